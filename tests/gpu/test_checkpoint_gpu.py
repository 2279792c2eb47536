"""The in-place checkpoint reader into GPU tensors: through its pinned staging buffers, in
chunks (a tensor bigger than two of them), equal to what torch's own reader loads."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tdmesh.worker.checkpoint_reader as reader

pytestmark = pytest.mark.gpu


def test_gpu_targets_load_through_the_staging_buffers_in_chunks(tmp_path):
    saved = {"big": torch.randn(5 * reader._STAGE // 4 // 2 + 3), "bf16": torch.randn(33, 7).bfloat16(),
             "scalar": torch.tensor(2.5)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(saved, checkpoint_id=str(tmp_path))
        ours = {k: torch.zeros_like(v, device="cuda") for k, v in saved.items()}
        theirs = {k: torch.zeros_like(v, device="cuda") for k, v in saved.items()}
        dcp.load(ours, storage_reader=reader.DirectReader(str(tmp_path)))
        dcp.load(theirs, storage_reader=dcp.FileSystemReader(str(tmp_path)))
    assert reader._stages and all(stage.is_pinned() for stage, _ in reader._stages)
    for k, v in saved.items():
        assert torch.equal(ours[k].cpu(), v) and torch.equal(theirs[k].cpu(), v), k

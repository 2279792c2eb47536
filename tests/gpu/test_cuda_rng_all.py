"""tdmesh.random's ``cuda_*_all_remote``: every CUDA generator of each GPU worker, as torch.cuda's ``*_all``.

Skipped without CUDA; run on a GPU host with `python -m pytest -q tests/gpu/test_cuda_rng_all.py`.
"""

import pytest
import torch

import tdmesh
from tdmesh import fetch_shard
from tdmesh import random as trandom

pytestmark = pytest.mark.gpu


def test_every_cuda_generator_is_seeded_saved_and_restored():
    n = min(torch.cuda.device_count(), 2)
    devices = torch.cuda.device_count()
    with tdmesh.local_mesh(hosts=1, gpus_per_host=n) as mesh, mesh.activate():
        trandom.cuda_manual_seed_all_remote(1234)
        seeded = trandom.cuda_get_rng_state_all_remote()
        a = torch.rand(4, device="cuda")
        b = torch.rand(4, device="cuda")
        advanced = trandom.cuda_get_rng_state_all_remote()
        trandom.cuda_set_rng_state_all_remote(seeded)
        c = torch.rand(4, device="cuda")
        per_rank = [fetch_shard((seeded, advanced, a, b, c), host=0, gpu=g).result() for g in range(n)]
    assert seeded.shape == (devices, 16) and seeded.dtype == torch.uint8 and seeded.device.type == "cuda"
    for g, (seeded_rows, advanced_rows, a, b, c) in enumerate(per_rank):
        assert all(torch.equal(row, seeded_rows[0]) for row in seeded_rows)  # one seed, every device
        assert not torch.equal(advanced_rows[g], seeded_rows[g])  # the worker's own GPU drew
        others = [i for i in range(devices) if i != g]
        assert all(torch.equal(advanced_rows[i], seeded_rows[i]) for i in others)
        assert torch.equal(a, c) and not torch.equal(a, b)
    assert all(torch.equal(per_rank[0][2], r[2]) for r in per_rank)  # the same seed: the same draws on every rank

"""Healing on one GPU (issue 54): a 1-worker CUDA mesh with a spare on the same GPU; the worker is SIGKILLed
in a step and the spare, with no replica to copy from, loads the step's start from FaultTolerance's
checkpoint: the job ends bit for bit as the job without the fault (dropout on the GPU, AdamW)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

import tdmesh

pytestmark = pytest.mark.gpu


@tdmesh.remote(propagate=lambda: None)
def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _job(folder: str, fault: bool):
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1, spares=1, pool=False) as mesh, mesh.activate():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Dropout(0.2), torch.nn.Linear(256, 8))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ft = tdmesh.FaultTolerance(mesh, {"model": model, "opt": opt}, checkpoint_dir=folder)

        def step(i: int):
            loss = model(torch.randn(32, 64)).pow(2).mean()
            loss.backward()
            if fault and i == 2 and not ft.heals:
                die()
            opt.step()
            opt.zero_grad()
            return loss

        losses = [tdmesh.fetch_shard(ft.step(step, i)).result().item() for i in range(5)]
        weights = tdmesh.fetch_shard(list(model.parameters())).result()
        assert mesh.device_type == "cuda" and len(ft.heals) == int(fault)
    return losses, weights


def test_a_one_gpu_mesh_heals_onto_a_spare_on_the_same_gpu(tmp_path):
    healed = _job(str(tmp_path / "healed"), True)
    plain = _job(str(tmp_path / "plain"), False)
    assert healed[0] == plain[0]
    assert all(torch.equal(a, b) for a, b in zip(healed[1], plain[1], strict=True))

"""GPU workers: NCCL process groups, tensors on cuda:LOCAL_RANK, fetches come back on CPU.

Skipped without CUDA; run on a GPU host with `python -m pytest -q -m gpu tests/test_gpu.py`.
"""

import os
import subprocess
import sys

import pytest
import torch

import tdmesh

pytestmark = pytest.mark.gpu
SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "torchrun_job.py")


def device_of(x):
    return str(x.device)


@pytest.fixture(scope="module")
def gpu_mesh():
    n = min(torch.cuda.device_count(), 2)
    with tdmesh.local_mesh(hosts=1, gpus_per_host=n) as mesh:
        yield mesh


def test_workers_use_nccl_and_their_own_gpu(gpu_mesh):
    import torch.distributed as dist
    backend = tdmesh.remote("torch.distributed.get_backend")
    where = tdmesh.remote(device_of)
    with gpu_mesh.activate():
        x = torch.ones(4)
        assert x.device.type == "cuda"
        last = gpu_mesh.size("gpu") - 1
        assert tdmesh.call_on_shard_and_fetch(backend, shard={"host": 0, "gpu": 0}).result() == "nccl"
        assert tdmesh.call_on_shard_and_fetch(where, x, shard={"host": 0, "gpu": last}).result() == f"cuda:{last}"
        y = (x * (gpu_mesh.rank("gpu") + 1)).sum()
        value = tdmesh.fetch_shard(y, host=0, gpu=last).result()
    assert value.device.type == "cpu" and float(value) == 4.0 * (last + 1)


def test_autograd_on_gpu_workers(gpu_mesh):
    with gpu_mesh.activate():
        w = torch.full((3,), 2.0).requires_grad_()
        (w * w).sum().backward()
        grad = tdmesh.fetch_shard(w.grad).result()
    assert grad.device.type == "cpu" and torch.equal(grad, torch.full((3,), 4.0))


def test_torchrun_on_gpus():
    n = min(torch.cuda.device_count(), 2)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                          str(n), "-m", "tdmesh.worker", SCRIPT, "ok"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"last rank value [{float(n)}, {float(n)}]" in out.stdout

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


# ----------------------------------------------------------------------------- collectives on NCCL
_EVENTS = {}


def record(name, x):
    """On a worker: record a CUDA event named ``name`` on the current stream."""
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    _EVENTS[name] = ev
    return x


def intervals(names):
    """On a worker: each event's time in ms after the first one, once all have happened."""
    torch.cuda.synchronize()
    base = _EVENTS[names[0]]
    return [base.elapsed_time(_EVENTS[n]) for n in names]


def matmuls(a, n):
    for _ in range(n):
        a = a @ a
        a = a / a.norm()
    return a


def test_reduce_stack_scatter_and_to_mesh_on_nccl(gpu_mesh):
    n = gpu_mesh.size("gpu")
    if n < 2:
        pytest.skip("needs 2 GPUs")
    with gpu_mesh.activate():
        x = torch.arange(4.0) + 10 * gpu_mesh.rank("gpu")
        total = x.reduce("gpu")
        stacked = x.reduce("gpu", "stack")
        bits = (torch.tensor([6, 3]) + gpu_mesh.rank("gpu")).reduce("gpu", "band")
        rs = torch.ones(n, 3).reduce("gpu", "sum", scatter=True)
        moved = x.slice_mesh(gpu=0).to_mesh(gpu_mesh.slice(gpu=1))
        got = tdmesh.fetch_shard((total, stacked, bits, rs), host=0, gpu=1).result()
        moved_value = tdmesh.fetch_shard(moved, host=0).result()
    assert torch.equal(got[0], torch.arange(4.0) * 2 + 10)
    assert torch.equal(got[1], torch.stack([torch.arange(4.0), torch.arange(4.0) + 10]))
    assert torch.equal(got[2], torch.tensor([6 & 7, 3 & 4]))
    assert torch.equal(got[3], torch.full((3,), 2.0))
    assert torch.equal(moved_value, torch.arange(4.0))


def test_remote_process_group_all_reduce_on_nccl(gpu_mesh):
    def all_reduce(t, pg):
        import torch.distributed as dist
        dist.all_reduce(t, group=pg)
        return t
    f = tdmesh.remote(all_reduce, propagate=lambda t, pg: t)
    pg = gpu_mesh.process_group("gpu")
    with gpu_mesh.activate():
        v = f(torch.ones(2) * (gpu_mesh.rank("gpu") + 1), pg)
        got = tdmesh.fetch_shard(v).result()
    n = gpu_mesh.size("gpu")
    assert torch.equal(got, torch.full((2,), float(n * (n + 1) // 2)))


def test_borrow_across_cuda_streams(gpu_mesh):
    other = tdmesh.Stream("other")
    with gpu_mesh.activate():
        a = torch.ones(1024, 1024)
        b, borrow = other.borrow(a, mutable=True)
        with other.activate():
            b.mul_(3)
        borrow.drop()
        a.add_(1)
        got = tdmesh.fetch_shard(a.sum()).result()
    assert float(got) == 4.0 * 1024 * 1024


def test_communication_and_compute_overlap_on_two_streams(gpu_mesh):
    """Events on the two CUDA streams show the all-reduce running while the matmuls run."""
    if gpu_mesh.size("gpu") < 2:
        pytest.skip("needs 2 GPUs")
    comm = tdmesh.Stream("comm")
    mark = tdmesh.remote(record, propagate=lambda name, x: x)
    work = tdmesh.remote(matmuls, propagate=lambda a, n: a)
    with gpu_mesh.activate():
        big = torch.ones(64 << 20)                       # 256 MiB to reduce
        a = torch.randn(4096, 4096)
        with comm.activate():
            g, borrow = comm.borrow(big, mutable=True)
        mark("compute_start", a)
        with comm.activate():
            mark("comm_start", g)
            for _ in range(4):
                g.reduce_("gpu")
            mark("comm_end", g)
        out = work(a, 40)
        mark("compute_end", out)
        borrow.drop()
        times = tdmesh.call_on_shard_and_fetch(tdmesh.remote(intervals),
                                               ["compute_start", "comm_start", "comm_end", "compute_end"]).result()
    compute_start, comm_start, comm_end, compute_end = times
    # the two intervals overlap: communication started before compute ended and ended after it started
    assert comm_start < compute_end and comm_end > compute_start, times
    overlap = min(comm_end, compute_end) - max(comm_start, compute_start)
    assert overlap > 0.25 * min(comm_end - comm_start, compute_end - compute_start), times

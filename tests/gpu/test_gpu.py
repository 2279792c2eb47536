"""GPU workers: NCCL process groups, tensors on cuda:LOCAL_RANK, fetches come back on CPU.

Skipped without CUDA; run on a GPU host with `python -m pytest -q -m gpu tests/gpu/test_gpu.py`.
"""

import contextlib
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

import tdmesh

from paths import REPO, SCRIPTS

sys.path.insert(0, os.path.join(REPO, "tests", "fleet"))
from opinfo_conformance import conformance, summary  # noqa: E402

pytestmark = pytest.mark.gpu
SCRIPT = os.path.join(SCRIPTS, "torchrun_job.py")


def device_of(x):
    return str(x.device)


@pytest.fixture(scope="module")
def gpu_mesh():
    n = min(torch.cuda.device_count(), 2)
    with tdmesh.local_mesh(hosts=1, gpus_per_host=n) as mesh:
        yield mesh


def test_workers_use_nccl_and_their_own_gpu(gpu_mesh):
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


def test_a_cuda_workers_backward_is_one_message_with_the_gradients_of_the_clients_engine(gpu_mesh, monkeypatch):
    """The workers run backward on their own autograd (CUDA streams and the engine's device thread
    there): one message, new gradients on the GPU, within float tolerance of the client's engine."""
    from tdmesh.engine.backward import COUNTS

    def grads():
        tdmesh.random.set_manual_seed_remote(0)  # the workers' generators make the weights and the batch
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                    torch.nn.Linear(32, 4))
        x = torch.randn(8, 16)
        loss = model(x).square().mean()
        before, first = dict(COUNTS), gpu_mesh.client.last_seq
        loss.backward()
        sent = gpu_mesh.client.last_seq - first
        assert all(p.grad.device.type == "cuda" for p in model.parameters())
        where = (COUNTS["workers"] - before["workers"], COUNTS["client"] - before["client"])
        return tdmesh.fetch_shard([p.grad for p in model.parameters()]).result(), where, sent

    with gpu_mesh.activate():
        on_workers, where, sent = grads()
        assert where == (1, 0) and sent == 1
        monkeypatch.setenv("TDMESH_BACKWARD", "client")
        on_client, where, sent = grads()
        assert where == (0, 1) and sent > 10
    for a, b in zip(on_workers, on_client):
        torch.testing.assert_close(a, b)


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


# ----------------------------------------------------------------------------- the error contract on CUDA
@pytest.mark.parametrize("launch_blocking", [False, True], ids=["async", "CUDA_LAUNCH_BLOCKING"])
def test_sticky_cuda_error_ends_the_worker_with_a_device_exception(monkeypatch, launch_blocking):
    """An out-of-range index_select trips a device-side assert: the worker's CUDA context is
    unusable, so it reports a DeviceException (op, user's line, rank, host) and leaves non-zero."""
    if launch_blocking:  # the workers inherit it: the faulting op itself reports the error
        monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1) as mesh:  # a fleet of its own: it breaks
        pid = mesh.client.hellos[0].pid
        with mesh.activate():
            x = torch.arange(4.0)
            line = sys._getframe().f_lineno + 1
            bad = x.index_select(0, torch.tensor([7]))
            fetch_line = sys._getframe().f_lineno + 2
            with pytest.raises(tdmesh.DeviceException) as err:
                tdmesh.inspect(bad)
            with pytest.raises(tdmesh.DeviceException):
                torch.ones(1) + 1  # the mesh stays failed
        result = None
        deadline = time.monotonic() + 10
        while result is None and time.monotonic() < deadline:
            result = mesh.fleet.processes.wait(timeout=0)
            time.sleep(0.05)
    text = str(err.value)
    assert "device-side assert" in text, text
    assert f"worker rank 0 (host {socket.gethostname()}, pid {pid})" in text, text
    assert f'File "{__file__}", line {line if launch_blocking else fetch_line}' in text, text
    if launch_blocking:
        assert "index_select" in text, text
    assert result is not None and result.failures[0].exitcode not in (0, None), result  # left by itself


NO_MESH_SCRIPT = """
import os, subprocess, torch, tdmesh
with tdmesh.local_mesh(hosts=1, gpus_per_host=1) as mesh, mesh.activate():
    remote_ones = torch.ones(2)
    with tdmesh.no_mesh.activate():
        local = torch.ones(2) * 3
    print("devices", remote_ones.device.type, local.device.type, flush=True)
    print("value", tdmesh.inspect(remote_ones).tolist(), local.tolist(), flush=True)
    # A process with a CUDA context is a compute app of the GPU (torch's lazy init is not one)
    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                          capture_output=True, text=True, check=True).stdout.split()
    print("worker has a context", str(mesh.client.hellos[0].pid) in apps, flush=True)
    print("client has a context", str(os.getpid()) in apps, flush=True)
"""


def test_no_mesh_inside_a_gpu_mesh_stays_on_the_clients_device(tmp_path):
    script = tmp_path / "no_mesh.py"
    script.write_text(NO_MESH_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                         env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "devices cuda cpu" in out.stdout
    assert "value [1.0, 1.0] [3.0, 3.0]" in out.stdout
    assert "worker has a context True" in out.stdout  # the probe can see contexts
    assert "client has a context False" in out.stdout


# ----------------------------------------------------------------------------- OpInfo on CUDA workers
CUDA_KNOWN_FAILURES = {
    "resize_": "growing a CUDA proxy in place: torch's resize_ kernel asserts a meta tensor when it updates the "
               "proxy, so tdmesh refuses it (a clear error, before anything is sent)",
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_opinfo_samples_match_local_torch_on_cuda_workers(dtype, capsys):
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1) as mesh:
        outcomes = conformance(mesh, "cuda", dtype)
    with capsys.disabled():
        print(f"\nOpInfo conformance, cuda {dtype}: {summary(outcomes)}")
    new = sorted({f"{o.op}[{o.sample}]: {o.error}" for o in outcomes if o.error and o.op not in CUDA_KNOWN_FAILURES})
    assert not new, "ops that fail on CUDA workers and not locally:\n" + "\n".join(new)


def test_resize_of_a_cuda_proxy_is_refused_before_anything_is_sent():
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1) as mesh, mesh.activate():
        x = torch.arange(4.0)
        with pytest.raises(NotImplementedError, match=r"resize_.*nothing was sent.*new_empty") as err:
            x.resize_(3, 3)
        assert "test_gpu.py" in str(err.value)
        assert x.shape == (4,) and tdmesh.fetch_shard(x * 2).result().tolist() == [0.0, 2.0, 4.0, 6.0]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_eigenvalues_of_a_column_major_matrix_on_a_cuda_worker_are_local_torchs(compiled):
    """torch 2.11's CUDA linalg_eig gave other eigenvalues, silently, for a column-major input made on
    a stream other than the default one (one H200; from then on on any stream): a worker runs it on
    its device's default stream (worker/ops.py).  Eager ops and compiled programs both."""
    torch.manual_seed(0)
    x = torch.randn(5, 5)
    want = torch.linalg.eigvals(x)

    def eigenvalues(t):
        return torch.linalg.eigvals(t.t().contiguous().t() * 1.0)

    with tdmesh.local_mesh(hosts=1, gpus_per_host=1) as mesh, mesh.activate():
        fn = tdmesh.compile(eigenvalues) if compiled else eigenvalues
        remote = tdmesh.to_mesh(x, mesh)
        for _ in range(3):
            got = tdmesh.fetch_shard(fn(remote)).result().cpu()
            assert torch.allclose(got, want, atol=1e-4), (got, want)


def test_view_copy_of_a_transposed_cuda_tensor_runs_as_locally():
    """torch's meta ``view_copy`` refuses an input a view cannot reshape; CUDA's kernel copies it.
    A CUDA mesh propagates on the meta device, so the workers' kernel decides (one round trip)."""
    local = torch.arange(24.0, device="cuda").reshape(4, 6).t()
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1) as mesh, mesh.activate():
        x = torch.arange(24.0).reshape(4, 6).t()
        y = torch.ops.aten.view_copy(x, (4, 6))
        assert y.shape == (4, 6) and y.stride() == (6, 1)
        assert torch.equal(tdmesh.fetch_shard(y).result().cuda(), torch.ops.aten.view_copy(local, (4, 6)))


@pytest.mark.parametrize("flags", [{}, {"capturable": True}, {"fused": True}], ids=["default", "capturable", "fused"])
def test_adamw_on_a_cuda_mesh_takes_torchs_fast_paths(flags):
    """On CUDA, AdamW defaults to foreach for remote parameters as for plain CUDA tensors;
    with capturable=True or fused=True a step is a few remote ops whatever the number of
    parameters, and the parameters end where local CUDA's do."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    def run(params):
        opt = torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, **flags)
        for q in params:
            q.grad = torch.full_like(q, 0.5)
        opt.step()
        return opt

    with tdmesh.local_mesh(hosts=1, gpus_per_host=1) as mesh:
        counts = []
        for n in (2, 12):
            with mesh.activate():
                params = [torch.ones(8).requires_grad_() for _ in range(n)]
                assert _default_to_fused_or_foreach(params, False, False) == (False, True)
                opt = run(params)
                before = mesh.client.last_seq
                opt.step()
                counts.append(mesh.client.last_seq - before)
                got = tdmesh.fetch_shard([q.detach() for q in params]).result()
        local = [torch.ones(8, device="cuda").requires_grad_() for _ in range(12)]
        run(local).step()
    if flags:
        assert counts[0] == counts[1] <= 24, counts  # capturable foreach AdamW: 18 foreach ops on H200
    for g, expected in zip(got, local):
        torch.testing.assert_close(g, expected.detach().cpu())


def test_the_ops_autograds_device_thread_runs_name_the_backward_call(gpu_mesh, monkeypatch):
    """On a CUDA mesh autograd runs backward's ops on its device thread, where no user frame is
    found: they are recorded at the line of the backward call that started them (they had no site).
    The client's engine runs them (with the workers running backward it is one op, at that line)."""
    import inspect as pyinspect

    monkeypatch.setenv("TDMESH_BACKWARD", "client")

    from _sites import recorded_sites
    with gpu_mesh.activate():
        w = torch.ones(3, requires_grad=True)
        loss = (w * 2).sin().sum()
        with recorded_sites(gpu_mesh.client) as sites:
            line = pyinspect.currentframe().f_lineno + 1
            loss.backward()
        got = tdmesh.fetch_shard(w.grad).result()
    assert len(sites) >= 3 and all(f"line {line}" in s and os.path.basename(__file__) in s for s in sites), sites
    assert torch.allclose(got.cpu(), 2 * torch.cos(torch.full((3,), 2.0)))


@pytest.mark.parametrize("side_stream", [False, True])
def test_a_factory_on_autograds_device_thread_runs_on_the_backward_calls_mesh_and_stream(gpu_mesh, side_stream):
    """A tensor hook (so the client's engine runs the backward, on autograd's CUDA device thread, whose
    Python context has no mesh) makes a tensor with a factory: it is made on the mesh and stream of the
    backward call, as on the calling thread for CPU tensors, and the gradient is local torch's."""
    stream = tdmesh.Stream("side") if side_stream else None
    with gpu_mesh.activate(), (stream.activate() if stream else contextlib.nullcontext()):
        w = torch.full((3,), 2.0, requires_grad=True)
        w.register_hook(lambda g: g + torch.ones(3, device="cuda"))  # local torch needs the device named there
        (w * w).sum().backward()
        got = tdmesh.fetch_shard(w.grad).result()
    assert torch.equal(got.cpu(), torch.full((3,), 5.0))

"""Compiled functions as worker programs, on real workers: a compiled training step (forward,
backward, bucketed reduce, foreach SGD with momentum) gives the losses of the same steps run eagerly, bit
for bit on CPU, whether each rank runs it as a program or message by message."""

import shutil

import pytest
import torch
from _training import data_parallel_step

import tdmesh
from tdmesh import fetch_shard, remote

recording_modes = remote("tdmesh.worker.builtins.recording_modes")


def _train(mesh, steps: int, backend: str | None) -> list[float]:
    """``steps`` training steps of a small MLP from seed 0, eager (backend None) or compiled."""
    with mesh.activate():
        tdmesh.random.set_manual_seed_remote(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
        rank = mesh.rank(mesh.names).float()
        batches = [(torch.randn(8, 6) + rank, (torch.arange(8) + i) % 3) for i in range(steps)]

        step = data_parallel_step(model, opt, mesh)

        for x, y in batches[:2]:  # creates the gradients and the optimizer's state
            step(x, y)
        run = step if backend is None else tdmesh.compile(step, backend=backend)
        losses = [run(x, y) for x, y in batches[2:]]
        return [float(fetch_shard(loss).result()) for loss in losses]


def test_compiled_training_steps_give_the_eager_losses_exactly(mesh2x2):
    eager = _train(mesh2x2, 22, None)
    program = _train(mesh2x2, 22, "program")
    with mesh2x2.activate():
        modes = tdmesh.call_on_shard_and_fetch(recording_modes).result()
    assert list(modes.values())[-1] == "program"
    messages = _train(mesh2x2, 22, "messages")
    with mesh2x2.activate():
        modes = tdmesh.call_on_shard_and_fetch(recording_modes).result()
    assert list(modes.values())[-1] == "messages: compiled with backend='messages'"
    assert program == eager and messages == eager
    assert eager[-1] < eager[0]  # it trains


def test_an_error_inside_a_program_fails_the_calls_outputs_and_later_calls_run(mesh1):
    with mesh1.activate():
        @tdmesh.compile
        def fn(x, d):
            bad = x // d  # integer division by zero: raises on the worker only
            return bad + 1, x * 2

        x = torch.arange(4)
        ok = [fn(x, torch.ones(4, dtype=torch.int64)) for _ in range(3)]
        failed = fn(x, torch.zeros(4, dtype=torch.int64))
        after = fn(x, torch.full((4,), 2, dtype=torch.int64))
        with pytest.raises(tdmesh.RemoteException, match="ZeroDivisionError"):
            fetch_shard(failed[0]).result()
        with pytest.raises(tdmesh.RemoteException, match="ZeroDivisionError"):  # one op to the client: all fail
            fetch_shard(failed[1]).result()
        assert torch.equal(fetch_shard(ok[2][0]).result(), x + 1)
        assert torch.equal(fetch_shard(after[0]).result(), x // 2 + 1)


def test_an_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        tdmesh.compile(lambda x: x, backend="fast")


def test_a_captured_tensor_that_changes_shape_between_calls_is_traced_again(mesh1):
    with mesh1.activate():
        w = torch.arange(6.0).view(2, 3)

        @tdmesh.compile
        def fn(x):
            return x + w.sum(0)

        x = torch.zeros(1)
        fn(x), fn(x)
        w.t_()  # in place: w is now 3 x 2, and w.sum(0) has 2 elements
        got = fn(x)
        assert fn.traces == 2 and got.shape == (2,)
        assert torch.equal(fetch_shard(got).result(), torch.tensor([3.0, 12.0]))
        w.mul_(10)  # a value change only: the recording reads w where it is
        assert torch.equal(fetch_shard(fn(x)).result(), torch.tensor([30.0, 120.0]))
        assert fn.traces == 2


def test_cuda_graph_true_needs_a_cuda_mesh_and_a_program(mesh1):
    with pytest.raises(ValueError, match="cuda_graph=True needs backend='program'"):
        tdmesh.compile(lambda x: x, backend="messages", cuda_graph=True)
    with mesh1.activate():
        fn = tdmesh.compile(lambda x: x * 2, cuda_graph=True)
        with pytest.raises(tdmesh.errors.UsageError, match=r"needs a CUDA mesh; this one is on cpu\n  at .*test_prog"):
            fn(torch.ones(2))
        auto = tdmesh.compile(lambda x: x * 2)  # the default: a program, silently, on CPU meshes
        assert torch.equal(fetch_shard(auto(torch.ones(2))).result(), torch.full((2,), 2.0))


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor's CPU kernels need a C++ compiler")
def test_inductor_compiles_each_workers_program_and_an_error_fails_the_whole_call(mesh1):
    """A Cholesky factorisation of a matrix that is not positive-definite (inductor calls aten's
    kernel, which raises).  Not an error inside a generated CPU kernel: torch 2.11's die of
    SIGFPE on an integer division by zero and of SIGSEGV on an index out of bounds."""
    with mesh1.activate():
        @tdmesh.compile(backend="inductor")
        def fn(a):
            return torch.linalg.cholesky(a * 2) + 1, a * 3

        a = torch.eye(3)
        ok = fn(a)  # compiles on the worker (seconds, once)
        bad = fn(-a)
        again = fn(a * 8)
        modes = tdmesh.call_on_shard_and_fetch(recording_modes).result()
        assert modes[fn.recording_id] == "inductor" and fn.mode == "inductor"
        assert torch.allclose(fetch_shard(ok[0]).result(), torch.eye(3) * 2 ** 0.5 + 1)
        for out in bad:  # one fused call: all of its outputs fail together
            with pytest.raises(tdmesh.RemoteException, match="positive-definite"):
                fetch_shard(out).result()
        assert torch.allclose(fetch_shard(again[0]).result(), torch.eye(3) * 4 + 1)
        assert torch.equal(fetch_shard(again[1]).result(), a * 24)


def inductor_cache_counts() -> tuple[int, int]:
    """This worker's (FX graph cache misses, hits): runs on the workers."""
    from torch._dynamo.utils import counters
    return counters["inductor"]["fxgraph_cache_miss"], counters["inductor"]["fxgraph_cache_hit"]


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor's CPU kernels need a C++ compiler")
def test_the_ranks_of_a_host_compile_each_inductor_graph_once_and_meet_in_collectives(tmp_path, monkeypatch):
    """Two ranks of one host, a reduce between two compiled graphs, an empty inductor cache:
    each graph is compiled by one rank (a cache miss) while the other waits on the host lock
    and loads it (a hit), so 2 misses and 2 hits.  A rank holds the lock only while it compiles
    a graph, never in the collective between them (holding it there would hang both ranks)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2, pool=False) as mesh, mesh.activate():
        @tdmesh.compile(backend="inductor")
        def fn(x):
            y = (x * 3 + 1).sin()
            y.reduce_("gpu", "sum")
            return y.cos() * 2

        x = torch.ones(4, 4) * mesh.rank("gpu")
        out = fn(x)
        got = tdmesh.fetch_all(out).result()
        counts = tdmesh.remote(inductor_cache_counts).call().result()
    both = sum((torch.ones(4, 4) * g * 3 + 1).sin() for g in range(2))
    for _, value in got:
        assert torch.allclose(value, both.cos() * 2)
    misses = sum(c[0] for _, c in counts)
    hits = sum(c[1] for _, c in counts)
    assert (misses, hits) == (2, 2), list(counts)


def test_a_failed_write_to_a_captured_tensor_fails_its_later_reads_on_the_client(mesh1):
    """A captured tensor the function writes in place (a parameter an optimizer updates) is a
    capture that the call mutates, not a ref the recording defines: the client keeps it alive
    and a failed write fails what reads it later with the remote error."""
    with mesh1.activate():
        w = torch.zeros(4, dtype=torch.int64)

        @tdmesh.compile
        def update(x, d):
            w.add_(x // d)  # integer division by zero raises on the worker
            return x + 1

        x = torch.arange(4)
        update(x, torch.ones(4, dtype=torch.int64))
        update(x, torch.ones(4, dtype=torch.int64))
        assert torch.equal(fetch_shard(w).result(), 2 * x)
        update(x, torch.zeros(4, dtype=torch.int64))
        with pytest.raises(tdmesh.RemoteException, match="ZeroDivisionError"):
            fetch_shard(w * 1).result()


def test_a_local_tensor_shipped_inside_is_a_fresh_copy_every_call(mesh1):
    """A program makes a local tensor of the function (``torch.tensor(...)``) on the device once and
    copies it each call (no host-to-device copy, which a CUDA graph cannot capture): a call that
    writes the copy in place leaves the next call's copy as the bytes the client sent."""
    with tdmesh.no_mesh.activate():
        local = torch.tensor([1.0, 2.0])
    with mesh1.activate():
        @tdmesh.compile
        def fn(x):
            t = torch.tensor(local)
            t.add_(x)  # written in place: the next call's copy must not see it
            return torch.cat([t, torch.tensor([10.0])]), t

        outs = [fn(torch.full((2,), float(i))) for i in range(5)]
        got = [(fetch_shard(a).result(), fetch_shard(b).result()) for a, b in outs]
        modes = tdmesh.call_on_shard_and_fetch(recording_modes).result()
    assert list(modes.values())[-1] == "program"
    for i, (a, b) in enumerate(got):
        assert torch.equal(b, torch.tensor([1.0 + i, 2.0 + i]))
        assert torch.equal(a, torch.tensor([1.0 + i, 2.0 + i, 10.0]))


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor's CPU kernels need a C++ compiler")
def test_inductor_options_reach_the_workers_compile(mesh1, tmp_path):
    """``options=`` are inductor's config for the workers' compiles, as torch.compile takes them: here its
    trace, which the worker's compile writes (the generated code among it) where the option says."""
    with mesh1.activate():
        @tdmesh.compile(backend="inductor", options={"trace.enabled": True, "trace.debug_dir": str(tmp_path),
                                                     "fx_graph_cache": False})  # a cache hit writes no trace
        def fn(x):
            return (x * 3 + 1).sin()

        @tdmesh.compile(backend="inductor")
        def plain(x):
            return (x * 5 + 1).cos()

        x = torch.arange(4.0)
        out, other = fn(x), plain(x)
        assert torch.allclose(fetch_shard(out).result(), (x * 3 + 1).sin())
        assert torch.allclose(fetch_shard(other).result(), (x * 5 + 1).cos())
    written = [p for p in tmp_path.rglob("output_code.py")]
    assert len(written) == 1, list(tmp_path.rglob("*"))  # fn's graph; plain's compile kept inductor's defaults
    assert "sin" in written[0].read_text()

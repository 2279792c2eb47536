"""Monarch's tensor-engine names and semantics that its own tests use, on tdmesh (issue 57).

Each test writes what a Monarch user's code does, under Monarch's spelling, and checks the value it gives
against local torch or the plain tdmesh spelling: a remote function's non-tensor results (the first rank's
value, cached with the call as Monarch's cached propagation keeps it), ``log_remote`` and
``set_logging_level_remote`` (checked in each worker's log file, where Monarch's own tests assert nothing),
``Future.get``, ``mesh(**dims)``, ``RemoteException.worker_error_string``, the seeding builtins, and a remote
name without a dot, refused at the call instead of at the definition (a module that only defines one imports).
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tdmesh
from tdmesh.builtins import log_remote, set_logging_level_remote
from tdmesh.builtins import random as mrandom

PANIC = tdmesh.remote("__test_panic", propagate="inspect")  # defined at import, as Monarch's test module does


@pytest.fixture(scope="module")
def mesh():
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as m:
        yield m


@tdmesh.remote
def seven():
    return 7


@tdmesh.remote
def mixed(x, tag):
    return x * 2, len(tag), tag.upper(), None


@tdmesh.remote
def a_lock():
    return threading.Lock()


def test_a_remote_function_may_return_values_that_are_not_tensors(mesh):
    """Monarch's ``close()`` returning 7: the client gets 7 (the first rank's value); tensors beside values are
    mesh tensors as ever; ``call_on_shard_and_fetch`` and ``.call()`` bring the values of any rank."""
    with mesh.activate():
        assert seven() == 7
        assert seven() == 7 and seven.cache_hits >= 1  # cached with the call, as Monarch's propagation is
        x = torch.ones(3) * (mesh.rank("gpu") + 1)
        doubled, n, upper, none = mixed(x, "abc")
        assert (n, upper, none) == (3, "ABC", None)
        for g in range(2):
            assert tdmesh.fetch_shard(doubled, host=0, gpu=g).result().tolist() == [2.0 * (g + 1)] * 3
        assert tdmesh.call_on_shard_and_fetch(seven, shard={"host": 0, "gpu": 1}).result() == 7
        assert [v for _, v in seven.call().get()] == [7, 7]


def test_a_result_that_does_not_pickle_is_refused_at_the_call(mesh):
    with mesh.activate():
        with pytest.raises(tdmesh.RemoteException, match="does not pickle"):
            a_lock()


@tdmesh.remote(propagate="inspect")
def add_log_file(path: str) -> None:
    """On each worker: ``log_remote``'s logger also writes to ``path.<rank>``."""
    handler = logging.FileHandler(f"{path}.{torch.distributed.get_rank()}")
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    handler.set_name("tdmesh-test")
    logger = logging.getLogger("tdmesh.builtins.log")
    logger.addHandler(handler)
    logger.propagate = False  # the test's file only: not the launcher's terminal


@tdmesh.remote
def read_log_file(path: str) -> str:
    logger = logging.getLogger("tdmesh.builtins.log")
    for h in list(logger.handlers):
        if h.get_name() == "tdmesh-test":
            h.flush()
            logger.removeHandler(h)
            h.close()
    logger.propagate = True
    with open(f"{path}.{torch.distributed.get_rank()}") as f:
        return f.read()


def test_log_remote_logs_on_every_rank_at_its_level(mesh, tmp_path):
    path = str(tmp_path / "log")
    with mesh.activate():
        add_log_file(path)
        x = torch.full((2,), 1.0) + mesh.rank("gpu")
        set_logging_level_remote(logging.INFO)
        assert log_remote("%s and %d", "str", 42) is None  # WARNING by default
        log_remote("rank value %s", x, level=logging.INFO)
        log_remote("not shown: %d", 1, level=logging.DEBUG)
        set_logging_level_remote(logging.ERROR)
        log_remote("filtered", level=logging.WARNING)
        log_remote("kept", level=logging.ERROR)
        logs = list(read_log_file.call(path).get())
    assert len(logs) == 2
    for point, text in logs:
        g = point["gpu"]
        local = torch.full((2,), 1.0 + g)  # what the rank holds, as torch prints it
        assert text.splitlines() == ["WARNING str and 42", f"INFO rank value {local}", "ERROR kept"], text


def test_future_get_is_result(mesh):
    with mesh.activate():
        t = torch.arange(3.0) + mesh.rank("gpu")
        assert tdmesh.fetch_shard(t, host=0, gpu=1).get().tolist() == [1.0, 2.0, 3.0]
        with pytest.raises(TimeoutError):
            tdmesh.Future.get(_never(), timeout=0.01)


def _never() -> tdmesh.Future:
    class Never(tdmesh.Future):
        def __init__(self):
            pass

        def result(self, timeout=None):
            raise TimeoutError("never")
    return Never()


def test_mesh_call_is_monarchs_spelling_of_slice(mesh):
    with pytest.warns(DeprecationWarning, match="mesh.slice"):
        sub = mesh(gpu=1)
    assert sub.rank_list == mesh.slice(gpu=1).rank_list and sub.names == ("host",)


def inner_fails(x):
    raise ValueError("inner went wrong")


def outer_calls(x):
    inner_fails(x)
    return x


def test_worker_error_string_holds_the_workers_traceback(mesh):
    with mesh.activate():
        y = tdmesh.remote(outer_calls, propagate=lambda x: x)(torch.ones(2))
        with pytest.raises(tdmesh.RemoteException) as info:
            tdmesh.fetch_shard(y).result()
    e = info.value
    assert "outer_calls" in e.worker_error_string and "inner_fails" in e.worker_error_string
    assert "ValueError: inner went wrong" in e.worker_error_string
    assert e.controller_frames == e.call_site and e.controller_frames


@settings(max_examples=10, deadline=None, database=None)
@given(seed=st.integers(0, 2**31), idx=st.integers(0, 3))
def test_monarchs_seeding_names_seed_as_torch_does(mesh, seed, idx):
    with mesh.activate():
        mrandom.set_manual_seed_remote(seed, idx)
        a = torch.rand(4)
        mrandom.set_manual_seed_remote(seed, idx)
        state = mrandom.get_rng_state_remote()
        b = torch.rand(4)
        mrandom.set_rng_state_remote(state)
        c = torch.rand(4)
        mrandom.manual_seed_cuda_remote(seed)  # CPU workers: nothing to seed, as torch.cuda.manual_seed there
        mrandom.manual_seed_all_cuda_remote(seed)
        states = mrandom.get_rng_state_all_cuda_remote()
        mrandom.set_rng_state_all_cuda_remote(states)
        got = [tdmesh.fetch_shard((a, b, c), host=0, gpu=g).result() for g in range(2)]
    want = torch.rand(4, generator=torch.Generator().manual_seed(seed ^ idx))
    assert states == []  # one state a CUDA device: none on CPU workers
    for a_, b_, c_ in got:
        assert torch.equal(a_, want) and torch.equal(b_, want) and torch.equal(c_, want)


def test_a_remote_name_without_a_dot_is_refused_where_it_is_called(mesh):
    with mesh.activate(), pytest.raises(ValueError, match="dotted import path") as info:
        PANIC()
    assert "test_monarch_names.py" in str(info.value)  # the user's line


class WorkerFoo:
    """The worker's object of Monarch's ``test_opaque_object``: ``add(b)`` is ``v + b``."""

    def __init__(self, v: float) -> None:
        self.v = v

    def add(self, b):
        return torch.full((), self.v) + b

    def scaled(self, b, k):
        return b * k


class Foo(tdmesh.OpaqueObject):
    @tdmesh.opaque_method
    def add(self, x):
        return x + x  # the propagator: shapes the result on the client


@tdmesh.remote
def value_of(obj, x):
    return obj.value.add(x) * 10


LIVE_REFS = tdmesh.remote("tdmesh.worker.builtins.live_refs")


def test_opaque_objects_live_on_every_rank_and_answer_through_their_methods(mesh):
    with mesh.activate():
        f = Foo(WorkerFoo, 4.0)
        x = torch.ones(3, 4) + mesh.rank("gpu")
        got = f.add(x)
        assert isinstance(got, tdmesh.Tensor) and got.shape == (3, 4)
        scaled = f.call_method("scaled", lambda self, b, k: b.clone(), x, 3)
        by_value = f.call_method_on_shard_and_fetch("add", torch.zeros(2), shard={"host": 0, "gpu": 1})
        through = value_of(f, x)
        f.hi = 4  # an attribute of the client's object: stays there
        for g in range(2):
            a, s, t = tdmesh.fetch_shard((got, scaled, through), host=0, gpu=g).result()
            assert torch.equal(a, torch.full((3, 4), 5.0 + g)) and torch.equal(s, torch.full((3, 4), 3.0 * (1 + g)))
            assert torch.equal(t, torch.full((3, 4), 50.0 + 10 * g))
        assert torch.equal(by_value.result(), torch.full((2,), 4.0)) and f.hi == 4
        by_path = tdmesh.OpaqueObject("collections.Counter", "aab")  # an import path, as Monarch's tests name them
        assert by_path.handle.call_one("most_common", 1).result() == [("a", 2)]


def test_an_opaque_object_is_freed_when_the_client_lets_it_go(mesh):
    import gc
    with mesh.activate():
        gc.collect()
        LIVE_REFS.call().get()
        before = [n for _, n in LIVE_REFS.call().get()]
        f = tdmesh.OpaqueObject(WorkerFoo, 1.0)
        assert [n for _, n in LIVE_REFS.call().get()] == [n + 1 for n in before]
        del f
        gc.collect()
        assert [n for _, n in LIVE_REFS.call().get()] == before


class Twice(torch.autograd.Function):
    """Monarch's ``test_remote_autograd_function`` class: a branch on requires_grad, a non-tensor output."""

    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x)
        ctx.scale = 2.0
        return (x * y if x.requires_grad else x + y), y, torch.ones(4), 4

    @staticmethod
    def backward(ctx, dx1, dx2, dx3, dx4):
        (x,) = ctx.saved_tensors
        return dx1 * ctx.scale * x, dx1 + dx2


RemoteTwice = tdmesh.remote_autograd_function(Twice)


@settings(max_examples=8, deadline=None, database=None)
@given(xv=st.floats(-3, 3), yv=st.floats(-3, 3), x_grad=st.booleans())
def test_remote_autograd_function_equals_the_function_run_locally(mesh, xv, yv, x_grad):
    """Forward and backward run on the workers; outputs, the non-tensor output and the gradients equal the same
    Function applied in local torch (each rank its own inputs)."""
    assert RemoteTwice.__name__ == "Remote_Twice"
    with mesh.activate():
        x = (torch.full((1,), xv) + mesh.rank("gpu")).requires_grad_(x_grad)
        y = torch.full((1,), yv).requires_grad_()
        outs = RemoteTwice.apply(x, y)
        assert outs[3] == 4
        (outs[0] + outs[1]).sum().backward()
        got = [tdmesh.fetch_shard((outs[0], x.grad if x_grad else torch.zeros(1), y.grad), host=0, gpu=g).result()
               for g in range(2)]
    for g, (o, xg, yg) in enumerate(got):
        lx = (torch.full((1,), xv) + g).requires_grad_(x_grad)
        ly = torch.full((1,), yv).requires_grad_()
        louts = Twice.apply(lx, ly)
        (louts[0] + louts[1]).sum().backward()
        assert torch.equal(o, louts[0].detach()) and torch.equal(yg, ly.grad)
        assert torch.equal(xg, lx.grad if x_grad else torch.zeros(1))

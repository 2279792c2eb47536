"""Remote functions end to end: propagation (cached, callable, "inspect"), shipping functions
by import path or pickle, ``.call`` gathering a ValueMesh, and the errors for what cannot work.

MONARCH_NOTES §1.3 and §5 items 33-39 and 45.
"""

import threading

import pytest
import torch

import tdmesh
from tdmesh import fetch_shard, inspect, remote
from tdmesh.engine.future import ValueMesh
from tdmesh.remote import Remote


# Module-level functions travel by import path ("test_remote.scale"); the workers import this module.
def scale(a, x):
    return x * a


def tail(a, x):
    return x[a:]


def raises_no(x):
    raise Exception("No")  # this line appears


def many_outputs(x):
    return (x + 1, [x * 2, x[0]], {"a": x - 1, "b": x.sum()})


def coords(host, gpu):
    return (int(host), int(gpu))


def add_into(x, y):
    x.add_(y)


_remembered = []


def remember(x):
    _remembered.append(float(x.sum()))


def recall():
    return list(_remembered)


def all_reduce(x, group):
    torch.distributed.all_reduce(x, group=group)
    return x


class Unpicklable:
    """A callable holding a lock: neither importable nor picklable."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __call__(self, x):
        return x


# ----------------------------------------------------------------------------- cached propagation
def test_cached_propagation_counts_hits_and_misses(mesh2x2):
    fn = remote(scale)
    assert fn._propagate is None and fn.cache_hits == fn.cache_misses == 0
    with mesh2x2.activate():
        x = torch.arange(4.0)
        y = torch.arange(4.0) + 10
        a = fn(3, x)      # miss
        b = fn(3, x)      # hit: same structure, values and metadata
        c = fn(3, y)      # hit: another tensor with the same metadata
        d = fn(2, x)      # miss: a different non-tensor argument
        assert (fn.cache_hits, fn.cache_misses) == (2, 2)
        for out in (a, b, c, d):
            assert isinstance(out, tdmesh.Tensor) and out.shape == (4,) and out.dtype == torch.float32
            # x * a is a fresh tensor: it aliases neither its input nor the other outputs
            assert out._r.aliases is not x._r.aliases and out._r.aliases is not y._r.aliases
            assert len(out._r.aliases.refs) == 1
        fn(3, torch.ones(2, 2))  # other metadata: a miss
        assert (fn.cache_hits, fn.cache_misses) == (2, 3)
        got = fetch_shard((a, b, c, d), host=1, gpu=0).result()
    expected = (torch.arange(4.0) * 3, torch.arange(4.0) * 3, (torch.arange(4.0) + 10) * 3, torch.arange(4.0) * 2)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_a_remote_call_is_one_message_whatever_its_propagation(mesh2x2):
    """The stand-ins a propagation runs on are local meta tensors: none of their factories reaches the
    workers (they did, two ops a tensor, before: a call with 30 tensors sent 89 ops besides itself)."""
    by_callable = remote(scale, propagate=lambda a, x: torch.empty_like(x))
    cached = remote(scale)
    with mesh2x2.activate():
        xs = [torch.ones(3) * i for i in range(5)]
        client = mesh2x2.client
        cached(3.0, xs[0])  # the cache's miss: its one real run on the first rank, fetched
        for fn in (by_callable, cached):
            first = client.last_seq
            out = fn(3.0, xs[1])
            assert client.last_seq - first == 1
            assert inspect(out).tolist() == [3.0, 3.0, 3.0]
            assert type(out._meta) is type(xs[1]._meta) and out.shape == (3,)


def test_cached_outputs_alias_inputs_only_where_the_function_did(mesh2x2):
    fn = remote(tail)
    with mesh2x2.activate():
        x = torch.arange(5.0)
        y = torch.arange(5.0) * 10
        vx = fn(1, x)
        vy = fn(1, y)  # a cache hit: the output aliases *this* call's input
        assert (fn.cache_hits, fn.cache_misses) == (1, 1)
        assert vx.shape == (4,) and vx.storage_offset() == 1
        assert vx._r.aliases is x._r.aliases and vy._r.aliases is y._r.aliases
        assert vx._r.aliases is not vy._r.aliases
        vx.mul_(-1)  # a view: writing it writes x
        got_x, got_vy = fetch_shard((x, vy), host=0, gpu=1).result()
    assert torch.equal(got_x, torch.tensor([0.0, -1.0, -2.0, -3.0, -4.0]))
    assert torch.equal(got_vy, torch.tensor([10.0, 20.0, 30.0, 40.0]))


def test_cached_propagation_detects_mutation(mesh2x2):
    fn = remote(add_into)
    with mesh2x2.activate():
        x = torch.zeros(3)
        assert fn(x[1:], torch.ones(2)) is None
        got = inspect(x, host=1, gpu=1)
    assert torch.equal(got, torch.tensor([0.0, 1.0, 1.0]))


def test_remote_exception_at_the_call_names_the_source_line(mesh2x2):
    fn = remote(raises_no)
    with mesh2x2.activate():
        x = torch.ones(2)
        with pytest.raises(tdmesh.RemoteException) as info:
            fn(x)
        still_fine = inspect(x + 1)
    text = str(info.value)
    assert 'raise Exception("No")  # this line appears' in text
    assert "Exception: No" in text and info.value.exc_type == "Exception"
    assert torch.equal(still_fine, torch.full((2,), 2.0))


def test_pytree_outputs(mesh2x2):
    fn = remote(many_outputs)
    with mesh2x2.activate():
        x = torch.arange(3.0)
        out = fn(x)
        assert type(out) is tuple and len(out) == 3
        first, (doubled, head), d = out
        assert type(out[1]) is list and type(d) is dict and sorted(d) == ["a", "b"]
        assert all(isinstance(t, tdmesh.Tensor) for t in (first, doubled, head, d["a"], d["b"]))
        assert head.shape == () and d["b"].shape == ()
        assert head._r.aliases is x._r.aliases          # x[0] is a view of x
        assert doubled._r.aliases is not x._r.aliases   # x * 2 is not
        got = inspect(out, host=1, gpu=0)
    x = torch.arange(3.0)
    assert torch.equal(got[0], x + 1)
    assert torch.equal(got[1][0], x * 2) and torch.equal(got[1][1], x[0])
    assert torch.equal(got[2]["a"], x - 1) and torch.equal(got[2]["b"], x.sum())


# ----------------------------------------------------------------------------- other propagations
def test_decorator_forms(mesh2x2):
    @remote
    def plus_ten(x):
        return x + 10

    @remote(propagate=lambda x: torch.empty_like(x))
    def plus_twenty(x):
        return x + 20

    assert isinstance(plus_ten, Remote) and isinstance(plus_twenty, Remote)
    assert plus_ten._propagate is None and callable(plus_twenty._propagate)
    with mesh2x2.activate():
        x = torch.arange(3.0)
        a, b = plus_ten(x), plus_twenty(x)
        got = fetch_shard((a, b), host=0, gpu=1).result()
    assert plus_ten.cache_misses == 1 and plus_twenty.cache_misses == 0  # a propagator needs no probe
    assert torch.equal(got[0], torch.arange(3.0) + 10) and torch.equal(got[1], torch.arange(3.0) + 20)


def test_inspect_propagation_returns_none_and_runs_for_its_side_effect(mesh2x2):
    fn = remote(remember, propagate="inspect")
    with mesh2x2.activate():
        assert fn(torch.full((2,), 1.5)) is None
        seen = remote(recall).call().result()
    assert fn.cache_misses == 0
    assert len(seen) == 4 and all(v == [3.0] for _, v in seen)


# ----------------------------------------------------------------------------- shipping functions
def test_functions_by_import_path(mesh2x2):
    by_string = remote("torch.add")
    by_op = remote(torch.ops.aten.mul.Tensor)
    module_level = remote(scale)
    assert by_string._target == "torch.add"
    assert by_op._target == "torch.ops.aten.mul.Tensor"
    assert module_level._target == f"{scale.__module__}.scale"
    with mesh2x2.activate():
        x = torch.arange(3.0)
        got = fetch_shard((by_string(x, x), by_op(x, x), module_level(4, x)), host=1, gpu=1).result()
        pids = remote("os.getpid").call().result()
    x = torch.arange(3.0)
    assert torch.equal(got[0], x + x) and torch.equal(got[1], x * x) and torch.equal(got[2], 4 * x)
    assert len({pid for _, pid in pids}) == 4  # every rank is its own process


def test_pickled_closures_run_remotely(mesh2x2):
    k = 7.0

    def times_k(x):
        return x * k

    fn = remote(times_k)
    lam = remote(lambda x: x - k)
    assert isinstance(fn._target, bytes) and isinstance(lam._target, bytes)
    with mesh2x2.activate():
        x = torch.arange(3.0)
        got = fetch_shard((fn(x), lam(x)), host=1, gpu=0).result()
    assert torch.equal(got[0], torch.arange(3.0) * 7) and torch.equal(got[1], torch.arange(3.0) - 7)


def test_functions_that_cannot_be_shipped(mesh2x2):
    with pytest.raises(ValueError, match="Unsupported target for a remote function"):
        remote(3)
    nodots = remote("nodots")  # defined (a module that only defines one imports), refused where it is called
    with mesh2x2.activate(), pytest.raises(ValueError, match="dotted import path"):
        nodots()
    with pytest.raises(ValueError, match="cannot ship .* to the workers: it has no import path and does not pickle"):
        remote(Unpicklable())
    with pytest.raises(ValueError, match="propagate must be"):
        remote(scale, propagate="sometimes")
    with pytest.raises(NotImplementedError, match="mocked"):
        remote(scale, propagate="mocked")
    missing = remote("no_such_module_here.fn")  # a path is only resolved on the workers
    with mesh2x2.activate():
        with pytest.raises(tdmesh.RemoteException, match="failed to resolve function"):
            missing(torch.ones(1))
        assert torch.equal(inspect(torch.ones(1) * 2), torch.full((1,), 2.0))


def test_process_group_argument_needs_a_propagator(mesh2x2):
    fn = remote(all_reduce)
    with mesh2x2.activate():
        pg = mesh2x2.process_group(("gpu",))
        x = torch.ones(2) * (mesh2x2.rank("gpu") + 1)
        with pytest.raises(TypeError, match="takes a process group.*cached propagation"):
            fn(x, pg)
        assert fn.cache_misses == 0  # refused before anything ran
        reduced = remote(all_reduce, propagate=lambda x, group: x)(x, pg)
        got = inspect(reduced, host=1, gpu=0)
    assert torch.equal(got, torch.full((2,), 3.0))


def test_remote_without_a_mesh_is_an_error():
    fn = remote(scale)
    with pytest.raises(ValueError, match="require an active device mesh"):
        fn(2, 3)


# ----------------------------------------------------------------------------- .call: every rank's value
def test_call_returns_a_value_mesh(mesh2x2):
    with mesh2x2.activate():
        fut = remote(coords).call(mesh2x2.rank("host"), mesh2x2.rank("gpu"))
        assert isinstance(fut, tdmesh.Future)
        vm = fut.result()
    assert isinstance(vm, ValueMesh) and len(vm) == 4
    points = []
    for point, value in vm:
        assert value == (point["host"], point["gpu"])
        points.append((point["host"], point["gpu"]))
    assert sorted(points) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert vm[dict(host=1, gpu=0)] == (1, 0) and vm[dict(host=0, gpu=1)] == (0, 1)


def test_call_on_a_sub_mesh(mesh2x2):
    host1 = mesh2x2.slice(host=1)
    with host1.activate():
        vm = remote(coords).call(host1.rank("gpu"), host1.process_idx()).result()
    assert len(vm) == 2
    assert {point["gpu"]: value for point, value in vm} == {0: (0, 2), 1: (1, 3)}


# ----------------------------------------------------------------------------- .call_one: the one rank's value
def test_call_one_returns_the_plain_value_of_a_one_rank_mesh(mesh2x2):
    one = mesh2x2.slice(host=1, gpu=0)
    with one.activate():
        fut = remote(coords).call_one(one.process_idx(), 7)
        assert isinstance(fut, tdmesh.Future)
        assert fut.result() == (2, 7)


def test_call_one_refuses_a_mesh_of_more_ranks(mesh2x2):
    with mesh2x2.slice(host=0).activate(), pytest.raises(ValueError, match=r"mesh of 1 rank; this one has 2 \({gpu=2}"):
        remote(coords).call_one(0, 1)


# ----------------------------------------------------------------------------- as_completed
def test_as_completed_yields_every_future_of_the_fleet_once(mesh2x2):
    per_gpu = []
    for g in range(2):
        one = mesh2x2.slice(host=1, gpu=g)
        with one.activate():
            per_gpu.append(remote(coords).call_one(one.process_idx(), g))
    with mesh2x2.activate():
        shard = fetch_shard(torch.full((2,), 3.0), host=0, gpu=1)
        futures = per_gpu + [shard, per_gpu[0]]
        done = list(tdmesh.as_completed(futures, timeout=60))
    assert len(done) == 3 and set(map(id, done)) == {id(f) for f in futures}
    assert [f.result() for f in per_gpu] == [(2, 0), (3, 1)]
    assert torch.equal(shard.result(), torch.full((2,), 3.0))

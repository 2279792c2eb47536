"""Worker-resident objects (issue 17, part 2): ``mesh.spawn``, ``handle.call``, ``handle.remote``."""

import gc

import pytest
import torch

import tdmesh
from tdmesh import fetch_shard

LIVE_REFS = tdmesh.remote("tdmesh.worker.builtins.live_refs")


class Counter:
    """Per-rank state: starts at ``start`` (a plain value or this rank's own tensor)."""

    def __init__(self, start, step=1):
        self.n = float(start)
        self.step = step
        self.seen = []

    def bump(self, k=None):
        self.n += self.step if k is None else k
        return self.n

    def fail(self):
        raise ValueError(f"refusing at {self.n}")

    def scaled(self, x):
        return x * self.n

    def record(self, x):
        self.seen.append(float(x.sum()))

    def history(self):
        return self.seen


class Pairs(dict):
    """A dict subclass: must stay one object, not be taken apart as a pytree."""

    def size(self):
        return len(self)


def values(future):
    return [v for _, v in future.result()]


def test_each_rank_builds_its_own_instance_from_its_own_tensor(mesh2x2):
    with mesh2x2.activate():
        h = mesh2x2.spawn(Counter, mesh2x2.rank(("host", "gpu")), step=10)
        assert values(h.call("bump")) == [10.0, 11.0, 12.0, 13.0]
        assert values(h.call("bump", 0.5)) == [10.5, 11.5, 12.5, 13.5]
        assert h.call_one("bump", shard={"host": 1, "gpu": 1}).result() == 23.5
        assert values(h.call("bump", 0)) == [10.5, 11.5, 12.5, 23.5]


def test_method_calls_run_in_order_with_the_tensor_ops(mesh2x2):
    with mesh2x2.activate():
        h = mesh2x2.spawn(Counter, 0)
        x = torch.zeros(3)
        record = h.remote("record", propagate="inspect")
        for _ in range(4):
            x.add_(1)            # in place: each record must see the value of its own point in the program
            record(x)
        assert values(h.call("history")) == [[3.0, 6.0, 9.0, 12.0]] * 4


def test_remote_methods_return_mesh_tensors(mesh2x2):
    with mesh2x2.activate():
        h = mesh2x2.spawn(Counter, mesh2x2.rank("gpu"))
        scaled = h.remote("scaled", propagate=lambda x: x)
        y = scaled(torch.ones(2))
        assert isinstance(y, tdmesh.Tensor) and y.shape == (2,)
        assert torch.equal(fetch_shard(y, host=0, gpu=1).result(), torch.ones(2))
        assert torch.equal(fetch_shard(y * 2, host=1, gpu=0).result(), torch.zeros(2))
        cached = h.remote("scaled")  # cached propagation: runs the method once more on the first rank
        z = cached(torch.ones(3))
        z2 = cached(torch.ones(3))
        assert cached.cache_hits == 1
        assert torch.equal(fetch_shard(z + z2, host=1, gpu=1).result(), torch.full((3,), 2.0))


def test_a_raising_method_is_a_remote_exception_and_the_object_survives(mesh2x2):
    with mesh2x2.activate():
        h = mesh2x2.spawn(Counter, 7)
        with pytest.raises(tdmesh.RemoteException, match="refusing at 7.0") as info:
            h.call("fail").result()
        text = str(info.value)
        assert "test_objects.py" in text and 'h.call("fail")' in text   # the user's line
        assert "in fail" in text and "raise ValueError" in text          # the worker's traceback
        assert values(h.call("bump")) == [8.0] * 4


def test_a_failed_construction_fails_every_call_with_its_error(mesh2x2):
    with mesh2x2.activate():
        h = mesh2x2.spawn(Counter)  # no start
        for _ in range(2):
            with pytest.raises(tdmesh.RemoteException, match="missing 1 required positional argument"):
                h.call("bump").result()
        y = h.remote("scaled", propagate=lambda x: x)(torch.ones(1))
        with pytest.raises(tdmesh.RemoteException, match="missing 1 required positional argument"):
            fetch_shard(y).result()
        assert fetch_shard(torch.ones(1)).result().item() == 1.0  # the mesh goes on


def test_the_object_is_freed_when_its_handle_dies(mesh2x2):
    with mesh2x2.activate():
        gc.collect()
        values(LIVE_REFS.call())  # earlier tests' dead proxies: their frees go out with this call
        before = values(LIVE_REFS.call())
        h = mesh2x2.spawn(Counter, 1)
        assert values(LIVE_REFS.call()) == [n + 1 for n in before]
        del h
        gc.collect()
        assert values(LIVE_REFS.call()) == before


def test_a_container_subclass_stays_one_object_and_cannot_be_fetched(mesh2x2):
    with mesh2x2.activate():
        h = mesh2x2.spawn(Pairs, a=1, b=2)
        assert values(h.call("size")) == [2] * 4
        with pytest.raises(tdmesh.RemoteException, match="cannot be fetched"):
            fetch_shard(h).result()


def test_an_object_is_an_argument_of_plain_remote_functions(mesh2x2):
    with mesh2x2.activate():
        h = mesh2x2.spawn(Counter, 5)
        peek = tdmesh.remote(_peek)
        assert values(peek.call(h)) == ["Counter 5.0"] * 4


def _peek(resident):
    return f"{type(resident.obj).__name__} {resident.obj.n}"


def test_objects_stay_on_their_mesh_and_stream(mesh2x2):
    other = tdmesh.Stream("other")
    with mesh2x2.activate():
        h = mesh2x2.spawn(Counter, 0)
        with other.activate():
            x = torch.ones(2)
            assert values(h.call("bump")) == [1.0] * 4  # calls run on the object's stream
        with pytest.raises(tdmesh.UsageError, match="take tensors of its mesh and stream"):
            h.call("scaled", x)
        sub = mesh2x2.slice(host=0)
    with sub.activate():
        with pytest.raises(tdmesh.TdmeshError, match="lives on"):
            tdmesh.remote(_peek).call(h)


def test_spawn_is_refused_inside_a_compiled_function(mesh2x2):
    @tdmesh.compile
    def step(x):
        mesh2x2.spawn(Counter, 0)
        return x + 1

    with mesh2x2.activate():
        with pytest.raises(tdmesh.UsageError, match="mesh.spawn inside tdmesh.compile"):
            step(torch.ones(1))

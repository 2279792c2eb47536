"""Streams and borrows, end to end on real workers.

A worker runs each stream on its own thread, so work on two streams really overlaps; a
tensor crosses streams only through a borrow, whose rules are checked on the client.

Most tests need one worker (``mesh1``: a CPU worker here, cuda:0 wherever local_mesh finds
CUDA); the collectives test runs on the ``cmesh`` fixture (tests/conftest.py), whose shape
``TDMESH_TEST_MESH=HOSTSxGPUS`` picks (default 2x2, the CPU/gloo mesh shared with the engine
tests).  On a 2-GPU host

    TDMESH_TEST_MESH=1x2 python -m pytest -q tests/fleet/test_collectives.py tests/fleet/test_streams.py

runs the suite on CUDA tensors over NCCL (``TDMESH_DEVICE=cpu`` keeps it on CPU).  Remote
functions here create no tensors of their own, so they run on either device.
"""

import threading

import pytest
import torch

import tdmesh
from tdmesh import Stream, fetch_shard, inspect, remote

try:
    from ._meshcase import coords, members, rank_of
except ImportError:  # tests/ is not a package: pytest puts it on sys.path
    from _meshcase import coords, members, rank_of

# A worker process imports this module to run the functions below, so this dict is shared
# by every stream thread of one worker.
_BARRIERS: dict = {}
_BARRIERS_LOCK = threading.Lock()


def wait_at_barrier(x, name):
    """Blocks until two threads of this worker reach the barrier ``name`` (or 30 s pass:
    then ``BrokenBarrierError`` fails the call, so a missing thread is an error, not a hang)."""
    with _BARRIERS_LOCK:
        barrier = _BARRIERS.setdefault(name, threading.Barrier(2, timeout=30))
    barrier.wait()
    return x + 1


def fail(x):
    raise ValueError("fail: poisoned on purpose")


def this_line() -> int:
    import inspect as pyinspect
    return pyinspect.currentframe().f_back.f_lineno


def test_get_active_stream():
    main = tdmesh.get_active_stream()
    assert main.name == "main" and main.id == 0
    other = Stream("get_active")
    assert other.id != 0
    with other.activate() as s:
        assert s is other and tdmesh.get_active_stream() is other
        third = Stream("third")
        with third.activate():
            assert tdmesh.get_active_stream() is third
        assert tdmesh.get_active_stream() is other
    assert tdmesh.get_active_stream() is main


def test_two_streams_run_in_parallel(mesh1):
    barrier = remote(wait_at_barrier, propagate=lambda x, name: x + 1)
    other = Stream("parallel")
    with mesh1.activate():
        a = torch.zeros(2)
        first = barrier(a, "parallel")  # blocks the main stream's thread until ...
        with other.activate():
            b = torch.full((2,), 10.0)
            second = barrier(b, "parallel")  # ... this call on the other stream's thread arrives
        got_first = fetch_shard(first).result(timeout=60)
        got_second = fetch_shard(second).result(timeout=60)
        assert second.stream is other and first.stream is not other
    assert torch.equal(got_first, torch.ones(2))
    assert torch.equal(got_second, torch.full((2,), 11.0))


def test_read_borrow(mesh1):
    other = Stream("read_borrow")
    with mesh1.activate():
        x = torch.ones(4)
        b, borrow = other.borrow(x)
        assert b.stream is other and x.stream is not other and b.ref != x.ref
        assert isinstance(borrow, tdmesh.Borrow)
        with pytest.raises(TypeError, match="would be mutated"):
            x.add_(1)
        with pytest.raises(TypeError, match="MUTATING_BORROW"):
            x[:2].mul_(3)  # a view of the origin is the origin
        with other.activate():
            with pytest.raises(TypeError, match="MUTATING_BORROW"):
                b.add_(1)
            read_b = b * 2
        read_x = x * 3  # the origin stays readable on its own stream
        borrow.drop()
        assert borrow.dropped and b.dropped and not x.dropped
        x.add_(1)
        got_x = inspect(x)
        got_read_x = inspect(read_x)
        got_read_b = inspect(read_b)  # made before the drop: still valid on the other stream
    assert torch.equal(got_x, torch.full((4,), 2.0))
    assert torch.equal(got_read_x, torch.full((4,), 3.0))
    assert torch.equal(got_read_b, torch.full((4,), 2.0))


def test_mutable_borrow(mesh1):
    other = Stream("mutable_borrow")
    with mesh1.activate():
        x = torch.ones(4)
        b, borrow = other.borrow(x, mutable=True)
        with pytest.raises(TypeError, match="BORROWED"):
            x + 1
        with pytest.raises(TypeError, match="BORROWED"):
            inspect(x)
        with pytest.raises(TypeError, match="BORROWED"):
            other.borrow(x)
        with other.activate():
            b.add_(5)
            b[0].mul_(-1)
        borrow.drop()
        got = inspect(x)
        y = x + 1
        got_y = inspect(y)
    assert torch.equal(got, torch.tensor([-6.0, 6.0, 6.0, 6.0]))
    assert torch.equal(got_y, torch.tensor([-5.0, 7.0, 7.0, 7.0]))


def test_mutable_borrow_while_read_borrowed(mesh1):
    s1, s2 = Stream("rb1"), Stream("rb2")
    with mesh1.activate():
        x = torch.ones(3)
        _, read = s1.borrow(x)
        with pytest.raises(RuntimeError, match="Cannot borrow this tensor mutably"):
            s2.borrow(x, mutable=True)
        with pytest.raises(RuntimeError, match="Cannot borrow this tensor mutably"):
            s2.borrow(x[1:], mutable=True)  # a view shares the origin's borrows
        b2, second_read = s2.borrow(x)  # more read borrows are fine
        second_read.drop()
        read.drop()
        b3, mutable = s2.borrow(x, mutable=True)
        with s2.activate():
            b3.fill_(4)
        mutable.drop()
        got = inspect(x)
    assert torch.equal(got, torch.full((3,), 4.0))


def test_borrow_argument_errors(mesh1):
    other = Stream("borrow_errors")
    local = torch.ones(2)
    with mesh1.activate():
        x = torch.ones(2)
        with pytest.raises(ValueError, match="already lives on"):
            tdmesh.get_active_stream().borrow(x)
        with pytest.raises(TypeError, match="only tdmesh tensors"):
            other.borrow(local)
        b, borrow = other.borrow(x)
        with pytest.raises(TypeError, match="MUTATING_BORROW"):
            Stream("third").borrow(b, mutable=True)
        borrow.drop()
        borrow.drop()  # idempotent
        x.drop()
        with pytest.raises(TypeError, match="DROPPED"):
            other.borrow(x)


def test_borrowing_a_borrowed_tensor(mesh1):
    """Regressions: a borrow of a borrowed tensor that its stream had not used yet read a
    ref the worker did not have (an unreported "failed seq -1"); and a mutable borrow of a
    *mutably* borrowed tensor was refused as if it were a read-only borrow."""
    s2, s3 = Stream("nested2"), Stream("nested3")
    with mesh1.activate():
        x = torch.ones(2)
        b1, read1 = s2.borrow(x)
        b2, read2 = s3.borrow(b1)  # b1 never used on s2 before this
        with s3.activate():
            got_read = inspect(b2 + 1)
        read2.drop()
        read1.drop()
        y = torch.zeros(2)
        c1, mut1 = s2.borrow(y, mutable=True)
        c2, mut2 = s3.borrow(c1, mutable=True)
        with s2.activate():
            with pytest.raises(TypeError, match="BORROWED"):
                c1 + 1
        with s3.activate():
            c2.add_(3)
        mut2.drop()
        with s2.activate():
            c1.mul_(2)
        mut1.drop()
        got_mut = inspect(y)
    assert torch.equal(got_read, torch.full((2,), 2.0))
    assert torch.equal(got_mut, torch.full((2,), 6.0))


def test_using_a_dropped_borrow_names_the_drop_line(mesh1):
    other = Stream("dropped_trace")
    with mesh1.activate():
        x = torch.ones(2)
        b, borrow = other.borrow(x)
        with other.activate():
            view = b[:1]
            drop_line = this_line(); borrow.drop()  # noqa: E702
            with pytest.raises(TypeError, match=rf"is dropped at:(.|\n)*line {drop_line}(.|\n)*borrow\.drop\(\)"):
                b + 1
            with pytest.raises(TypeError, match=rf"DROPPED: tensor {view.ref} is dropped at:(.|\n)*line {drop_line}"):
                view * 2
        got = inspect(x + 1)
    assert torch.equal(got, torch.full((2,), 2.0))


def test_with_borrow_drops(mesh1):
    other = Stream("with_borrow")
    with mesh1.activate():
        x = torch.zeros(2)
        b, borrow = other.borrow(x, mutable=True)
        with borrow:
            with other.activate():
                b.add_(7)
        assert borrow.dropped and b.dropped
        with other.activate():
            with pytest.raises(TypeError, match="is dropped at"):
                b.sum()
        x.add_(1)  # the origin is usable again
        got = inspect(x)
    assert torch.equal(got, torch.full((2,), 8.0))


def test_wrong_stream(mesh1):
    other = Stream("wrong_stream")
    with mesh1.activate():
        x = torch.ones(2)
        with other.activate():
            with pytest.raises(TypeError, match="WRONG_STREAM"):
                x + 1
            y = torch.ones(2)  # made under the other stream: lives there
            assert y.stream is other
        with pytest.raises(TypeError, match="WRONG_STREAM"):
            y * 2
        with pytest.raises(TypeError, match="WRONG_STREAM"):
            remote("torch.add", propagate=lambda a, b: a)(x, y)
        got = inspect(y)  # fetches read on the tensor's own stream
    assert torch.equal(got, torch.ones(2))


def test_borrow_of_a_poisoned_value(mesh1):
    failing = remote(fail, propagate=lambda x: x + 0)  # a fresh result, not an alias of x
    other = Stream("poisoned_borrow")
    with mesh1.activate():
        x = torch.ones(2)
        z = failing(x)
        b, borrow = other.borrow(z)
        with other.activate():
            w = b + 1
            unrelated = torch.full((2,), 3.0) * 2
        borrow.drop()
        with pytest.raises(tdmesh.RemoteException, match="poisoned on purpose"):
            fetch_shard(w).result(timeout=60)
        with pytest.raises(tdmesh.RemoteException, match="poisoned on purpose"):
            fetch_shard(z).result(timeout=60)
        after_main = inspect(x * 5)
        with other.activate():
            after_other = inspect(unrelated + 1)
        # a mutable borrow of a poisoned value: what the borrower writes cannot heal it
        z2 = failing(x)
        b2, borrow2 = other.borrow(z2, mutable=True)
        with other.activate():
            b2.add_(1)
        borrow2.drop()
        with pytest.raises(tdmesh.RemoteException, match="poisoned on purpose"):
            fetch_shard(z2).result(timeout=60)
        again = inspect(x + 2)
    assert torch.equal(after_main, torch.full((2,), 5.0))
    assert torch.equal(after_other, torch.full((2,), 7.0))
    assert torch.equal(again, torch.full((2,), 3.0))


def test_alternating_streams_keep_each_streams_order(mesh1):
    other = Stream("alternating")
    with mesh1.activate():
        x = torch.zeros((), dtype=torch.int64)
        with other.activate():
            y = torch.ones((), dtype=torch.int64)
        for i in range(100):
            if i % 2 == 0:
                x.mul_(3).add_(i).remainder_(1000003)  # any reordering changes the result
            else:
                with other.activate():
                    y.mul_(2).sub_(i).remainder_(999983)
        got_x = fetch_shard(x).result(timeout=60)
        with other.activate():
            got_y = fetch_shard(y).result(timeout=60)
    ex, ey = 0, 1
    for i in range(100):
        if i % 2 == 0:
            ex = (ex * 3 + i) % 1000003
        else:
            ey = (ey * 2 - i) % 999983
    assert got_x.item() == ex
    assert got_y.item() == ey


def test_borrow_sees_earlier_writes_and_orders_later_ones(mesh1):
    """A borrow reads the origin as of the borrow; a mutable borrow's writes are seen by
    the origin's stream after the drop, even with work queued on both streams."""
    other = Stream("borrow_order")
    with mesh1.activate():
        x = torch.zeros(1000)
        for _ in range(20):
            x.add_(1)
        b, borrow = other.borrow(x, mutable=True)
        with other.activate():
            for _ in range(30):
                b.add_(2)
        borrow.drop()
        x.mul_(2)
        got = inspect(x)
    assert torch.equal(got, torch.full((1000,), 160.0))


def test_collectives_on_two_streams_of_the_full_mesh(cmesh):
    """A reduce on another stream uses its own communicators: it neither waits behind nor
    mixes with the main stream's reduces."""
    other = Stream("comms")
    with cmesh.activate():
        v = torch.ones(2) * (cmesh.process_idx() + 1)
        b, borrow = other.borrow(v)
        with other.activate():
            on_other = b.reduce("gpu")
        on_main = v.reduce("host")
        borrow.drop()
        got = {(h, g): fetch_shard(on_main, host=h, gpu=g) for h, g in coords(cmesh)}
        with other.activate():
            got_other = {(h, g): fetch_shard(on_other, host=h, gpu=g) for h, g in coords(cmesh)}
    for (h, g), fut in got.items():
        by_host = sum(rank_of(cmesh, *c) + 1 for c in members(cmesh, "host", h, g))
        by_gpu = sum(rank_of(cmesh, *c) + 1 for c in members(cmesh, "gpu", h, g))
        assert torch.equal(fut.result(), torch.full((2,), float(by_host)))
        assert torch.equal(got_other[h, g].result(), torch.full((2,), float(by_gpu)))

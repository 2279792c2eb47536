"""Future, as a unit: a fake client whose ``pump`` applies scheduled events on a virtual clock
(MONARCH_NOTES §5.B items 16-17).  No processes, no sleeping: ``tdmesh.engine.future.time`` is
replaced by the fake client's clock, so a 0.5 s timeout costs nothing."""

from __future__ import annotations

import heapq
import itertools
import types

import pytest

import tdmesh.engine.future as future_mod
from tdmesh.engine.future import Future, as_completed
from tdmesh.errors import RemoteException

T0 = 1000.0


class FakeClient:
    """Stands in for ``Client``: ``pump(timeout, until)`` applies the events due within
    ``timeout`` of the virtual clock, stopping early once ``until()`` holds, and lets the
    clock run to the deadline when nothing more is due (time passes while waiting)."""

    def __init__(self) -> None:
        self.now = T0
        self._events: list = []
        self._order = itertools.count()
        self.pumps: list = []          # the timeout of every pump() call

    def monotonic(self) -> float:
        return self.now

    def at(self, t: float, fn) -> None:
        heapq.heappush(self._events, (t, next(self._order), fn))

    def pump(self, timeout=0, until=None) -> None:
        self.pumps.append(timeout)
        if timeout is None and not self._events:
            raise AssertionError("pump(None) with nothing scheduled would block forever")
        deadline = float("inf") if timeout is None else self.now + timeout
        while self._events and self._events[0][0] <= deadline:
            t, _, fn = heapq.heappop(self._events)
            self.now = max(self.now, t)
            fn()
            if until is not None and until():
                return
        if deadline != float("inf"):
            self.now = max(self.now, deadline)


@pytest.fixture
def client(monkeypatch):
    c = FakeClient()
    monkeypatch.setattr(future_mod, "time", types.SimpleNamespace(monotonic=c.monotonic))
    return c


def remote_error(seq=3) -> RemoteException:
    return RemoteException(seq, 1, "ValueError", "bad shapes", "Traceback ...\nValueError: bad shapes", None)


# ----------------------------------------------------------------- §5.B item 16
def test_timeout_then_retry_then_value(client):
    fut = Future(client)
    client.at(T0 + 0.75, lambda: fut._set_result(4))

    with pytest.raises(TimeoutError, match="called again"):
        fut.result(timeout=0.5)
    assert client.now == pytest.approx(T0 + 0.5)   # it waited the full half second, no more
    assert not fut.done()
    assert repr(fut) == "<tdmesh.Future pending>"

    assert fut.result(timeout=1) == 4
    assert client.now == pytest.approx(T0 + 0.75)  # returned as soon as the value arrived
    assert fut.exception() is None
    assert fut.done()
    assert repr(fut) == "<tdmesh.Future done>"
    assert fut.result() == 4                         # and again, without pumping
    assert fut.result(timeout=0) == 4


def test_timeout_can_be_retried_many_times(client):
    fut = Future(client)
    client.at(T0 + 10, lambda: fut._set_result("late"))
    for i in range(1, 4):
        with pytest.raises(TimeoutError):
            fut.result(timeout=1)
        assert client.now == pytest.approx(T0 + i)
    with pytest.raises(TimeoutError):
        fut.exception(timeout=1)
    assert fut.result(timeout=None) == "late"


def test_result_without_timeout_waits_for_the_value(client):
    fut = Future(client)
    client.at(T0 + 3600, lambda: fut._set_result([1, 2]))
    assert fut.result() == [1, 2]
    assert client.pumps[0] is None


def test_value_already_received_is_found_with_zero_timeout(client):
    """A value waiting in the client's inbox is found by ``result(timeout=0)`` (a poll), as
    it is by ``done()``: polling must not time out forever without ever pumping."""
    fut = Future(client)
    client.at(T0, lambda: fut._set_result(7))
    assert fut.result(timeout=0) == 7
    assert client.pumps == [0]


def test_zero_timeout_on_a_pending_future_times_out(client):
    fut = Future(client)
    client.at(T0 + 1, lambda: fut._set_result(7))
    with pytest.raises(TimeoutError):
        fut.result(timeout=0)
    with pytest.raises(TimeoutError):
        fut.exception(timeout=0)
    assert client.now == T0


def test_done_never_blocks(client):
    fut = Future(client)
    client.at(T0 + 5, lambda: fut._set_result(1))
    assert fut.done() is False
    assert client.pumps == [0]
    assert client.now == T0
    client.now = T0 + 5
    assert fut.done() is True
    n = len(client.pumps)
    assert fut.done() is True
    assert len(client.pumps) == n   # a finished future does not pump


def test_other_futures_settle_while_waiting(client):
    a, b = Future(client), Future(client)
    client.at(T0 + 1, lambda: a._set_result("a"))
    client.at(T0 + 2, lambda: b._set_result("b"))
    assert b.result(timeout=5) == "b"
    assert a._finished() and a.result(timeout=0) == "a"


# ----------------------------------------------------------------- §5.B item 17
def test_exception_is_returned_and_raised(client):
    fut = Future(client)
    err = remote_error()
    client.at(T0 + 0.1, lambda: fut._set_exception(err))
    assert fut.exception(timeout=1) is err
    assert fut.done()
    assert repr(fut) == "<tdmesh.Future failed>"
    with pytest.raises(RemoteException) as info:
        fut.result()
    assert info.value is err
    assert info.value.seq == 3 and info.value.rank == 1
    with pytest.raises(RemoteException):
        fut.result(timeout=0)   # the stored exception, every time


def test_exception_is_none_on_success(client):
    fut = Future(client)
    fut._set_result(None)        # None is a value, not "pending"
    assert fut.done()
    assert fut.exception() is None
    assert fut.result() is None
    assert client.pumps == []


def test_settled_once(client):
    """A late resolution (e.g. a Status arriving after the fleet failed the future) does not
    replace what the user has already been told."""
    fut = Future(client)
    err = remote_error()
    fut._set_exception(err)
    fut._set_result(5)
    fut._set_exception(RuntimeError("later"))
    assert fut.exception() is err
    ok = Future(client)
    ok._set_result(5)
    ok._set_exception(err)
    assert ok.result() == 5 and ok.exception() is None


# ----------------------------------------------------------------- callbacks
def test_callback_runs_once_when_done(client):
    fut = Future(client)
    calls = []
    fut.add_callback(lambda f: calls.append(("first", f.result())))
    fut.add_callback(lambda f: calls.append(("second", f.result())))
    assert calls == []
    client.at(T0 + 1, lambda: fut._set_result(9))
    assert fut.result(timeout=2) == 9
    assert calls == [("first", 9), ("second", 9)]
    fut.result()
    fut.done()
    fut._set_result(10)      # ignored, and callbacks do not run again
    assert calls == [("first", 9), ("second", 9)]


def test_callback_runs_immediately_if_already_done(client):
    fut = Future(client)
    fut._set_result("v")
    seen = []
    fut.add_callback(seen.append)
    assert seen == [fut]
    assert client.pumps == []


def test_callback_sees_the_exception(client):
    fut = Future(client)
    seen = []
    fut.add_callback(lambda f: seen.append(f.exception()))
    err = remote_error()
    fut._set_exception(err)
    assert seen == [err]
    seen2 = []
    fut.add_callback(lambda f: seen2.append(f.exception()))
    assert seen2 == [err]


def test_callback_may_add_a_callback(client):
    fut = Future(client)
    order = []
    fut.add_callback(lambda f: (order.append(1), f.add_callback(lambda g: order.append(2))))
    fut._set_result(0)
    assert order == [1, 2]


def test_future_of_a_local_value_needs_no_client():
    """fetch_shard of a pytree without remote tensors builds ``Future(None)``, already done."""
    fut = Future(None)
    fut._set_result({"a": 1})
    assert fut.done() and fut.result(timeout=0) == {"a": 1} and fut.exception() is None


# ----------------------------------------------------------------- as_completed
class OtherFleet(FakeClient):
    """A second fleet's client, on the first one's virtual clock."""

    def __init__(self, clock: FakeClient) -> None:
        self._clock = clock
        super().__init__()

    now = property(lambda self: self._clock.now, lambda self, t: setattr(self._clock, "now", t))


def test_as_completed_yields_in_finishing_order_each_once_blocking_on_the_client(client):
    a, b, c, failed = Future(client), Future(client), Future(client), Future(client)
    c._set_result("c")
    client.at(T0 + 2, lambda: a._set_result("a"))
    client.at(T0 + 1, lambda: b._set_result("b"))
    client.at(T0 + 3, lambda: failed._set_exception(remote_error()))
    order = list(as_completed([a, b, a, c, failed, b]))
    assert order == [c, b, a, failed]
    assert all(timeout is None for timeout in client.pumps)  # it waited on the replies, it never polled
    assert client.now == pytest.approx(T0 + 3)


def test_as_completed_times_out_with_some_pending_and_counts_from_the_call(client):
    a, b = Future(client), Future(client)
    client.at(T0 + 1, lambda: a._set_result(1))
    client.at(T0 + 10, lambda: b._set_result(2))
    found = as_completed([a, b], timeout=3)
    client.now = T0 + 0.5  # time spent before the first next() counts
    assert next(found) is a
    with pytest.raises(TimeoutError, match=r"1 \(of 2\) futures were not done within 3 s"):
        next(found)
    assert client.now == pytest.approx(T0 + 3)
    assert not b.done()


def test_as_completed_waits_on_the_futures_of_several_fleets(client):
    other = OtherFleet(client)
    mine, theirs, later = Future(client), Future(other), Future(other)
    client.at(T0 + 1.5, lambda: mine._set_result("mine"))
    other.at(T0 + 0.5, lambda: theirs._set_result("theirs"))
    other.at(T0 + 2.5, lambda: later._set_result("later"))
    assert list(as_completed([later, mine, theirs], timeout=5)) == [theirs, mine, later]


def test_as_completed_takes_only_futures(client):
    with pytest.raises(TypeError, match="tdmesh Futures, got int"):
        as_completed([Future(client), 3])

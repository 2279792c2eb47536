"""The dashboard's JSON view, from what a client knows: each rank's state, the chart's rates, errors.

``tdmesh.monitor.view`` reads a handful of the client's attributes and sends nothing; these tests
give it those attributes as plain records (the live page of a real mesh is
``tests/fleet/test_dashboard.py``), so every state and its precedence is pinned here, including the
ones a live test reaches only by luck of timing (a death the launcher saw before any connection
closed).
"""

from __future__ import annotations

import traceback
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tdmesh.errors import DeviceException, RemoteException
from tdmesh.monitor.view import STATES, Timeline, error_view, rank_state
from tdmesh.protocol.messages import Sample

TIMEOUT = 4.0


def client(*, lost=(), closed=False, parked=False, in_pdb=(), failure=None):
    observations = SimpleNamespace(lost_ranks=set(lost), parked=parked)
    return SimpleNamespace(observations=observations, closed=closed, debugger=SimpleNamespace(stopped=set(in_pdb)),
                           failure=failure)


def sample(*streams) -> Sample:
    """A worker's sample with ``streams`` as (queued, seq running or -1, running for s)."""
    return Sample(0, 1 << 20, 0, 0, tuple((i, q, seq, "add", "x.py:1", t) for i, (q, seq, t) in enumerate(streams)),
                  ())


IDLE = sample((0, -1, 0.0))
BUSY = sample((3, 17, 0.5))
STUCK = sample((0, 17, TIMEOUT + 1))


@pytest.mark.parametrize("state,kwargs,seen", [
    ("starting", {}, None),
    ("idle", {}, IDLE),
    ("running", {}, BUSY),
    ("running", {}, sample((0, -1, 0.0), (2, -1, 0.0))),  # a second stream with work queued
    ("stuck", {}, STUCK),
    ("in pdb", {"in_pdb": {0}}, STUCK),  # stepping over slow code in pdb is not a stuck op
    ("exited", {"closed": True}, BUSY),
    ("parked", {"closed": True, "parked": True}, IDLE),
    ("dead", {"lost": {0}}, BUSY),  # its connection closed
    ("dead", {"lost": {0}, "closed": True}, IDLE),  # and stays dead once the mesh has exited
])
def test_each_state_and_what_comes_first(state, kwargs, seen):
    assert state in STATES
    assert rank_state(client(**kwargs), 0, seen, TIMEOUT) == state


@pytest.mark.parametrize("state,kwargs,seen", [
    ("spare", {}, IDLE),  # an idle spare is a spare...
    ("running", {}, BUSY),  # ...and shows what else it does as any rank does
    ("starting", {}, None),
    ("dead", {"lost": {0}}, IDLE),
    ("parked", {"closed": True, "parked": True}, IDLE),
])
def test_a_spare_is_spare_where_another_rank_would_be_idle(state, kwargs, seen):
    assert rank_state(client(**kwargs), 0, seen, TIMEOUT, spares=(0,)) == state


@given(lost=st.booleans(), closed=st.booleans(), parked=st.booleans(), pdb=st.booleans(),
       seen=st.sampled_from([None, IDLE, BUSY, STUCK]))
def test_a_rank_the_launcher_saw_fail_is_dead_whatever_else_the_client_knows(lost, closed, parked, pdb, seen):
    """The launcher's account (``dead``) and a closed connection (``lost_ranks``) each make a rank dead;
    the rank beside it is never dead by association."""
    c = client(lost={0} if lost else (), closed=closed, parked=parked, in_pdb={0, 1} if pdb else ())
    assert rank_state(c, 0, seen, TIMEOUT, dead=(0,)) == "dead"
    assert rank_state(c, 1, seen, TIMEOUT, dead=(0,)) != "dead"


def test_the_chart_and_the_rates_are_differences_over_time():
    c = SimpleNamespace(closed=True, last_seq=-1, supervisor=SimpleNamespace(progress={0: 0, 2: 0}))
    timeline = Timeline(c)  # its thread ends at once: the client is closed
    timeline._thread.join(5)
    timeline.points.clear()
    timeline.points.extend([(100.0, 0, {0: 0, 2: 0}), (101.0, 50, {0: 40, 2: 30}), (103.0, 250, {0: 240, 2: 130})])
    issued, completed = timeline.rates(window=5.0)
    assert issued == pytest.approx(250 / 3) and completed == pytest.approx({0: 80.0, 2: 130 / 3})
    assert timeline.chart() == [[-2.0, 50.0, 30.0], [0.0, 100.0, 50.0]]  # the slowest child's rate
    issued, completed = timeline.rates(window=2.0)  # only the last two points are within 2 s
    assert issued == pytest.approx(100.0) and completed == pytest.approx({0: 100.0, 2: 50.0})


def test_an_error_shows_the_users_line_and_the_workers_traceback():
    site = [traceback.FrameSummary("train.py", 12, "step")]
    view = error_view(RemoteException(7, 1, "ValueError", "bad shape", "  File \"w.py\", line 3\n", site))
    assert view["type"] == "RemoteException" and view["rank"] == 1 and view["message"] == "ValueError: bad shape"
    assert 'File "train.py", line 12, in step' in view["client_traceback"]
    assert view["worker_traceback"] == '  File "w.py", line 3\n'
    fleet = error_view(DeviceException("worker rank 0 (host h, pid 9) died: killed by signal SIGKILL"))
    assert fleet["text"].endswith("SIGKILL") and fleet["client_traceback"] == "" and "rank" not in fleet
    assert error_view(None) is None

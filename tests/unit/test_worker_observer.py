"""A worker's dashboard sample, taken from a real interpreter whose stream thread runs a remote
function: the running op's age, and how a pdb session on that thread is left out of it.

No processes: the interpreter runs its stream on a thread, as a worker does, and the user's
pdb lines arrive as the ``DebuggerInput`` messages the client would send.
"""

from __future__ import annotations

import sys
import time

import cloudpickle
import pytest
import torch

from tdmesh.protocol import messages as m
from tdmesh.worker.interpreter import Interpreter

pytestmark = pytest.mark.time_limit(60)


def stop_then_sleep(stepped_over, after):
    breakpoint()
    time.sleep(stepped_over)
    time.sleep(after)
    return 1


def just_sleep(seconds):
    time.sleep(seconds)
    return 1


def running_for(interp) -> float:
    (_, _, seq, _, _, for_s), = interp.observer.stream_states()
    assert seq >= 0, "the stream is not running the op"
    return for_s


def wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def interp(monkeypatch):
    sent: list = []
    worker = Interpreter(0, torch.device("cpu"), sent.append, threaded=True)
    monkeypatch.setattr(sys, "breakpointhook", worker.console.breakpoint)  # as the worker loop installs it
    worker.sent = sent  # type: ignore[attr-defined]
    yield worker
    for _ in range(3):
        worker.console.lines.put("c\n")  # a test that failed inside a pdb session lets its stream go
    for stream in list(worker.streams.values()):
        stream.close()


def call(interp, function, *args) -> None:
    interp.handle(m.CallFunction(1, (0,), (), cloudpickle.dumps(function), args, {}))


def test_a_running_op_ages_while_it_runs(interp):
    call(interp, just_sleep, 1.0)
    wait_for(lambda: interp.observer.stream_states()[0][2] >= 0)
    first = running_for(interp)
    time.sleep(0.4)
    assert running_for(interp) >= first + 0.3


def test_the_time_a_stream_sits_in_pdb_is_left_out_of_its_ops_age(interp):
    """`n` over a 1.5 s sleep, then `c`: the op spent 1.5 s in pdb, and its age stays near 0 while
    the user steps; after the session ends it counts again from there, never the pdb time."""
    call(interp, stop_then_sleep, 1.5, 2.0)
    sent = interp.sent
    reads = lambda: sum(isinstance(x, m.DebuggerRead) for x in sent)  # noqa: E731
    wait_for(lambda: reads() == 1)
    assert running_for(interp) < 0.2
    interp.handle(m.DebuggerInput("n\n"))  # steps over the first sleep: the same pdb session
    time.sleep(0.5)
    assert running_for(interp) < 0.2  # a sample taken inside the step
    wait_for(lambda: reads() == 2)  # pdb stopped after the sleep
    assert running_for(interp) < 0.2
    interp.handle(m.DebuggerInput("c\n"))
    wait_for(lambda: any(isinstance(x, m.DebuggerDone) for x in sent))
    thread = interp.streams[0]._thread.ident
    assert interp.console.pdb_seconds(thread, time.monotonic()) >= 1.5
    time.sleep(0.6)  # inside the second sleep, which runs outside pdb
    assert 0.5 <= running_for(interp) < 1.4

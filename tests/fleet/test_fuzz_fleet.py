"""Malformed frames between real processes, after authentication: a bad frame ends the
session of the peer that got it (a worker) or sent it (as the client sees it), with an error
naming the rank and what was wrong; every pending future fails with a DeviceException, and
no worker process outlives the fleet.

Relays are off (``TDMESH_RELAYS=0``) so that the client holds one connection per worker and
a frame can be put on one worker's connection alone."""

from __future__ import annotations

import contextlib
import glob
import os
import socket

import pytest
import torch
from test_supervision import FAST, assert_no_worker_left, worker_pids

import tdmesh
from tdmesh import DeviceException, fetch_shard, inspect, remote
from tdmesh.protocol import messages as m
from tdmesh.protocol.transport import ENTRY, entries

HOST = socket.gethostname()


@pytest.fixture(autouse=True)
def one_connection_per_worker(monkeypatch):
    monkeypatch.setenv("TDMESH_RELAYS", "0")


def fleet(log_dir):
    return tdmesh.local_mesh(hosts=1, gpus_per_host=2, pool=False, supervision=FAST, log_dir=str(log_dir))


@contextlib.contextmanager
def working_fleet(log_dir):
    """A fleet whose workers have run an op: (mesh, worker pids, that op's tensor), inside its activation."""
    with fleet(log_dir) as mesh:
        pids = worker_pids(mesh)
        with mesh.activate():
            x = torch.ones(2) + 1
            assert inspect(x, host=0, gpu=1).tolist() == [2.0, 2.0]
            yield mesh, pids, x


def logged(log_dir, text: str) -> list[str]:
    """The worker log files under ``log_dir`` that contain ``text``."""
    found = []
    for path in glob.glob(os.path.join(str(log_dir), "**", "*"), recursive=True):
        if os.path.isfile(path):
            with open(path, errors="replace") as f:
                if text in f.read():
                    found.append(path)
    return found


def failure_of(make_future) -> str:
    """The DeviceException text of a fetch: raised when it is issued (the fleet already failed) or
    by its result; a fetch that succeeds fails the test."""
    try:
        value = make_future().result(timeout=30)
    except DeviceException as e:
        return str(e)
    raise AssertionError(f"a fetch on a broken fleet returned {value!r}")


def slowly(x):
    import time
    time.sleep(1.0)  # keeps what follows pending while the bad frame arrives
    return x


# --------------------------------------------------------------------- client -> one worker
@pytest.mark.parametrize("payload, problem", [
    (entries([m.DeleteRefs((1, "two"))]), "the client sent a DeleteRefs whose refs is tuple"),
    (entries([m.Status(0, 1)]), "the client sent a message that is not client->worker"),
    (entries([(1, 2, 3)]), "the client sent a bare tuple of 3 fields"),
    (ENTRY.pack(0, 10) + b"\x80\x05garbage!", "undecodable entry at byte 8 of a 18-byte frame"),
    (ENTRY.pack(0, 12) + b"\x80\x05garbage!", "an entry of 12 bytes at byte 8 overruns a 18-byte frame"),
    (entries([m.RequestStatus(0)], set_id=9), "an entry names rank set 9, which was never defined"),
    (entries([m.CreateGroups("bogus", 0, id=99)]),
     "the client sent a CreateGroups that could not be handled: ValueError: unknown group kind 'bogus'"),
], ids=["wrong-field-type", "wrong-direction", "bare-tuple", "corrupt-pickle", "wrong-entry-length",
        "undefined-rank-set", "unhandled"])
def test_a_bad_frame_ends_that_workers_session_and_fails_the_fleet(tmp_path, payload, problem):
    with working_fleet(tmp_path) as (mesh, pids, x):
        client = mesh.client
        y = remote(slowly, propagate=lambda x: x)(x)
        pending = [fetch_shard(y, host=0, gpu=1), fetch_shard(y * 3, host=0, gpu=0)]
        with client.lock:
            client.flush()
            client.conns[1].send_payload(payload)  # on rank 1's connection only
        errors = [failure_of(lambda f=f: f) for f in pending]
        errors.append(failure_of(lambda: fetch_shard(x + 1)))
    assert all(f"worker rank 1 (host {HOST}, pid {pids[1]}" in text for text in errors), errors
    assert logged(tmp_path, f"rank 1: leaving: the session broke the protocol: {problem}"), problem
    assert_no_worker_left(pids)


def test_a_bad_message_met_on_a_stream_thread_ends_the_worker_too(tmp_path):
    """A CallOp naming an op never defined passes the schema; its stream finds out, stops, and
    wakes the message loop, which leaves (it does not wait for a next frame that never comes)."""
    with working_fleet(tmp_path) as (mesh, pids, x):
        client = mesh.client
        with client.lock:
            client.flush()
            client.conns[1].send_payload(entries([(50, 999, (70,), (), (), 0)]))
        text = failure_of(lambda: fetch_shard(x * 2, host=0, gpu=1))
    assert f"worker rank 1 (host {HOST}, pid {pids[1]}" in text, text
    assert logged(tmp_path, "rank 1: leaving: the session broke the protocol: op 999 is not defined on worker 1")
    assert_no_worker_left(pids)


# --------------------------------------------------------------------- one worker -> client
def send_malformed_status():
    """On rank 1: a Status whose rank is a string, sent as the interpreter sends any message."""
    from tdmesh.worker.interpreter import Interpreter
    interp = Interpreter.current
    assert interp is not None
    if interp.rank == 1:
        interp.send(m.Status("one", 3))
    return torch.zeros(1)


def _rank_1_connection():
    """On a worker: (its connection to the client, the lock its sends take) on rank 1, else None."""
    from tdmesh.protocol.transport import Connection
    from tdmesh.worker.interpreter import Interpreter
    interp = Interpreter.current
    assert interp is not None
    if interp.rank != 1:
        return None
    cells = [c.cell_contents for c in interp.send.__closure__ or ()]
    return next(c for c in cells if isinstance(c, Connection)), next(c for c in cells if hasattr(c, "acquire"))


def send_garbage_frame():
    """On rank 1: a frame of bytes that are no pickle, on the worker's own connection."""
    found = _rank_1_connection()
    if found is not None:
        conn, lock = found
        with lock:
            conn.send_payload(b"\x80\x05no pickle here")
    return torch.zeros(1)


def send_half_a_frame():
    """On rank 1: half a frame header, then silence (its heartbeats wait behind the send lock)."""
    import time

    from tdmesh.protocol.transport import MAGIC
    found = _rank_1_connection()
    if found is not None:
        conn, lock = found
        with lock:
            conn.sock.sendall(MAGIC + b"\x00\x00")
            time.sleep(60)
    return torch.zeros(1)


@pytest.mark.parametrize("function, problem", [
    (send_malformed_status, "it sent a Status whose rank is str 'one'; it must be an int"),
    (send_garbage_frame, "undecodable message at byte"),
    (send_half_a_frame, "stopped in the middle of a frame"),
], ids=["wrong-field-type", "garbage", "stalled-frame"])
def test_a_bad_frame_from_a_worker_is_a_device_exception_naming_it(tmp_path, function, problem):
    with fleet(tmp_path) as mesh:
        pids = worker_pids(mesh)
        with mesh.activate():
            y = remote(function, propagate=lambda: torch.zeros(1))()
            errors = [failure_of(lambda: fetch_shard(y + 1, host=0, gpu=1)),
                      failure_of(lambda: fetch_shard(y + 2, host=0, gpu=0))]
            with pytest.raises(DeviceException) as later:
                inspect(y * 2)  # the fleet stays failed
    for text in errors + [str(later.value)]:
        assert f"worker rank 1 (host {HOST}, pid {pids[1]}" in text and problem in text, text
    assert_no_worker_left(pids)

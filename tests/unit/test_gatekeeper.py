"""The controller's gatekeeper on real sockets, in process: strangers never hold up workers.

Every connection is checked on its own thread, so a stranger that connects and stays silent
(or trickles bytes) costs the job nothing; it is cut when its first frame is not complete
within ``Gatekeeper.HELLO_TIMEOUT`` and refused, like every other stranger.
"""

import select
import socket
import struct
import threading
import time

import pytest

from tdmesh.errors import DeviceException
from tdmesh.fleet.job import Gatekeeper, accept_workers
from tdmesh.protocol import messages as m
from tdmesh.protocol.handshake import join
from tdmesh.protocol.transport import MAGIC, Connection


def frame(payload: bytes) -> bytes:
    return struct.pack("!4sQ", MAGIC, len(payload)) + payload


class Startup:
    """``accept_workers`` for ``world`` ranks on a thread; ``address`` is set once it listens."""

    def __init__(self, world: int, timeout: float, on_publish=None) -> None:
        self.on_publish = on_publish
        self.announced = threading.Event()
        self.result = None
        self.error = None
        self.thread = threading.Thread(target=self._run, args=(world, timeout), daemon=True)
        self.thread.start()
        assert self.announced.wait(10), "the gatekeeper never announced itself"

    def _announce(self, host: str, port: int):
        self.port, self.token = port, "t" * 32

        def publish() -> None:
            self.announced.set()
            if self.on_publish is not None:
                self.on_publish(self)
        return self.token, publish

    def _run(self, world: int, timeout: float) -> None:
        try:
            self.result = accept_workers(None, world, host="127.0.0.1", bind="127.0.0.1", timeout=timeout,
                                         announce=self._announce)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            self.error = e

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def worker(self, rank: int) -> socket.socket:
        """A connection that passes the handshake as ``rank``."""
        s = self.connect()
        join(Connection(s), self.token, m.Hello(rank, b"", "", "test", 1, "cpu", None), "the test's gate")
        return s


def wait_for(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.fixture
def patient_gate(monkeypatch):
    """Strangers get a minute for their first frame: nothing a test does can outlast it."""
    monkeypatch.setattr(Gatekeeper, "HELLO_TIMEOUT", 60.0)


def test_a_worker_that_connects_the_moment_the_client_is_published_is_admitted():
    """The gate knows the session token before the announcement is out: a worker as quick as
    the publish itself passes (CI once saw one refused as a stranger, then a 120 s wait)."""
    first = []
    startup = Startup(world=1, timeout=20, on_publish=lambda s: first.append(s.worker(0)))
    startup.thread.join(20)
    assert startup.error is None, startup.error
    conns, hellos, gate, _ = startup.result
    assert sorted(hellos) == [0] and gate.refused == 0
    gate.close()


def test_silent_strangers_do_not_hold_up_the_workers(patient_gate):
    startup = Startup(world=2, timeout=20)
    strangers = [startup.connect() for _ in range(3)]      # connected, and never a byte
    trickler = startup.connect()
    trickler.sendall(MAGIC[:2])                            # half a header, then silence
    workers = [startup.worker(1), startup.worker(0)]
    startup.thread.join(30)
    assert startup.error is None, startup.error
    conns, hellos, gate, _ = startup.result
    # both ranks got in while every stranger was still connected and unanswered
    assert sorted(conns) == [0, 1] and [hellos[r].rank for r in (0, 1)] == [0, 1]
    assert gate.refused == 0
    for s in strangers + [trickler]:
        s.close()
    assert wait_for(lambda: gate.refused == 4), f"refused {gate.refused} of 4 strangers"
    gate.close()
    for c in conns.values():
        c.close()
    for w in workers:
        w.close()


def test_a_first_frame_that_never_completes_is_cut(monkeypatch):
    monkeypatch.setattr(Gatekeeper, "HELLO_TIMEOUT", 0.5)
    startup = Startup(world=1, timeout=20)
    trickler = startup.connect()
    trickler.sendall(frame(b"x" * 100)[:20])              # the header and 8 bytes of 100
    worker = startup.worker(0)
    startup.thread.join(30)
    assert startup.error is None, startup.error
    conns, _, gate, _ = startup.result
    trickler.settimeout(10)
    received = b""
    while chunk := trickler.recv(4096):  # the gate's challenge, then the close
        received += chunk
    assert received.startswith(MAGIC), "the gatekeeper kept a stalled first frame open"
    assert wait_for(lambda: gate.refused == 1)
    gate.close()
    conns[0].close()
    worker.close()
    trickler.close()


def test_a_rank_taken_twice_is_refused_and_startup_goes_on(patient_gate):
    startup = Startup(world=2, timeout=20)
    twins = [startup.worker(0), startup.worker(0)]        # the right token, one rank, twice
    last = startup.worker(1)
    startup.thread.join(30)
    assert startup.error is None, startup.error
    conns, _, gate, _ = startup.result
    assert sorted(conns) == [0, 1]
    assert wait_for(lambda: gate.refused == 1)
    # whichever came second was closed; the other one is rank 0's live connection
    closed, _, _ = select.select(twins, [], [], 10)
    assert len(closed) == 1 and closed[0].recv(16) == b""
    still_open = [t for t in twins if t is not closed[0]][0]
    assert select.select([still_open], [], [], 0.2)[0] == []
    gate.close()
    for c in conns.values():
        c.close()
    for s in twins + [last]:
        s.close()


def test_startup_times_out_naming_the_missing_ranks(patient_gate):
    startup = Startup(world=2, timeout=1)
    worker = startup.worker(1)
    startup.thread.join(30)
    assert isinstance(startup.error, DeviceException)
    assert "ranks [0] did not connect" in str(startup.error)
    worker.settimeout(10)
    assert worker.recv(16) == b"", "a failed startup left an admitted connection open"
    worker.close()

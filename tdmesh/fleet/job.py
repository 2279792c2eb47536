"""A running fleet: the client's listening socket, the worker connections, shutdown.

Both entry points end here: ``local_mesh`` (workers started by torch.distributed.elastic
from the calling process) and ``world_mesh`` (workers started by torchrun).  The client
listens, publishes its address (and, without a shared secret, a token) in the job's c10d
store, and accepts exactly one connection per rank that proves it knows the token.
"""

from __future__ import annotations

import logging
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ..config import env_float
from ..engine.client import Client
from ..engine.settle import forget, pending, settle
from ..errors import DeviceException
from ..protocol import messages as m
from ..protocol.handshake import check_hello, hear, welcome
from ..protocol.rendezvous import job_scope, publish_controller, reachable_host
from ..protocol.security import job_token, server_tls
from ..protocol.transport import DEFAULT_MAX_FRAME, Connection, hello_ranks
from . import pool
from .pool import quiet_elastic

log = logging.getLogger("tdmesh")


def controller_host() -> str:
    return reachable_host("TDMESH_CONTROLLER_HOST")


def _cut(sock: socket.socket) -> None:
    """End a first frame that is taking too long: the reader sees the connection close."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _not_open(hello) -> str:
    if type(hello) is m.RelayHello:
        return f"the relay of host {hello.host!r} speaks for ranks that are not open in this job"
    return f"rank {hello.rank!r} is not an open rank of this job"


class Gatekeeper:
    """The client's listening socket.  Only processes that prove they know the job's token
    (tdmesh.protocol.handshake; inside TLS when TDMESH_TLS_CERT is set) get in; everything else (a wrong
    proof, garbage, oversized or truncated frames, a rank already taken) is refused, logged,
    and closed, and nothing else happens.
    After startup it stays open and refuses every newcomer, so strays are seen in the log.

    Each connection is checked on a thread of its own (at most ``MAX_CHECKS`` at once), so a
    stranger that connects and sends nothing holds up no one but itself."""

    MAX_CHECKS = 32
    HELLO_TIMEOUT = 5.0  # seconds a connection gets to send its first frame

    def __init__(self, bind: str) -> None:
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((bind, 0))
        self.listener.listen(64)
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.token = ""  # set before anyone is told where the gate is
        self.tls = server_tls()
        self.refused = 0
        self.closed = False
        self.arrivals: queue.SimpleQueue = queue.SimpleQueue()  # (conn, hello, peer), token checked
        self._admitting = True
        self._lock = threading.Lock()
        self._checks = threading.BoundedSemaphore(self.MAX_CHECKS)
        self._thread = threading.Thread(target=self._accept_loop, name="tdmesh-gatekeeper", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                sock, peer = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            if not self._checks.acquire(blocking=False):
                self._refuse(Connection(sock), peer, f"{self.MAX_CHECKS} connections are already being checked")
                continue
            threading.Thread(target=self._check, args=(sock, peer), name="tdmesh-gatekeeper-check",
                             daemon=True).start()

    def _check(self, sock: socket.socket, peer) -> None:
        # the handshake must be complete within HELLO_TIMEOUT, however slowly it trickles in
        deadline = threading.Timer(self.HELLO_TIMEOUT, _cut, args=(sock,))
        try:
            sock.settimeout(self.HELLO_TIMEOUT)
            deadline.start()
            try:
                conn, nonce, hello = hear(sock, self.tls, 1 << 16)  # a Hello is small; a stranger gets no more
            except Exception as e:  # noqa: BLE001 - whatever a stranger sends
                return self._refuse(Connection(sock), peer, f"{type(e).__name__}: {e}")
            finally:
                deadline.cancel()
            if not check_hello(self.token, nonce, hello):
                return self._refuse(conn, peer, "it did not prove that it knows this job's token")
            with self._lock:
                if self._admitting:
                    welcome(conn, self.token, nonce, hello)
                    conn.sock.settimeout(None)
                    conn.max_frame = DEFAULT_MAX_FRAME  # authenticated: fetches may be large
                    self.arrivals.put((conn, hello, peer))
                    return
            self._refuse(conn, peer, _not_open(hello))
        except OSError as e:  # the peer went away mid-handshake
            log.warning("tdmesh: a connection from %s broke during the handshake: %s", peer, e)
        finally:
            self._checks.release()

    def _refuse(self, conn: Connection, peer, why: str) -> None:
        with self._lock:
            self.refused += 1
        log.warning("tdmesh refused a connection from %s: %s", peer, why)
        conn.close()
        return None

    def admit(self, conn: Connection, hello, peer, world_size: int, taken) -> bool:
        """Whether an authenticated connection gets its rank (a relay: its ranks); refused (and closed) if not."""
        ranks = hello_ranks(hello)
        if ranks is None or not all(isinstance(r, int) and 0 <= r < world_size and r not in taken for r in ranks):
            self._refuse(conn, peer, _not_open(hello))
            return False
        return True

    def refuse_newcomers(self) -> None:
        """After startup: every newcomer, even one with the token, is refused and logged."""
        with self._lock:
            self._admitting = False
        self._refuse_arrivals()

    def _refuse_arrivals(self) -> None:
        while True:
            try:
                conn, hello, peer = self.arrivals.get_nowait()
            except queue.Empty:
                return
            self._refuse(conn, peer, _not_open(hello))

    def close(self) -> None:
        self.closed = True
        with self._lock:
            self._admitting = False
        try:
            self.listener.close()
        except OSError:
            pass
        self._refuse_arrivals()


def accept_workers(store, world_size: int, *, host: str, bind: str, scope: str | None = None,
                   alive: Callable[[], str | None] = lambda: None, timeout: float | None = None,
                   announce: Callable[[str, int], tuple[str, Callable[[], None]]] | None = None,
                   meanwhile: Callable[[], None] | None = None):
    """Publish the client in ``store`` and accept one authenticated connection per rank.

    ``alive()`` returns a reason when the workers can no longer come (a launcher saw them
    die), so startup failures are reported at once instead of after the timeout.  ``meanwhile``
    runs once the client is published, while the workers come (the gate admits them meanwhile).
    Each connection is a worker, or a host's relay speaking for several ranks.  Returns
    (connections by the first rank behind them, every rank's hello, the gatekeeper that
    keeps refusing strangers, {key: (host, ranks)} of the relays).  ``announce(host, port)``
    (attach mode) returns the session's token and the call that publishes the client its own
    way: the gate knows the token before any worker can learn where it is (a worker that came
    in between was refused as a stranger and the client waited out its timeout).
    """
    timeout = env_float("TDMESH_CONNECT_TIMEOUT") if timeout is None else timeout
    gate = Gatekeeper(bind)
    conns: dict[int, Connection] = {}
    hellos: dict[int, m.Hello] = {}
    relays: dict[int, tuple[int, tuple[int, ...]]] = {}
    try:
        if announce is not None:
            gate.token, publish = announce(host, gate.port)
            publish()
        else:
            token, published = job_token(scope or job_scope())
            gate.token = token
            publish_controller(store, host, gate.port, token if published else None, scope)
        if meanwhile is not None:
            meanwhile()
        deadline = time.monotonic() + timeout
        while len(hellos) < world_size:
            why = alive()
            if why:
                raise DeviceException(f"workers failed while starting: {why}")
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(hellos))
                raise DeviceException(f"ranks {missing} did not connect to the client within {timeout:.0f} s")
            try:
                conn, hello, peer = gate.arrivals.get(timeout=0.2)
            except queue.Empty:
                continue
            if gate.admit(conn, hello, peer, world_size, hellos):
                if type(hello) is m.RelayHello:
                    conns[hello.first] = conn
                    hellos.update((h.rank, h) for h in hello.hellos)
                    relays[hello.first] = (hello.host, tuple(range(hello.first, hello.end)))
                else:
                    conns[hello.rank] = conn
                    hellos[hello.rank] = hello
    except BaseException:
        for conn in conns.values():
            conn.close()
        gate.close()
        raise
    gate.refuse_newcomers()
    # in rank order, however the connections arrived (ranks that connect themselves race each other)
    return conns, dict(sorted(hellos.items())), gate, relays


class Fleet:
    """Owns a client and (for local meshes) the worker processes; ``exit`` is idempotent."""

    def __init__(self, client: Client, processes=None, store=None, log_files: dict | None = None,
                 gate: Gatekeeper | None = None, pool_key: tuple | None = None, scope: str = "",
                 spares: tuple[int, ...] = ()) -> None:
        self.client = client
        self.spares = spares  # connected ranks outside the mesh, ready to take a dead worker's place
        self.mesh: Any = None  # the fleet's own mesh (launcher._mesh_for): its repr names the spares
        self.pool_key = pool_key  # a local fleet that may park its workers in the warm pool
        self.scope = scope
        self.gate = gate
        self.processes = processes
        self.store = store
        self.log_files = log_files or {}
        self.exited = False
        self.clean_exit = True
        self.quiet = False  # exit(client_raised=True): the workers leave without elastic's log lines
        # healing (fleet/heal.py): how the workers reach a new client, its generation, each rank's process
        self.reconnect: dict = {}
        self.generation = 0
        self.process_of = {r: r for r in client.ranks}  # rank -> the launcher's index of its process

    def drain(self, timeout: float | None = 60.0) -> None:
        """Wait until every op sent so far has run, so every remote error is known."""
        client = self.client
        if client.failure is not None or client.closed:
            return
        with client.lock:
            if not len(client.history):
                return
            client.request_status(client.last_seq)
        client.pump(timeout, until=lambda: not len(client.history) or client.failure is not None)

    def exit(self, error: str | None = None, detach: bool = False, client_raised: bool = False) -> None:
        """Stop the fleet (``detach``: release an attached fleet for the next client instead).

        After an error (the client raised, Ctrl-C) nobody waits long: workers get a few
        seconds to leave before the launcher stops them.  Where the client's own code raised
        (``client_raised``), the workers leave quietly: their exit follows from the user's
        error, whose traceback is the one to read, so torch elastic's lines about stopping
        them ("Sending process N closing signal SIGTERM", "failed (exitcode: 1)") are not
        printed."""
        if error is None and pending and pending[0][2] is self and not self.exited:  # a step not yet confirmed
            try:
                settle()
            except BaseException as e:
                self.exit(f"{type(e).__name__}: {e}", client_raised=True)  # the error is the user's to read
                raise
        forget(self)
        if self.exited:
            return
        self.quiet = client_raised
        self.clean_exit = error is None
        self.exited = True
        client = self.client
        unobserved = None
        if self.gate is not None:
            self.gate.close()
        park = False
        try:
            if error is None:
                self.drain()
                if client.history.unobserved:
                    unobserved = next(iter(client.history.unobserved.values()))
            park = self.pool_key is not None and error is None and unobserved is None and client.failure is None
            client.shutdown(error if error is not None else (str(unobserved) if unobserved else None),
                            timeout=5.0 if error is not None else 30.0,
                            detach=(detach or park) and error is None)
            park = park and client.failure is None
        finally:
            if park:
                self._park()
            else:
                self._stop_processes()
        if unobserved is not None:
            raise unobserved
        if client.failure is not None and error is None and not client.failure.observed:
            raise client.failure

    def _park(self) -> None:
        """Hand the workers (detached: each waits for its next job) to the warm pool."""
        assert self.pool_key is not None
        pool.park(pool.Parked(self.pool_key, self.scope, self.processes, self.store, self.log_files,
                              time.monotonic()))
        self.processes = None
        idle = pool.idle_timeout()
        n = len(self.client.ranks)
        print(f"tdmesh: {n} worker{'s stay' if n != 1 else ' stays'} warm for {idle:g} s for the next local_mesh of "
              f"this shape; tdmesh.pool.clear() stops {'them' if n != 1 else 'it'} now (TDMESH_POOL_IDLE=0 or "
              f"local_mesh(pool=False): never kept)", file=sys.stderr, flush=True)

    def _stop_processes(self) -> None:
        if self.processes is None:
            return
        if self.client.failure is not None:  # a broken fleet: no one is waiting for a clean exit
            import signal
            try:
                self.processes.close(death_sig=signal.SIGKILL, timeout=5)
            finally:
                self.processes = None
            return
        self._wait_for_processes(30.0 if self.clean_exit else 5.0)

    def _wait_for_processes(self, seconds: float) -> None:
        """Give workers ``seconds`` to exit on their own; then the launcher stops them."""
        with quiet_elastic(self.quiet):
            try:
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline:
                    result = self.processes.wait(timeout=0.1, period=0.02)
                    if result is not None:
                        break
            finally:
                try:
                    self.processes.close(timeout=30 if self.clean_exit else 5)
                finally:
                    self.processes = None

"""A host's relay: the client's frames go to each host once, and come back aggregated.

Each host's first worker runs one, on a thread (README §"Many hosts"; bench/README has what
was measured).  The relay listens; the host's ranks and the relays of its subtree
(:mod:`tdmesh.geometry.fanout`) connect and say hello; then it connects to its parent (the client, or
another host's relay) with one :class:`~tdmesh.protocol.messages.RelayHello` for all of them.

Downstream it forwards every frame unchanged to every child: a frame holds entries for rank
sets (see :mod:`tdmesh.protocol.transport`), and each worker keeps its own, so a relay does no work per
message and no frame grows with the number of ranks.  Upstream it forwards workers' frames
unchanged, except that ``Status`` becomes one per relay (the minimum over the ranks behind it,
sent when it grows) and heartbeats stop here: the relay sends its own, and reports a rank whose
connection closes or that stays silent past the heartbeat timeout as ``RanksLost``.  When its
parent goes away the relay closes every child, so the ranks behind it leave too.
"""

from __future__ import annotations

import io
import logging
import pickle
import selectors
import socket
import time
from typing import Any

from . import messages as m
from .handshake import check_hello, hear, join, welcome
from .schema import check_relay_control, check_worker_message
from .security import server_tls
from .transport import DEFAULT_MAX_FRAME, MAGIC, RELAY_MAGIC, Connection, ProtocolError, connect, hello_ranks

log = logging.getLogger("tdmesh.protocol.relay")

__all__ = ["Relay"]

_SMALL = 512  # upstream frames up to this size may be a Status or a Heartbeat: look inside


class _Upstream(pickle.Unpickler):
    """Reads a small upstream frame only as far as knowing whether it is a Status or Heartbeat."""

    def find_class(self, module: str, name: str):
        if module == m.__name__ and name in ("Status", "Heartbeat"):
            return getattr(m, name)
        raise pickle.UnpicklingError("not for the relay")


def _peek(payload) -> object:
    """The frame's one message if it is a Status or Heartbeat and nothing else, else None."""
    stream = io.BytesIO(payload)
    try:
        msg = _Upstream(stream).load()
        check_worker_message(msg)
    except Exception:  # noqa: BLE001 - anything else travels on unopened (a malformed one: the client rejects it)
        return None
    return msg if stream.tell() == len(payload) else None


class _Child:
    __slots__ = ("conn", "key", "ranks", "relay", "progress", "seen", "lost")

    def __init__(self, conn: Connection, key: int, ranks: tuple[int, ...], relay: bool) -> None:
        self.conn = conn
        self.key = key          # its first rank: the rank its Status names
        self.ranks = ranks
        self.relay = relay
        self.progress = 0
        self.seen = time.monotonic()
        self.lost = False


class Relay:
    """The relay of ``host``, for ranks ``range(first, end)``: the host's own workers connect with
    a Hello each, the relays of its subtree's other hosts with a RelayHello for their ranks."""

    HELLO_TIMEOUT = 10.0

    def __init__(self, host: int, first: int, end: int, token: str, bind: str = "0.0.0.0",
                 heartbeat_interval: float = 2.0, heartbeat_timeout: float = 20.0) -> None:
        self.host, self.first, self.end = host, first, end
        self.token = token
        self.tls = server_tls()
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((bind, 0))
        self.listener.listen(128)
        self.port = self.listener.getsockname()[1]
        self.children: list[_Child] = []
        self.hellos: dict[int, m.Hello] = {}
        self.up: Connection | None = None
        self._sent_progress = 0

    # -- startup ------------------------------------------------------------------------------
    def gather(self, timeout: float) -> None:
        """Accept children, in any order, until every rank of ``range(first, end)`` is behind one."""
        want = set(range(self.first, self.end))
        deadline = time.monotonic() + timeout
        self.listener.settimeout(0.5)
        while want:
            if time.monotonic() > deadline:
                raise TimeoutError(f"host {self.host}'s relay: ranks {sorted(want)} did not connect within "
                                   f"{timeout:.0f} s")
            try:
                sock, peer = self.listener.accept()
            except TimeoutError:
                continue
            try:
                sock.settimeout(self.HELLO_TIMEOUT)
                conn, nonce, hello = hear(sock, self.tls, 1 << 24)
                conn.sock.settimeout(None)
                conn.max_frame = DEFAULT_MAX_FRAME  # past the hello: a child's fetch results may be large
            except (OSError, ProtocolError, pickle.UnpicklingError) as e:
                log.warning("host %d's relay refused a connection from %s: %s", self.host, peer, e)
                Connection(sock).close()
                continue
            if not check_hello(self.token, nonce, hello):
                log.warning("host %d's relay refused a connection from %s: no proof of the job token", self.host, peer)
                conn.close()
            elif type(hello) is m.Hello and hello.rank in want:
                welcome(conn, self.token, nonce, hello)
                want.discard(hello.rank)
                self.hellos[hello.rank] = hello
                self.children.append(_Child(conn, hello.rank, (hello.rank,), False))
            elif type(hello) is m.RelayHello and (ranks := hello_ranks(hello)) is not None and want.issuperset(ranks):
                welcome(conn, self.token, nonce, hello)
                want.difference_update(ranks)
                self.hellos.update({h.rank: h for h in hello.hellos})
                self.children.append(_Child(conn, hello.first, tuple(range(hello.first, hello.end)), True))
            else:
                log.warning("host %d's relay refused %r from %s: not one of its children", self.host,
                            type(hello).__name__, peer)
                conn.close()
        self.listener.close()
        # relays first (their subtrees are deeper), the host's own first worker last: it may
        # leave the moment it reads an Exit, taking this thread with it
        self.children.sort(key=lambda c: (not c.relay, -c.key))

    def connect_up(self, host: str, port: int) -> None:
        self.up = connect(host, port)
        join(self.up, self.token, m.RelayHello(self.host, self.first, self.end, b"", "",
                                               tuple(self.hellos[r] for r in sorted(self.hellos))),
             f"host {self.host}'s relay's parent at {host}:{port}")

    # -- serving ------------------------------------------------------------------------------
    def serve(self) -> None:
        """Forward until the parent goes away; then close every child."""
        assert self.up is not None
        sel = selectors.DefaultSelector()
        sel.register(self.up.sock, selectors.EVENT_READ, None)
        for child in self.children:
            sel.register(child.conn.sock, selectors.EVENT_READ, child)
        next_beat = time.monotonic() + self.heartbeat_interval
        try:
            while True:
                for key, _ in sel.select(timeout=max(0.0, next_beat - time.monotonic())):
                    if key.data is None:
                        while True:  # TLS may hold further frames already read: no selector sees them
                            if not self._downstream():
                                return
                            if not self.up.pending():
                                break
                    elif not self._upstream(key.data, sel):
                        return  # every rank behind it has left: so does the relay
                    else:
                        while not key.data.lost and key.data.conn.pending():
                            if not self._upstream(key.data, sel):
                                return
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self.heartbeat_interval
                    self._beat(now)
        except OSError as e:  # the parent's connection broke: nobody is left to serve
            log.warning("host %d's relay: its parent's connection failed (%s); closing its ranks", self.host, e)
        finally:
            for child in self.children:
                child.conn.close()
            self.up.close()

    def _downstream(self) -> bool:
        assert self.up is not None
        frame = self.up.recv_frame((MAGIC, RELAY_MAGIC))
        if frame is None:
            return False
        magic, payload = frame
        if magic == RELAY_MAGIC:
            try:
                config = pickle.loads(payload)
                check_relay_control(config)
            except Exception as e:  # noqa: BLE001 - a broken control frame ends the relay's session
                raise ProtocolError(f"host {self.host}'s relay got a broken control frame: "
                                    f"{type(e).__name__}: {e}") from e
            self.heartbeat_interval, self.heartbeat_timeout = config
            for child in self.children:
                if child.relay and not child.lost:
                    self._send_child(child, lambda c: c.conn.send_control(config))
            return True
        crc = self.up.last_checksum  # checked on the way in
        for child in self.children:
            if not child.lost:
                self._send_child(child, lambda c: c.conn.send_payload(payload, crc))
        return True

    def _send_child(self, child: _Child, send) -> None:
        try:
            send(child)
        except OSError as e:
            self._lose(child, f"sending to it through host {self.host}'s relay failed: {e}")

    def _upstream(self, child: _Child, sel) -> bool:
        """Handle a frame from ``child``; False once no child is left."""
        assert self.up is not None
        try:
            payload = child.conn.recv_payload()
        except (OSError, ProtocolError) as e:
            payload = None
            why = str(e)
        else:
            why = f"its connection to host {self.host}'s relay closed"
        if payload is None:
            sel.unregister(child.conn.sock)
            child.conn.close()
            self._lose(child, why)
            return not all(c.lost for c in self.children)
        child.seen = time.monotonic()
        msg: Any = _peek(payload) if len(payload) <= _SMALL else None
        t = type(msg)
        if t is m.Status:
            if msg.first_uncompleted > child.progress:
                child.progress = msg.first_uncompleted
                low = min(c.progress for c in self.children)
                if low > self._sent_progress:
                    self._sent_progress = low
                    self.up.send_messages([m.Status(self.first, low)])
        elif t is not m.Heartbeat:
            self.up.send_payload(payload, child.conn.last_checksum)  # checked on the way in
        return True

    def _beat(self, now: float) -> None:
        assert self.up is not None
        for child in self.children:
            if not child.lost and now - child.seen > self.heartbeat_timeout:
                self._lose(child, f"nothing heard for {now - child.seen:.1f} s (heartbeat_timeout="
                                  f"{self.heartbeat_timeout} s); it is hung or unreachable")
        self.up.send_messages([m.Heartbeat(self.first)])

    def _lose(self, child: _Child, why: str) -> None:
        if child.lost:
            return
        child.lost = True
        assert self.up is not None
        self.up.send_messages([m.RanksLost(child.ranks, why)])

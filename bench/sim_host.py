"""One simulated host of ``bench/scale.py``: the real relay, and a sink that answers for the host's ranks.

    python bench/sim_host.py HOST FIRST END SUBTREE_END [--direct]

No torch: the sink speaks the worker protocol (hello, entries, Status, FetchResult, heartbeats)
without running anything.  It decodes each frame once for all of its ranks, answers
RequestStatus for them (one Status, as the relay would aggregate it) and SendValue for the
members of the message's rank set (a pickled ``None``: the value path is not what is measured).
It prints its relay's port, then reads its parent's address (the client or another host's
relay) and the job token from stdin.  ``--direct``: no relay; the sink (one rank) connects to the client.
"""

from __future__ import annotations

import io
import os
import pickle
import socket
import sys
import threading
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if "tdmesh" not in sys.modules:  # the package's __init__ imports torch; a sink needs only the protocol
    _package = types.ModuleType("tdmesh")
    _package.__path__ = [os.path.join(REPO, "tdmesh")]
    sys.modules["tdmesh"] = _package

from tdmesh.protocol import messages as m  # noqa: E402
from tdmesh.protocol.handshake import join  # noqa: E402
from tdmesh.protocol.relay import Relay  # noqa: E402
from tdmesh.protocol.transport import ALL_RANKS, DEFINE_SET, ENTRY, MAGIC, RELAY_MAGIC, connect  # noqa: E402

_NONE = pickle.dumps(None)


class _Protocol(pickle.Unpickler):
    """Reads a message only if it is built of the protocol's own records (what the sink answers);
    anything else (a DefineOp's dtypes and devices, a CallFunction's torch values) is left unread: unpickling
    those imported torch into every simulated host (220 MB each: 256 hosts did not fit in 24 GiB)."""

    def find_class(self, module: str, name: str):
        if module in (m.__name__, "tdmesh.geometry.slice") or (module, name) == ("builtins", "range"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}: not a protocol record")


def _load(body):
    """The message of an entry's ``body``, or None when the sink has nothing to do with it."""
    try:
        return _Protocol(io.BytesIO(body)).load()
    except pickle.UnpicklingError:
        return None


def sink(conn, host: int, first: int, end: int, token: str, direct: bool) -> None:
    ranks = range(first, end)
    hellos = tuple(m.Hello(r, b"", "", socket.gethostname(), os.getpid(), "cpu", None) for r in ranks)
    join(conn, token, hellos[0] if direct else m.RelayHello(host, first, end, b"", "", hellos), "the sink's parent")
    lock = threading.Lock()
    stop = threading.Event()

    def send(msg) -> None:  # one message a frame, as workers send them
        with lock:
            conn.send_messages([msg])

    def beat(interval: float) -> None:
        while not stop.wait(interval):
            send(m.Heartbeat(first))

    members: dict[int, range | list[int]] = {ALL_RANKS: ranks}
    unpack, size, loads = ENTRY.unpack_from, ENTRY.size, _load
    try:
        while True:
            frame = conn.recv_frame((MAGIC, RELAY_MAGIC))
            if frame is None:
                return
            if frame[0] == RELAY_MAGIC:  # the relay passes its configuration down to what looks like a relay
                continue
            payload = frame[1]
            view, pos, n_bytes = memoryview(payload), 0, len(payload)
            while pos < n_bytes:
                set_id, n = unpack(payload, pos)
                pos += size
                body, pos = view[pos:pos + n], pos + n
                if set_id == DEFINE_SET:
                    defined, slices = loads(body)
                    members[defined] = [r for r in ranks if any(r in s for s in slices)]
                    continue
                mine = members[set_id]
                if not mine:
                    continue
                msg = loads(body)
                kind = type(msg)
                if kind is tuple:  # CallOp / CallRecording: nothing to run
                    continue
                if kind is m.RequestStatus:
                    send(m.Status(first, msg.seq + 1))
                elif kind is m.SendValue:
                    for r in mine:
                        send(m.FetchResult(msg.seq, _NONE, None, r))
                elif kind is m.Supervise:
                    threading.Thread(target=beat, args=(msg.heartbeat_interval,), daemon=True).start()
                elif kind in (m.Exit, m.Detach):
                    return
    finally:
        stop.set()
        conn.close()


def main(argv: list[str]) -> None:
    host, first, end, subtree_end = (int(a) for a in argv[:4])
    if "--direct" in argv:
        print(0, flush=True)
        up_host, up_port, token = sys.stdin.readline().split()
        sink(connect(up_host, int(up_port)), host, first, end, token, True)
        return
    relay = Relay(host, first, subtree_end, "", bind="127.0.0.1")
    print(relay.port, flush=True)
    up_host, up_port, token = sys.stdin.readline().split()
    relay.token = token

    def run() -> None:
        relay.gather(300)
        relay.connect_up(up_host, int(up_port))
        relay.serve()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    sink(connect("127.0.0.1", relay.port), host, first, end, token, False)
    thread.join(10)


if __name__ == "__main__":
    main(sys.argv[1:])

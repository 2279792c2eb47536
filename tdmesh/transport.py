"""Framed connections between the client and its workers.

A frame is ``MAGIC | u64 length | payload``, where the payload is a run of pickles, one per
message.  Pickling each message once and concatenating the bytes lets the client send the
same bytes to every rank of a mesh without re-serialising per recipient.  Frames over
``max_frame`` bytes or with a bad magic are refused: the peer is not one of ours.
"""

from __future__ import annotations

import io
import pickle
import socket
import struct
from collections.abc import Iterable, Iterator

from .errors import ProtocolError

__all__ = ["MAGIC", "DEFAULT_MAX_FRAME", "Connection", "ProtocolError", "connect", "decode", "encode"]

MAGIC = b"TDM1"
_HEADER = struct.Struct("!4sQ")
DEFAULT_MAX_FRAME = 1 << 34  # 16 GiB: a fetch of a big tensor is one frame


def encode(msg) -> bytes:
    """One message as the bytes that go into a frame."""
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def decode(payload) -> Iterator:
    """The messages of one frame payload, in order."""
    stream = io.BytesIO(payload)
    end = len(payload)
    load = pickle.load
    while stream.tell() < end:  # each message is its own pickle, with its own memo
        try:
            msg = load(stream)
        except Exception as e:  # truncated or corrupt pickle: the peer broke the protocol
            raise ProtocolError(f"undecodable message at byte {stream.tell()} of a {end}-byte frame: "
                                f"{type(e).__name__}: {e}") from e
        yield msg


class Connection:
    """One socket carrying frames both ways.  ``send_*`` is not thread-safe; callers lock."""

    def __init__(self, sock: socket.socket, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.sock = sock
        self.max_frame = max_frame
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def fileno(self) -> int:
        return self.sock.fileno()

    def send_payload(self, payload: bytes | bytearray | memoryview) -> None:
        header = _HEADER.pack(MAGIC, len(payload))
        if len(payload) < 65536:
            self.sock.sendall(header + bytes(payload))
        else:
            self.sock.sendall(header)
            self.sock.sendall(payload)

    def send_messages(self, msgs: Iterable) -> None:
        self.send_payload(b"".join(encode(m) for m in msgs))

    def recv_payload(self) -> bytearray | None:
        """The next frame's payload, or ``None`` when the peer closed cleanly between frames."""
        header = self._recv_exact(_HEADER.size, allow_eof=True)
        if header is None:
            return None
        magic, length = _HEADER.unpack(header)
        if magic != MAGIC:
            raise ProtocolError(f"bad frame magic {magic!r} (expected {MAGIC!r}): not a tdmesh peer")
        if length > self.max_frame:
            raise ProtocolError(f"frame of {length} bytes exceeds the limit of {self.max_frame} bytes")
        return self._recv_exact(length, allow_eof=False)

    def recv_messages(self) -> list | None:
        payload = self.recv_payload()
        return None if payload is None else list(decode(payload))

    def _recv_exact(self, n: int, allow_eof: bool) -> bytearray | None:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                if got == 0 and allow_eof:
                    return None
                raise ProtocolError(f"connection closed mid-frame ({got} of {n} bytes)")
            got += k
        return buf  # no copy: a large fetch is held once

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def connect(host: str, port: int, timeout: float = 60.0) -> Connection:
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.settimeout(None)
    return Connection(sock)

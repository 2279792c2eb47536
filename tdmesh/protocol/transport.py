"""Framed connections between the client and its workers.

A frame is ``MAGIC | u64 length | u32 CRC-32 of the payload | payload``.  Upstream (worker ->
client) the payload is a run of pickles, one per message; a message holding big buffers (a
fetched tensor's bytes) makes it a bulk frame, whose buffers follow the messages unpickled and
outside the checksum (:mod:`tdmesh.protocol.bulk`).  Downstream (client -> workers) it is a run of
*entries*, ``u32 rank set | u32 length | pickle``: the client pickles each message once and
sends the same frame to every child (a worker, or a host's relay that forwards it unchanged),
and each worker keeps the entries of the rank sets it belongs to (:class:`RankFilter`).  A
message holding big buffers (an uploaded tensor's bytes) is one entry preceded by a
``BUFFERS`` entry of their sizes; the frame is then a bulk frame whose bulk is those buffers,
sent from the client's memory and read in place by the worker, as fetches are upstream.  A
frame's size never depends on how many ranks receive it.  Relays also get control frames of
their own (``RELAY_MAGIC``).  Frames over ``max_frame`` bytes or with a bad magic are refused:
the peer is not one of ours.  A frame whose checksum does not match was damaged on its way and
is refused before anything in it is unpickled: CPython's C unpickler can spend minutes and
gigabytes on a few damaged bytes (a memo index read from the middle of a string allocates 16
bytes per unit of the index; CPython issue gh-115952), so damaged bytes must never reach it.
"""

from __future__ import annotations

import io
import pickle
import socket
import struct
import zlib
from collections.abc import Iterable, Iterator

from ..config import env_int
from ..errors import ProtocolError
from ..geometry.slice import Slice
from . import messages as m
from .bulk import BULK_MAGIC, BulkFrame, big_buffers_into, bulk_parts, covered, frame_parts, reader, split, take_block
from .security import client_tls

__all__ = ["MAGIC", "RELAY_MAGIC", "DEFAULT_MAX_FRAME", "Connection", "ProtocolError", "connect", "decode",
           "encode", "call_op_entry", "ENTRY", "ALL_RANKS", "DEFINE_SET", "entries", "RankFilter", "decode_hello",
           "decode_restricted",
           "hello_ranks", "checksum", "FRAME_HEADER", "BUFFERS", "buffers_entry"]

MAGIC = b"TDM1"
RELAY_MAGIC = b"TDMR"  # a frame for the relay itself (its configuration), not forwarded to workers
FRAME_HEADER = struct.Struct("!4sQI")  # magic, payload length, CRC-32 of the payload
ENTRY = struct.Struct("!II")  # rank set id, length of the pickle that follows
ALL_RANKS = 0                 # the rank set every rank belongs to
DEFINE_SET = 0xFFFFFFFF       # an entry that defines a rank set: pickle of (id, tuple of Slices)
BUFFERS = 0xFFFFFFFE          # u64 sizes of the next entry's out-of-band buffers, which lie in the frame's bulk
DEFAULT_MAX_FRAME = env_int("TDMESH_MAX_FRAME")  # 16 GiB by default: a fetch of a big tensor is one frame


def checksum(payload) -> int:
    """The CRC-32 a frame of ``payload`` carries (of what it covers: :func:`tdmesh.protocol.bulk.covered`);
    computed once for a payload sent to many peers."""
    return zlib.crc32(covered(payload))


def encode(msg) -> bytes:
    """One message as the bytes that go into a frame."""
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def decode(payload) -> Iterator:
    """The messages of one frame payload, in order (a :class:`BulkFrame`'s with their buffers)."""
    structure, bulk = split(payload)
    stream = reader(structure)
    end, taken = len(structure), 0
    load = pickle.load
    while (at := stream.tell()) < end:  # each message is its own pickle, with its own memo
        try:
            if structure[at] == 0:  # a message whose big buffers are in the bulk: views of it, not copies
                buffers, at, taken = take_block(structure, at, bulk, taken)
                stream.seek(at)
                msg = load(stream, buffers=buffers)
            else:
                msg = load(stream)
        except ProtocolError:
            raise
        except Exception as e:  # truncated or corrupt pickle: the peer broke the protocol
            raise ProtocolError(f"undecodable message at byte {stream.tell()} of a {end}-byte frame: "
                                f"{type(e).__name__}: {e}") from e
        yield msg
    if taken != len(bulk):
        raise ProtocolError(f"{len(bulk) - taken} bytes of a frame's bulk belong to no message")


def entries(msgs: Iterable, set_id: int = ALL_RANKS, out_of_band: int | None = None) -> bytes | BulkFrame:
    """``msgs`` as a downstream payload, every message for the rank set ``set_id``; with
    ``out_of_band``, their PickleBuffers of that size or more travel in a bulk (a copy here:
    the client's :class:`tdmesh.engine.outbox.Outbox` sends them from where they lie)."""
    out: list = []
    bulk: list = []
    for msg in msgs:
        buffers: list = []
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL,
                            buffer_callback=None if out_of_band is None else big_buffers_into(buffers, out_of_band))
        if buffers:
            out.extend(buffers_entry(buffers))
            bulk.extend(b.raw() for b in buffers)
        out.append(ENTRY.pack(set_id, len(data)))
        out.append(data)
    structure = b"".join(out)
    if not bulk:
        return structure
    return BulkFrame(b"".join(bytes(p) for p in bulk_parts(structure, bulk)[0]))


# A bare CallOp's entry, its pickle written by hand: the eager hot path queues one per op, and
# ``pickle.dumps`` of the tuple plus the entry's header cost ~0.7 us more than one ``struct`` pack
# (bench/README, twenty-ninth session).  The bytes are a pickle any ``pickle.loads`` reads as the
# tuple ``(seq, op, (result,), (), refs, stream)``: PROTO 5, MARK, a BININT ('J', int32 little-endian)
# per int, TUPLE1/2/3 for the one-tuples, EMPTY_TUPLE, TUPLE (from the mark), STOP; no memo.  A value
# past int32 (a job past 2**31 ops) or more than 3 refs takes pickle's own encoding.
def _call_op_struct(k: int) -> struct.Struct:
    # after the result: TUPLE1 ) ) 'J' (no refs), or TUPLE1 ) 'J' ref ('J' ref)... TUPLEk 'J'
    after_result = "4s" if not k else "3si" + "ci" * (k - 1) + "2s"
    return struct.Struct("<12sicici" + after_result + "i2s")


_CALL_OP_STRUCTS = {k: _call_op_struct(k) for k in range(4)}
_call_op_prefixes: dict[int, bytes] = {}  # set id * 4 + refs -> entry header + PROTO + MARK + 'J'


def call_op_entry(set_id: int, seq: int, op: int, result: int, refs: tuple, stream: int) -> bytes:
    """The entry of a bare CallOp ``(seq, op, (result,), (), refs, stream)`` for rank set ``set_id``."""
    k = len(refs)
    if k < 4:
        key = set_id * 4 + k
        prefix = _call_op_prefixes.get(key)
        if prefix is None:
            prefix = _call_op_prefixes[key] = ENTRY.pack(set_id, _CALL_OP_STRUCTS[k].size - ENTRY.size) + b"\x80\x05(J"
        try:
            if k == 1:
                return _PACK_1(prefix, seq, b"J", op, b"J", result, b"\x85)J", refs[0], b"\x85J", stream, b"t.")
            if k == 2:
                return _PACK_2(prefix, seq, b"J", op, b"J", result, b"\x85)J", refs[0], b"J", refs[1], b"\x86J", stream,
                               b"t.")
            if k == 3:
                return _PACK_3(prefix, seq, b"J", op, b"J", result, b"\x85)J", refs[0], b"J", refs[1], b"J", refs[2],
                               b"\x87J", stream, b"t.")
            return _PACK_0(prefix, seq, b"J", op, b"J", result, b"\x85))J", stream, b"t.")
        except struct.error:  # past int32: pickle's encoding below
            pass
    data = pickle.dumps((seq, op, (result,), (), refs, stream), protocol=pickle.HIGHEST_PROTOCOL)
    return ENTRY.pack(set_id, len(data)) + data


_PACK_0, _PACK_1, _PACK_2, _PACK_3 = (_CALL_OP_STRUCTS[k].pack for k in range(4))


def buffers_entry(buffers: list) -> list[bytes]:
    """The ``BUFFERS`` entry announcing ``buffers`` (PickleBuffers) for the entry after it."""
    sizes = struct.pack(f"!{len(buffers)}Q", *(b.raw().nbytes for b in buffers))
    return [ENTRY.pack(BUFFERS, len(sizes)), sizes]


class RankFilter:
    """One rank's reading of downstream payloads: the messages of the rank sets it belongs to,
    in order.  Entries for other ranks are skipped without being unpickled; their out-of-band
    buffers (in a bulk frame's bulk) are skipped too."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.member: dict[int, bool] = {ALL_RANKS: True}

    def messages(self, payload) -> list:
        out: list = []
        structure, bulk = split(payload)
        end = len(structure)
        view = memoryview(structure)
        unpack, size, member, loads = ENTRY.unpack_from, ENTRY.size, self.member, pickle.loads
        pos = taken = 0
        buffers: list | None = None  # announced by a BUFFERS entry, for the next entry
        try:
            while pos < end:
                set_id, n = unpack(structure, pos)
                pos += size
                if pos + n > end:
                    raise ProtocolError(f"an entry of {n} bytes at byte {pos} overruns a {end}-byte frame")
                if set_id == BUFFERS:
                    if buffers is not None or n % 8:
                        raise ProtocolError(f"a buffers entry at byte {pos} follows another or is not u64 sizes")
                    buffers = []
                    for length in struct.unpack_from(f"!{n // 8}Q", structure, pos):
                        if taken + length > len(bulk):
                            raise ProtocolError(f"an out-of-band buffer of {length} bytes overruns the frame's "
                                                f"{len(bulk)}-byte bulk")
                        buffers.append(bulk[taken:taken + length])
                        taken += length
                elif set_id == DEFINE_SET:
                    if buffers is not None:
                        raise ProtocolError(f"out-of-band buffers at byte {pos} precede a rank set definition")
                    defined, slices = loads(view[pos:pos + n])
                    if type(defined) is not int or type(slices) is not tuple or \
                            not all(type(s) is Slice for s in slices):
                        raise ProtocolError(f"a rank set definition at byte {pos} is not (int id, tuple of Slices)")
                    member[defined] = any(self.rank in s for s in slices)
                else:
                    if member[set_id]:
                        out.append(loads(view[pos:pos + n]) if buffers is None else
                                   loads(view[pos:pos + n], buffers=buffers))
                    buffers = None
                pos += n
        except KeyError as e:
            raise ProtocolError(f"an entry names rank set {e.args[0]}, which was never defined") from None
        except ProtocolError:
            raise
        except Exception as e:  # truncated or corrupt: the peer broke the protocol
            raise ProtocolError(f"undecodable entry at byte {pos} of a {end}-byte frame: "
                                f"{type(e).__name__}: {e}") from e
        if buffers is not None:
            raise ProtocolError("a frame ends with out-of-band buffers that no message takes")
        if taken != len(bulk):
            raise ProtocolError(f"{len(bulk) - taken} bytes of a frame's bulk belong to no message")
        return out


class _RestrictedUnpickler(pickle.Unpickler):
    """Decodes a frame of a peer not yet authenticated.  Unpickling runs whatever globals a
    pickle names, so before the handshake's proof checks nothing but the expected records (a
    ``Hello``, a relay's ``RelayHello`` of Hellos, a ``Challenge``, a ``Welcome``) and pickle's
    primitive values may be built: a plain ``pickle.loads`` would run a stranger's code."""

    def __init__(self, stream, names: tuple[str, ...]) -> None:
        super().__init__(stream)
        self.names = names

    def find_class(self, module: str, name: str):
        if module == m.__name__ and name in self.names:
            return getattr(m, name)
        raise pickle.UnpicklingError(f"a handshake frame may only hold {' or '.join(self.names)}, "
                                     f"not {module}.{name}")


def decode_restricted(payload, names: tuple[str, ...]) -> object:
    """The one message of a handshake frame, decoded safely, which must be one of ``names``."""
    stream = io.BytesIO(payload)
    inner = ("Hello",) if "RelayHello" in names and "Hello" not in names else ()  # a RelayHello holds Hellos
    msg = _RestrictedUnpickler(stream, names + inner).load()
    if stream.tell() != len(payload):
        raise ProtocolError(f"{len(payload) - stream.tell()} bytes after the first message")
    if type(msg).__name__ not in names or type(msg).__module__ != m.__name__:
        raise ProtocolError(f"expected {' or '.join(names)}, got {type(msg).__name__}")
    return msg


def decode_hello(payload) -> object:
    """The one message of a connection's first frame: a worker's Hello or a relay's RelayHello."""
    return decode_restricted(payload, ("Hello", "RelayHello"))


def hello_ranks(hello) -> list | None:
    """The ranks a hello speaks for: a worker's own, or every rank behind a relay (checked
    against the Hellos it carries); None for anything malformed."""
    if type(hello) is m.Hello:
        return [hello.rank]
    if type(hello) is not m.RelayHello or not (isinstance(hello.first, int) and isinstance(hello.end, int)
                                               and isinstance(hello.hellos, tuple)):
        return None
    ranks = list(range(hello.first, hello.end))
    if [getattr(h, "rank", None) for h in hello.hellos] != ranks or not all(type(h) is m.Hello for h in hello.hellos):
        return None
    return ranks


class Connection:
    """One socket carrying frames both ways.  ``send_*`` is not thread-safe; callers lock."""

    def __init__(self, sock: socket.socket, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.sock = sock
        self.max_frame = max_frame
        self.last_checksum = 0  # of the last frame received: a relay forwards it with the frame
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def fileno(self) -> int:
        return self.sock.fileno()

    def send_payload(self, payload: bytes | bytearray | memoryview, checksum: int | None = None) -> None:
        """One frame of ``payload`` (a received :class:`BulkFrame` goes on as one); ``checksum``
        when a caller sending the same payload to many peers, or forwarding it, has it already."""
        self._send(BULK_MAGIC if type(payload) is BulkFrame else MAGIC, [payload],
                   zlib.crc32(covered(payload)) if checksum is None else checksum)

    def send_parts(self, parts: list, checksum: int, bulk: bool) -> None:
        """One frame whose payload is ``parts`` in order (a bulk frame's: :func:`tdmesh.protocol.bulk.bulk_parts`)."""
        self._send(BULK_MAGIC if bulk else MAGIC, parts, checksum)

    def send_messages(self, msgs: Iterable) -> None:
        is_bulk, parts, checksum = frame_parts(msgs)
        self._send(BULK_MAGIC if is_bulk else MAGIC, parts, checksum)

    def _send(self, magic: bytes, parts: list, checksum: int) -> None:
        header = FRAME_HEADER.pack(magic, sum(memoryview(p).nbytes for p in parts), checksum)
        if len(parts) == 1 and len(parts[0]) < 65536:
            self.sock.sendall(header + bytes(parts[0]))
            return
        self.sock.sendall(header)
        for part in parts:  # a bulk buffer goes from where it lies (a tensor's memory) into the socket
            self.sock.sendall(part)

    def send_control(self, msg) -> None:
        """A control frame for a relay (pickled ``msg``)."""
        payload = encode(msg)
        self.sock.sendall(FRAME_HEADER.pack(RELAY_MAGIC, len(payload), zlib.crc32(payload)) + payload)

    def recv_payload(self) -> bytearray | None:
        """The next frame's payload, or ``None`` when the peer closed cleanly between frames."""
        frame = self.recv_frame()
        return None if frame is None else frame[1]

    def recv_frame(self, magics: tuple[bytes, ...] = (MAGIC,)) -> tuple[bytes, bytearray] | None:
        """The next frame as (magic, payload); ``None`` on a clean close between frames.  Where
        ``MAGIC`` is expected a bulk frame may come too (magic ``MAGIC``, payload a BulkFrame)."""
        header = self._recv_exact(FRAME_HEADER.size, allow_eof=True)
        if header is None:
            return None
        magic, length, checksum = FRAME_HEADER.unpack(header)
        bulk = magic == BULK_MAGIC and MAGIC in magics
        if magic not in magics and not bulk:
            raise ProtocolError(f"bad frame magic {magic!r} (expected {MAGIC!r}): not a tdmesh peer")
        if length > self.max_frame:
            raise ProtocolError(f"frame of {length} bytes exceeds the limit of {self.max_frame} bytes")
        payload = self._recv_exact(length, allow_eof=False, into=BulkFrame if bulk else bytearray)
        assert payload is not None
        if zlib.crc32(covered(payload)) != checksum:
            raise ProtocolError(f"a {length}-byte frame failed its checksum: it was damaged on its way")
        self.last_checksum = checksum
        return MAGIC if bulk else magic, payload

    def recv_payloads(self) -> list[bytearray] | None:
        """The next frame's payload, and those of every later frame TLS has already read in (a
        selector does not see bytes decrypted into the TLS buffer: see ``pending``); ``None`` on
        a clean close before the first."""
        payload = self.recv_payload()
        if payload is None:
            return None
        payloads = [payload]
        while self.pending() and (payload := self.recv_payload()) is not None:
            payloads.append(payload)
        return payloads

    def recv_messages(self) -> list | None:
        """The messages of ``recv_payloads``."""
        payloads = self.recv_payloads()
        return None if payloads is None else [msg for payload in payloads for msg in decode(payload)]

    def pending(self) -> int:
        """Bytes already read from the socket into TLS's buffer, which no selector reports."""
        pending = getattr(self.sock, "pending", None)
        return pending() if pending is not None else 0

    def _recv_exact(self, n: int, allow_eof: bool, into: type = bytearray) -> bytearray | None:
        buf = into(n)
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
    """A connection to a listener (the client's gate, a relay); inside TLS when TDMESH_TLS_CERT,
    TDMESH_TLS_KEY and TDMESH_TLS_CA are set."""
    sock = socket.create_connection((host, port), timeout=timeout)
    tls = client_tls()
    if tls is not None:
        sock = tls.wrap_socket(sock, server_hostname=host)
    sock.settimeout(None)
    return Connection(sock)

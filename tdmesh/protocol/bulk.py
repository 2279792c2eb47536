"""Big buffers on the wire: bulk frames, and reading frames in place.

A fetch of a big tensor used to be bound by copies of its bytes (each ~36 ms per 64 MiB of
fresh memory on a 2-core VM, as much on a 16-core host): into the worker's pickle of the
value, into the pickle of the FetchResult, into the client's ``io.BytesIO``, out of both
pickles again.  Here a message's PickleBuffers of ``OUT_OF_BAND`` bytes or more (a packed
tensor's memory, :func:`tdmesh.protocol.codec.pickle_value`) stay out of its pickle: the frame becomes
a *bulk frame* (``BULK_MAGIC``), whose payload is

    u64 n | n bytes of messages | bulk

where each message with big buffers is ``0 | u32 count | u64 size x count`` then its pickle,
and the bulk is those buffers, in order, sent from where they lie and read in place as views
of the received frame.  The frame's checksum covers the ``8 + n`` bytes of messages, which the
unpickler reads (damaged bytes must never reach it: see :mod:`tdmesh.protocol.transport`), not the bulk,
which nothing parses: damage there would change a tensor's values, as on any TCP transfer
(gloo's and NCCL's included), never what runs.  Checksumming the bulk would cost two passes
over it (~29 ms per 64 MiB each here): as much as the transfer itself.
"""

from __future__ import annotations

import io
import pickle
import struct
import zlib
from collections.abc import Callable, Iterable

from ..errors import ProtocolError

__all__ = ["BULK_MAGIC", "OUT_OF_BAND", "BulkFrame", "big_buffers_into", "frame_parts", "bulk_parts", "covered",
           "split", "take_block", "reader"]

BULK_MAGIC = b"TDMB"
OUT_OF_BAND = 1 << 20  # PickleBuffers from this size on travel in a bulk frame's bulk, not inside their pickle
_BLOCK = struct.Struct("!BI")  # 0 (no pickle starts so) | how many buffers; then their u64 sizes, then the pickle
_STRUCTURE = struct.Struct("!Q")  # how many bytes of messages come before the bulk
_IN_PLACE = 1 << 20  # messages from this size on are read in place; smaller ones through io.BytesIO (faster per call)


class BulkFrame(bytearray):
    """The payload of a received ``BULK_MAGIC`` frame (see the module's docstring)."""


def big_buffers_into(buffers: list, limit: int = OUT_OF_BAND) -> Callable[[pickle.PickleBuffer], bool]:
    """A pickle ``buffer_callback`` that leaves PickleBuffers of ``limit`` bytes or more out of
    the pickle (answering False), collected into ``buffers``, and keeps smaller ones in it."""
    def keep_in_band(buffer: pickle.PickleBuffer) -> bool:
        if buffer.raw().nbytes < limit:
            return True
        buffers.append(buffer)
        return False
    return keep_in_band


def frame_parts(msgs: Iterable, out_of_band: int = OUT_OF_BAND) -> tuple[bool, list, int]:
    """``msgs`` as one frame: (whether it is a bulk frame, the pieces of its payload, its checksum)."""
    pieces, bulk = [], []
    for msg in msgs:
        buffers: list = []
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL,
                            buffer_callback=big_buffers_into(buffers, out_of_band))
        if buffers:
            raws = [b.raw() for b in buffers]
            pieces.append(_BLOCK.pack(0, len(raws)) + struct.pack(f"!{len(raws)}Q", *(r.nbytes for r in raws)))
            bulk.extend(raws)
        pieces.append(data)
    messages = pieces[0] if len(pieces) == 1 else b"".join(pieces)
    if not bulk:
        return False, [messages], zlib.crc32(messages)
    parts, checksum = bulk_parts(messages, bulk)
    return True, parts, checksum


def bulk_parts(messages, bulk: list) -> tuple[list, int]:
    """A bulk frame's payload as the pieces to send (its messages, then ``bulk``'s buffers from
    where they lie) and its checksum, which covers the messages only."""
    head = _STRUCTURE.pack(len(messages))
    return [head, messages, *bulk], zlib.crc32(messages, zlib.crc32(head))


def covered(payload) -> memoryview:
    """The part of a received payload its checksum covers: all of it, or a bulk frame's messages."""
    view = memoryview(payload)
    if type(payload) is not BulkFrame:
        return view
    n = _STRUCTURE.unpack_from(payload)[0] if len(payload) >= _STRUCTURE.size else len(payload)
    if _STRUCTURE.size + n > len(payload):
        raise ProtocolError(f"a bulk frame of {len(payload)} bytes declares {n} bytes of messages")
    return view[:_STRUCTURE.size + n]


def split(payload) -> tuple:
    """A payload's messages and its bulk (empty but for a BulkFrame), as views where they are big."""
    if type(payload) is not BulkFrame:
        return payload, memoryview(b"")
    head = covered(payload)
    return head[_STRUCTURE.size:], memoryview(payload)[len(head):]


def take_block(messages, at: int, bulk, taken: int) -> tuple[list, int, int]:
    """The buffers of the block at ``at`` (views of ``bulk`` from ``taken`` on), where its
    pickle starts, and how much of the bulk is taken after them."""
    end = len(messages)
    if at + _BLOCK.size > end:
        raise ProtocolError(f"an out-of-band block at byte {at} of a {end}-byte frame is cut short")
    _, count = _BLOCK.unpack_from(messages, at)
    at += _BLOCK.size
    if at + 8 * count > end:
        raise ProtocolError(f"an out-of-band block of {count} buffers overruns a {end}-byte frame")
    buffers = []
    for size in struct.unpack_from(f"!{count}Q", messages, at):
        if taken + size > len(bulk):
            raise ProtocolError(f"an out-of-band buffer of {size} bytes overruns the frame's {len(bulk)}-byte bulk")
        buffers.append(bulk[taken:taken + size])
        taken += size
    return buffers, at + 8 * count, taken


def reader(messages):
    """A file to unpickle ``messages`` from: ``io.BytesIO`` (which copies a bytearray whole
    first) for small ones, a reader in place for big ones."""
    return io.BytesIO(messages) if len(messages) < _IN_PLACE else _InPlace(messages)


class _InPlace:
    def __init__(self, buf) -> None:
        self.view = memoryview(buf)
        self.pos = 0

    def read(self, n: int = -1) -> bytes:
        end = len(self.view) if n < 0 else min(len(self.view), self.pos + n)
        out = bytes(self.view[self.pos:end])
        self.pos = end
        return out

    def readinto(self, b) -> int:
        n = min(len(b), len(self.view) - self.pos)
        memoryview(b).cast("B")[:n] = self.view[self.pos:self.pos + n]
        self.pos += n
        return n

    def readline(self) -> bytes:  # only protocol-0 opcodes read lines: short ones
        at = self.pos
        while at < len(self.view):
            found = bytes(self.view[at:at + 4096]).find(b"\n")
            if found >= 0:
                return self.read(at + found + 1 - self.pos)
            at += 4096
        return self.read()

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int) -> None:
        self.pos = pos

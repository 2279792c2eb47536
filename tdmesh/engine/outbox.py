"""What the client has queued for its workers: one log of entries, sent whole to each child.

A message is pickled once and appended once, with the id of the rank set it is for; a flush
sends the same payload to every child (a worker, or a host's relay), and each worker keeps
the entries of its own rank sets.  So the client's work per op never depends on how many
ranks receive it, and its work per flush on how many children it has (at most the relay
fan-out).  A rank set is defined on first use by an entry that describes it as slices (a
mesh's own :class:`Slice`), so a frame never grows with the number of ranks either.
A message's big buffers (an uploaded tensor's memory) are not copied into the log: they are
sent from where they lie, as the bulk of a bulk frame (:mod:`tdmesh.protocol.transport`).
"""

from __future__ import annotations

import pickle
import socket
import zlib

from ..config import env_str, usable_cores
from ..geometry.fanout import rank_set
from ..protocol.bulk import BulkFrame, big_buffers_into, bulk_parts
from ..protocol.transport import ALL_RANKS, DEFINE_SET, ENTRY, buffers_entry, call_op_entry

__all__ = ["Outbox", "flush_interval"]

# Seconds between timed sends while the client issues.  An early send lets the workers run an op
# while the client issues the next; that needs a core of their own.  Where the client and its
# workers share too few cores, each frame's wake-ups (relay, message loops, streams) preempt the
# client instead: on 2 cores with 2 CPU workers a 5 ms interval made the tiny GPT's eager step
# 4-9% faster than 2 ms (paired in-process rounds, bench/README, twentieth session).
FLUSH_INTERVAL = 0.002
SHARED_CORES_FLUSH_INTERVAL = 0.005


def flush_interval(hellos: dict) -> float:
    """``TDMESH_FLUSH_INTERVAL``, with 'auto' decided by whether this host's worker processes (their
    Hellos name the host) and the client together outnumber the cores this process may run on."""
    text = env_str("TDMESH_FLUSH_INTERVAL")
    if text != "auto":
        return float(text)
    here = socket.gethostname()
    local = sum(1 for hello in hellos.values() if hello.hostname == here)
    return SHARED_CORES_FLUSH_INTERVAL if local + 1 > usable_cores() else FLUSH_INTERVAL

_pack = ENTRY.pack
_IDENTITY_CACHE = 4096


class Outbox:
    def __init__(self, world: tuple[int, ...]) -> None:
        self.log: list[bytes] = []   # header, pickle, header, pickle ... (a CallOp's entry is one item)
        self.bulk: list = []         # the big buffers the log's BUFFERS entries announce, in order
        self.bytes = 0               # queued, bulk included
        self.frames = 0              # frames sent, over every child
        self.bytes_sent = 0          # their payloads' bytes
        self.known: dict[int, tuple[object, int]] = {}  # id(ranks) -> (ranks, set id): the hot path reads it
        self._by_slices: dict[tuple, int] = {}
        self._all = frozenset(world)

    def set_id(self, ranks) -> int:
        """The id of rank set ``ranks`` (a mesh's rank list, or any sequence), defined on first use."""
        found = self.known.get(id(ranks))
        if found is not None and found[0] is ranks:
            return found[1]
        if len(ranks) == len(self._all) and self._all.issuperset(ranks):
            set_id: int | None = ALL_RANKS
        else:
            slices = getattr(ranks, "slices", None) or rank_set(ranks)
            set_id = self._by_slices.get(slices)
        if set_id is None:
            set_id = self._by_slices[slices] = len(self._by_slices) + 1
            definition = pickle.dumps((set_id, slices), protocol=pickle.HIGHEST_PROTOCOL)
            self.log.append(_pack(DEFINE_SET, len(definition)))
            self.log.append(definition)
        if len(self.known) >= _IDENTITY_CACHE:
            self.known.clear()
        self.known[id(ranks)] = (ranks, set_id)  # holding ``ranks``: its id is not reused
        return set_id

    def put(self, ranks, data: bytes) -> None:
        self.append(self.set_id(ranks), data)

    def put_all(self, data: bytes) -> None:
        self.append(ALL_RANKS, data)

    def append(self, set_id: int, data: bytes) -> None:
        self.log.append(_pack(set_id, len(data)))
        self.log.append(data)
        self.bytes += len(data)

    def append_call_op(self, ranks, seq: int, op: int, result: int, refs: tuple, stream: int) -> None:
        """A bare CallOp for ``ranks`` (the eager hot path's message): its entry is one pack
        (:func:`tdmesh.protocol.transport.call_op_entry`), not a pickle and a header."""
        found = self.known.get(id(ranks))
        entry = call_op_entry(found[1] if found is not None and found[0] is ranks else self.set_id(ranks),
                              seq, op, result, refs, stream)
        self.log.append(entry)
        self.bytes += len(entry)

    def append_message(self, set_id: int, msg) -> None:
        """``msg`` pickled here, its big PickleBuffers left out of the pickle (:meth:`append_with_buffers`)."""
        buffers: list = []
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=big_buffers_into(buffers))
        if buffers:
            self.append_with_buffers(set_id, data, buffers)
        else:
            self.append(set_id, data)

    def append_with_buffers(self, set_id: int, data: bytes, buffers: list) -> None:
        """A message pickled with its big PickleBuffers ``buffers`` left out: they are sent
        from their memory at the next flush, so it must not change before then."""
        self.log.extend(buffers_entry(buffers))
        raws = [b.raw() for b in buffers]
        self.bulk.extend(raws)
        self.bytes += sum(r.nbytes for r in raws)
        self.append(set_id, data)

    def pending(self) -> int:
        """Messages (and rank set definitions) queued and not yet sent (for tests and tools: it walks
        the entries, as a CallOp's is one item of the log and any other two)."""
        structure = b"".join(self.log)
        at = count = 0
        while at < len(structure):
            at += ENTRY.size + ENTRY.unpack_from(structure, at)[1]
            count += 1
        return count

    def sent(self, size: int, children: int) -> None:
        self.frames += children
        self.bytes_sent += size * children

    def take(self) -> bytes | BulkFrame:
        """The queued payload as one object (a copy of any bulk: for tests and tools)."""
        parts, _, bulk = self.take_frame()
        return BulkFrame(b"".join(bytes(p) for p in parts)) if bulk else parts[0]

    def take_frame(self) -> tuple[list, int, bool]:
        """The queued payload as (the pieces to send, the frame's checksum, whether it is a bulk frame)."""
        structure = b"".join(self.log)
        self.log.clear()
        self.bytes = 0
        if not self.bulk:
            return [structure], zlib.crc32(structure), False
        bulk, self.bulk = self.bulk, []
        parts, checksum = bulk_parts(structure, bulk)
        return parts, checksum, True

"""Which fuzzed payloads would trip CPython's C unpickler itself, not tdmesh's decoder.

CPython's C unpickler sizes its memo by the largest index a ``PUT``/``BINPUT``/``LONG_BINPUT``
names (16 bytes per unit of the index, zeroed): a few damaged bytes read as ``LONG_BINPUT``
cost up to 64 GiB and minutes (CPython gh-115952, fixed after 3.14).  ``pickle.dumps`` never
writes such an op (protocol 5 memoizes with ``MEMOIZE``), and every frame carries a CRC-32 that
is checked before anything in it is unpickled, so damaged bytes never reach the unpickler from
the wire: only a peer that computes tdmesh's checksums, i.e. one that holds the job's token and
may run code on the fleet anyway, could send them.  The fuzz tests that feed bytes straight to
the decoder, past the checksum, leave these payloads out (and the transport tests show the
checksum refusing them)."""

from __future__ import annotations

import io
import pickletools
import struct

_MEMO_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}


def _pickles_bomb(payload: bytes) -> bool:
    """True if a pickle of the run in ``payload`` names a memo index beyond its bytes."""
    stream, end = io.BytesIO(payload), len(payload)
    while stream.tell() < end:
        start = stream.tell()
        if payload[start] == 0:  # a block (tdmesh.protocol.bulk): 0 | count | sizes, then the message's pickle
            if start + 5 > end:
                return False
            count = struct.unpack_from("!I", payload, start + 1)[0]
            start += 5 + 8 * count
            if start > end:
                return False
            stream.seek(start)
        try:
            for op, arg, _ in pickletools.genops(stream):
                if op.name in _MEMO_PUTS and int(arg) > end - start:
                    return True
        except Exception:  # noqa: BLE001 - not a pickle past here: the unpickler stops too
            return False
    return False


def upstream_bomb(payload: bytes) -> bool:
    """An upstream payload (a run of pickles; a bulk frame's messages) that would trip the C unpickler."""
    from tdmesh.protocol.bulk import BulkFrame
    if type(payload) is BulkFrame:
        n = struct.unpack_from("!Q", payload)[0] if len(payload) >= 8 else 0
        return _pickles_bomb(bytes(payload[8:8 + n]))
    return _pickles_bomb(bytes(payload))


def downstream_bomb(payload: bytes) -> bool:
    """A downstream payload (entries of ``u32 rank set | u32 length | pickle``) that would."""
    from tdmesh.protocol.bulk import BulkFrame
    from tdmesh.protocol.transport import ENTRY
    if type(payload) is BulkFrame:  # an upload's frame: its entries, then the bulk (never unpickled)
        n = struct.unpack_from("!Q", payload)[0] if len(payload) >= 8 else 0
        payload = bytes(payload[8:8 + n])
    pos = 0
    while pos + ENTRY.size <= len(payload):
        _, n = ENTRY.unpack_from(payload, pos)
        pos += ENTRY.size
        body = payload[pos:pos + n]
        if upstream_bomb(body):
            return True
        pos += n
    return False

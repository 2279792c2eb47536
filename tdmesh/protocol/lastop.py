"""The op a worker was running when it died, for the client's diagnosis.

A worker killed by SIGKILL or ``os._exit``, or a segfault in an extension, says nothing on its way out,
and its last ``Status`` may be many ops old: "the first op it had not reported complete" names the wrong
line.  So each worker notes the seq of every remote function, collective and compiled call it starts in
an 8-byte file in shared memory (``/dev/shm``; one ``struct`` write, against tens of microseconds of such
a call; the aten ops of the hot path note nothing), and the client on the same host reads it when the
worker dies, by the pid the worker said hello with.  Workers on other hosts (a multi-node torchrun) have
no such file here: the diagnosis then names no op.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import tempfile

__all__ = ["Slot", "read"]

_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
_SEQ = struct.Struct("<q")


def _path(pid: int) -> str:
    return os.path.join(_DIR, f"tdmesh-running-{pid}")


class Slot:
    """This worker's file: ``note(seq)`` as an op starts; removed when the worker exits normally."""

    def __init__(self, shared: bool = True) -> None:
        self.path = _path(os.getpid())
        self._map: mmap.mmap | None = None
        if not shared:  # an interpreter in a test's own process: nothing to diagnose, no file
            return
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, _SEQ.size)
                self._map = mmap.mmap(fd, _SEQ.size)
            finally:
                os.close(fd)
        except OSError:  # no shared memory to write to: the diagnosis names no op
            return
        self.note(-1)

    def note(self, seq: int) -> None:
        if self._map is not None:
            _SEQ.pack_into(self._map, 0, seq)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
            with contextlib.suppress(OSError):
                os.unlink(self.path)


def read(pid: int) -> int | None:
    """The seq worker ``pid`` last noted (None: none, or no file on this host); the file is removed."""
    path = _path(pid)
    try:
        with open(path, "rb") as f:
            data = f.read(_SEQ.size)
        os.unlink(path)
    except OSError:
        return None
    if len(data) != _SEQ.size:
        return None
    seq = _SEQ.unpack(data)[0]
    return seq if seq >= 0 else None

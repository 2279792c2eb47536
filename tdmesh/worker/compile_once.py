"""``backend="inductor"``: the ranks of one host compile one program once.

Every rank of a mesh defines the same recording, so on one host N workers would compile the
same graph at once, each paying the whole compile.  torch's own caches (inductor's FX graph
cache and AOTAutograd's, on by default, in one directory per user) make a second compile of a
graph already compiled on this host a cache load.  So the first call of a compiled body takes
a host-wide file lock named by the program's source: the first rank to get it compiles and
fills the caches, the others wait for it and then load.  After its first call a body is the
plain ``torch.compile`` function again (no lock).

A body can call collectives (dynamo runs them between its graphs).  A rank inside one waits
for the others, which may be waiting for the lock: so the lock is let go for the length of
every collective (``yielding_host_lock``) and taken again after it.  A rank holds it only
while it compiles or computes, which waits on no other rank, so no rank waits forever; each
of the body's graphs is still compiled by the first rank to reach it and loaded by the rest.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
import threading

import torch

__all__ = ["compile_once_per_host", "yielding_host_lock"]

_held = threading.local()  # .lock: the open lock file this thread holds (a body's first call)


def compile_once_per_host(consts: dict, name: str, source: str) -> None:
    """Replace ``consts[name]`` by its ``torch.compile`` whose first call holds the host lock."""
    compiled = torch.compile(consts[name], dynamic=False)
    key = hashlib.sha256(source.encode()).hexdigest()[:20]
    path = os.path.join(tempfile.gettempdir(), f"tdmesh-inductor-{key}.lock")

    def first_call(*args):
        with open(path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            _held.lock = lock
            try:
                out = compiled(*args)
            finally:
                _held.lock = None
                fcntl.flock(lock, fcntl.LOCK_UN)
        consts[name] = compiled  # later calls: no lock
        return out

    first_call.__wrapped__ = compiled  # type: ignore[attr-defined]
    consts[name] = first_call


def yielding_host_lock(collective):
    """``collective`` run with this thread's host lock let go meanwhile (see the module
    docstring): the other ranks of the host can reach the same collective."""
    def run(*args, **kwargs):
        lock = getattr(_held, "lock", None)
        if lock is None:
            return collective(*args, **kwargs)
        fcntl.flock(lock, fcntl.LOCK_UN)
        try:
            return collective(*args, **kwargs)
        finally:
            fcntl.flock(lock, fcntl.LOCK_EX)

    run.__wrapped__ = collective
    return run

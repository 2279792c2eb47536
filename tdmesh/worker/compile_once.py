"""``backend="inductor"``: the ranks of one host compile one program once.

Every rank of a mesh defines the same recording, so on one host N workers would compile the
same graph at once, each paying the whole compile.  torch's own caches (inductor's FX graph
cache and AOTAutograd's, on by default, in one directory per user) make a second compile of a
graph already compiled on this host a cache load.  So the first call of a compiled body takes
a host-wide file lock named by the program's source: the first rank to get it compiles and
fills the caches, the others wait for it and then load.  After its first call a body is the
plain ``torch.compile`` function again (no lock).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile

import torch

__all__ = ["compile_once_per_host"]


def compile_once_per_host(consts: dict, name: str, source: str) -> None:
    """Replace ``consts[name]`` by its ``torch.compile`` whose first call holds the host lock."""
    compiled = torch.compile(consts[name], dynamic=False)
    key = hashlib.sha256(source.encode()).hexdigest()[:20]
    path = os.path.join(tempfile.gettempdir(), f"tdmesh-inductor-{key}.lock")

    def first_call(*args):
        with open(path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                out = compiled(*args)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        consts[name] = compiled  # later calls: no lock
        return out

    first_call.__wrapped__ = compiled  # type: ignore[attr-defined]
    consts[name] = first_call

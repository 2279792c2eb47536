"""Python's cyclic garbage collector in tdmesh's processes: fewer full collections.

An eager step makes hundreds of short-lived Python objects a step on the client (proxies, autograd's
nodes, the dataflow history) and on each worker (messages, values).  With CPython's default first
threshold (700) enough of them are alive at each young collection to be promoted, and every few hundred
steps a full collection scans every object of the process: ~290,000 on a client that imported torch
and a model (165-190 ms each on this project's 2-core VM), ~174,000 on a worker (85-140 ms, while
every other rank waits for it at the next collective).  Measured with ``gc.callbacks`` over 1,200
steps of the tiny GPT (bench/README, twenty-first session): the client's collections took 0.93 ms of
CPU a step with the default and 0.23 ms with a first threshold of 5,000 (no full collection in the run).

So, with ``TDMESH_GC_THRESHOLD`` (default 5000; 0 leaves the collector alone):

- the client raises the first threshold to it while a mesh is live (never lowers it, never touches a
  disabled collector) and puts back the thresholds it found when the last live mesh shuts down, unless
  something else changed them meanwhile.  Nothing is frozen there: the process is the user's, and a
  frozen object's cycles would outlive the user's ``del``.
- a worker, whose process is tdmesh's own, also freezes (``gc.freeze``) what is alive when it starts
  serving a client (its modules, torch's tables, its process group): its full collections then scan only
  what the session made (2-13 ms instead of 85).
"""

from __future__ import annotations

import gc
import threading

from .config import env_int

__all__ = ["hold_for_client", "release_for_client", "tune_worker"]

_lock = threading.Lock()
_live_clients = 0
_found: tuple[int, int, int] | None = None  # the thresholds the first live client found
_set: tuple[int, int, int] | None = None    # the thresholds it set (None: it left them alone)


def _raised() -> tuple[int, int, int] | None:
    """The thresholds with the first one raised to ``TDMESH_GC_THRESHOLD``, or None to leave them be."""
    wanted = env_int("TDMESH_GC_THRESHOLD")
    first, second, third = gc.get_threshold()
    if wanted <= 0 or not gc.isenabled() or first == 0 or first >= wanted:
        return None
    return wanted, second, third


def hold_for_client() -> None:
    """A client (a mesh) goes live in this process: raise the first threshold while any is."""
    global _live_clients, _found, _set
    with _lock:
        _live_clients += 1
        if _live_clients == 1:
            _found, _set = gc.get_threshold(), _raised()
            if _set is not None:
                gc.set_threshold(*_set)


def release_for_client() -> None:
    """A client shut down: the last one puts back the thresholds it found, if they are still its own."""
    global _live_clients, _found, _set
    with _lock:
        if _live_clients == 0:
            return
        _live_clients -= 1
        if _live_clients == 0:
            if _set is not None and _found is not None and gc.get_threshold() == _set:
                gc.set_threshold(*_found)
            _found = _set = None


def tune_worker() -> None:
    """A worker is about to serve a client: freeze what is alive now and raise the first threshold."""
    if env_int("TDMESH_GC_THRESHOLD") <= 0:
        return
    gc.freeze()
    raised = _raised()
    if raised is not None:
        gc.set_threshold(*raised)

"""Warm workers: a finished ``local_mesh``'s workers wait for the next one of the same shape.

Starting a worker costs about a second (an interpreter, ``import torch``, a process group);
a notebook or a test suite that opens mesh after mesh pays it each time.  When a local mesh
exits cleanly its workers are detached instead of stopped: each destroys its process groups,
resets torch's global state and waits, in the client's process tree, on a key of the fleet's
store.  The next ``local_mesh`` with the same shape and environment takes them: it publishes
itself under a new job scope, writes that scope to the key, and the workers join a fresh
default process group and connect (no refs, groups or ops of the last client survive: they
lived in its worker session).  Parked fleets are stopped after ``TDMESH_POOL_IDLE`` seconds,
at interpreter exit, or when this process dies (workers watch their parent).  torchrun's
workers are never pooled: torchrun owns their lives.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
from typing import Any, NamedTuple

from ..config import env_float
from ..protocol.rendezvous import NEXT_JOB, SHUTDOWN

__all__ = ["Parked", "park", "take", "clear", "parked_count", "NEXT_JOB"]


class Parked(NamedTuple):
    key: tuple
    scope: str
    processes: Any      # the launcher's process context
    store: Any          # the TCPStore the workers are connected to
    log_files: dict
    since: float


_lock = threading.Lock()
_parked: dict[tuple, list[Parked]] = {}
_reaper: threading.Thread | None = None


def idle_timeout() -> float:
    return env_float("TDMESH_POOL_IDLE")


def park(entry: Parked) -> None:
    global _reaper
    with _lock:
        _parked.setdefault(entry.key, []).append(entry)
        if _reaper is None or not _reaper.is_alive():
            _reaper = threading.Thread(target=_reap, name="tdmesh-pool", daemon=True)
            _reaper.start()


def take(key: tuple) -> Parked | None:
    """A parked fleet of this key whose workers are all still alive, or None."""
    while True:
        with _lock:
            entries = _parked.get(key)
            if not entries:
                return None
            entry = entries.pop()
        if entry.processes.wait(timeout=0) is None:  # none has exited
            return entry
        _stop(entry)


def parked_count() -> int:
    with _lock:
        return sum(len(v) for v in _parked.values())


def clear() -> None:
    """Stop every parked fleet now (tests that count processes; interpreter exit)."""
    with _lock:
        entries = [e for v in _parked.values() for e in v]
        _parked.clear()
    for entry in entries:
        _stop(entry)


@contextlib.contextmanager
def quiet_elastic(quiet: bool = True):
    """Without torch elastic's lines about the workers it stops ("Sending process N closing
    signal SIGTERM"), where their stop is tdmesh's choice or follows from the user's error."""
    elastic = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    level = elastic.level
    if quiet:
        elastic.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        elastic.setLevel(level)


def _stop(entry: Parked) -> None:
    with contextlib.suppress(Exception):
        entry.store.set(entry.scope + NEXT_JOB, SHUTDOWN)
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and entry.processes.wait(timeout=0.1, period=0.02) is None:
            pass
    finally:
        with quiet_elastic():  # a parked worker slow to leave (a GPU's teardown) is stopped, not crashed
            entry.processes.close(timeout=5)


def _reap() -> None:
    """Stop fleets parked longer than the idle timeout; end when none is left (``park`` restarts it)."""
    global _reaper
    done = False
    while not done:
        time.sleep(0.5)
        now, idle = time.monotonic(), idle_timeout()
        with _lock:
            old = [e for v in _parked.values() for e in v if now - e.since > idle]
            for e in old:
                _parked[e.key].remove(e)
            done = not any(_parked.values())
            if done:
                _reaper = None
        for e in old:
            _stop(e)


atexit.register(clear)

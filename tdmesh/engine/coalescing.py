"""``with tdmesh.coalescing():`` holds back the messages of the block and sends each rank
one batch when the outermost block exits (nested blocks flush once).  A block whose messages
outgrow a batch (16 KiB, some 400 ops) sends them in such batches as it goes, so the workers
start on a long block before it ends and coalescing is never slower than plain dispatch.  Fetching
inside the block would wait for messages that are not sent yet, so it raises."""

from __future__ import annotations

import contextlib
import threading

_lock = threading.Lock()
_depth = 0
held_clients: set = set()   # clients whose messages a block is holding back


def depth() -> int:
    return _depth


def clients() -> set:
    return held_clients


@contextlib.contextmanager
def coalescing():
    """Buffer the messages of this block; send them as one batch per rank at the end."""
    global _depth
    with _lock:
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            touched = set()
            if _depth == 0:
                touched = set(held_clients)
                held_clients.clear()
        for client in touched:
            client.flush()


def check_not_coalescing(what: str) -> None:
    if _depth:
        raise NotImplementedError(f"NYI: {what} during a coalescing block: its messages are not sent until "
                                  f"the block exits; fetch after the `with tdmesh.coalescing():` block")

"""``tdmesh.stacks()``: where every rank is, now -- the first question about a job that hangs.

Each rank answers from a stream of its own (a worker runs a thread per stream), so the
answer comes while the main stream's thread is blocked inside an op, a collective waiting on
a rank that never came, or a remote function stuck in I/O.  A rank that does not answer
within ``timeout`` (dead, or its process wedged below Python) fails the call; ``kill -USR1
<pid>`` of that worker still prints its stacks (``docs/debugging.md``).
"""

from __future__ import annotations

from .engine.context import get_active_mesh
from .engine.stream import Stream
from .remote import remote

__all__ = ["stacks"]

_STACKS = Stream("tdmesh-stacks")  # a stream nothing else uses: its thread on each worker is free to answer


def stacks(mesh=None, timeout: float = 30.0) -> dict[int, str]:
    """Every rank's Python stacks, ``{global rank: text}``: each thread by name (a stream's thread
    is ``tdmesh-stream-<id>``, the main stream's ``tdmesh-stream-0``), innermost call last."""
    mesh = mesh if mesh is not None else get_active_mesh()
    with mesh.activate(), _STACKS.activate():
        future = remote("tdmesh.worker.builtins.stacks_text").call()
    future.early = True  # the answers, not the completion of the ops issued before (which may be stuck)
    return dict(sorted(value for _, value in future.result(timeout=timeout)))

"""``tdmesh.stacks()``: where every rank is, now -- the first question about a job that hangs.

The request goes out of band (``RequestStacks``, not an op): each worker's message thread
answers it, so the answer comes while every stream's thread is blocked inside an op, a
collective waiting on a rank that never came, or a remote function stuck in I/O, and it may
be asked from any thread of the client (the dashboard's) while the user's thread is waiting.
A rank that does not answer within ``timeout`` (dead, or its process wedged below Python)
fails the call; ``kill -USR1 <pid>`` of that worker still prints its stacks
(``docs/debugging.md``).
"""

from __future__ import annotations

from .engine.context import get_active_mesh

__all__ = ["stacks"]


def stacks(mesh=None, timeout: float = 30.0) -> dict[int, str]:
    """Every rank's Python stacks, ``{global rank: text}``: each thread by name (a stream's thread
    is ``tdmesh-stream-<id>``, the main stream's ``tdmesh-stream-0``), innermost call last."""
    mesh = mesh if mesh is not None else get_active_mesh()
    client = mesh._live()
    client.check_usable()
    return client.observations.stacks(mesh.rank_list, timeout)

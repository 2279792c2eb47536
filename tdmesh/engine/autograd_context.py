"""The mesh and stream each autograd node's forward ran under, for incremental backward.

``tdmesh.grad_generator`` runs each backward node under the mesh and stream its forward op
ran on (a pipeline's stages, a side stream's ops).  Autograd numbers its nodes in the order
the forward makes them (per thread: ``sequence_nr``), so the context of a node is that of the
range of numbers it falls in: every activation or deactivation of a mesh or a stream notes
the number where the new context begins (so do the start and end of a compiled
function's trace).  That is one list entry per context switch that had
nodes made under it (switches with no node in between overwrite each other), nothing per op.
The lists keep the newest ``MAX_RANGES`` ranges; an older node's context is not known, and
the generator takes it from the gradients the node receives instead.
"""

from __future__ import annotations

import bisect
import threading

from torch._C._autograd import _get_sequence_nr

from . import stream as _stream
from .context import active_mesh
from .saved import on_hooks_change, ours_on_top
from .stream import DEFAULT_STREAM, get_active_stream

__all__ = ["note_context", "forward_context", "context_of_span", "set_sink"]

MAX_RANGES = 1 << 16


class _Ranges(threading.local):
    def __init__(self) -> None:
        self.starts: list[int] = [0]  # the first sequence_nr of each range...
        self.contexts: list[tuple] = [(None, DEFAULT_STREAM, True)]  # ...and its (mesh, stream, not traced)


_ranges = _Ranges()


def note_context() -> None:
    """The context in effect from now on (called after each mesh or stream activation change)."""
    now = _get_sequence_nr()
    mesh = active_mesh.get()
    client = getattr(mesh, "client", None)
    context = (mesh, get_active_stream(), (client is None or client.sink is client) and ours_on_top())
    r = _ranges
    if r.starts[-1] == now:  # no node made since the last change: that context never held one
        r.contexts[-1] = context
        if len(r.starts) > 1 and r.contexts[-2] == context:
            del r.starts[-1], r.contexts[-1]
        return
    if r.contexts[-1] == context:
        return
    r.starts.append(now)
    r.contexts.append(context)
    if len(r.starts) > MAX_RANGES:
        del r.starts[: MAX_RANGES // 2], r.contexts[: MAX_RANGES // 2]


def forward_context(sequence_nr: int) -> tuple | None:
    """``(mesh or None, stream, recorded)`` active when node ``sequence_nr`` was made on this thread
    (``recorded``: the workers recorded it too; not while a compiled function was traced, nor under
    the user's own saved-tensor hooks: ``checkpoint``); None when that is older than the ranges kept."""
    r = _ranges
    i = bisect.bisect_right(r.starts, sequence_nr) - 1
    if i < 0:
        return None
    return r.contexts[i]


def context_of_span(first: int, last: int) -> tuple | None:
    """The context of every node numbered ``first`` to ``last`` where one context held them all; else None."""
    r = _ranges
    i = bisect.bisect_right(r.starts, first) - 1
    if i < 0 or (i + 1 < len(r.starts) and r.starts[i + 1] <= last):
        return None
    return r.contexts[i]


_stream.on_change.append(note_context)
on_hooks_change.append(note_context)


def set_sink(client, sink) -> None:
    """Send ``client``'s issued ops to ``sink`` (a compiled function's recorder while it traces, or
    the client): noted, as autograd nodes made while tracing have no copy on the workers."""
    client.sink = sink
    note_context()


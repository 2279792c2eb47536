"""Streams on the client.

A ``Stream`` names an ordered queue of work on every worker; work on different streams
may overlap (a thread per stream, and a CUDA stream on GPUs).  A tensor belongs to the
stream that made it; using it on another stream takes a borrow (:mod:`tdmesh.borrow`).
"""

from __future__ import annotations

import contextvars
import itertools
from collections.abc import Callable

from .context import UNSET, backward_caller, backward_calls

__all__ = ["Stream", "StreamActivation", "DEFAULT_STREAM", "get_active_stream"]

_ids = itertools.count(1)


class Stream:
    """A named stream of work on every worker.  ``Stream("comms")``."""

    def __init__(self, name: str, *, _default: bool = False) -> None:
        self.name = name
        self.id = 0 if _default else next(_ids)

    def __repr__(self) -> str:
        return f"<tdmesh.Stream {self.name!r} id={self.id}>"

    def activate(self) -> StreamActivation:
        """Make new work go to this stream, now; a context manager restores the previous one."""
        return StreamActivation(self)

    def borrow(self, t, mutable: bool = False):
        """Lend ``t`` (from its own stream) to this stream: returns ``(borrowed tensor, Borrow)``.
        Defined by :mod:`tdmesh.borrow`, which sits above this module."""
        raise NotImplementedError("tdmesh.borrow is not imported")


DEFAULT_STREAM = Stream("main", _default=True)
_active_stream: contextvars.ContextVar = contextvars.ContextVar("tdmesh_active_stream", default=DEFAULT_STREAM)
# called after each change of the active stream (tdmesh.engine.autograd_context notes it for backward)
on_change: list[Callable[[], None]] = []


def get_active_stream() -> Stream:
    """The stream new work goes to (the default stream unless one is activated; on autograd's device
    thread, that of the backward call it runs: ``context.backward_calls``)."""
    stream = _active_stream.get(UNSET)
    if stream is UNSET:
        caller = backward_caller() if backward_calls else None
        return DEFAULT_STREAM if caller is None else caller[1]
    return stream


class StreamActivation:
    def __init__(self, stream: Stream) -> None:
        self._stream = stream
        self._token = _active_stream.set(stream)
        self._active = True
        for note in on_change:
            note()

    def __enter__(self) -> Stream:
        return self._stream

    def __exit__(self, *exc) -> None:
        if self._active:
            self._active = False
            _active_stream.reset(self._token)
            for note in on_change:
                note()

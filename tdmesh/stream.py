"""Streams and borrows on the client.

A ``Stream`` names an ordered queue of work on every worker; work on different streams
may overlap (a thread per stream, and a CUDA stream on GPUs).  A tensor belongs to the
stream that made it; using it on another stream takes a *borrow*: a read borrow makes the
origin and the borrowed tensor read-only until dropped, a mutable borrow makes the origin
unusable until dropped.  Breaking either rule is a ``TypeError`` at the user's line.
"""

from __future__ import annotations

import contextvars
import itertools
import warnings

from . import messages as m

__all__ = ["Stream", "Borrow", "get_active_stream"]

_ids = itertools.count(1)


class Stream:
    """A named stream of work on every worker.  ``Stream("comms")``."""

    def __init__(self, name: str, *, _default: bool = False) -> None:
        self.name = name
        self.id = 0 if _default else next(_ids)

    def __repr__(self) -> str:
        return f"<tdmesh.Stream {self.name!r} id={self.id}>"

    def activate(self) -> "StreamActivation":
        """Make new work go to this stream, now; a context manager restores the previous one."""
        return StreamActivation(self)

    def borrow(self, t, mutable: bool = False):
        """Lend ``t`` (from its own stream) to this stream: returns ``(borrowed tensor, Borrow)``."""
        borrow = Borrow(t, self, mutable)
        return borrow.tensor, borrow


DEFAULT_STREAM = Stream("main", _default=True)
_active_stream: contextvars.ContextVar = contextvars.ContextVar("tdmesh_active_stream", default=DEFAULT_STREAM)


def get_active_stream() -> Stream:
    """The stream new work goes to (the default stream unless one is activated)."""
    return _active_stream.get()


class StreamActivation:
    def __init__(self, stream: Stream) -> None:
        self._stream = stream
        self._token = _active_stream.set(stream)
        self._active = True

    def __enter__(self) -> Stream:
        return self._stream

    def __exit__(self, *exc) -> None:
        if self._active:
            self._active = False
            _active_stream.reset(self._token)


class Borrow:
    """A tensor lent to another stream; ``drop()`` (or leaving ``with borrow:``) gives it back."""

    def __init__(self, origin, stream: Stream, mutable: bool) -> None:
        from .tensor import Tensor, _Aliases, _raise, call_site, site_text, user_line
        if type(origin) is not Tensor:
            raise TypeError(f"only tdmesh tensors can be borrowed, got {type(origin).__name__}\n  at {user_line()}")
        if origin.dropped:
            _raise(TypeError(f"DROPPED: tensor {origin.ref} is dropped and cannot be borrowed\n  at {user_line()}"))
        if origin.stream is stream:
            raise ValueError(f"tensor {origin.ref} already lives on {stream!r}; borrow it onto another stream")
        aliases = origin._r.aliases
        if aliases.mutable_borrow is not None:
            _raise(TypeError(f"BORROWED: tensor {origin.ref} is mutably borrowed (at "
                             f"{site_text(aliases.mutable_borrow.site)}) and cannot be borrowed again\n  at {user_line()}"))
        if aliases.borrow is not None and not aliases.borrow.mutable and mutable:
            _raise(TypeError(f"MUTATING_BORROW: tensor {origin.ref} is itself a read-only borrow and cannot be "
                             f"borrowed mutably\n  at {user_line()}"))
        if mutable and aliases.read_borrows:
            raise RuntimeError("Cannot borrow this tensor mutably because it (or a view) is already being "
                               f"borrowed non-mutably (tensor {origin.ref})\n  at {user_line()}")
        if aliases.borrow is not None and not aliases.borrow.first_use_sent:
            # the origin is itself a borrowed tensor that its stream has not received yet
            aliases.borrow.first_use()
        mesh = origin.mesh
        client = mesh.client
        self.origin = origin
        self.stream = stream
        self.mutable = mutable
        self.site = call_site()
        self.mesh = mesh
        self.first_use_sent = False
        self.dropped = False
        self._origin_refs = list(aliases.refs)
        with client.lock:
            self.id = client.new_ref()
            ref = client.new_ref()
            borrowed_aliases = _Aliases()
            borrowed_aliases.borrow = self
            self.tensor = Tensor(origin._meta, origin.device, mesh, ref, borrowed_aliases, stream)
            seq = client.new_seq()
            client.send(mesh, m.BorrowCreate(ref, self.id, origin.ref, origin.stream.id, stream.id), seq,
                        [origin.ref], [ref])
        self._aliases = aliases
        self._borrowed_aliases = borrowed_aliases
        if mutable:
            aliases.mutable_borrow = self
        else:
            aliases.read_borrows += 1

    def first_use(self) -> None:
        """Called by dispatch before the first op that reads the borrowed tensor."""
        if not self.first_use_sent:
            self.first_use_sent = True
            self.mesh.client.send(self.mesh, m.BorrowFirstUse(self.id))

    def drop(self) -> None:
        """Give the tensor back: the borrowed tensor and its views become unusable."""
        if self.dropped:
            return
        from .tensor import call_site
        client = self.mesh.client
        site = call_site()
        with client.lock:
            self.dropped = True
            self.first_use()
            borrowed = self._borrowed_aliases.live()
            for r in borrowed:
                r.dropped_at = site
            views = [r.id for r in borrowed if r.id != self.tensor.ref]
            if views:
                client.send(self.mesh, m.DeleteRefs(tuple(views)))
            if self.mutable:  # what the borrower wrote is the origin's value now: errors flow back
                seq = client.new_seq()
                client.send(self.mesh, m.BorrowLastUse(self.id), seq, [self.tensor.ref], self._origin_refs)
            else:
                client.send(self.mesh, m.BorrowLastUse(self.id))
            client.send(self.mesh, m.BorrowDrop(self.id))
        if self.mutable:
            self._aliases.mutable_borrow = None
        else:
            self._aliases.read_borrows -= 1

    def __enter__(self) -> "Borrow":
        return self

    def __exit__(self, *exc) -> None:
        self.drop()

    def __del__(self) -> None:
        if not getattr(self, "dropped", True):
            warnings.warn(f"a borrow of tensor {self.origin.ref} onto {self.stream!r} was never dropped; dropping "
                          f"it now (call borrow.drop() or use `with borrow:`)", stacklevel=2)
            try:
                self.drop()
            except Exception:
                pass


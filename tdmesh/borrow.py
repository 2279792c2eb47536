"""Borrows: a tensor of one stream lent to another.

A read borrow makes the origin and the borrowed tensor read-only until dropped; a mutable
borrow makes the origin unusable until dropped.  Breaking either rule is a
:class:`~tdmesh.errors.PlacementError` at the user's line.  ``Stream.borrow`` is defined
here, above :mod:`tdmesh.engine.stream`, because lending issues messages.
"""

from __future__ import annotations

import warnings

from .engine.issue import New, issue, issue_message
from .engine.stream import Stream
from .engine.tensor import AliasSet, Tensor, raise_in_op
from .errors import UsageError, call_site, site_text, user_line
from .protocol import messages as m

__all__ = ["Borrow"]


class Borrow:
    """A tensor lent to another stream; ``drop()`` (or leaving ``with borrow:``) gives it back."""

    def __init__(self, origin: Tensor, stream: Stream, mutable: bool) -> None:
        if type(origin) is not Tensor:
            raise TypeError(f"only tdmesh tensors can be borrowed, got {type(origin).__name__}\n  at {user_line()}")
        if origin.dropped:
            raise_in_op("DROPPED", f"tensor {origin.ref} is dropped and cannot be borrowed")
        if origin.stream is stream:
            raise ValueError(f"tensor {origin.ref} already lives on {stream!r}; borrow it onto another stream")
        aliases = origin.aliases
        if aliases.mutable_borrow is not None:
            raise_in_op("BORROWED", f"tensor {origin.ref} is mutably borrowed (at "
                                    f"{site_text(aliases.mutable_borrow.site)}) and cannot be borrowed again")
        if aliases.borrow is not None and not aliases.borrow.mutable and mutable:
            raise_in_op("MUTATING_BORROW", f"tensor {origin.ref} is itself a read-only borrow and cannot be "
                                           f"borrowed mutably")
        if mutable and aliases.read_borrows:
            raise UsageError(f"Cannot borrow this tensor mutably because it (or a view) is already being borrowed "
                             f"non-mutably (tensor {origin.ref}); drop those borrows first\n  at {user_line()}")
        if aliases.borrow is not None and not aliases.borrow.first_use_sent:
            # the origin is itself a borrowed tensor that its stream has not received yet
            aliases.borrow.first_use()
        mesh = origin.mesh
        self.origin = origin
        self.stream = stream
        self.mutable = mutable
        self.site = call_site()
        self.mesh = mesh
        self.first_use_sent = False
        self.dropped = False
        self._origin_refs = list(aliases.refs)
        self.id = mesh.client.new_ref()
        borrowed_aliases = AliasSet()
        borrowed_aliases.borrow = self

        def build(seq, results, _mutated):
            return m.BorrowCreate(results[0], self.id, origin.ref, origin.stream.id, stream.id)

        self.tensor = issue(mesh, build, inputs=[origin], outputs=[New(origin.meta, borrowed_aliases)],
                            device=origin.device, stream=stream)[0]
        self._aliases = aliases
        self._borrowed_aliases = borrowed_aliases
        if mutable:
            aliases.mutable_borrow = self
        else:
            aliases.read_borrows += 1

    def first_use(self) -> None:
        """Called before the first op that reads the borrowed tensor."""
        if not self.first_use_sent:
            self.first_use_sent = True
            issue_message(self.mesh, m.BorrowFirstUse(self.id))

    def drop(self) -> None:
        """Give the tensor back: the borrowed tensor and its views become unusable."""
        if self.dropped:
            return
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
                issue_message(self.mesh, m.DeleteRefs(tuple(views)))
            if self.mutable:  # what the borrower wrote is the origin's value now: errors flow back
                issue(self.mesh, lambda seq, results, mutated: m.BorrowLastUse(self.id), inputs=[self.tensor],
                      defs=self._origin_refs)
            else:
                issue_message(self.mesh, m.BorrowLastUse(self.id))
            issue_message(self.mesh, m.BorrowDrop(self.id))
        if self.mutable:
            self._aliases.mutable_borrow = None
        else:
            self._aliases.read_borrows -= 1

    def __enter__(self) -> Borrow:
        return self

    def __exit__(self, *exc) -> None:
        self.drop()

    def __del__(self) -> None:
        if not getattr(self, "dropped", True):
            warnings.warn(f"a borrow of tensor {self.origin.ref} onto {self.stream!r} was never dropped; dropping "
                          f"it now (call borrow.drop() or use `with borrow:`)", stacklevel=2)
            try:
                self.drop()
            except Exception:  # noqa: BLE001 - a finalizer must not raise (the fleet may be gone)
                pass


def _borrow(self: Stream, t: Tensor, mutable: bool = False):
    """Lend ``t`` (from its own stream) to this stream: returns ``(borrowed tensor, Borrow)``."""
    borrow = Borrow(t, self, mutable)
    return borrow.tensor, borrow


Stream.borrow = _borrow  # type: ignore[method-assign]

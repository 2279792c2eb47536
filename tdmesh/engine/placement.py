"""Where a tensor may be used: the placement and borrow rules, checked at the user's line.

An op's remote inputs must live on the op's mesh and stream, must not be dropped or
mutably borrowed elsewhere; a mutation must not write a read-only borrow.  Breaking a rule
is a :class:`~tdmesh.errors.PlacementError` (a ``TypeError``) before anything is sent.
"""

from __future__ import annotations

import traceback
from collections.abc import Sequence

import torch

from ..errors import frames, site_text
from .stream import Stream, get_active_stream
from .tensor import Tensor, describe, raise_in_op

__all__ = ["check_inputs", "plainly_placed", "check_mutation", "check_no_grad", "note_written", "on_fused_write"]


def check_inputs(remote: Sequence[Tensor], mesh, what, stream: Stream | None = None) -> None:
    """Placement and permission checks for an op's remote inputs, raised at the user's line."""
    stream = stream if stream is not None else get_active_stream()
    for t in remote:
        if t._mesh is not mesh:
            raise_in_op("WRONG_MESH", f"{what} mixes tensors from two meshes:\n  {describe(remote[0])}\n"
                                      f"  {describe(t)}\nmove one with t.to_mesh(other_mesh)")
        r = t._r
        if type(r.dropped_at) is str:  # lost in a heal (tdmesh.FaultTolerance): the text says so
            raise_in_op("DROPPED", f"tensor {r.id} {r.dropped_at}, so it cannot be used in {what}")
        if r.dropped_at is not None:
            where = "".join(traceback.format_list(frames(r.dropped_at)))
            raise_in_op("DROPPED", f"tensor {r.id} is dropped at:\n{where}and cannot be used in {what}")
        if t._stream is not stream:
            raise_in_op("WRONG_STREAM", f"tensor {r.id} lives on {t._stream!r} but the active stream is {stream!r}; "
                                        f"borrow it with {stream.name!r} stream.borrow(t), or activate its stream")
        aliases = r.aliases
        if aliases.mutable_borrow is not None:
            raise_in_op("BORROWED", f"tensor {r.id} is mutably borrowed by {aliases.mutable_borrow.stream!r} "
                                    f"(at {site_text(aliases.mutable_borrow.site)}); drop the borrow before using it")
        if aliases.borrow is not None and not aliases.borrow.first_use_sent:
            aliases.borrow.first_use()


def plainly_placed(remote: Sequence[Tensor], mesh, stream: Stream) -> bool:
    """True where :func:`check_inputs` has nothing to say or do: every input on ``mesh`` and ``stream``,
    not dropped, not borrowed (the eager hot path's one pass; any other case gets the full check)."""
    for t in remote:
        if t._mesh is not mesh or t._stream is not stream:
            return False
        r = t._r
        aliases = r.aliases
        if r.dropped_at is not None or aliases.mutable_borrow is not None or aliases.borrow is not None:
            return False
    return True


def check_mutation(t: Tensor, what) -> None:
    """``t`` is about to be written: it must not be lent read-only, nor be a read-only borrow."""
    aliases = t._r.aliases
    if aliases.fused is not None:
        note_written(t)
    if aliases.copied_at is not None:
        raise_in_op("INDEXED_COPY", f"tensor {t._r.id} would be written by {what}, and it is x[i] of a per-rank "
                                    f"scalar i (made at {aliases.copied_at}): each rank's row is a copy, where local "
                                    f"torch's x[int] is a view of x; write into x itself: x[i] = value")
    if aliases.read_borrows:
        raise_in_op("MUTATING_BORROW", f"tensor {t._r.id} would be mutated by {what} while it is borrowed "
                                       f"read-only; drop the borrow first")
    if aliases.borrow is not None and not aliases.borrow.mutable:
        raise_in_op("MUTATING_BORROW", f"tensor {t._r.id} is a read-only borrow (made at "
                                       f"{site_text(aliases.borrow.site)}) and would be mutated by {what}")


def note_written(t: Tensor) -> None:
    """``t`` is about to be written: where it shares storage with the output of a composite issued whole
    that torch makes a view, ``engine/composites.py`` must know (registered in ``on_fused_write``)."""
    aliases = t._r.aliases
    if aliases.fused is not None:
        for hook in on_fused_write:
            hook(aliases)


on_fused_write: list = []


def check_no_grad(tensors: Sequence[Tensor], what: str) -> None:
    """``what`` is not differentiable: refuse a tensor that autograd would have to follow.
    (``requires_grad`` read with torch functions off: under an active mesh each read is
    otherwise a round trip through the mode's ``__torch_function__``, one per gradient of a
    step's ``reduce_``.)"""
    if not torch.is_grad_enabled():
        return
    with torch._C.DisableTorchFunction():
        needs = next((t for t in tensors if t.requires_grad), None)
    if needs is not None:
        raise_in_op("REQUIRES_GRAD", f"{what} of tensor {needs._r.id}, which requires grad, is not differentiable; "
                                     f"use its .detach() or run under torch.no_grad()")

"""Indexing by a per-rank scalar: ``x[mesh.rank("gpu")]``, ``x[:, i] = v`` with ``i`` a 0-d mesh tensor.

torch reads a 0-d integer tensor used as an index as a Python int (``.item()``), which on a mesh asks every
rank for one value where each has its own: the disagreeing-ranks error, where the user wants each rank's own
row.  Under an active mesh ``__getitem__`` and ``__setitem__`` with such an index run as one indexing op per
rank instead: the index's other parts (ints, slices, ``None``, ``...``) first, as a view, then ``aten.index``
(or ``aten.index_put_``) of that view with the scalars as one-element index tensors, their new dim squeezed
away: each rank's value is what its local torch gives for ``x[int(i)]``, gradients included.

One difference remains, and is refused rather than silent: torch's ``x[int]`` is a view of ``x``, these rows are
copies, so a write into one (``x[i].zero_()``) is a ``PlacementError`` (``INDEXED_COPY``) naming ``x[i] = v``,
which writes into ``x`` itself.  A scalar index beside another tensor index (``x[i, idx]``) is refused too.
"""

from __future__ import annotations

import torch

from ..errors import UsageError, call_site, site_text, user_line
from .tensor import Tensor

__all__ = ["SPECIAL"]


def _per_rank(part) -> bool:
    return type(part) is Tensor and part.dim() == 0 and not part.dtype.is_floating_point and \
        not part.dtype.is_complex and part.dtype is not torch.bool


def _plan(x, parts: tuple) -> tuple[tuple, list, int, list]:
    """(the index with each per-rank scalar a full slice, the ``aten.index`` indices of that view, the dim the
    scalars' one-element index leaves in the result, the view's dims the scalars select)."""
    consumed = sum(1 for p in parts if p is not None and p is not Ellipsis)
    view: list = []
    dims: list[int] = []
    d = 0
    for p in parts:
        if p is Ellipsis:
            view.append(p)
            d += x.dim() - consumed
        elif p is None:
            view.append(p)
            d += 1
        elif _per_rank(p):
            view.append(slice(None))
            dims.append(d)
            d += 1
        elif isinstance(p, slice):
            view.append(p)
            d += 1
        elif isinstance(p, int) and not isinstance(p, bool):
            view.append(p)
        else:
            raise UsageError(f"indexing by a per-rank scalar (a 0-d integer mesh tensor) beside a {type(p).__name__} "
                             f"index: index in two steps (x[i] then [...]), or use torch.index_select\n"
                             f"  at {user_line()}")
    scalars = [p for p in parts if _per_rank(p)]
    indices: list = [None] * (dims[-1] + 1)
    for dim, scalar in zip(dims, scalars):
        indices[dim] = scalar.reshape(1)
    adjacent = dims == list(range(dims[0], dims[0] + len(dims)))
    return tuple(view), indices, dims[0] if adjacent else 0, dims


def _getitem(func, args, kwargs):
    x, index = args
    parts = index if type(index) is tuple else (index,)
    if type(x) is not Tensor or not any(_per_rank(p) for p in parts):
        return NotImplemented
    view, indices, at, _ = _plan(x, parts)
    out = torch.ops.aten.index.Tensor(x[view], indices).squeeze(at)
    out._r.aliases.copied_at = site_text(call_site())
    return out


def _setitem(func, args, kwargs):
    x, index, value = args
    parts = index if type(index) is tuple else (index,)
    if type(x) is not Tensor or not any(_per_rank(p) for p in parts):
        return NotImplemented
    view, indices, at, dims = _plan(x, parts)
    base = x[view]
    selected = [n for i, n in enumerate(base.shape) if i not in dims]  # torch's x[int] shape
    if not isinstance(value, torch.Tensor):
        value = torch.full((), value, dtype=x.dtype)
    torch.ops.aten.index_put_(base, indices, value.to(x.dtype).expand(selected).unsqueeze(at))
    return None


SPECIAL = {torch.Tensor.__getitem__: _getitem, torch.Tensor.__setitem__: _setitem}

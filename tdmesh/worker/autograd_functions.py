"""``tdmesh.remote_autograd_function``'s worker side: a ``torch.autograd.Function``'s own ``forward`` and
``backward``, each run on every rank as a remote function.

The client's Function (``tdmesh/remote_autograd.py``) calls :func:`forward` with the inputs and which of them
require grad; it returns what the class's forward returned, the attributes forward set on ``ctx`` and the
tensors it saved, which the client keeps for :func:`backward` (tensors as mesh tensors, other values as they
are).  The ctx a class sees here has what these methods use of torch's: attributes, ``save_for_backward`` /
``saved_tensors`` and ``needs_input_grad``; the marks (``mark_dirty``, ``mark_non_differentiable``,
``set_materialize_grads``) are the client's Function's business and do nothing here.
"""

from __future__ import annotations

from typing import Any

import torch

from .functions import resolve

_OWN = ("needs_input_grad", "saved_tensors", "_to_save")


class WorkerCtx:
    """The ``ctx`` of a Function's forward and backward on a worker."""

    def __init__(self, needs: tuple, saved: tuple = (), attrs: dict | None = None) -> None:
        self.needs_input_grad = tuple(needs)
        self.saved_tensors = tuple(saved)
        self._to_save: tuple = ()
        for key, value in (attrs or {}).items():
            setattr(self, key, value)

    def save_for_backward(self, *tensors) -> None:
        self._to_save = tensors

    def mark_dirty(self, *tensors) -> None:
        pass

    def mark_non_differentiable(self, *tensors) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


def forward(target, needs: tuple, *args):
    """``cls.forward(ctx, *args)`` with the inputs the client's autograd tracks requiring grad (as the class's
    own code may ask); returns ``(its output, ctx's attributes, the tensors it saved)``."""
    cls: Any = resolve(target)  # the Function class
    ctx = WorkerCtx(needs)
    args = tuple(a.detach().requires_grad_() if n and isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a, n in zip(args, needs))
    with torch.no_grad():
        out = cls.forward(ctx, *args)
    attrs = {k: v for k, v in vars(ctx).items() if k not in _OWN}
    saved = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in ctx._to_save)
    out = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in out) if isinstance(out, tuple) else \
        out.detach() if isinstance(out, torch.Tensor) else out
    return out, attrs, saved


def backward(target, attrs: dict, saved: tuple, needs: tuple, *grads):
    """``cls.backward(ctx, *grads)`` with forward's attributes and saved tensors: a gradient per input."""
    cls: Any = resolve(target)  # the Function class
    ctx = WorkerCtx(needs, saved, attrs)
    with torch.no_grad():
        out = cls.backward(ctx, *grads)
    return out if isinstance(out, tuple) else (out,)

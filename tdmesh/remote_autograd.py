"""``remote_autograd_function(cls)``: Monarch's way to run a ``torch.autograd.Function`` on the workers.

The result is a new Function (named ``Remote_<cls name>``) for the client's autograd: its ``apply`` runs
``cls.forward`` on every rank of the inputs' mesh (one remote function), and the client's backward runs
``cls.backward`` there (another).  ``cls`` must be importable by the workers (defined at module level, or
pickled by value from the user's script as any remote function).  What forward sets on ``ctx`` and the tensors
it saves stay with the client's ctx until backward; tensor outputs are mesh tensors and other outputs come
back as values (the first rank's, as a remote function's non-tensor results: see docs/monarch.md).  Both
methods use cached propagation: a call with new argument metadata runs the method once more on the first rank
to learn its results' shapes, so they should not depend on side effects.
"""

from __future__ import annotations

import warnings

import torch

from .errors import user_line
from .remote import function_path, remote

__all__ = ["remote_autograd_function"]

_forward = remote("tdmesh.worker.autograd_functions.forward")
_backward = remote("tdmesh.worker.autograd_functions.backward")


def remote_autograd_function(target_class: type, name: str | None = None) -> type:
    """A ``torch.autograd.Function`` whose forward and backward are ``target_class``'s, run on the workers."""
    if getattr(target_class, "_tdmesh_remote_of", None) is not None:
        warnings.warn(f"{target_class.__name__} already runs on the workers: returned as it is", stacklevel=2)
        return target_class
    if not (isinstance(target_class, type) and issubclass(target_class, torch.autograd.Function)):
        raise TypeError(f"remote_autograd_function needs a torch.autograd.Function subclass, got {target_class!r}\n"
                        f"  at {user_line()}")
    target = function_path(target_class)

    def forward(ctx, *args):
        needs = tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        out, attrs, saved = _forward(target, needs, *args)
        ctx.save_for_backward(*[t for t in saved if isinstance(t, torch.Tensor)])
        ctx.tdmesh_saved = [None if isinstance(t, torch.Tensor) else t for t in saved]
        ctx.tdmesh_attrs = attrs
        ctx.tdmesh_needs = needs
        return out

    def backward(ctx, *grads):
        tensors = iter(ctx.saved_tensors)
        saved = tuple(next(tensors) if v is None else v for v in ctx.tdmesh_saved)
        return tuple(_backward(target, ctx.tdmesh_attrs, saved, ctx.tdmesh_needs, *grads))

    return type(name or f"Remote_{target_class.__name__}", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward),
                 "_tdmesh_remote_of": target_class, "__module__": target_class.__module__})

"""Monarch's ``OpaqueModule``: an ``nn.Module`` that lives on the workers, differentiable from the client.

``OpaqueModule("torch.nn.Linear", 3, 3)`` builds the module on every rank of the active mesh (an
``OpaqueObject``).  Its ``parameters()`` are mesh tensors that alias the live weights (a ``p.zero_()``
under ``no_grad`` zeroes the module's weight) and require grad on the client, so a client optimizer
can step them.  ``module(*args, propagator=fn)`` runs the module on every rank; ``fn(module, *args)``
shapes its outputs on the client, as a remote function's propagator.  With grad enabled and an input
or parameter requiring it, the call is one node of the client's autograd graph: its forward keeps the
worker's graph in a worker-resident box (freed when the client's graph lets go of it), its backward
differentiates that graph on the worker, and the parameters' gradients accumulate into the client's
parameter tensors' ``.grad``.  ``call_method(name, propagator, *args)`` is not differentiable.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .engine.tensor import Tensor
from .opaque import OpaqueObject
from .opaque_ref import OpaqueRef
from .remote import remote

__all__ = ["OpaqueModule"]

_parameters = remote("tdmesh.worker.objects.module_parameters")


class OpaqueModule:
    """An ``nn.Module`` built by ``constructor(*args, **kwargs)`` on every rank of the active mesh."""

    def __init__(self, *args, **kwargs) -> None:
        self._object = OpaqueObject(*args, **kwargs)
        self._parameters: list | None = None

    @property
    def object(self) -> OpaqueObject:
        return self._object

    def parameters(self) -> list:
        """The module's parameters as mesh tensors (aliasing the live weights; they require grad)."""
        if self._parameters is None:
            with self._object.stream.activate():
                params = _parameters(self._object)
            for p in params:
                p.requires_grad_(True)
            self._parameters = params
        return list(self._parameters)

    def call_method(self, method_name: str, propagator: Callable, *args, **kwargs):
        """The module's method ``method_name`` on every rank, not differentiable (``OpaqueObject.call_method``)."""
        return self._object.call_method(method_name, propagator, *args, **kwargs)

    def __call__(self, *args, propagator: Callable, **kwargs):
        params = self.parameters()
        flat = tree_flatten((args, kwargs))[0]
        inputs = [x for x in flat if type(x) is Tensor]
        if not torch.is_grad_enabled() or not any(t.requires_grad for t in inputs + params):
            return self.call_method("__call__", propagator, *args, **kwargs)
        structure: list = []  # the outputs' tree spec and non-tensor leaves, learnt by forward
        tensors = _ModuleCall.apply(self, propagator, args, kwargs, structure, len(inputs), *inputs, *params)
        spec, leaves = structure
        it = iter(tensors)
        return tree_unflatten([next(it) if leaf is None else leaf for leaf in leaves], spec)

    def __repr__(self) -> str:
        return f"<OpaqueModule {self._object.handle!r}>"


def _substituted(args, kwargs, tensors):
    """``(args, kwargs)`` with their mesh tensors, in order, replaced by ``tensors``."""
    leaves, spec = tree_flatten((args, kwargs))
    it = iter(tensors)
    return tree_unflatten([next(it) if type(x) is Tensor else x for x in leaves], spec)


class _ModuleCall(torch.autograd.Function):
    """One call of an OpaqueModule as a node of the client's autograd graph."""

    @staticmethod
    def forward(ctx, module, propagator, args, kwargs, structure, n_inputs, *tensors):
        needs = tuple(ctx.needs_input_grad[6:])
        args, kwargs = _substituted(args, kwargs, tensors[:n_inputs])

        def propagate(obj, needs, args, kwargs, *params):
            return OpaqueRef(None), propagator(module, *args, **kwargs)

        forward = remote("tdmesh.worker.objects.module_forward", propagate=propagate)
        graph, out = forward(module.object, needs, args, kwargs, *tensors[n_inputs:])
        leaves, spec = tree_flatten(out)
        structure += [spec, [None if type(x) is Tensor else x for x in leaves]]
        wanted = [t for t, need in zip(tensors, needs) if need]
        ctx.graph = graph
        ctx.needs = needs
        ctx.metas = [(tuple(t.shape), t.dtype) for t in wanted]
        return tuple(x for x in leaves if type(x) is Tensor)

    @staticmethod
    def backward(ctx, *grads):
        metas = ctx.metas
        backward = remote("tdmesh.worker.objects.module_backward",
                          propagate=lambda graph, *g: [torch.empty(s, dtype=d) for s, d in metas])
        found = iter(backward(ctx.graph, *grads))
        ctx.graph = None  # the worker's graph is spent: its box is freed with this handle
        return (None,) * 6 + tuple(next(found) if need else None for need in ctx.needs)

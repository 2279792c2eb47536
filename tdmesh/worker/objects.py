"""Worker side of ``mesh.spawn``: an object in the ref table, and calls of its methods."""

from __future__ import annotations

from ..protocol.resident import Resident
from .functions import resolve


def construct(target, args, kwargs) -> Resident:
    """``mesh.spawn``: build the object (``target`` is the class's import path or pickled bytes)."""
    return Resident(resolve(target)(*args, **kwargs))


def call_method(resident: Resident, name: str, *args, **kwargs):
    """``handle.call`` and ``handle.remote``: one method call on this rank's object."""
    if type(resident) is not Resident:
        raise TypeError(f"expected a worker-resident object (mesh.spawn), got {type(resident).__name__}")
    return getattr(resident.obj, name)(*args, **kwargs)


def module_parameters(resident: Resident) -> list:
    """``OpaqueModule.parameters()``: the module's parameters, detached, sharing the live weights' storage."""
    return [p.detach() for p in resident.obj.parameters()]


def module_forward(resident: Resident, needs: tuple, args, kwargs, *_params):
    """``OpaqueModule.__call__`` with gradients: the module runs with grad on, each input tensor the client
    flagged (``needs``: one flag per input tensor leaf, then per parameter) a fresh leaf; returns a box holding
    what backward needs (the outputs, the inputs and parameters to differentiate by) and the outputs, detached.
    The parameters the client passes alias the module's own, which are the ones differentiated."""
    import torch
    from torch.utils._pytree import tree_flatten, tree_unflatten

    leaves, spec = tree_flatten((args, kwargs))
    flags = iter(needs)
    wrt = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and next(flags):
            leaves[i] = leaf.detach().requires_grad_(True)
            wrt.append(leaves[i])
    wrt += [p for p, need in zip(resident.obj.parameters(), flags) if need]
    args, kwargs = tree_unflatten(leaves, spec)
    with torch.enable_grad():
        out = resident.obj(*args, **kwargs)
    outs, out_spec = tree_flatten(out)
    graph = Resident(([o for o in outs if isinstance(o, torch.Tensor)], wrt))
    return graph, tree_unflatten([o.detach() if isinstance(o, torch.Tensor) else o for o in outs], out_spec)


def module_backward(graph: Resident, *grads) -> list:
    """The gradients of a ``module_forward``'s inputs and parameters (zeros where an output did not reach one);
    ``grads``: one per tensor output."""
    import torch

    outs, wrt = graph.obj
    pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad and g is not None]
    found = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True) \
        if pairs else [None] * len(wrt)
    graph.obj = None  # the graph is spent (as autograd's without retain_graph): free it now
    return [torch.zeros_like(w) if g is None else g for w, g in zip(wrt, found)]

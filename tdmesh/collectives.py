"""Collectives over mesh dims and moves between meshes, from the client.

``t.reduce("gpu")`` is one ``Reduce`` message to the ranks of ``t``'s mesh; the workers run
it on process groups over those dims (NCCL on GPUs, gloo on CPUs).  ``t.to_mesh(other)``
is a point-to-point copy matched by dim name, broadcast over dims only the destination has;
autograd follows it (the gradient moves back), so a model can span meshes (pipelines).
The tensor methods ``reduce``, ``reduce_``, ``to_mesh`` and ``slice_mesh`` are defined here.
"""

from __future__ import annotations

import warnings
import weakref
from typing import NamedTuple

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .engine import backward as engine_backward
from .engine.dispatch import ship_local
from .engine.issue import New, issue
from .engine.placement import check_inputs, check_mutation, check_no_grad
from .engine.propagation import TensorMeta
from .engine.stream import get_active_stream
from .engine.tensor import Tensor, describe
from .errors import UsageError, user_line
from .geometry.grouping import normalize_dims, to_mesh_plan
from .protocol import messages as m

__all__ = ["reduce", "reduce_", "reduce_grads_in_backward", "GradReduction", "to_mesh", "slice_mesh",
           "MeshSliceTensor", "REDUCTIONS"]

REDUCTIONS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor", "stack")


def _contiguous_meta(shape, dtype) -> TensorMeta:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return TensorMeta(tuple(shape), tuple(reversed(strides)), 0, dtype)


class _ReducePlan(NamedTuple):
    """What a reduce of one (mesh, dims, reduction, scatter, input shape) needs: checked once."""
    dims: tuple
    out_shape: tuple
    factory: tuple


_plans: dict = {}


def _plan(t, dims, reduction: str, scatter: bool, inplace: bool) -> _ReducePlan:
    # the proxy's own fields, not t.shape and t.dtype: under an active mesh each of those is a round trip
    # through the mode's __torch_function__ (~2 us), and reduce_ plans every gradient of a step
    meta = t._meta
    key = (t._mesh.shape, dims, reduction, scatter, inplace, meta.size, meta.dtype)
    try:
        return _plans[key]
    except (KeyError, TypeError):  # TypeError: unhashable dims, checked (and refused) below
        pass
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; choose one of {list(REDUCTIONS)}")
    shape = t.mesh.shape
    named = normalize_dims(shape, (dims,) if isinstance(dims, str) else dims)
    n = shape.size(named)
    if (reduction == "stack" or scatter) and len(named) > 1:
        what = "stack" if reduction == "stack" else "scatter"
        raise ValueError(f"reduce with {what} over dims {list(named)} is not valid for multiple dimensions; "
                         f"reduce over one dim at a time")
    if scatter and (t.dim() == 0 or t.shape[0] != n):
        raise TypeError(f"When scattering over {list(named)} (size {n}), dim 0 of the tensor must be {n}, "
                        f"got shape {list(t.shape)}")
    if inplace and scatter and reduction != "stack":
        raise ValueError("reduce_ cannot scatter: the output has another shape than the input; use reduce(...)")
    if inplace and reduction == "stack" and not scatter:
        raise ValueError("reduce_ cannot stack: the output has another shape than the input; use reduce(...)")
    if reduction == "stack" and not scatter:
        out_shape = (n, *t.shape)
    elif scatter and reduction != "stack":
        out_shape = tuple(t.shape[1:])
    else:
        out_shape = tuple(t.shape)
    plan = _ReducePlan(named, out_shape, (tuple(t.shape), str(t.dtype).split(".")[1]))
    if len(_plans) > 4096:  # shapes of a long-running program are few; a program that varies them is not
        _plans.clear()
    if not isinstance(dims, list):  # a list of dims is valid, but no key
        _plans[key] = plan
    return plan


def _reduce(t, dims, reduction: str, scatter: bool, mesh, inplace: bool, out):
    if type(t) is not Tensor:
        raise TypeError(f"reduce needs a tdmesh tensor, got {type(t).__name__}\n  at {user_line()}")
    if mesh is not None:
        raise NotImplementedError("reduce(mesh=...) is not supported; reduce on the tensor's own mesh")
    plan = _plan(t, dims, reduction, scatter, inplace)
    check_no_grad([t], "reduce")
    stream = get_active_stream()
    inputs = [t] if out is None else [t, out]
    check_inputs(inputs, t.mesh, "reduce", stream)
    if out is not None:
        if type(out) is not Tensor:
            raise TypeError(f"out must be a tdmesh tensor on the same mesh, got {type(out).__name__}")
        if tuple(out.shape) != plan.out_shape or out.dtype != t.dtype:
            raise ValueError(f"out has shape {list(out.shape)} ({out.dtype}); Reduce expects the shape to be "
                             f"torch.Size({list(plan.out_shape)}) ({t.dtype})")
        check_mutation(out, "reduce(out=...)")
    if inplace:
        check_mutation(t, "reduce_")
    group = t.mesh.client.ensure_groups("dims", stream.id, t.mesh.shape, plan.dims)
    written = t if inplace else out
    outputs = [written] if written is not None else [New(_contiguous_meta(plan.out_shape, t.dtype))]

    def build(seq, results, _mutated):
        return m.Reduce(seq, results[0], t.ref, plan.factory, group, reduction, scatter, inplace,
                        out.ref if out is not None else None, stream.id)

    return issue(t.mesh, build, inputs=inputs, outputs=outputs, mutated=[written] if written is not None else (),
                 device=t.device, stream=stream)[0]


def reduce(tensors, dims=(), reduction: str = "sum", scatter: bool = False, mesh=None, out=None):
    """Reduce every tdmesh tensor of a pytree over mesh ``dims`` (``()`` = all dims)."""
    if type(tensors) is Tensor:
        return _reduce(tensors, dims, reduction, scatter, mesh, False, out)
    if out is not None:
        raise ValueError("out= is only supported when reducing a single tensor")
    return tree_map(lambda t: _reduce(t, dims, reduction, scatter, mesh, False, None), tensors)


def reduce_(tensors, dims=(), reduction: str = "sum", scatter: bool = False, mesh=None):
    """In-place :func:`reduce` over a pytree.

    Several tensors of one mesh and stream (gradients, say) travel as one message and are
    reduced in buckets, one collective per dtype and 32 MiB, as DDP does; tensors that share
    memory, stacks and scatters are reduced one by one.  In one bucketed call, a tensor that
    failed upstream marks every tensor of the call failed (peers still take part, nobody hangs)."""
    leaves, spec = tree_flatten(tensors)
    if _bucketable(leaves, reduction, scatter, mesh):
        _reduce_many(leaves, dims, reduction)
        return tree_unflatten(leaves, spec)
    return tree_map(lambda t: _reduce(t, dims, reduction, scatter, mesh, True, None), tensors)


def _bucketable(leaves: list, reduction: str, scatter: bool, mesh) -> bool:
    if len(leaves) < 2 or scatter or reduction == "stack" or mesh is not None:
        return False
    if any(type(t) is not Tensor for t in leaves):
        return False
    first = leaves[0]
    storages = {id(t._r.aliases) for t in leaves}
    return (len(storages) == len(leaves)
            and all(t._mesh is first._mesh and t._stream is first._stream for t in leaves))


def _reduce_many(leaves: list, dims, reduction: str) -> None:
    first = leaves[0]
    plans = [_plan(t, dims, reduction, False, True) for t in leaves]
    check_no_grad(leaves, "reduce")
    stream = get_active_stream()
    check_inputs(leaves, first.mesh, "reduce", stream)
    for t in leaves:
        check_mutation(t, "reduce_")
    group = first.mesh.client.ensure_groups("dims", stream.id, first.mesh.shape, plans[0].dims)
    refs = tuple(t.ref for t in leaves)
    factories = tuple(p.factory for p in plans)
    issue(first.mesh, lambda seq, results, mutated: m.ReduceMany(seq, refs, factories, group, reduction, stream.id),
          inputs=leaves, mutated=leaves, stream=stream)


class GradReduction:
    """What :func:`reduce_grads_in_backward` returns: ``remove()`` stops the reduction."""

    def __init__(self, params: list, spec: tuple) -> None:
        self._params = [weakref.ref(p) for p in params]
        self._spec = spec

    def remove(self) -> None:
        if not self._params:
            return  # removed already
        for ref in self._params:
            p = ref()
            if p is not None and getattr(p, "_reduce_in_backward", None) is self._spec:
                p._reduce_in_backward = None
        self._params = []
        engine_backward.REDUCING[0] -= 1


def reduce_grads_in_backward(params, dims=(), reduction: str = "avg") -> GradReduction:
    """From now on, each backward reduces these parameters' gradients over ``dims`` of their
    mesh (``"avg"``: DDP's data parallelism; or ``"sum"``) while it runs, as DDP overlaps its
    all-reduce with backward: where the workers run the backward (``tdmesh/engine/backward.py``)
    each fills DDP-sized buckets and starts a bucket's collective as soon as its gradients are
    in (``tdmesh/worker/overlap.py``); where the client's engine runs it, the gradients are
    reduced in one ``reduce_`` after it.  ``.grad`` after ``backward()`` is the reduced gradient
    either way.  As with DDP, a gradient accumulated over several backward calls is reduced at
    each of them."""
    params = [p for p in params]
    if reduction not in ("avg", "sum"):
        raise ValueError(f"reduce_grads_in_backward reduces gradients by 'avg' or 'sum', not {reduction!r}"
                         f"\n  at {user_line()}")
    if not params:
        raise ValueError(f"reduce_grads_in_backward: no parameters given\n  at {user_line()}")
    first = params[0]
    for p in params:
        if type(p) is not Tensor or p._mesh is not first._mesh or p._stream is not first._stream:
            raise UsageError(f"reduce_grads_in_backward: every parameter must be a tensor of one mesh and "
                             f"stream, got {describe(p)}\n  at {user_line()}")
    spec = (_plan(first, dims, reduction, False, True).dims, reduction)
    for p in params:
        p._reduce_in_backward = spec  # read by each backward (engine/backward.py)
    engine_backward.REDUCING[0] += 1
    return GradReduction(params, spec)


def _reduce_after_client_backward(groups: dict) -> None:
    """A backward the client's engine ran: its registered gradients, reduced after it."""
    for (dims, reduction), grads in groups.items():
        reduce_(grads, dims, reduction)


engine_backward.REDUCE_AFTER_CLIENT_BACKWARD[0] = _reduce_after_client_backward


class MeshSliceTensor:
    """``t.slice_mesh(**kw)``: ``t`` seen on a sub-mesh, ready to ``to_mesh``.  Sends nothing."""

    def __init__(self, tensor: Tensor, mesh) -> None:
        self.tensor = tensor
        self.mesh = mesh

    def to_mesh(self, mesh, stream=None) -> Tensor:
        """Copy the sliced tensor to ``mesh`` (see :func:`to_mesh`)."""
        return _to_mesh(self.tensor, self.mesh, mesh, stream)

    def __repr__(self) -> str:
        return f"<MeshSliceTensor of tensor {self.tensor.ref} on {self.mesh.shape}>"


def _to_mesh(t: Tensor, source, dest, stream=None) -> Tensor:
    if type(t) is not Tensor:
        raise TypeError(f"to_mesh needs a tdmesh tensor, got {type(t).__name__}\n  at {user_line()}")
    if dest.client is not t.mesh.client:
        raise ValueError("to_mesh moves tensors within one fleet; these meshes belong to different fleets")
    to_mesh_plan(source.shape, dest.shape)  # raises on meshes that do not match, before any autograd node
    broadcast = [d for d in dest.names if d not in source.names]
    if broadcast:
        warnings.warn(f"to_mesh broadcasts over destination dims {broadcast} that the source lacks", stacklevel=3)
    if t.requires_grad and torch.is_grad_enabled():
        return _DifferentiableMove.apply(t, source, dest, stream)
    return _move(t, source, dest, stream)


def _move(t: Tensor, source, dest, stream=None, home=None) -> Tensor:
    """The SendTensors of one move from ``source`` (``t``'s mesh or a slice of it) to
    ``dest``.  ``home``: the result lives on this mesh, of which ``dest`` is a slice, and
    its ranks outside ``dest`` bind zeros (a gradient going back into a sliced tensor)."""
    client = t.mesh.client
    plan = to_mesh_plan(source.shape, dest.shape)
    from_stream = t.stream
    to_stream = stream if stream is not None else from_stream
    check_inputs([t], t.mesh, "to_mesh", from_stream)
    client.ensure_groups("p2p", from_stream.id, to_stream=to_stream.id)
    factory = (tuple(t.shape), str(t.dtype).split(".")[1])
    result_mesh = dest if home is None else home
    zeros_on = home.processes if home is not None and home.shape != dest.shape else None
    fills = set(zeros_on) if zeros_on is not None else set()

    def build(seq, results, _mutated):  # one message per (senders, receivers) pair of the plan
        return [(sorted(set(senders) | set(receivers) | fills),
                 m.SendTensor(seq, results[0], senders, receivers, t.ref, factory, from_stream.id, to_stream.id,
                              zeros_on))
                for senders, receivers in plan]

    return issue(result_mesh, build, inputs=[t], outputs=[New(_contiguous_meta(t.shape, t.dtype))], device=t.device,
                 stream=to_stream)[0]


class _DifferentiableMove(torch.autograd.Function):
    """``to_mesh`` as an autograd node: the gradient travels back to the source, summed
    over the destination dims the move broadcast over (each copy got its own gradient)."""

    @staticmethod
    def forward(ctx, t, source, dest, stream):
        ctx.source, ctx.dest, ctx.home, ctx.stream = source, dest, t.mesh, t.stream
        return _move(t, source, dest, stream)

    @staticmethod
    def backward(ctx, grad):
        broadcast = [d for d in ctx.dest.names if d not in ctx.source.names]
        mesh = ctx.dest
        if broadcast:
            grad = grad.reduce(tuple(broadcast), "sum")
            mesh = mesh.slice(**{d: 0 for d in broadcast})
        return _move(grad, mesh, ctx.source, ctx.stream, home=ctx.home), None, None, None


def to_mesh(tensors, mesh, stream=None):
    """Copy every tensor of a pytree to ``mesh``: tdmesh tensors (or MeshSliceTensors) move
    between meshes; local tensors are shipped, the same copy to every rank."""
    def move(x):
        if isinstance(x, MeshSliceTensor):
            return x.to_mesh(mesh, stream)
        if isinstance(x, torch.Tensor) and type(x) is not Tensor:
            return ship_local(x, mesh, stream)
        return _to_mesh(x, x.mesh if type(x) is Tensor else None, mesh, stream)
    return tree_map(move, tensors, is_leaf=lambda x: isinstance(x, MeshSliceTensor))


def slice_mesh(tensors, **kw):
    """``t.slice_mesh(**kw)`` for every tdmesh tensor of a pytree."""
    return tree_map(lambda t: MeshSliceTensor(t, t.mesh.slice(**kw)), tensors)


# ----------------------------------------------------------------------------- tensor methods
def _method_reduce(self, dims=(), reduction: str = "sum", scatter: bool = False, mesh=None, _inplace: bool = False,
                   out=None):
    """Reduce over mesh ``dims`` (``()`` = every dim): ``sum avg product min max band bor bxor``
    or ``stack`` (a leading dim of the group size); ``scatter`` splits dim 0 over the group."""
    return _reduce(self, dims, reduction, scatter, mesh, _inplace, out)


def _method_reduce_(self, dims=(), reduction: str = "sum", scatter: bool = False, mesh=None):
    """In-place :meth:`reduce`."""
    return _reduce(self, dims, reduction, scatter, mesh, True, None)


def _method_to_mesh(self, mesh, stream=None):
    """A copy of this tensor on ``mesh`` (dims matched by name, broadcast over new dims)."""
    return _to_mesh(self, self._mesh, mesh, stream)


def _method_slice_mesh(self, **kw):
    """This tensor restricted to ``self.mesh.slice(**kw)``, to move with ``.to_mesh``."""
    return MeshSliceTensor(self, self._mesh.slice(**kw))


Tensor.reduce = _method_reduce  # type: ignore[attr-defined]
Tensor.reduce_ = _method_reduce_  # type: ignore[attr-defined]
Tensor.to_mesh = _method_to_mesh  # type: ignore[attr-defined]
Tensor.slice_mesh = _method_slice_mesh  # type: ignore[attr-defined]

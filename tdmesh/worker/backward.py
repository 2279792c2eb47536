"""Backward run by the workers' own autograd (the client's half: ``tdmesh/engine/backward.py``).

While a mesh's forward runs, each worker records the same autograd graph the client does: a
leaf the client makes require grad is made to here (``set_requires_grad``), and every op runs
under the client's grad mode (``DefineOp.grad``, ``CallFunction.grad``).  A ``loss.backward()``
whose graph allows it is then one call of ``run_backward``, not one message per backward op.

Everything else a worker runs must leave that graph as the client's: a remote function's
results are detached once leaves are mirrored (the client's proxies of them do not require
grad, so nothing computed from them may carry gradient here), and a graph the client runs
backward through itself is dropped (``drop_graphs``), so that its saved activations are freed
as the client frees its own, not when the last tensor of the forward dies.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from ..protocol.graph_digest import digest, reachable
from .groups import Groups
from .overlap import Overlap, join_with_zeros
from .streams import current_stream
from .values import held_results

__all__ = ["set_requires_grad", "run_backward", "run_grad", "drop_graphs", "detach_results"]

_state = {"mirrored": False}  # whether a client mirrored a leaf's requires_grad into this process


def set_requires_grad(tensor: torch.Tensor, requires_grad: bool) -> None:
    """A leaf's ``requires_grad_`` on the client, mirrored here."""
    _state["mirrored"] = True
    tensor.requires_grad_(requires_grad)


def mirrored() -> bool:
    return _state["mirrored"]


def forget_mirroring() -> None:
    """A warm worker's next job starts as a fresh process does."""
    _state["mirrored"] = False


def remote_results(value, expect: tuple, function):
    """A remote function's results as the worker binds them: held as plain tensors and checked against the
    client's propagation (``values.held_results``), detached where they carry gradient (``detach_results``)."""
    value = held_results(value, expect, function)
    return detach_results(value) if mirrored() else value


def detach_results(value):
    """A remote function's results as the workers bind them: tensors that carry gradient here
    are detached, as their proxies on the client carry none (only once leaves are mirrored:
    before, any graph here is the remote function's own)."""
    if type(value) is tuple and all(type(v) is torch.Tensor for v in value):  # a backward's new gradients
        if not any(v.requires_grad for v in value):
            return value
        return tuple(v.detach() if v.requires_grad else v for v in value)
    return tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) and v.requires_grad else v, value)


def run_backward(roots: list, grad_roots: list, leaves: list, grads: list, retain_graph: bool,
                 expected: tuple[int, int, int], reduce: tuple = (), leaf_specs: tuple = ()) -> tuple:
    """``torch.autograd.backward(roots, grad_roots, inputs=leaves)`` with each leaf's ``.grad``
    first set to what the client's proxy holds (``grads``: a tensor or None); returns the new
    gradients of the leaves that had none, in order (the client made their proxies).

    Refuses (every result poisoned, nothing accumulated) when this worker's graph is not the
    client's (``expected`` is the client's digest) or when torch leaves a leaf without a
    gradient that the client made a proxy for.  ``reduce``: ``(leaf indices, group id, reduction)``
    of the gradients to reduce while backward runs (``tdmesh.worker.overlap``), ``leaf_specs`` each
    leaf's (elements, dtype name) for a rank that cannot run it (``_join_reductions``)."""
    overlap = None
    if reduce:
        groups = Groups.current  # this session's process groups (this runs on one of its streams)
        assert groups is not None
        overlap = Overlap(leaves, [(indices, groups.by_id(group), how) for indices, group, how in reduce])
    try:
        _check_graph(roots, expected)
        for leaf, grad in zip(leaves, grads):
            leaf.grad = grad
        torch.autograd.backward(roots, [g for g in grad_roots] if any(g is not None for g in grad_roots) else None,
                                retain_graph=retain_graph, inputs=leaves)
    except BaseException:
        if overlap is not None:  # peers are in (or will start) the same collectives: take part, with zeros
            overlap.finish(failed=True)
        raise
    if overlap is not None and not overlap.finish(failed=False):
        raise RuntimeError("tdmesh: a gradient to reduce during backward was not made on this rank; its buckets "
                           "were reduced with zeros so that no peer waits")
    new = []
    for i, (leaf, had) in enumerate(zip(leaves, grads)):
        grad = leaf.grad
        if grad is None:
            raise RuntimeError(f"tdmesh: backward gave leaf {i} of this graph ({tuple(leaf.shape)}) no gradient, "
                               f"where the client expected one; run with TDMESH_BACKWARD=client for this model")
        if had is None:
            laid_out = _laid_out_as(leaf, grad)
            if laid_out is not grad:
                grad = leaf.grad = laid_out
            new.append(grad)
    return tuple(new)


def _join_reductions(args: tuple, kwargs: dict, device) -> None:
    """``run_backward`` on a rank where an argument failed upstream (the interpreter poisons its results
    without calling it): the reductions registered for it still run there, with zeros, so peers whose
    backward ran do not wait for this rank in their collectives until the process group times out."""
    params = dict(zip(("roots", "grad_roots", "leaves", "grads", "retain_graph", "expected", "reduce",
                       "leaf_specs"), args)) | kwargs
    reduce, specs = params.get("reduce") or (), params.get("leaf_specs") or ()
    if not reduce or not specs:
        return
    groups = Groups.current
    assert groups is not None
    join_with_zeros(list(specs), [(indices, groups.by_id(group), how) for indices, group, how in reduce], device)


run_backward.on_poison = _join_reductions  # type: ignore[attr-defined]


def run_grad(roots: list, grad_roots: list, inputs: list, retain_graph: bool, expected: tuple[int, int, int]) -> tuple:
    """``torch.autograd.grad(roots, inputs, grad_roots)``: the gradients, laid out as their inputs
    (the client made their proxies so), where every input has one (the client checked it is in the graph)."""
    _check_graph(roots, expected)
    grads = torch.autograd.grad(roots, inputs, [g for g in grad_roots] if any(g is not None for g in grad_roots)
                                else None, retain_graph=retain_graph, allow_unused=True)
    out = []
    for i, (x, grad) in enumerate(zip(inputs, grads)):
        if grad is None:
            raise RuntimeError(f"tdmesh: backward gave input {i} ({tuple(x.shape)}) no gradient, where the client "
                               f"expected one; run with TDMESH_BACKWARD=client for this model")
        out.append(_laid_out_as(x, grad))
    return tuple(out)


def _laid_out_as(like: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` with ``like``'s strides and no offset, as the client's proxy of it says (a copy where not)."""
    if grad.storage_offset() == 0 and grad.stride() == like.stride():
        return grad
    return torch.empty_strided(like.shape, like.stride(), dtype=grad.dtype, device=grad.device).copy_(grad)


def _check_graph(roots: list, expected) -> None:
    nodes, edges = reachable([r.grad_fn for r in roots])
    found = digest(nodes, edges)
    if found != tuple(expected):
        raise RuntimeError(
            f"tdmesh: this worker's autograd graph is not the client's (nodes, edges, names: {found} here, "
            f"{tuple(expected)} on the client), so its gradients would not be the ones asked for; nothing was "
            f"computed.  This is a tdmesh bug: please report it, and run with TDMESH_BACKWARD=client meanwhile")


def drop_graphs(roots: list) -> None:
    """The client runs this graph's backward itself: free what this worker's copy of it saved
    now (each value of this stream whose node is in it is replaced by a detached alias, so the
    graph has no owner left), not when the forward's last tensor dies."""
    nodes, _ = reachable([r.grad_fn for r in roots if isinstance(r, torch.Tensor)])
    stream = current_stream()
    if not nodes or stream is None:
        return
    inside = set(nodes)
    env = stream.env
    for ref, value in list(env.items()):
        if isinstance(value, torch.Tensor) and value.grad_fn is not None and value.grad_fn in inside:
            env[ref] = value.detach()

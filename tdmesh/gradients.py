"""Incremental backward: gradients yielded as backward makes them (Monarch's ``grad_generator``).

``loss.backward()`` issues every backward op before the first line after it runs, so a
gradient reduction written after it starts when backward has been issued whole.  Iterating
``tdmesh.grad_generator(loss, params)`` issues only the backward ops that the next gradient
needs, then yields it: a ``g.reduce_("dp")`` in the loop body is issued between the backward
ops, and the workers (which run each stream's ops in order) start reducing that gradient
while the rest of backward runs -- on another stream (``stream.borrow``) the two overlap.

The generator walks autograd's graph itself and calls each node (``torch.autograd.grad``'s
values, within rounding of the summation order): a node runs once every node that feeds it
has run, the ancestors of the next gradient first, newest forward op first among them (the
order of torch's engine).  Each node runs under ``torch.no_grad()`` and under the mesh and
stream its forward op ran on (``tdmesh.engine.autograd_context``), so a pipeline's stages
and a side stream's ops go back where they came from.  As with ``torch.autograd.grad``,
nothing accumulates into ``.grad``.  What differs from torch's engine: hooks registered on
tensors or nodes of the graph do not run, and ``create_graph`` is not offered.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from typing import Any, Union

import torch
from torch.autograd.graph import GradientEdge

from .engine.activation import no_mesh
from .engine.autograd_context import forward_context
from .engine.context import active_mesh_or_none
from .engine.propagation import TensorMeta
from .engine.stream import get_active_stream
from .engine.tensor import Tensor
from .errors import UsageError, user_line

__all__ = ["grad_generator", "grad_function", "gradient_execution_order"]

TensorOrEdge = Union[torch.Tensor, GradientEdge]


def _checked(x, what: str):
    if not isinstance(x, (torch.Tensor, GradientEdge)):
        raise UsageError(f"{what}: expected a tensor or a torch.autograd.graph.GradientEdge, got "
                         f"{type(x).__name__}\n  at {user_line()}")
    if isinstance(x, torch.Tensor) and not x.requires_grad:
        raise UsageError(f"{what}: a tensor that does not require grad has no gradient\n  at {user_line()}")
    return x


def _node_of(x):
    """The node whose input ``x``'s gradient arrives at, where that is known without an op
    (torch's ``get_gradient_edge`` runs ``view_as`` for a leaf: a remote op on a mesh)."""
    if isinstance(x, GradientEdge):
        return x.node
    return x.grad_fn


def _key(x, accumulators: dict) -> tuple:
    """``(node, input slot)`` where ``x``'s gradient is summed; a leaf's node is its
    AccumulateGrad node found in the graph (a leaf the graph does not reach gets a key of its own)."""
    if isinstance(x, GradientEdge):
        return (x.node, x.output_nr)
    if x.grad_fn is not None:
        return (x.grad_fn, x.output_nr)
    node = accumulators.get(id(x))
    return (node, 0) if node is not None else ("leaf", id(x))


def _as_list(x) -> list:
    return [x] if isinstance(x, (torch.Tensor, GradientEdge)) else list(x)


def _reach(nodes: list) -> tuple[list, set, dict]:
    """The nodes reached from ``nodes`` (each after every node below it), that set, and the
    AccumulateGrad nodes among them by the id of their leaf."""
    order: list = []
    seen: set = set()
    for start in nodes:
        if start is None:
            continue
        stack = [(start, False)]
        while stack:
            node, done = stack.pop()
            if done:
                order.append(node)
                continue
            if node in seen:
                continue
            seen.add(node)
            stack.append((node, True))
            stack.extend((n, False) for n, _ in node.next_functions if n is not None and n not in seen)
    accumulators = {id(n.variable): n for n in seen if hasattr(n, "variable")}
    return order, seen, accumulators


def gradient_execution_order(roots: TensorOrEdge | Sequence[TensorOrEdge],
                             with_respect_to: Sequence[TensorOrEdge]) -> list[int]:
    """The indices of ``with_respect_to`` in the order backward from ``roots`` completes their
    gradients: a gradient is complete once its last use in the forward has been run backward,
    so the tensor whose first use came last comes first.  Iterate ``grad_generator`` in this
    order to have each gradient as early as possible."""
    wanted = [_checked(t, "gradient_execution_order") for t in with_respect_to]
    _, seen, accumulators = _reach([_node_of(_checked(r, "gradient_execution_order")) for r in _as_list(roots)])
    keys = [_key(t, accumulators) for t in wanted]
    first_use: dict[tuple, float] = {k: math.inf for k in keys}
    for node in seen:
        for key in node.next_functions:
            if key in first_use:
                first_use[key] = min(first_use[key], node._sequence_nr())
    return sorted(range(len(keys)), key=lambda i: first_use[keys[i]], reverse=True)


def grad_generator(roots: TensorOrEdge | Sequence[TensorOrEdge] = (),
                   with_respect_to: Sequence[TensorOrEdge] = (),
                   grad_roots: Sequence[torch.Tensor | None] = ()) -> Iterator[torch.Tensor | None]:
    """Yield the gradient of ``roots`` with respect to each of ``with_respect_to``, in that order,
    running just the backward each one needs before it is yielded (None: not reached from the
    roots).  ``grad_roots``: the gradient of each root (default: ones, for a one-element root)."""
    return _Backward(_as_list(roots), list(with_respect_to), list(grad_roots))


class _Backward:
    """The state of one incremental backward: the graph between the roots and the wanted
    edges, the gradients summed at each edge so far, and what has run."""

    def __init__(self, roots: list, with_respect_to: list, grad_roots: list) -> None:
        if len(grad_roots) not in (0, len(roots)):
            raise UsageError(f"grad_generator: {len(grad_roots)} grad_roots for {len(roots)} roots\n  at {user_line()}")
        roots = [_checked(r, "grad_generator(roots=...)") for r in roots]
        wanted = [_checked(t, "grad_generator(with_respect_to=...)") for t in with_respect_to]
        order, self._reached, accumulators = _reach([_node_of(r) for r in roots])
        self._keys = [_key(t, accumulators) for t in wanted]
        self._next = 0
        self._grads: dict[tuple, Any] = {}  # (node, input slot) -> the gradient summed there so far
        self._kept: dict[tuple, Any] = {}  # a wanted edge's gradient, kept when its node ran before it was asked for
        self._unasked = set(self._keys)
        self._inputs: dict = {}  # node -> [(shape, dtype) of each input], read once
        for k, root in enumerate(roots):
            grad = grad_roots[k] if grad_roots else None
            if grad is None:
                grad = _ones_for(root)
            node, slot = _key(root, accumulators)
            self._add(node, slot, grad)
        self._plan(order, {k[0] for k in self._keys})
        self._done: set = set()

    def _plan(self, order: list, wanted_nodes: set) -> None:
        """Which nodes must run (those with a wanted edge below them), and the edges into each
        node from the nodes that run (it is complete when they have all delivered)."""
        leads: set = set()  # nodes from which a wanted edge is reached
        self._runs: set = set()
        for node in order:  # children first
            below = [n for n, _ in node.next_functions if n is not None and n in leads]
            if below:
                self._runs.add(node)
            if below or node in wanted_nodes:
                leads.add(node)
        self._above: dict = {n: [] for n in self._reached}  # the running nodes with an edge into each (per edge)
        for node in self._runs:
            for n, _ in node.next_functions:
                if n is not None:
                    self._above[n].append(node)

    def _add(self, node, slot: int, grad) -> None:
        key = (node, slot)
        have = self._grads.get(key)
        self._grads[key] = grad if have is None else have + grad

    def __iter__(self) -> _Backward:
        return self

    def __next__(self) -> torch.Tensor | None:
        if self._next >= len(self._keys):
            raise StopIteration
        key = self._keys[self._next]
        self._next += 1
        node = key[0]
        if node in self._reached:
            with ExitStack() as contexts, torch.no_grad():
                current: list = [(active_mesh_or_none(), get_active_stream())]
                for ancestor in self._ancestors_in_order(node):
                    self._run(ancestor, contexts, current)
        self._unasked.discard(key)
        if key in self._kept:
            return self._kept.pop(key)
        if node in self._runs and node not in self._done:
            grad = self._grads.get(key)  # the node still runs with it: the caller gets its own copy
            return None if grad is None else _in_context(grad, lambda g: g.clone())
        return self._grads.pop(key, None)

    def _ancestors_in_order(self, target) -> Iterator:
        """The nodes not yet run that feed ``target``, each after all that feed it, the newest
        forward op first among those ready (torch's engine's priority)."""
        need: set = set()
        stack = list(self._above[target])
        while stack:
            node = stack.pop()
            if node in need or node in self._done:
                continue
            need.add(node)
            stack.extend(self._above[node])
        waiting = {n: sum(1 for m in self._above[n] if m in need) for n in need}
        ready = [(-n._sequence_nr(), id(n), n) for n in need if waiting[n] == 0]
        heapq.heapify(ready)
        while ready:
            node = heapq.heappop(ready)[2]
            yield node
            for n, _ in node.next_functions:
                if n in waiting:
                    waiting[n] -= 1
                    if waiting[n] == 0:
                        heapq.heappush(ready, (-n._sequence_nr(), id(n), n))

    def _run(self, node, contexts: ExitStack, current: list) -> None:
        grads = [self._grads.pop((node, i), None) for i in range(len(node._input_metadata))]
        for i, g in enumerate(grads):
            if (node, i) in self._unasked and g is not None:
                self._kept[(node, i)] = g  # its node's ops are issued before the caller can change it
        self._done.add(node)
        outs: Sequence = ()
        if any(g is not None for g in grads):
            _enter(node, grads, contexts, current)
            outs = _call(node, grads)
        for k, (n, slot) in enumerate(node.next_functions):
            grad = outs[k] if n is not None and k < len(outs) else None
            if grad is not None:
                self._add(n, slot, self._fit(grad, n, slot, node))

    def _fit(self, grad: torch.Tensor, node, slot: int, producer) -> torch.Tensor:
        """``grad`` in the shape and dtype of ``node``'s input ``slot``, as torch's engine makes
        it (a broadcast input's gradient comes summed to the input's shape)."""
        expected = self._inputs.get(node)
        if expected is None:
            expected = self._inputs[node] = [(tuple(m.shape), m.dtype) for m in node._input_metadata]
        shape, dtype = expected[slot]
        meta = getattr(grad, "_meta", None)  # a dense proxy's metadata: read without a torch call
        have = (tuple(meta.size), meta.dtype) if isinstance(meta, TensorMeta) else (tuple(grad.shape), grad.dtype)
        if have[0] != shape:
            try:
                grad = grad.sum_to_size(shape)
            except RuntimeError:
                raise RuntimeError(f"{producer.name()} returned a gradient of shape {have[0]} for an input of "
                                   f"shape {shape}") from None
        if have[1] != dtype:
            grad = grad.to(dtype)
        return grad


def _ones_for(root) -> torch.Tensor:
    if not isinstance(root, torch.Tensor):
        raise UsageError(f"grad_generator: a GradientEdge root needs its gradient in grad_roots\n  at {user_line()}")
    if root.numel() != 1:
        raise UsageError(f"grad_generator: the gradient of a root of shape {tuple(root.shape)} cannot be implied "
                         f"(only a one-element root's is ones); pass grad_roots\n  at {user_line()}")
    return _in_context(root, torch.ones_like)


def _in_context(t: torch.Tensor, fn: Callable) -> torch.Tensor:
    """``fn(t)`` on the mesh and stream of ``t`` (whichever are active now)."""
    with ExitStack() as contexts:
        if isinstance(t, Tensor):
            contexts.enter_context(t._mesh.activate())
            contexts.enter_context(t._stream.activate())
        with torch.no_grad():
            return fn(t)


def _enter(node, grads: list, contexts: ExitStack, current: list) -> None:
    """Make the mesh and stream of ``node``'s forward active (where they are not already)."""
    context = forward_context(node._sequence_nr())
    if context is not None:
        context = context[:2]
    if context is None:  # older than the ranges kept: where its gradients are
        first = next((g for g in grads if isinstance(g, Tensor)), None)
        context = (first._mesh, first._stream) if first is not None else current[0]
    if context is None or context == current[0]:
        return
    mesh, stream = context
    contexts.enter_context(no_mesh.activate() if mesh is None else mesh.activate())
    contexts.enter_context(stream.activate())
    current[0] = context


def _call(node, grads: list) -> Sequence:
    """Run one node on its output gradients; returns one gradient per ``next_functions`` entry."""
    if not hasattr(node, "_forward_cls"):  # a C++ node takes undefined gradients as None
        out = node(*grads)
        return out if isinstance(out, tuple) else (out,)
    # a torch.autograd.Function's node: its backward gets zeros for missing gradients (as the
    # engine materializes them) and returns one value per forward argument; the entries of
    # next_functions are those of the tensor arguments that require grad, in order
    grads = [g if g is not None else _zeros(m) for g, m in zip(grads, node._input_metadata)]
    out = node.apply(*grads)
    out = out if isinstance(out, tuple) else (out,)
    needs = node.needs_input_grad
    if len(out) != len(needs):
        raise RuntimeError(f"{node.name()}: backward returned {len(out)} gradients for {len(needs)} forward arguments")
    per_edge = iter(g for g, need in zip(out, needs) if need)
    return tuple(next(per_edge, None) if n is not None else None for n, _ in node.next_functions)


def _zeros(metadata) -> torch.Tensor:
    return torch.zeros(metadata.shape, dtype=metadata.dtype)


class _GradFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, *args):
        result, backward = fn(*args)
        ctx.backward_of_fn = backward
        return result

    @staticmethod
    def backward(ctx, *grads):
        out = ctx.backward_of_fn(*grads)
        return (None, *(out if isinstance(out, tuple) else (out,)))


def grad_function(fn: Callable) -> Callable:
    """``fn(*args)`` returns ``(result, backward)``; the returned function computes ``result``
    and, in backward, calls ``backward(*grads of result)`` for one gradient per argument (None
    for a non-tensor).  The closure ``backward`` keeps what it captures until the graph is
    freed -- typically the forward's tensors, or a mesh to send the gradient back to::

        @tdmesh.grad_function
        def to_mesh(x, mesh):
            source = x.mesh
            return x.to_mesh(mesh), lambda g: (g.to_mesh(source), None)
    """
    def call(*args):
        return _GradFunction.apply(fn, *args)
    call.__name__ = getattr(fn, "__name__", "grad_function")
    call.__doc__ = fn.__doc__
    return call

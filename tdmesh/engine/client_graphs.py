"""Autograd nodes made by a backward on the client's engine (``create_graph=True``): the workers have no copy.

A backward that builds a graph (a gradient penalty, a Hessian-vector product, double backward,
``torch.autograd.functional.hessian`` or ``jvp``) runs on the client's engine (``backward.py``).  The ops it
issues are the backward formulas' aten ops, but the engine also links each saved leaf it unpacks to that
leaf's gradient accumulator, at the autograd level above the dispatcher: the workers see only an
``aten.detach`` of the leaf, so their copies of such a backward's results do not require grad.  A later
backward over those results cannot run on the workers: their graph lacks the nodes (they refused it, as
their digest differed, and the call failed; ``tests/fleet/test_double_backward.py``).  So once such a
backward returns, the nodes it made (those its results reach that the graph it ran over did not hold) are
marked in their ``metadata``, and a backward whose graph reaches a marked node runs on the client's engine.
The walk runs only after such a backward, and the check only once a node was ever marked.
"""

from __future__ import annotations

import torch

from ..protocol.graph_digest import reachable

__all__ = ["graph_nodes", "mark_new", "run_marking", "reaches_marked", "MARKED"]

_MARK = "tdmesh: made by a backward on the client's engine"
MARKED = [0]  # nodes marked so far (none: a backward's graph is not looked at)


def _grad_fns(tensors) -> list:
    with torch._C.DisableTorchFunction():
        return [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]


def graph_nodes(tensors) -> set:
    """The nodes reached from ``tensors`` (a backward's roots, before it runs)."""
    return set(reachable(_grad_fns(tensors))[0])


def mark_new(before: set, results) -> None:
    """Mark the nodes ``results`` (a backward's new gradients) reach that ``before`` did not hold."""
    seen: set = set()
    stack = [n for n in _grad_fns(results) if n not in before]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        node.metadata[_MARK] = True
        stack.extend(child for child, _ in node.next_functions if child is not None and child not in before)
    MARKED[0] += len(seen)


def reaches_marked(nodes) -> bool:
    """Whether any of ``nodes`` (a backward's graph) was made by a backward on the client's engine."""
    return any(_MARK in node.metadata for node in nodes)


def run_marking(run, roots, create_graph: bool, new_gradients):
    """``run()``, a backward on the client's engine over ``roots``; with ``create_graph``, the nodes it made
    are marked.  ``new_gradients(out)`` gives its new gradients from its result (``torch.autograd.grad``);
    None: they are the ``.grad`` of the graph's leaves (``backward``)."""
    before = graph_nodes(roots) if create_graph else None
    out = run()
    if before is not None:
        if new_gradients is not None:
            mark_new(before, new_gradients(out))
        else:
            with torch._C.DisableTorchFunction():
                mark_new(before, [n.variable.grad for n in before if hasattr(n, "variable")])
    return out

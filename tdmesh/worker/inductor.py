"""``backend="inductor"``: a recording's aten ops as FX graphs, compiled by inductor directly.

A recording already is the straight-line program that dynamo would recover from a Python
function's bytecode: every op is an aten ``OpOverload`` with its constants bound and its
tensors named by refs.  So the worker builds the FX graphs itself (each ref a node) and hands
each to inductor (``compile_fx``, the compiler ``torch.compile`` hands its graphs to), with the
call's own tensors as example inputs.  The steps inductor should not see -- collectives, the
fused optimizer kernels, user functions -- run as they are between the graphs.  Tracing the
generated body with dynamo instead took 18 of the 66 s that GPT-2 width's step took to compile
on an H200 (its first frame traced twice around the collective's graph break, and the
resumed frame again), which is what this saves.

One compile per host: every rank of a mesh defines the same recording, so on one host N
workers would compile the same graphs at once.  torch's own caches (inductor's FX graph cache,
one directory per user) make a second compile of a graph already compiled on this host a
cache load, so a graph's first call takes a host-wide file lock named by its code: the first
rank compiles and fills the cache, the others wait and load.  A rank holds the lock only while
it compiles (never across a collective, which runs between graphs), so no rank waits forever.
"""

from __future__ import annotations

import fcntl
import hashlib
import operator
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from ..protocol import messages as m
from .ops import DefinedOp

__all__ = ["graphable", "GraphBuilder", "CompiledGraph"]


def graphable(op: DefinedOp, results: int) -> bool:
    """Whether a CallOp of ``op`` with ``results`` result refs can be a node of an inductor graph:
    an aten op (not a fused optimizer kernel: functionalizing its writes to the parameters fails
    inside torch 2.11-2.13) whose results are exactly its tensors, or that returns nothing (the in-place
    ``_foreach_*_`` ops of torch's multi-tensor optimizers: inductor functionalizes their writes and fuses
    them, where aten ran each as its own kernel between the graphs), with no tensor among its constants."""
    fn = op.fn
    if not isinstance(fn, torch._ops.OpOverload) or fn._schema.name.startswith("aten::_fused_"):
        return False
    if fn.namespace not in ("aten", "prims"):
        return False
    kinds = [str(r.type) for r in fn._schema.returns]
    if kinds == ["List[Tensor]"] or (not kinds and results <= 1):
        pass  # a list of tensors: one result each; or none (an in-place multi-tensor op: its plan's one None)
    elif any(k != "Tensor" for k in kinds) or len(kinds) != results:
        return False
    return not _holds_tensor((op.args, op.kwargs))


def _holds_tensor(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, (tuple, list)):
        return any(_holds_tensor(x) for x in obj)
    if isinstance(obj, dict):
        return any(_holds_tensor(x) for x in obj.values())
    return False


class GraphBuilder:
    """One FX graph of consecutive graphable steps: refs read from before it are its inputs,
    named at their first read by ``outside(ref)`` (the program's local for that ref)."""

    def __init__(self, outside: Callable[[int], str]) -> None:
        self.graph = torch.fx.Graph()
        self.outside = outside
        self.inputs: list[int] = []        # refs read from outside, in the order of the placeholders
        self.input_names: list[str] = []
        self.nodes: dict[int, torch.fx.Node] = {}  # ref -> its node (inputs, and refs defined here)
        self.defined: list[int] = []       # refs defined here, in order (a ref may repeat)
        self.steps: list[int] = []         # the recording's step indices in this graph

    def add(self, index: int, op: DefinedOp, refs: tuple, results: tuple) -> None:
        def value(obj):
            t = type(obj)
            if t is m.Slot:
                return self._node(refs[obj.position])
            if t is tuple or t is list:
                return t(value(x) for x in obj)
            if t is dict:
                return {k: value(x) for k, x in obj.items()}
            return obj

        fn = op.fn
        assert isinstance(fn, torch._ops.OpOverload)  # graphable() said so
        node = self.graph.call_function(fn, value(op.args), value(op.kwargs))
        self.steps.append(index)
        returns = fn._schema.returns
        if not returns:  # an in-place multi-tensor op (``_foreach_mul_``): its writes are the graph's mutations
            return
        if len(results) == 1 and str(returns[0].type) == "Tensor" and len(returns) == 1:
            self._bind(results[0], node)
            return
        for i, ref in enumerate(results):
            self._bind(ref, self.graph.call_function(operator.getitem, (node, i)))

    def _node(self, ref: int) -> torch.fx.Node:
        node = self.nodes.get(ref)
        if node is None:
            self.input_names.append(self.outside(ref))
            node = self.nodes[ref] = self.graph.placeholder(f"in{len(self.inputs)}")
            self.inputs.append(ref)
        return node

    def _bind(self, ref: int | None, node: torch.fx.Node) -> None:
        if ref is not None:
            self.nodes[ref] = node
            self.defined.append(ref)

    def finish(self, outputs: list[int]) -> torch.fx.GraphModule:
        """The graph returning ``outputs`` (refs defined here), as a module for inductor."""
        self.graph.output(tuple(self.nodes[r] for r in outputs))
        return torch.fx.GraphModule(torch.nn.Module(), self.graph)


class CompiledGraph:
    """A graph module that inductor compiles at its first call, with that call's tensors as the
    example inputs, under the host-wide lock (see the module docstring); a call returns the
    graph's outputs as a tuple."""

    def __init__(self, module: torch.fx.GraphModule, options: dict | None = None) -> None:
        self.module = module
        self.options = options or {}
        self.compiled: Callable[..., Any] | None = None

    def __call__(self, *args):
        compiled = self.compiled
        if compiled is None:
            compiled = self.compiled = _compile_once_per_host(self.module, args, self.options)
        return compiled(*args)


def _compile_once_per_host(module: torch.fx.GraphModule, args: tuple, options: dict) -> Callable[..., Any]:
    """Inductor's compile of ``module`` for ``args``, in a tracing context whose fake mode has a
    shape environment, as dynamo's has: without one, inductor's FX graph cache and AOTAutograd's
    are bypassed ("No shape env") and every rank would compile every graph itself.  The example
    inputs are that mode's fakes of ``args`` with static shapes (a recording's shapes never change:
    the client records a call with other shapes anew); real tensors there would be given symbolic
    sizes, and the kernels would take every size as an argument.  ``options``: inductor's config for this
    compile (``config_patches``: ``tdmesh.compile(options=)``)."""
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    shapes = "".join(f"{tuple(a.shape)}{a.dtype}{a.device}" if isinstance(a, torch.Tensor) else repr(a) for a in args)
    key = hashlib.sha256((module.code + shapes + repr(sorted(options.items()))).encode()).hexdigest()[:20]
    path = os.path.join(tempfile.gettempdir(), f"tdmesh-inductor-{key}.lock")
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            fake = FakeTensorMode(shape_env=ShapeEnv())
            with tracing(TracingContext(fake)):
                examples = [fake.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a for a in args]
                return compile_fx(module, examples, config_patches=options or None)  # type: ignore[return-value]
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)

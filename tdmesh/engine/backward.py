"""``loss.backward()`` run by the workers' own autograd: one message instead of one per backward op.

The client's autograd records every forward (``requires_grad``, ``grad_fn`` and errors are
torch's own), and so do the workers: leaves the client makes require grad are mirrored
(``requires_grad_``, the ``requires_grad`` setter and factories' ``requires_grad=True``), and
each op runs there in the client's grad mode (``saved.workers_record``).  At ``backward`` the
client walks its graph; where every node is one the workers recorded (an aten op of this mesh
and stream, issued under tdmesh's saved-tensor hooks, not traced by a compiled function), no
node or non-leaf tensor has a hook, and every leaf is a mirrored proxy whose gradient the
client can describe, the backward is one call of ``tdmesh.worker.backward.run_backward``; the
client makes the proxies of the new gradients (as ``AccumulateGrad`` would) and frees what its
graph saved; ``torch.autograd.grad`` of leaves likewise returns the new proxies.  Anything else
(custom ``autograd.Function``s, hooks, ``retain_grad``, ``create_graph``, ``inputs=``, a
pipeline's meshes, checkpointing, anomaly mode, a graph that reaches nodes a ``create_graph`` backward
made: ``client_graphs.py``; sparse gradients: ``Embedding(sparse=True)``) runs on the client's engine
as before, and the workers drop their copy of the graph.  Hooks registered on autograd nodes
themselves (``grad_fn.register_hook``) cannot be seen: code that uses them sets
``TDMESH_BACKWARD=client``.  The workers check that their graph has the client's shape before running
it (``tdmesh.protocol.graph_digest``).
"""

from __future__ import annotations

import functools
import math

import torch

from ..protocol import messages as m
from ..protocol.graph_digest import digest, reachable
from . import client_graphs, composites, saved
from .autograd_context import context_of_span, forward_context
from .issue import New, issue
from .propagation import TensorMeta
from .stream import get_active_stream
from .tensor import Tensor
from .wire import to_wire

__all__ = ["backward", "mirror_requires_grad", "COUNTS"]

COUNTS = {"workers": 0, "client": 0}  # backward calls by where they ran (tests and benchmarks read it)
REDUCING = [0]  # live tdmesh.reduce_grads_in_backward registrations
REDUCE_AFTER_CLIENT_BACKWARD: list = [None]  # set by tdmesh.collectives: {(dims, reduction): grads} -> None

_RUN = "tdmesh.worker.backward.run_backward"
_DROP = "tdmesh.worker.backward.drop_graphs"
_GRAD = "tdmesh.worker.backward.run_grad"
_SET = "tdmesh.worker.backward.set_requires_grad"
_ACCUMULATE = composites.ACCUMULATE  # autograd's node kind of a leaf's accumulator
_hooked: dict[int, None] = {}  # sequence numbers of nodes whose tensors have hooks or retain_grad, oldest first
_HOOKED_KEPT = 1 << 16  # the newest kept (a model that hooks a tensor every step adds one a step)
_base_requires_grad = torch._C.TensorBase.requires_grad
_base_requires_grad_ = torch._C.TensorBase.requires_grad_


def mirror_requires_grad(t: Tensor, flag: bool) -> None:
    """Make the workers' tensor of leaf ``t`` require grad as the client's does."""
    if getattr(t, "_wgrad", False) == flag or t._mesh.client is None or not saved.workers_run_backward():
        return
    stream = t._stream

    def build(seq, results, _mutated):
        return m.CallFunction(seq, results, (), _SET, (m.Ref(t._r.id), flag), {}, stream.id)

    issue(t._mesh, build, inputs=[t], stream=stream)
    t._wgrad = flag  # type: ignore[attr-defined]


def _requires_grad_(self, requires_grad=True):
    with torch._C.DisableTorchFunction():
        _base_requires_grad_(self, requires_grad)
        leaf = self.grad_fn is None
    if leaf:
        mirror_requires_grad(self, bool(requires_grad))
    return self


def _note_hooked(t) -> None:
    with torch._C.DisableTorchFunction():
        node = t.grad_fn
    if node is not None:
        _hooked[node._sequence_nr()] = None
        if len(_hooked) > _HOOKED_KEPT:
            for seq in list(_hooked)[: _HOOKED_KEPT // 2]:
                del _hooked[seq]


def _register_hook(self, hook):
    _note_hooked(self)
    return torch.Tensor.register_hook(self, hook)


def _retain_grad(self):
    _note_hooked(self)
    return torch.Tensor.retain_grad(self)


Tensor.requires_grad_ = _requires_grad_  # type: ignore[method-assign]
Tensor.requires_grad = property(_base_requires_grad.__get__, _requires_grad_)  # type: ignore[assignment,attr-defined]
Tensor.register_hook = _register_hook  # type: ignore[method-assign]
Tensor.retain_grad = _retain_grad  # type: ignore[method-assign]


@functools.lru_cache(maxsize=4096)  # asked of every leaf at every backward: kept by metadata (a model's share few)
def _dense(meta: TensorMeta) -> bool:
    """Non-overlapping and dense (contiguous up to a permutation of its dims: channels-last, say):
    ``AccumulateGrad`` gives such a leaf's new gradient the leaf's strides, as the workers' copy
    does (``worker/backward.py: _laid_out_as``), so the client knows its metadata."""
    expected = 1
    for size, stride in sorted(((n, s) for n, s in zip(meta.size, meta.stride) if n != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _plan(roots: list, grad_roots: list):
    """``(mesh, stream, nodes' sequence numbers, leaves, digest, leaves' accumulator numbers)``
    where the workers can run this backward; None (the reason in ``CLIENT_REASON``) where the
    client's engine must."""
    first = roots[0]
    if type(first) is not Tensor:
        return _client("its root is not a mesh tensor")
    mesh, stream = first._mesh, first._stream
    client = mesh.client
    if stream is not get_active_stream():
        return _client("its roots are not on the active stream (the client's engine raises at the op that is not)")
    if client is None or client.sink is not client or torch.is_anomaly_enabled():
        return _client("a compiled function is being traced, or anomaly mode is on")
    with torch._C.DisableTorchFunction():
        for r in roots:
            if type(r) is not Tensor or r._mesh is not mesh or r._stream is not stream or r.grad_fn is None:
                return _client("its roots are on several meshes or streams, or one has no grad_fn")
        for r, g in zip(roots, grad_roots):
            if g is None and math.prod(r._meta.size) != 1:
                return _client("a root that is not a scalar has no gradient given")  # torch raises, there
            if g is not None and (type(g) is not Tensor or g._mesh is not mesh or g._stream is not stream):
                return _client("a gradient given is not a tensor of the roots' mesh and stream")
        nodes, edges = reachable([r.grad_fn for r in roots])
        if client_graphs.MARKED[0] and client_graphs.reaches_marked(nodes):
            return _client("a node was made by a backward on the client's engine (create_graph=True): the "
                           "workers hold no copy of it")
        saved_by_node = saved.saved_by_node()
        seqs: list[int] = []
        leaves: list = []
        order: list[int] = []  # each leaf's accumulator's number: made at the leaf's first use in the forward
        expansions: list = []  # what each composite node stands for in the workers' graph
        for node in nodes:
            kind = type(node)
            if kind is _ACCUMULATE:
                leaf = node.variable
                order.append(node._sequence_nr())
                if not _mirrored_leaf(leaf, mesh, stream):
                    reason = f"a leaf is not a mirrored mesh tensor of this mesh ({_leaf_text(leaf)})"
                    _mirror_unmirrored(nodes, mesh)  # every leaf at once: the next forward records them all there
                    return _client(reason)
                leaves.append(leaf)
                continue
            seq = node._sequence_nr()
            if _makes_sparse_gradient(kind, node):
                return _client(f"{kind.__name__} makes a sparse gradient (sparse=True), whose size only the "
                               f"values decide: the client cannot describe it before the workers run it")
            if seq in _hooked or isinstance(node, torch.autograd.function.BackwardCFunction):
                grown = getattr(node, "tdmesh_expansion", None)  # a composite issued whole (composites.py)
                if grown is None or seq in _hooked or seq in composites.DIVERGED:
                    return _client(f"{kind.__name__} is a custom autograd.Function's or has hooks (or retain_grad), "
                                   f"or its output was written in place")
                expansions.append(grown)
            entry = saved_by_node.get(seq)
            if entry is saved.RELEASED:
                raise saved.freed_error()  # a second backward through it, as torch raises
            seqs.append(seq)
        if seqs and not _recorded_here(seqs, mesh, stream):
            return _client("a node was made on another mesh or stream, while a compiled function was traced, or under "
                           "the user's saved-tensor hooks (checkpoint)")
    return mesh, stream, seqs, leaves, composites.grown(digest(nodes, edges), expansions), order


def _makes_sparse_gradient(kind: type, node) -> bool:
    """An embedding's or embedding bag's node with ``sparse=True``, or a gather's with ``sparse_grad=True``:
    its input's gradient is sparse, with as many values as the indices pick.  Which node kinds can is
    looked up once a kind."""
    flag = _SPARSE_FLAG.get(kind)
    if flag is None:
        flag = _SPARSE_FLAG[kind] = next((a for a in ("_saved_sparse", "_saved_sparse_grad") if hasattr(kind, a)), "")
    return bool(flag) and bool(getattr(node, flag))


_SPARSE_FLAG: dict[type, str] = {}  # node kind -> the attribute saying its gradient is sparse, or ""


def _recorded_here(seqs: list[int], mesh, stream) -> bool:
    """Whether every node was made on ``mesh`` and ``stream`` and recorded on the workers: one lookup where
    the graph was made in one context (a forward's usual case), else one a node."""
    span = context_of_span(min(seqs), max(seqs))
    for context in ([span] if span is not None else map(forward_context, seqs)):
        if context is None or context[0] is not mesh or context[1] is not stream or not context[2]:
            return False
    return True


def _mirror_unmirrored(nodes, mesh) -> None:
    """Make the workers' copy of every leaf of this mesh in the graph require grad where the client
    saw it made to on the client only (a model made under ``TDMESH_BACKWARD=client``, or outside an
    activation): one backward on the client's engine, not one a leaf, before the workers can run it."""
    for node in nodes:
        if type(node) is _ACCUMULATE:
            leaf = node.variable  # type: ignore[union-attr]
            if type(leaf) is Tensor and leaf._mesh is mesh and getattr(leaf, "_wgrad", False) is False:
                mirror_requires_grad(leaf, True)


def _client(reason: str) -> None:
    """No plan: the client's engine runs this backward, for ``reason`` (kept in ``CLIENT_REASON``)."""
    CLIENT_REASON[0] = reason


CLIENT_REASON = [""]  # why the latest backward that could not run on the workers ran on the client


def _leaf_text(leaf) -> str:
    if type(leaf) is not Tensor:
        return f"a {type(leaf).__name__}"
    if not getattr(leaf, "_wgrad", False):
        return "its requires_grad was set where tdmesh could not see it; mirrored now, for the next forward"
    return "another mesh or stream, not dense, hooked, or its .grad elsewhere"


def _mirrored_leaf(leaf, mesh, stream) -> bool:
    if type(leaf) is not Tensor or leaf._mesh is not mesh or leaf._stream is not stream:
        return False
    if not getattr(leaf, "_wgrad", False) or type(leaf._meta) is not TensorMeta or not _dense(leaf._meta):
        return False
    if leaf._backward_hooks or getattr(leaf, "_post_accumulate_grad_hooks", None):
        return False
    grad = leaf.grad
    return grad is None or (type(grad) is Tensor and grad._mesh is mesh and grad._stream is stream)


def _run_on_workers(plan, roots: list, grad_roots: list, retain_graph: bool) -> None:
    mesh, stream, seqs, leaves, shape, order = plan
    with torch._C.DisableTorchFunction():
        grads = [leaf.grad for leaf in leaves]
        new = [New(_grad_meta(leaf._meta), device=leaf.device) for leaf, g in zip(leaves, grads) if g is None]
    existing = [g for g in grads if g is not None]
    # every tensor here is a proxy (or None): Refs made directly, not by to_wire's walk
    reduce = _reduce_plans(mesh, stream, leaves, order) if REDUCING[0] else ()
    # each leaf's (elements, dtype) with a reduction: a rank whose backward cannot run still joins its collectives
    specs = tuple((math.prod(leaf._meta.size), str(leaf._meta.dtype).split(".")[1]) for leaf in leaves) if reduce \
        else ()
    args = ([m.Ref(r._r.id) for r in roots], [None if g is None else m.Ref(g._r.id) for g in grad_roots],
            [m.Ref(leaf._r.id) for leaf in leaves], [None if g is None else m.Ref(g._r.id) for g in grads],
            retain_graph, shape, reduce, specs)

    def build(seq, results, mutated):
        return m.CallFunction(seq, results, mutated, _RUN, args, {}, stream.id)

    made = issue(mesh, build, inputs=list(roots) + [g for g in grad_roots if g is not None] + leaves + existing,
                 outputs=new, mutated=existing, stream=stream)
    made_grads = iter(made)
    with torch._C.DisableTorchFunction():
        for leaf, g in zip(leaves, grads):
            if g is None:
                leaf.grad = next(made_grads)
    if not retain_graph:
        saved.release(seqs)


def _grad_meta(meta: TensorMeta) -> TensorMeta:
    """A new gradient's metadata, as ``AccumulateGrad`` makes it for a dense leaf: the leaf's, from offset 0."""
    return meta if meta.offset == 0 else TensorMeta(meta.size, meta.stride, 0, meta.dtype)


def _grad(run_on_client, func, args: tuple, kwargs: dict):
    """``torch.autograd.grad``: on the workers where the graph allows it and every input is a leaf
    of it (gradients returned, nothing accumulated); else the client's engine (unused inputs, a
    non-leaf input, ``create_graph``, batched gradients: its errors and Nones are torch's)."""
    params = dict(zip(("outputs", "inputs", "grad_outputs", "retain_graph", "create_graph", "only_inputs",
                       "allow_unused", "is_grads_batched", "materialize_grads"), args)) | kwargs
    roots, inputs = _as_list(params.get("outputs")), _as_list(params.get("inputs"))
    grad_roots = _as_list(params.get("grad_outputs")) or [None] * len(roots)
    create_graph = bool(params.get("create_graph"))
    retain = params.get("retain_graph")
    retain_graph = create_graph if retain is None else bool(retain)
    plan = None
    if (saved.workers_run_backward() and roots and inputs and len(grad_roots) == len(roots) and not create_graph
            and not params.get("is_grads_batched") and not _in_backward()):
        plan = _plan(roots, grad_roots)
        if plan is not None and not all(any(x is leaf for leaf in plan[3]) for x in inputs):
            _client("an input is not a leaf the graph reaches (torch's engine answers for it)")
            plan = None
    if plan is None:
        COUNTS["client"] += 1
        out = client_graphs.run_marking(lambda: run_on_client(func, args, kwargs), roots, create_graph, lambda o: o)
        if roots and type(roots[0]) is Tensor and not retain_graph:
            _drop_on_workers(roots)
        return out
    COUNTS["workers"] += 1
    mesh, stream, seqs, _, shape, _ = plan
    with torch._C.DisableTorchFunction():
        new = [New(TensorMeta(x._meta.size, x._meta.stride, 0, x._meta.dtype), device=x.device) for x in inputs]
    wire = to_wire((list(roots), list(grad_roots), list(inputs), retain_graph, shape))

    def build(seq, results, _mutated):
        return m.CallFunction(seq, results, (), _GRAD, wire, {}, stream.id)

    made = issue(mesh, build, inputs=list(roots) + [g for g in grad_roots if g is not None] + list(inputs),
                 outputs=new, stream=stream)
    if not retain_graph:
        saved.release(seqs)
    return tuple(made)


def _reduce_plans(mesh, stream, leaves: list, order: list[int]) -> tuple:
    """``(leaf indices, group id, reduction)`` per registered (dims, reduction): the leaves whose
    gradients ``tdmesh.reduce_grads_in_backward`` reduces during this backward, latest first
    used first (about the order backward completes them: DDP reverses its parameters' order)."""
    by_spec: dict = {}
    for i in sorted(range(len(leaves)), key=lambda i: -order[i]):
        spec = getattr(leaves[i], "_reduce_in_backward", None)
        if spec is not None:
            by_spec.setdefault(spec, []).append(i)
    client = mesh.client
    return tuple((tuple(indices), client.ensure_groups("dims", stream.id, mesh.shape, dims), reduction)
                 for (dims, reduction), indices in by_spec.items())


def _reduce_after_client(roots: list) -> None:
    """The client's engine ran a backward: reduce the registered gradients it made, now."""
    groups: dict = {}
    with torch._C.DisableTorchFunction():
        nodes, _ = reachable([r.grad_fn for r in roots if type(r) is Tensor])
        for node in nodes:
            if type(node) is _ACCUMULATE:
                leaf = node.variable  # type: ignore[union-attr]
                spec = getattr(leaf, "_reduce_in_backward", None)
                if spec is not None and leaf.grad is not None:
                    groups.setdefault(spec, []).append(leaf.grad)
    if groups:
        REDUCE_AFTER_CLIENT_BACKWARD[0](groups)


def _drop_on_workers(roots: list) -> None:
    """The client's engine ran this backward: the workers free their copy of its graph."""
    first = roots[0]
    client = first._mesh.client
    if client is None or client.sink is not client or not saved.workers_run_backward():
        return
    stream = first._stream
    on_mesh = [r for r in roots if type(r) is Tensor and r._mesh is first._mesh]
    args = to_wire((on_mesh,))

    def build(seq, results, _mutated):
        return m.CallFunction(seq, results, (), _DROP, args, {}, stream.id)

    issue(first._mesh, build, inputs=on_mesh, stream=stream)


def _as_list(x) -> list:
    if x is None:
        return []
    return [x] if isinstance(x, torch.Tensor) else list(x)


def backward(run_on_client, func, args: tuple, kwargs: dict):
    """``Tensor.backward`` / ``torch.autograd.backward`` under an active mesh."""
    if func is torch.autograd.grad:
        return _grad(run_on_client, func, args, kwargs)
    if func is torch.Tensor.backward:
        params = dict(zip(("self", "gradient", "retain_graph", "create_graph", "inputs"), args)) | kwargs
        roots = [params.get("self")]
        grad_roots = [params.get("gradient")]
    else:
        params = dict(zip(("tensors", "grad_tensors", "retain_graph", "create_graph", "grad_variables", "inputs"),
                          args)) | kwargs
        roots = _as_list(params.get("tensors"))
        grad_roots = _as_list(params.get("grad_tensors", params.get("grad_variables"))) or [None] * len(roots)
    create_graph = bool(params.get("create_graph"))
    retain_graph = params.get("retain_graph")
    retain_graph = create_graph if retain_graph is None else bool(retain_graph)
    eligible = (saved.workers_run_backward() and roots and len(grad_roots) == len(roots) and not create_graph
                and params.get("inputs") is None and not _in_backward())
    plan = _plan(roots, grad_roots) if eligible else None
    if plan is not None:
        _run_on_workers(plan, roots, grad_roots, retain_graph)
        COUNTS["workers"] += 1
        return None
    COUNTS["client"] += 1
    out = client_graphs.run_marking(lambda: run_on_client(func, args, kwargs), roots, create_graph, None)
    if REDUCING[0] and roots:
        _reduce_after_client(roots)
    if roots and type(roots[0]) is Tensor and not retain_graph:
        _drop_on_workers(roots)
    return out


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


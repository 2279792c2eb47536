"""``F.linear`` on mesh tensors issued whole: one remote op, one client node, for torch's four.

torch runs ``linear`` as a CompositeImplicit decomposition above the Python dispatch key, so a
3-d input with a bias reaches tdmesh's dispatch as four aten ops (``view``, ``t``, ``addmm``,
``view``): four wrappers, four autograd nodes and four messages on the client, for half the ops
of a transformer's forward.  Seen where the user called it (the mesh's torch-function mode), the
call is issued as one ``aten::linear``: each worker runs torch's own decomposition of it (the
same kernels, the same autograd nodes as local torch), and the client records one node of its
own for them.  When the workers run the backward (``engine/backward.py``), the digest of the
client's graph that they check theirs against counts that node as what it stands for: the nodes,
edges and node names of the decomposition, found once per argument metadata by running it on meta
tensors (:func:`expansion`).  So the gradients are the workers' torch's, bit for bit.

Where the client's own engine runs a backward through such a node (hooks, ``retain_grad``, a
checkpoint, ``create_graph``, ``TDMESH_BACKWARD=client`` set later), the node recomputes the
decomposition from the inputs it saved and differentiates that: torch's ops again (one matmul
more, on that path only).

Issued whole only where nothing could see the difference: every tensor a proxy of the active
stream, plainly placed; the client issuing eagerly (not a compiled function's trace); no
torch-function mode but the mesh's, no dispatch mode but the mesh's; autocast, functorch
transforms, forward AD, inference mode and the profiler off; with a gradient to record, tdmesh's
saved-tensor hooks on top (not a checkpoint's) and the workers running backwards.  Otherwise
torch decomposes the call as always.

One thing a later op can tell apart: in torch's decomposition the output of an n-d linear with a
bias is a view (of ``addmm``'s result).  Writing it in place under autograd rebuilds the
workers' graph around the view (``CopySlices``), which the client's one node cannot follow.
The first write into such an output (or an alias of it) turns issuing whole off in this process
and sends that graph's backward to the client's engine: correct, and slower once.
"""

from __future__ import annotations

import threading
import zlib
from typing import NamedTuple

import torch
import torch.autograd.forward_ad as forward_ad
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode

from ..config import env_str
from ..protocol.graph_digest import reachable
from . import placement
from .dispatch import MESH_MODE, dispatch
from .propagation import meta_tensor
from .saved import thread_hooks
from .stream import get_active_stream
from .tensor import Tensor

__all__ = ["SPECIAL", "ACCUMULATE", "ON", "configure", "DIVERGED", "Expansion", "expansion", "grown", "COUNTS"]

_LINEAR = torch.ops.aten.linear.default
ON = [True]            # issuing whole (configure); off for good after a write into a viewing output (module docstring)
_WRITTEN = [False]     # that write happened in this process
DIVERGED: set = set()  # sequence numbers of the nodes whose viewing output was written: the client's engine runs them
COUNTS = {"linear": 0}  # calls issued whole (tests and benchmarks read it)
_replaying = threading.local()  # .on: a node's backward is recomputing its decomposition on this thread
_any_autocast, _functorch_active = torch._C._is_any_autocast_enabled, torch._C._are_functorch_transforms_active
_profiling, _inference = torch._C._autograd._profiler_enabled, torch.is_inference_mode_enabled
_dispatch_modes, _dispatch_mode_at = torch._C._len_torch_dispatch_stack, torch._C._get_dispatch_stack_at
_function_modes = torch._C._len_torch_function_stack
_push_mode, _pop_mode = torch._C._push_on_torch_dispatch_stack, torch._C._pop_torch_dispatch_stack
_grad_enabled = torch._C.is_grad_enabled
ACCUMULATE = type(torch.ones(1, requires_grad=True).view(1).grad_fn.next_functions[0][0])  # type: ignore[union-attr]


class Expansion(NamedTuple):
    """What one client node stands for in the workers' graph, beyond itself: more nodes, more edges, and
    the change to the sum of node names' hashes (``protocol/graph_digest.py``); ``view_out``: torch's output
    is a view of a tensor inside the decomposition."""
    nodes: int
    edges: int
    names: int
    view_out: bool


_EXPANSIONS: dict = {}


def _name_hash(kind: type) -> int:
    return zlib.crc32(kind.__name__.encode())


def expansion(key: tuple, tensors: tuple, needs: tuple) -> Expansion | None:
    """The decomposition of ``aten::linear`` for these arguments (proxies or None, each requiring grad as
    ``needs`` says), found on meta tensors of their metadata; None where the client's node could not stand
    for it: an input reached twice inside it (the node has one edge an input); a decomposition that turns
    on the strides of length-one dims (``matmul``'s folding reads them), which only the workers' tensors
    settle: the client's metadata may describe such a stride otherwise, harmlessly for any op but this one
    (its digest would differ, and the workers refuse the backward); an input that is not contiguous, which
    torch's ``reshape`` views with ``_reshape_alias`` on a device and ``view`` on meta tensors.  Kept in
    ``_EXPANSIONS`` under ``key``, which the caller looks up first (every call of every ``nn.Linear``)."""
    shapes = {_shape_of(tensors, needs, stride_of_one) for stride_of_one in (None, "dense", "one")}
    result: Expansion | None = None
    if len(shapes) == 1 and meta_tensor(tensors[0]._meta).is_contiguous():
        inner, edges, outer, view_out = shapes.pop()
        own_edges = sum(1 for t, need in zip(tensors, needs) if t is not None and need)
        if inner and outer == own_edges:
            names = sum(inner) - _name_hash(_LinearBackward)
            result = Expansion(len(inner) - 1, edges - own_edges, names & 0xFFFFFFFF, view_out)
    _EXPANSIONS[key] = result
    return result


def _shape_of(tensors: tuple, needs: tuple, stride_of_one: str | None) -> tuple:
    """``linear`` run on meta tensors like ``tensors`` (a length-one dim's stride as given, as if contiguous,
    or 1): the name hashes of its nodes (sorted), its edges, the edges out of it, whether its output is a
    view."""
    with no_dispatch(), torch._C.DisableTorchFunction(), torch.enable_grad():
        out = _LINEAR(*_metas(tensors, needs, stride_of_one))
        nodes, edges = reachable([out.grad_fn])
        inner = [n for n in nodes if type(n) is not ACCUMULATE]
        outer = sum(1 for n in inner for child, _ in n.next_functions if type(child) is ACCUMULATE)
        return tuple(sorted(_name_hash(type(n)) for n in inner)), edges, outer, out._is_view()


def _metas(tensors: tuple, needs: tuple, stride_of_one: str | None) -> list:
    """Meta tensors like ``tensors`` (proxies or None), each requiring grad as ``needs`` says, a length-one dim's
    stride as given, as if contiguous (``"dense"``) or 1 (``"one"``); the same tensor twice stays one tensor."""
    metas: dict[int, torch.Tensor] = {}
    out: list[torch.Tensor | None] = []
    for t, need in zip(tensors, needs):
        if t is None:
            out.append(None)
            continue
        if id(t) not in metas:
            meta = meta_tensor(t._meta)
            if stride_of_one is not None and 1 in meta.shape:
                meta = meta.as_strided(meta.shape, _strides_of_one(meta, stride_of_one))
            metas[id(t)] = meta.detach().requires_grad_(need)
        out.append(metas[id(t)])
    return out


def _strides_of_one(t: torch.Tensor, how: str) -> list[int]:
    strides = list(t.stride())
    for d in range(t.dim() - 1, -1, -1):
        if t.shape[d] == 1:
            strides[d] = 1 if how == "one" or d == t.dim() - 1 else strides[d + 1] * t.shape[d + 1]
    return strides


class _Linear(torch.autograd.Function):
    """``aten::linear`` as one op: its forward issues it, its node stands for torch's decomposition."""

    @staticmethod
    def forward(ctx, x, weight, bias, found: Expansion):
        ctx.tdmesh_expansion = found
        with torch.enable_grad():  # the workers record the decomposition (saved.workers_record reads the mode)
            out = dispatch(MESH_MODE, _LINEAR, None, (x, weight, bias), {})
        if found.view_out:
            out._r.aliases.fused = ctx._sequence_nr()
        ctx.save_for_backward(x, weight, bias)
        return out

    @staticmethod
    def backward(ctx, grad):
        """The client's engine runs this node: torch's decomposition again, from the saved inputs, and its
        backward.  It differentiates aliases of the inputs (``view_as``), not the inputs, so that their hooks
        (``register_hook``, ``retain_grad``) run once, when the engine hands them the returned gradients; with
        ``create_graph`` the gradients stay differentiable through the aliases."""
        saved = ctx.saved_tensors
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[:3]) if need]
        create_graph = _grad_enabled()
        _replaying.on = getattr(_replaying, "on", 0) + 1
        try:
            with torch.enable_grad():
                args = [t.view_as(t) if i in wanted else t for i, t in enumerate(saved)]
                out = torch.nn.functional.linear(*args)
                grads = torch.autograd.grad(out, [args[i] for i in wanted], grad, create_graph=create_graph)
        finally:
            _replaying.on -= 1
        result: list = [None, None, None, None]
        for i, g in zip(wanted, grads):
            result[i] = g
        return tuple(result)


_LinearBackward = _Linear._backward_cls
# ``Function.apply`` less its Python wrapper, which binds default arguments for ``setup_context`` and unwraps
# functorch's dead wrappers (neither applies: no setup_context, functorch transforms off): 2-3 us a call
_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, _Linear)


def _linear(func, args, kwargs):
    """``torch._C._nn.linear`` under the mesh's torch-function mode: issued whole where allowed (module
    docstring), else ``NotImplemented`` (torch's decomposition, op by op).  Every call of every
    ``nn.Linear`` comes here: the commonest case (three positional arguments, all proxies) is checked first."""
    if kwargs or len(args) != 3:
        args = _positional(args, kwargs)
        if args is None:
            return NotImplemented
    x, weight, bias = args
    if type(x) is not Tensor or type(weight) is not Tensor or (bias is not None and type(bias) is not Tensor) or \
            not ON[0] or getattr(_replaying, "on", 0):
        return NotImplemented
    mesh = x._mesh
    client = mesh.client
    if client is None or client.sink is not client or _function_modes() or _dispatch_modes() != 1 or \
            _dispatch_mode_at(0) is not MESH_MODE or _any_autocast() or _functorch_active() or \
            forward_ad._current_level >= 0 or _inference() or _profiling() or \
            not placement.plainly_placed(args if bias is not None else args[:2], mesh, get_active_stream()):
        return NotImplemented
    needs = (x.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    if not _grad_enabled() or needs == _NO_GRAD:  # nothing to record: the op alone, where its kernels are settled
        if not _settled(args, needs):
            return NotImplemented
        COUNTS["linear"] += 1
        return dispatch(MESH_MODE, _LINEAR, None, args, {})
    if not thread_hooks.ours_on_top:  # a checkpoint's hooks, or TDMESH_BACKWARD=client when the mesh was activated
        return NotImplemented
    found = _found(args, needs)
    if found is None:
        return NotImplemented
    COUNTS["linear"] += 1
    return _apply(x, weight, bias, found)


_SETTLED: dict = {}


def _key(args: tuple, needs: tuple) -> tuple:
    """The caches' key of a call: its tensors' metadata, which need a gradient, which are the same tensor."""
    x, weight, bias = args
    bias_meta = None if bias is None else bias._meta
    return (x._meta, weight._meta, bias_meta, needs, x is weight, bias is x or bias is weight)


class _Recorder(TorchDispatchMode):
    """The aten ops a call dispatches (on meta tensors, the mesh's mode off the stack)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _settled(args: tuple, needs: tuple) -> bool:
    """Whether ``linear`` runs the same aten ops whatever the strides of its length-one dims: ``matmul`` folds
    an input into a matrix, where the weight needs no gradient, only where those strides let it (another kernel,
    another rounding), and only the workers' tensors settle them (``expansion``).  Autograd's nodes show it
    where the input needs a gradient; with nothing to record (or only the bias to) the ops alone do.  Once per
    argument metadata and ``needs``."""
    key = _key(args, needs)
    settled = _SETTLED.get(key)
    if settled is None:
        seen = set()
        mesh_mode = _pop_mode(None)  # the mesh's (the caller checked it is the only one)
        try:
            for stride_of_one in (None, "dense", "one"):
                with no_dispatch():
                    metas = _metas(args, needs, stride_of_one)
                with _Recorder() as recorder:
                    try:
                        _LINEAR(*metas)
                    except Exception:  # noqa: BLE001 - arguments torch refuses: its own path raises, at the user's line
                        return False
                seen.add(tuple(recorder.ops))
        finally:
            _push_mode(mesh_mode)
        settled = _SETTLED[key] = len(seen) == 1
    return settled


def _found(args: tuple, needs: tuple) -> Expansion | None:
    """``expansion`` of these arguments, from ``_EXPANSIONS`` after its first call; None where torch refuses them
    (its own path raises, at the user's line) or where they are not ``_settled``."""
    key = _key(args, needs)
    found = _EXPANSIONS.get(key, False)
    if found is False:
        try:
            found = expansion(key, args, needs)
        except Exception:  # noqa: BLE001 - arguments torch refuses
            return None
        if found is not None and not _settled(args, needs):  # kept with it: nothing more to look up a call
            found = _EXPANSIONS[key] = None
    return found


_NO_GRAD = (False, False, False)


def _positional(args: tuple, kwargs: dict) -> tuple | None:
    """``linear``'s (input, weight, bias) from a call with keywords or without a bias; None where unknown."""
    names = ("input", "weight", "bias")
    if len(args) > 3 or any(k not in names[len(args):] for k in kwargs):
        return None
    args = tuple(args) + tuple(kwargs.get(k) for k in names[len(args):])
    return args if args[0] is not None and args[1] is not None else None


def configure() -> None:
    """At each activation: ``TDMESH_WHOLE_LINEAR``, unless a write into a viewing output turned it off."""
    ON[0] = env_str("TDMESH_WHOLE_LINEAR") != "off" and not _WRITTEN[0]


def _written(aliases) -> None:
    """A write into a tensor sharing storage with a viewing output (module docstring)."""
    ON[0] = False
    _WRITTEN[0] = True
    DIVERGED.add(aliases.fused)


placement.on_fused_write.append(_written)
SPECIAL = {torch._C._nn.linear: _linear}


def grown(shape: tuple[int, int, int], expansions: list) -> tuple[int, int, int]:
    """A digest of the client's graph with each composite node counted as the nodes it stands for."""
    nodes, edges, names = shape
    for found in expansions:
        nodes += found.nodes
        edges += found.edges
        names = (names + found.names) & 0xFFFFFFFF
    return nodes, edges, names

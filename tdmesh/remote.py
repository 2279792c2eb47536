"""Remote functions: run a Python function on every worker of a mesh.

``tdmesh.remote(fn_or_path, propagate=...)`` ships the function by import path when it has
one (``"os.path.split"``, an aten op, a module-level function) and by (cloud)pickle
otherwise.  ``propagate`` tells the client what the call returns without running it: a
callable run on meta tensors, or ``"inspect"`` for functions called for side effects.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten, treespec_loads

from .engine.coalescing import check_not_coalescing
from .engine.fetch import mesh_of, prepare_call, send_value, shard_rank
from .engine.future import Future
from .engine.issue import New, issue
from .engine.placement import check_mutation
from .engine.propagation import TensorMeta, meta_tensor, tensor_meta
from .engine.settle import pending, settle
from .engine.stream import get_active_stream
from .engine.tensor import AliasSet, RefOwner, Tensor
from .engine.wire import op_path, sealed_args
from .errors import UsageError, user_line
from .opaque_ref import handle_of
from .protocol import messages as m
from .protocol.codec import with_source
from .protocol.resident import Resident

__all__ = ["remote", "Remote", "function_path", "call_on_shard_and_fetch"]


def function_path(fn) -> str | bytes:
    """How ``fn`` travels: an import path when one leads back to it, else pickled bytes."""
    if isinstance(fn, str):
        if "." not in fn:
            raise ValueError(f"remote function path {fn!r} must be a dotted import path like 'os.path.split'")
        return fn
    if isinstance(fn, torch._ops.OpOverload):
        return op_path(fn)
    if isinstance(fn, Remote):
        return fn._target
    if not callable(fn):
        raise ValueError(f"Unsupported target for a remote function: {fn!r} is neither callable nor an import path")
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    if module and module != "__main__" and "<" not in qualname:
        try:
            obj = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            if obj is fn:
                return f"{module}.{qualname}"
        except (ImportError, AttributeError):
            pass
    import cloudpickle  # ships closures and functions of the user's script (__main__) by value
    try:  # cloudpickle raises TypeError/PicklingError/... for what it cannot pickle: one clear error
        return with_source(cloudpickle.dumps(fn), _source_file(fn))
    except Exception as e:
        raise ValueError(f"cannot ship {fn!r} to the workers: it has no import path and does not pickle "
                         f"({type(e).__name__}: {e}); define it at module level") from e


def _source_file(fn) -> str | None:
    """The file ``fn``'s code comes from (a class: its module's), for the workers' tracebacks."""
    code = getattr(fn, "__code__", None)
    if code is not None:
        return None if code.co_filename.startswith("<") else code.co_filename
    return getattr(sys.modules.get(getattr(fn, "__module__", "")), "__file__", None)


class Remote:
    """A function that runs on the workers; calling it under a mesh returns remote tensors."""

    def __init__(self, target, propagate=None) -> None:
        if propagate == "mocked":  # checked first: "mocked" is a known mode, just not one tdmesh has
            raise NotImplementedError("propagate='mocked' is not supported")
        if propagate not in (None, "cached", "inspect") and not callable(propagate):
            raise ValueError(f"propagate must be a callable, 'inspect', 'cached' or None, got {propagate!r}")
        self._unresolved: str | None = None
        try:
            self._path = function_path(target)
        except ValueError as e:  # a name without a dot ("__test_panic"): refused where it is called, as a
            if not isinstance(target, str):  # module that only defines one still imports (Monarch's resolve then)
                raise
            self._path, self._unresolved = "", str(e)
        self._propagate = propagate
        self._cache: dict = {}
        self.cache_hits = 0
        self.cache_misses = 0
        self.__name__ = getattr(target, "__name__", str(target))

    def __repr__(self) -> str:
        return f"<tdmesh.remote {self.__name__}>"

    @property
    def _target(self) -> str | bytes:
        """How the function travels; a name that leads nowhere is refused here, at the call's user line."""
        if self._unresolved is not None:
            raise ValueError(f"{self._unresolved}\n  at {user_line()}")
        return self._path

    def __call__(self, *args, **kwargs):
        return call_remote(self, args, kwargs)

    def call(self, *args, **kwargs) -> Future:
        """Run on every rank of the mesh and fetch each rank's (picklable) return value:
        a Future of a ``ValueMesh`` to iterate as ``(point, value)``."""
        flat, _ = tree_flatten((args, kwargs))
        return send_value(mesh_of(flat), self._target, args, kwargs, None)

    def call_one(self, *args, **kwargs) -> Future:
        """Run on the one rank of a 1-rank mesh and fetch its (picklable) return value: a
        Future of the plain value, not a ValueMesh (as ``call`` on that mesh, unwrapped)."""
        flat, _ = tree_flatten((args, kwargs))
        mesh = mesh_of(flat)
        if len(mesh.rank_list) != 1:
            raise ValueError(f"call_one runs on a mesh of 1 rank; this one has {len(mesh.rank_list)} "
                             f"({mesh.shape}): use .call() for a value per rank, or slice the mesh to one rank\n"
                             f"  at {user_line()}")
        return send_value(mesh, self._target, args, kwargs, mesh.processes.offset)


def remote(fn=None, *, propagate=None):
    """``remote(fn_or_path, propagate=...)`` or the decorators ``@remote`` / ``@remote(propagate=...)``."""
    if fn is None:
        return lambda f: Remote(f, propagate)
    return Remote(fn, propagate)


def call_on_shard_and_fetch(remote_fn: Remote, *args, shard: dict | None = None, **kwargs) -> Future:
    """Run ``remote_fn`` on one rank and fetch what it returns (an Exception returned is a value)."""
    if not isinstance(remote_fn, Remote):
        raise TypeError(f"call_on_shard_and_fetch needs a tdmesh.remote function, got {remote_fn!r}\n"
                        f"  at {user_line()}")
    flat, _ = tree_flatten((args, kwargs))
    mesh = mesh_of(flat)
    return send_value(mesh, remote_fn._target, args, kwargs, shard_rank(mesh, shard, {}))


def call_remote(fn: Remote, args: tuple, kwargs: dict, mesh=None):
    """``fn(*args, **kwargs)`` on ``mesh`` (default: where its arguments live) as one CallFunction."""
    target = fn._target  # first: a name that leads nowhere is refused before anything is issued
    if pending:  # a fault-tolerant step not yet confirmed: settled first (engine/settle.py)
        settle()
    flat, _ = tree_flatten((args, kwargs))
    mesh = mesh if mesh is not None else mesh_of(flat)
    stream = get_active_stream()
    remote_args, groups, objects = prepare_call(flat, mesh, stream)
    if fn._propagate == "inspect":
        spec, out_leaves, mutated = None, [], []
    elif fn._propagate is None or fn._propagate == "cached":
        spec, out_leaves, mutated = _propagate_cached(fn, args, kwargs, flat, mesh)
    else:
        spec, out_leaves, mutated = _propagate_with(fn._propagate, args, kwargs)
    for t in mutated:
        check_mutation(t, fn)
    outputs = [None if leaf is None or type(leaf) is Value or leaf is _OPAQUE else
               New(tensor_meta(leaf), source.aliases if source is not None else None) for leaf, source in out_leaves]
    sealed = sealed_args(args, kwargs)
    expect = tuple(m.OPAQUE if leaf is _OPAQUE else None if o is None else _expected(o.meta)  # the workers check
                   for (leaf, _), o in zip(out_leaves, outputs))
    opaque = _opaque_owners(out_leaves, mesh)

    grad = torch.is_grad_enabled()  # the function runs in the caller's grad mode

    def build(seq, results, mutated_refs):
        if opaque:
            results = tuple(opaque[i].id if i in opaque else r for i, r in enumerate(results))
        return m.CallFunction(seq, results, mutated_refs, target, sealed, {}, stream.id, groups, grad, expect)

    proxies = issue(mesh, build, inputs=remote_args, outputs=outputs, mutated=mutated, device=mesh.client.device,
                    stream=stream, uses=objects, defs=tuple(o.id for o in opaque.values()))
    if spec is None:
        return None
    if opaque or any(type(leaf) is Value for leaf, _ in out_leaves):
        proxies = [leaf.value if type(leaf) is Value else handle_of(opaque[i], mesh, stream) if i in opaque else p
                   for i, ((leaf, _), p) in enumerate(zip(out_leaves, proxies))]
    return tree_unflatten(proxies, spec)


_OPAQUE = object()  # an output leaf that is an OpaqueRef: a ref on the workers, a handle on the client


def _opaque_owners(out_leaves, mesh) -> dict:
    """A new ref (and its owner, which deletes it when the handle dies) for each OpaqueRef result."""
    if not any(leaf is _OPAQUE for leaf, _ in out_leaves):
        return {}
    client = mesh.client
    if client.sink is not client:
        raise UsageError(f"a remote function that returns an OpaqueRef inside tdmesh.compile: objects are made "
                         f"once, make them before the compiled function\n  at {user_line()}")
    with client.lock:
        return {i: RefOwner(client.new_ref(), mesh, AliasSet()) for i, (leaf, _) in enumerate(out_leaves)
                if leaf is _OPAQUE}


class Value(NamedTuple):
    """A result of a remote function that is not a tensor: the value the first rank's run returned (cached
    with the call's key, as Monarch's cached propagation keeps it); the workers keep nothing for it."""
    value: Any


def _expected(meta) -> tuple:
    """What a worker checks a result against: (shape, dtype, layout), as names."""
    layout = getattr(meta, "layout", torch.strided)
    return tuple(meta.size), str(meta.dtype).split(".")[1], str(layout).split(".")[1]


def _propagate_cached(fn: Remote, args, kwargs, flat, mesh):
    """Outputs of ``fn`` learnt by running it once, for real, on the mesh's first rank, then
    cached by the arguments' structure, values, tensor metadata, aliasing and requires_grad."""
    tensors = [x for x in flat if type(x) is Tensor]
    alias_ids: dict[int, int] = {}

    def key_of(x):
        if type(x) is Tensor:
            return ("T", x._meta, x.requires_grad, alias_ids.setdefault(id(x.aliases), len(alias_ids)))
        if hasattr(x, "_tdmesh_groups"):
            raise TypeError(f"{fn!r} takes a process group or device mesh: cached propagation would run it on "
                            f"one rank, where a collective waits forever; pass propagate=<callable>\n"
                            f"  at {user_line()}")
        if hasattr(x, "_tdmesh_wire"):  # a mesh: its shape is what the function sees
            return ("wire", x._tdmesh_wire())
        if isinstance(x, (float, bool, complex)):  # 2 == 2.0 == True, but they are different calls
            return (type(x), x)
        return x

    with torch._C.DisableTorchFunction():  # requires_grad read directly, not through the mesh's mode
        key_leaves = tuple(key_of(x) for x in flat)
    try:
        key = (tree_flatten((args, kwargs))[1], key_leaves)
        hit = fn._cache.get(key)
    except TypeError:  # unhashable arguments: probe every time
        key, hit = None, None
    if hit is None:
        check_not_coalescing(f"a cache miss of {fn!r} (cached propagation runs it once on a worker and waits "
                             f"for the answer: call it once before the block, or give it propagate=<callable>)")
        fn.cache_misses += 1
        hit = send_value(mesh, "tdmesh.worker.builtins.probe", (fn._target, args, kwargs), {},
                          mesh.processes.offset).result()
        if key is not None:
            fn._cache[key] = hit
    else:
        fn.cache_hits += 1
    spec_text, described, mutated_idx = hit
    leaves: list[tuple[Any, Tensor | None]] = []  # a meta tensor, a Value or None; the input it aliases
    for d in described:
        if d is None:
            leaves.append((None, None))
        elif len(d) == 2:  # ("value", v): a result that is not a tensor, as the first rank returned it
            leaves.append((Value(d[1]), None))
        elif len(d) == 1:  # (OPAQUE,): an OpaqueRef
            leaves.append((_OPAQUE, None))
        else:
            size, stride, offset, dtype, alias = d
            meta = meta_tensor(TensorMeta(tuple(size), tuple(stride), offset, getattr(torch, dtype)))
            leaves.append((meta, tensors[alias] if alias is not None else None))
    return treespec_loads(spec_text), leaves, [tensors[i] for i in mutated_idx]


def _propagate_with(propagate: Callable, args, kwargs):
    """Run the user's propagator on meta stand-ins; detect outputs, aliasing and mutation."""
    originals: dict[int, Tensor] = {}

    def to_meta(x):
        if type(x) is Tensor:
            meta = meta_tensor(x._meta)  # the proxy's own metadata: nothing read through torch
            originals[id(meta)] = x
            return meta
        return x

    meta_args = tree_map(to_meta, args)
    meta_kwargs = tree_map(to_meta, kwargs)
    metas = [x for x in tree_flatten((meta_args, meta_kwargs))[0] if isinstance(x, torch.Tensor)]
    versions = [t._version for t in metas]
    try:  # the propagator runs locally on meta tensors, never on the mesh
        with _disable_current_modes(), torch.device("meta"):
            out = propagate(*meta_args, **meta_kwargs)
    except Exception as e:
        raise type(e)(f"{e}\n  (raised by the propagate function on the client)\n  at {user_line()}") from e
    mutated = [originals[id(t)] for t, v in zip(metas, versions) if t._version != v]
    flat_out, spec = tree_flatten(out)
    leaves: list[tuple[Any, Tensor | None]] = []  # a meta tensor, _OPAQUE or None; the input it aliases
    for x in flat_out:
        if x is None or type(x) is Resident:  # Resident: OpaqueRef(None), a handle of a worker's object
            leaves.append((None if x is None else _OPAQUE, None))
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"the propagate function must return tensors (a pytree of them) or OpaqueRef(None), got "
                            f"{type(x).__name__}")
        leaves.append((x, originals.get(id(x))))
    return spec, leaves, mutated

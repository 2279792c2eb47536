"""Remote functions: run a Python function on every worker of a mesh.

``tdmesh.remote(fn_or_path, propagate=...)`` ships the function by import path when it has
one (``"os.path.split"``, an aten op, a module-level function) and by (cloud)pickle
otherwise.  ``propagate`` tells the client what the call returns without running it: a
callable run on meta tensors, or ``"inspect"`` for functions called for side effects.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten, treespec_loads

from . import messages as m
from ._context import active_mesh_or_none
from .propagation import TensorMeta, meta_tensor, tensor_meta
from .mesh import TorchMeshHandle
from .stream import get_active_stream
from .tensor import (Tensor, _Aliases, _describe, _op_path, _wire, check_inputs, check_mutation, sealed_args,
                     user_line)

__all__ = ["remote", "Remote", "function_path"]


def function_path(fn) -> str | bytes:
    """How ``fn`` travels: an import path when one leads back to it, else pickled bytes."""
    if isinstance(fn, str):
        if "." not in fn:
            raise ValueError(f"remote function path {fn!r} must be a dotted import path like 'os.path.split'")
        return fn
    if isinstance(fn, torch._ops.OpOverload):
        return _op_path(fn)
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
        return cloudpickle.dumps(fn)
    except Exception as e:
        raise ValueError(f"cannot ship {fn!r} to the workers: it has no import path and does not pickle "
                         f"({type(e).__name__}: {e}); define it at module level") from e


class Remote:
    """A function that runs on the workers; calling it under a mesh returns remote tensors."""

    def __init__(self, target, propagate=None) -> None:
        if propagate == "mocked":  # checked first: "mocked" is a known mode, just not one tdmesh has
            raise NotImplementedError("propagate='mocked' is not supported")
        if propagate not in (None, "cached", "inspect") and not callable(propagate):
            raise ValueError(f"propagate must be a callable, 'inspect', 'cached' or None, got {propagate!r}")
        self._target = function_path(target)
        self._propagate = propagate
        self._cache: dict = {}
        self.cache_hits = 0
        self.cache_misses = 0
        self.__name__ = getattr(target, "__name__", str(target))

    def __repr__(self) -> str:
        return f"<tdmesh.remote {self.__name__}>"

    def __call__(self, *args, **kwargs):
        return call_remote(self, args, kwargs)

    def call(self, *args, **kwargs):
        """Run on every rank of the mesh and fetch each rank's (picklable) return value:
        a Future of a ``ValueMesh`` to iterate as ``(point, value)``."""
        from .fetch import _send_value_all
        flat, _ = tree_flatten((args, kwargs))
        return _send_value_all(_mesh_of(flat), self._target, args, kwargs)


def remote(fn=None, *, propagate=None):
    """``remote(fn_or_path, propagate=...)`` or the decorators ``@remote`` / ``@remote(propagate=...)``."""
    if fn is None:
        return lambda f: Remote(f, propagate)
    return Remote(fn, propagate)


def _mesh_of(flat) -> Any:
    mesh = None
    for x in flat:
        if isinstance(x, torch.Tensor):
            if type(x) is not Tensor:
                raise TypeError(f"LOCAL_TENSOR: remote functions take tensors on the mesh, got "
                                f"{_describe(x)}\n  at {user_line()}")
            if mesh is None:
                mesh = x._mesh
            elif x._mesh is not mesh:
                raise TypeError(f"WRONG_MESH: remote function arguments live on two meshes "
                                f"({mesh.shape} and {x._mesh.shape})\n  at {user_line()}")
    if mesh is None:
        mesh = active_mesh_or_none()
    if mesh is None:  # no tensors, no active mesh: a mesh argument says where
        from .mesh import DeviceMesh
        mesh = next((x for x in flat if isinstance(x, DeviceMesh)), None)
    if mesh is None:
        raise ValueError("Remote functions require an active device mesh, use `with mesh.activate():`")
    return mesh


def prepare_call(flat, mesh, stream) -> tuple:
    """Checks shared by remote calls and fetches: placement and borrow rules of the tensor
    arguments, and creation of the process groups passed as arguments (once per stream)."""
    remote_args = [x for x in flat if type(x) is Tensor]
    check_inputs(remote_args, mesh, "a remote function", stream)
    groups = []
    for x in flat:
        if isinstance(x, RemoteProcessGroup):
            if x.mesh.client is not mesh.client:
                raise TypeError(f"{x!r} belongs to another fleet than the mesh this call runs on\n  at {user_line()}")
            mesh.client.ensure_groups("remote", stream.id, x.mesh.shape, x.dims, x.ref)
            groups.append(x._tdmesh_wire())
        elif isinstance(x, TorchMeshHandle):
            for d in x.mesh.names:
                mesh.client.ensure_groups("dims", stream.id, x.mesh.shape, (d,))
    return remote_args, tuple(groups)


def call_remote(fn: Remote, args: tuple, kwargs: dict):
    flat, _ = tree_flatten((args, kwargs))
    mesh = _mesh_of(flat)
    client = mesh.client
    stream = get_active_stream()
    remote_args, groups = prepare_call(flat, mesh, stream)
    if fn._propagate == "inspect":
        outputs, out_leaves, mutated = None, [], []
    elif fn._propagate is None or fn._propagate == "cached":
        outputs, out_leaves, mutated = _propagate_cached(fn, args, kwargs, flat, mesh)
    else:
        outputs, out_leaves, mutated = _propagate_with(fn._propagate, args, kwargs)
    with client.lock:
        results = []
        proxies = []
        for leaf, source in out_leaves:
            if leaf is None:  # the function returns None in this slot
                results.append(None)
                proxies.append(None)
                continue
            ref = client.new_ref()
            aliases = source._r.aliases if source is not None else _Aliases()
            proxies.append(Tensor(tensor_meta(leaf), client.device, mesh, ref, aliases, stream))
            results.append(ref)
        for t in mutated:
            check_mutation(t, fn)
        mutated_refs = [r for t in mutated for r in t._r.aliases.refs]
        seq = client.new_seq()
        msg = m.CallFunction(seq, tuple(results), tuple(mutated_refs), fn._target, sealed_args(args, kwargs), {},
                             stream.id, groups)
        client.send(mesh, msg, seq, [t.ref for t in remote_args], [r for r in results if r is not None] + mutated_refs)
    if outputs is None:
        return None
    return tree_unflatten(proxies, outputs)


def _propagate_cached(fn: Remote, args, kwargs, flat, mesh):
    """Outputs of ``fn`` learnt by running it once, for real, on the mesh's first rank, then
    cached by the arguments' structure, values, tensor metadata, aliasing and requires_grad."""
    from .mesh import DeviceMesh
    tensors = [x for x in flat if type(x) is Tensor]
    alias_ids: dict[int, int] = {}

    def key_of(x):
        if type(x) is Tensor:
            return ("T", x._meta, x.requires_grad, alias_ids.setdefault(id(x._r.aliases), len(alias_ids)))
        if isinstance(x, (RemoteProcessGroup, TorchMeshHandle)):
            raise TypeError(f"{fn!r} takes a process group or device mesh: cached propagation would run it on "
                            f"one rank, where a collective waits forever; pass propagate=<callable>\n  at {user_line()}")
        if isinstance(x, DeviceMesh):
            return ("mesh", x.shape)
        if isinstance(x, (float, bool, complex)):  # 2 == 2.0 == True, but they are different calls
            return (type(x), x)
        return x

    key_leaves = tuple(key_of(x) for x in flat)
    try:
        key = (tree_flatten((args, kwargs))[1], key_leaves)
        hit = fn._cache.get(key)
    except TypeError:  # unhashable arguments: probe every time
        key, hit = None, None
    if hit is None:
        from ._coalescing import check_not_coalescing
        from .fetch import _send_value
        check_not_coalescing(f"a cache miss of {fn!r} (cached propagation runs it once on a worker and waits "
                             f"for the answer: call it once before the block, or give it propagate=<callable>)")
        fn.cache_misses += 1
        hit = _send_value(mesh, "tdmesh.worker.builtins.probe", (fn._target, args, kwargs), {},
                          mesh.processes.offset).result()
        if key is not None:
            fn._cache[key] = hit
    else:
        fn.cache_hits += 1
    spec_text, described, mutated_idx = hit
    leaves = []
    for d in described:
        if d is None:
            leaves.append((None, None))
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
            meta = meta_tensor(tensor_meta(x))
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
    leaves = []
    for x in flat_out:
        if x is None:
            leaves.append((None, None))
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"the propagate function must return tensors (a pytree of them), got {type(x).__name__}")
        leaves.append((x, originals.get(id(x))))
    return spec, leaves, mutated


class RemoteProcessGroup:
    """``mesh.process_group(dims)``: a remote function receives it as a real
    ``torch.distributed.ProcessGroup`` over ``dims``, on the stream the call runs on."""

    def __init__(self, mesh, dims) -> None:
        from .grouping import normalize_dims
        if isinstance(dims, str):
            dims = (dims,)
        self.mesh = mesh
        self.dims = normalize_dims(mesh.shape, dims)
        self.ref = mesh.client.new_ref()

    def size(self) -> int:
        """Members of each group: ``mesh.size(dims)``."""
        return self.mesh.size(self.dims)

    def _tdmesh_wire(self):
        return m.ProcessGroupArg(self.ref, self.mesh.shape, self.dims)

    def __repr__(self) -> str:
        return f"<tdmesh.RemoteProcessGroup {self.ref} over {list(self.dims)} of {self.mesh.shape}>"

"""The client's remote tensor: a ``torch.Tensor`` wrapper subclass naming a worker value.

Every aten op on one of these (or, under an active mesh, every factory call) becomes a
``CallFunction`` for the workers of the tensor's mesh.  Metadata comes from
:mod:`tdmesh.propagation`, so the result is available at once and nothing blocks.
Autograd runs on the client over these wrappers, so its backward ops are remote too.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_unflatten

from . import messages as m
from ._context import active_mesh_or_none
from .stream import get_active_stream
from .propagation import TensorMeta, op_aliasing, propagate, schema_arg

_TDMESH_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_SKIP = (_TDMESH_DIR, _TORCH_DIR, "<frozen", os.path.dirname(os.__file__) + os.sep + "contextlib")

# Ops whose answer is a Python value on the client: they need a fetch, not a dispatch.
_NEEDS_VALUE = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal", "aten::item"}


_collectives_module = None


def _collectives():
    """tdmesh.collectives, imported on first use (it imports this module) and kept."""
    global _collectives_module
    if _collectives_module is None:
        from . import collectives
        _collectives_module = collectives
    return _collectives_module


def call_site() -> list:
    """(filename, lineno, name) of the user's innermost frames: cheap enough for every op."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP):
        frame = frame.f_back
    site = []
    while frame is not None and len(site) < 6:
        site.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return site


def site_text(site) -> str:
    """The innermost user frame of a captured call site, as a traceback line."""
    if not site:
        return "<unknown>"
    filename, lineno, name = site[0]
    return f'File "{filename}", line {lineno}, in {name}'


def user_line() -> str:
    return site_text(call_site())


def frames(site) -> list[traceback.FrameSummary]:
    return [traceback.FrameSummary(f, l, n) for f, l, n in reversed(site or [])]


class _Ref:
    """Owns one worker ref; when the last proxy holding it dies, the ref is deleted remotely."""
    __slots__ = ("id", "mesh", "aliases", "dropped_at", "__weakref__")

    def __init__(self, ref_id: int, mesh, aliases: "_Aliases") -> None:
        self.id = ref_id
        self.mesh = mesh
        self.aliases = aliases
        self.dropped_at = None
        aliases.refs[ref_id] = weakref.ref(self)
        recorder = mesh.client.recorder
        if recorder is not None:  # tracing a compiled function: it may drop what it made
            recorder.created.append(weakref.ref(self))

    def __del__(self) -> None:
        try:
            self.aliases.refs.pop(self.id, None)
            if self.dropped_at is None:
                self.mesh.client.delete_ref(self.id, self.mesh)
        except Exception:  # interpreter shutdown
            pass


class _Aliases:
    """The live refs that share one worker storage: mutating any of them changes all of them.
    Held weakly, so a proxy's death is not delayed until the cycle collector runs.  Also the
    borrow state of that storage: read borrows of it, a mutable borrow of it, or the Borrow
    that lent it (when these refs are the borrowed side)."""
    __slots__ = ("refs", "read_borrows", "mutable_borrow", "borrow")

    def __init__(self) -> None:
        self.refs: dict[int, weakref.ref] = {}  # ref id -> weakref to its _Ref (no cycle)
        self.read_borrows = 0
        self.mutable_borrow = None
        self.borrow = None

    def live(self) -> list:
        """The live _Refs of this storage."""
        return [r for r in (w() for w in list(self.refs.values())) if r is not None]


class Tensor(torch.Tensor):
    """A tensor that lives on every worker of ``mesh``; its metadata is local, its data remote."""

    _r: _Ref
    _mesh: Any
    _stream: Any

    @staticmethod
    def __new__(cls, meta: TensorMeta, device, mesh, ref_id: int, aliases: _Aliases, stream=None):
        t = torch.Tensor._make_wrapper_subclass(cls, meta.size, strides=meta.stride,
                                                storage_offset=meta.offset, dtype=meta.dtype,
                                                device=device, requires_grad=False)
        t._r = _Ref(ref_id, mesh, aliases)
        t._meta = meta
        t._mesh = mesh
        t._stream = stream if stream is not None else get_active_stream()
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return dispatch(func, args, kwargs or {})

    @property
    def mesh(self):
        return self._mesh

    @property
    def stream(self):
        return self._stream

    @property
    def ref(self) -> int:
        return self._r.id

    @property
    def dropped(self) -> bool:
        return self._r.dropped_at is not None

    def reduce(self, dims=(), reduction: str = "sum", scatter: bool = False, mesh=None, _inplace: bool = False,
               out=None):
        """Reduce over mesh ``dims`` (``()`` = every dim): ``sum avg product min max band bor bxor``
        or ``stack`` (a leading dim of the group size); ``scatter`` splits dim 0 over the group."""
        return _collectives()._reduce(self, dims, reduction, scatter, mesh, _inplace, out)

    def reduce_(self, dims=(), reduction: str = "sum", scatter: bool = False, mesh=None):
        """In-place :meth:`reduce`."""
        return _collectives()._reduce(self, dims, reduction, scatter, mesh, True, None)

    def to_mesh(self, mesh, stream=None):
        """A copy of this tensor on ``mesh`` (dims matched by name, broadcast over new dims)."""
        return _collectives()._to_mesh(self, self._mesh, mesh, stream)

    def slice_mesh(self, **kw):
        """This tensor restricted to ``self.mesh.slice(**kw)``, to move with ``.to_mesh``."""
        return _collectives().MeshSliceTensor(self, self._mesh.slice(**kw))

    def drop(self) -> None:
        """Free this tensor and every view sharing its memory on the workers, now."""
        if self._r.dropped_at is not None:
            return
        site = call_site()
        refs = self._r.aliases.live()
        for r in refs:
            r.dropped_at = site
        self._mesh.client.delete_refs([r.id for r in refs], self._mesh)

    def __repr__(self, *, tensor_contents=None) -> str:
        state = " dropped" if self.dropped else ""
        on = "" if self._stream.id == 0 else f", stream={self._stream.name!r}"
        return (f"tdmesh.Tensor(shape={list(self.shape)}, dtype={self.dtype}, device={self.device}, "
                f"mesh={self._mesh.shape}{on}, ref={self._r.id}{state})")

    def __reduce_ex__(self, protocol):
        raise TypeError("a tdmesh.Tensor cannot be pickled: its data lives on the workers; "
                        "fetch it with tdmesh.fetch_shard(t).result()")


_last_error = threading.local()


def _raise(error: Exception):
    """Raise ``error`` from dispatch, remembering it: torch turns a TypeError inside a binary
    operator into ``NotImplemented``, and the operators of :class:`Tensor` re-raise it."""
    _last_error.value = error
    raise error


def _binary(name: str):
    base = getattr(torch.Tensor, name)

    def operator(self, other):
        _last_error.value = None
        out = base(self, other)
        if out is NotImplemented:
            error, _last_error.value = getattr(_last_error, "value", None), None
            if error is not None:
                raise error
        return out

    operator.__name__ = name
    return operator


_BINARY = [f"__{p}{n}__" for n in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul",
                                   "and", "or", "xor", "lshift", "rshift") for p in ("", "r", "i")
           if hasattr(torch.Tensor, f"__{p}{n}__")] + ["__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__"]
for _name in _BINARY:
    setattr(Tensor, _name, _binary(_name))
Tensor.__hash__ = torch.Tensor.__hash__


def _describe(t) -> str:
    if isinstance(t, Tensor):
        return f"tdmesh.Tensor(ref={t._r.id}, shape={list(t.shape)}, mesh={t._mesh.shape})"
    return f"local tensor(shape={list(t.shape)}, device={t.device})"


_no_tensor_out: dict = {}


def _makes_no_tensor(func) -> bool:
    answer = _no_tensor_out.get(func)
    if answer is None:
        answer = not any("Tensor" in str(r.type) for r in func._schema.returns) and not any(
            "Tensor" in str(a.type) for a in func._schema.arguments)
        _no_tensor_out[func] = answer
    return answer


def _value_on_client(func, args, kwargs, remote):
    """``t.item()``, ``bool(t)``, ``torch.equal``: a Python value the client needs now.

    These block: the tensors are fetched from the first rank of their mesh (replicated
    values such as an optimizer's step count read the same everywhere), then the op runs
    locally.  Prefer ``fetch_shard`` where the wait can be deferred.
    """
    from ._coalescing import check_not_coalescing
    from .fetch import fetch_shard
    check_not_coalescing(f"{func} (it needs a value from the workers)")
    values = fetch_shard(tuple(remote)).result()
    local = dict(zip(map(id, remote), values))
    from torch.utils._pytree import tree_map
    swap = lambda x: local.get(id(x), x) if type(x) is Tensor else x  # noqa: E731
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes():
        return func(*tree_map(swap, args), **tree_map(swap, kwargs))


def _scan(obj, remote: list, local: list):
    """One pass over an op's arguments: collect tensors, and build the propagation cache key."""
    t = type(obj)
    if t is Tensor:
        remote.append(obj)
        return obj._meta
    if t is tuple or t is list:
        return (t, tuple([_scan(x, remote, local) for x in obj]))
    if t is dict:
        return (dict, tuple([(k, _scan(v, remote, local)) for k, v in obj.items()]))
    if isinstance(obj, torch.Tensor):
        local.append(obj)
        return ("local", id(obj))
    if t is float or t is bool or t is complex:  # 12 == 12.0 == True, but they make other dtypes
        return (t, obj)
    return obj


def dispatch(func, args: tuple, kwargs: dict):
    """Turn one aten call into a remote op and return its result proxies."""
    name = func._schema.name
    remote: list = []
    local: list = []
    key = (_scan(args, remote, local), _scan(kwargs, remote, local) if kwargs else None)
    if remote:
        mesh = remote[0]._mesh
        if name in _NEEDS_VALUE:
            return _value_on_client(func, args, kwargs, remote)
    elif local and name not in ("aten::lift_fresh", "aten::lift"):
        # only local tensors (a fetched value, say): the op is the client's own business.
        # Mixing local and remote tensors is the error (below); torch.tensor(data) ships data.
        return func(*args, **kwargs)
    else:
        mesh = active_mesh_or_none()
        if mesh is None or _makes_no_tensor(func):
            # no_mesh, or an op with no remote input and no tensor output (profiler ranges and
            # the like): it is the client's own business
            return func(*args, **kwargs)
    client = mesh.client
    if client is None:
        raise RuntimeError(f"{mesh!r} is a pure geometry value with no fleet; get a live mesh from "
                           f"tdmesh.local_mesh() or tdmesh.world_mesh()")
    if local:
        if name in ("aten::lift_fresh", "aten::lift") and not remote:
            return _ship_local(func, local[0], mesh)
        _raise(TypeError(f"LOCAL_TENSOR: {func} mixes a local tensor with the mesh {mesh.shape}:\n"
                        f"  {_describe(local[0])}\nmove it to the mesh with torch.tensor(...) under "
                        f"`with mesh.activate():`, or run local code under tdmesh.no_mesh.activate()\n"
                        f"  at {user_line()}"))
    check_inputs(remote, mesh, func)
    return _dispatch_remote(func, args, kwargs, key, remote, mesh, client)


def check_inputs(remote: list, mesh, what, stream=None) -> None:
    """Placement and permission checks for an op's remote inputs, raised at the user's line."""
    stream = stream if stream is not None else get_active_stream()
    recorder = mesh.client.recorder if mesh.client is not None else None
    if recorder is not None:
        for t in remote:
            recorder.seen[t._r.id] = t
    for t in remote:
        if t._mesh is not mesh:
            _raise(TypeError(f"WRONG_MESH: {what} mixes tensors from two meshes:\n  {_describe(remote[0])}\n"
                             f"  {_describe(t)}\nmove one with t.to_mesh(other_mesh)\n  at {user_line()}"))
        r = t._r
        if r.dropped_at is not None:
            _raise(TypeError(f"DROPPED: tensor {r.id} is dropped at:\n"
                             f"{''.join(traceback.format_list(frames(r.dropped_at)))}"
                             f"and cannot be used in {what}\n  at {user_line()}"))
        if t._stream is not stream:
            _raise(TypeError(f"WRONG_STREAM: tensor {r.id} lives on {t._stream!r} but the active stream is "
                             f"{stream!r}; borrow it with {stream.name!r} stream.borrow(t), or activate its stream"
                             f"\n  at {user_line()}"))
        aliases = r.aliases
        if aliases.mutable_borrow is not None:
            _raise(TypeError(f"BORROWED: tensor {r.id} is mutably borrowed by {aliases.mutable_borrow.stream!r} "
                             f"(at {site_text(aliases.mutable_borrow.site)}); drop the borrow before using it"
                             f"\n  at {user_line()}"))
        if aliases.borrow is not None and not aliases.borrow.first_use_sent:
            aliases.borrow.first_use()


def check_mutation(t, what) -> None:
    aliases = t._r.aliases
    if aliases.read_borrows:
        _raise(TypeError(f"MUTATING_BORROW: tensor {t._r.id} would be mutated by {what} while it is borrowed "
                         f"read-only; drop the borrow first\n  at {user_line()}"))
    if aliases.borrow is not None and not aliases.borrow.mutable:
        _raise(TypeError(f"MUTATING_BORROW: tensor {t._r.id} is a read-only borrow (made at "
                         f"{site_text(aliases.borrow.site)}) and would be mutated by {what}\n  at {user_line()}"))


def _dispatch_remote(func, args, kwargs, key, remote, mesh, client):
    if remote:
        device = remote[0].device
    else:
        device = kwargs.get("device")
        if device is None:
            device = client.device
        else:
            device = torch.device(device)
            if device.type == client.device.type:  # "cuda" means the worker's own GPU: one index
                device = client.device
    try:
        out = propagate(func, args, kwargs, remote, key)
    except Exception as e:
        # Errors that metadata reveals are the user's, raised at their line as local torch would.
        raise type(e)(f"{e}\n  (tdmesh: raised while checking {func} on the client, before anything was sent)"
                      f"\n  at {user_line()}") if _retypable(e) else e
    aliasing = op_aliasing(func)
    mutated_refs: list[int] = []
    for position in aliasing.mutated_args:
        target = schema_arg(func, args, kwargs, position)
        for t in (target if isinstance(target, (list, tuple)) else (target,)):
            if type(t) is Tensor:
                check_mutation(t, func)
                mutated_refs.extend(t._r.aliases.refs)
    results: list = []
    outputs: list = []
    leaf_sources = _leaf_sources(aliasing, out, func, args, kwargs)
    stream = get_active_stream()
    with client.lock:
        for leaf, (source, is_write) in zip(out.leaves, leaf_sources):
            if type(leaf) is tuple and leaf and leaf[0] == "value":
                if leaf[1] is None:  # an optional output the op did not produce (e.g. a grad)
                    outputs.append(None)
                    results.append(None)
                    continue
                raise TypeError(f"{func} returns a Python value ({leaf[1]!r}) that needs a fetch\n  at {user_line()}")
            if is_write and type(source) is Tensor:
                if source._meta != leaf:
                    raise NotImplementedError(f"{func} changes the shape or strides of a remote tensor in place; "
                                              f"use its out-of-place form\n  at {user_line()}")
                outputs.append(source)  # in-place / out=: the result is the argument itself
                results.append(None)
                continue
            aliases = source._r.aliases if type(source) is Tensor else None
            if aliases is None:
                aliases = _Aliases()
            ref = client.new_ref()
            outputs.append(Tensor(leaf, device, mesh, ref, aliases, stream))
            results.append(ref)
        seq = client.new_seq()
        msg = m.CallFunction(seq, tuple(results), tuple(mutated_refs), _op_path(func),
                             _wire(args), _wire(kwargs) if kwargs else {}, stream.id)
        uses = [t._r.id for t in remote]
        defs = [r for r in results if r is not None] + mutated_refs
        client.send(mesh, msg, seq, uses, defs)
    if out.single:
        return outputs[0]
    return tree_unflatten(outputs, out.spec)


def _leaf_sources(aliasing, out, func, args, kwargs):
    """For each output leaf: (the argument it aliases or None, whether it is written)."""
    returns = aliasing.return_aliases
    n = len(out.leaves)
    if len(returns) == 1 and (returns[0][2] or n == 1):
        source, is_write, _ = returns[0]
        value = schema_arg(func, args, kwargs, source) if source is not None else None
        return [(value, is_write)] * n
    if len(returns) == n:
        return [((schema_arg(func, args, kwargs, s) if s is not None else None), w) for s, w, _ in returns]
    return [(None, False)] * n


def _retypable(e: Exception) -> bool:
    try:
        type(e)("probe")
        return True
    except Exception:
        return False


_op_paths: dict = {}


def _op_path(func) -> str:
    path = _op_paths.get(func)
    if path is None:
        path = f"torch.ops.{func.namespace}.{func._schema.name.split('::')[1]}.{func._overloadname}"
        _op_paths[func] = path
    return path


def _wire(obj):
    """Arguments as they travel: proxies become Refs; containers are rebuilt only if needed."""
    t = type(obj)
    if t is Tensor:
        return m.Ref(obj._r.id)
    if t is tuple or t is list:
        return t(_wire(x) for x in obj)
    if t is dict:
        return {k: _wire(v) for k, v in obj.items()}
    if t is torch.Tensor or isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # NamedTuples keep their type
        return t(*(_wire(x) for x in obj))
    wire = getattr(obj, "_tdmesh_wire", None)
    if wire is not None:
        return wire()
    return obj


def sealed_args(args: tuple, kwargs: dict) -> bytes:
    """A user function's arguments, pickled on their own: a value the worker cannot unpickle
    (a class defined in ``__main__``, say) then fails that call, not the worker's whole frame."""
    import pickle
    try:
        return pickle.dumps((_wire(args), _wire(kwargs)), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise TypeError(f"the arguments of this remote call cannot be pickled ({type(e).__name__}: {e})"
                        f"\n  at {user_line()}") from e


def _ship_local(func, data: torch.Tensor, mesh):
    """``torch.tensor(data)`` under a mesh: the data travels with the op."""
    client = mesh.client
    device = client.device
    meta = TensorMeta(tuple(data.shape), tuple(data.stride()), 0, data.dtype)
    data = data.detach().clone()
    stream = get_active_stream()
    with client.lock:
        ref = client.new_ref()
        out = Tensor(meta, device, mesh, ref, _Aliases(), stream)
        seq = client.new_seq()
        msg = m.CallFunction(seq, (ref,), (), "torch.ops.aten._to_copy.default", (data,), {"device": device},
                             stream.id)
        client.send(mesh, msg, seq, [], [ref])
    return out


class _MeshMode(TorchDispatchMode):
    """Active while any mesh is: factory calls and ops on remote tensors go to the mesh."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return dispatch(func, args, kwargs or {})


def _mode_dispatch(self, func, types, args=(), kwargs=None):
    return dispatch(func, args, kwargs or {})


# torch wraps a mode's __torch_dispatch__ in a dynamo-disable shim (several microseconds per
# op); tdmesh is never traced by dynamo, so the hot path calls the plain function.
_MeshMode.__torch_dispatch__ = _mode_dispatch
MESH_MODE = _MeshMode()

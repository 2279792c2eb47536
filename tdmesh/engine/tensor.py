"""The client's remote tensor: a ``torch.Tensor`` wrapper subclass naming a worker value.

A ``Tensor`` holds a ``RefOwner`` (the worker ref, freed on the workers when the last proxy
holding it dies) and the ``AliasSet`` of refs that share its storage (mutating one changes
all; borrows are tracked per storage).  Ops on it are turned into messages by
:mod:`tdmesh.engine.dispatch`; the collective methods (``reduce``, ``to_mesh`` ...) are defined
by :mod:`tdmesh.collectives`, which sits above this module.
"""

from __future__ import annotations

import copy
import threading
import weakref
from typing import Any, NoReturn

import torch

from ..errors import PlacementError, UsageError, call_site, user_line
from .propagation import SparseMeta, TensorMeta, meta_tensor
from .stream import Stream

__all__ = ["Tensor", "RefOwner", "AliasSet", "new_proxy", "view_proxy", "describe", "raise_in_op", "binary_call",
           "BINARY_OPERATORS"]


class RefOwner:
    """Owns one worker ref; when the last proxy holding it dies, the ref is deleted remotely."""
    __slots__ = ("id", "mesh", "aliases", "dropped_at", "__weakref__")

    def __init__(self, ref_id: int, mesh, aliases: AliasSet) -> None:
        self.id = ref_id
        self.mesh = mesh
        self.aliases = aliases
        self.dropped_at: list | None = None
        aliases.refs[ref_id] = weakref.ref(self)

    def __del__(self) -> None:
        try:
            self.aliases.refs.pop(self.id, None)
            if self.dropped_at is None:
                self.mesh.client.delete_ref(self.id, self.mesh)
        except Exception:  # noqa: BLE001 - a finalizer must not raise (interpreter shutdown)
            pass


class AliasSet:
    """The live refs that share one worker storage: mutating any of them changes all of them.
    Held weakly, so a proxy's death is not delayed until the cycle collector runs.  Also the
    borrow state of that storage: read borrows of it, a mutable borrow of it, or the Borrow
    that lent it (when these refs are the borrowed side)."""
    __slots__ = ("refs", "read_borrows", "mutable_borrow", "borrow", "copied_at", "fused")

    def __init__(self) -> None:
        self.refs: dict[int, weakref.ref] = {}  # ref id -> weakref to its RefOwner (no cycle)
        self.read_borrows = 0
        self.mutable_borrow: Any = None
        self.borrow: Any = None
        self.copied_at: str | None = None  # the user's line of an index by a per-rank scalar (a copy, not a view)
        # the node of a linear issued whole whose output this is, where torch's is a view (engine/composites.py)
        self.fused: int | None = None

    def live(self) -> list[RefOwner]:
        """The live RefOwners of this storage."""
        return [r for r in (w() for w in list(self.refs.values())) if r is not None]


class Tensor(torch.Tensor):
    """A tensor that lives on every worker of ``mesh``; its metadata is local, its data remote."""

    _r: RefOwner
    _meta: TensorMeta | SparseMeta
    _device: torch.device  # the device it names: a sparse proxy's wrapper is a meta tensor, and a dense
    # one's read as ``t.device`` costs 0.19 us (a new torch.device, past torch's check for a torch function)
    _mesh: Any
    _stream: Stream

    @staticmethod
    def __new__(cls, meta: TensorMeta | SparseMeta, device, mesh, ref_id: int, aliases: AliasSet, stream: Stream):
        if not isinstance(meta, SparseMeta):
            return new_proxy(meta, device, mesh, ref_id, aliases, stream)
        # A wrapper cannot have a compressed layout: a sparse proxy is a meta tensor of the
        # same structure, re-typed, whose device queries come to __torch_dispatch__.
        device = torch.device(device)
        t = torch.Tensor._make_subclass(cls, meta_tensor(meta), False, dispatch_device=True,
                                        device_for_backend_keys=device)
        t._device = device
        t._r = RefOwner(ref_id, mesh, aliases)
        t._meta = meta
        t._mesh = mesh
        t._stream = stream
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # replaced by tdmesh.engine.dispatch.dispatch
        raise NotImplementedError("tdmesh.engine.dispatch is not imported")

    @property
    def mesh(self):
        return self._mesh

    @property
    def stream(self) -> Stream:
        return self._stream

    @property
    def ref(self) -> int:
        return self._r.id

    @property
    def aliases(self) -> AliasSet:
        """The refs sharing this tensor's storage on the workers (views, in-place results)."""
        return self._r.aliases

    @property
    def meta(self) -> TensorMeta | SparseMeta:
        return self._meta

    @property
    def dropped(self) -> bool:
        return self._r.dropped_at is not None

    def drop(self) -> None:
        """Free this tensor and every view sharing its memory on the workers, now."""
        if self._r.dropped_at is not None:
            return
        site = call_site()
        refs = self._r.aliases.live()
        for r in refs:
            r.dropped_at = site
        self._mesh.client.delete_refs([r.id for r in refs], self._mesh)

    def __repr__(self, *, tensor_contents=None) -> str:  # type: ignore[override]
        state = " dropped" if self.dropped else ""
        on = "" if self._stream.id == 0 else f", stream={self._stream.name!r}"
        return (f"tdmesh.Tensor(shape={list(self.shape)}, dtype={self.dtype}, device={self.device}, "
                f"mesh={self._mesh.shape}{on}, ref={self._r.id}{state})")

    def __deepcopy__(self, memo):
        """``copy.deepcopy`` (a model's EMA copy, a target network, the best model so far): a new tensor on the
        same mesh and stream holding a copy of the workers' data, as torch copies a local leaf: its strides,
        ``requires_grad``, a deep copy of its ``.grad`` and of its Python attributes (a parameter stays one).
        torch's own ``__deepcopy__`` copied the proxy's ``__dict__``, mesh and client locks included, and failed
        ("cannot pickle '_thread.RLock' object")."""
        found = memo.get(id(self))
        if found is not None:
            return found
        with torch._C.DisableTorchFunction():
            leaf, requires_grad, grad = self.grad_fn is None, self.requires_grad, self.grad
        if not leaf:  # torch's rule, in its words
            raise RuntimeError(f"Only Tensors created explicitly by the user (graph leaves) support the deepcopy "
                               f"protocol at the moment.\n  at {user_line()}")
        with torch.no_grad():
            new = self.clone(memory_format=torch.preserve_format)
        if requires_grad:
            new.requires_grad_()
        if grad is not None:
            new.grad = copy.deepcopy(grad, memo)
        own = new.__dict__
        for name, value in self.__dict__.items():
            if name not in own:
                own[name] = copy.deepcopy(value, memo)
        memo[id(self)] = new
        return new

    def untyped_storage(self):
        """A mesh tensor has no memory on the client: a library that reads a tensor's memory (safetensors'
        ``save_file``, a ``numpy()`` view) is refused here, before it wrote anything, naming the ways."""
        raise UsageError(f"tdmesh.Tensor {self._r.id} has no memory on the client: its data lives on the workers. "
                         f"Fetch a replica first (tdmesh.fetch_shard(t).result()); save a model with "
                         f"model.save_pretrained(dir) (one replica, checked) or tdmesh.checkpoint.save\n"
                         f"  at {user_line()}")

    def __reduce_ex__(self, protocol):  # torch.save, pickle
        raise UsageError(f"a tdmesh.Tensor cannot be pickled (torch.save, pickle): its data lives on the workers. "
                         f"{_CHECKPOINT_WAY}; for a small value, fetch it: tdmesh.fetch_shard(t).result() "
                         f"(one rank) or tdmesh.fetch_all(t)\n  at {user_line()}")

    # torch.distributed.checkpoint's planner asks a tensor for these first (DTensor's protocol):
    # on the client, DCP would read each mesh tensor's bytes in its writer thread; it fails here, at once
    def __create_write_items__(self, fqn: str, obj):
        raise UsageError(f"torch.distributed.checkpoint cannot save mesh tensor {fqn!r} from the client: its data "
                         f"lives on the workers. {_CHECKPOINT_WAY}\n  at {user_line()}")

    def __create_chunk_list__(self):
        raise UsageError(f"torch.distributed.checkpoint cannot load into a mesh tensor from the client: its data "
                         f"lives on the workers. {_CHECKPOINT_WAY.replace('save', 'load')}\n  at {user_line()}")


_CHECKPOINT_WAY = ("Checkpoint with tdmesh.checkpoint.save(state_dict, checkpoint_id=path) (DCP's arguments), which "
                   "runs torch.distributed.checkpoint on every worker")


_wrapper = torch.Tensor._make_wrapper_subclass
_STRIDED, _DEVICE = torch.strided, torch.device


def _takes_positions() -> bool:
    """Whether this torch's ``_make_wrapper_subclass`` takes strides, storage offset, memory format,
    dtype, layout and device in that order by position: torch parses positions faster than keywords
    (1.14 -> 0.89 us a wrapper, torch 2.13).  Checked once on a probe, keywords where it fails."""
    class Probe(torch.Tensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError
    try:
        t = _wrapper(Probe, (2, 3), (1, 2), 1, None, torch.float16, _STRIDED, torch.device("meta"))
    except Exception:  # noqa: BLE001 - another signature: keywords it is
        return False
    return (t.shape, t.stride(), t.storage_offset(), t.dtype, t.device.type) == ((2, 3), (1, 2), 1, torch.float16,
                                                                                 "meta")


_BY_POSITION = _takes_positions()


def new_proxy(meta: TensorMeta, device, mesh, ref_id: int, aliases: AliasSet, stream: Stream) -> Tensor:
    """``Tensor(meta, ...)`` for dense metadata: what eager dispatch makes for every result."""
    if _BY_POSITION:
        t = _wrapper(Tensor, meta.size, meta.stride, meta.offset, None, meta.dtype, _STRIDED, device)
    elif meta.offset:
        t = _wrapper(Tensor, meta.size, strides=meta.stride, storage_offset=meta.offset, dtype=meta.dtype,
                     device=device)
    else:  # torch parses fewer keywords (0.2 us of the ~1.4 a wrapper costs)
        t = _wrapper(Tensor, meta.size, strides=meta.stride, dtype=meta.dtype, device=device)
    t._r = RefOwner(ref_id, mesh, aliases)
    t._meta = meta
    t._mesh = mesh
    t._stream = stream
    t._device = device if type(device) is _DEVICE else t.device
    return t


def view_proxy(meta: TensorMeta, device, mesh, ref_id: int, base: Tensor, stream: Stream) -> Tensor:
    """The proxy of a view of ``base``: under inference mode a normal tensor where ``base`` is one, as torch makes a
    view of a normal tensor there (autograd's view kernel then shares ``base``'s version counter with it: an
    inference-tensor proxy made it fail with "Cannot set version_counter for inference tensor")."""
    if _inference_on() and not base.is_inference():
        with torch.inference_mode(False):  # a new one each time: the context object holds its state
            return new_proxy(meta, device, mesh, ref_id, base._r.aliases, stream)
    return new_proxy(meta, device, mesh, ref_id, base._r.aliases, stream)


_inference_on = torch.is_inference_mode_enabled


def describe(t) -> str:
    """A tensor as error messages name it."""
    if isinstance(t, Tensor):
        return f"tdmesh.Tensor(ref={t._r.id}, shape={list(t.shape)}, mesh={t._mesh.shape})"
    return f"local tensor(shape={list(t.shape)}, device={t.device})"


# ----------------------------------------------------------------------------- binary operators
# torch turns a TypeError raised inside a binary operator's dispatch into NotImplemented (and
# then a generic "unsupported operand" error): remember the real one and re-raise it.
_last_error = threading.local()


def raise_in_op(code: str, message: str) -> NoReturn:
    """Raise a PlacementError from inside an op, so that binary operators re-raise it."""
    error = PlacementError(code, message)
    _last_error.value = error
    raise error


def binary_call(base, self, other):
    """``base(self, other)`` (a ``torch.Tensor`` binary operator), re-raising the error an op raised
    where torch made it ``NotImplemented``."""
    _last_error.value = None
    out = base(self, other)
    if out is NotImplemented:
        error, _last_error.value = getattr(_last_error, "value", None), None
        if error is not None:
            raise error
    return out


def _binary(name: str):
    """The operator as torch's, its op's errors kept (``tdmesh.engine.operators`` installs faster ones)."""
    base = getattr(torch.Tensor, name)

    def operator(self, other):
        return binary_call(base, self, other)

    operator.__name__ = name
    return operator


BINARY_OPERATORS = [f"__{p}{n}__" for n in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul",
                                            "and", "or", "xor", "lshift", "rshift") for p in ("", "r", "i")
                    if hasattr(torch.Tensor, f"__{p}{n}__")] + ["__eq__", "__ne__", "__lt__", "__le__", "__gt__",
                                                                "__ge__"]
for _name in BINARY_OPERATORS:
    setattr(Tensor, _name, _binary(_name))
Tensor.__hash__ = torch.Tensor.__hash__  # type: ignore[method-assign]

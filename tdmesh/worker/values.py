"""What a worker's ref table holds besides tensors, and the helpers around its values.

A ``Poison`` stands where a value could not be computed; a ``BorrowSlot`` is a value lent
between streams; ``device_is_broken`` tells a sticky CUDA error (the worker must leave)
from an ordinary one.
"""

from __future__ import annotations

import pickle
import threading
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from ..errors import TdmeshError
from ..protocol import messages as m
from ..protocol.codec import pack_tensor, plain_tensor
from ..protocol.resident import Resident
from .streams import Stream

__all__ = ["Poison", "DependentOnError", "BorrowSlot", "DeviceBroken", "device_is_broken", "event_on", "unseal",
           "to_fetchable", "held_results"]


class Poison:
    """The slot of a value whose computation failed at ``seq``."""
    __slots__ = ("seq", "message")

    def __init__(self, seq: int, message: str) -> None:
        self.seq = seq
        self.message = message

    def __repr__(self) -> str:
        return f"Poison(seq={self.seq}, {self.message!r})"


class DependentOnError(Exception):
    def __init__(self, poison: Poison) -> None:
        super().__init__(poison.message)
        self.poison = poison


class BorrowSlot:
    """A value lent from one stream to another, with the events that order the two."""
    __slots__ = ("msg", "created", "released", "value", "event", "last_event")

    def __init__(self, msg: m.BorrowCreate) -> None:
        self.msg = msg
        self.created = threading.Event()
        self.released = threading.Event()
        self.value: Any = None
        self.event: Any = None
        self.last_event: Any = None


class DeviceBroken(TdmeshError, RuntimeError):
    """This worker's device can no longer run anything (a sticky CUDA error)."""


def device_is_broken(device: torch.device, error: BaseException) -> bool:
    """Whether ``error`` left ``device`` unusable.  A device-side assert or an illegal address
    poisons the CUDA context for good; other CUDA errors (a bad launch configuration) do
    not.  Only a new round trip through the device tells the two apart."""
    cuda_error = isinstance(error, getattr(torch, "AcceleratorError", RuntimeError)) or "CUDA error" in str(error)
    if device.type != "cuda" or not cuda_error:
        return False
    try:
        torch.cuda.synchronize(device)
        torch.zeros(1, device=device).add_(1).item()
    except Exception:  # noqa: BLE001 - whatever the broken context raises
        return True
    return False


def event_on(stream: Stream):
    """A CUDA event recorded now on ``stream``'s CUDA stream; None on CPU (threads order it)."""
    if stream.cuda is None:
        return None
    event = torch.cuda.Event()
    event.record(stream.cuda)
    return event


def unseal(args, kwargs):
    """Arguments as sent: a tuple (aten ops), or pickled bytes (user functions, see sealed_args)."""
    if type(args) is bytes:
        return pickle.loads(args)
    return args, kwargs


def to_fetchable(leaf):
    """Tensors travel to the client on CPU, carrying only their own elements (a DTensor: its local shard)."""
    if isinstance(leaf, torch.Tensor):
        leaf = plain_tensor(leaf).detach()
        if leaf.device.type == "meta":
            raise ValueError(f"a meta tensor ({list(leaf.shape)}, {leaf.dtype}) has no data to fetch")
        if leaf.device.type != "cpu":
            leaf = leaf.cpu()
        return pack_tensor(leaf)
    return leaf


def held_results(value, expect: tuple, function):
    """A remote function's results as the worker holds them (``codec.plain_tensor``: a collective's result
    waited for, a DTensor's local shard), each checked against what the client's propagation described
    (``expect``: shape, dtype and layout per result).  A result that differs would give the client's proxy another
    shape or dtype than the worker's value: every later op planned on it would be wrong without an error."""
    leaves: tuple | list
    if type(value) is tuple and all(type(leaf) is torch.Tensor for leaf in value):
        leaves = value  # a flat tuple of plain tensors (a backward's new gradients): its own leaves
    else:
        leaves, spec = tree_flatten(value)
        if any(isinstance(leaf, torch.Tensor) and type(leaf) is not torch.Tensor for leaf in leaves):
            leaves = [plain_tensor(leaf, "a result") if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
            value = tree_unflatten(leaves, spec)
    if not expect or len(leaves) != len(expect):  # a count that differs: bind_results says so
        return value
    for i, (leaf, want) in enumerate(zip(leaves, expect)):
        if want is None:
            continue
        if want == m.OPAQUE:  # an OpaqueRef the client holds a handle of: the box is bound to its ref
            if type(leaf) is not Resident:
                raise TypeError(f"result {i} of {_name(function)} is a {type(leaf).__name__}, where its propagation "
                                f"described an OpaqueRef: return tdmesh.OpaqueRef(obj) there")
            continue
        if type(leaf) is Resident:
            raise TypeError(f"result {i} of {_name(function)} is an OpaqueRef, where its propagation described a "
                            f"tensor: describe it as OpaqueRef(None) in the propagate function")
        shape, dtype, layout = want
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"result {i} of {_name(function)} is a {type(leaf).__name__}, where its propagation "
                            f"described a tensor of shape {list(shape)} ({dtype})")
        if leaf.is_nested or leaf.is_quantized or leaf.is_meta:
            kind = "nested" if leaf.is_nested else "quantized" if leaf.is_quantized else "meta"
            raise TypeError(f"result {i} of {_name(function)} is a {kind} tensor, which a mesh tensor cannot hold "
                            f"(dense and sparse tensors with data): convert it in the function (to_padded_tensor(), "
                            f"dequantize()), or return it by value with call_on_shard_and_fetch")
        got = (tuple(leaf.shape), _short_name(leaf.dtype), _short_name(leaf.layout))
        if got != (tuple(shape), dtype, layout):
            raise TypeError(f"result {i} of {_name(function)} is a {got[2]} tensor of shape {list(got[0])} ({got[1]}),"
                            f" where its propagation described a {layout} one of shape {list(shape)} ({dtype}): fix "
                            f"the propagate function (or what the function returns), else the client's view of the "
                            f"value would not be the worker's")
    return value


_SHORT_NAMES: dict = {}


def _short_name(kind) -> str:
    """``torch.float32`` -> ``"float32"`` (a dtype's or layout's name as the client's propagation writes it), once."""
    name = _SHORT_NAMES.get(kind)
    if name is None:
        name = _SHORT_NAMES[kind] = str(kind).split(".")[1]
    return name


def _name(function) -> str:
    return function if isinstance(function, str) else "the remote function"


def bind_results(env: dict, results: tuple, value, function=None) -> None:
    """Bind what an op or function returned to its result refs: a tensor to the one ref, else the
    value's pytree leaves in order (None refs bind nothing); a count that differs is a TypeError."""
    if not results:  # the client asked for no results (propagate="inspect")
        return
    if len(results) == 1 and isinstance(value, torch.Tensor):
        if results[0] is not None:
            env[results[0]] = value
        return
    if isinstance(value, (tuple, list)) and len(value) == len(results) and \
            all(isinstance(leaf, torch.Tensor) for leaf in value):
        leaves = value  # a flat tuple or list of tensors (layer_norm, split, foreach ops): no pytree walk
    else:
        leaves = tree_leaves(value)
        if len(leaves) != len(results):
            name = function if isinstance(function, str) else "function"
            raise TypeError(f"{name} returned {len(leaves)} values where the client expected {len(results)}")
    for ref, leaf in zip(results, leaves):
        if ref is not None:
            env[ref] = leaf

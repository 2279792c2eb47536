"""Value encodings both sides share: a dense CPU tensor as raw bytes (``PackedTensor``), the
metadata a worker reports of a tensor whose shape only its data decides, and a callable
pickled by value with the file its code came from.

Kept apart from :mod:`tdmesh.protocol.messages` (the protocol's records) so that file stays the list
of what travels; workers may import this module (see tests/unit/test_layout.py)."""

from __future__ import annotations

import pickle

from .messages import PackedTensor

__all__ = ["plain_tensor", "UnheldTensor", "pack_tensor", "unpack_tensor", "describe_tensor", "with_source",
           "load_callable", "pickle_value", "unpickle_value"]


class UnheldTensor(TypeError):
    """A tensor subclass a worker can neither hold as a mesh tensor's value nor send: it names the way out."""


def plain_tensor(t, what: str = "the value"):
    """``t`` as the tensor a worker holds or sends: a functional collective's result waited for, a DTensor's
    local shard (``to_local()``: the value this rank holds, as a mesh tensor is each rank's own value; a
    remote function returns ``t.full_tensor()`` for the whole), a subclass that owns its memory (a
    ``Parameter``, a user's subclass) as it is.  A wrapper subclass of any other kind owns no memory, and
    packing ``data_ptr()`` of one crashed the worker (SIGSEGV): it is refused, naming the type."""
    import torch
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    for _ in range(8):  # a DTensor's local shard may itself be a collective's pending result
        if type(t) is torch.Tensor or not isinstance(t, torch.Tensor) or not is_traceable_wrapper_subclass(t):
            return t
        kind = type(t).__name__
        if kind == "AsyncCollectiveTensor":
            t = t.trigger_wait()
        elif kind == "DTensor":
            t = t.to_local()
        else:
            raise UnheldTensor(f"{what} is a {type(t).__module__}.{kind}, a tensor subclass that owns no memory "
                               f"of its own: tdmesh holds and sends plain tensors; return a plain tensor from the "
                               f"remote function (for example the subclass's inner tensor)")
    return t


def pack_tensor(t):
    """``t`` (detached, on CPU) as a PackedTensor, or ``t`` itself for layouts bytes can't carry.

    Its ``data`` is a ``pickle.PickleBuffer`` over the tensor's own memory (which it keeps
    alive), so that no copy is made of it before it is sent: with protocol 5 a small one is
    written into the pickle straight from that memory (a bytearray on the other side), a big one
    is left out of the pickle (:func:`pickle_value`) and sent from that memory (:mod:`tdmesh.protocol.bulk`).
    A fetch of a big tensor was bound by such copies (each ~36 ms per 64 MiB on a 2-core VM)."""
    import ctypes

    import torch
    if t.layout is not torch.strided or t.is_quantized or t.is_nested or t.requires_grad:
        return t
    t = t.resolve_conj().resolve_neg().contiguous()  # the bytes must hold the values, not a lazy view of them
    nbytes = t.numel() * t.element_size()
    data: object = bytearray()
    if nbytes:
        memory = (ctypes.c_char * nbytes).from_address(t.data_ptr())
        memory.tensor = t  # the buffer outlives any temporary copy above
        data = pickle.PickleBuffer(memory)
    return PackedTensor(str(t.dtype).split(".")[1], tuple(t.shape), data)


_COMPRESSED_INDEX = {"sparse_csr": "crow_indices", "sparse_bsr": "crow_indices",
                     "sparse_csc": "ccol_indices", "sparse_bsc": "ccol_indices"}


def describe_tensor(t) -> tuple:
    """What a client proxy records of a worker tensor whose metadata only the data decides:
    ``(size, stride, offset, dtype)`` of a dense tensor, or the fields of the client's
    ``SparseMeta`` (structure, not indices or values) of a sparse one."""
    import torch
    layout = t.layout
    if layout is torch.strided:
        return tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype
    if layout is torch.sparse_coo:
        return tuple(t.shape), layout, t.dtype, t._nnz(), t.dense_dim(), t._indices().dtype, (), t.is_coalesced()
    index = _COMPRESSED_INDEX.get(str(layout).split(".")[1])
    if index is None:
        raise NotImplementedError(f"tdmesh has no remote form for {layout} tensors")
    blocksize = ()
    if layout in (torch.sparse_bsr, torch.sparse_bsc):
        shape = t.values().shape
        blocksize = tuple(shape[len(shape) - t.dense_dim() - 2:len(shape) - t.dense_dim()])
    return tuple(t.shape), layout, t.dtype, t._nnz(), t.dense_dim(), getattr(t, index)().dtype, blocksize, False


def unpack_tensor(p: PackedTensor):
    """The tensor of ``p``, over the memory ``p`` arrived in (no copy): the bytearray of a
    PackedTensor pickled in band, or the writable view of the bulk frame its bytes came in
    (:func:`pickle_value`).  Anything else (a PickleBuffer never sent) is copied."""
    import torch
    dtype = getattr(torch, p.dtype)
    data = p.data
    if not (type(data) is bytearray or (type(data) is memoryview and not data.readonly)):
        data = bytearray(data)
    if not data:
        return torch.empty(p.shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).reshape(p.shape)


def pickle_value(value):
    """A fetched value as a FetchResult carries it: its pickle, or ``(pickle, buffer, ...)``
    with the bytes of its big tensors left out of the pickle, for the transport to send from
    the tensors' memory in a bulk frame (:func:`tdmesh.protocol.bulk.frame_parts`) and the client to
    read in place."""
    from .bulk import big_buffers_into
    buffers: list = []
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=big_buffers_into(buffers))
    return (data, *buffers) if buffers else data


def unpickle_value(wire):
    """The value of :func:`pickle_value`'s wire form (its PackedTensors still packed)."""
    if type(wire) is tuple:
        return pickle.loads(wire[0], buffers=wire[1:])
    return pickle.loads(wire)


_SOURCE = "tdmesh: a callable and the file of its code"


def with_source(payload: bytes, filename: str | None) -> bytes:
    """A cloudpickled callable, with the file its code came from.  cloudpickle >= 3.1 names the
    code of every function it pickles by value ``<dynamic-code>``, so a worker's tracebacks and
    pdb would show no source line of the user's script; :func:`load_callable` puts the name back."""
    return payload if not filename else pickle.dumps((_SOURCE, filename, payload), protocol=pickle.HIGHEST_PROTOCOL)


def load_callable(data: bytes):
    """The callable of pickled ``data`` (see :func:`with_source`); cloudpickle must be importable."""
    obj = pickle.loads(data)
    if type(obj) is tuple and len(obj) == 3 and obj[0] == _SOURCE:
        _, filename, payload = obj
        obj = pickle.loads(payload)
        _name_source(obj, filename)
    return obj


def _name_source(obj, filename: str) -> None:
    import types
    for fn in _functions_of(obj):
        if isinstance(fn, types.FunctionType):
            fn.__code__ = _renamed(fn.__code__, filename)


def _functions_of(obj) -> list:
    if not isinstance(obj, type):
        return [obj]
    found = []
    for value in vars(obj).values():  # a class: its methods, static and class methods, properties
        value = getattr(value, "__func__", value)
        found.extend([value.fget, value.fset, value.fdel] if isinstance(value, property) else [value])
    return found


def _renamed(code, filename: str):
    import types
    if code.co_filename != "<dynamic-code>":
        return code
    consts = tuple(_renamed(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)

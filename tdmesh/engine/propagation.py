"""Output metadata of an op without running it: shapes, strides, dtypes and aliasing.

Ops on CPU workers run on fake CPU tensors: torch's fake tensors take the device's own
decisions where its kernels differ from the meta device's (a convolution's output memory
format, FFT and ``linalg.eig`` strides, batch norm's saved statistics), so a proxy's strides
are the ones the worker's tensor has.  The meta device gave a channels-last convolution a
contiguous proxy: composite ops then took other paths than local torch (``linear`` on a
"non-contiguous" input: ``matmul`` + ``add`` instead of ``addmm``, results a rounding apart),
and code that trusts strides (``as_strided``) read other elements than the worker holds.
Other devices' ops run on the meta device (fake tensors where a meta kernel is missing).
The answer is cached by the op, its arguments' metadata and the device type: a training
loop repeats the same few hundred (op, shapes) pairs, so after the first step propagation
is a dict lookup.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, NamedTuple

import torch
from torch.utils._mode_utils import no_dispatch
from torch.utils._pytree import tree_flatten, tree_map

from ..protocol.codec import describe_tensor
from .kernel_layouts import corrected, extent

_META = torch.device("meta")


class TensorMeta(NamedTuple):
    size: tuple
    stride: tuple
    offset: int
    dtype: torch.dtype


class SparseMeta(NamedTuple):
    """What the client knows of a remote sparse tensor (COO, CSR, CSC, BSR, BSC): its
    structure, without its indices or values.  Sparse proxies stand on a meta tensor of
    exactly this structure (see :func:`meta_tensor`)."""
    size: tuple
    layout: torch.layout
    dtype: torch.dtype
    nnz: int
    dense_dim: int
    index_dtype: torch.dtype
    blocksize: tuple             # (rows, cols) of a BSR/BSC block, else ()
    coalesced: bool              # COO only: whether the indices are known to be unique and sorted


class OpAliasing(NamedTuple):
    """From the op schema: which arguments it writes, and which argument each return aliases."""
    mutated_args: tuple          # schema argument positions written in place
    return_aliases: tuple        # per return: (argument position or None, is_write, is_list)


_aliasing_cache: dict = {}


def op_aliasing(func) -> OpAliasing:
    try:
        return _aliasing_cache[func]
    except KeyError:
        pass
    schema = func._schema
    by_set: dict[str, int] = {}
    mutated: list[int] = []
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is not None:
            for s in info.before_set:
                by_set.setdefault(s, i)
            if info.is_write:
                mutated.append(i)
    returns: list[tuple[int | None, bool, bool]] = []
    for ret in schema.returns:
        info = ret.alias_info
        is_list = isinstance(ret.type, torch.ListType)
        if info is None:
            returns.append((None, False, is_list))
        else:
            source = next((by_set[s] for s in info.before_set if s in by_set), None)
            returns.append((source, info.is_write, is_list))
    result = OpAliasing(tuple(mutated), tuple(returns))
    _aliasing_cache[func] = result
    return result


def schema_arg(func, args: tuple, kwargs: dict, position: int):
    """The value bound to schema argument ``position`` in this call."""
    if position < len(args):
        return args[position]
    return kwargs.get(func._schema.arguments[position].name)


def meta_tensor(meta: TensorMeta | SparseMeta) -> torch.Tensor:
    """An empty meta tensor with exactly this size, stride and storage offset (or this
    sparse structure), made here whatever mesh is active: a remote call's propagation makes its
    stand-ins at the user's level, where the active mesh's modes would otherwise send these
    factories to the workers (twice a tensor: ``empty``, ``as_strided``) and hand back proxies."""
    with no_dispatch(), torch._C.DisableTorchFunction():
        if isinstance(meta, SparseMeta):
            return _sparse_meta_tensor(meta)
        size, stride, offset, dtype = meta
        base = torch.empty((extent(size, stride, offset),), dtype=dtype, device=_META)
        return base.as_strided(size, stride, offset)


def tensor_meta(t: torch.Tensor) -> TensorMeta | SparseMeta:
    """``t``'s metadata, read with torch functions off: at the user's level each property read would
    otherwise be a round trip through the active mesh's torch-function mode (~2.5 us each)."""
    with torch._C.DisableTorchFunction():
        if t.layout is not torch.strided:
            return sparse_meta(t)
        return TensorMeta(tuple(t.shape), tuple(t.stride()), int(t.storage_offset()), t.dtype)


def from_description(description: tuple) -> TensorMeta | SparseMeta:
    """The metadata a worker's ``codec.describe_tensor`` sent."""
    return SparseMeta(*description) if isinstance(description[1], torch.layout) else TensorMeta(*description)


def sparse_meta(t: torch.Tensor) -> SparseMeta:
    """The structure of a sparse tensor (any device, meta included)."""
    return SparseMeta(*describe_tensor(t))


def _sparse_meta_tensor(s: SparseMeta) -> torch.Tensor:
    size, n = s.size, s.nnz
    if s.layout is torch.sparse_coo:
        sparse_dim = len(size) - s.dense_dim
        return torch.sparse_coo_tensor(torch.empty((sparse_dim, n), dtype=s.index_dtype, device=_META),
                                       torch.empty((n, *size[sparse_dim:]), dtype=s.dtype, device=_META),
                                       size, is_coalesced=s.coalesced, device=_META)
    batch = size[:len(size) - s.dense_dim - 2]
    rows, cols = size[len(batch):len(batch) + 2]
    block_rows, block_cols = s.blocksize or (1, 1)
    compressed = rows // block_rows if s.layout in (torch.sparse_csr, torch.sparse_bsr) else cols // block_cols
    return torch.sparse_compressed_tensor(
        torch.empty((*batch, compressed + 1), dtype=s.index_dtype, device=_META),
        torch.empty((*batch, n), dtype=s.index_dtype, device=_META),
        torch.empty((*batch, n, *s.blocksize, *size[len(batch) + 2:]), dtype=s.dtype, device=_META),
        size, dtype=s.dtype, layout=s.layout, device=_META)


class Propagated(NamedTuple):
    spec: Any                    # tree spec of the output
    leaves: tuple                # TensorMeta per tensor leaf, or ("value", v) for non-tensor leaves
    single: bool                 # the output is one tensor (no unflattening needed)
    sparse: bool = False         # an output is sparse: its number of elements only the data decides


_cache: dict = {}
stats = {"hits": 0, "misses": 0}


def propagate(func, args: tuple, kwargs: dict, remote: list, key, device_type: str = "meta") -> Propagated:
    """Run ``func`` on stand-ins for the ``remote`` proxies among its arguments (fake tensors
    of ``device_type`` where that is ``"cpu"``, else meta tensors); ``key`` names ``func`` and
    describes the arguments' structure, metadata and values (for the cache)."""
    if key is not None:
        key = (key, device_type)
    try:
        hit = _cache.get(key)
    except TypeError:  # an unhashable argument: propagate without caching
        key, hit = None, None
    if hit is not None:
        stats["hits"] += 1
        return hit
    stats["misses"] += 1
    leaf_metas = {id(x): x._meta for x in remote}
    _fake_modes.propagating = True  # a failure here is the user's error or the workers' question: not logged
    try:
        if device_type == "cpu" and not any(type(meta) is SparseMeta for meta in leaf_metas.values()):
            out = _run_on_device(func, args, kwargs, leaf_metas, device_type)
        else:
            out = _run_on_meta(func, args, kwargs, leaf_metas)
    finally:
        _fake_modes.propagating = False
    flat, out_spec = tree_flatten(out)
    leaves = tuple(tensor_meta(x) if isinstance(x, torch.Tensor) else ("value", x) for x in flat)
    if device_type == "cpu":
        leaves = corrected(func, op_aliasing(func), args, kwargs, lambda x: leaf_metas.get(id(x)) or tensor_meta(x),
                           leaves)
    result = Propagated(out_spec, leaves, out_spec.is_leaf() and isinstance(out, torch.Tensor),
                        any(type(leaf) is SparseMeta for leaf in leaves))
    if key is not None and len(_cache) < 100_000:
        _cache[key] = result
    return result


def warm_up() -> None:
    """Run one op on the meta device: the first one imports torch._dynamo (its Python refs
    are wrapped to disable it), ~0.8 s that the client would otherwise spend at the user's
    first op.  ``local_mesh`` calls this while its workers boot."""
    with torch._C.DisableTorchFunction():
        torch.ones(2, device=_META).add(1).sum()
    keep_dynamo_out()


_kept_out: list[bool] = [False]


def keep_dynamo_out() -> None:
    """Dynamo never traces tdmesh's own code: its files are in dynamo's skip list, so their frames run as
    plain Python.  ``torch.compile`` of a function on mesh tensors runs it under dynamo's frame hook; dynamo
    skipped the user's frame (a dispatch mode is present) but compiled the frames it called, tdmesh's
    ``dispatch`` among them, and baked in the answer of the plan cache for the first op it saw: a compiled
    ``(x @ w1.t()) @ w2.t()`` got a proxy of the first matmul's shape while the worker computed the second's
    (a silent desync).  With tdmesh skipped, such a function runs its ops as tdmesh issues them eagerly."""
    if _kept_out[0]:
        return
    try:
        import torch._dynamo.trace_rules as rules
        rules.add("tdmesh")
    except Exception:  # noqa: BLE001 - a torch without this rule table: said once, and dispatch warns
        logging.getLogger("tdmesh").warning("tdmesh could not add itself to dynamo's skip list: torch.compile "
                                            "of code on a mesh may compile tdmesh's own frames; use tdmesh.compile")
    _kept_out[0] = True


def _on_meta(value, leaf_metas: dict, device: torch.device = _META):
    """``value`` with meta stand-ins for its proxies (exactly their metadata) and its local tensors
    (data shipped to the mesh: ``torch.tensor(...)``), and ``device`` for its devices."""
    def to_meta(x):
        meta = leaf_metas.get(id(x))
        if meta is not None:
            return meta_tensor(meta)
        if isinstance(x, torch.device):
            return device
        if isinstance(x, torch.Tensor):
            return x.to(_META)
        return x

    return tree_map(to_meta, value)


def _run_on_meta(func, args, kwargs, leaf_metas):
    meta_args = _on_meta(args, leaf_metas)
    meta_kwargs = _on_meta(kwargs, leaf_metas)
    try:
        return func(*meta_args, **meta_kwargs)
    except NotImplementedError:
        return _run_on_fake(func, args, kwargs, leaf_metas)


_fake_modes = threading.local()


class _QuietWhilePropagating(logging.Filter):
    """torch's fake mode logs a traceback for every meta kernel that raises; here that is a user
    error tdmesh raises at the user's line (or a refusal the workers then settle): not logged.
    A logged record also keeps that traceback's frames, and the proxies in them, alive for as long
    as a handler keeps it (pytest's log capture: a compiled MoE step then never settled, since
    the state of its previous call still looked alive)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(_fake_modes, "propagating", False)


logging.getLogger("torch._subclasses.fake_tensor").addFilter(_QuietWhilePropagating())


def _device_mode():
    """This thread's fake mode for propagation (a mode is entered on one thread's stack; kept,
    since making one costs ~100 us).  No fallback kernels: an op without a fake or meta kernel
    goes to :func:`_run_on_fake` as before."""
    mode = getattr(_fake_modes, "mode", None)
    if mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        mode = _fake_modes.mode = FakeTensorMode(allow_non_fake_inputs=True, allow_fallback_kernels=False)
        mode.cache_enabled = False  # its process-wide dispatch cache is unbounded; ours (above) is bounded
    return mode


def _run_on_device(func, args, kwargs, leaf_metas, device_type: str):
    """``func`` on fake tensors of ``device_type``: each stands on a meta tensor of exactly its
    proxy's metadata, so nothing is allocated whatever its size."""
    from torch._subclasses.fake_tensor import FakeTensor, UnsupportedOperatorException
    mode = _device_mode()
    device = torch.device(device_type)

    def to_fake(x):  # every tensor of a stand-in value is a meta stand-in
        return FakeTensor(mode, x, device) if isinstance(x, torch.Tensor) else x

    fake_args = tree_map(to_fake, _on_meta(args, leaf_metas, device))
    fake_kwargs = tree_map(to_fake, _on_meta(kwargs, leaf_metas, device))
    try:
        with mode:
            out = func(*fake_args, **fake_kwargs)
    except (NotImplementedError, UnsupportedOperatorException):
        return _run_on_fake(func, args, kwargs, leaf_metas)
    return tree_map(lambda x: meta_tensor(tensor_meta(x)) if isinstance(x, torch.Tensor) else x, out)


def _run_on_fake(func, args, kwargs, leaf_metas):
    """Fallback for ops without a meta kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def to_fake(x):
        meta = leaf_metas.get(id(x))
        if type(meta) is SparseMeta:
            raise NotImplementedError("no fake sparse inputs")
        if meta is not None:
            return mode.from_tensor(torch.empty_strided(meta.size, meta.stride, dtype=meta.dtype))
        return x

    with mode:
        out = func(*tree_map(to_fake, args), **tree_map(to_fake, kwargs))
    return tree_map(lambda x: meta_tensor(tensor_meta(x)) if isinstance(x, torch.Tensor) else x, out)

"""Output layouts of CPU kernels that torch's fake kernels do not reproduce.

CPU meshes propagate on fake CPU tensors, which take most of the CPU kernels' decisions but not
all: torch's elementwise references lack ``TensorIterator``'s rule that an output is contiguous
when every input is (so a channels-last ``(N, C, 1, 1)`` input, contiguous too, kept its size-1
strides on the client and lost them on the worker), and its batch norm fakes keep the input's
strides where the CPU kernel picks a memory format.  Size-1 strides decide ``suggest_memory_format``,
so autograd's formulas and recorded programs on the client then chose other paths than local
torch.  Two answers, checked against the CPU kernels by ``tests/unit/test_kernel_layouts.py``:

- where an input is not plainly contiguous, the kernel is asked: it runs on zeros laid out as the
  inputs, shrunk to 2 elements a dim for elementwise ops (at any size), as they are for others
  (small inputs only); once per (op, metadata) pair, as propagation is cached;
- batch norm's rules (``batch_norm_cpu_transform_input_template`` and
  ``batch_norm_backward_cpu_template`` in ATen), at any size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._mode_utils import no_dispatch
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["corrected", "extent"]

# A dense tensor's metadata is propagation's ``TensorMeta`` (size, stride, offset, dtype), read and
# remade here by its fields (``_replace``): propagation imports this module, not the other way.
Meta = Any


def _dense(meta) -> bool:
    """A dense tensor's metadata (not a sparse structure, not a non-tensor output)."""
    return hasattr(meta, "stride") and hasattr(meta, "offset")


_CHANNELS_LAST = {4: (torch.channels_last, (1, 3, 2, 0)), 5: (torch.channels_last_3d, (1, 4, 3, 2, 0))}


def _strides_like_channels_last(size: tuple, stride: tuple) -> bool:
    """c10's ``is_channels_last_strides_{2,3}d``: the channels dim innermost, then the spatial dims
    from the last, then the batch dim, with its tie-breaks for size-1 dims."""
    order = _CHANNELS_LAST[len(size)][1]
    lowest = 0
    if stride[1] == 0:
        return False
    for d in order:
        if size[d] == 0 or stride[d] < lowest:
            return False
        if d == 0 and lowest == stride[1]:
            return False
        lowest = stride[d] * (size[d] if size[d] > 1 else 1)
    return True


def _suggested(meta: Meta) -> torch.memory_format:
    """c10's ``Tensor::suggest_memory_format()``."""
    if len(meta.size) in _CHANNELS_LAST and _strides_like_channels_last(meta.size, meta.stride):
        return _CHANNELS_LAST[len(meta.size)][0]
    return torch.contiguous_format


def _is_contiguous(meta: Meta, memory_format: torch.memory_format) -> bool:
    """Whether strides are the dense ones of ``memory_format`` (size-1 dims' strides ignored, as torch does)."""
    order = (range(len(meta.size) - 1, -1, -1) if memory_format is torch.contiguous_format
             else _CHANNELS_LAST[len(meta.size)][1])
    expected = 1
    for d in order:
        if meta.size[d] != 1 and meta.stride[d] != expected:
            return False
        expected *= meta.size[d]
    return True


def _dense_format(meta: Meta) -> torch.memory_format | None:
    """``contiguous_format`` or the channels-last format ``meta`` is dense in (contiguous first, as
    the kernels test it), else None."""
    if _is_contiguous(meta, torch.contiguous_format):
        return torch.contiguous_format
    fmt = _CHANNELS_LAST.get(len(meta.size))
    if fmt is not None and _is_contiguous(meta, fmt[0]):
        return fmt[0]
    return None


def _batch_norm(input_: Meta, weight: Meta | None, bias: Meta | None) -> torch.memory_format:
    dense = _dense_format(input_)
    params = all(p is None or _is_contiguous(p, torch.contiguous_format) for p in (weight, bias))
    return dense if dense is not None and params else _suggested(input_)


def _batch_norm_backward(grad: Meta, input_: Meta) -> torch.memory_format:
    dense = _dense_format(input_)
    if dense is not None and _dense_format(grad) is not None and _suggested(input_) == _suggested(grad):
        return dense
    return _suggested(input_)


# op -> (the rule, the positions of the tensor arguments it reads, the index among them of the one
# whose shape output 0 has); output 0 takes the rule's memory format
_FORWARD: tuple[Callable[..., torch.memory_format], tuple[int, ...], int] = (_batch_norm, (0, 1, 2), 0)
_BACKWARD: tuple[Callable[..., torch.memory_format], tuple[int, ...], int] = (_batch_norm_backward, (0, 1), 1)
_RULES = {
    "aten::native_batch_norm": _FORWARD,
    "aten::_native_batch_norm_legit": _FORWARD,
    "aten::_native_batch_norm_legit_no_training": _FORWARD,
    "aten::_native_batch_norm_legit_functional": _FORWARD,
    "aten::_batch_norm_with_update": _FORWARD,
    "aten::_batch_norm_with_update_functional": _FORWARD,
    "aten::_batch_norm_no_update": _FORWARD,
    "aten::native_batch_norm_backward": _BACKWARD,
    "aten::batch_norm_backward": _BACKWARD,
}


def corrected(func, aliasing, args: tuple, kwargs: dict, metas, leaves: tuple) -> tuple:
    """``leaves`` (the propagated outputs' metadata on a CPU mesh) laid out as the CPU kernel lays
    them out, where torch's fake kernels may not: where an input is not plainly contiguous the
    kernel itself is asked (:func:`_probed`); else a batch norm's output follows the rules above,
    at any size.  ``metas(x)`` gives an argument's metadata (a proxy's or a local tensor's)."""
    if not leaves:
        return leaves
    probed = _probed(func, aliasing, args, kwargs, metas, leaves)
    if probed is not None:
        return probed
    rule = _RULES.get(func._schema.name)
    if rule is None or not _dense(leaves[0]):
        return leaves
    fn, positions, shaped_like = rule
    inputs = [metas(args[i]) if i < len(args) and args[i] is not None else None for i in positions]
    reference = inputs[shaped_like]
    if any(m is not None and not _dense(m) for m in inputs) or inputs[0] is None \
            or reference is None or leaves[0].size != reference.size:
        return leaves
    out = leaves[0]
    with torch._C.DisableTorchFunction():
        stride = torch.empty(out.size, device="meta", memory_format=fn(*inputs)).stride()
    return (out._replace(stride=tuple(stride), offset=0), *leaves[1:])


# inputs up to this many elements in all are run by the CPU kernel where a layout is ambiguous (once
# per (op, metadata) pair: propagation is cached); elementwise ops run on a shrunk copy at any size
_PROBE_ELEMENTS = 1 << 16
_UNPROBED_TAGS = (torch.Tag.nondeterministic_seeded, torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)
_SCALARS = (int, float, bool, complex, str, torch.dtype, torch.memory_format, type(None))


def _probed(func, aliasing, args: tuple, kwargs: dict, metas, leaves: tuple) -> tuple | None:
    """The outputs' metadata from the CPU kernel run on zeros laid out as the inputs, where an input
    is not plainly contiguous (a size-1 dim's stride is free, and torch's fakes and the CPU kernels
    choose it otherwise: ``TensorIterator`` makes an output contiguous when every input is
    contiguous, the fakes keep a channels-last input's size-1 strides; a permuted or gapped input's
    output follows the kernel's own rule); else None.  An elementwise-looking op (tensors that
    broadcast to its outputs' shape, scalar arguments) runs first on its inputs shrunk to at most 2
    elements a dim in the same dim order (:func:`_shrunk`), at any size; then, or else, the inputs
    as they are where they are small.  Never for an op that writes an argument, returns a view,
    draws random numbers or has a data-dependent shape."""
    if func.namespace != "aten" or any(tag in func.tags for tag in _UNPROBED_TAGS):
        return None
    if aliasing.mutated_args or any(source is not None for source, _, _ in aliasing.return_aliases):
        return None
    flat, spec = tree_flatten((args, kwargs))
    inputs = {i: metas(x) for i, x in enumerate(flat) if isinstance(x, torch.Tensor) or hasattr(x, "_meta")}
    if not all(_dense(m) for m in inputs.values()) or all(_unambiguous(m) for m in inputs.values()):
        return None
    shape = leaves[0].size if _dense(leaves[0]) else None
    attempts = []  # (stand-ins, whether they are shrunk)
    if shape is not None and all(_dense(leaf) and leaf.size == shape for leaf in leaves) \
            and all(isinstance(x, _SCALARS) for i, x in enumerate(flat) if i not in inputs) \
            and all(_broadcasts(m.size, shape) for m in inputs.values()):
        shrunk = {i: _shrunk(m) for i, m in inputs.items()}
        if all(v is not None for v in shrunk.values()):
            attempts.append((shrunk, True))
    if sum(extent(m.size, m.stride, m.offset) for m in inputs.values()) <= _PROBE_ELEMENTS:
        attempts.append(({i: (m.size, m.stride, m.offset) for i, m in inputs.items()}, False))
    for stand_ins, shrunk_ in attempts:
        real = _run(func, flat, spec, inputs, stand_ins)
        fixed = _laid_out_as(real, leaves, shrunk_) if real is not None and len(real) == len(leaves) else None
        if fixed is not None:
            return fixed
    return None


def _run(func, flat: list, spec, inputs: dict, stand_ins: dict) -> list | None:
    """``func``'s flat outputs on zeros of the stand-ins' layouts, or None where the kernel refuses them."""
    flat = list(flat)
    try:
        with no_dispatch(), torch._C.DisableTorchFunction():
            for i, (size, stride, offset) in stand_ins.items():
                flat[i] = torch.zeros(extent(size, stride, offset), dtype=inputs[i].dtype).as_strided(
                    size, stride, offset)
            real_args, real_kwargs = tree_unflatten(flat, spec)
            return tree_flatten(func(*real_args, **real_kwargs))[0]
    except Exception:  # noqa: BLE001 - zeros or a shrunk shape the kernel refuses: the next attempt, or the fakes
        return None


def _laid_out_as(real: list, leaves: tuple, grown: bool) -> tuple | None:
    """``leaves`` with the strides of the kernel's outputs (``grown`` from a shrunk run to their sizes)."""
    fixed = []
    for got, leaf in zip(real, leaves):
        if _dense(leaf) and isinstance(got, torch.Tensor) and got.layout is torch.strided \
                and got.dtype == leaf.dtype:
            stride = _grown(leaf.size, tuple(got.shape), tuple(got.stride())) if grown else \
                (tuple(got.stride()) if tuple(got.shape) == leaf.size else None)
            if stride is None:
                return None
            leaf = leaf._replace(stride=stride, offset=0 if grown else int(got.storage_offset()))
        fixed.append(leaf)
    return tuple(fixed)


def _unambiguous(meta: Meta) -> bool:
    """Contiguous, without size-1 dims: every kernel's output layout is then the fakes' (OpInfo's
    samples as given: no proxy apart)."""
    return 1 not in meta.size and _is_contiguous(meta, torch.contiguous_format)


def _broadcasts(size: tuple, shape: tuple) -> bool:
    return len(size) <= len(shape) and all(n in (1, m) for n, m in zip(reversed(size), reversed(shape)))


def _dense_order(size: tuple, stride: tuple) -> list | None:
    """The dims of size > 1 and nonzero stride from the innermost out, where those dims are laid out
    densely among themselves (a contiguous, permuted or expanded tensor); else None."""
    order = sorted((d for d, n in enumerate(size) if n > 1 and stride[d] != 0), key=lambda d: stride[d])
    expected = 1
    for d in order:
        if stride[d] != expected:
            return None
        expected *= size[d]
    return order


def _shrunk(meta: Meta) -> tuple | None:
    """(size, stride, offset) of a tensor of at most 2 elements a dim laid out as ``meta`` is: its
    dims in the same order, its expanded dims expanded, each size-1 dim's stride the same product
    of inner dims; None where ``meta`` is not such a layout (gaps between its elements)."""
    if 0 in meta.size:
        return None
    order = _dense_order(meta.size, meta.stride)
    if order is None:
        return None
    size = tuple(min(n, 2) for n in meta.size)
    inner = {1: 1}  # a stride of the big layout -> the shrunk one (products of the dims inner to it)
    big = small = 1
    for d in order:
        big, small = big * meta.size[d], small * 2
        inner[big] = small
    stride = []
    for d, n in enumerate(meta.size):
        if meta.stride[d] == 0 and n > 1:
            stride.append(0)
        elif meta.stride[d] in inner:  # every dim of the order; a size-1 dim placed between them
            stride.append(inner[meta.stride[d]])
        else:
            return None  # a size-1 dim with a stride no product of inner dims: none to mirror
    return size, tuple(stride), 0


def _grown(size: tuple, small_size: tuple, small_stride: tuple) -> tuple | None:
    """The strides of a dense tensor of ``size`` laid out as the shrunk kernel output is; None where
    that output is not dense."""
    order = _dense_order(small_size, small_stride)
    if order is None or 0 in small_stride or small_size != tuple(min(n, 2) for n in size):
        return None
    grown = {1: 1}
    big = small = 1
    for d in order:
        big, small = big * size[d], small * 2
        grown[small] = big
    if any(s not in grown for s in small_stride):
        return None
    return tuple(grown[s] for s in small_stride)  # a dim's shrunk stride names the dims inner to it


def extent(size: tuple, stride: tuple, offset: int) -> int:
    """The elements of storage a strided layout spans (its offset included)."""
    return offset + (1 + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else 0)

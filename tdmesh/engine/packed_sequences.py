"""Packed sequences (``torch.nn.utils.rnn``) on a mesh: the calls whose kernels read ``batch_sizes`` on the host.

torch keeps a ``PackedSequence``'s ``batch_sizes`` on the CPU and its C++ reads them directly: an RNN over a
packed sequence (``_VF.lstm``, ``gru``, ``rnn_tanh``, ``rnn_relu`` given ``batch_sizes``) and
``_pad_packed_sequence`` (``pad_packed_sequence``).  On a mesh ``batch_sizes`` is the workers' tensor (made
by ``_pack_padded_sequence`` there), so those kernels failed reading a proxy's memory ("its data is not
allocated yet").  The mesh's torch-function mode sends these calls here: their ``batch_sizes`` are read
once from every rank, which must agree (one round trip, as ``tensor_split``'s indices are), and

- an RNN gets them as a local CPU tensor: torch's own composite then issues the per-step ops (or cuDNN's
  one op) on the mesh;
- ``_pad_packed_sequence``'s composite makes its output with ``data.options()``, a local tensor, and copies
  the proxies into it: it runs here as the same copies into a mesh tensor (steps of one batch size
  together, as torch groups them), the lengths worked out from the batch sizes on the host and made on
  the mesh's CPU, as torch returns them on the CPU.  The copies carry autograd, as torch's do.

CPU meshes only: on a CUDA mesh (one H200 worker, the twenty-eighth session) the tests of both failed, one
with a local tensor meeting the mesh's in ``aten.where`` (the cuDNN path), the cause not yet found, so there
they are refused at the user's line with the ways out.
"""

from __future__ import annotations

import torch
from torch.utils._mode_utils import no_dispatch

from ..errors import user_line
from .tensor import Tensor
from .unshaped import host_values

__all__ = ["SPECIAL"]


def _sizes_of(func, args) -> list | None:
    sizes = args[1] if len(args) > 1 else None
    if type(sizes) is not Tensor or sizes.dtype is not torch.int64 or sizes.dim() != 1:
        return None  # not the packed overload (gru's and the rnns' second argument may be hx)
    data = args[0]
    if type(data) is Tensor and data.device.type != "cpu":
        raise NotImplementedError(
            f"{func.__name__} of a packed sequence on a {data.device.type} mesh: not supported yet (on an H200 "
            f"worker the tests of an RNN over a PackedSequence and of pad_packed_sequence failed); pad the "
            f"batch instead (nn.utils.rnn.pad_sequence), run the RNN on it and mask the padding, or run it on "
            f"a CPU mesh\n  at {user_line()}")
    return host_values(sizes, "a packed sequence's batch_sizes")


def _rnn(func, args, kwargs):
    counts = _sizes_of(func, args)
    if counts is None:
        return NotImplemented
    return func(args[0], _local(counts), *args[2:], **kwargs)


def _local(counts: list) -> torch.Tensor:
    """A local CPU tensor of ``counts`` (the mesh's dispatch mode would make a proxy of Python data)."""
    with no_dispatch():
        return torch.tensor(counts, dtype=torch.int64, device="cpu")


def _pad_packed(func, args, kwargs):
    counts = _sizes_of(func, args)
    if counts is None:
        return NotImplemented
    names = ("data", "batch_sizes", "batch_first", "padding_value", "total_length")
    params = dict(zip(names, args)) | kwargs
    data, batch_first = params["data"], params["batch_first"]
    padding_value, total_length = params["padding_value"], params["total_length"]
    steps = len(counts)
    if total_length != -1:
        if total_length < steps:  # torch's check, in its words
            raise RuntimeError(f"Expected total_length to be at least the length of the longest sequence in "
                               f"input, but got total_length={total_length} and max sequence length being {steps}")
        steps = total_length
    batch = counts[0] if counts else 0
    out = data.new_full((steps, batch, *data.shape[1:]), padding_value)
    offset = step = 0
    while step < len(counts):
        run = step
        while run < len(counts) and counts[run] == counts[step]:
            run += 1
        n, b = run - step, counts[step]
        out[step:run, :b] = data[offset:offset + n * b].view(n, b, *data.shape[1:])
        offset, step = offset + n * b, run
    lengths = [sum(1 for c in counts if c > k) for k in range(batch)]
    return (out.transpose(0, 1) if batch_first else out), torch.tensor(lengths, dtype=torch.int64, device="cpu")


SPECIAL = {getattr(torch._C._VariableFunctions, name): _rnn for name in ("lstm", "gru", "rnn_tanh", "rnn_relu")}
SPECIAL[torch._C._VariableFunctions._pad_packed_sequence] = _pad_packed

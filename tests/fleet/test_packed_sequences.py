"""Packed sequences on a mesh (``torch.nn.utils.rnn``, ``tdmesh/engine/packed_sequences.py``): torch's own
``pack_padded_sequence``, ``pack_sequence``, ``pad_packed_sequence`` and its RNN modules over them give local
torch's values and gradients.  Before the twenty-eighth session an RNN over a packed sequence and
``pad_packed_sequence`` failed on a mesh ("its data is not allocated yet": torch's kernels read
``batch_sizes`` on the host).  CPU meshes only: a CUDA mesh refuses them with the ways out.  Drawn by
hypothesis: the lengths (sorted or not), layout, padding, modules."""

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.utils import rnn

from tdmesh import inspect

_RNNS = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn_tanh": lambda *a, **k: nn.RNN(*a, nonlinearity="tanh", **k),
         "rnn_relu": lambda *a, **k: nn.RNN(*a, nonlinearity="relu", **k)}


def _on_mesh(values: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values.tolist(), dtype=values.dtype)


def _run(kind: str, bidirectional: bool, layers: int, padded: torch.Tensor, lengths: list, batch_first: bool,
         enforce_sorted: bool, total_length, local_module=None):
    """Pack, run the RNN, pad back, a loss and its backward: (padded output, lengths, loss, input grad,
    parameter grads); ``local_module`` given: the same parameter values on the mesh."""
    torch.manual_seed(0)
    module = _RNNS[kind](3, 4, num_layers=layers, batch_first=batch_first, bidirectional=bidirectional).double()
    if local_module is not None:
        with torch.no_grad():
            for p, q in zip(module.parameters(), local_module.parameters()):
                p.copy_(_on_mesh(q))
    x = padded.clone().requires_grad_()
    packed = rnn.pack_padded_sequence(x, lengths, batch_first=batch_first, enforce_sorted=enforce_sorted)
    out, _ = module(packed)
    padded_out, out_lengths = rnn.pad_packed_sequence(out, batch_first=batch_first, padding_value=-2.5,
                                                      total_length=total_length)
    loss = (padded_out * padded_out.cos()).sum()
    loss.backward()
    return module, (padded_out, out_lengths, loss, x.grad, *[p.grad for p in module.parameters()])


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(sorted(_RNNS)), bidirectional=st.booleans(), layers=st.integers(1, 2),
       lengths=st.lists(st.integers(1, 5), min_size=1, max_size=4), batch_first=st.booleans(),
       sort=st.booleans(), extra=st.integers(0, 2), seed=st.integers(0, 1000))
def test_rnns_over_packed_sequences_match_local_torch(mesh1, kind, bidirectional, layers, lengths, batch_first,
                                                       sort, extra, seed):
    if sort:
        lengths = sorted(lengths, reverse=True)
    steps = max(lengths)
    g = torch.Generator().manual_seed(seed)
    padded = torch.randn(len(lengths), steps, 3, generator=g, dtype=torch.float64)
    if not batch_first:
        padded = padded.transpose(0, 1).contiguous()
    total_length = steps + extra if extra else None
    local_module, want = _run(kind, bidirectional, layers, padded, lengths, batch_first, sort, total_length)
    if mesh1.device_type != "cpu":  # refused there, with the ways out (packed_sequences.py)
        with mesh1.activate(), pytest.raises(NotImplementedError, match="packed sequence on a cuda mesh"):
            _run(kind, bidirectional, layers, _on_mesh(padded), lengths, batch_first, sort, total_length)
        return
    with mesh1.activate():
        _, got = _run(kind, bidirectional, layers, _on_mesh(padded), lengths, batch_first, sort, total_length,
                      local_module)
        got = [inspect(v) for v in got]
    for g_, w in zip(got, want):
        torch.testing.assert_close(g_, w, rtol=1e-12, atol=1e-12)


def test_pack_sequence_and_pad_packed_sequence_round_trip(mesh1):
    local = [torch.arange(5.0) + 10 * i for i in range(3)]
    local = [local[0][:2], local[1], local[2][:4]]
    want_padded, want_lengths = rnn.pad_packed_sequence(rnn.pack_sequence(local, enforce_sorted=False),
                                                        batch_first=True)
    if mesh1.device_type != "cpu":  # refused there, with the ways out (packed_sequences.py)
        with mesh1.activate(), pytest.raises(NotImplementedError, match="packed sequence on a cuda mesh"):
            rnn.pad_packed_sequence(rnn.pack_sequence([_on_mesh(t) for t in local], enforce_sorted=False))
        return
    with mesh1.activate():
        seqs = [_on_mesh(t) for t in local]
        padded, lengths = rnn.pad_packed_sequence(rnn.pack_sequence(seqs, enforce_sorted=False), batch_first=True)
        assert lengths.device.type == "cpu"  # as torch returns them
        got = inspect(padded), inspect(lengths)
    assert torch.equal(got[0], want_padded) and torch.equal(got[1], want_lengths)

"""``tdmesh.worker.checkpoint_reader.DirectReader`` against torch's own ``FileSystemReader``:
for any state dict that ``torch.distributed.checkpoint`` saves (dtypes, shapes, views, scalars,
empty tensors, plain values) and any target layout, the in-place reader loads exactly what
DCP's loads, and reads the plain records in place (not through DCP's path)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

import tdmesh.worker.checkpoint_reader as reader
from tdmesh.worker.checkpoint_reader import DirectReader

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.int64, torch.bool,
          torch.complex64, torch.uint8]


def _value(data, dtype, shape):
    if dtype is torch.complex64:
        t = torch.randn(shape, dtype=dtype)
    elif dtype is torch.bool:
        t = torch.randn(shape) > 0
    else:
        t = (torch.randn(shape, dtype=torch.float64) * 50).to(dtype)
    view = data.draw(st.sampled_from(["whole", "slice", "transposed"]))
    if view == "slice" and t.dim() and t.shape[0] > 1:
        return t[1:]
    if view == "transposed" and t.dim() >= 2:
        return t.transpose(0, 1)
    return t


def _target(data, like: torch.Tensor) -> torch.Tensor:
    if data.draw(st.booleans()) and like.dim() == 2:  # a transposed target: not contiguous
        return torch.zeros(like.shape[::-1], dtype=like.dtype).t()
    return torch.zeros(like.shape, dtype=like.dtype)


def _load(reader_type, state, path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is not initialized: a single process"
        dcp.load(state, storage_reader=reader_type(path))


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_the_in_place_reader_loads_what_dcps_own_reader_loads(data, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt"))
    shapes = st.lists(st.integers(0, 5), max_size=3).map(tuple)
    saved: dict = {f"t{i}": _value(data, data.draw(st.sampled_from(DTYPES)), data.draw(shapes))
                   for i in range(data.draw(st.integers(1, 6)))}
    saved["step"] = data.draw(st.integers())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(saved, checkpoint_id=path)
    ours = {k: _target(data, v) if isinstance(v, torch.Tensor) else 0 for k, v in saved.items()}
    theirs = {k: v.clone() if isinstance(v, torch.Tensor) else 0 for k, v in ours.items()}
    _load(DirectReader, ours, path)
    _load(dcp.FileSystemReader, theirs, path)
    for k, v in saved.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(ours[k], theirs[k]) and torch.equal(ours[k], v), k
        else:
            assert ours[k] == theirs[k] == v


def test_plain_records_are_read_in_place_and_the_rest_through_dcp(tmp_path, monkeypatch):
    read_in_place = []
    original = DirectReader._read_in_place

    def counted(self, f, req, planner):
        went = original(self, f, req, planner)
        read_in_place.append((req.storage_index.fqn, went))
        return went
    monkeypatch.setattr(DirectReader, "_read_in_place", counted)
    saved = {"w": torch.randn(64, 1024), "h": torch.randn(8).half(), "empty": torch.empty(0, 3),
             "t": torch.randn(4, 5)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(saved, checkpoint_id=str(tmp_path))
    target = {"w": torch.zeros(64, 1024), "h": torch.zeros(8).half(), "empty": torch.empty(0, 3),
              "t": torch.zeros(5, 4).t()}  # a transposed target: DCP's path copies into it
    memory = target["w"].data_ptr()
    _load(DirectReader, target, str(tmp_path))
    assert dict(read_in_place) == {"w": True, "h": True, "t": False}  # (an empty tensor has nothing to read)
    assert target["w"].data_ptr() == memory and all(torch.equal(target[k], saved[k]) for k in saved)


def test_a_record_that_is_not_one_plain_tensor_goes_through_dcps_path():
    import io
    import pickle
    layout = reader._TensorLayout(io.BytesIO(pickle.dumps(print)))
    with pytest.raises(reader._NotPlain):
        layout.load()

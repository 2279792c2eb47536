"""A proxy's wrapper is made with positional arguments where this torch takes them (faster to parse)
and with keywords otherwise: both must describe the same tensor."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tdmesh.engine.tensor as tensor_module
from tdmesh.engine.propagation import TensorMeta, tensor_meta
from tdmesh.engine.stream import DEFAULT_STREAM
from tdmesh.engine.tensor import AliasSet, new_proxy


def described(t) -> tuple:
    return t.shape, t.stride(), t.storage_offset(), t.dtype, t.device, t.layout, t.requires_grad


def test_this_torch_takes_the_wrappers_arguments_by_position():
    """torch 2.11 and 2.13 do; were it to stop, proxies would be made with keywords (the probe)."""
    assert tensor_module._BY_POSITION


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=0, max_size=4), st.booleans(), st.integers(0, 3),
       st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64]))
def test_positional_and_keyword_wrappers_describe_the_same_tensor(sizes, transposed, offset, dtype):
    base = torch.empty(sizes, dtype=dtype, device="meta")
    if transposed and base.dim() >= 2:
        base = base.transpose(0, -1)
    meta = tensor_meta(torch.as_strided(base, base.shape, base.stride(), offset))
    assert isinstance(meta, TensorMeta)
    made = []
    for by_position in (True, False):
        tensor_module._BY_POSITION = by_position
        try:
            made.append(new_proxy(meta, torch.device("cpu"), None, 1, AliasSet(), DEFAULT_STREAM))
        finally:
            tensor_module._BY_POSITION = True
    assert described(made[0]) == described(made[1])
    assert (tuple(made[0].shape), made[0].stride(), made[0].storage_offset()) == (meta.size, meta.stride, meta.offset)


@pytest.fixture(autouse=True)
def _quiet_ref_owners(monkeypatch):
    """These proxies name no mesh: their RefOwners have nothing to free when they die."""
    monkeypatch.setattr(tensor_module.RefOwner, "__del__", lambda self: None)

"""Slot arithmetic of op plans (tdmesh/engine/plan.py): which remote tensors each schema argument
holds, in the order dispatch scans them.  A wrong span would put a tensor in another's slot
on every reuse of a plan, so it is checked against the scan itself on random argument trees."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tdmesh.engine.dispatch import _scan
from tdmesh.engine.plan import slot_spans
from tdmesh.engine.propagation import TensorMeta
from tdmesh.engine.stream import DEFAULT_STREAM
from tdmesh.engine.tensor import AliasSet, Tensor

_META = TensorMeta((2,), (1,), 0, torch.float32)
_refs = iter(range(10**9))


def proxy() -> Tensor:
    """A remote tensor with no fleet behind it (its free on death finds no client and is skipped)."""
    return Tensor(_META, "cpu", SimpleNamespace(), next(_refs), AliasSet(), DEFAULT_STREAM)


leaf = st.one_of(st.integers(-3, 3), st.none(), st.floats(allow_nan=False, width=16), st.builds(proxy))
tree = st.recursive(leaf, lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner), max_leaves=8)


def tensors_in(obj) -> list:
    found: list = []
    _scan(obj, found, [])
    return found


@settings(max_examples=200, deadline=None)
@given(args=st.lists(tree, max_size=4), kwargs=st.dictionaries(st.sampled_from(["a", "b", "out"]), tree, max_size=3))
def test_each_argument_span_holds_exactly_its_own_tensors_in_scan_order(args, kwargs):
    names = [f"p{i}" for i in range(len(args))] + ["a", "b", "out"]
    func = SimpleNamespace(_schema=SimpleNamespace(arguments=[SimpleNamespace(name=n) for n in names]))
    remote: list = []
    for a in args:  # the order dispatch scans: positional arguments, then keyword arguments as given
        _scan(a, remote, [])
    if kwargs:
        _scan(kwargs, remote, [])
    spans = slot_spans(func, tuple(args), kwargs)
    for position, value in list(enumerate(args)) + [(names.index(k), v) for k, v in kwargs.items()]:
        assert [id(t) for t in remote[spans[position].start:spans[position].stop]] == [id(t) for t in tensors_in(value)]
    assert sum(len(s) for s in spans.values()) == len(remote)

"""Shape: named dims over a Slice.  Properties (MONARCH_NOTES §4.2, M3-M5 of §4.3), the
documented examples and every error path."""

from __future__ import annotations

import copy
import math
import pickle
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tdmesh import Shape, Slice, UnknownDimError
from tdmesh.geometry.slice import ravel, row_major_strides

try:
    from .strategies import (
        NAME_POOL,
        PROPS,
        UNREPRESENTABLE,
        dim_names,
        factorizations,
        grid,
        model_at,
        model_select,
        pyslices,
        shapes,
    )
except ImportError:  # tests/ is not a package: pytest puts it on sys.path
    from strategies import (
        NAME_POOL,
        PROPS,
        UNREPRESENTABLE,
        dim_names,
        factorizations,
        grid,
        model_at,
        model_select,
        pyslices,
        shapes,
    )


def hg(host=2, gpu=8) -> Shape:
    return Shape(("host", "gpu"), Slice.new_row_major([host, gpu]))


class Model:
    """A shape as plain data: labels and the ``(coords, rank)`` of every point, row-major."""

    def __init__(self, shape: Shape):
        self.labels = list(shape.labels)
        self.sizes = list(shape.slice.sizes)
        self.entries = grid(shape.slice)

    def at(self, label, index):
        d = self.labels.index(label)
        self.entries = model_at(self.entries, d, index)
        del self.labels[d], self.sizes[d]

    def select(self, label, pyslice):
        d = self.labels.index(label)
        positions = range(*pyslice.indices(self.sizes[d]))
        self.entries = model_select(self.entries, d, positions)
        self.sizes[d] = len(positions)

    def check(self, shape: Shape):
        assert list(shape.labels) == self.labels
        assert list(shape.slice.sizes) == self.sizes
        assert shape.ranks() == [r for _, r in self.entries]
        for coords, rank in self.entries:
            assert shape.coordinates(rank) == dict(zip(self.labels, coords))


def _nested(s: Slice) -> bool:
    """Every stride (in stride order) is a multiple of the extent of the dim inside it."""
    pairs = sorted(zip(s.strides, s.sizes))
    return all(b[0] % (a[0] * a[1]) == 0 for a, b in zip(pairs, pairs[1:]))


# =========================================================================================
# Properties
# =========================================================================================

@PROPS
@given(shapes())
def test_ranks_len_sizes_and_coordinates_agree_with_the_slice(shape):
    s = shape.slice
    assert shape.ranks() == list(s) and len(shape) == len(s)
    assert shape.sizes == dict(zip(shape.labels, s.sizes))
    assert list(shape.sizes) == list(shape.labels)
    assert shape.size() == len(shape) == math.prod(shape.sizes.values())
    for d, label in enumerate(shape.labels):
        assert shape.dim(label) == d and shape.size(label) == s.sizes[d]
    assert shape.size(list(shape.labels)) == len(shape)
    Model(shape).check(shape)


@PROPS
@given(shapes(min_ndim=1), st.data())
def test_at_is_the_coordinate_filter(shape, data):
    label = data.draw(st.sampled_from(shape.labels))
    index = data.draw(st.integers(0, shape.sizes[label] - 1))
    model = Model(shape)
    model.at(label, index)
    got = shape.at(label, index)
    model.check(got)
    assert got.slice == shape.slice.at(shape.dim(label), index)
    assert got == shape.index(**{label: index})


@PROPS
@given(shapes(min_ndim=1), st.data())
def test_select_is_the_coordinate_filter(shape, data):
    """Python slice semantics on one dim; negative and zero steps are rejected."""
    label = data.draw(st.sampled_from(shape.labels))
    bad_step = data.draw(st.integers(-4, 0))
    with pytest.raises(ValueError, match=f"slice of dim {label!r} must have a positive step, got {bad_step}"):
        shape.select(label, slice(None, None, bad_step))
    with pytest.raises(ValueError, match="positive step"):
        shape.index(**{label: slice(None, None, bad_step)})
    ps = data.draw(pyslices(shape.sizes[label]))
    positions = range(*ps.indices(shape.sizes[label]))
    if not positions:
        with pytest.raises(ValueError, match=f"of dim {label!r} \\(size {shape.sizes[label]}\\) selects no ranks"):
            shape.select(label, ps)
        return
    try:
        got = shape.select(label, ps)
    except ValueError as err:
        assert re.search(UNREPRESENTABLE, str(err)) and positions.step > 1 and len(positions) > 1
        return
    model = Model(shape)
    model.select(label, ps)
    model.check(got)
    assert got == shape.index(**{label: ps})


@st.composite
def _index_ops(draw, shape):
    """A keyword-ordered ``index(**ops)`` call: each dim at most once, ints in range."""
    order = draw(st.permutations(shape.labels))
    labels = order[:draw(st.integers(0, len(order)))]
    ops = {}
    for label in labels:
        size = shape.sizes[label]
        ops[label] = draw(st.one_of(st.integers(0, size - 1), pyslices(size)))
    return ops


@PROPS
@given(shapes(), st.data())
def test_index_applies_at_and_select_in_keyword_order(shape, data):
    ops = data.draw(_index_ops(shape))
    model = Model(shape)
    step = shape  # the same calls, one at a time
    for label, value in ops.items():
        if isinstance(value, slice):
            try:
                step = step.select(label, value)
            except ValueError as err:
                empty = not range(*value.indices(model.sizes[model.labels.index(label)]))
                assert re.search("selects no ranks" if empty else UNREPRESENTABLE, str(err)), err
                with pytest.raises(ValueError, match=re.escape(str(err))):
                    shape.index(**ops)
                return
            model.select(label, value)
        else:
            step = step.at(label, value)
            model.at(label, value)
    got = shape.index(**ops)
    assert got == step
    model.check(got)


@st.composite
def _split_plans(draw, shape):
    """``(kwargs, {old dim: (new names, new sizes)})`` for a valid ``split`` call."""
    taken = set(shape.labels)
    kwargs, plan = {}, {}
    for label in shape.labels:
        if not draw(st.booleans()):
            continue
        size = shape.sizes[label]
        parts = draw(st.integers(1, 3))
        sizes = draw(st.sampled_from(factorizations(size, parts)))
        names = draw(st.lists(st.sampled_from(NAME_POOL).filter(lambda n: n not in taken),
                              min_size=parts, max_size=parts, unique=True))
        taken.update(names)
        inferred = draw(st.one_of(st.none(), st.integers(0, parts - 1)))
        kwargs[label] = tuple(names)
        kwargs.update({n: k for i, (n, k) in enumerate(zip(names, sizes)) if i != inferred})
        plan[label] = (names, sizes)
    return kwargs, plan


@PROPS
@given(st.booleans().flatmap(lambda nested: shapes(nested=nested)), st.data())
def test_split_preserves_rank_order(shape, data):
    """M4: the ranks are unchanged, each split dim's sizes multiply to its size, and its new
    strides are ``stride_d * row_major(new sizes)``.  A slice whose strides are multiples of
    the extents inside them can always be split; others may hit Slice's rectangularity rule."""
    kwargs, plan = data.draw(_split_plans(shape))
    try:
        got = shape.split(**kwargs)
    except ValueError as err:
        assert not _nested(shape.slice) and re.search(UNREPRESENTABLE, str(err)), err
        return
    assert len(got.labels) == len(shape.labels) + sum(len(n) - 1 for n, _ in plan.values())
    labels, sizes, strides = [], [], []
    for label, size, stride in zip(shape.labels, shape.slice.sizes, shape.slice.strides):
        names, new_sizes = plan.get(label, ([label], [size]))
        assert math.prod(new_sizes) == size
        labels += names
        sizes += new_sizes
        strides += [stride * k for k in row_major_strides(new_sizes)]
    assert list(got.labels) == labels
    assert list(got.slice.sizes) == sizes and list(got.slice.strides) == strides
    assert got.slice.offset == shape.slice.offset
    assert got.ranks() == shape.ranks()
    for rank in shape.ranks():
        old, new = shape.coordinates(rank), got.coordinates(rank)
        for label in shape.labels:
            names, new_sizes = plan.get(label, ([label], [shape.sizes[label]]))
            assert ravel([new[n] for n in names], new_sizes) == old[label]


@PROPS
@given(shapes(), st.data())
def test_rename_keeps_the_slice(shape, data):
    """M3: offsets, sizes, strides and ranks are identical; only the labels change (names
    may also be swapped)."""
    order = data.draw(st.permutations(shape.labels))
    old = order[:data.draw(st.integers(0, len(order)))]
    fresh = data.draw(st.permutations([n for n in NAME_POOL if n not in shape.labels]))
    renames = dict(zip(old, fresh))
    got = shape.rename(**renames)
    assert got.slice == shape.slice
    assert got.labels == tuple(renames.get(n, n) for n in shape.labels)
    assert got.ranks() == shape.ranks()
    for rank in shape.ranks():
        assert list(got.coordinates(rank).values()) == list(shape.coordinates(rank).values())
    if len(shape.labels) >= 2:
        a, b = order[:2]
        swapped = shape.rename(**{a: b, b: a})
        assert swapped.slice == shape.slice
        assert swapped.dim(a) == shape.dim(b) and swapped.dim(b) == shape.dim(a)


@PROPS
@given(st.booleans().flatmap(lambda dense: shapes(dense=dense)), dim_names)
def test_flatten_succeeds_iff_dense_and_preserves_ranks(shape, name):
    """M5: a dense (row-major) slice flattens to one stride-1 dim with the same ranks; any
    other slice raises."""
    dense = shape.ranks() == list(range(shape.slice.offset, shape.slice.offset + len(shape)))
    assert shape.slice.is_contiguous() == dense
    if dense:
        flat = shape.flatten(name)
        assert flat.labels == (name,)
        assert flat.slice == Slice(offset=shape.slice.offset, sizes=[len(shape)], strides=[1])
        assert flat.ranks() == shape.ranks()
    else:
        with pytest.raises(ValueError, match="cannot flatten sparse mesh"):
            shape.flatten(name)


@PROPS
@given(shapes())
def test_pickle_hash_eq_repr_and_table(shape):
    for clone in (pickle.loads(pickle.dumps(shape)), copy.deepcopy(shape)):
        assert clone == shape and hash(clone) == hash(shape)
    assert str(shape) == "{" + ", ".join(f"{n}={k}" for n, k in shape.sizes.items()) + "}"
    assert repr(shape) == f"Shape({shape}, {shape.slice!r})"
    table = shape.to_table()
    if not shape.labels:
        assert table == f"(no dims) rank {shape.slice.offset}"
        return
    lines = table.splitlines()
    ncols = shape.slice.sizes[-1]
    assert lines[0].split(": ")[-1].split() == [str(c) for c in range(ncols)]
    assert f"{shape.labels[-1]}: " in lines[0]
    cells = [int(x) for line in lines[1:] for x in line.split()[-ncols:]]
    assert cells == shape.ranks()
    assert len(lines) == 1 + len(shape) // ncols


# =========================================================================================
# Documented examples
# =========================================================================================

def test_host_gpu_examples():
    s = hg()
    assert repr(s) == "Shape({host=2, gpu=8}, Slice(offset=0, sizes=[2, 8], strides=[8, 1]))"
    assert str(s) == "{host=2, gpu=8}"
    assert s.index(host=1).ranks() == list(range(8, 16))
    assert s.at("host", 1).labels == ("gpu",)
    assert s.index(gpu=slice(2, None)).ranks() == [2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 15]
    assert s.index(gpu=slice(3, 5)).ranks() == [3, 4, 11, 12]
    assert s.select("gpu", slice(3, 5)).labels == ("host", "gpu")
    assert s.index(gpu=slice(3, 5), host=1).ranks() == [11, 12]
    assert s.index(host=1, gpu=slice(3, 5)).ranks() == [11, 12]
    assert s.index(gpu=slice(3, 5), host=1).labels == ("gpu",)
    with pytest.raises(ValueError, match=r"slice 1:1 of dim 'gpu' \(size 8\) selects no ranks"):
        s.index(gpu=slice(1, 1))
    with pytest.raises(IndexError, match=r"index 8 out of range for dim 'gpu' of size 8 \(valid: 0..7\)"):
        s.index(gpu=8)
    assert s.coordinates(13) == {"host": 1, "gpu": 5}
    assert s.index(gpu=slice(-2, None)).ranks() == [6, 7, 14, 15]


def test_host_gpu_step_selection_is_a_valid_sub_grid_when_it_divides():
    s = hg()
    got = s.index(gpu=slice(1, None, 2))
    assert got.slice == Slice(offset=1, sizes=[2, 4], strides=[8, 2])
    assert got.ranks() == [1, 3, 5, 7, 9, 11, 13, 15]


def test_zone_host_gpu_index():
    s = Shape(("zone", "host", "gpu"), Slice.new_row_major([2, 5, 7]))
    got = s.index(host=3)
    assert got.labels == ("zone", "gpu")
    assert got.slice == Slice(offset=21, sizes=[2, 7], strides=[35, 1])


def test_select_step_three_on_ten():
    s = Shape(("x",), Slice.new_row_major([10]))
    got = s.select("x", slice(0, 10, 3))
    assert got.slice == Slice(offset=0, sizes=[4], strides=[3])
    assert got.ranks() == [0, 3, 6, 9]


def test_unity_shape():
    u = Shape.unity()
    assert u.labels == () and len(u) == 1 and u.ranks() == [0] and u.sizes == {}
    assert u.index() == u and u.coordinates(0) == {}
    assert str(u) == "{}" and u.to_table() == "(no dims) rank 0"


SPLIT_BASE = Shape(("host", "gpu"), Slice(offset=0, sizes=[60, 24], strides=[24, 1]))


@pytest.mark.parametrize("constraint, sizes, strides", [
    ({"pp": 4}, [15, 4, 24], [96, 24, 1]),
    ({"dp": 4}, [4, 15, 24], [360, 24, 1]),
    ({"dp": 60}, [60, 1, 24], [24, 24, 1]),
    ({"pp": 60}, [1, 60, 24], [1440, 24, 1]),
    ({"dp": 6, "pp": 10}, [6, 10, 24], [240, 24, 1]),
])
def test_split_examples(constraint, sizes, strides):
    got = SPLIT_BASE.split(host=("dp", "pp"), gpu=("tp",), **constraint)
    assert got.labels == ("dp", "pp", "tp")
    assert list(got.slice.sizes) == sizes and list(got.slice.strides) == strides
    assert got.ranks() == SPLIT_BASE.ranks() == list(range(60 * 24))


def test_split_doc_example_and_keyword_order_irrelevant():
    s = hg()
    assert s.split(host=("dp", "pp"), pp=1).sizes == {"dp": 2, "pp": 1, "gpu": 8}
    a = SPLIT_BASE.split(pp=4, gpu=("tp",), host=("dp", "pp"))
    assert a == SPLIT_BASE.split(host=("dp", "pp"), gpu=("tp",), pp=4)
    assert SPLIT_BASE.split(host=("host",)) == SPLIT_BASE
    assert SPLIT_BASE.split() == SPLIT_BASE


def test_rename_keeps_slice_example():
    got = SPLIT_BASE.rename(host="dp", gpu="tp")
    assert got.labels == ("dp", "tp") and got.slice == SPLIT_BASE.slice
    assert SPLIT_BASE.rename(gpu="host", host="gpu").labels == ("gpu", "host")


@pytest.mark.parametrize("offset, sizes, strides", [
    (0, [100], [1]), (100, [8, 4, 2], [8, 2, 1]), (1, [4, 2], [2, 1]), (5, [], []),
])
def test_flatten_good(offset, sizes, strides):
    sl = Slice(offset=offset, sizes=sizes, strides=strides)
    shape = Shape([f"dim{d}" for d in range(len(sizes))], sl)
    flat = shape.flatten("outer")
    assert flat.labels == ("outer",) and flat.slice.strides == (1,)
    assert flat.ranks() == list(sl)


@pytest.mark.parametrize("offset, sizes, strides", [
    (0, [100], [2]), (0, [64, 32], [64, 1]), (0, [2, 3], [1, 2]),
])
def test_flatten_bad(offset, sizes, strides):
    shape = Shape([f"dim{d}" for d in range(len(sizes))], Slice(offset=offset, sizes=sizes, strides=strides))
    with pytest.raises(ValueError, match=r"cannot flatten sparse mesh: Slice\(offset=0.*only dense"):
        shape.flatten("bad_dim")


def test_dims_named_like_parameters_work_as_keywords():
    """``self`` (and ``label``, ``name``) are legal dim names and keywords of index/split/rename."""
    s = Shape(("self", "label"), Slice.new_row_major([2, 3]))
    assert s.index(self=1).ranks() == [3, 4, 5]
    assert s.index(label=slice(1, 2), self=0).ranks() == [1]
    assert s.rename(self="me").labels == ("me", "label")
    assert s.split(self=("a", "b"), a=1).sizes == {"a": 1, "b": 2, "label": 3}
    assert Shape(("x",), Slice.new_row_major([4])).split(x=("self", "y"), self=2).sizes == {"self": 2, "y": 2}


# =========================================================================================
# Error paths
# =========================================================================================

def test_constructor_errors():
    sl = Slice.new_row_major([2, 8])
    with pytest.raises(ValueError, match=r"Shape has 1 labels \['host'\] for a 2-dim Slice"):
        Shape(("host",), sl)
    with pytest.raises(ValueError, match=r"Shape has 3 labels"):
        Shape(("a", "b", "c"), sl)
    with pytest.raises(ValueError, match=r"duplicate dim names in \['gpu', 'gpu'\]"):
        Shape(("gpu", "gpu"), sl)
    with pytest.raises(ValueError, match=r"dim names must be identifiers, got 'gpu 0'"):
        Shape(("host", "gpu 0"), sl)
    with pytest.raises(ValueError, match=r"dim names must be identifiers, got 3"):
        Shape(("host", 3), sl)
    with pytest.raises(TypeError, match=r"Shape needs a Slice, got list"):
        Shape(("host",), [0, 1])


def test_shapes_are_immutable():
    s = hg()
    with pytest.raises(AttributeError, match="Shape is immutable; cannot set '_labels'"):
        s._labels = ("a", "b")
    assert s.labels == ("host", "gpu")


UNKNOWN = r"mesh has no dim 'rack'; its dims are \['host', 'gpu'\]"


@pytest.mark.parametrize("call", [
    lambda s: s.dim("rack"),
    lambda s: s.at("rack", 0),
    lambda s: s.select("rack", slice(None)),
    lambda s: s.index(rack=0),
    lambda s: s.size("rack"),
    lambda s: s.size(["host", "rack"]),
])
@pytest.mark.parametrize("exc", [UnknownDimError, KeyError, ValueError])
def test_unknown_dim_is_both_key_and_value_error(call, exc):
    with pytest.raises(exc, match=UNKNOWN) as info:
        call(hg())
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)
    assert str(info.value).startswith("mesh has no dim 'rack'")


def test_unknown_dim_after_at_lists_remaining_dims():
    with pytest.raises(KeyError, match=r"mesh has no dim 'host'; its dims are \['gpu'\]"):
        hg().index(host=0).at("host", 0)


def test_at_and_select_value_errors():
    s = hg()
    with pytest.raises(TypeError, match=r"index for dim 'gpu' must be an int or a slice, got '1'"):
        s.at("gpu", "1")
    with pytest.raises(TypeError, match=r"must be an int or a slice, got True"):
        s.index(gpu=True)
    with pytest.raises(IndexError, match=r"index -1 out of range for dim 'host' of size 2 \(valid: 0..1\)"):
        s.at("host", -1)
    with pytest.raises(ValueError, match=r"slice 5:2 of dim 'gpu' \(size 8\) selects no ranks"):
        s.select("gpu", slice(5, 2))
    with pytest.raises(ValueError, match=r"slice 8: of dim 'gpu' \(size 8\) selects no ranks"):
        s.index(gpu=slice(8, None))
    with pytest.raises(ValueError, match=r"slice ::-1 .*|must have a positive step, got -1"):
        s.index(gpu=slice(None, None, -1))
    with pytest.raises(ValueError, match=r"must have a positive step, got 0"):
        s.select("gpu", slice(0, 4, 0))


@pytest.mark.parametrize("kw, match", [
    (dict(host=("dp", "pp")), r"Cannot infer size of dims \['dp', 'pp'\] when splitting 'host' \(size 60\)"),
    (dict(host=("dp", "pp", "cp"), pp=2), r"Cannot infer size of dims \['dp', 'cp'\]"),
    (dict(host=("dp", "pp"), pp=7),
     r"dim 'host' of size 60 cannot be evenly divided into sizes 7 and an inferred 'dp'"),
    (dict(host=("dp", "pp"), pp=4, cp=2), r"unused size constraints \['cp'\]: no split produces those dims"),
    (dict(pp=4), r"unused size constraints \['pp'\]"),
    (dict(host=("gpu", "pp"), pp=4), r"Duplicate dimension name 'gpu' after split"),
    (dict(host=("dp", "pp"), gpu=("pp",), dp=60), r"Duplicate dimension name 'pp'"),
    (dict(host="dp"), r"split\(host=...\) needs a sequence of new dim names for existing dim 'host', got 'dp'"),
    (dict(host=4), r"needs a sequence of new dim names for existing dim 'host', got 4"),
    (dict(host=("dp", "pp"), pp="4"), r"'pp' is not an existing dim \(dims are \['host', 'gpu'\]\); "
                                      r"expected an integer size constraint for a new dim, got '4'"),
    (dict(host=("dp", "pp"), pp=True), r"expected an integer size constraint for a new dim, got True"),
    (dict(host=("dp", "pp"), pp=0), r"size constraint pp=0 must be >= 1"),
    (dict(host=("dp",), dp=4), r"dim 'host' has size 60, not the 4 asked for 'dp'"),
    (dict(host=("dp", "pp"), dp=4, pp=4), r"sizes \[4, 4\] of \['dp', 'pp'\] multiply to 16, not the size 60"),
    (dict(host=()), r"split of dim 'host' needs at least one new name"),
    (dict(host=("dp", "p p"), dp=60), r"dim names must be identifiers, got 'p p'"),
])
def test_split_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        SPLIT_BASE.split(**kw)


def test_rename_errors():
    with pytest.raises(ValueError, match=r"Duplicate dimension name 'gpu' after split"):
        SPLIT_BASE.rename(host="gpu")
    with pytest.raises(KeyError, match=r"mesh has no dim 'rack'; its dims are \['host', 'gpu'\]"):
        SPLIT_BASE.rename(rack="r")
    with pytest.raises(ValueError, match=r"mesh has no dim 'rack'"):
        SPLIT_BASE.rename(host="dp", rack="r")
    with pytest.raises(ValueError, match=r"dim names must be identifiers, got '1x'"):
        SPLIT_BASE.rename(host="1x")

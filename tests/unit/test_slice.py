"""Slice: property tests S1-S12 (MONARCH_NOTES §4.1), documented examples (§5.A 1-7) and
every error path of the constructor and the operations."""

from __future__ import annotations

import copy
import itertools
import math
import pickle
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tdmesh.geometry.slice import Slice, ravel, row_major_strides, unravel

try:
    from .strategies import PROPS, UNREPRESENTABLE, dense_slices, grid, model_at, model_select, raw_triples, slices
except ImportError:  # tests/ is not a package: pytest puts it on sys.path
    from strategies import PROPS, UNREPRESENTABLE, dense_slices, grid, model_at, model_select, raw_triples, slices


def _max(s: Slice) -> int:
    return s.offset + sum((n - 1) * k for n, k in zip(s.sizes, s.strides))


# =========================================================================================
# Properties
# =========================================================================================

@PROPS
@given(slices())
def test_s1_s2_s6_iteration_is_injective_and_row_major(s):
    """The constructor keeps what it is given; iteration is the row-major walk of the
    coordinates (the last dim fastest) whatever the order of the strides (S2), it is
    injective (S1), and it starts at the offset (S6)."""
    assert Slice(offset=s.offset, sizes=list(s.sizes), strides=list(s.strides)) == s
    assert s.ndim == len(s.sizes) == len(s.strides)
    ranks = list(s)
    assert ranks == [r for _, r in grid(s)]
    # S1
    assert len(ranks) == len(set(ranks)) == math.prod(s.sizes) == len(s)
    # S2
    assert [s[i] for i in range(len(s))] == ranks
    # S6 (and the far corner is the max)
    assert min(ranks) == s.offset == s[0]
    assert max(ranks) == _max(s)


@PROPS
@given(slices())
def test_s3_s4_s5_coordinate_round_trips(s):
    for i, (coords, rank) in enumerate(grid(s)):
        # S4: coordinates of the i-th rank are unravel(i)
        assert s.coordinates(rank) == unravel(i, s.sizes) == list(coords)
        # S3: index inverts getitem
        assert s.index(s[i]) == i
        # S5: nditem inverts coordinates
        assert s.nditem(s.coordinates(rank)) == rank == s.nditem(coords)


@PROPS
@given(slices())
def test_s7_holes_are_not_members(s):
    members = set(s)
    lo, hi = min(members), max(members)
    window = range(max(0, lo - 3), hi + 4)
    assert [v for v in window if v in s] == sorted(members)
    holes = [v for v in window if v not in members]
    if len(holes) > 24:  # the first, the last and an even spread in between
        holes = sorted(set(holes[:4] + holes[-4:] + holes[::len(holes) // 16]))
    for v in holes:
        with pytest.raises(ValueError, match=f"rank {v} is not in"):
            s.coordinates(v)
        with pytest.raises(ValueError, match=f"rank {v} is not in"):
            s.index(v)


@PROPS
@given(slices(), st.data())
def test_s8_out_of_range_negative_and_python_slice_indices(s, data):
    with pytest.raises(IndexError, match=f"index {len(s)} out of range"):
        s[len(s)]
    with pytest.raises(IndexError, match="out of range"):
        s[len(s) + 7]
    with pytest.raises(TypeError, match="must be non-negative, got -1"):
        s[-1]
    with pytest.raises(TypeError, match="non-negative"):
        s[-len(s)]
    # a Python slice gives a tuple, with Python's semantics (negative bounds and steps too)
    n = len(s)
    bound = st.one_of(st.none(), st.integers(-n - 2, n + 2))
    step = st.one_of(st.none(), st.integers(-3, -1), st.integers(1, 3))
    ps = slice(data.draw(bound), data.draw(bound), data.draw(step))
    got = s[ps]
    assert isinstance(got, tuple)
    assert got == tuple(list(s)[ps])


@PROPS
@given(slices(min_ndim=1), st.data())
def test_s9_at_is_the_coordinate_filter(s, data):
    dim = data.draw(st.integers(0, s.ndim - 1))
    index = data.draw(st.integers(0, s.sizes[dim] - 1))
    sub = s.at(dim, index)
    expected = model_at(grid(s), dim, index)
    assert list(sub) == [r for _, r in expected]
    assert sub.offset == s.offset + index * s.strides[dim]
    assert sub.sizes == s.sizes[:dim] + s.sizes[dim + 1:]
    assert sub.strides == s.strides[:dim] + s.strides[dim + 1:]
    for coords, rank in expected:
        assert sub.coordinates(rank) == list(coords)


def _select(s, dim, begin, end, step):
    """``s.select(...)``; when the strided result cannot be represented, check that the
    constructor's rectangularity rule is the reason and return ``None``."""
    try:
        return s.select(dim, begin, end, step)
    except ValueError as err:
        new_size = len(range(begin, min(end, s.sizes[dim]), step))
        assert step > 1 and new_size > 1, err
        assert re.search(UNREPRESENTABLE, str(err)), err
        return None


@st.composite
def _select_args(draw, s):
    dim = draw(st.integers(0, s.ndim - 1))
    size = s.sizes[dim]
    begin = draw(st.integers(0, size - 1))
    end = draw(st.integers(begin + 1, size + 3))
    step = draw(st.integers(1, size + 1))
    return dim, begin, end, step


@PROPS
@given(slices(min_ndim=1), st.data())
def test_s9_select_is_the_coordinate_filter(s, data):
    dim, begin, end, step = data.draw(_select_args(s))
    positions = range(begin, min(end, s.sizes[dim]), step)
    sub = _select(s, dim, begin, end, step)
    if sub is None:
        return
    expected = model_select(grid(s), dim, positions)
    assert list(sub) == [r for _, r in expected]
    assert sub.sizes[dim] == len(positions)
    assert sub.offset == s.offset + begin * s.strides[dim]
    for coords, rank in expected:
        assert sub.coordinates(rank) == list(coords)
        assert sub.index(rank) == ravel(coords, sub.sizes)


@PROPS
@given(slices(min_ndim=1), st.data())
def test_select_with_unit_step_always_succeeds(s, data):
    """Contiguous ranges of one dim are always representable; the whole dim is the same
    slice; a single pick keeps the dim (size 1) with its original stride."""
    dim = data.draw(st.integers(0, s.ndim - 1))
    begin = data.draw(st.integers(0, s.sizes[dim] - 1))
    end = data.draw(st.integers(begin + 1, s.sizes[dim] + 2))
    sub = s.select(dim, begin, end)
    positions = range(begin, min(end, s.sizes[dim]))
    assert list(sub) == [r for _, r in model_select(grid(s), dim, positions)]
    assert s.select(dim, 0, s.sizes[dim]) == s == s.select(dim, 0, s.sizes[dim] + 10, 1)
    one = s.select(dim, begin, begin + 1, data.draw(st.integers(1, 9)))
    assert one.sizes[dim] == 1 and one.strides[dim] == s.strides[dim]
    assert list(one) == list(s.at(dim, begin))


@PROPS
@given(slices(min_ndim=2), st.data())
def test_s10_select_then_at_commutes_with_the_filter(s, data):
    dim, begin, end, step = data.draw(_select_args(s))
    positions = range(begin, min(end, s.sizes[dim]), step)
    at_dim = data.draw(st.integers(0, s.ndim - 1))
    selected = _select(s, dim, begin, end, step)
    if selected is None:
        return
    at_index = data.draw(st.integers(0, selected.sizes[at_dim] - 1))
    got = selected.at(at_dim, at_index)
    expected = model_at(model_select(grid(s), dim, positions), at_dim, at_index)
    assert list(got) == [r for _, r in expected]
    if at_dim != dim:
        # the other order: fix first, then select (dim shifts down when at_dim < dim)
        d2 = dim - 1 if at_dim < dim else dim
        other = _select(s.at(at_dim, at_index), d2, begin, end, step)
        if other is not None:
            assert list(other) == list(got)
            assert other == got
    else:
        # fixing the selected dim at i is fixing the original dim at begin + i*step
        assert list(got) == list(s.at(dim, positions[at_index]))


@PROPS
@given(st.lists(st.integers(0, 60), max_size=25))
def test_s11_from_list_covers_exactly_with_arithmetic_runs(ranks):
    pieces = Slice.from_list(ranks)
    assert [r for p in pieces for r in p] == sorted(set(ranks))
    for p in pieces:
        assert p.ndim == 1 and len(p) >= 1
        values = list(p)
        assert values == list(range(p.offset, p.offset + len(p) * p.strides[0], p.strides[0]))
    # greedy: a run of two or more is never continued by the next piece's first rank
    for p, q in zip(pieces, pieces[1:]):
        if len(p) >= 2:
            assert q.offset - p[len(p) - 1] != p.strides[0]


@PROPS
@given(slices(min_ndim=1, max_ndim=1))
def test_s11_from_list_of_a_strided_run_gives_it_back(s):
    if len(s) >= 2:
        assert Slice.from_list(list(s)) == [s]
        assert Slice.from_list(list(reversed(list(s))) * 2) == [s]
    else:
        assert Slice.from_list(list(s)) == [Slice(offset=s.offset, sizes=[1], strides=[1])]


@PROPS
@given(slices())
def test_s12_pickle_copy_hash_and_equality(s):
    for clone in (pickle.loads(pickle.dumps(s)), copy.copy(s), copy.deepcopy(s)):
        assert clone == s and hash(clone) == hash(s) and list(clone) == list(s)
        assert repr(clone) == repr(s)
    assert s != Slice(offset=s.offset + 1, sizes=list(s.sizes), strides=list(s.strides))
    assert len({s, pickle.loads(pickle.dumps(s))}) == 1
    assert s != (s.offset, s.sizes, s.strides)
    assert repr(s) == f"Slice(offset={s.offset}, sizes={list(s.sizes)}, strides={list(s.strides)})"


@PROPS
@given(st.booleans().flatmap(lambda dense: dense_slices() if dense else slices()))
def test_is_contiguous_iff_strides_are_row_major(s):
    """``is_contiguous`` holds iff the strides of the dims of size > 1 are the row-major
    ones, iff the ranks are ``offset, offset+1, ...`` in order; ``new_row_major`` builds
    exactly those strides."""
    row_major = row_major_strides(s.sizes)
    assert row_major == [math.prod(s.sizes[i + 1:]) for i in range(s.ndim)]
    strides_row_major = all(n == 1 or k == r for n, k, r in zip(s.sizes, s.strides, row_major))
    dense = list(s) == list(range(s.offset, s.offset + len(s)))
    assert s.is_contiguous() == strides_row_major == dense
    made = Slice.new_row_major(list(s.sizes), offset=s.offset)
    assert made.is_contiguous() and list(made.strides) == row_major
    assert list(made) == list(range(s.offset, s.offset + len(s)))
    assert Slice.new_row_major(list(s.sizes)).offset == 0


def _monarch_accepts(offset, sizes, strides) -> bool:
    """Monarch's ``Slice::new`` rule (MONARCH_NOTES §4.1), plus tdmesh's size >= 1."""
    if len(sizes) != len(strides) or offset < 0 or any(n < 1 for n in sizes):
        return False
    prev_stride = prev_size = None
    total = 1
    for stride, size in sorted(zip(strides, sizes)):
        if prev_stride is not None:
            if stride % prev_stride:
                return False
            if stride == prev_stride and size != 1 and prev_size != 1:
                return False
        if total > stride:
            return False
        total, prev_stride, prev_size = stride * size, stride, size
    return True


@PROPS
@given(raw_triples)
def test_constructor_accepts_exactly_monarchs_valid_slices(triple):
    """Whatever the constructor accepts is a well-behaved slice, and it accepts exactly
    what Monarch's rule accepts (stride 0 included: always rejected)."""
    offset, sizes, strides = triple
    accepts = _monarch_accepts(offset, sizes, strides)
    if not accepts:
        match = "strides must be >= 1" if 0 in strides else r"^Slice "
        with pytest.raises(ValueError, match=match):
            Slice(offset=offset, sizes=sizes, strides=strides)
        return
    s = Slice(offset=offset, sizes=sizes, strides=strides)
    assert list(s) == [r for _, r in grid(s)]
    assert len(set(s)) == len(s)
    for i, (coords, v) in enumerate(grid(s)):
        assert s.coordinates(v) == list(coords) and s.index(v) == i


# =========================================================================================
# Documented examples
# =========================================================================================

def test_a1_two_by_three_row_major():
    s = Slice(offset=0, sizes=[2, 3], strides=[3, 1])
    assert list(s) == [0, 1, 2, 3, 4, 5]
    assert all(s[i] == i for i in range(6))
    assert len(s) == 6 and s.ndim == 2
    assert s == Slice.new_row_major([2, 3])
    assert repr(s) == "Slice(offset=0, sizes=[2, 3], strides=[3, 1])"
    assert s.sizes == (2, 3) and s.strides == (3, 1) and s.offset == 0
    assert s.is_contiguous()


def test_a2_indexing_is_by_coordinates_not_by_value_order():
    s = Slice(offset=0, sizes=[2, 2, 2], strides=[4, 32, 1])
    assert s[1] == 1
    assert s[2] == 32
    assert list(s) == [0, 1, 32, 33, 4, 5, 36, 37]
    assert s.coordinates(32) == [0, 1, 0] and s.index(32) == 2
    assert not s.is_contiguous()


def test_a3_offset_ten_iterates_a_range():
    s = Slice(offset=10, sizes=[10, 2], strides=[10, 5])
    assert list(s) == list(range(10, 106, 5))
    assert s[3] == 25


def test_a4_coordinates_and_index_of_members_and_non_members():
    s = Slice(offset=1, sizes=[2, 3], strides=[10, 2])
    assert list(s) == [1, 3, 5, 11, 13, 15]
    assert s.coordinates(1) == [0, 0]
    assert s.coordinates(13) == [1, 1] and s.index(13) == 4
    assert s.coordinates(15) == [1, 2] and s.index(15) == 5
    with pytest.raises(ValueError, match="rank 0 is not in .* below the offset"):
        s.coordinates(0)
    with pytest.raises(ValueError, match="rank 0 is not in .* below the offset"):
        s.index(0)
    with pytest.raises(ValueError, match="rank 2 is not in .* falls between strides"):
        s.coordinates(2)
    with pytest.raises(ValueError, match="rank 7 is not in .* past the end of dim 1"):
        s.index(7)
    with pytest.raises(ValueError, match="rank 21 is not in .* past the end of dim 0"):
        s.coordinates(21)
    assert 13 in s and 7 not in s and 0 not in s and "13" not in s and 1.0 not in s


def test_a4_coordinates_with_permuted_strides():
    s = Slice(offset=0, sizes=[3, 2], strides=[1, 3])  # column-major 3x2
    assert list(s) == [0, 3, 1, 4, 2, 5]
    assert s.coordinates(4) == [1, 1] and s.index(4) == 3
    assert s.coordinates(2) == [2, 0] and s.index(2) == 4


@pytest.mark.parametrize("ranks, expected", [
    ([], []),
    ([1, 2, 3], [Slice(offset=1, sizes=[3], strides=[1])]),
    ([1, 3, 5], [Slice(offset=1, sizes=[3], strides=[2])]),
    ([1, 2, 4, 5, 6], [Slice(offset=1, sizes=[2], strides=[1]), Slice(offset=4, sizes=[3], strides=[1])]),
    ([1, 2, 3, 10, 11, 12], [Slice(offset=1, sizes=[3], strides=[1]), Slice(offset=10, sizes=[3], strides=[1])]),
    (list(range(100)), [Slice(offset=0, sizes=[100], strides=[1])]),
    ([7], [Slice(offset=7, sizes=[1], strides=[1])]),
    ([5, 3, 1, 3], [Slice(offset=1, sizes=[3], strides=[2])]),
])
def test_a5_from_list_runs(ranks, expected):
    assert Slice.from_list(ranks) == expected


def test_zero_dim_slice_holds_its_offset():
    s = Slice(offset=37, sizes=[], strides=[])
    assert len(s) == 1 and list(s) == [37] and s[0] == 37
    assert 37 in s and 36 not in s
    assert s.coordinates(37) == [] and s.index(37) == 0 and s.nditem([]) == 37
    assert s.is_contiguous()
    assert repr(s) == "Slice(offset=37, sizes=[], strides=[])"
    with pytest.raises(ValueError, match="rank 38 is not in .* falls between strides"):
        s.coordinates(38)


def test_size_one_dims_may_share_a_stride():
    s = Slice(offset=0, sizes=[1, 4, 1], strides=[1, 1, 4])
    assert list(s) == [0, 1, 2, 3] and s.is_contiguous()
    assert s.coordinates(2) == [0, 2, 0]


def test_select_step_on_one_dim():
    s = Slice.new_row_major([10])
    assert s.select(0, 0, 10, 3) == Slice(offset=0, sizes=[4], strides=[3])
    assert list(s.select(0, 0, 10, 3)) == [0, 3, 6, 9]
    assert s.select(0, 2, 100, 4) == Slice(offset=2, sizes=[2], strides=[4])


def test_select_and_at_examples():
    s = Slice(offset=0, sizes=[2, 3], strides=[3, 1])
    assert s.at(0, 1) == Slice(offset=3, sizes=[3], strides=[1])
    assert s.at(1, 2) == Slice(offset=2, sizes=[2], strides=[3])
    assert s.select(1, 1, 3, 1) == Slice(offset=1, sizes=[2, 2], strides=[3, 1])
    assert s.select(1, 1, 3, 1).index(5) == 3
    # a single pick keeps the dim (size 1) and its original stride
    assert s.select(1, 2, 3, 5) == Slice(offset=2, sizes=[2, 1], strides=[3, 1])
    assert Slice.new_row_major([2, 8]).select(1, 0, 8, 2) == Slice(offset=0, sizes=[2, 4], strides=[8, 2])


def test_step_select_that_breaks_rectangularity_is_rejected():
    """Monarch-compatible: every third of 8 GPUs has stride 3, which does not divide the
    host stride 8, so the result is not a valid Slice (tdmesh, like Monarch, raises)."""
    s = Slice.new_row_major([2, 8])
    with pytest.raises(ValueError, match="not rectangular: 8 is not a multiple of 3"):
        s.select(1, 0, 8, 3)


def test_slices_are_immutable():
    s = Slice(offset=0, sizes=[2], strides=[1])
    with pytest.raises(AttributeError, match="Slice is immutable; cannot set 'offset'"):
        s.offset = 3
    with pytest.raises(AttributeError, match="immutable"):
        s._sizes = (4,)
    with pytest.raises(AttributeError, match="cannot delete '_offset'"):
        del s._offset
    assert s == Slice(offset=0, sizes=[2], strides=[1])


def test_equality_is_structural_not_by_ranks():
    a = Slice(offset=0, sizes=[1], strides=[1])
    b = Slice(offset=0, sizes=[1], strides=[5])
    assert list(a) == list(b) and a != b
    assert Slice(offset=3, sizes=(2,), strides=(1,)) == Slice(offset=3, sizes=[2], strides=[1])


def test_module_helpers():
    assert row_major_strides([2, 3, 4]) == [12, 4, 1]
    assert row_major_strides([]) == []
    assert ravel([1, 2], [3, 4]) == 6 and unravel(6, [3, 4]) == [1, 2]
    assert ravel([], []) == 0 and unravel(0, []) == []


# =========================================================================================
# Error paths
# =========================================================================================

@pytest.mark.parametrize("kw, exc, match", [
    (dict(offset=0, sizes=[2, 3], strides=[1]), ValueError,
     r"one stride per size: sizes \[2, 3\] has 2, strides \[1\] has 1"),
    (dict(offset=0, sizes=[2], strides=[0]), ValueError, r"strides must be >= 1, got strides \[0\]"),
    (dict(offset=0, sizes=[2, 2], strides=[2, 0]), ValueError, "strides must be >= 1"),
    (dict(offset=0, sizes=[2], strides=[-1]), ValueError, "strides must be >= 1"),
    (dict(offset=0, sizes=[2, 2], strides=[1, 1]), ValueError,
     r"repeat stride 1 across dims of sizes 2 and 2; ranks would collide"),
    (dict(offset=0, sizes=[2, 3], strides=[3, 2]), ValueError,
     r"not rectangular: 3 is not a multiple of 2"),
    (dict(offset=0, sizes=[3, 2], strides=[1, 2]), ValueError,
     r"stride 2 is smaller than the extent 3"),
    (dict(offset=0, sizes=[4, 1], strides=[1, 2]), ValueError,
     r"stride 2 is smaller than the extent 4 .*sizes \[4, 1\], strides \[1, 2\]"),
    (dict(offset=0, sizes=[2, 4], strides=[2, 1]), ValueError, r"stride 2 is smaller than the extent 4"),
    (dict(offset=-1, sizes=[2], strides=[1]), ValueError, "offset must be >= 0, got -1"),
    (dict(offset=0, sizes=[0], strides=[1]), ValueError, r"sizes must be >= 1, got sizes \[0\]"),
    (dict(offset=0, sizes=[2, -1], strides=[1, 2]), ValueError, "sizes must be >= 1"),
    (dict(offset=1.0, sizes=[2], strides=[1]), TypeError, r"offset must be an int, got 1.0 \(float\)"),
    (dict(offset=True, sizes=[2], strides=[1]), TypeError, r"offset must be an int, got True \(bool\)"),
    (dict(offset=0, sizes=[2.0], strides=[1]), TypeError, "size must be an int, got 2.0"),
    (dict(offset=0, sizes=[2], strides=["1"]), TypeError, "stride must be an int, got '1'"),
])
def test_constructor_errors(kw, exc, match):
    with pytest.raises(exc, match=match):
        Slice(**kw)


def test_constructor_is_keyword_only():
    with pytest.raises(TypeError, match="positional"):
        Slice(0, [2], [1])


@pytest.fixture
def s23():
    return Slice(offset=4, sizes=[2, 3], strides=[10, 2])  # 4 6 8 / 14 16 18


def test_index_and_coordinates_errors(s23):
    with pytest.raises(ValueError, match=r"rank 3 is not in Slice\(offset=4.*below the offset"):
        s23.index(3)
    with pytest.raises(ValueError, match="rank 5 is not in .* falls between strides"):
        s23.coordinates(5)
    with pytest.raises(ValueError, match="rank 10 is not in .* past the end of dim 1"):
        s23.index(10)
    with pytest.raises(TypeError, match="rank must be an int, got '4'"):
        s23.coordinates("4")
    with pytest.raises(TypeError, match="index must be an int, got 1.5"):
        s23[1.5]
    with pytest.raises(TypeError, match="non-negative, got -1 .*0..5"):
        s23[-1]
    with pytest.raises(IndexError, match=r"Slice index 6 out of range .* of length 6"):
        s23[6]


def test_nditem_checks_only_the_number_of_coordinates(s23):
    with pytest.raises(IndexError, match=r"has 2 dims, got 1 coordinates \[0\]"):
        s23.nditem([0])
    with pytest.raises(IndexError, match=r"has 2 dims, got 3 coordinates"):
        s23.nditem([0, 0, 0])
    assert s23.nditem([1, 2]) == 18
    assert s23.nditem([0, 5]) == 14  # not bounds-checked (MONARCH_NOTES §4.1)


def test_at_errors(s23):
    with pytest.raises(IndexError, match=r"dim 2 out of range for .* with 2 dims \(0..1\)"):
        s23.at(2, 0)
    with pytest.raises(IndexError, match="dim -1 out of range"):
        s23.at(-1, 0)
    with pytest.raises(IndexError, match="dim True out of range"):
        s23.at(True, 0)
    with pytest.raises(IndexError, match="dim '0' out of range"):
        s23.at("0", 0)
    with pytest.raises(IndexError, match="index 3 out of range for dim 1 of size 3"):
        s23.at(1, 3)
    with pytest.raises(IndexError, match="index -1 out of range for dim 0 of size 2"):
        s23.at(0, -1)


def test_select_errors(s23):
    with pytest.raises(IndexError, match="dim 5 out of range"):
        s23.select(5, 0, 1)
    with pytest.raises(IndexError, match="select begin 3 out of range for dim 1 of size 3"):
        s23.select(1, 3, 4)
    with pytest.raises(IndexError, match="select begin -1 out of range for dim 0 of size 2"):
        s23.select(0, -1, 2)
    with pytest.raises(ValueError, match="select range 1:1 of dim 1 is empty"):
        s23.select(1, 1, 1)
    with pytest.raises(ValueError, match="select range 2:0 of dim 1 is empty"):
        s23.select(1, 2, 0)
    with pytest.raises(ValueError, match="select step must be >= 1, got 0"):
        s23.select(1, 0, 3, 0)
    with pytest.raises(ValueError, match="select step must be >= 1, got -1"):
        s23.select(1, 2, 0, -1)


def test_from_list_errors():
    with pytest.raises(ValueError, match="offset must be >= 0, got -2"):
        Slice.from_list([-2, 0, 2])
    with pytest.raises(TypeError, match=r"rank must be an int, got 1.5"):
        Slice.from_list([1, 1.5])


@pytest.mark.parametrize("sizes, strides", [([2, 2], [2, 1]), ([3, 4], [4, 1]), ([2, 3, 2], [6, 2, 1])])
def test_dense_grid_coordinates_exhaustive(sizes, strides):
    s = Slice(offset=5, sizes=sizes, strides=strides)
    for i, coords in enumerate(itertools.product(*(range(n) for n in sizes))):
        assert s[i] == 5 + i and s.coordinates(5 + i) == list(coords)

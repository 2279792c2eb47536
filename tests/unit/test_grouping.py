"""Process-group membership and to_mesh pairing (MONARCH_NOTES §4.3 M7, §4.4 W1-W5)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tdmesh import Shape, Slice, UnknownDimError
from tdmesh.geometry.grouping import all_groups, dims_rank, group_members, normalize_dims, to_mesh_pairs, to_mesh_plan
from tdmesh.geometry.slice import ravel

try:
    from .strategies import PROPS, shapes, slices
except ImportError:  # tests/ is not a package: pytest puts it on sys.path
    from strategies import PROPS, shapes, slices


def _subset(data, labels, *, min_size=0):
    """An ordered subset of ``labels`` (in random order)."""
    order = data.draw(st.permutations(labels))
    return tuple(order[:data.draw(st.integers(min_size, len(order)))])


# =========================================================================================
# Properties
# =========================================================================================

@PROPS
@given(shapes(), st.data())
def test_w3_groups_partition_the_mesh(shape, data):
    """W3: the groups over ``D`` partition the mesh; two ranks share a group iff their
    coordinates agree outside ``D``; ``group_members(r)`` is r's group, ordered row-major by
    the coordinates on ``D`` (in the mesh's dim order)."""
    dims = _subset(data, shape.labels)
    D = normalize_dims(shape, dims)
    assert set(D) == set(dims or shape.labels)
    assert list(D) == [d for d in shape.labels if d in D]  # the mesh's dim order
    outside = [d for d in shape.labels if d not in D]

    groups = all_groups(shape, dims)
    group_size = math.prod(shape.sizes[d] for d in D)
    assert len(groups) == len(shape) // group_size
    assert all(len(g) == group_size for g in groups)
    flat = [r for g in groups for r in g]
    assert sorted(flat) == sorted(shape.ranks()) and len(set(flat)) == len(flat)

    coords = {r: shape.coordinates(r) for r in shape.ranks()}
    key = {r: tuple(coords[r][d] for d in outside) for r in shape.ranks()}
    # a group is exactly one class of "same coordinates outside D" ...
    assert all(len({key[m] for m in g}) == 1 for g in groups)
    assert len({key[g[0]] for g in groups}) == len(groups)
    # ... the groups come in row-major order of those outside coordinates ...
    assert [key[g[0]] for g in groups] == list(itertools.product(*(range(shape.sizes[d]) for d in outside)))
    # ... and inside a group the members are in row-major order of their coordinates on D
    for g in groups:
        inside = [tuple(coords[m][d] for d in D) for m in g]
        assert inside == list(itertools.product(*(range(shape.sizes[d]) for d in D)))
    group_of = {r: i for i, g in enumerate(groups) for r in g}
    ranks = shape.ranks()
    for r in ranks[::max(1, len(ranks) // 16)] + ranks[-1:]:  # an even spread of ranks
        members = group_members(shape, r, dims)
        assert r in members
        assert members == groups[group_of[r]]


@PROPS
@given(shapes(), st.data())
def test_m7_dims_rank_is_row_major_in_the_given_order(shape, data):
    dims = _subset(data, shape.labels)
    for r in shape.ranks():
        coords = shape.coordinates(r)
        expected = ravel([coords[d] for d in dims], [shape.sizes[d] for d in dims])
        assert dims_rank(shape, r, dims) == expected
        assert 0 <= expected < math.prod(shape.sizes[d] for d in dims)
    if dims:
        # W1: a rank sits at its dims_rank within its group (over mesh-ordered dims)
        D = normalize_dims(shape, dims)
        for group in all_groups(shape, D):
            assert [dims_rank(shape, r, D) for r in group] == list(range(len(group)))
    for d in shape.labels:
        assert [dims_rank(shape, r, d) for r in shape.ranks()] == \
               [shape.coordinates(r)[d] for r in shape.ranks()]


@st.composite
def _to_mesh_pairs(draw):
    """``(src, dst)``: ``src`` has a subset of ``dst``'s dims, in any order, with the same
    sizes, over an unrelated slice."""
    dst = draw(shapes())
    order = draw(st.permutations(dst.labels))
    labels = order[:draw(st.integers(0, len(order)))]
    src_slice = draw(slices(sizes=[dst.sizes[d] for d in labels]))
    return Shape(labels, src_slice), dst


@PROPS
@given(_to_mesh_pairs())
def test_w5_to_mesh_pairs_match_shared_coordinates(pair):
    src, dst = pair
    shared = [d for d in dst.labels if d in src.labels]
    broadcast = [d for d in dst.labels if d not in src.labels]
    plan = to_mesh_plan(src, dst)
    pairs = to_mesh_pairs(src, dst)

    # the plan: one entry per assignment of the broadcast coordinates, equal-length pairs
    assert len(plan) == math.prod(dst.sizes[d] for d in broadcast)
    assert pairs == [(f, t) for fr, to in plan for f, t in zip(fr, to)]
    seen_assignments = []
    for from_ranks, to_ranks in plan:
        assert len(from_ranks) == len(to_ranks) == len(src)
        assert sorted(from_ranks) == sorted(src.ranks())
        assignment = {tuple(dst.coordinates(t)[d] for d in broadcast) for t in to_ranks}
        assert len(assignment) == 1  # one broadcast coordinate per entry
        seen_assignments += assignment
    assert seen_assignments == list(itertools.product(*(range(dst.sizes[d]) for d in broadcast)))

    # every destination rank receives exactly once, from the source rank at its coordinates
    assert sorted(t for _, t in pairs) == sorted(dst.ranks())
    for f, t in pairs:
        fc, tc = src.coordinates(f), dst.coordinates(t)
        assert all(fc[d] == tc[d] for d in shared)
    # every source rank sends once per broadcast assignment
    sends = {f: 0 for f in src.ranks()}
    for f, _ in pairs:
        sends[f] += 1
    assert set(sends.values()) == {len(plan)}
    # onto itself: the identity, in one piece
    assert to_mesh_plan(dst, dst) == [(dst.slice, dst.slice)]
    assert to_mesh_pairs(dst, dst) == [(r, r) for r in dst.ranks()]


# =========================================================================================
# Documented examples
# =========================================================================================

def test_w1_worker_dims_two_by_four():
    shape = Shape(("a", "b"), Slice(offset=0, sizes=[3, 4], strides=[4, 1]))
    assert group_members(shape, 1, "b") == [0, 1, 2, 3] and dims_rank(shape, 1, "b") == 1
    assert group_members(shape, 1, "a") == [1, 5, 9] and dims_rank(shape, 1, "a") == 0
    assert group_members(shape, 6, "b") == [4, 5, 6, 7] and dims_rank(shape, 6, "b") == 2
    assert group_members(shape, 6, ["a"]) == [2, 6, 10] and dims_rank(shape, 6, "a") == 1


def test_w1_worker_dims_three_d():
    # rank 10 of (0,[3,4,2],[8,2,1]) is a=1, b=1, c=0.  (The figures listed for this case in
    # MONARCH_NOTES §4.4 repeat the 2-d rank-6 example; Monarch's test asserts nothing here.)
    shape = Shape(("a", "b", "c"), Slice(offset=0, sizes=[3, 4, 2], strides=[8, 2, 1]))
    assert shape.coordinates(10) == {"a": 1, "b": 1, "c": 0}
    assert group_members(shape, 10, "b") == [8, 10, 12, 14] and dims_rank(shape, 10, "b") == 1
    assert group_members(shape, 10, "a") == [2, 10, 18] and dims_rank(shape, 10, "a") == 1
    assert group_members(shape, 10, "c") == [10, 11] and dims_rank(shape, 10, "c") == 0


def test_w2_ranks_for_dim_slices():
    shape = Shape(("x", "y", "z"), Slice(offset=0, sizes=[2, 2, 2], strides=[4, 2, 1]))
    assert group_members(shape, 1, ["x"]) == [1, 5]
    assert group_members(shape, 1, ["y"]) == [1, 3]
    assert group_members(shape, 1, ["z"]) == [0, 1]
    assert group_members(shape, 1, ["x", "y"]) == [1, 3, 5, 7]
    assert group_members(shape, 1, ["y", "z"]) == [0, 1, 2, 3]
    assert group_members(shape, 1, ["x", "y", "z"]) == list(range(8))
    # tdmesh orders members by the MESH's dim order; Monarch by the order given
    assert group_members(shape, 1, ["y", "x"]) == [1, 3, 5, 7]  # Monarch: [1, 5, 3, 7]
    assert set(group_members(shape, 1, ["y", "x"])) == {1, 5, 3, 7}
    assert group_members(shape, 1, ["z", "x", "y"]) == list(range(8))
    # tdmesh: no dims (or None) means every dim (Monarch's worker returns [] for [])
    assert group_members(shape, 1, []) == group_members(shape, 1, None) == list(range(8))
    assert all_groups(shape, ["x", "z"]) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert all_groups(shape, "y") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert all_groups(shape, None) == [list(range(8))]


def test_groups_on_a_strided_sub_mesh():
    mesh = Shape(("host", "gpu"), Slice.new_row_major([2, 8])).index(gpu=slice(1, None, 2))
    assert mesh.ranks() == [1, 3, 5, 7, 9, 11, 13, 15]
    assert all_groups(mesh, "gpu") == [[1, 3, 5, 7], [9, 11, 13, 15]]
    assert all_groups(mesh, "host") == [[1, 9], [3, 11], [5, 13], [7, 15]]
    assert group_members(mesh, 11, "host") == [3, 11]
    assert dims_rank(mesh, 11, "gpu") == 1 and dims_rank(mesh, 11, ("gpu", "host")) == 3


def test_dims_rank_examples():
    shape = Shape(("host", "gpu"), Slice.new_row_major([2, 2]))
    assert [dims_rank(shape, r, ("host", "gpu")) for r in range(4)] == [0, 1, 2, 3]
    assert [dims_rank(shape, r, ("gpu", "host")) for r in range(4)] == [0, 2, 1, 3]
    assert [dims_rank(shape, r, ()) for r in range(4)] == [0, 0, 0, 0]


def test_normalize_dims():
    shape = Shape(("host", "gpu", "tp"), Slice.new_row_major([2, 2, 2]))
    assert normalize_dims(shape, None) == ("host", "gpu", "tp")
    assert normalize_dims(shape, ()) == ("host", "gpu", "tp")
    assert normalize_dims(shape, "gpu") == ("gpu",)
    assert normalize_dims(shape, ["tp", "host"]) == ("host", "tp")
    assert normalize_dims(shape, iter(["tp", "gpu"])) == ("gpu", "tp")


def test_to_mesh_broadcast_example():
    mesh = Shape(("host", "gpu"), Slice.new_row_major([2, 4]))
    src = mesh.index(host=0)
    plan = to_mesh_plan(src, mesh)
    assert plan == [(Slice(offset=0, sizes=[4], strides=[1]), Slice(offset=0, sizes=[4], strides=[1])),
                    (Slice(offset=0, sizes=[4], strides=[1]), Slice(offset=4, sizes=[4], strides=[1]))]
    assert to_mesh_pairs(src, mesh) == [(0, 0), (1, 1), (2, 2), (3, 3), (0, 4), (1, 5), (2, 6), (3, 7)]


def test_to_mesh_reordered_dims_example():
    src = Shape(("host", "gpu"), Slice.new_row_major([2, 2]))
    dst = Shape(("gpu", "host"), Slice(offset=4, sizes=[2, 2], strides=[2, 1]))
    (from_ranks, to_ranks), = to_mesh_plan(src, dst)
    assert from_ranks == Slice(offset=0, sizes=[2, 2], strides=[1, 2])
    assert to_ranks == dst.slice
    assert to_mesh_pairs(src, dst) == [(0, 4), (2, 5), (1, 6), (3, 7)]


def test_to_mesh_from_a_single_rank_broadcasts_everywhere():
    src = Shape(("host", "gpu"), Slice.new_row_major([2, 2])).index(host=1, gpu=0)
    dst = Shape(("host", "gpu"), Slice.new_row_major([2, 2]))
    assert to_mesh_pairs(src, dst) == [(2, 0), (2, 1), (2, 2), (2, 3)]
    assert len(to_mesh_plan(src, dst)) == 4


# =========================================================================================
# Error paths
# =========================================================================================

def test_grouping_errors():
    shape = Shape(("host", "gpu"), Slice.new_row_major([2, 4]))
    with pytest.raises(UnknownDimError, match=r"mesh has no dim 'rack'; its dims are \['host', 'gpu'\]"):
        normalize_dims(shape, ["gpu", "rack"])
    with pytest.raises(KeyError, match="mesh has no dim 'rack'"):
        all_groups(shape, "rack")
    with pytest.raises(ValueError, match="mesh has no dim 'rack'"):
        group_members(shape, 0, ["rack"])
    with pytest.raises(KeyError, match="mesh has no dim 'rack'"):
        dims_rank(shape, 0, ("gpu", "rack"))
    with pytest.raises(ValueError, match=r"dims \['gpu', 'gpu'\] name a dim twice; mesh dims are \['host', 'gpu'\]"):
        normalize_dims(shape, ["gpu", "gpu"])
    with pytest.raises(ValueError, match="name a dim twice"):
        all_groups(shape, ("host", "host"))
    with pytest.raises(ValueError, match=r"rank 8 is not in Slice\(offset=0, sizes=\[2, 4\]"):
        group_members(shape, 8, "gpu")
    with pytest.raises(ValueError, match="rank 9 is not in"):
        dims_rank(shape, 9, "gpu")


def test_to_mesh_plan_errors():
    hg = Shape(("host", "gpu"), Slice.new_row_major([2, 4]))
    with pytest.raises(ValueError, match=r"destination mesh does not have dimensions \['host'\] of the source "
                                         r"\(source dims \['host', 'gpu'\], destination dims \['gpu'\]\)"):
        to_mesh_plan(hg, hg.index(host=0))
    with pytest.raises(ValueError, match=r"does not have dimensions \['host', 'gpu'\]"):
        to_mesh_pairs(hg, Shape(("x",), Slice.new_row_major([8])))
    with pytest.raises(ValueError, match=r"dimension 'gpu' of the destination mesh has a different length "
                                         r"\(2\) than the source \(4\)"):
        to_mesh_plan(hg, hg.index(gpu=slice(0, 2)))
    with pytest.raises(ValueError, match=r"dimension 'host' of the destination mesh has a different length "
                                         r"\(1\) than the source \(2\)"):
        to_mesh_pairs(hg, hg.index(host=slice(1, 2)))

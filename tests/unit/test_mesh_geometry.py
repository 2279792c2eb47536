"""DeviceMesh geometry (MONARCH_NOTES §4.3 M1-M8, §5.A 9-11 and 14): a pure value over
Shape; nothing here needs workers."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tdmesh import Shape, Slice, UnknownDimError
from tdmesh.mesh import DeviceMesh

try:
    from .strategies import PROPS, UNREPRESENTABLE, dense_meshes, grid, model_at, model_select, pyslices, shapes
except ImportError:  # tests/ is not a package: pytest puts it on sys.path
    from strategies import PROPS, UNREPRESENTABLE, dense_meshes, grid, model_at, model_select, pyslices, shapes


def mesh_of(offset, sizes, strides, names, client=None) -> DeviceMesh:
    return DeviceMesh(Shape(names, Slice(offset=offset, sizes=sizes, strides=strides)), client)


# =========================================================================================
# Properties
# =========================================================================================

@PROPS
@given(shapes(min_ndim=1), st.data())
def test_m1_m2_slice_by_int_or_slice(shape, data):
    """M1: an int removes the dim, keeps the coordinate filter in row-major order and moves
    the offset by ``i * stride``.  M2: a slice keeps the dim with ``len(range(...))`` ranks.
    The result is a new mesh with this mesh as parent and the same client."""
    client = object()
    mesh = DeviceMesh(shape, client)
    label = data.draw(st.sampled_from(shape.labels))
    d, size, stride = shape.dim(label), shape.sizes[label], shape.slice.strides[shape.dim(label)]
    i = data.draw(st.integers(0, size - 1))
    sub = mesh.slice(**{label: i})
    assert label not in sub.names and len(sub.names) == len(mesh.names) - 1
    assert list(sub.processes) == [r for _, r in model_at(grid(shape.slice), d, i)]
    assert sub.processes.offset == mesh.processes.offset + i * stride
    assert sub.shape == shape.at(label, i)
    assert sub.client is client and sub.fleet is mesh.fleet and sub is not mesh

    ps = data.draw(pyslices(size))
    positions = range(*ps.indices(size))
    if not positions:
        with pytest.raises(ValueError, match="selects no ranks"):
            mesh.slice(**{label: ps})
        return
    try:
        kept = mesh.slice(**{label: ps})
    except ValueError as err:  # a strided pick that Slice cannot represent (see test_slice.py)
        assert positions.step > 1 and re.search(UNREPRESENTABLE, str(err)), err
        return
    assert kept.names == mesh.names and kept.sizes[label] == len(positions)
    assert list(kept.processes) == [r for _, r in model_select(grid(shape.slice), d, positions)]


@PROPS
@given(shapes())
def test_m6_processes_nditem_and_geometry_accessors(shape):
    mesh = DeviceMesh(shape)
    assert mesh.processes is shape.slice and mesh.names == shape.labels and mesh.sizes == shape.sizes
    assert len(mesh) == len(shape) == mesh.size() == mesh.size(list(mesh.names))
    for rank in shape.ranks():
        coords = shape.coordinates(rank)
        assert mesh.processes.nditem([coords[n] for n in mesh.names]) == rank
    assert mesh.client is None and mesh != DeviceMesh(shape)  # identity, not value, equality
    assert mesh.to_table() == shape.to_table()


@PROPS
@given(dense_meshes(), st.sampled_from(["outer", "r", "self"]))
def test_dense_meshes_flatten_and_show_their_ranks(mesh, name):
    ranks = list(range(mesh.processes.offset, mesh.processes.offset + len(mesh)))
    assert list(mesh.processes) == ranks
    flat = mesh.flatten(name)
    assert flat.names == (name,) and list(flat.processes) == ranks and flat.client is mesh.client
    shown = f"{ranks[0]}..{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
    assert repr(mesh) == f"<DeviceMesh {mesh.shape} ranks {shown}>"
    assert str(mesh) == f"DeviceMesh {mesh.shape}\n{mesh.to_table()}"


# =========================================================================================
# Documented examples
# =========================================================================================

def test_from_sizes_and_size():
    mesh = DeviceMesh.from_sizes(host=2, gpu=2)
    assert mesh.names == ("host", "gpu") and mesh.sizes == {"host": 2, "gpu": 2}
    assert mesh.size(["host", "gpu"]) == 4
    assert mesh.size() == len(mesh) == 4 and mesh.size("gpu") == 2 and mesh.size(("gpu",)) == 2
    assert mesh.size([]) == 1
    assert mesh.processes == Slice(offset=0, sizes=[2, 2], strides=[2, 1])
    assert DeviceMesh.from_sizes(host=2, gpu=4).processes == Slice.new_row_major([2, 4])
    client = object()
    assert DeviceMesh.from_sizes(client, x=3).client is client
    unit = DeviceMesh.from_sizes()
    assert unit.names == () and len(unit) == 1 and list(unit.processes) == [0]


def test_meshes_compare_by_identity():
    a, b = DeviceMesh.from_sizes(host=2), DeviceMesh.from_sizes(host=2)
    assert a == a and a != b and a.shape == b.shape
    assert len({a, b}) == 2


def test_m8_mesh_index():
    mesh = mesh_of(0, [2, 3, 4], [12, 4, 1], ("a", "b", "c"))
    fake = list(range(24))
    point = mesh.slice(a=0, b=0, c=0)
    assert point.names == () and list(point.processes) == [0] and len(point) == 1
    row = mesh.slice(a=0, b=0)
    assert row.names == ("c",) and list(row.processes) == fake[0:4]
    evens = mesh.slice(c=slice(None, None, 2))
    assert evens.names == ("a", "b", "c") and list(evens.processes) == fake[::2]
    assert list(mesh.slice(b=2, c=3).processes) == [11, 23]
    assert mesh.slice(b=2, c=3).names == ("a",)
    # keyword order: slicing a then b is b then a
    assert list(mesh.slice(a=1, b=slice(1, 3)).processes) == list(mesh.slice(b=slice(1, 3), a=1).processes)


def test_m3_rename_keeps_processes():
    mesh = mesh_of(0, [60, 24], [24, 1], ("host", "gpu"))
    renamed = mesh.rename(host="dp", gpu="tp")
    assert renamed.names == ("dp", "tp") and renamed.processes == mesh.processes
    assert renamed.client is mesh.client and renamed.fleet is mesh.fleet


def test_m4_split_examples():
    mesh = mesh_of(0, [60, 24], [24, 1], ("host", "gpu"))
    for kw, sizes, strides in [({"pp": 4}, [15, 4, 24], [96, 24, 1]),
                               ({"dp": 4}, [4, 15, 24], [360, 24, 1]),
                               ({"dp": 60}, [60, 1, 24], [24, 24, 1]),
                               ({"pp": 60}, [1, 60, 24], [1440, 24, 1])]:
        got = mesh.split(host=("dp", "pp"), gpu=("tp",), **kw)
        assert got.names == ("dp", "pp", "tp")
        assert list(got.processes.sizes) == sizes and list(got.processes.strides) == strides
        assert list(got.processes) == list(mesh.processes)


def test_m4_split_of_a_sub_mesh_preserves_ranks():
    mesh = DeviceMesh.from_sizes(host=4, gpu=8).slice(host=slice(1, 3), gpu=slice(0, 8, 2))
    assert list(mesh.processes) == [8, 10, 12, 14, 16, 18, 20, 22]
    got = mesh.split(gpu=("a", "b"), a=2)
    assert got.sizes == {"host": 2, "a": 2, "b": 2}
    assert list(got.processes.strides) == [8, 4, 2]
    assert list(got.processes) == list(mesh.processes)


@pytest.mark.parametrize("offset, sizes, strides", [(0, [100], [1]), (100, [8, 4, 2], [8, 2, 1]), (1, [4, 2], [2, 1])])
def test_m5_flatten_good(offset, sizes, strides):
    mesh = mesh_of(offset, sizes, strides, tuple(f"dim{d}" for d in range(len(sizes))))
    flat = mesh.flatten("outer")
    assert flat.names == ("outer",)
    assert list(flat.processes.strides) == [1]
    assert list(flat.processes) == list(mesh.processes)


@pytest.mark.parametrize("offset, sizes, strides", [(0, [100], [2]), (0, [64, 32], [64, 1])])
def test_m5_flatten_bad(offset, sizes, strides):
    mesh = mesh_of(offset, sizes, strides, tuple(f"dim{d}" for d in range(len(sizes))))
    with pytest.raises(ValueError, match="cannot flatten sparse mesh"):
        mesh.flatten("bad_dim")


def test_flatten_of_a_dense_sub_mesh():
    mesh = DeviceMesh.from_sizes(host=2, gpu=4).slice(host=1)
    assert mesh.flatten("r").processes == Slice(offset=4, sizes=[4], strides=[1])
    with pytest.raises(ValueError, match="cannot flatten sparse mesh"):
        DeviceMesh.from_sizes(host=2, gpu=4).slice(gpu=slice(0, 2)).flatten("r")


def test_repr_str_and_table_show_the_rank_grid():
    mesh = DeviceMesh.from_sizes(host=2, gpu=2)
    assert repr(mesh) == "<DeviceMesh {host=2, gpu=2} ranks 0..3>"
    table = ("       | gpu: 0 1\n"
             "host=0 |      0 1\n"
             "host=1 |      2 3")
    assert mesh.to_table() == table
    assert str(mesh) == "DeviceMesh {host=2, gpu=2}\n" + table


def test_repr_of_sparse_and_large_meshes_lists_ranks():
    mesh = DeviceMesh.from_sizes(zone=2, host=2, gpu=4).slice(gpu=slice(0, 4, 2))
    assert repr(mesh) == "<DeviceMesh {zone=2, host=2, gpu=2} ranks 0, 2, 4, 6, 8, 10, 12, 14>"
    assert mesh.to_table() == ("              | gpu:  0  1\n"
                               "zone=0,host=0 |       0  2\n"
                               "zone=0,host=1 |       4  6\n"
                               "zone=1,host=0 |       8 10\n"
                               "zone=1,host=1 |      12 14")
    big = DeviceMesh.from_sizes(x=2, y=16).slice(y=slice(0, 16, 2))
    assert repr(big) == "<DeviceMesh {x=2, y=8} ranks 0, 2, 4, 6, 8, 10, ..., 26, 28, 30>"
    assert repr(DeviceMesh.from_sizes()) == "<DeviceMesh {} ranks 0>"
    assert DeviceMesh.from_sizes(gpu=4).to_table() == "gpu: 0 1 2 3\n     0 1 2 3"
    assert DeviceMesh.from_sizes(gpu=1).slice(gpu=0).to_table() == "(no dims) rank 0"


def test_dims_named_like_parameters():
    mesh = DeviceMesh.from_sizes(self=2, gpu=3)
    assert list(mesh.slice(self=1).processes) == [3, 4, 5]
    assert mesh.rename(self="host").names == ("host", "gpu")
    assert mesh.split(self=("a", "b"), a=2).sizes == {"a": 2, "b": 1, "gpu": 3}


# =========================================================================================
# Error paths
# =========================================================================================

def test_mesh_errors():
    mesh = DeviceMesh.from_sizes(host=2, gpu=8)
    with pytest.raises(TypeError, match="DeviceMesh needs a Shape, got Slice"):
        DeviceMesh(Slice.new_row_major([2]))
    for exc in (KeyError, ValueError, UnknownDimError):
        with pytest.raises(exc, match=r"mesh has no dim 'rack'; its dims are \['host', 'gpu'\]"):
            mesh.size("rack")
        with pytest.raises(exc, match=r"mesh has no dim 'rack'"):
            mesh.slice(rack=0)
    with pytest.raises(KeyError, match=r"mesh has no dim 'host'; its dims are \['gpu'\]"):
        mesh.slice(host=0).slice(host=1)
    with pytest.raises(IndexError, match=r"index 8 out of range for dim 'gpu' of size 8"):
        mesh.slice(gpu=8)
    with pytest.raises(ValueError, match=r"slice 1:1 of dim 'gpu' \(size 8\) selects no ranks"):
        mesh.slice(gpu=slice(1, 1))
    with pytest.raises(ValueError, match=r"must have a positive step, got -1"):
        mesh.slice(gpu=slice(None, None, -1))
    with pytest.raises(ValueError, match="Cannot infer size of dims"):
        mesh.split(host=("dp", "pp"))
    with pytest.raises(ValueError, match="Duplicate dimension name 'gpu'"):
        mesh.rename(host="gpu")
    with pytest.raises(KeyError, match="mesh has no dim 'rack'"):
        mesh.rename(rack="r")

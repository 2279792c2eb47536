"""Shared hypothesis strategies for the pure geometry modules (Slice, Shape, meshes).

Every strategy here draws *valid* values by construction (no rejection sampling, no
``filter``), and keeps them small (sizes 1..5, at most 4 dims, offsets below 41) so that a
property test of a couple of hundred examples runs in well under a second.

Slices are built innermost-first: ``stride_0 >= 1`` and
``stride_k = stride_{k-1} * q_k`` with ``q_k >= size_{k-1}``, then the dims are permuted
consistently (sizes and strides together), so every dim order appears.  With
``nested=True``, ``q_k`` is a multiple of ``size_{k-1}`` (``stride_k = extent_{k-1} * m_k``,
the generator of MONARCH_NOTES §4.1); such slices can always be split.
"""

from __future__ import annotations

import functools
import itertools

from hypothesis import settings
from hypothesis import strategies as st

from tdmesh.geometry.shape import Shape
from tdmesh.geometry.slice import Slice
from tdmesh.mesh import DeviceMesh

__all__ = [
    "PROPS", "NAME_POOL", "slices", "dense_slices", "dim_names", "shapes", "dense_shapes",
    "meshes", "dense_meshes", "raw_triples", "pyslices", "factorizations",
    "grid", "model_at", "model_select", "UNREPRESENTABLE",
]

#: settings for the property tests: about 200 examples, no per-example deadline
#: (CI machines are slow and shared), no example database written into the repo.
PROPS = settings(max_examples=200, deadline=None, database=None)

#: names that dims are drawn from: short, readable, and including names that collide with
#: Python parameter names of the geometry API (``self``, ``label``, ``name``, ``dims``).
NAME_POOL = ("host", "gpu", "zone", "dp", "pp", "tp", "a", "b", "c", "x", "y", "z",
             "self", "label", "name", "dims", "_d0")

MAX_SIZE = 5
MAX_NDIM = 4


@st.composite
def slices(draw, *, min_ndim: int = 0, max_ndim: int = MAX_NDIM, max_size: int = MAX_SIZE,
           sizes=None, nested: bool = False, max_offset: int = 40) -> Slice:
    """A valid :class:`Slice`; ``sizes`` fixes the sizes in dim order (strides are drawn)."""
    if sizes is None:
        ndim = draw(st.integers(min_ndim, max_ndim))
        sizes = [draw(st.integers(1, max_size)) for _ in range(ndim)]
    sizes = list(sizes)
    ndim = len(sizes)
    # order[j] is the mesh dim that is the j-th innermost
    order = draw(st.permutations(range(ndim)))
    inner_sizes = [sizes[d] for d in order]
    inner_strides: list[int] = []
    for j, _size in enumerate(inner_sizes):
        if j == 0:
            stride = draw(st.integers(1, 3))
        else:
            prev_stride, prev_size = inner_strides[-1], inner_sizes[j - 1]
            m = draw(st.integers(1, 3))
            extra = 0 if nested else draw(st.integers(0, 2))
            stride = prev_stride * (prev_size * m + extra)
        inner_strides.append(stride)
    strides = [0] * ndim
    for j, d in enumerate(order):
        strides[d] = inner_strides[j]
    offset = draw(st.integers(0, max_offset))
    return Slice(offset=offset, sizes=sizes, strides=strides)


@st.composite
def dense_slices(draw, *, min_ndim: int = 0, max_ndim: int = MAX_NDIM, max_size: int = MAX_SIZE,
                 max_offset: int = 40) -> Slice:
    """A row-major (contiguous) slice with a random offset."""
    ndim = draw(st.integers(min_ndim, max_ndim))
    sizes = [draw(st.integers(1, max_size)) for _ in range(ndim)]
    return Slice.new_row_major(sizes, offset=draw(st.integers(0, max_offset)))


#: a single dim name: mostly from the pool, sometimes a fresh identifier
dim_names = st.one_of(
    st.sampled_from(NAME_POOL),
    st.builds("{}{}".format, st.sampled_from(["d", "dim_", "_", "x"]), st.integers(0, 20)),
)


@functools.cache
def _label_tuples(ndim: int) -> list[tuple[str, ...]]:
    return list(itertools.permutations(NAME_POOL, ndim))


@st.composite
def shapes(draw, *, min_ndim: int = 0, max_ndim: int = MAX_NDIM, dense: bool = False,
           nested: bool = False) -> Shape:
    """A :class:`Shape` with distinct identifier labels over a valid (or dense) slice.

    Labels are one draw from every ordered choice of ``ndim`` pool names (fast to
    generate, and shrinks towards the first names of the pool)."""
    if dense:
        sl = draw(dense_slices(min_ndim=min_ndim, max_ndim=max_ndim))
    else:
        sl = draw(slices(min_ndim=min_ndim, max_ndim=max_ndim, nested=nested))
    choices = _label_tuples(sl.ndim)
    return Shape(choices[draw(st.integers(0, len(choices) - 1))], sl)


def dense_shapes(**kw) -> st.SearchStrategy[Shape]:
    """A dense mesh geometry: ranks ``offset..offset+N-1`` in row-major order."""
    return shapes(dense=True, **kw)


def meshes(**kw) -> st.SearchStrategy[DeviceMesh]:
    """A client-less :class:`DeviceMesh` over :func:`shapes` (same keywords)."""
    return st.builds(DeviceMesh, shapes(**kw))


def dense_meshes(**kw) -> st.SearchStrategy[DeviceMesh]:
    """A client-less dense :class:`DeviceMesh`: ranks ``offset..offset+N-1``."""
    return meshes(dense=True, **kw)


#: arbitrary small ``(offset, sizes, strides)`` triples, valid or not: for checking that
#: whatever the constructor accepts behaves (it may reject more than strictly necessary)
raw_triples = st.integers(0, 4).flatmap(lambda n: st.tuples(
    st.integers(0, 20),
    st.lists(st.integers(1, 4), min_size=n, max_size=n),
    st.lists(st.integers(0, 30), min_size=n, max_size=n),
))


def pyslices(size: int) -> st.SearchStrategy[slice]:
    """Python slices with positive (or omitted) steps, bounds possibly out of range/negative."""
    bound = st.one_of(st.none(), st.integers(-size - 2, size + 2))
    return st.builds(slice, bound, bound, st.one_of(st.none(), st.integers(1, size + 1)))


def factorizations(n: int, parts: int) -> list[list[int]]:
    """Every ordered way of writing ``n`` as a product of ``parts`` positive ints."""
    if parts == 1:
        return [[n]]
    out = []
    for f in range(1, n + 1):
        if n % f == 0:
            out.extend([f] + rest for rest in factorizations(n // f, parts - 1))
    return out


# -- reference models (independent of the code under test) -------------------------------

def grid(s: Slice) -> list[tuple[tuple[int, ...], int]]:
    """``(coords, rank)`` of every point of ``s`` in row-major coordinate order, computed
    from the definition ``rank = offset + sum(c_k * stride_k)``."""
    return [(coords, s.offset + sum(c * k for c, k in zip(coords, s.strides)))
            for coords in itertools.product(*(range(n) for n in s.sizes))]


def model_at(entries, dim: int, index: int):
    """``at`` on a list of ``(coords, rank)``: keep ``coords[dim] == index``, drop the dim."""
    return [(c[:dim] + c[dim + 1:], r) for c, r in entries if c[dim] == index]


def model_select(entries, dim: int, positions: range):
    """``select`` on a list of ``(coords, rank)``: keep ``coords[dim]`` in ``positions``
    and renumber it by its place in ``positions``."""
    where = {p: i for i, p in enumerate(positions)}
    return [(c[:dim] + (where[c[dim]],) + c[dim + 1:], r) for c, r in entries if c[dim] in where]


#: the message of a select whose strided result the Slice constructor cannot represent
#: (Monarch's rules: strides must divide each other and nest; see test_slice.py)
UNREPRESENTABLE = r"not rectangular|smaller than the extent"

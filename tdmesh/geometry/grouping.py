"""Which ranks talk to which: process-group membership and ``to_mesh`` pairing.

Pure arithmetic over :class:`~tdmesh.geometry.shape.Shape`, shared by the client (to check
arguments) and the worker (to build ``torch.distributed`` groups).  Reducing a mesh
over dims ``D`` means: every rank talks to the ranks whose coordinates agree with its
own on every dim *outside* ``D``.  Those sets partition the mesh.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from .shape import Shape
from .slice import Slice, ravel

__all__ = ["normalize_dims", "group_members", "all_groups", "dims_rank", "to_mesh_plan", "to_mesh_pairs"]


def normalize_dims(shape: Shape, dims: None | str | Iterable[str]) -> tuple[str, ...]:
    """``dims`` as a tuple in the mesh's own dim order; ``()``/``None`` means every dim.

    Unknown or repeated dims raise, naming the mesh's dims.
    """
    if dims is None:
        return shape.labels
    if isinstance(dims, str):
        dims = (dims,)
    dims = tuple(dims)
    if not dims:
        return shape.labels
    for d in dims:
        shape.dim(d)
    if len(set(dims)) != len(dims):
        raise ValueError(f"dims {list(dims)} name a dim twice; mesh dims are {list(shape.labels)}")
    return tuple(d for d in shape.labels if d in dims)


def group_members(shape: Shape, rank: int, dims: Iterable[str]) -> list[int]:
    """The ranks that share ``rank``'s group over ``dims``, ordered row-major by their
    coordinates on ``dims`` (taken in the mesh's dim order)."""
    dims = normalize_dims(shape, dims)
    coords = shape.coordinates(rank)
    fixed = {d: c for d, c in coords.items() if d not in dims}
    return shape.index(**fixed).ranks()


def all_groups(shape: Shape, dims: Iterable[str]) -> list[list[int]]:
    """Every group over ``dims``, in row-major order of the other dims' coordinates.

    Every rank can compute this list identically, which is what a collective
    ``new_group`` call sequence needs.
    """
    dims = normalize_dims(shape, dims)
    outer = [d for d in shape.labels if d not in dims]
    sizes = [shape.sizes[d] for d in outer]
    return [shape.index(**dict(zip(outer, coords))).ranks()
            for coords in itertools.product(*(range(n) for n in sizes))]


def dims_rank(shape: Shape, rank: int, dims: str | Sequence[str]) -> int:
    """``rank``'s coordinate along ``dims``, combined row-major in the *given* order."""
    if isinstance(dims, str):
        dims = (dims,)
    coords = shape.coordinates(rank)
    for d in dims:
        shape.dim(d)
    return ravel([coords[d] for d in dims], [shape.sizes[d] for d in dims])


def to_mesh_plan(src: Shape, dst: Shape) -> list[tuple[Slice, Slice]]:
    """How ``to_mesh`` moves a tensor from ``src`` to ``dst``.

    Returns ``(from_ranks, to_ranks)`` pairs of equal length: ``from_ranks[i]`` sends to
    ``to_ranks[i]``.  Dims are matched by name; every ``src`` dim must be in ``dst`` with
    the same size; ``dst`` dims that ``src`` lacks are broadcast, one pair per assignment
    of their coordinates.
    """
    missing = [d for d in src.labels if d not in dst.labels]
    if missing:
        raise ValueError(f"destination mesh does not have dimensions {missing} of the source "
                         f"(source dims {list(src.labels)}, destination dims {list(dst.labels)})")
    for d in src.labels:
        if src.sizes[d] != dst.sizes[d]:
            raise ValueError(f"dimension {d!r} of the destination mesh has a different length "
                             f"({dst.sizes[d]}) than the source ({src.sizes[d]})")
    shared = [d for d in dst.labels if d in src.labels]
    broadcast = [d for d in dst.labels if d not in src.labels]
    from_ranks = Slice(offset=src.slice.offset,
                       sizes=[src.sizes[d] for d in shared],
                       strides=[src.slice.strides[src.dim(d)] for d in shared])
    plan = []
    for coords in itertools.product(*(range(dst.sizes[d]) for d in broadcast)):
        to_ranks = dst.index(**dict(zip(broadcast, coords))).slice
        plan.append((from_ranks, to_ranks))
    return plan


def to_mesh_pairs(src: Shape, dst: Shape) -> list[tuple[int, int]]:
    """Every ``(source rank, destination rank)`` transfer of ``to_mesh``, in plan order."""
    return [(f, t) for from_ranks, to_ranks in to_mesh_plan(src, dst) for f, t in zip(from_ranks, to_ranks)]

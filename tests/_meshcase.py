"""Shape-generic helpers for the suites that run on the ``cmesh`` fixture (tests/conftest.py).

``cmesh`` has dims ``("host", "gpu")`` and the shape that ``TDMESH_TEST_MESH=HOSTSxGPUS``
asks for (default 2x2).  A coordinate is a ``(host, gpu)`` tuple; every coordinate, group and
expected value of those suites is derived from the mesh's sizes with these helpers, never
hard-coded for one shape.

Workers import the test modules (to run their remote functions), and with them this module:
keep it free of anything a worker could not import.
"""

from __future__ import annotations

import pytest

from tdmesh import fetch_shard

DIMS = ("host", "gpu")


def check_dims(mesh) -> None:
    assert tuple(mesh.names) == DIMS, f"the cmesh suites expect dims {DIMS}, got {mesh.names}"


def shape_text(mesh) -> str:
    """``"HOSTSxGPUS"``, as ``TDMESH_TEST_MESH`` spells it."""
    return f"{mesh.size('host')}x{mesh.size('gpu')}"


def coords(mesh) -> list[tuple[int, int]]:
    """Every ``(host, gpu)`` of the mesh, in rank order."""
    return [(h, g) for h in range(mesh.size("host")) for g in range(mesh.size("gpu"))]


def rank_of(mesh, h: int, g: int) -> int:
    """The global rank at ``(h, g)`` (local_mesh's meshes are dense and row-major)."""
    return h * mesh.size("gpu") + g


def at(**coordinate: int) -> tuple[int, int]:
    """``at(host=1, gpu=0) == (1, 0)``: a coordinate from keywords, as tests with a variable dim spell it."""
    return coordinate["host"], coordinate["gpu"]


def shard(c: tuple[int, int]) -> dict:
    return {"host": c[0], "gpu": c[1]}


def other(dim: str) -> str:
    """The mesh's other dim."""
    return DIMS[1 - DIMS.index(dim)]


def members(mesh, dims, h: int, g: int) -> list[tuple[int, int]]:
    """The coordinates of ``(h, g)``'s group over ``dims`` (a name, a tuple, ``()`` = every
    dim), in coordinate order: the order of a stack and of group ranks."""
    if isinstance(dims, str):
        dims = (dims,)
    dims = tuple(dims) or DIMS
    hosts = range(mesh.size("host")) if "host" in dims else [h]
    gpus = range(mesh.size("gpu")) if "gpu" in dims else [g]
    return [(hh, gg) for hh in hosts for gg in gpus]


def group_dim(mesh, prefer: str = "gpu") -> str:
    """``prefer``, or the other dim when only that one has size >= 2: the dim whose groups
    have real peers.  Unlike :func:`wide_dim` it never skips (a 1x1 mesh gets ``prefer``)."""
    if mesh.size(prefer) < 2 and mesh.size(other(prefer)) >= 2:
        return other(prefer)
    return prefer


def wide_dim(mesh, prefer: str = "gpu", needs: str = "a dim of size >= 2") -> str:
    """A dim of size >= 2, ``prefer`` when it has one; skips the test on a mesh without one."""
    for d in (prefer, other(prefer)):
        if mesh.size(d) >= 2:
            return d
    pytest.skip(f"needs {needs}; the mesh is {shape_text(mesh)} (host x gpu)")


def fetch_every(obj, mesh) -> dict:
    """``{(host, gpu): value}``: one fetch per rank of ``mesh``, all in flight at once."""
    futures = {c: fetch_shard(obj, host=c[0], gpu=c[1]) for c in coords(mesh)}
    return {c: f.result() for c, f in futures.items()}


def rows(x, n: int, view: bool = False):
    """``x`` (local or remote) as ``n`` distinct rows, as a scatter over a group of ``n``
    needs: ``x.reshape(n, -1)`` (``x.view`` with ``view=True``) when ``n`` divides its size,
    else ``n`` shifted copies of its values.  Used identically on the workers' tensors (under
    the mesh's activation) and on the local expectations."""
    import torch
    if x.numel() % n == 0:
        return x.view(n, -1) if view else x.reshape(n, -1)
    return x.reshape(1, -1) + 1000 * torch.arange(n, dtype=x.dtype).view(n, 1)

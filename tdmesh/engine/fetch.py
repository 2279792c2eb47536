"""Getting values back: ``fetch_shard``, ``inspect``, ``fetch_all`` and ``show``.

Also the two helpers every call that reads remote tensors shares: which mesh it runs on
(``mesh_of``) and the checks and process groups its arguments need (``prepare_call``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

from ..errors import UnknownDimError, user_line
from ..protocol import messages as m
from .coalescing import check_not_coalescing
from .context import active_mesh_or_none
from .future import Future
from .issue import issue
from .placement import check_inputs
from .settle import pending, settle
from .stream import get_active_stream
from .tensor import Tensor, describe, raise_in_op
from .wire import sealed_args

__all__ = ["fetch_shard", "inspect", "fetch_all", "show", "send_value", "shard_rank", "mesh_of", "prepare_call"]


def mesh_of(flat) -> Any:
    """The mesh a call with these (flattened) arguments runs on: its tensors' (all on one
    mesh), else the active mesh, else a mesh passed as an argument."""
    mesh = None
    for x in flat:
        if isinstance(x, torch.Tensor):
            if type(x) is not Tensor:
                raise_in_op("LOCAL_TENSOR", f"remote functions take tensors on the mesh, got {describe(x)}")
            if mesh is None:
                mesh = x._mesh
            elif x._mesh is not mesh:
                raise_in_op("WRONG_MESH", f"remote function arguments live on two meshes "
                                          f"({mesh.shape} and {x._mesh.shape})")
    if mesh is None:
        mesh = active_mesh_or_none()
    if mesh is None:  # no tensors, no active mesh: a mesh argument says where
        mesh = next((x for x in flat if _travels_as_mesh(x)), None)
    if mesh is None:
        raise ValueError(f"Remote functions require an active device mesh, use `with mesh.activate():`\n"
                         f"  at {user_line()}")
    return mesh


def _travels_as_mesh(x) -> bool:
    wire = getattr(x, "_tdmesh_wire", None)
    return wire is not None and getattr(x, "client", None) is not None and type(wire()) is m.MeshArg


def prepare_call(flat, mesh, stream) -> tuple[list, tuple, tuple]:
    """Checks shared by remote calls and fetches: placement and borrow rules of the tensor
    arguments, and creation of the process groups that arguments need (once per stream).
    Returns the tensor arguments, the groups, and the refs of worker-resident objects
    (``mesh.spawn``) among the arguments, which the call uses as it uses its tensors."""
    remote_args = [x for x in flat if type(x) is Tensor]
    check_inputs(remote_args, mesh, "a remote function", stream)
    groups = []
    objects = []
    for x in flat:
        needs = getattr(x, "_tdmesh_groups", None)
        if needs is not None:
            group = needs(mesh.client, stream.id)
            if group is not None:
                groups.append(group)
        ref = getattr(x, "_tdmesh_object_ref", None)
        if ref is not None:
            if x.mesh is not mesh or x.stream is not stream:
                raise_in_op("WRONG_MESH" if x.mesh is not mesh else "WRONG_STREAM",
                            f"{x!r} lives on {x.mesh.shape}, {x.stream!r}; this call runs on {mesh.shape}, "
                            f"{stream!r}")
            objects.append(ref)
    return remote_args, tuple(groups), tuple(objects)


def shard_rank(mesh, shard: dict | None, coords: dict) -> int:
    shard = dict(shard or {})
    shard.update(coords)
    if not shard:
        return mesh.processes.offset
    unknown = [d for d in shard if d not in mesh.names]
    if unknown:
        raise UnknownDimError(f"fetch_shard got dims {unknown} that the mesh does not have; its dims are "
                              f"{list(mesh.names)}")
    missing = [d for d in mesh.names if d not in shard]
    if missing:
        raise ValueError(f"Missing key(s) {missing} in shard {shard}: name every dim of the mesh "
                         f"{list(mesh.names)}, or none for its first rank")
    return mesh.shape.index(**shard).slice.offset


def send_value(mesh, function, args, kwargs, rank: int | None, uses: tuple = (), flush: bool = True) -> Future:
    """A SendValue to one rank (``rank=None``: every rank of ``mesh``, gathered into a
    ValueMesh), on the stream of the tensors it reads (else the active one); ``uses`` are
    refs it reads that no proxy holds yet.  ``flush=False``: sent with the ops that follow (by
    the flusher), for a value not waited on at once."""
    check_not_coalescing("fetching results")
    if pending:  # a fault-tolerant step not yet confirmed: settled first (settle.py)
        settle()
    client = mesh.client
    flat, _ = tree_flatten((args, kwargs))
    tensors = [x for x in flat if type(x) is Tensor]
    stream = tensors[0].stream if tensors else get_active_stream()
    _, groups, objects = prepare_call(flat, mesh, stream)
    fut = Future(client)
    if rank is None:
        fut.gather = mesh.shape
    sealed = sealed_args(args, kwargs)
    with client.lock:
        issue(mesh, lambda seq, results, mutated: m.SendValue(seq, (), function, sealed, {}, stream.id, groups),
              inputs=tensors, stream=stream, ranks=None if rank is None else (rank,), future=fut, deletes_first=True,
              uses=tuple(uses) + objects)
        client.request_status(client.last_seq)  # the SendValue's: completion resolves the future
        if flush:
            client.flush()
    return fut


def fetch_shard(obj, shard: dict | None = None, **coords) -> Future:
    """A future for ``obj`` (a pytree of remote tensors) as seen by one rank of its mesh.

    ``shard=None`` means the mesh's first rank; otherwise name every dim.  Tensors come
    back on CPU, holding only their own elements.
    """
    flat, _ = tree_flatten(obj)
    if not any(type(x) is Tensor for x in flat) and active_mesh_or_none() is None:
        fut = Future(None)
        fut._set_result(obj)
        return fut
    mesh = mesh_of(flat)
    rank = shard_rank(mesh, shard, coords)
    return send_value(mesh, None, (obj,), {}, rank)


def inspect(obj, shard: dict | None = None, **coords):
    """``fetch_shard(obj, shard, **coords).result()``."""
    return fetch_shard(obj, shard, **coords).result()


def fetch_all(obj) -> Future:
    """A future of ``obj``'s value on every rank of its mesh: a ValueMesh of (point, value)."""
    flat, _ = tree_flatten(obj)
    return send_value(mesh_of(flat), None, (obj,), {}, None)


def show(obj, max_chars: int = 60) -> str:
    """``obj`` (a tdmesh tensor or pytree of them) on every rank, as a table: one row per rank.

    Blocks like :func:`inspect`.  Scalars print as values, small tensors in full, large ones
    as shape, dtype and a summary (min / mean / max).
    """
    values = fetch_all(obj).result()
    with _disable_current_modes():  # the fetched values are local, whatever mesh is active
        return _table(values, max_chars)


def _table(values, max_chars: int) -> str:
    names = list(values.shape.labels)
    rows = []
    for point, value in values:
        rows.append(([str(point[n]) for n in names], _summary(value, max_chars)))
    widths = [max(len(n), *(len(r[0][i]) for r in rows)) for i, n in enumerate(names)]
    head = "  ".join(n.rjust(w) for n, w in zip(names, widths)) + "  | value"
    lines = [head, "-" * len(head)]
    for coords, text in rows:
        lines.append("  ".join(c.rjust(w) for c, w in zip(coords, widths)) + "  | " + text)
    return "\n".join(lines)


def _summary(value, max_chars: int) -> str:
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            return repr(value.item())
        text = str(value.tolist())
        if len(text) <= max_chars:
            return text
        v = value.double()
        return (f"{list(value.shape)} {str(value.dtype).split('.')[1]}  min {v.min().item():.4g}  "
                f"mean {v.mean().item():.4g}  max {v.max().item():.4g}")
    text = repr(value)
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."

"""Getting values back: ``fetch_shard``, ``inspect`` and ``call_on_shard_and_fetch``."""

from __future__ import annotations

from torch.utils._pytree import tree_flatten

from . import messages as m
from ._context import active_mesh_or_none
from ._coalescing import check_not_coalescing
from .future import Future
from .remote import Remote, _mesh_of, prepare_call
from .stream import get_active_stream
from .tensor import Tensor, _wire, sealed_args, user_line

__all__ = ["fetch_shard", "inspect", "call_on_shard_and_fetch", "fetch_all", "show"]


def _shard_rank(mesh, shard: dict | None, coords: dict) -> int:
    shard = dict(shard or {})
    shard.update(coords)
    if not shard:
        return mesh.processes.offset
    unknown = [d for d in shard if d not in mesh.names]
    if unknown:
        from .shape import UnknownDimError
        raise UnknownDimError(f"fetch_shard got dims {unknown} that the mesh does not have; its dims are "
                              f"{list(mesh.names)}")
    missing = [d for d in mesh.names if d not in shard]
    if missing:
        raise ValueError(f"Missing key(s) {missing} in shard {shard}: name every dim of the mesh "
                         f"{list(mesh.names)}, or none for its first rank")
    return mesh.shape.index(**shard).slice.offset


def _send_value(mesh, function, args, kwargs, rank: int | None) -> Future:
    """A SendValue to one rank (``rank=None``: every rank of ``mesh``, gathered into a
    ValueMesh), on the stream of the tensors it reads (else the active one)."""
    check_not_coalescing("fetching results")
    client = mesh.client
    flat, _ = tree_flatten((args, kwargs))
    tensors = [x for x in flat if type(x) is Tensor]
    stream = tensors[0].stream if tensors else get_active_stream()
    _, groups = prepare_call(flat, mesh, stream)
    fut = Future(client)
    if rank is None:
        fut.gather = mesh.shape
    with client.lock:
        seq = client.new_seq()
        client.send(mesh, m.SendValue(seq, (), function, sealed_args(args, kwargs), {}, stream.id, groups), seq,
                    [t.ref for t in tensors], (), fut, ranks=None if rank is None else (rank,), deletes_first=True)
        client.request_status(seq)
        client.flush()
    return fut


def _send_value_all(mesh, function, args, kwargs) -> Future:
    """A SendValue to every rank of ``mesh``; the future gathers a ValueMesh."""
    return _send_value(mesh, function, args, kwargs, None)


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
    mesh = _mesh_of(flat)
    rank = _shard_rank(mesh, shard, coords)
    return _send_value(mesh, None, (obj,), {}, rank)


def inspect(obj, shard: dict | None = None, **coords):
    """``fetch_shard(obj, shard, **coords).result()``."""
    return fetch_shard(obj, shard, **coords).result()


def call_on_shard_and_fetch(remote_fn: Remote, *args, shard: dict | None = None, **kwargs) -> Future:
    """Run ``remote_fn`` on one rank and fetch what it returns (an Exception returned is a value)."""
    if not isinstance(remote_fn, Remote):
        raise TypeError(f"call_on_shard_and_fetch needs a tdmesh.remote function, got {remote_fn!r}\n  at {user_line()}")
    flat, _ = tree_flatten((args, kwargs))
    mesh = _mesh_of(flat)
    rank = _shard_rank(mesh, shard, {})
    return _send_value(mesh, remote_fn._target, args, kwargs, rank)


def fetch_all(obj) -> Future:
    """A future of ``obj``'s value on every rank of its mesh: a ValueMesh of (point, value)."""
    flat, _ = tree_flatten(obj)
    mesh = _mesh_of(flat)
    return _send_value_all(mesh, None, (obj,), {})


def show(obj, max_chars: int = 60) -> str:
    """``obj`` (a tdmesh tensor or pytree of them) on every rank, as a table: one row per rank.

    Blocks like :func:`inspect`.  Scalars print as values, small tensors in full, large ones
    as shape, dtype and a summary (min / mean / max).
    """
    from torch.utils._python_dispatch import _disable_current_modes
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
    import torch
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

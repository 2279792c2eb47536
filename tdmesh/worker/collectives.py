"""Collectives on mesh dims and point-to-point moves between meshes, on the worker.

A rank whose input is poisoned still takes part, with zeros of the right shape, so its
peers never hang; the client's dataflow history marks the output failed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..protocol import messages as m

_OPS = {
    "sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "band": dist.ReduceOp.BAND,
    "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR,
}
# torch 2.13 renamed all_gather_into_tensor; 2.11 only has the old name
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_LOCAL: dict[str, Callable[..., torch.Tensor]] = {
    "band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor,
    "sum": torch.add, "product": torch.mul, "min": torch.minimum, "max": torch.maximum}


_group_info: dict = {}


def clear_group_info() -> None:
    """Forget every group's (backend, size, rank): after its groups are destroyed, ids recur."""
    _group_info.clear()


def _info(group) -> tuple[str, int, int]:
    """(backend, size, this rank's group rank), looked up once per group: the hot path of a
    stream of small reduces should not walk torch.distributed's registries every time."""
    info = _group_info.get(id(group))
    if info is None:
        info = _group_info[id(group)] = (dist.get_backend(group), dist.get_world_size(group), dist.get_rank(group))
    return info


def _value_or_zeros(env: dict, ref, factory, device) -> tuple[torch.Tensor, bool]:
    value = env.get(ref)
    if not isinstance(value, torch.Tensor):  # missing, or a Poison: the failure is already known
        shape, dtype = factory
        return torch.zeros(shape, dtype=getattr(torch, dtype), device=device), True
    return value, False


def _all_reduce(y: torch.Tensor, reduction: str, group, n: int) -> None:
    """In place over ``group``; emulates what a backend lacks (gloo: avg; nccl: bitwise ops).

    Integer ``avg`` is the floor of the mean on every backend (``sum // n``, Python's rule);
    NCCL's own integer AVG would round toward zero, so results would depend on the device.
    A group of one (a dim of size 1) reduces nothing: no collective is run."""
    if n == 1:
        return
    backend = _info(group)[0]
    if reduction == "avg" and (backend == "gloo" or not (y.is_floating_point() or y.is_complex())):
        _backend_all_reduce(y, "sum", group)
        if y.is_floating_point() or y.is_complex():
            y.div_(n)
        else:
            y.floor_divide_(n)
        return
    if reduction in ("band", "bor", "bxor") and backend == "nccl":
        parts = _all_gather(y, group, n)
        acc = parts[0].clone()
        for i in range(1, n):
            acc = _LOCAL[reduction](acc, parts[i])
        y.copy_(acc)
        return
    _backend_all_reduce(y, reduction, group)


def _backend_all_reduce(y: torch.Tensor, reduction: str, group) -> None:
    if y.is_complex():
        dist.all_reduce(y, _OPS[reduction], group=group)  # torch views complex as real pairs
        return
    # What dist.all_reduce does after its checks (this rank is a member; y is one dense
    # tensor): its Python wrapper costs as much as a small NCCL all-reduce itself.
    group.allreduce([y], _OPTIONS[reduction]).wait()


def _options(op) -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    return opts


_OPTIONS = {name: _options(op) for name, op in _OPS.items()}


def _all_gather(x: torch.Tensor, group, n: int) -> torch.Tensor:
    """``[n, *x.shape]`` of every member's ``x`` in group-rank order (= coordinate order)."""
    if n == 1:
        return x.unsqueeze(0).clone(memory_format=torch.contiguous_format)
    flat = x.reshape(-1) if x.dim() == 0 else x.contiguous()
    out = torch.empty((n * flat.shape[0], *flat.shape[1:]), dtype=x.dtype, device=x.device)
    _gather_single(out, flat, group=group)  # concatenated along dim 0 (gloo and nccl)
    return out.view(n, *x.shape)


def reduce(interp, msg: m.Reduce, env: dict) -> None:
    group = interp.groups.by_id(msg.group)
    n = _info(group)[1]
    x, _ = _value_or_zeros(env, msg.tensor, msg.factory, interp.device)
    out = None
    if msg.out is not None:
        out, _ = _value_or_zeros(env, msg.out, _out_factory(msg, n), interp.device)
    if msg.reduction == "stack":
        if msg.scatter:  # all-to-all: row i goes to group rank i
            result = out if out is not None else torch.empty_like(x, memory_format=torch.contiguous_format)
            src = x.contiguous()
            if n == 1:
                result.copy_(src)
            elif result.is_contiguous():
                dist.all_to_all_single(result, src, group=group)
            else:
                tmp = torch.empty_like(src)
                dist.all_to_all_single(tmp, src, group=group)
                result.copy_(tmp)
        else:
            gathered = _all_gather(x, group, n)
            result = gathered if out is None else out.copy_(gathered)
        if msg.inplace:
            x.copy_(result)
            return
    elif msg.scatter:
        full = x.contiguous().clone() if x.is_contiguous() else x.contiguous()
        _all_reduce(full, msg.reduction, group, n)
        part = full[_info(group)[2]]
        result = part.clone() if out is None else out.copy_(part)
    else:
        if msg.inplace:
            target = x
        elif out is not None:
            target = out.copy_(x)
        else:
            target = x.clone(memory_format=torch.contiguous_format)
        _all_reduce_into(target, msg.reduction, group, n)
        result = target
    if msg.result is not None:
        env[msg.result] = result


def _all_reduce_into(x: torch.Tensor, reduction: str, group, n: int) -> None:
    """``_all_reduce`` of any tensor, through a contiguous copy where it is a strided view."""
    if x.is_contiguous():
        _all_reduce(x, reduction, group, n)
    else:
        tmp = x.contiguous()
        _all_reduce(tmp, reduction, group, n)
        x.copy_(tmp)


_BUCKET_BYTES = 32 << 20  # the most one flattened bucket holds (a copy of the tensors it packs)


def reduce_many(interp, msg: m.ReduceMany, env: dict) -> None:
    """``tdmesh.reduce_(list)``: tensors of one dtype are packed into flat buckets, each
    reduced by one collective and unpacked, instead of one collective per tensor."""
    group = interp.groups.by_id(msg.group)
    n = _info(group)[1]
    xs = [_value_or_zeros(env, ref, factory, interp.device)[0] for ref, factory in zip(msg.tensors, msg.factories)]
    if n == 1:
        return
    buckets: dict = {}  # (dtype, device) -> [(bytes, [tensors]), ...], the last one open
    for x in xs:
        size = x.numel() * x.element_size()
        if size >= _BUCKET_BYTES:  # big enough to travel alone (decided by size only: every
            # rank must run the same collectives, whether its tensor is a view or zeros)
            _all_reduce_into(x, msg.reduction, group, n)
            continue
        kind = buckets.setdefault((x.dtype, x.device), [])
        if not kind or kind[-1][0] + size > _BUCKET_BYTES:
            kind.append([0, []])
        kind[-1][0] += size
        kind[-1][1].append(x)
    for kind in buckets.values():
        for _, bucket in kind:
            if len(bucket) == 1:
                _all_reduce_into(bucket[0], msg.reduction, group, n)
                continue
            flat = torch._utils._flatten_dense_tensors(bucket)  # one C++ call each way, not one op per tensor
            _all_reduce(flat, msg.reduction, group, n)
            torch._foreach_copy_(bucket, torch._utils._unflatten_dense_tensors(flat, bucket))


def _out_factory(msg: m.Reduce, n: int) -> tuple:
    """Shape and dtype of the output: ``[n, *shape]`` for a stack, ``shape[1:]`` for a reduce-scatter."""
    shape, dtype = msg.factory
    if msg.reduction == "stack" and not msg.scatter:
        return (n, *shape), dtype
    if msg.scatter and msg.reduction != "stack":
        return tuple(shape[1:]), dtype
    return tuple(shape), dtype


def send_tensor(interp, msg: m.SendTensor, stream) -> None:
    """``to_mesh``: rank ``from_ranks[i]`` sends to ``to_ranks[i]``; a same-rank move is a copy;
    a rank of ``zeros_on`` that receives nothing binds zeros."""
    rank = interp.rank
    from_env = interp.stream(msg.from_stream).env if rank in msg.from_ranks else None
    to_env = interp.stream(msg.to_stream).env if binds_result(msg, rank) else None
    ops = []
    received = None
    if from_env is not None:
        x, _ = _value_or_zeros(from_env, msg.tensor, msg.factory, interp.device)
        dst = msg.to_ranks[msg.from_ranks.index(rank)]
        if dst == rank:
            received = x.clone()
        else:
            group = interp.groups.p2p(msg.from_stream, msg.to_stream)
            # a conjugate or negative view (x.conj(), torch._neg_view) goes as its values: c10d refuses such a
            # view, and the sender's refusal left its receiver waiting in the pair for good
            ops.append(dist.P2POp(dist.isend, x.resolve_conj().resolve_neg().contiguous(), dst, group))
    if rank in msg.to_ranks and received is None:
        src = msg.from_ranks[msg.to_ranks.index(rank)]
        shape, dtype = msg.factory
        received = torch.empty(shape, dtype=getattr(torch, dtype), device=interp.device)
        group = interp.groups.p2p(msg.from_stream, msg.to_stream)
        ops.append(dist.P2POp(dist.irecv, received, src, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    if to_env is not None:
        if received is None:
            shape, dtype = msg.factory
            received = torch.zeros(shape, dtype=getattr(torch, dtype), device=interp.device)
        to_env[msg.result] = received


def binds_result(msg: m.SendTensor, rank: int) -> bool:
    return rank in msg.to_ranks or (msg.zeros_on is not None and rank in msg.zeros_on)

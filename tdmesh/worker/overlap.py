"""Gradients reduced while the workers' own backward runs (``tdmesh.reduce_grads_in_backward``).

DDP's overlap, on each worker: the leaves to reduce are packed into buckets (DDP's sizes: the
first 1 MiB, then 25 MiB, in the order the client's graph reaches them, about the order backward
makes their gradients); a post-accumulate-grad hook counts each bucket's gradients, and a bucket
whose gradients are all there starts its all-reduce at once (asynchronously, from autograd's
thread), so the reduction overlaps the rest of backward.  Buckets start in order, as DDP's do:
every rank runs the same collectives in the same order whatever its timing, and a rank whose
backward failed still runs the ones left (with zeros), so no peer waits for it forever.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["Overlap", "join_with_zeros"]

FIRST_BUCKET_BYTES = 1 << 20  # torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES
BUCKET_BYTES = 25 << 20       # DistributedDataParallel(bucket_cap_mb=25)


class _Bucket:
    __slots__ = ("indices", "group", "size", "reduction", "left")

    def __init__(self, indices: list[int], group, size: int, reduction: str) -> None:
        self.indices = indices
        self.group = group
        self.size = size
        self.reduction = reduction
        self.left = len(indices)


def _buckets(nbytes: list[int], plans: list) -> list[_Bucket]:
    """The buckets of ``plans`` (``(leaf indices, process group, reduction)``) for leaves of ``nbytes``
    bytes each: every rank makes the same ones, in the same order."""
    buckets: list[_Bucket] = []
    for indices, group, reduction in plans:
        n = dist.get_world_size(group)
        if n == 1:
            continue  # a group of one reduces nothing
        current: list[int] = []
        total, limit = 0, FIRST_BUCKET_BYTES
        for i in indices:
            size = nbytes[i]
            if current and total + size > limit:
                buckets.append(_Bucket(current, group, n, reduction))
                current, total, limit = [], 0, BUCKET_BYTES
            current.append(i)
            total += size
        if current:
            buckets.append(_Bucket(current, group, n, reduction))
    return buckets


def join_with_zeros(specs: list[tuple[int, str]], plans: list, device) -> None:
    """A rank that cannot run this backward at all (an input of it failed upstream): it still runs every
    bucket's collective, with zeros, as its peers do (``specs``: each leaf's (elements, dtype name), as the
    client's proxies have them), so none of them waits for it.  The client's history marks the gradients
    failed on every rank: they depend on the failed value."""
    dtypes = [getattr(torch, dtype) for _, dtype in specs]
    buckets = _buckets([numel * dtype.itemsize for (numel, _), dtype in zip(specs, dtypes)], plans)
    works = [_zeros_reduced(b, sum(specs[i][0] for i in b.indices), dtypes[b.indices[0]], device)[1]
             for b in buckets]
    for work in works:
        work.wait()


def _zeros_reduced(bucket: _Bucket, numel: int, dtype, device) -> tuple:
    """A bucket's collective started with zeros (a rank without its gradients takes part so that no peer
    waits): (the flat zeros, the work)."""
    flat = torch.zeros(numel, dtype=dtype, device=device)
    return flat, dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=bucket.group, async_op=True)


class Overlap:
    """The buckets of one backward: ``plans`` are ``(leaf indices, process group, reduction)``."""

    def __init__(self, leaves: list, plans: list) -> None:
        self.leaves = leaves
        self.buckets = _buckets([leaf.numel() * leaf.element_size() for leaf in leaves], plans)
        self.bucket_of = {i: k for k, b in enumerate(self.buckets) for i in b.indices}
        self.started = 0  # buckets started so far (in order)
        self.works: list[tuple] = []
        self.handles = [leaves[i].register_post_accumulate_grad_hook(self._counter(i)) for i in self.bucket_of]

    def _counter(self, i: int):
        def ready(_leaf) -> None:
            self.buckets[self.bucket_of[i]].left -= 1
            while self.started < len(self.buckets) and self.buckets[self.started].left == 0:
                self._start(self.started, zeros=False)
                self.started += 1
        return ready

    def _start(self, k: int, zeros: bool) -> None:
        bucket = self.buckets[k]
        grads = [self.leaves[i].grad for i in bucket.indices]
        if zeros:
            first = self.leaves[bucket.indices[0]]
            flat, work = _zeros_reduced(bucket, sum(self.leaves[i].numel() for i in bucket.indices), first.dtype,
                                        first.device)
        else:
            if len(grads) == 1 and grads[0].is_contiguous():
                flat = grads[0]  # reduced in place
            else:
                flat = torch._utils._flatten_dense_tensors(grads)
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=bucket.group, async_op=True)
        self.works.append((work, flat, grads, bucket, zeros))

    def finish(self, failed: bool) -> bool:
        """After backward: start what is left (with zeros where this rank failed or a gradient
        never came), wait for every bucket and put the reduced gradients back; False where a
        bucket went with zeros (this backward's gradients are not valid)."""
        for handle in self.handles:
            handle.remove()
        while self.started < len(self.buckets):
            self._start(self.started, zeros=True)
            failed = True  # a bucket whose gradients did not all come: this backward's results are not valid
            self.started += 1
        for work, flat, grads, bucket, zeros in self.works:
            work.wait()
            if failed or zeros:
                continue
            if bucket.reduction == "avg":
                flat.div_(bucket.size)
            if flat is not grads[0]:
                torch._foreach_copy_(grads, torch._utils._unflatten_dense_tensors(flat, grads))
        return not failed

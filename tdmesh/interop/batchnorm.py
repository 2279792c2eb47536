"""``nn.SyncBatchNorm`` on a mesh normalises with the statistics of the whole batch: every rank's share of it,
over the mesh's dims (or the dims of the ``mesh.process_group(dims)`` given as its ``process_group``), as
SyncBatchNorm over a torchrun job's world does.  Before, it found no default process group on the client and
fell back to each rank's own statistics, silently (losses a few 1e-3 from global-batch BatchNorm's).

The statistics are two sums over the mesh (the mean, then the centred squares: no cancellation), each a
``reduce`` whose gradient is the same reduce of the gradient, so backward reduces as torch's
``SyncBatchNorm`` backward does; the running statistics take the global mean and unbiased variance.  Half
inputs keep their statistics in float32, as torch's kernels do.  On CPU meshes too (torch's own refuses CPU
tensors): a mesh of gloo workers is where SyncBatchNorm code is tried first.  Outside a mesh, in eval mode,
and on a one-rank group, it is torch's own.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..collectives import reduce
from ..engine.tensor import Tensor
from ..errors import UsageError, user_line

__all__ = ["install"]


class _MeshSum(torch.autograd.Function):
    """Sum over mesh dims, differentiable: the gradient of an all-reduce sum is the all-reduce sum of its
    gradient (each rank's loss depends on every rank's input through it)."""

    @staticmethod
    def forward(ctx, x, dims):
        ctx.dims = dims
        return reduce(x, dims, "sum")

    @staticmethod
    def backward(ctx, grad):
        return reduce(grad.contiguous(), ctx.dims, "sum"), None


def _dims(module, mesh) -> tuple:
    group = module.process_group
    if group is None:
        return tuple(mesh.names)
    if getattr(group, "mesh", None) is mesh and hasattr(group, "dims"):
        return tuple(group.dims)
    raise UsageError(f"SyncBatchNorm's process_group is {group!r}: on a mesh it synchronises over the mesh's dims "
                     f"(process_group=None) or over mesh.process_group(dims) of the input's mesh\n  at {user_line()}")


def _global_batch_norm(x, weight, bias, running_mean, running_var, momentum: float, eps: float, dims) -> Tensor:
    channels = x.shape[1]
    over = [0, *range(2, x.dim())]
    count = (x.numel() // channels) * x.mesh.size(dims)  # every rank's share has the same shape
    stats = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    shape = [1, channels] + [1] * (x.dim() - 2)
    mean = _MeshSum.apply(stats.sum(over), dims) / count
    centred = stats - mean.view(shape)
    var = _MeshSum.apply((centred * centred).sum(over), dims) / count
    out = centred * torch.rsqrt(var.view(shape) + eps)
    if weight is not None:
        out = out * weight.view(shape) + bias.view(shape)
    if running_mean is not None:
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(mean.detach().to(running_mean.dtype), alpha=momentum)
            unbiased = var.detach() * (count / max(count - 1, 1))
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    return out.to(x.dtype)


def _forward(original):
    @functools.wraps(original)
    def forward(self, input):
        if type(input) is not Tensor:
            return original(self, input)
        self._check_input_dim(input)
        self._check_non_zero_input_channels(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:  # as torch's forward
            self.num_batches_tracked.add_(1)
            factor = 1.0 / self.num_batches_tracked.item() if self.momentum is None else self.momentum
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        tracked = not self.training or self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None
        dims = _dims(self, input.mesh)
        if not (bn_training and self.training) or input.mesh.size(dims) == 1:  # torch does not sync these either
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, bn_training, factor,
                                self.eps)
        return _global_batch_norm(input, self.weight, self.bias, running_mean, running_var, factor, self.eps, dims)

    forward.__tdmesh_original__ = original
    return forward


def install() -> None:
    if not hasattr(torch.nn.SyncBatchNorm.forward, "__tdmesh_original__"):
        torch.nn.SyncBatchNorm.forward = _forward(torch.nn.SyncBatchNorm.forward)  # type: ignore[method-assign]

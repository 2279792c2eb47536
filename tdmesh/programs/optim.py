"""torch's optimizers on remote parameters take the paths they take for plain tensors.

``torch.optim`` picks its foreach (one kernel over a list of tensors) and fused paths only
for tensor types it lists (``_default_to_fused_or_foreach``), and ``torch.utils._foreach_utils``
keeps a second list that ``clip_grad_norm_`` and tensor grouping read.  A tdmesh tensor is not
in them, so every optimizer fell back to its single-tensor path: about 15 remote ops per
parameter per step instead of a handful per step.  Registering ``tdmesh.Tensor`` in both lists
(as ``torch.distributed.tensor`` registers DTensor, in its ``__init__``) makes the choice the
same as for plain tensors of the mesh's device type: foreach by default on CUDA meshes,
single-tensor by default on CPU ones (``foreach=True`` and ``fused=True`` work on both), and
each foreach or fused call is one remote op.  This is tdmesh's one registration with torch.
"""

from __future__ import annotations

import torch
import torch.optim.optimizer as _optimizer
import torch.utils._foreach_utils as _foreach_utils

from ..engine.tensor import Tensor

__all__ = ["register_foreach_support"]


def register_foreach_support() -> None:
    """Add ``tdmesh.Tensor`` to torch's lists of tensor types with foreach/fused kernels (idempotent)."""
    for supported in (_optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
        if Tensor not in supported:
            supported.append(Tensor)  # type: ignore[arg-type]  # (as DTensor's registration)


register_foreach_support()


def hyperparameters(opt) -> tuple:
    """An optimizer's Python-valued settings (``lr``, ``betas``, ``weight_decay`` ...): what a
    compiled step bakes into its recording, so a replay checks they are unchanged (a tensor
    ``lr`` is read where it is, so a scheduler's in-place updates need no check)."""
    return tuple(tuple((k, v) for k, v in group.items() if k != "params" and not isinstance(v, torch.Tensor))
                 for group in opt.param_groups)


def watch_optimizers(recorder):
    """Note each torch optimizer stepped while ``recorder`` traces, with its settings as the
    step reads them; returns the hook's handle (``.remove()`` when the trace ends)."""
    def seen(opt, args, kwargs):
        if id(opt) not in recorder.optimizers:
            recorder.optimizers[id(opt)] = (opt, hyperparameters(opt))
    return _optimizer.register_optimizer_step_pre_hook(seen)

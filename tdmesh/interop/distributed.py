"""The ``torch.distributed`` calls of a torchrun script, under an active mesh.

The client has no process group of its own (``dist.is_initialized()`` stays False: code that takes a
single-process path when it is, takes it), and its mesh is the world.  So, under an active mesh:

- ``all_reduce(t, op)`` of a mesh tensor reduces it in place over the whole mesh (``t.reduce_``), as the
  same call on every torchrun rank does; ``broadcast(t, src)`` gives every rank rank ``src``'s value;
  ``all_gather(list, t)`` fills the list with every rank's value, in rank order; ``barrier()`` returns at
  once (the client orders every op already); ``async_op=True`` gives a finished work handle.
- ``get_world_size()`` is the mesh's size; ``get_rank()`` has no answer (each rank's differs): refused,
  naming ``mesh.rank(dims)``; ``init_process_group`` is refused (the mesh is the job's group).
- ``DistributedDataParallel`` of a model on a mesh is refused, naming ``tdmesh.reduce_grads_in_backward``.

Anything else (a call on local tensors, another group) is torch's own.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..collectives import reduce, reduce_
from ..engine.context import active_mesh_or_none
from ..engine.tensor import Tensor
from ..errors import UsageError, user_line

__all__ = ["install"]

_REDUCTIONS = {"SUM": "sum", "AVG": "avg", "PRODUCT": "product", "MIN": "min", "MAX": "max", "BAND": "band",
               "BOR": "bor", "BXOR": "bxor"}


class _Done:
    """What ``async_op=True`` returns: the op is already issued, in order, on the mesh."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _world(tensor, group, what: str):
    """The mesh of a call on mesh tensors over the world, or None for torch's own (local tensors)."""
    if type(tensor) is not Tensor:
        return None
    if group is not None and group is not dist.group.WORLD:
        raise UsageError(f"torch.distributed.{what} of a mesh tensor over {group!r}: on a mesh, reduce over mesh "
                         f"dims with t.reduce_(dims, ...) (the group= of torch's calls is the world)\n"
                         f"  at {user_line()}")
    return tensor.mesh


def _all_reduce(original):
    @functools.wraps(original)
    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        mesh = _world(tensor, group, "all_reduce")
        if mesh is None:
            return original(tensor, op, group, async_op)
        name = _REDUCTIONS.get(str(op).split(".")[-1])
        if name is None:
            raise UsageError(f"torch.distributed.all_reduce with {op} has no tdmesh reduction; the reductions are "
                             f"{list(_REDUCTIONS)}\n  at {user_line()}")
        reduce_(tensor, mesh.names, name)
        return _Done() if async_op else None

    return all_reduce


def _broadcast(original):
    @functools.wraps(original)
    def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
        mesh = _world(tensor, group, "broadcast")
        if mesh is None:
            return original(tensor, src, group, async_op, group_src=group_src)
        rank = src if src is not None else group_src
        if rank is None or not 0 <= rank < len(mesh.rank_list):
            raise ValueError(f"broadcast from rank {rank}: the mesh has ranks 0..{len(mesh.rank_list) - 1}")
        with torch.no_grad():
            tensor.copy_(tensor.slice_mesh(**mesh.shape.coordinates(mesh.rank_list[rank])).to_mesh(mesh))
        return _Done() if async_op else None

    return broadcast


def _all_gather(original):
    @functools.wraps(original)
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        mesh = _world(tensor, group, "all_gather")
        if mesh is None:
            return original(tensor_list, tensor, group, async_op)
        if len(tensor_list) != len(mesh.rank_list):
            raise ValueError(f"torch.distributed.all_gather into {len(tensor_list)} tensors on {mesh!r}, which has "
                             f"{len(mesh.rank_list)} ranks\n  at {user_line()}")
        with torch.no_grad():
            stacked = tensor
            for dim in reversed(mesh.names):  # the last dim innermost: the ranks in the mesh's (row-major) order
                stacked = reduce(stacked, dim, "stack")
            for out, part in zip(tensor_list, stacked.reshape(-1, *tensor.shape).unbind(0)):
                out.copy_(part)
        return _Done() if async_op else None

    return all_gather


def _on_mesh_only(original, answer):
    @functools.wraps(original)
    def call(*args, **kwargs):
        mesh = active_mesh_or_none()
        if mesh is None or mesh.client is None:
            return original(*args, **kwargs)
        return answer(mesh, *args, **kwargs)

    return call


def _no_rank(mesh, group=None):
    raise UsageError(f"torch.distributed.get_rank() under a mesh: the client drives every rank of {mesh!r} at once, "
                     f"and each rank's own is a value on the mesh, mesh.rank({list(mesh.names)}) (a tensor), or "
                     f"tdmesh.remote code's own dist.get_rank()\n  at {user_line()}")


def _no_init(mesh, *args, **kwargs):
    raise UsageError(f"torch.distributed.init_process_group under a mesh: the mesh is the job's group ({mesh!r}); "
                     f"leave the call out (torch.distributed calls on mesh tensors run over the mesh)\n"
                     f"  at {user_line()}")


def _ddp_init(original):
    @functools.wraps(original)
    def __init__(self, module, *args, **kwargs):
        if any(type(p) is Tensor for p in module.parameters()):
            raise UsageError("DistributedDataParallel of a model on a mesh: the mesh already holds a replica on every "
                             "rank; average the gradients with tdmesh.reduce_grads_in_backward(model.parameters(), "
                             f"mesh.names, 'avg') once, and use the model itself\n  at {user_line()}")
        return original(self, module, *args, **kwargs)

    return __init__


def install() -> None:
    if hasattr(dist.all_reduce, "__tdmesh__"):
        return
    patched = {"all_reduce": _all_reduce(dist.all_reduce), "broadcast": _broadcast(dist.broadcast),
               "all_gather": _all_gather(dist.all_gather),
               "barrier": _on_mesh_only(dist.barrier, lambda mesh, *a, **k: None),
               "get_world_size": _on_mesh_only(dist.get_world_size, lambda mesh, group=None: len(mesh.rank_list)),
               "get_rank": _on_mesh_only(dist.get_rank, _no_rank),
               "init_process_group": _on_mesh_only(dist.init_process_group, _no_init)}
    for name, fn in patched.items():
        fn.__tdmesh__ = True
        setattr(dist, name, fn)
    from torch.nn.parallel import DistributedDataParallel
    DistributedDataParallel.__init__ = _ddp_init(DistributedDataParallel.__init__)  # type: ignore[method-assign]

"""``torch.manual_seed(s)`` under an active mesh seeds every worker of it with ``s``, as every torchrun rank
of an SPMD script that seeds does: ``torch.manual_seed(0); model = Net()`` gives identical replicas, equal to
each rank's of a torchrun job (before, the client's own generator took the seed and the workers kept theirs:
two draws after the same seed differed, and so did the ranks' replicas, silently).  The client's generator
is seeded too: local draws (a DataLoader's shuffle) follow the seed as they would in each rank's process.

``torch.cuda.manual_seed`` and ``manual_seed_all`` seed every worker's CUDA generator (on a CUDA mesh).
Per-rank streams stay with ``tdmesh.random`` (``new_state(mesh.rank(...) + k)``).  Outside an active mesh
each is torch's own, unchanged.
"""

from __future__ import annotations

import contextvars
import functools

import torch

from .. import random as mesh_random
from ..engine.context import active_mesh_or_none

__all__ = ["install"]

# torch.manual_seed calls torch.cuda.manual_seed_all itself: one seeding, one message to the workers
_seeding: contextvars.ContextVar = contextvars.ContextVar("tdmesh_seeding", default=False)


def _on_mesh(original, remote, cuda_only: bool):
    @functools.wraps(original)
    def seed(value):
        if _seeding.get():
            return original(value)
        token = _seeding.set(True)
        try:
            result = original(value)  # the client's own generator, as torch does
        finally:
            _seeding.reset(token)
        mesh = active_mesh_or_none()
        if mesh is not None and mesh.client is not None and (not cuda_only or mesh.device_type == "cuda"):
            remote(int(value))
        return result

    seed.__tdmesh_original__ = original  # type: ignore[attr-defined]
    return seed


def install() -> None:
    if hasattr(torch.manual_seed, "__tdmesh_original__"):
        return
    cpu = _on_mesh(torch.random.manual_seed, mesh_random.set_manual_seed_remote, False)
    torch.manual_seed = torch.random.manual_seed = cpu
    import torch.cuda.random as cuda_random
    for name in ("manual_seed", "manual_seed_all"):
        wrapped = _on_mesh(getattr(cuda_random, name), mesh_random.cuda_manual_seed_all_remote, True)
        setattr(cuda_random, name, wrapped)
        setattr(torch.cuda, name, wrapped)

"""Monarch's seeding builtins (``monarch.builtins.random``) under their Monarch names.

Most are ``tdmesh.random``'s own functions.  Two differ in form from tdmesh's spelling, as Monarch has them:
``get_rng_state_all_cuda_remote`` gives a list (one remote ``uint8 [16]`` state per CUDA device a worker sees:
none on CPU workers) where ``tdmesh.random.cuda_get_rng_state_all_remote`` gives one ``[devices, 16]`` tensor,
and ``set_rng_state_all_cuda_remote`` takes that list back.  Every result's shape is the worker's real one (a
worker checks what a remote function returns against what the client was told)."""

from __future__ import annotations

from typing import cast

import torch

from ..engine.context import get_active_mesh
from ..engine.tensor import Tensor
from ..random import (
    cuda_get_rng_state_all_remote,
    cuda_manual_seed_all_remote,
    cuda_set_rng_state_all_remote,
    get_rng_state_remote,
    random_seed_remote,
    seed_remote,
    set_manual_seed_remote,
    set_rng_state_remote,
)
from ..remote import remote

__all__ = ["set_manual_seed_remote", "get_rng_state_remote", "set_rng_state_remote", "seed_remote",
           "random_seed_remote", "manual_seed_cuda_remote", "manual_seed_all_cuda_remote",
           "get_rng_state_all_cuda_remote", "set_rng_state_all_cuda_remote"]

_cuda_manual_seed = remote("tdmesh.worker.random_ops.cuda_manual_seed", propagate="inspect")


def manual_seed_cuda_remote(seed) -> None:
    """``torch.cuda.manual_seed(seed)`` on every worker of the active mesh: each worker's own GPU (a no-op on CPU
    workers, as in torch).  ``seed``: an int, or a remote scalar for one seed per rank."""
    get_active_mesh()  # no mesh: the error names it here, at the user's line
    _cuda_manual_seed(seed)


def manual_seed_all_cuda_remote(seed) -> None:
    """``torch.cuda.manual_seed_all(seed)`` on every worker of the active mesh (``cuda_manual_seed_all_remote``)."""
    cuda_manual_seed_all_remote(seed)


def get_rng_state_all_cuda_remote() -> list:
    """``torch.cuda.get_rng_state_all()`` on every worker of the active mesh: a list with one remote
    ``uint8 [16]`` state for each CUDA device a worker sees (empty on CPU workers, as torch's ``[]``)."""
    return list(cuda_get_rng_state_all_remote().unbind(0))


def set_rng_state_all_cuda_remote(states: list) -> None:
    """``torch.cuda.set_rng_state_all(states)`` on every worker of the states' mesh, from the list
    ``get_rng_state_all_cuda_remote`` gave (an empty list, a CPU mesh's, changes nothing)."""
    if len(states) == 0:
        return
    cuda_set_rng_state_all_remote(cast(Tensor, torch.stack(list(states))))  # a mesh op: a mesh tensor

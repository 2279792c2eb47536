"""Randomness on the mesh: seeding, saving and restoring the workers' generators.

Ops such as ``torch.rand`` run on the workers, so they draw from the workers' own
generators; the client's ``torch.manual_seed`` does not reach them.  These functions act
on every worker of the active mesh (or of the tensors they are given)::

    with mesh.activate():
        tdmesh.random.set_manual_seed_remote(0)        # the same stream on every rank
        mine = tdmesh.random.new_state(mesh.rank(("host", "gpu")) + 4)   # one per rank
        shared = tdmesh.random.get_state()
        tdmesh.random.set_state(mine)                  # dropout masks differ per rank
        ...
        tdmesh.random.set_state(shared)                # init agrees on every rank

A :class:`State` holds two remote ``uint8`` tensors: the CPU generator state
(``torch.get_rng_state()``, ``[5056]``) and the CUDA one (``torch.cuda.get_rng_state()``,
``[16]``).  On CPU-only workers the CUDA slot is a dummy ``zeros(16, uint8)`` that keeps the
same shape (so the client's metadata is exact on every fleet) and ``set_state`` ignores.
Both tensors live on the mesh's device, like every other tensor of the mesh.

A State covers each worker's own GPU.  The ``cuda_*_all_remote`` functions are torch's
``torch.cuda.*_all`` for every CUDA device a worker sees; their state is one
``uint8 [devices, 16]`` tensor, which has no rows on CPU workers (torch's ``[]``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .engine.context import get_active_mesh
from .engine.tensor import Tensor
from .engine.wire import to_wire
from .errors import user_line
from .remote import remote

__all__ = [
    "State", "get_state", "set_state", "new_state", "make_deterministic", "set_manual_seed_remote",
    "get_rng_state_remote", "set_rng_state_remote", "seed_remote", "random_seed_remote",
    "cuda_manual_seed_all_remote", "cuda_get_rng_state_all_remote", "cuda_set_rng_state_all_remote",
]

_OPS = "tdmesh.worker.random_ops."
CPU_STATE_BYTES = 5056
CUDA_STATE_BYTES = 16


class State(NamedTuple):
    """The generator state of every worker of a mesh: remote ``uint8`` tensors ``cpu``
    ``[5056]`` and ``cuda`` ``[16]`` (a dummy on CPU workers).  Kept so that a stream of
    draws can be resumed or replayed with :func:`set_state`.  Fetching one gives a plain
    ``(cpu, cuda)`` tuple of local tensors (``State(*fetched)`` names them again)."""

    cpu: Tensor
    cuda: Tensor

    def _tdmesh_wire(self):
        """How a State travels (``fetch_shard(state)``, remote-function arguments): as a plain
        ``(cpu, cuda)`` tuple of refs, since the wire format only walks plain tuples."""
        return (to_wire(self.cpu), to_wire(self.cuda))


def _state_meta(*_args):
    return (torch.empty(CPU_STATE_BYTES, dtype=torch.uint8), torch.empty(CUDA_STATE_BYTES, dtype=torch.uint8))


def _cpu_state_meta(*_args):
    return torch.empty(CPU_STATE_BYTES, dtype=torch.uint8)


_manual_seed = remote(_OPS + "manual_seed", propagate="inspect")
_get_state = remote(_OPS + "get_state", propagate=_state_meta)
_set_state = remote(_OPS + "set_state", propagate="inspect")
_new_state = remote(_OPS + "new_state", propagate=_state_meta)
_make_deterministic = remote(_OPS + "make_deterministic", propagate="inspect")
_get_rng_state = remote(_OPS + "get_rng_state", propagate=_cpu_state_meta)
_set_rng_state = remote(_OPS + "set_rng_state", propagate="inspect")
_seed = remote(_OPS + "seed", propagate="inspect")
_cuda_manual_seed_all = remote(_OPS + "cuda_manual_seed_all", propagate="inspect")
# [devices, 16]: how many CUDA devices a worker has is learnt once, from the mesh's first rank
_cuda_get_rng_state_all = remote(_OPS + "cuda_get_rng_state_all", propagate="cached")
_cuda_set_rng_state_all = remote(_OPS + "cuda_set_rng_state_all", propagate="inspect")


def _mesh_device(mesh) -> torch.device:
    """The device the workers put state tensors on (a CUDA one resolves to each worker's GPU)."""
    return torch.device(mesh.device_type)


def set_manual_seed_remote(seed, process_idx=0) -> None:
    """``torch.manual_seed(seed ^ process_idx)`` on every worker of the active mesh (CUDA
    generators too).  The same arguments give every rank the same stream, which is what
    parameter init needs to agree across replicas; a different ``process_idx`` (an int, or
    a remote scalar such as ``mesh.process_idx()`` for one stream per rank) gives another."""
    _manual_seed(seed, process_idx)


def get_state() -> State:
    """The current generator states of every worker of the active mesh, as a :class:`State`
    of remote tensors; keep it to resume or replay the same draws later with :func:`set_state`."""
    return State(*_get_state(_mesh_device(get_active_mesh())))


def set_state(state: State) -> None:
    """Restore both generators of every rank from ``state`` (from :func:`get_state` or
    :func:`new_state`): the draws that followed that state are drawn again."""
    cpu, cuda = state
    _set_state(cpu, cuda, _mesh_device(cpu.mesh))


def new_state(seed: Tensor) -> State:
    """The state ``manual_seed(seed.item())`` gives, on each rank of ``seed``'s mesh, without
    disturbing the current generators (saved, seeded, read, restored on the worker).  ``seed``
    is a remote scalar and may differ per rank (``mesh.rank(("host", "gpu")) + 4``), so one
    call makes independent per-rank streams, e.g. for dropout, to switch to with :func:`set_state`."""
    if type(seed) is not Tensor:
        raise TypeError(f"new_state needs a remote scalar tensor seed (e.g. mesh.rank('gpu') + 4), got "
                        f"{type(seed).__name__}; use set_manual_seed_remote for one seed everywhere")
    return State(*_new_state(seed, _mesh_device(seed.mesh)))


def make_deterministic() -> None:
    """Deterministic kernels on every worker of the active mesh, for bit-reproducible runs:
    ``torch.use_deterministic_algorithms(True)``, cuDNN deterministic without benchmark
    autotuning, and ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (which deterministic cuBLAS needs).
    The setting is worker-global and stays for the life of the workers."""
    _make_deterministic()


def get_rng_state_remote() -> Tensor:
    """``torch.get_rng_state()`` of every worker of the active mesh (remote ``uint8 [5056]``):
    the CPU half of :func:`get_state`, for code that mirrors the plain torch API."""
    return _get_rng_state(_mesh_device(get_active_mesh()))


def set_rng_state_remote(state: Tensor) -> None:
    """``torch.set_rng_state(state)`` on every worker of ``state``'s mesh: replays the CPU
    draws that followed :func:`get_rng_state_remote`."""
    _set_rng_state(state)


def seed_remote() -> None:
    """``torch.seed()`` on every worker of the active mesh: a non-deterministic seed, different
    per rank (the seed value, a uint64, is not returned)."""
    _seed()


def random_seed_remote() -> None:
    """``torch.random.seed()`` on every worker: the same function as :func:`seed_remote` under
    its other torch name, kept for Monarch's API."""
    _seed()


def cuda_manual_seed_all_remote(seed) -> None:
    """``torch.cuda.manual_seed_all(seed)`` on every worker of the active mesh: the generators
    of every CUDA device each worker sees (``seed`` an int, or a remote scalar for one seed
    per rank); the CPU generator is left alone.  As in torch it is a no-op where CUDA is
    absent: on CPU workers nothing changes."""
    _cuda_manual_seed_all(seed)


def cuda_get_rng_state_all_remote() -> Tensor:
    """``torch.cuda.get_rng_state_all()`` of every worker of the active mesh, as one remote
    ``uint8 [devices, 16]`` tensor (row ``i``: ``cuda:i``'s state) to give back to
    :func:`cuda_set_rng_state_all_remote`.  On CPU workers it has no rows, as torch's ``[]``."""
    return _cuda_get_rng_state_all(_mesh_device(get_active_mesh()))


def cuda_set_rng_state_all_remote(states: Tensor) -> None:
    """``torch.cuda.set_rng_state_all`` on every worker of ``states``' mesh, from a
    :func:`cuda_get_rng_state_all_remote` tensor: the CUDA draws that followed it come again."""
    if type(states) is not Tensor or states.dim() != 2 or states.shape[1] != CUDA_STATE_BYTES:
        got = list(states.shape) if type(states) is Tensor else type(states).__name__
        raise TypeError(f"cuda_set_rng_state_all_remote needs the remote uint8 [devices, {CUDA_STATE_BYTES}] tensor "
                        f"of cuda_get_rng_state_all_remote, got {got}\n  at {user_line()}")
    _cuda_set_rng_state_all(states, _mesh_device(states.mesh))

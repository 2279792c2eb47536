"""Worker side of :mod:`tdmesh.random`: the functions the client calls by import path.

Every RNG here is process-global on the worker (the CPU generator, and the default CUDA
generator of the worker's own GPU), so these functions act on whatever stream runs them.

State tensors are ``uint8``: the CPU state is ``torch.get_rng_state()`` (5056 bytes of
mt19937); the CUDA state is ``torch.cuda.get_rng_state()`` (16 bytes: seed and offset of
Philox).  A worker without a GPU has no CUDA generator: its CUDA slot is a dummy
``zeros(16, uint8)`` (same shape as the real one, so the client's propagated metadata stays
true) and ``set_state`` ignores it.  Returned tensors live on the worker's device, which is
where the client believes every tensor of the mesh is; setters copy them back to CPU, the
only place torch accepts a generator state.
"""

from __future__ import annotations

import os

import torch

CPU_STATE_BYTES = 5056
CUDA_STATE_BYTES = 16


def _as_int(x) -> int:
    """A seed given as a Python int or as a (per-rank) scalar tensor."""
    return int(x.item()) if isinstance(x, torch.Tensor) else int(x)


def _on_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def manual_seed(seed, process_idx=0) -> None:
    """``torch.manual_seed(seed ^ process_idx)``, CUDA generators included."""
    value = _as_int(seed) ^ _as_int(process_idx)
    torch.manual_seed(value)  # also seeds CUDA (lazily, if it is not initialized yet) ...
    torch.cuda.manual_seed_all(value)  # ... said explicitly; a queued no-op without CUDA


def get_state(device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cpu, cuda)`` generator states on ``device``; the CUDA one is a dummy without a GPU."""
    cpu = torch.get_rng_state()
    if _on_cuda(device):
        cuda = torch.cuda.get_rng_state(device)
    else:
        cuda = torch.zeros(CUDA_STATE_BYTES, dtype=torch.uint8)
    if device is not None and torch.device(device).type != "cpu":
        cpu, cuda = cpu.to(device), cuda.to(device)
    return cpu, cuda


def set_state(cpu: torch.Tensor, cuda: torch.Tensor, device=None) -> None:
    """Restore both generators from a :func:`get_state` pair (the CUDA one only on a GPU)."""
    torch.set_rng_state(cpu.detach().cpu())
    if _on_cuda(device):
        torch.cuda.set_rng_state(cuda.detach().cpu(), device)


def new_state(seed, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The state ``manual_seed(seed)`` would give, leaving this worker's generators untouched."""
    orig = get_state(device)
    try:
        torch.manual_seed(_as_int(seed))
        return get_state(device)
    finally:
        set_state(*orig, device)


def make_deterministic() -> None:
    """Deterministic kernels from here on (cuBLAS needs its workspace config for that)."""
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def get_rng_state(device=None) -> torch.Tensor:
    """``torch.get_rng_state()`` on ``device``."""
    state = torch.get_rng_state()
    return state.to(device) if device is not None and torch.device(device).type != "cpu" else state


def set_rng_state(state: torch.Tensor) -> None:
    """``torch.set_rng_state`` from a tensor on any device."""
    torch.set_rng_state(state.detach().cpu())


def seed() -> None:
    """``torch.seed()``: a non-deterministic seed (its uint64 value is not returned)."""
    torch.seed()



def cuda_manual_seed_all(seed) -> None:
    """``torch.cuda.manual_seed_all(seed)``: every CUDA device of this worker, not only its
    own (torch queues it until CUDA initializes, so it is a no-op on a worker without CUDA)."""
    torch.cuda.manual_seed_all(_as_int(seed))


def cuda_manual_seed(seed) -> None:
    """``torch.cuda.manual_seed(seed)``: this worker's current CUDA device (its own GPU); queued by torch until
    CUDA initializes, so a no-op on a worker without CUDA."""
    torch.cuda.manual_seed(_as_int(seed))


def _cuda_devices(device) -> int:
    """The CUDA devices whose generators a worker on ``device`` owns: none on a CPU mesh's
    worker (even where the host has GPUs: that worker never touches CUDA)."""
    return torch.cuda.device_count() if _on_cuda(device) else 0


def cuda_get_rng_state_all(device=None) -> torch.Tensor:
    """``torch.cuda.get_rng_state_all()`` stacked into one ``uint8 [devices, 16]`` tensor on
    ``device``: row ``i`` is ``cuda:i``'s state; no rows on a CPU worker (torch's ``[]``)."""
    if _cuda_devices(device) == 0:
        return torch.empty(0, CUDA_STATE_BYTES, dtype=torch.uint8)
    return torch.stack(torch.cuda.get_rng_state_all()).to(device)


def cuda_set_rng_state_all(states: torch.Tensor, device=None) -> None:
    """``torch.cuda.set_rng_state_all`` from a :func:`cuda_get_rng_state_all` tensor, which must
    have one row per CUDA device of this worker (none on a CPU worker: then nothing changes)."""
    devices = _cuda_devices(device)
    if tuple(states.shape) != (devices, CUDA_STATE_BYTES):
        raise ValueError(f"the CUDA generator states of this worker are uint8 [{devices}, {CUDA_STATE_BYTES}] "
                         f"({devices} CUDA devices), got {list(states.shape)}")
    torch.cuda.set_rng_state_all(list(states.detach().cpu()))

"""Small functions the client calls remotely by import path (``mesh.rank``, ``process_idx``)."""

from __future__ import annotations

import torch


def mesh_rank(mesh, dims) -> torch.Tensor:
    """This worker's coordinate along ``dims`` as an int64 scalar on its device."""
    return torch.tensor(mesh.rank(dims), dtype=torch.int64, device=mesh.device)


def process_idx(mesh) -> torch.Tensor:
    """This worker's global rank as an int64 scalar on its device."""
    return torch.tensor(mesh.global_rank, dtype=torch.int64, device=mesh.device)


def live_refs() -> int:
    """How many refs this worker holds: what a leak check or a soak test watches."""
    from .interpreter import Interpreter
    return len(Interpreter.current.env) if Interpreter.current is not None else 0


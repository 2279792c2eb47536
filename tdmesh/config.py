"""Every ``TDMESH_*`` environment variable, in one table, with its default."""

from __future__ import annotations

import os

VARIABLES = {
    "TDMESH_BACKEND": ("", "process-group backend for workers: nccl or gloo (default: nccl with CUDA, else gloo)"),
    "TDMESH_DEVICE": ("", "'cpu' forces CPU workers even where CUDA is present"),
    "TDMESH_DEVICE_INDEX": ("", "CUDA device of this worker (default LOCAL_RANK); set by local_mesh"),
    "TDMESH_STORE": ("", "host:port of the c10d store (default MASTER_ADDR:MASTER_PORT from torchrun)"),
    "TDMESH_LOG_LEVEL": ("WARNING", "log level of tdmesh's own loggers on workers"),
    "TDMESH_LOG_FILE": ("", "this worker's log file, reported in errors (set by local_mesh)"),
    "TDMESH_SELF_ERROR_EXIT_CODE": ("1", "worker exit code when the job fails and this worker caused it"),
    "TDMESH_PEER_ERROR_EXIT_CODE": ("1", "worker exit code when the job fails because of another process"),
    "TDMESH_PEER_EXIT_DELAY": ("2.0", "seconds a torchrun worker waits before exiting for another process's failure, so that rank 0 (the script) is torchrun's root cause"),
    "TDMESH_SCOPE": ("", "store key prefix of a local_mesh fleet (set by local_mesh)"),
    "TDMESH_CONNECT_TIMEOUT": ("120", "seconds the controller waits for every worker to connect"),
}


def env_str(name: str, default: str | None = None) -> str:
    if default is None:
        default = VARIABLES[name][0]
    return os.environ.get(name, default)


def env_int(name: str, default: int | None = None) -> int:
    return int(env_str(name, None if default is None else str(default)))


def env_float(name: str, default: float | None = None) -> float:
    return float(env_str(name, None if default is None else str(default)))

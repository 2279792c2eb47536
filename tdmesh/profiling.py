"""``with tdmesh.profile(dir):`` -- torch.profiler on every worker, one trace file per rank.

The traces (``dir/rank<r>.trace.json``, Chrome trace format) open in Perfetto
(ui.perfetto.dev) and chrome://tracing; TensorBoard's profiler plugin reads the same files.
"""

from __future__ import annotations

import contextlib
import os

import torch

from .engine.context import get_active_mesh
from .engine.fetch import fetch_shard
from .remote import remote

__all__ = ["profile"]


@contextlib.contextmanager
def profile(directory: str, mesh=None, record_shapes: bool = False):
    """Profile every worker of ``mesh`` (default: the active mesh) while the block runs."""
    mesh = mesh if mesh is not None else get_active_mesh()
    directory = os.path.abspath(directory)
    start = remote("tdmesh.worker.builtins.profile_start", propagate="inspect")
    stop = remote("tdmesh.worker.builtins.profile_stop", propagate=lambda d, r: torch.empty((), dtype=torch.int64))
    with mesh.activate():
        start(record_shapes)
    try:
        yield directory
    finally:
        with mesh.activate():
            done = stop(directory, mesh.process_idx())
            # wait until every rank has written its file
            fetch_shard(done.reduce(mesh.names, "sum")).result()

"""The active mesh: the client's one piece of ambient state.

Ops without remote tensor arguments (factories) run on the active mesh; ``None`` (no mesh,
or ``tdmesh.no_mesh``) means they run locally.  :mod:`tdmesh.engine.activation` sets it.

A backward the client's engine runs for CUDA tensors runs its nodes on autograd's device thread,
a C++ thread whose Python context is empty: there the active mesh and stream are those of the
backward call being run (``backward_calls``), as they are on the calling thread for CPU tensors;
else a double-backward formula's factory (``ones([1])``) made a local tensor there.
"""

from __future__ import annotations

import contextvars

import torch

__all__ = ["get_active_mesh", "active_mesh_or_none"]

active_mesh: contextvars.ContextVar = contextvars.ContextVar("tdmesh_active_mesh", default=None)
UNSET = object()  # ``ContextVar.get(UNSET)``: never set in this context (``no_mesh`` sets None)
# (mesh, stream) of each backward call under a mesh whose nodes the client's engine runs now, any thread
backward_calls: list[tuple] = []


def backward_caller() -> tuple | None:
    """During a backward (on autograd's device thread): the (mesh, stream) its call was made under,
    where every backward running now was made under the same; else None (then nothing is guessed)."""
    calls = backward_calls
    if not calls or torch._C._current_graph_task_id() == -1:
        return None
    mesh, stream = calls[0]
    for other in calls[1:]:
        if other[0] is not mesh or other[1] is not stream:
            return None
    return mesh, stream


def get_active_mesh():
    """The mesh that ops without remote tensor arguments run on."""
    mesh = active_mesh_or_none()
    if mesh is None:
        raise ValueError("no device mesh is active; use `with mesh.activate():`")
    return mesh


def active_mesh_or_none():
    """The active mesh, or None."""
    mesh = active_mesh.get(UNSET)
    if mesh is UNSET:
        caller = backward_caller() if backward_calls else None
        return None if caller is None else caller[0]
    return mesh

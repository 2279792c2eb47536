"""The active mesh: the client's one piece of ambient state.

Ops without remote tensor arguments (factories) run on the active mesh; ``None`` (no mesh,
or ``tdmesh.no_mesh``) means they run locally.  :mod:`tdmesh.engine.activation` sets it.
"""

from __future__ import annotations

import contextvars

__all__ = ["get_active_mesh", "active_mesh_or_none"]

active_mesh: contextvars.ContextVar = contextvars.ContextVar("tdmesh_active_mesh", default=None)


def get_active_mesh():
    """The mesh that ops without remote tensor arguments run on."""
    mesh = active_mesh.get()
    if mesh is None:
        raise ValueError("no device mesh is active; use `with mesh.activate():`")
    return mesh


def active_mesh_or_none():
    """The active mesh, or None."""
    return active_mesh.get()

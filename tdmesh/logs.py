"""``tdmesh.set_log_level``: how much the workers log, changed from the client at run time."""

from __future__ import annotations

import logging

from .engine.context import get_active_mesh
from .remote import remote

__all__ = ["set_log_level"]


def set_log_level(level: int | str, mesh=None, logger: str = "tdmesh") -> None:
    """Make ``logger`` log at ``level`` (an int, or a name such as ``"DEBUG"``) on every rank of
    ``mesh`` (default: the active mesh); returns once every rank has it.

    ``"tdmesh"`` is tdmesh's own worker loggers (``TDMESH_LOG_LEVEL`` sets them at start);
    ``""`` is the root logger, which a remote function's own ``logging`` calls go through.
    The change lasts until this client's session with the workers ends."""
    if isinstance(level, str):
        number = logging.getLevelName(level.upper())
        if not isinstance(number, int):
            raise ValueError(f"unknown log level {level!r}: use an int or one of DEBUG, INFO, WARNING, ERROR, "
                             f"CRITICAL")
        level = number
    mesh = mesh if mesh is not None else get_active_mesh()
    with mesh.activate():
        remote("tdmesh.worker.builtins.set_log_level").call(logger, level).result()

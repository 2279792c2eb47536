"""``log_remote`` and ``set_logging_level_remote``, as Monarch's ``monarch.builtins.log`` has them.

Both are remote functions of no result (``propagate="inspect"``): a call sends one message to every rank of
the active mesh and returns ``None`` at once.  On each worker ``log_remote(msg, *args, level=...)`` is
``logger.log(level, msg, *args)`` on the worker's ``tdmesh.builtins.log`` logger -- lazy %-formatting, and a
mesh tensor among the arguments is that rank's local value -- and its output goes wherever the worker's
logging goes (the launcher's terminal, or the worker log files).  ``set_logging_level_remote(level)`` sets
that one logger's level on every rank, until the client's session with the workers ends (as
``tdmesh.set_log_level``, which waits for every rank and takes any logger's name)."""

from __future__ import annotations

import logging

from ..remote import remote

__all__ = ["log_remote", "set_logging_level_remote", "logger", "LOGGER_NAME"]

LOGGER_NAME = "tdmesh.builtins.log"
logger = logging.getLogger(LOGGER_NAME)  # the client's: never called by these (the workers log)

_log = remote("tdmesh.worker.builtins.log_message", propagate="inspect")
_set_level = remote("tdmesh.worker.builtins.set_log_level", propagate="inspect")


def log_remote(*args, level: int = logging.WARNING, **kwargs) -> None:
    """Log ``args`` (a message and its %-arguments) at ``level`` on every rank of the active mesh."""
    _log(LOGGER_NAME, level, *args, **kwargs)


def set_logging_level_remote(level: int) -> None:
    """Make ``log_remote``'s logger log at ``level`` on every rank of the active mesh (no wait)."""
    _set_level(LOGGER_NAME, level)

"""Monarch's builtins under their Monarch names (``monarch.builtins``): logging on the workers and the seeding
functions, for code written against Monarch.  tdmesh's own spellings live in ``tdmesh.random`` and
``tdmesh.set_log_level``; docs/monarch.md maps one onto the other."""

from . import random
from .log import log_remote, set_logging_level_remote

__all__ = ["log_remote", "set_logging_level_remote", "random"]

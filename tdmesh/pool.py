"""``tdmesh.pool``: the warm pool's public face (``tdmesh.pool.clear()`` stops every parked
worker now; ``parked_count()`` says how many fleets wait).  The pool itself, parking and
taking fleets, is ``tdmesh.fleet.pool``."""

from .fleet.pool import clear, parked_count

__all__ = ["clear", "parked_count"]

"""A process forked from the client (a DataLoader's worker processes, ``multiprocessing`` with fork) holds
a copy of every live client: its sockets, queues and proxies.  Nothing of it may act there: a proxy collected
in the child (its cyclic garbage is the parent's) would queue a free, and a flush would write into the
parent's sockets, interleaving frames with the parent's own.  So in the child every client is closed at
once: a free is dropped, and using a mesh raises "this mesh has exited" at the user's line."""

from __future__ import annotations

import os
import weakref

from ..garbage import hold_for_client

__all__ = ["client_started"]

_clients: weakref.WeakSet = weakref.WeakSet()


def client_started(client) -> None:
    """A client goes live in this process (fewer full collections while it is: ``tdmesh/garbage.py``)."""
    hold_for_client()
    _clients.add(client)


def _in_child() -> None:
    for client in list(_clients):
        client.closed = True


os.register_at_fork(after_in_child=_in_child)

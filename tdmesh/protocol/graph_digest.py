"""The shape of an autograd graph, as the client and the workers both compute it.

When the workers run a backward themselves (``tdmesh/engine/backward.py``), their graph was
recorded from the same aten ops as the client's, so it has the same nodes and edges.  The
client sends the digest of its graph with the backward; a worker whose own graph differs
refuses to run it (a gradient from a different graph would be wrong without an error).  The
digest counts nodes and edges and sums a hash of each node's type name that is the same in
every process (``str.__hash__`` is salted per process).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

__all__ = ["reachable", "digest"]

_name_hashes: dict[type, int] = {}


def reachable(roots: Iterable) -> tuple[list, int]:
    """The autograd nodes reached from ``roots`` (nodes; None ignored), each once, and the
    number of edges between them."""
    seen: set = set()
    order: list = []
    stack = [n for n in roots if n is not None]
    edges = 0
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        order.append(node)
        for child, _ in node.next_functions:
            if child is not None:
                edges += 1
                if child not in seen:
                    stack.append(child)
    return order, edges


def digest(nodes: list, edges: int) -> tuple[int, int, int]:
    """``(nodes, edges, hash of the nodes' type names)`` of a graph ``reachable`` found."""
    total = 0
    for node in nodes:
        kind = type(node)
        h = _name_hashes.get(kind)
        if h is None:
            h = _name_hashes[kind] = zlib.crc32(kind.__name__.encode())
        total = (total + h) & 0xFFFFFFFF
    return (len(nodes), edges, total)

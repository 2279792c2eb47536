"""Where each frame goes: the relay tree over hosts, and rank sets as slices.

Pure arithmetic, no torch, no sockets.  The client sends each frame to at most ``fanout``
children; a host's relay forwards it to its own ranks and to at most ``fanout`` child relays,
so no process sends a frame more than ``fanout`` times (plus its own ranks), whatever the
fleet's size.  Hosts split into contiguous blocks: a block's first host relays for the rest
of it, recursively, so every relay's subtree is one contiguous range of hosts (and ranks).
"""

from __future__ import annotations

from collections.abc import Sequence

from .slice import Slice

__all__ = ["relay_parents", "relay_children", "subtree_hosts", "rank_set", "RankList", "DEFAULT_FANOUT"]

DEFAULT_FANOUT = 32


def _blocks(first: int, end: int, fanout: int) -> list[tuple[int, int]]:
    """``range(first, end)`` cut into at most ``fanout`` contiguous blocks, sizes within one of each other."""
    n = end - first
    if n <= 0:
        return []
    k = min(fanout, n)
    base, extra = divmod(n, k)
    blocks, start = [], first
    for i in range(k):
        size = base + (1 if i < extra else 0)
        blocks.append((start, start + size))
        start += size
    return blocks


def relay_parents(hosts: int, fanout: int = DEFAULT_FANOUT) -> list[int]:
    """``parents[h]``: the host whose relay host ``h``'s relay connects to, or -1 for the client."""
    if hosts < 1 or fanout < 1:
        raise ValueError(f"a relay tree needs hosts >= 1 and fanout >= 1, got hosts={hosts}, fanout={fanout}")
    parents = [-1] * hosts
    pending = [(-1, 0, hosts)]  # (parent, first host, end) of blocks still to place
    while pending:
        parent, first, end = pending.pop()
        for a, b in _blocks(first, end, fanout):
            parents[a] = parent
            pending.append((a, a + 1, b))
    return parents


def relay_children(hosts: int, fanout: int = DEFAULT_FANOUT) -> dict[int, list[int]]:
    """``children[h]`` (and ``children[-1]`` for the client): the relays that connect to it, in host order."""
    children: dict[int, list[int]] = {h: [] for h in range(-1, hosts)}
    for h, p in enumerate(relay_parents(hosts, fanout)):
        children[p].append(h)
    return children


def subtree_hosts(host: int, hosts: int, fanout: int = DEFAULT_FANOUT) -> range:
    """The hosts whose frames pass through ``host``'s relay (itself included): a contiguous range."""
    children = relay_children(hosts, fanout)
    last = host
    while children[last]:
        last = children[last][-1]
    return range(host, last + 1)


def rank_set(ranks: Sequence[int]) -> tuple[Slice, ...]:
    """``ranks`` as few slices as a 1-d cover allows (one for any arithmetic run, e.g. a
    whole mesh or a column of it).  A mesh passes its own :class:`Slice` instead."""
    return tuple(Slice.from_list(ranks)) if ranks else ()


class RankList(tuple):
    """A mesh's ranks in mesh order that also know the :class:`Slice` they come from, so the
    client defines the rank set by the slice (a few ints), not by listing the ranks."""

    slices: tuple[Slice, ...]

    def __new__(cls, ranks: Slice) -> RankList:
        self = super().__new__(cls, ranks)
        self.slices = (ranks,)
        return self

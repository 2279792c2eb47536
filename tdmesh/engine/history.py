"""The client's dataflow history: every op by seq, failure propagation, completion.

Every remote op is a node ``(seq, uses, defs)``.  A root failure reported by a worker marks
its node and, transitively, every later node that reads what it defined.  A seq is
*complete* once every rank has reported progress past it (RequestStatus -> Status); only
then is its future resolved, so a resolved future has seen every earlier error.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from ..errors import ProtocolViolation, RemoteException
from ..protocol import messages as m
from .future import Future, ValueMesh, load_value


class Node:
    __slots__ = ("seq", "uses", "defs", "site", "future", "value", "failure")

    def __init__(self, seq, uses, defs, site, future) -> None:
        self.seq = seq
        self.uses = uses
        self.defs = defs
        self.site = site
        self.future = future
        self.value: Any = None  # a FetchResult, or {rank: FetchResult} for a gather
        self.failure: RemoteException | None = None


class History:
    def __init__(self, ranks: Iterable[int]) -> None:
        self._order: deque[Node] = deque()
        self._by_seq: dict[int, Node] = {}
        self._frontier = {r: 0 for r in ranks}
        self._failed_refs: dict[int, RemoteException] = {}
        self.unobserved: dict[int, RemoteException] = {}
        # failures of ops with no outputs (a check such as _linalg_check_errors): no value
        # depends on them, so the next blocking call raises them (seq -> error)
        self._silent: dict[int, RemoteException] = {}
        self._last_seq = -1

    def add(self, seq: int, uses, defs, site, future: Future | None = None) -> Node:
        if seq <= self._last_seq:  # also after the last node completed and was freed
            raise AssertionError(f"seq {seq} is not above the last seq {self._last_seq}")
        self._last_seq = seq
        node = Node(seq, uses, defs, site, future)
        failed = self._failed_refs
        if failed:
            for u in uses:
                exc = failed.get(u)
                if exc is not None:
                    node.failure = exc
                    for d in defs:
                        failed[d] = exc
                    break
        self._order.append(node)
        self._by_seq[seq] = node
        return node

    def forget_refs(self, refs: Iterable[int]) -> None:
        if self._failed_refs:
            for r in refs:
                self._failed_refs.pop(r, None)

    def set_value(self, msg: m.FetchResult, rank: int | None = None) -> None:
        node = self._by_seq.get(msg.seq)
        if node is None:
            return
        if getattr(node.future, "gather", None) is not None:  # one value per rank (Remote.call)
            if node.value is None:
                node.value = {}
            node.value[rank] = msg
        else:
            node.value = msg

    def fail(self, msg: m.RemoteFunctionFailed, site_frames) -> None:
        node = self._by_seq.get(msg.seq)
        exc = RemoteException(msg.seq, msg.rank, msg.exc_type, msg.message, msg.traceback,
                              site_frames(node.site if node else None))
        if node is not None and node.failure is not None and node.failure.seq <= msg.seq:
            return  # another rank (or an earlier root) already failed this seq: report once
        self.unobserved.setdefault(msg.seq, exc)
        if node is None:
            return
        node.failure = exc
        if not node.defs and node.future is None:
            self._silent.setdefault(msg.seq, exc)
        poisoned = set(node.defs)
        for later in self._order:
            if later.seq <= msg.seq:
                continue
            if later.failure is None and not poisoned.isdisjoint(later.uses):
                later.failure = exc
                poisoned.update(later.defs)
        for r in poisoned:
            self._failed_refs.setdefault(r, exc)

    def status(self, msg: m.Status) -> list[Node]:
        """Advance ``msg.rank``; returns the nodes that are now complete, in seq order."""
        if msg.first_uncompleted > self._frontier.get(msg.rank, 0):
            self._frontier[msg.rank] = msg.first_uncompleted
        bound = min(self._frontier.values())
        done = []
        order = self._order
        while order and order[0].seq < bound:
            node = order.popleft()
            del self._by_seq[node.seq]
            done.append(node)
        return done

    def resolve(self, node: Node) -> None:
        """Deliver a complete node's value or error to its future."""
        fut = node.future
        if fut is None:
            return
        silent = self._silent and self._earlier_silent_failure(node.seq)
        if silent:
            fut._set_exception(silent)
        elif node.failure is not None:
            self.unobserved.pop(node.failure.seq, None)
            fut._set_exception(node.failure)
        elif node.value is None:
            fut._set_exception(ProtocolViolation(f"internal error: seq {node.seq} completed without a value"))
        elif isinstance(node.value, dict):
            shape = fut.gather
            missing = [r for r in shape.ranks() if r not in node.value or node.value[r].error is not None]
            if missing:
                fut._set_exception(ProtocolViolation(f"internal error: seq {node.seq} has no value from ranks "
                                                     f"{missing}"))
            else:
                fut._set_result(ValueMesh(shape, {r: load_value(v.value) for r, v in node.value.items()}))
        elif node.value.error is not None:
            fut._set_exception(ProtocolViolation(f"seq {node.seq} depends on failed seq {node.value.error.seq}, "
                                            f"whose error was not reported"))
        else:
            fut._set_result(load_value(node.value.value))

    def _earlier_silent_failure(self, seq: int) -> RemoteException | None:
        """The oldest failure of an output-less op issued before ``seq``, now observed: it
        is raised by this blocking call, as local torch would have raised it at once."""
        first = min(self._silent)  # ranks and streams may report out of seq order
        if first > seq:
            return None
        exc = self._silent.pop(first)
        self.unobserved.pop(first, None)
        return exc

    def site_of(self, seq: int):
        """The call site recorded for ``seq`` while it is not complete, else None."""
        node = self._by_seq.get(seq)
        return node.site if node is not None else None

    def pending_futures(self) -> list[Future]:
        return [n.future for n in self._order if n.future is not None]

    def __len__(self) -> int:
        return len(self._order)

"""The client's dataflow history: every op by seq, failure propagation, completion.

Every remote op is a node ``(seq, uses, defs)``.  A root failure reported by a worker marks
its node and, transitively, every later node that reads what it defined.  A seq is
*complete* once every rank has reported progress past it (RequestStatus -> Status); only
then is its future resolved, so a resolved future has seen every earlier error.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable
from operator import itemgetter
from typing import Any, NamedTuple

from ..errors import ProtocolViolation, RemoteException
from ..protocol import messages as m
from .future import Future, ValueMesh, load_value

_seq_of = itemgetter(0)


class Node(NamedTuple):
    """A complete op that has a future, as :meth:`History.status` hands it to :meth:`History.resolve`."""
    seq: int
    uses: Any
    defs: Any
    site: Any
    future: Future | None
    failure: RemoteException | None
    value: Any  # a FetchResult, or {rank: FetchResult} for a gather


class History:
    """Ops not yet complete are plain tuples ``(seq, uses, defs, site, future)`` in seq order (a list
    read from ``_head``): an op's entry is made for every op the client issues, so it is the least a
    node can be; the few that fail or carry a value keep those by seq beside it."""

    compact_after = 1024  # complete entries dropped from the list's front once past this and past half

    def __init__(self, ranks: Iterable[int]) -> None:
        self._order: list[tuple] = []
        self._head = 0  # entries before it are complete (dropped in bulk)
        # the seqs of the entries that have a future, in order: completion visits these alone, not
        # every op completed (a probe's answer completes a few hundred ops: 0.14 us each on this VM)
        self._with_futures: list[int] = []
        self._failures: dict[int, RemoteException] = {}  # seq -> the failure it depends on, while pending
        self._values: dict[int, Any] = {}  # seq -> FetchResult (or {rank: FetchResult}), while pending
        self._frontier = {r: 0 for r in ranks}
        self._failed_refs: dict[int, RemoteException] = {}
        self.unobserved: dict[int, RemoteException] = {}
        # failures of ops with no outputs (a check such as _linalg_check_errors): no value
        # depends on them, so the next blocking call raises them (seq -> error)
        self._silent: dict[int, RemoteException] = {}
        self._last_seq = -1

    def add(self, seq: int, uses, defs, site, future: Future | None = None) -> None:
        if seq <= self._last_seq:  # also after the last node completed and was freed
            raise AssertionError(f"seq {seq} is not above the last seq {self._last_seq}")
        self._last_seq = seq
        failed = self._failed_refs
        if failed:
            for u in uses:
                exc = failed.get(u)
                if exc is not None:
                    self._failures[seq] = exc
                    for d in defs:
                        failed[d] = exc
                    break
        self._order.append((seq, uses, defs, site, future))
        if future is not None:
            self._with_futures.append(seq)

    def failure_of(self, seq: int) -> RemoteException | None:
        """The failure op ``seq`` depends on (its own or an earlier one's), while it is not complete."""
        return self._failures.get(seq)

    def _index(self, seq: int) -> int | None:
        order = self._order
        i = bisect_left(order, seq, self._head, key=_seq_of)
        return i if i < len(order) and order[i][0] == seq else None

    def forget_refs(self, refs: Iterable[int]) -> None:
        if self._failed_refs:
            for r in refs:
                self._failed_refs.pop(r, None)

    def set_value(self, msg: m.FetchResult, rank: int | None = None) -> None:
        i = self._index(msg.seq)
        if i is None:
            return
        future = self._order[i][4]
        if getattr(future, "gather", None) is not None:  # one value per rank (Remote.call)
            self._values.setdefault(msg.seq, {})[rank] = msg
        else:
            self._values[msg.seq] = msg

    def fail(self, msg: m.RemoteFunctionFailed, site_frames) -> None:
        i = self._index(msg.seq)
        entry = self._order[i] if i is not None else None
        exc = RemoteException(msg.seq, msg.rank, msg.exc_type, msg.message, msg.traceback,
                              site_frames(entry[3] if entry else None))
        failures = self._failures
        earlier = failures.get(msg.seq)
        if entry is not None and earlier is not None and earlier.seq <= msg.seq:
            return  # another rank (or an earlier root) already failed this seq: report once
        self.unobserved.setdefault(msg.seq, exc)
        if i is None:
            return
        _, _, defs, _, future = self._order[i]
        failures[msg.seq] = exc
        if not defs and future is None:
            self._silent.setdefault(msg.seq, exc)
        poisoned = set(defs)
        for later_seq, uses, later_defs, _, _ in self._order[i + 1:]:
            if later_seq not in failures and not poisoned.isdisjoint(uses):
                failures[later_seq] = exc
                poisoned.update(later_defs)
        for r in poisoned:
            self._failed_refs.setdefault(r, exc)

    def status(self, msg: m.Status) -> list[Node]:
        """Advance ``msg.rank``; returns the nodes that are now complete and have a future, in seq order."""
        if msg.first_uncompleted > self._frontier.get(msg.rank, 0):
            self._frontier[msg.rank] = msg.first_uncompleted
        bound = min(self._frontier.values())
        order, head = self._order, self._head
        cut = bisect_left(order, bound, head, key=_seq_of)
        if cut == head:
            return []
        failures, values = self._failures, self._values
        done = []
        with_futures = self._with_futures
        if with_futures and with_futures[0] < bound:
            ended = bisect_left(with_futures, bound)
            at = head
            for seq in with_futures[:ended]:
                at = bisect_left(order, seq, at, cut, key=_seq_of)
                _, uses, defs, site, future = order[at]
                done.append(Node(seq, uses, defs, site, future, failures.get(seq), values.get(seq)))
            del with_futures[:ended]
        for pending in (failures, values):
            if pending:
                for seq in [s for s in pending if s < bound]:
                    del pending[seq]
        if cut == len(order):
            order.clear()
            cut = 0
        elif cut > self.compact_after and cut * 2 > len(order):
            del order[:cut]
            cut = 0
        self._head = cut
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
            shape: Any = fut.gather  # the mesh Shape of a gather
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
        i = self._index(seq)
        return self._order[i][3] if i is not None else None

    def pending_futures(self) -> list[Future]:
        return [self._order[i][4] for i in map(self._index, self._with_futures) if i is not None]

    def __len__(self) -> int:
        return len(self._order) - self._head

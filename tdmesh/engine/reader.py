"""The client's reader thread: frames from every child, turned into inbox messages.

It notes each child's sign of life for the supervisor and answers what must not wait for the
user's thread: progress (Status), a lost relay's ranks, a broken device (failed at once, before
that worker's exit is reported), pdb's output, and the dashboard's samples and stacks (kept in
``client.observations``, never queued).  Everything else is queued for the user's thread to apply.
"""

from __future__ import annotations

import queue
import selectors
import threading
import time

from ..errors import ProtocolError, ProtocolViolation
from ..protocol import messages as m
from ..protocol.schema import received_messages
from .supervisor import WorkerLost


class Inbox:
    """Replies from the reader thread (and the supervisor's findings), applied under the client's lock in the
    order they arrived: a waiting thread waits for arrivals outside the lock and takes them under it.  (When it
    took one outside the lock, another thread's drain could apply a Status that came after it first: a fetch
    then completed without its value.)"""
    __slots__ = ("_queue", "arrived")

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.arrived = threading.Event()  # set by each put; cleared by the thread that drains

    def put(self, item) -> None:
        self._queue.put(item)
        self.arrived.set()

    def empty(self) -> bool:
        return self._queue.empty()

    def drain(self, apply) -> int:
        """``apply(rank, msg)`` each reply that already arrived, without waiting (the caller holds the client's
        lock); how many."""
        applied = 0
        while not self._queue.empty():
            try:
                rank, msg = self._queue.get_nowait()
            except queue.Empty:
                break
            apply(rank, msg)
            applied += 1
        return applied


def read_loop(client) -> None:
    """The reader thread's loop (see the module docstring)."""
    sel = selectors.DefaultSelector()
    for rank, conn in client.conns.items():
        sel.register(conn.sock, selectors.EVENT_READ, rank)
    open_ranks = set(client.conns)
    while open_ranks:
        for key, _ in sel.select(timeout=0.5):
            rank = key.data
            error: BaseException | None = None
            client.reading = (rank, time.monotonic())  # the supervisor's view of a frame that stalls midway
            try:
                msgs = received_messages(client.conns[rank], client.hellos)
            except (OSError, ProtocolError, ProtocolViolation) as e:
                msgs, error = None, e
            client.reading = None
            if msgs is None:
                sel.unregister(key.fileobj)
                open_ranks.discard(rank)
                if not client.exiting:
                    why = client.info.exit_reason() or (str(error) if error else "its connection closed")
                    client.inbox.put((rank, WorkerLost(why)))
                continue
            supervisor = client.supervisor
            supervisor.seen(rank)
            for msg in msgs:
                t = type(msg)
                if t is m.Heartbeat:
                    continue
                if t is m.Status:
                    supervisor.status(rank, msg.first_uncompleted)
                elif t is m.FetchResult:  # one of a gather's values: which rank's it is matters
                    client.inbox.put((msg.rank if msg.rank >= 0 else rank, msg))
                    continue
                elif t is m.RanksLost:
                    if not client.exiting:
                        why = client.info.exit_reason() or msg.why  # the launcher's account, if it has one
                        client.inbox.put((msg.ranks[0], WorkerLost(why, msg.ranks)))
                    continue
                elif t is m.DebuggerRead or t is m.DebuggerDone:
                    client.debugger.seen(msg)
                elif t is m.WorkerFailed:  # at once: its exit must not be reported first
                    client.fail_from_supervisor(client.info.broken_device(msg, client.site_of(msg.seq)))
                    continue
                elif t is m.Sample or t is m.Stacks:
                    client.observations.seen(msg)
                    continue
                client.inbox.put((rank, msg))

"""The client's side of workers' background tasks (``tdmesh.worker.tasks``): a future per
task, resolved once every rank of it has sent ``TaskDone`` -- with the first rank's error if
any failed, or with the fleet's failure if the fleet breaks first.  Nothing waits on a stream
meanwhile: the client keeps handling the other replies."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..errors import RemoteException, call_site, frames
from ..protocol import messages as m
from .future import Future

log = logging.getLogger("tdmesh")


class Tasks:
    def __init__(self, client) -> None:
        self.client = client
        self._pending: dict[int, tuple[Future, set[int], str, list]] = {}  # task -> (future, ranks to hear
        #                                                                     from, what, the user's call site)
        self._next = 1
        self.handlers: dict[type, Callable[[int, Any], None]] = {m.TaskDone: self.TaskDone}

    def new(self, ranks, what: str) -> tuple[int, Future]:
        """A task id for ``ranks`` to run and the future that its ``TaskDone``s resolve."""
        task, self._next = self._next, self._next + 1
        fut = Future(self.client)
        if self.client.failure is not None:
            fut._set_exception(self.client.failure)
        else:
            self._pending[task] = (fut, set(ranks), what, call_site())
        return task, fut

    def TaskDone(self, rank: int, msg: m.TaskDone) -> None:
        entry = self._pending.get(msg.task)
        if entry is None:
            return
        fut, waiting, what, site = entry
        waiting.discard(msg.rank)
        if msg.error is not None and not fut._finished():
            message, _, trace = msg.error.partition("\n")
            kind, _, text = message.partition(": ")
            fut._set_exception(RemoteException(-1, msg.rank, kind, f"{what}: {text}", trace, frames(site)))
        if not waiting:
            del self._pending[msg.task]
            fut._set_result(None)  # a no-op where an error was set

    def abandon(self, task: int, error: BaseException) -> None:
        """The message that was to start ``task`` failed (on some rank, which never starts it)."""
        entry = self._pending.pop(task, None)
        if entry is not None:
            entry[0]._set_exception(error)

    def fail(self, error: BaseException) -> None:
        """The fleet broke: no task of it will report."""
        pending, self._pending = self._pending, {}
        for fut, *_ in pending.values():
            fut._set_exception(error)

    def wait_all(self, timeout: float) -> None:
        """Before the client leaves: the tasks end (the workers also wait for them at Exit).
        Their errors stay unobserved here: a fleet that broke meanwhile is still raised at exit."""
        for fut, *_ in list(self._pending.values()):
            try:
                fut._wait(timeout)
            except TimeoutError:
                log.warning("tdmesh: a background task (an async checkpoint's write) is still running after "
                            "%.0f s; the workers finish it before they exit", timeout)
                return

"""A worker's background tasks: work that a message starts and that ends after it.

An async checkpoint's write must overlap the training that follows it, so it cannot hold a
stream (a stream that waits blocks every later ``RequestStatus``, hence every fetch).  The
function a message runs starts the task here instead and returns; the task's thread sends
``TaskDone`` when it ends, and the client resolves the task's future once every rank of it
has.  ``Exit`` and ``Detach`` wait for the running tasks, so a checkpoint being written when
the client leaves is finished, not cut off.
"""

from __future__ import annotations

import logging
import os
import threading
import traceback
from collections.abc import Callable
from typing import Any

from ..protocol import messages as m

log = logging.getLogger("tdmesh.worker")


class Tasks:
    def __init__(self, rank: int, send: Callable[[Any], None]) -> None:
        self.rank = rank
        self._send = send
        self._threads: dict[int, threading.Thread] = {}
        self._lock = threading.Lock()

    def start(self, task: int, fn: Callable[[], None]) -> None:
        """Run ``fn`` on a thread of its own; the client hears ``TaskDone(task)`` when it ends."""
        thread = threading.Thread(target=self._run, args=(task, fn), name=f"tdmesh-task-{task}", daemon=True)
        with self._lock:
            if task in self._threads:
                raise RuntimeError(f"background task {task} is already running on rank {self.rank}")
            self._threads[task] = thread
        thread.start()

    def _run(self, task: int, fn: Callable[[], None]) -> None:
        error = None
        _yield_cpu()
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - the client is told, whatever it was
            error = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            log.error("rank %d: background task %d failed: %s", self.rank, task, error)
        with self._lock:
            self._threads.pop(task, None)
        try:
            self._send(m.TaskDone(task, self.rank, error))
        except OSError:
            pass  # the client is gone: nobody is waiting

    def join(self, timeout: float | None = None) -> None:
        """Wait for every running task (the worker is leaving)."""
        with self._lock:
            threads = list(self._threads.values())
        for thread in threads:
            thread.join(timeout)


def _yield_cpu() -> None:
    """Background work gives way to the streams: this thread's scheduling priority drops to the
    lowest (Linux schedules threads as tasks of their own), so on a host whose cores the job
    keeps busy an async checkpoint's write takes what the training leaves."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: the write just competes
        pass

"""Worker streams: each an ordered queue of work with its own thread (and CUDA stream).

Work on different streams really runs concurrently, which is what lets communication on
one stream overlap compute on another (and what lets two ops that wait on each other
from different streams both finish).  Each stream owns the refs it defines; values cross
streams only through borrows.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable

import torch

log = logging.getLogger("tdmesh.worker")
_running = threading.local()  # the Stream whose work this thread runs (a stream thread: its own, for good)


def current_stream() -> Stream | None:
    """The stream whose message this thread is running (for work that reads its ref table)."""
    return getattr(_running, "stream", None)


class Stream:
    def __init__(self, stream_id: int, device: torch.device, on_fatal: Callable[[BaseException], None],
                 threaded: bool = True) -> None:
        self.id = stream_id
        self.env: dict = {}
        self.device = device
        self.cuda = None
        if device.type == "cuda" and torch.cuda.is_available() and threaded:  # inline = unit tests
            self.cuda = torch.cuda.current_stream(device) if stream_id == 0 else torch.cuda.Stream(device)
        self._on_fatal = on_fatal
        self._queue: queue.SimpleQueue | None = None
        self._thread = None
        if threaded:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._loop, name=f"tdmesh-stream-{stream_id}", daemon=True)
            self._thread.start()

    def submit(self, fn: Callable, msg) -> None:
        """Run ``fn(msg, self)`` on this stream after everything submitted before."""
        if self._queue is None:  # inline (unit tests): on the caller's thread, whose grad mode ops set
            _running.stream = self
            grad = torch.is_grad_enabled()
            try:
                self._run(fn, msg, raise_errors=True)
            finally:
                torch._C._set_grad_enabled(grad)
        else:
            self._queue.put((fn, msg))

    def _loop(self) -> None:
        if self.cuda is not None:
            # The current CUDA stream is per thread: set once here, every op of this thread
            # runs on it (cheaper than a stream context around each message).
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(self.cuda)
        assert self._queue is not None  # a threaded stream has its queue until close()
        # A view written in place gets a new grad_fn: autograd rebuilds it as one AsStridedBackward
        # where a tensor supports as_strided, and by replaying its view ops (ViewBackward,
        # TransposeBackward, ...) where it does not: the client's proxies.  Replaying here too keeps
        # this thread's autograd graph the client's (the same gradients; Longformer's chunked
        # attention writes such views), so backward can run here.  Per thread, as grad mode is.
        torch._C._set_view_replay_enabled(True)
        _running.stream = self
        get = self._queue.get
        while True:
            item = get()
            if item is None or not self._run(item[0], item[1], raise_errors=False):
                return  # closed, or stopped: nothing queued after a broken message runs

    def _run(self, fn, msg, raise_errors: bool) -> bool:
        """Run one item; False when it raised the error that ends the worker."""
        try:
            fn(msg, self)
        except BaseException as e:  # noqa: BLE001 - an infrastructure error ends the worker
            if raise_errors:
                raise
            log.error("stream %d stopped on %s: %s", self.id, type(e).__name__, e)
            self._on_fatal(e)
            return False
        return True

    def abandon(self, timeout: float = 30.0) -> None:
        """A heal (``worker/healing.leave``): drop the queued work, let the running item end (its collective's
        connections were cut) and stop the thread; one still running after ``timeout`` ends the worker."""
        if self._queue is None or self._thread is None:
            return
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"stream {self.id} did not stop within {timeout:g} s of a heal")
        self._queue = None

    def close(self) -> None:
        """Finish the queued work and stop the thread."""
        if self._queue is not None and self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._queue = None

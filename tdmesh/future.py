"""``Future``: a value the workers will send, or the error that prevents it."""

from __future__ import annotations

import time
from typing import Any, Callable

from .errors import DeviceException

_PENDING = object()


class Future:
    """The result of a fetch.  ``result(timeout)`` may be retried after a ``TimeoutError``."""

    def __init__(self, client) -> None:
        self._client = client
        self._value: Any = _PENDING
        self._exception: BaseException | None = None
        self._callbacks: list[Callable[["Future"], None]] = []
        self.gather = None  # the mesh Shape when the value is one per rank (Remote.call)

    # called by the client when the value (or its error) is known
    def _set_result(self, value) -> None:
        if self._finished():
            return  # settled once: a late resolution cannot change what the user has seen
        self._value = value
        self._run_callbacks()

    def _set_exception(self, exc: BaseException) -> None:
        if self._finished():
            return
        self._exception = exc
        self._value = None
        self._run_callbacks()

    def _run_callbacks(self) -> None:
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)

    def _finished(self) -> bool:
        return self._value is not _PENDING

    def done(self) -> bool:
        """True once the value or its error has arrived (never blocks)."""
        if not self._finished():
            self._client.pump(0)
        return self._finished()

    def _wait(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._finished():
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                self._client.pump(0, until=self._finished)  # a last look at what has already arrived
                if self._finished():
                    return
                raise TimeoutError(f"the value was not ready within {timeout} s; result() can be called again")
            self._client.pump(remaining, until=self._finished)

    def result(self, timeout: float | None = None):
        """The value; raises the remote error, or ``TimeoutError`` (retryable)."""
        self._wait(timeout)
        if self._exception is not None:
            self._observed()
            raise self._exception
        return self._value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error this future failed with, or None; ``TimeoutError`` if not done in time."""
        self._wait(timeout)
        if self._exception is not None:
            self._observed()
        return self._exception

    def _observed(self) -> None:
        """The user has seen this future's error: a fleet failure is not raised again at exit."""
        if isinstance(self._exception, DeviceException):
            self._exception.observed = True

    def add_callback(self, fn: Callable[["Future"], None]) -> None:
        """Call ``fn(self)`` once done (now, if it already is)."""
        if self._finished():
            fn(self)
        else:
            self._callbacks.append(fn)

    def __repr__(self) -> str:
        state = "pending" if not self._finished() else ("failed" if self._exception else "done")
        return f"<tdmesh.Future {state}>"

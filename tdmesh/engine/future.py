"""``Future``: a value the workers will send, or the error that prevents it; ``ValueMesh``:
one value per rank, what ``Remote.call`` and ``fetch_all`` deliver; ``as_completed``: futures
in the order they finish."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map

from ..errors import DeviceException
from ..protocol import messages as m
from ..protocol.codec import unpack_tensor, unpickle_value
from .settle import pending, settle

_PENDING = object()
# Waiting on futures of several fleets: each client's replies arrive on its own queue, so the
# wait takes turns, blocking on one client's queue this long before the next one's.
_TURN_SECONDS = 0.01


class Future:
    """The result of a fetch.  ``result(timeout)`` may be retried after a ``TimeoutError``."""

    def __init__(self, client) -> None:
        self._client = client
        self._value: Any = _PENDING
        self._exception: BaseException | None = None
        self._callbacks: list[Callable[[Future], None]] = []
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
        if pending and (not self._finished() or self._exception is not None):
            settle()  # a fault-tolerant step not yet confirmed: healed first if a worker died in it (settle.py)
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

    def get(self, timeout: float | None = None):
        """Monarch's name for :meth:`result` (its futures' ``get``): the same wait, value and errors."""
        return self.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error this future failed with, or None; ``TimeoutError`` if not done in time."""
        self._wait(timeout)
        if self._exception is not None:
            self._observed()
        return self._exception

    def _follow(self, other: Future) -> None:
        """Take ``other``'s outcome when it comes (a heal ran the step that made this future again)."""
        self._client, self._value, self._exception, self.gather = other._client, _PENDING, None, other.gather

        def take(done: Future) -> None:
            if done._exception is not None:
                self._set_exception(done._exception)
            else:
                self._set_result(done._value)
        other.add_callback(take)

    def _observed(self) -> None:
        """The user has seen this future's error: a fleet failure is not raised again at exit."""
        if isinstance(self._exception, DeviceException):
            self._exception.observed = True

    def add_callback(self, fn: Callable[[Future], None]) -> None:
        """Call ``fn(self)`` once done (now, if it already is)."""
        if self._finished():
            fn(self)
        else:
            self._callbacks.append(fn)

    def __repr__(self) -> str:
        state = "pending" if not self._finished() else ("failed" if self._exception else "done")
        return f"<tdmesh.Future {state}>"



def as_completed(futures: Iterable[Future], timeout: float | None = None) -> Iterator[Future]:
    """Yield each of ``futures`` once it is done (its value or its error has arrived), in the
    order they finish, as ``concurrent.futures.as_completed``: ones already done come first, a
    future given twice is yielded once, and ``TimeoutError`` is raised by the ``next()`` that
    finds some still pending ``timeout`` seconds after this call.  Waiting applies the fleet's
    replies (``client.pump``), blocking until one arrives; futures of several fleets are
    waited on in turns."""
    unique = list(dict.fromkeys(futures))  # a Future hashes by identity
    for f in unique:
        if not isinstance(f, Future):
            raise TypeError(f"as_completed takes tdmesh Futures, got {type(f).__name__}")
    deadline = None if timeout is None else time.monotonic() + timeout
    return _in_completion_order(unique, deadline, timeout)


def _in_completion_order(pending: list[Future], deadline: float | None, timeout: float | None) -> Iterator[Future]:
    total = len(pending)

    def any_finished() -> bool:
        return any(f._finished() for f in pending)

    while pending:
        finished = [f for f in pending if f._finished()]
        if finished:
            pending = [f for f in pending if f not in finished]
            yield from finished
            continue
        clients = list(dict.fromkeys(f._client for f in pending))
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            for client in clients:
                client.pump(0, until=any_finished)  # a last look at what has already arrived
            if not any_finished():
                raise TimeoutError(f"{len(pending)} (of {total}) futures were not done within {timeout} s")
        elif len(clients) == 1:
            clients[0].pump(remaining, until=any_finished)
        else:
            for client in clients:
                client.pump(_TURN_SECONDS if remaining is None else min(_TURN_SECONDS, remaining), until=any_finished)
                if any_finished():
                    break


def load_value(payload):
    """Unpickle a fetched value (a FetchResult's, see ``codec.pickle_value``) as local tensors,
    whatever mesh is active on the client."""
    with _disable_current_modes(), torch._C.DisableTorchFunction():  # no mesh's factory defaults either
        value = unpickle_value(payload)
        return tree_map(lambda x: unpack_tensor(x) if type(x) is m.PackedTensor else x, value,
                        is_leaf=lambda x: type(x) is m.PackedTensor)


class ValueMesh:
    """One value per rank of a mesh, from ``Remote.call``: iterate ``(point, value)`` pairs,
    where ``point`` maps dim names to coordinates, or index with ``vm[dict(host=0, gpu=1)]``."""

    def __init__(self, shape, values: dict) -> None:
        self.shape = shape
        self._values = values

    def __iter__(self):
        for rank in self.shape.ranks():
            yield self.shape.coordinates(rank), self._values[rank]

    def __getitem__(self, point: dict):
        return self._values[self.shape.index(**point).slice.offset]

    def __len__(self) -> int:
        return len(self._values)

    def to_numpy(self):
        """The values as a numpy array shaped like the mesh, followed by the values' own shape
        when every value is a number (or a numeric array/tensor) of one shape; otherwise an
        object array shaped like the mesh."""
        sizes = list(self.shape.sizes.values())
        values = [self._values[r] for r in self.shape.ranks()]
        try:
            arrays = [np.asarray(v.detach().numpy() if hasattr(v, "detach") else v) for v in values]
        except (TypeError, ValueError, RuntimeError):
            arrays = None
        if arrays and all(a.dtype.kind in "biufc" and a.shape == arrays[0].shape for a in arrays):
            return np.stack(arrays).reshape(sizes + list(arrays[0].shape))
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out.reshape(sizes)

    def __repr__(self) -> str:
        return f"ValueMesh({self.shape}, {[v for _, v in self]!r})"

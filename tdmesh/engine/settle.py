"""Steps whose end is not confirmed yet, settled before the client does anything else.

``FaultTolerance.step`` returns as soon as a step is issued (a lagged commit: the next step is issued while
the workers still run this one).  A worker's death in such a step is healed by running the step again,
which is only exact while nothing but fault-tolerant steps followed it.  So before the client issues any
other op, or waits on a future, the step's owner settles it: waits for its end, healing first if a worker
died in it.  ``pending`` holds that owner's settle function while it has unconfirmed steps; the issue paths
test it (a list's truth: nanoseconds on the hot path) and call :func:`settle`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from .tensor import raise_in_op

__all__ = ["pending", "settle", "defer", "cancel", "forget"]

pending: list[tuple[int, Callable[[], None], object]] = []  # (the thread that may settle, its function, its fleet)


def defer(settle_fn: Callable[[], None], fleet: object) -> None:
    """Steps on ``fleet`` were issued and not confirmed: settle them before the next op of this thread."""
    pending[:] = [(threading.get_ident(), settle_fn, fleet)]


def cancel() -> None:
    """The owner confirms (or re-runs) them itself."""
    pending.clear()


def forget(fleet: object) -> None:
    """``fleet`` stops (after an error, or once settled): nothing of it is left to settle."""
    if pending and pending[0][2] is fleet:
        pending.clear()


def settle(inputs: Sequence = ()) -> None:
    """Called where the client is about to issue an op (reading ``inputs``) or wait: confirms the pending
    steps first.  Only the thread that issued them settles (a background thread's op must not run the user's
    step).  After a heal an input made in a step that ran again (not its state, not what it returned) is lost:
    raised here, named, before the op reads its stale ref."""
    if not pending or pending[0][0] != threading.get_ident():
        return
    _, fn, _ = pending.pop()
    fn()
    for t in inputs:  # proxies: each holds its ref's owner
        lost = t._r.dropped_at
        if type(lost) is str:
            raise_in_op("DROPPED", f"tensor {t._r.id} {lost}, so it cannot be used in the op issued here")

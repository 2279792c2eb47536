"""The client's flusher thread: it sends what a thread that stopped issuing left queued.

While a thread issues it sends its own ops (``Client._queued``, every ``flush_interval``), and this
thread sends only once no thread has queued anything for the interval (``Client._last_queued``): it
used to send whenever the last send was that old, so it often took the client's lock between two ops
of an issuing thread, which then waited for it and for the GIL (the tiny GPT's eager step 1.23x
slower in an A/B on 2 cores, ``.dbg/ab_flusher.py``; the add loop 15.2 -> 12.0 us an op with this rule,
``python -m bench.background_threads``).  A thread's last ops wait at most the interval
(``tests/fleet/test_client_threads.py``).  With nothing queued it sleeps until something is
(``Client._wake_flusher``), not every 2 ms: an idle client took 2.6% of a core waking up to find
nothing to send; but not right after a thread sent its own ops, as that thread is likely to queue
again at once, and setting the event then cost it (half of this thread's wakes in the add loop).
Each wake still takes the GIL from an issuing thread: on this VM's 2 cores the flusher's wakes, one
per interval, cost the add loop ~1.7 us an op (``bench.background_threads``'s "flusher asleep" row);
fewer would let a thread's last ops wait longer.
"""

from __future__ import annotations

import time

__all__ = ["flush_loop"]

_monotonic = time.monotonic


def flush_loop(client) -> None:
    """The flusher thread's loop (see the module docstring)."""
    delay = client.flush_interval
    while not client.closed:
        if _nothing_to_send(client):
            quiet = _monotonic() - client._last_queued
            if quiet < client.flush_interval:  # a thread that just sent its own ops: it is likely to queue
                time.sleep(client.flush_interval - quiet)  # again at once, and waking this thread then costs it
                continue
            client._work_queued.clear()
            client._flusher_idle = True  # from here a queuing thread wakes it...
            if _nothing_to_send(client):  # ...so what was queued before this line is seen here
                client._work_queued.wait()
            client._flusher_idle = False
            continue
        time.sleep(delay)
        delay = client.flush_interval - (_monotonic() - client._last_queued)
        if delay > 0:  # a thread queued within the interval: it sends itself, so look again once it is quiet
            continue
        delay = client.flush_interval
        if (client.outbox.log or client._deletes) and not client.coalescing_held():
            if client.lock.acquire(timeout=0.05):
                try:  # a thread may have queued again while this one waited for the lock: it sends itself
                    if not client.closed and client.failure is None and \
                            _monotonic() - client._last_queued >= client.flush_interval:
                        client.flush()
                finally:
                    client.lock.release()


def _nothing_to_send(client) -> bool:
    return client.failure is not None or not (client.outbox.log or client._deletes)

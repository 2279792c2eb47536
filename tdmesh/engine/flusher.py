"""The client's flusher thread: it sends what a thread that stopped issuing left queued.

While a thread issues it flushes itself (``Client.submit``, every ``flush_interval``), and this
thread keeps off the lock: taking it between two ops made the issuing thread wait for it and for the
GIL (the tiny GPT's eager step 1.23x slower in an A/B on 2 cores, ``.dbg/ab_flusher.py``).  With
nothing queued it sleeps until something is (``Client._wake_flusher``), not every 2 ms: an idle
client took 2.6% of a core waking up to find nothing to send.
"""

from __future__ import annotations

import time

__all__ = ["flush_loop"]

_monotonic = time.monotonic


def flush_loop(client) -> None:
    """The flusher thread's loop (see the module docstring)."""
    while not client.closed:
        if _nothing_to_send(client):
            client._work_queued.clear()
            client._flusher_idle = True  # from here a queuing thread wakes it...
            if _nothing_to_send(client):  # ...so what was queued before this line is seen here
                client._work_queued.wait()
            client._flusher_idle = False
            continue
        time.sleep(client.flush_interval)
        if _monotonic() - client._last_flush < client.flush_interval:
            continue
        if (client.outbox.log or client._deletes) and not client.coalescing_held():
            if client.lock.acquire(timeout=0.05):
                try:
                    if not client.closed and client.failure is None:
                        client.flush()
                finally:
                    client.lock.release()


def _nothing_to_send(client) -> bool:
    return client.failure is not None or not (client.outbox.log or client._deletes)

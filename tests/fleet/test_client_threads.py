"""The client's background threads while a thread issues: each wake of the flusher or the reader takes
the GIL from the issuing thread (on this VM's 2 cores ~1.5-2 us of every op in the add loop went to
them), so they wake only when they have something to do."""

from __future__ import annotations

import threading
import time

import torch

import tdmesh
from tdmesh import inspect, remote
from tdmesh.config import ControllerParams


def _probes_of(client) -> list[int]:
    """The seq of every progress probe the client queues from now on (the real probe is sent too)."""
    seqs: list[int] = []
    queue_probe = client._queue_probe

    def recording(seq: int) -> None:
        seqs.append(seq)
        queue_probe(seq)

    client._queue_probe = recording
    return seqs


def test_a_progress_probe_waits_for_the_answer_to_the_last_one():
    """Every ``ops_per_progress_request`` ops the client asks the workers how far they are; while they
    have not answered the last question, a new one would only be answered after it (each answer wakes
    the client's reader): behind a slow op 500 ops send one probe, not 50, and probes go on once it is
    answered."""
    sleep = remote("time.sleep", propagate="inspect")
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1, controller=ControllerParams(ops_per_progress_request=10),
                           pool=False) as mesh, mesh.activate():
        client = mesh.client
        x = torch.zeros(2)
        assert inspect(x).tolist() == [0.0, 0.0]  # every earlier probe answered (its Status precedes the value)
        probes = _probes_of(client)
        sleep(1.5)  # the worker is busy for 1.5 s: 500 adds take a few ms to issue
        first = client.last_seq
        for _ in range(500):
            x = x + 1
        busy = list(probes)
        assert client.last_seq - first == 500
        assert len(busy) == 1 and first < busy[0] <= first + 32, busy  # within a few looks at the last probe
        assert inspect(x).tolist() == [500.0, 500.0]
        for _ in range(50):
            x = x + 1
        assert len(probes) > 1 and probes[-1] > client.last_seq - 50, probes  # answered: probing again
        assert inspect(x).tolist() == [550.0, 550.0]


def test_the_flusher_sends_only_what_an_issuing_thread_left_when_it_went_quiet():
    """While a thread issues it sends its own ops every ``flush_interval``; the flusher sends only once that
    thread has queued nothing for the interval (it used to send whenever the last send was that old, taking
    the client's lock between two ops of the issuing thread), and then it does send: nothing waits for a
    fetch."""
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1, pool=False) as mesh, mesh.activate():
        client = mesh.client
        quiet_for: list[float] = []  # at each of the flusher's sends: how long since a thread queued
        sent_at: list[float] = []
        flush = client.flush

        def watched_flush() -> None:
            if threading.current_thread() is client._flusher:
                sent_at.append(time.monotonic())
                quiet_for.append(sent_at[-1] - client._last_queued)
            flush()

        client.flush = watched_flush
        x = torch.zeros(2)
        for _ in range(3):
            start = time.monotonic()
            while time.monotonic() - start < 0.3:  # ~150 of the issuing thread's own sends
                x = x + 1
            last_op = client._last_queued  # then the free of x's predecessor: only the flusher can send it
            deadline = time.monotonic() + 10
            while (client.pending_messages() or client._deletes) and time.monotonic() < deadline:
                time.sleep(0.001)  # no fetch
            assert client.pending_messages() == 0 and not client._deletes
            assert any(t >= last_op for t in sent_at), (sent_at, last_op)
        client.flush = flush
        assert all(q >= client.flush_interval for q in quiet_for), (quiet_for, client.flush_interval)
        total = inspect(x)
        assert total[0] == total[1] > 0


def test_a_wait_returns_when_another_thread_applied_what_it_awaits(mesh2x2):
    """A thread about to wait on a fetch while another thread's probe drains the inbox (the supervisor's,
    when the client has been quiet) and applies the fetch's replies: nothing more comes (a host's relay
    passes on no Status that is not new), so a wait that looked at what it awaits only after a reply hung
    for good (CI, twenty-ninth session).  The state is made here: the replies arrive, another thread
    applies them, then the wait begins with the inbox empty; it must return at once, not block."""
    client = mesh2x2.client
    with mesh2x2.activate():
        future = tdmesh.fetch_shard(torch.ones(3) * 2, host=1, gpu=1)
        client.flush()
        deadline = time.monotonic() + 30
        while not client.supervisor.answered(client.last_seq) and time.monotonic() < deadline:
            time.sleep(0.01)  # every rank's Status has reached the reader (and so the inbox)
        time.sleep(0.2)  # the fetch's value too
        with client.lock:
            client._drain_inbox()  # another thread's drain (the supervisor's probe: lock, drain) applied the replies
        assert future.done() and client.inbox.empty()
        waited: list = []
        waiter = threading.Thread(target=lambda: waited.append(client.pump(None, until=future._finished) or True),
                                  daemon=True)
        waiter.start()
        waiter.join(10)
        assert waited == [True], "the wait did not return though what it awaits was applied"
        assert torch.equal(future.result(), torch.full((3,), 2.0))


def test_replies_apply_in_arrival_order_while_another_thread_probes():
    """The supervisor's probes drain replies on their own thread while the user's thread waits for a fetch: a
    waiting thread that took a reply off the inbox outside the client's lock let such a drain apply the Status
    behind it first, and the fetch completed without its value ("internal error: seq N completed without a
    value", 321 of 5,000 fetches here before the fix).  Every fetch gives its value."""
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1) as mesh, mesh.activate():
        client = mesh.client
        stop = threading.Event()

        def probe() -> None:
            while not stop.is_set():
                client.send_probe()  # what the supervisor does when the user sends nothing for a while
                time.sleep(0.0002)

        probers = [threading.Thread(target=probe) for _ in range(2)]
        for t in probers:
            t.start()
        try:
            x = torch.zeros(())
            for i in range(1, 2001):
                x = x + 1
                assert inspect(x).item() == i
        finally:
            stop.set()
            for t in probers:
                t.join()

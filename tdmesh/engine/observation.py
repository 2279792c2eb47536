"""What the client hears of its workers besides op results: the dashboard's raw material.

The reader thread hands ``Sample`` and ``Stacks`` frames here directly (they never enter the
inbox, so the user's thread applies nothing for them); the rest is noted where the client
already learns it: the last remote error, stuck-op warnings, lost ranks.  Until
``sample_every`` no worker sends a Sample, so an unwatched fleet pays nothing but this
object.  Any thread may read it: each update replaces a whole value.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time

from ..protocol import messages as m

LOG_LINES = 200  # a rank's recent lines kept for the page


class Observations:
    def __init__(self, client) -> None:
        self.client = client
        self.samples: dict[int, tuple[float, m.Sample]] = {}  # rank -> (when it came, the sample)
        self.logs: dict[int, collections.deque] = {}
        self.last_error: BaseException | None = None
        self.warnings: collections.deque[tuple[float, str]] = collections.deque(maxlen=20)
        self.lost_ranks: set[int] = set()
        self.parked = False  # the session ended by detaching: the workers wait, warm, for the next client
        self.interval = 0.0
        self._requests = itertools.count(1)
        self._answers: dict[int, dict[int, str]] = {}
        self._answered = threading.Condition()

    # the reader thread ------------------------------------------------------------------------------
    def seen(self, msg) -> None:
        if type(msg) is m.Sample:
            self.samples[msg.rank] = (time.monotonic(), msg)
            if msg.logs:
                self.logs.setdefault(msg.rank, collections.deque(maxlen=LOG_LINES)).extend(msg.logs)
            return
        with self._answered:
            answers = self._answers.get(msg.request)
            if answers is not None:
                answers[msg.rank] = msg.text
                self._answered.notify_all()

    # where the client learns of trouble -----------------------------------------------------------------
    def warned(self, text: str) -> None:
        self.warnings.append((time.time(), text))

    def lost(self, ranks) -> None:
        self.lost_ranks.update(ranks)

    # asked by the dashboard or tdmesh.stacks (any thread) -----------------------------------------------
    def sample_every(self, interval: float) -> None:
        """Every rank sends a Sample each ``interval`` seconds from now on; 0 stops them."""
        if interval == self.interval:
            return
        self.interval = interval
        self.client.send_setup(m.Observe(interval))
        self.client.flush()

    def stacks(self, ranks, timeout: float) -> dict[int, str]:
        """Every rank's stacks, asked out of band: the answer comes from each worker's message thread,
        whatever its streams (and this client's user thread) are blocked in."""
        ranks = tuple(ranks)
        request = next(self._requests)
        with self._answered:
            self._answers[request] = {}
        client = self.client
        try:
            client.send_setup(m.RequestStacks(request), ranks)
            client.flush()
            deadline = time.monotonic() + timeout
            with self._answered:
                answers = self._answers[request]
                while len(answers) < len(ranks):
                    left = deadline - time.monotonic()
                    if client.failure is not None:
                        raise client.failure
                    if left <= 0:
                        missing = sorted(set(ranks) - set(answers))
                        raise TimeoutError(
                            f"tdmesh.stacks: ranks {missing} did not answer within {timeout:g} s (dead, or wedged "
                            f"below Python: `kill -USR1 <pid>` prints a worker's stacks from C, docs/debugging.md)")
                    self._answered.wait(min(left, 0.1))
                return dict(sorted(answers.items()))
        finally:
            with self._answered:
                self._answers.pop(request, None)

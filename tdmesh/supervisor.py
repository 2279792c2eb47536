"""Watching the fleet from the client: dead workers, silent workers, stuck ops.

A thread of its own checks, every fraction of a second: the launcher's view of the worker
processes (exit code or signal, for ``local_mesh``), each rank's last sign of life (frames
and heartbeats, noted by the client's reader thread), and the oldest progress probe that a
rank has not answered.  A dead or silent worker becomes a ``DeviceException`` delivered to
every pending future within the bound; a stuck op is a warning naming the ranks and the
op's source line, or a ``DeviceException`` when ``fail_on_operation_timeout`` is set.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from .config import ControllerParams, SupervisionParams
from .errors import DeviceException

log = logging.getLogger("tdmesh")


class FleetFailure(Exception):
    """Inbox item: the supervisor found the fleet broken."""


class Supervisor:
    def __init__(self, client, supervision: SupervisionParams, controller: ControllerParams,
                 process_failure: Callable[[], str | None] | None = None) -> None:
        self.client = client
        self.supervision = supervision
        self.controller = controller
        self.process_failure = process_failure
        now = time.monotonic()
        self.last_seen = {r: now for r in client.ranks}
        self.progress = {r: 0 for r in client.ranks}
        self.probes: list[tuple[int, float]] = []   # (seq, sent at), oldest first
        self._warned: set[int] = set()
        self._last_probe = now
        self._thread = threading.Thread(target=self._loop, name="tdmesh-supervisor", daemon=True)
        self._thread.start()

    # called by the client's reader thread ---------------------------------------------------
    def seen(self, rank: int) -> None:
        self.last_seen[rank] = time.monotonic()

    def status(self, rank: int, first_uncompleted: int) -> None:
        if first_uncompleted > self.progress.get(rank, 0):
            self.progress[rank] = first_uncompleted

    # called by the client under its lock when it sends a probe ---------------------------------
    def probed(self, seq: int) -> None:
        self.probes.append((seq, time.monotonic()))
        self._last_probe = time.monotonic()

    # the watch -------------------------------------------------------------------------------
    def _loop(self) -> None:
        period = max(0.05, min(0.5, self.supervision.heartbeat_interval, self.controller.progress_check_interval / 4))
        client = self.client
        while not client.exiting and client.failure is None:
            time.sleep(period)
            if client.exiting or client.failure is not None:
                return
            try:
                self._check()
            except Exception:  # noqa: BLE001 - the watch must not die silently
                log.exception("tdmesh supervisor check failed")

    def _check(self) -> None:
        client = self.client
        if self.process_failure is not None:
            why = self.process_failure()
            if why:
                return client.fail_from_supervisor(DeviceException(f"{why}\n{client.where_logs()}"))
        now = time.monotonic()
        timeout = self.supervision.heartbeat_timeout
        for rank, seen in self.last_seen.items():
            if now - seen > timeout:
                return client.fail_from_supervisor(DeviceException(
                    f"worker rank {rank} {client.describe(rank)} stopped heartbeating: nothing heard for "
                    f"{now - seen:.1f} s (heartbeat_timeout={timeout} s); it is hung or unreachable\n"
                    f"{client.where_logs()}"))
        self._check_progress(now)

    def _check_progress(self, now: float) -> None:
        client = self.client
        params = self.controller
        frontier = min(self.progress.values())
        self.probes = [(seq, t) for seq, t in self.probes if seq >= frontier]
        if now - self._last_probe > params.progress_check_interval and client.outstanding_work(frontier):
            client.send_probe()
        if not self.probes:
            return
        seq, sent = self.probes[0]
        late = now - sent
        if late <= params.operation_timeout or seq in self._warned:
            return
        self._warned.add(seq)
        stuck = [r for r, p in sorted(self.progress.items()) if p <= seq]
        first = min(self.progress[r] for r in stuck)
        named = ", ".join(f"{r} {client.describe(r)}" for r in stuck)
        message = (f"ranks {named} have operations that have not completed after "
                   f"{params.operation_timeout:g} seconds; the oldest was issued at {client.site_of(first)}")
        if params.fail_on_operation_timeout:
            client.fail_from_supervisor(DeviceException(message + f"\n{client.where_logs()}"))
        else:
            log.warning(message)

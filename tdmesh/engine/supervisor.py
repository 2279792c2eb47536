"""Watching the fleet from the client: dead workers, silent workers, stuck ops.

A thread of its own checks, every fraction of a second: the launcher's view of the worker
processes (exit code or signal, for ``local_mesh``), each rank's last sign of life (frames
and heartbeats, noted by the client's reader thread), and the oldest progress probe that a
rank has not answered.  A dead or silent worker becomes a ``DeviceException`` delivered to
every pending future within the bound; a stuck op is a warning naming the ranks and the
op's source line, or a ``DeviceException`` when ``fail_on_operation_timeout`` is set.  Time
this process did not run (the check woke late), and a child whose bytes wait unread, are not
silence: the client's own deafness is never blamed on its workers.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from ..config import ControllerParams, SupervisionParams
from ..errors import DeviceException
from ..protocol import lastop

log = logging.getLogger("tdmesh")


class WorkerLost(NamedTuple):
    """Inbox item: a child's connection closed (or a relay lost ``ranks``); ``why`` says how."""
    why: str
    ranks: tuple = ()


class FleetFailure(NamedTuple):
    """Inbox item: the supervisor (or the reader) found the fleet broken."""
    error: DeviceException


class FleetInfo:
    """What the client knows of its workers, to name them in errors: host, pid, log files,
    and (for local_mesh) the launcher's account of a dead process."""

    def __init__(self, hellos: dict, log_dir: str | None, process_failure: Callable[[], str | None] | None,
                 relays: dict | None = None, failed_ranks: Callable[[], tuple[int, ...]] | None = None,
                 site_of: Callable[[int], str] | None = None) -> None:
        self.hellos = hellos
        self.log_dir = log_dir
        self.process_failure = process_failure
        self.failed_ranks = failed_ranks  # the launcher's: ranks whose processes it saw fail, the cause first
        self.relays = relays or {}  # child key -> (host index, ranks behind that relay)
        self.site_of = site_of  # the user's line of an op not yet complete

    def describe(self, rank: int) -> str:
        hello = self.hellos.get(rank)
        return "" if hello is None else f"(host {hello.hostname}, pid {hello.pid})"

    def name(self, key: int) -> str:
        """A child of the client by its key: a worker rank, or a host's relay and its ranks."""
        if key in self.relays:
            host, ranks = self.relays[key]
            return (f"the relay of host {host} (in worker rank {key} {self.describe(key)}; it serves ranks "
                    f"{_span(ranks)})")
        return f"worker rank {key} {self.describe(key)}"

    def where_logs(self) -> str:
        files = {r: h.log for r, h in self.hellos.items() if h.log}
        if files:
            return "worker logs: " + ", ".join(f"rank {r}: {f}" for r, f in sorted(files.items()))
        return f"worker logs: {self.log_dir or 'the terminal that started the workers'}"

    def exit_reason(self) -> str | None:
        """How dead workers ended, if the launcher can tell (local_mesh) within a moment: a
        dead process shows first as a closed connection or a broken pipe."""
        if self.process_failure is None:
            return None
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            why = self.process_failure()
            if why:
                return why
            time.sleep(0.05)
        return None

    def ranks_of(self, key: int) -> str:
        """The ranks behind a child of the client, named: ``3 (host h, pid p)`` for a worker."""
        if key in self.relays:
            host, ranks = self.relays[key]
            return f"{_span(ranks)} (behind the relay of host {host}, in worker rank {key} {self.describe(key)})"
        return f"{key} {self.describe(key)}"

    def died(self, why: str) -> DeviceException:
        """Worker processes died, by the launcher's account (``why``: the cause, then what followed from it):
        the cause first, then the op the dead worker was running and the user's line that issued it
        (``protocol/lastop.py``), then the consequences."""
        cause, _, then = why.partition("\n")
        lines = [cause]
        dead = self.failed_ranks() if self.failed_ranks is not None else ()
        hello = self.hellos.get(dead[0]) if dead else None
        seq = lastop.read(hello.pid) if hello is not None else None
        if seq is not None and self.site_of is not None:
            lines.append(f"it was running op {seq}, issued at {self.site_of(seq)}")
        return DeviceException("\n".join(lines + ([then] if then else []) + [self.where_logs()]))

    def lost(self, key: int, why: str, ranks: tuple = ()) -> DeviceException:
        """``key``'s connection closed (a worker, or a relay), or a relay lost ``ranks``."""
        if why.startswith("worker rank"):  # the launcher's account names the rank, host and pid itself
            return self.died(why)
        if len(ranks) > 1:
            who = f"worker ranks {_span(ranks)} (behind the relay of worker rank {key} {self.describe(key)})"
        else:
            who = self.name(key)
        return DeviceException(f"{who} was lost: {why}\n{self.where_logs()}")

    def broken_device(self, msg, site: str) -> DeviceException:
        """A worker's device is unusable (a sticky CUDA error): name the op, the user's line,
        the rank and where it ran."""
        return DeviceException(
            f"worker rank {msg.rank} {self.describe(msg.rank)} hit an error that leaves its device unusable, "
            f"and left: {msg.exc_type}: {msg.message.strip()}\n"
            f"The op that met it ({msg.function}) was issued at {site}\n"
            f"(CUDA reports a kernel's fault at a later call: with CUDA_LAUNCH_BLOCKING=1 set for the workers, "
            f"the op named is the one that faulted.)\n"
            f"Traceback on worker rank {msg.rank}:\n{msg.traceback.rstrip()}\n{self.where_logs()}")


def _span(ranks) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


class Supervisor:
    def __init__(self, client, supervision: SupervisionParams, controller: ControllerParams,
                 process_failure: Callable[[], str | None] | None = None) -> None:
        self.client = client
        self.supervision = supervision
        self.controller = controller
        self.process_failure = process_failure
        now = time.monotonic()
        self.last_seen = {r: now for r in client.children}  # workers, or relays (which watch their ranks)
        self.progress = {r: 0 for r in client.children}
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

    def answered(self, seq: int) -> bool:
        """Whether every child has run every op up to ``seq`` (the Status of a probe after it came back)."""
        return min(self.progress.values(), default=seq + 1) > seq

    # called by the client under its lock when it sends a probe ---------------------------------
    def probed(self, seq: int) -> None:
        self.probes.append((seq, time.monotonic()))
        self._last_probe = time.monotonic()

    # the watch -------------------------------------------------------------------------------
    def _loop(self) -> None:
        period = max(0.05, min(0.5, self.supervision.heartbeat_interval, self.controller.progress_check_interval / 4))
        client = self.client
        last = time.monotonic()
        while not client.exiting and client.failure is None:
            time.sleep(period)
            if client.exiting or client.failure is not None:
                return
            now = time.monotonic()
            stalled, last = now - last - period, now
            if stalled > period:
                self._discount(stalled)
            try:
                self._check()
            except Exception:  # noqa: BLE001 - the watch must not die silently
                log.exception("tdmesh supervisor check failed")

    def _check(self) -> None:
        client = self.client
        if self.process_failure is not None:
            why = self.process_failure()
            if why:
                return client.fail_from_supervisor(client.info.died(why))
        now = time.monotonic()
        timeout = self.supervision.heartbeat_timeout
        silent = [(rank, seen) for rank, seen in self.last_seen.items()
                  if now - seen > timeout and not self._unread(rank)]
        reading = client.reading  # the reader has waited inside one child's frame: no one else can be heard
        if silent and reading is not None and now - reading[1] > self.supervision.heartbeat_interval:
            return client.fail_from_supervisor(DeviceException(
                f"{client.info.name(reading[0])} stopped in the middle of a frame: the client has waited "
                f"{now - reading[1]:.1f} s for the rest of it (heartbeat_timeout={timeout} s)\n"
                f"{client.info.where_logs()}"))
        if silent:
            rank, seen = silent[0]
            client.observations.lost((rank,))  # what a heal replaces (tdmesh.FaultTolerance)
            return client.fail_from_supervisor(DeviceException(
                f"{client.info.name(rank)} stopped heartbeating: nothing heard for "
                f"{now - seen:.1f} s (heartbeat_timeout={timeout} s); it is hung or unreachable\n"
                f"{client.info.where_logs()}"))
        self._check_progress(now)

    def _discount(self, stalled: float) -> None:
        """This thread woke ``stalled`` seconds late: the process did not run (a call of the
        user's that held the GIL, a stopped process, an overloaded machine), so neither did its
        reader, and what the workers sent meanwhile waits unread.  Silence and lateness are
        measured without that time: a client kept from listening does not blame its workers."""
        for key in list(self.last_seen):
            self.last_seen[key] += stalled
        self.probes = [(seq, t + stalled) for seq, t in self.probes]

    def _unread(self, key: int) -> bool:
        """Whether ``key``'s connection holds bytes the reader has not taken yet: a child heard
        from but not yet read is alive, however long this process was kept from reading."""
        conn = self.client.conns.get(key)
        if conn is None:
            return False
        try:
            return conn.pending() > 0 or bool(select.select([conn.sock], [], [], 0)[0])
        except (OSError, ValueError):  # closed meanwhile: the reader reports that
            return False

    def _check_progress(self, now: float) -> None:
        client = self.client
        params = self.controller
        frontier = min(self.progress.values())
        self.probes = [(seq, t) for seq, t in self.probes if seq >= frontier]
        if now - self._last_probe > params.progress_check_interval and client.outstanding_work(frontier):
            client.send_probe()
        if not self.probes:
            return
        if client.debugger.stopped:  # a rank in pdb is not stuck: its ops' clocks start again when it resumes
            self.probes = [(seq, now) for seq, _ in self.probes]
            return
        seq, sent = self.probes[0]
        late = now - sent
        if late <= params.operation_timeout or seq in self._warned:
            return
        self._warned.add(seq)
        stuck = [r for r, p in sorted(self.progress.items()) if p <= seq]
        first = min(self.progress[r] for r in stuck)
        named = ", ".join(client.info.ranks_of(r) for r in stuck)
        message = (f"ranks {named} have operations that have not completed after "
                   f"{params.operation_timeout:g} seconds; the oldest was issued at {client.site_of(first)}")
        client.observations.warned(message)
        if params.fail_on_operation_timeout:
            client.fail_from_supervisor(DeviceException(message + f"\n{client.info.where_logs()}"))
        else:
            log.warning(message)

"""The fleet as the dashboard shows it: one JSON-ready dict built from what the client knows.

Everything here is read from the client (hellos, the supervisor's progress, the debugger,
``client.observations``), never asked of the workers: building a view sends nothing.  A
``Timeline`` keeps a point a second (ops issued, the slowest rank's ops completed) for the
throughput chart.
"""

from __future__ import annotations

import collections
import threading
import time
import traceback

from ..errors import RemoteException

STATES = ("running", "idle", "spare", "parked", "in pdb", "stuck", "dead", "exited", "starting")
TIMELINE_SECONDS = 300  # the chart's span: the last five minutes
LOG_LINES_SHOWN = 50


class Timeline:
    """A point a second while the client lives: (wall time, ops issued, each child's ops completed)."""

    def __init__(self, client, period: float = 1.0) -> None:
        self.client = client
        self.period = period
        self.points: collections.deque = collections.deque(maxlen=int(TIMELINE_SECONDS / period) + 1)
        self.stopped = False
        self.record()
        self._thread = threading.Thread(target=self._loop, name="tdmesh-dashboard-timeline", daemon=True)
        self._thread.start()

    def record(self) -> None:
        client = self.client
        self.points.append((time.time(), client.last_seq + 1, dict(client.supervisor.progress)))

    def _loop(self) -> None:
        client = self.client
        while not client.closed and not self.stopped:
            time.sleep(self.period)
            if client.failure is None and client.outstanding_work(min(client.supervisor.progress.values())):
                client.send_probe()  # progress a second old at most (one RequestStatus), not 100 ops behind
            self.record()

    def rates(self, window: float = 5.0) -> tuple[float, dict]:
        """Ops per second over the last ``window`` seconds: issued by the client, completed per child."""
        points = list(self.points)
        if len(points) < 2:
            return 0.0, {}
        last = points[-1]
        first = next((p for p in points if last[0] - p[0] <= window), points[-2])
        if first is last:
            first = points[-2]
        span = max(last[0] - first[0], 1e-9)
        completed = {k: (v - first[2].get(k, 0)) / span for k, v in last[2].items()}
        return (last[1] - first[1]) / span, completed

    def chart(self) -> list:
        """[[seconds ago, issued ops/s, slowest rank's completed ops/s], ...], oldest first."""
        points = list(self.points)
        now = points[-1][0] if points else time.time()
        out = []
        for a, b in zip(points, points[1:]):
            span = max(b[0] - a[0], 1e-9)
            slowest = min((b[2][k] - a[2].get(k, 0) for k in b[2]), default=0)
            out.append([round(b[0] - now, 1), round((b[1] - a[1]) / span, 1), round(slowest / span, 1)])
        return out


def child_of(client, rank: int) -> int:
    """The key of the client's child that carries ``rank`` (itself, or its host's relay)."""
    for key, (_, ranks) in client.info.relays.items():
        if rank in ranks:
            return key
    return rank


def rank_state(client, rank: int, sample, operation_timeout: float, dead=(), spares=()) -> str:
    """``dead``: ranks the launcher saw fail (a death the supervisor noticed before any connection closed);
    ``spares``: the fleet's spare workers (outside the mesh: "spare" where another rank would be "idle")."""
    obs = client.observations
    if rank in obs.lost_ranks or rank in dead:
        return "dead"
    if client.closed:
        return "parked" if obs.parked else "exited"
    if rank in client.debugger.stopped:
        return "in pdb"
    if sample is None:
        return "starting"
    streams = sample.streams
    if any(s[2] >= 0 and s[5] >= operation_timeout for s in streams):
        return "stuck"
    if any(s[2] >= 0 or s[1] > 0 for s in streams):
        return "running"
    return "spare" if rank in spares else "idle"


def error_view(exc: BaseException | None) -> dict | None:
    """The last error, with both tracebacks where it has two: where the user issued it, and the worker's."""
    if exc is None:
        return None
    view: dict = {"type": type(exc).__name__, "text": str(exc), "client_traceback": "", "worker_traceback": ""}
    if isinstance(exc, RemoteException):
        view.update(rank=exc.rank, message=f"{exc.exc_type}: {exc.message}",
                    client_traceback="".join(traceback.format_list(exc.call_site)),
                    worker_traceback=exc.worker_traceback)
    return view


def fleet_view(client, mesh, timeline: Timeline | None) -> dict:
    """``/api/fleet``: the job, then one entry per rank of the client's fleet."""
    obs = client.observations
    operation_timeout = client.controller.operation_timeout
    issued_rate, completed_rates = timeline.rates() if timeline is not None else (0.0, {})
    progress = client.supervisor.progress
    issued = client.last_seq + 1
    host_of = _hosts(mesh, client.ranks)
    now = time.monotonic()
    failed_ranks = client.info.failed_ranks
    dead = failed_ranks() if client.failure is not None and failed_ranks is not None else ()
    spares = mesh.fleet.spares if mesh.fleet is not None else ()
    ranks = []
    for rank in client.ranks:
        hello = client.hellos[rank]
        seen = obs.samples.get(rank)
        sample = seen[1] if seen is not None else None
        key = child_of(client, rank)
        completed = progress.get(key, 0)
        entry = {
            "rank": rank, "host": host_of.get(rank, 0), "hostname": hello.hostname, "pid": hello.pid,
            "device": hello.device, "state": rank_state(client, rank, sample, operation_timeout, dead, spares),
            "completed": completed, "behind": max(0, issued - completed),
            "ops_per_second": round(completed_rates.get(key, 0.0), 1),
            "sampled_ago": None if seen is None else round(now - seen[0], 1),
            "rss": None, "cuda_allocated": None, "cuda_reserved": None, "streams": [],
            "logs": list(obs.logs.get(rank, ()))[-LOG_LINES_SHOWN:], "log_file": hello.log,
        }
        if sample is not None:
            cuda = hello.device.startswith("cuda")
            entry.update(rss=sample.rss, cuda_allocated=sample.cuda_allocated if cuda else None,
                         cuda_reserved=sample.cuda_reserved if cuda else None,
                         streams=[{"id": s[0], "queued": s[1], "running": None if s[2] < 0 else
                                   {"seq": s[2], "what": s[3], "where": s[4], "for_s": s[5]}} for s in sample.streams])
        ranks.append(entry)
    failure = client.failure
    return {
        "time": time.time(),
        "job": {"state": "failed" if failure is not None else ("parked" if obs.parked else "exited")
                if client.closed else "running",
                "mesh": str(mesh).splitlines()[0], "dims": dict(mesh.sizes), "ranks": len(client.ranks),
                "device": client.device_type,
                "issued": issued, "ops_per_second": round(issued_rate, 1), "sample_interval": obs.interval,
                "operation_timeout": operation_timeout},
        "failure": error_view(failure),
        "last_error": error_view(obs.last_error),
        "warnings": [{"time": t, "text": text} for t, text in obs.warnings],
        "chart": timeline.chart() if timeline is not None else [],
        "states": list(STATES),
        "ranks": ranks,
    }


def _hosts(mesh, ranks) -> dict[int, int]:
    """Each rank's host index: its ``host`` coordinate where the mesh has that dim, else by hostname."""
    shape = mesh._shape
    if "host" in shape.labels:
        return {r: shape.coordinates(r)["host"] for r in shape.ranks()}
    return {r: 0 for r in ranks}

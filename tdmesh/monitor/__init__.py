"""``tdmesh.dashboard()``: a live page of the fleet, served from the client process.

One dashboard per process (as a cluster has one Ray dashboard): calling it again shows
the mesh passed (a new ``local_mesh`` in a notebook) on the same URL.  Until it is called
nothing runs: no thread, no socket, no worker sample.  Then workers send a sample a second
(``TDMESH_DASHBOARD_INTERVAL``), and this process runs the HTTP server and a thread that
keeps a point a second for the chart.  See docs/dashboard.md.
"""

from __future__ import annotations

import secrets
import socket
import threading

from ..config import env_float
from ..engine.context import get_active_mesh
from .server import LOOPBACK_NAMES, DashboardServer
from .view import Timeline, fleet_view

__all__ = ["dashboard", "stop_dashboard"]

_lock = threading.Lock()
_current: _Dashboard | None = None


class _Dashboard:
    def __init__(self, host: str, port: int, token: str | None, mesh) -> None:
        self.host = host
        self.mesh = mesh
        self.timeline = Timeline(mesh._live())
        self.server = DashboardServer(host, port, token, self.fleet, self.stacks)
        shown = socket.gethostname() if host in ("0.0.0.0", "", "::") else host
        self.url = f"http://{shown}:{self.server.port}/" + (f"?token={token}" if token else "")

    def show(self, mesh) -> None:
        if mesh._live() is not self.mesh._live():
            self._unwatch()
            self.timeline = Timeline(mesh._live())
        self.mesh = mesh

    def _unwatch(self) -> None:
        """The fleet shown so far stops sampling (if it still runs) and its chart's thread ends."""
        self.timeline.stopped = True
        client = self.mesh._live()
        if client.failure is None and not client.closed:
            client.observations.sample_every(0)

    def close(self) -> None:
        self._unwatch()
        self.server.close()

    def fleet(self) -> dict:
        mesh = self.mesh
        view = fleet_view(mesh._live(), mesh, self.timeline)
        view["url"] = self.url.split("?")[0]
        return view

    def stacks(self) -> dict[int, str]:
        return self.mesh._live().observations.stacks(self.mesh.rank_list, timeout=10.0)  # tdmesh.stacks


def dashboard(port: int | None = None, mesh=None, *, host: str = "127.0.0.1") -> str:
    """Serve the live page of ``mesh``'s fleet (default: the active mesh) and return its URL
    (printed the first time).  ``port`` None takes a free one.  ``host`` other than 127.0.0.1
    serves other machines, and then the page asks for the job's token (in the returned URL)."""
    global _current
    mesh = mesh if mesh is not None else get_active_mesh()
    client = mesh._live()
    with _lock:
        same = _current is not None and _current.host == host and port in (None, _current.server.port)
        if same:
            assert _current is not None
            _current.show(mesh)
        else:
            if _current is not None:
                _current.close()
            token = None if host in LOOPBACK_NAMES else _job_token(mesh)
            _current = _Dashboard(host, port or 0, token, mesh)
            print(f"tdmesh dashboard: {_current.url}", flush=True)
        url = _current.url
    if client.failure is None and not client.closed:
        client.observations.sample_every(max(1.0, env_float("TDMESH_DASHBOARD_INTERVAL")))
    return url


def stop_dashboard() -> None:
    """Close the page: its server and chart thread end, and the workers stop sampling (as
    before ``dashboard()``); a later ``dashboard()`` starts a new one."""
    global _current
    with _lock:
        if _current is not None:
            _current.close()
            _current = None


def _job_token(mesh) -> str:
    """The token workers prove to join this job (its gate's), else a new one for this page alone."""
    gate = getattr(getattr(mesh, "fleet", None), "gate", None)
    return getattr(gate, "token", None) or secrets.token_urlsafe(24)

"""The dashboard's HTTP server: the standard library's, one static page and two JSON routes.

``/`` is ``page.html`` (no build step: plain HTML, CSS and JavaScript that polls the JSON);
``/api/fleet`` is ``view.fleet_view``; ``/api/stacks`` is ``tdmesh.stacks`` of the fleet.
Bound to 127.0.0.1 it serves only requests whose ``Host`` is this machine's loopback name
(a page elsewhere cannot reach it through DNS rebinding).  Bound to any other address it
requires the job's token, from ``?token=`` once (then a same-site cookie) or an
``Authorization: Bearer`` header: the page shows code, paths and stacks (docs/SECURITY.md).
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger("tdmesh")

LOOPBACK_NAMES = ("127.0.0.1", "localhost")
_COOKIE = "tdmesh_token"


class DashboardServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, token: str | None, fleet, stacks) -> None:
        """``fleet()`` gives ``/api/fleet``'s dict, ``stacks()`` the ranks' stacks; ``token`` None: loopback only."""
        super().__init__((host, port), _Handler)
        self.token = token
        self.fleet = fleet
        self.stacks = stacks
        self.page = resources.files(__package__).joinpath("page.html").read_bytes()
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.2},
                                       name="tdmesh-dashboard", daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return self.server_address[1]

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self.thread.join(5)


class _Handler(BaseHTTPRequestHandler):
    server: DashboardServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        log.debug("dashboard: " + format, *args)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        url = urlsplit(self.path)
        refusal = self._refusal(url)
        if refusal:
            return self._send(403, "text/plain; charset=utf-8", refusal.encode())
        if url.path == "/":
            extra = {}
            token = parse_qs(url.query).get("token", [None])[0]
            if self.server.token is not None and token:
                extra["Set-Cookie"] = f"{_COOKIE}={token}; HttpOnly; SameSite=Strict; Path=/"
            return self._send(200, "text/html; charset=utf-8", self.server.page, extra)
        if url.path == "/api/fleet":
            return self._json(200, self.server.fleet())
        if url.path == "/api/stacks":
            try:
                return self._json(200, {str(rank): text for rank, text in self.server.stacks().items()})
            except Exception as e:  # noqa: BLE001 - the page shows why (a dead fleet, a rank that did not answer)
                return self._json(503, {"error": f"{type(e).__name__}: {e}"})
        self._send(404, "text/plain; charset=utf-8", f"no such page: {url.path}\n".encode())

    def _refusal(self, url) -> str | None:
        token = self.server.token
        if token is None:
            host = (self.headers.get("Host") or "").rsplit(":", 1)[0].strip("[]")
            if host not in LOOPBACK_NAMES:
                return f"this dashboard serves only its own machine (Host {host!r} is not {LOOPBACK_NAMES})\n"
            return None
        offered = parse_qs(url.query).get("token", [None])[0] or _cookie(self.headers.get("Cookie", "")) or \
            (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
        if offered and hmac.compare_digest(offered.encode(), token.encode()):
            return None
        return "this dashboard needs the job's token: open the URL that tdmesh.dashboard() returned\n"

    def _json(self, status: int, value) -> None:
        self._send(status, "application/json", json.dumps(value).encode())

    def _send(self, status: int, kind: str, body: bytes, extra: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)


def _cookie(header: str) -> str | None:
    for part in header.split(";"):
        name, _, value = part.strip().partition("=")
        if name == _COOKIE:
            return value
    return None

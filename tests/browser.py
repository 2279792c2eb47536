"""A real headless Chromium, driven over the DevTools protocol on a pipe (standard library only).

``--remote-debugging-pipe`` makes Chromium read protocol messages (JSON, each ended by a NUL
byte) from its fd 3 and write its own to fd 4: no port, no websocket client.  Enough of the
protocol for the dashboard's tests: open a page, evaluate JavaScript in it (clicks, DOM
queries), and save a screenshot.  ``browser_path()`` is None where no Chromium is installed;
``TDMESH_REQUIRE_BROWSER=1`` (set by ``.ci/run``) makes that a failure instead of a skip.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import threading
import time

import pytest

from tdmesh.config import env_str

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# headless, as root (CI), and without the background connections a closed network refuses at every start
QUIET_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
               "--no-default-browser-check", "--disable-quic", "--disable-background-networking",
               "--disable-component-update", "--disable-sync")


def browser_path() -> str | None:
    return next((p for p in map(shutil.which, CANDIDATES) if p), None)


def require_browser() -> str:
    path = browser_path()
    if path is None:
        if env_str("TDMESH_REQUIRE_BROWSER") == "1":
            pytest.fail(f"no Chromium ({', '.join(CANDIDATES)}) on PATH, and TDMESH_REQUIRE_BROWSER=1: install "
                        f"Debian's chromium package (.ci/run does)")
        pytest.skip("no Chromium on PATH (Debian: apt-get install chromium)")
    return path


class Chromium:
    """One headless browser process; ``open(url)`` gives a Page.  Use as a context manager."""

    def __init__(self, profile_dir: str, width: int = 1400, height: int = 1000) -> None:
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        args = [require_browser(), *QUIET_FLAGS, "--remote-debugging-pipe",
                f"--user-data-dir={profile_dir}", f"--window-size={width},{height}", "about:blank"]
        # the pipe ends become the browser's fds 3 and 4 (bash moves them there, then execs it)
        self.process = subprocess.Popen(
            ["bash", "-c", f'exec "$@" 3<&{to_browser_r} 4>&{from_browser_w}', "chromium", *args],
            pass_fds=(to_browser_r, from_browser_w), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._next_id = 0
        self._replies: dict[int, dict] = {}
        self._arrived = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        buffer = b""
        while True:
            chunk = os.read(self._from_browser, 1 << 16)
            if not chunk:
                with self._arrived:
                    self._arrived.notify_all()
                return
            buffer += chunk
            while b"\0" in buffer:
                raw, buffer = buffer.split(b"\0", 1)
                message = json.loads(raw)
                if "id" in message:
                    with self._arrived:
                        self._replies[message["id"]] = message
                        self._arrived.notify_all()

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 30):
        self._next_id += 1
        number = self._next_id
        message: dict = {"id": number, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        with self._arrived:
            while number not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or self.process.poll() is not None:
                    raise TimeoutError(f"Chromium did not answer {method} (exit code {self.process.poll()})")
                self._arrived.wait(min(left, 0.5))
            reply = self._replies.pop(number)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def open(self, url: str) -> Page:
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        page.send("Page.enable")
        page.send("Runtime.enable")
        page.send("Page.navigate", {"url": url})
        return page

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=5)
        except (TimeoutError, RuntimeError, OSError):
            pass
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._to_browser)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Page:
    def __init__(self, browser: Chromium, session: str) -> None:
        self.browser = browser
        self.session = session

    def send(self, method: str, params: dict | None = None, timeout: float = 30):
        return self.browser.send(method, params, self.session, timeout)

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (awaited if it is a promise)."""
        result = self.send("Runtime.evaluate", {"expression": expression, "awaitPromise": True,
                                                 "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0):
        """Poll ``expression`` until it is truthy; its value.  A TimeoutError shows the last value."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            try:
                value = self.evaluate(expression)
            except RuntimeError:  # the page is still loading: its elements are not there yet
                value = None
            if value:
                return value
            time.sleep(0.2)
        raise TimeoutError(f"{expression!r} stayed {value!r} for {timeout} s")

    def screenshot(self, path: str) -> None:
        data = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

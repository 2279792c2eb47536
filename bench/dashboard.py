"""What the dashboard costs the dispatch loop: bench.dispatch's section (2), with the page open
and refreshing against without it, interleaved round by round on one fleet in this run.

    python -m bench.dashboard                       # 10,000 adds, 1 CPU worker, 7 rounds
    python -m bench.dashboard --device cuda         # one GPU worker
    python -m bench.dashboard --viewer python       # the page's requests made by a thread here

Each round times the loop (issue + one fetch) once without the dashboard (never opened, or
closed with ``stop_dashboard()``: no server, no sample), then once with it open, workers sampling
every second and a viewer refreshing: a headless Chromium showing the page (``--viewer
browser``, the default where Chromium is installed; it polls ``/api/fleet`` every second as a
user's tab does) or a thread in this process that GETs ``/`` and ``/api/fleet`` every second
(``--viewer python``: the server's work without the browser's own CPU).  The viewer starts
before the timed loop and gets ``--settle`` seconds to load.  Prints ops/s of both, and the
median of the per-round ratios (target: >= 0.97); and the client's CPU time per op (all its
threads), which moves with the wall time round to round: the loop's own work varies, so the
spread is not time spent waiting.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

if __package__ in (None, ""):  # run as ``python bench/dashboard.py``
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import helpers as h  # noqa: E402
from bench.dispatch import SHAPE  # noqa: E402


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench.dashboard", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=10_000, help="adds per timed loop (default 10000)")
    p.add_argument("--rounds", type=int, default=7, help="rounds of without/with (default 7)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--viewer", choices=("browser", "python"), default=None,
                   help="what refreshes the page (default: browser where Chromium is installed, else python)")
    p.add_argument("--settle", type=float, default=2.0, help="seconds a viewer gets to load before timing")
    return h.parse(p, argv, iters=300, rounds=1, viewer="python", settle=0.2)


class PythonViewer:
    """The page's own requests, made from a thread: ``/`` once, then ``/api/fleet`` every second."""

    def __init__(self, url: str) -> None:
        self.url, self.stop, self.requests = url, threading.Event(), 0
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        urllib.request.urlopen(self.url, timeout=30).read()
        while not self.stop.wait(1.0):
            urllib.request.urlopen(self.url + "api/fleet", timeout=30).read()
            self.requests += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


class BrowserViewer:
    """A headless Chromium showing the page (it refreshes itself every second)."""

    def __init__(self, url: str, browser: str) -> None:
        self.profile = tempfile.mkdtemp(prefix="tdmesh_bench_chromium_")
        self.process = subprocess.Popen([browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                                         "--disable-background-networking", "--disable-component-update",
                                         "--disable-sync", f"--user-data-dir={self.profile}", url],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(30)
        shutil.rmtree(self.profile, ignore_errors=True)


def timed_loop(mesh, n: int) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds over all its threads) of the loop."""
    import tdmesh
    with mesh.activate():
        t0, c0 = time.perf_counter(), time.process_time()
        local = h.run_loop_local(n, SHAPE)
        value = tdmesh.fetch_shard(local).result()
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert float(value.min()) == float(value.max()) == n
    return elapsed, cpu


def main(argv=None) -> None:
    args = _parse(argv)
    if args.device == "cpu":
        os.environ["TDMESH_DEVICE"] = "cpu"
    import tdmesh
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    viewer_kind = args.viewer or ("browser" if browser else "python")
    if viewer_kind == "browser" and browser is None:
        sys.exit("--viewer browser: no Chromium on PATH")
    print(f"bench.dashboard: {args.iters:,} adds of {SHAPE} per loop, 1 {args.device} worker, {args.rounds} rounds, "
          f"viewer: {viewer_kind}{f' ({browser})' if viewer_kind == 'browser' else ''}")
    without, with_page, ratios, cpu_ratios = [], [], [], []
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1, pool=False) as mesh:
        timed_loop(mesh, 1000)  # warm-up
        for r in range(args.rounds):
            plain, plain_cpu = timed_loop(mesh, args.iters)
            url = tdmesh.dashboard(mesh=mesh)
            viewer = BrowserViewer(url, browser) if viewer_kind == "browser" else PythonViewer(url)
            time.sleep(args.settle)
            try:
                watched, watched_cpu = timed_loop(mesh, args.iters)
                view = fleet_json(url)
            finally:
                viewer.close()
                tdmesh.stop_dashboard()
            assert len(view["ranks"]) == 1 and view["ranks"][0]["rss"], view
            without.append(args.iters / plain)
            with_page.append(args.iters / watched)
            ratios.append(plain / watched)
            cpu_ratios.append(plain_cpu / watched_cpu)
            print(f"  round {r}: without {without[-1]:,.0f} ops/s, with the page open {with_page[-1]:,.0f} ops/s, "
                  f"ratio {ratios[-1]:.3f}; client CPU per op {plain_cpu / args.iters * 1e6:.1f} vs "
                  f"{watched_cpu / args.iters * 1e6:.1f} us, ratio {cpu_ratios[-1]:.3f}")
    h.print_table(["", "ops/s (median)", "best"],
                  [["without the dashboard", f"{statistics.median(without):,.0f}", f"{max(without):,.0f}"],
                   ["page open, refreshing", f"{statistics.median(with_page):,.0f}", f"{max(with_page):,.0f}"]])
    print(f"with/without: median of the per-round ratios {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}; target >= 0.97)")
    print(f"client CPU per op, without/with: median of the per-round ratios {statistics.median(cpu_ratios):.3f} "
          f"(min {min(cpu_ratios):.3f}, max {max(cpu_ratios):.3f}; every thread of this process, the viewer "
          f"thread's requests included with --viewer python)")


def fleet_json(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "api/fleet", timeout=30).read())


if __name__ == "__main__":
    main()

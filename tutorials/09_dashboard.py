"""The fleet's live page: tdmesh.dashboard(), its JSON view, and tdmesh.stacks().

    python tutorials/09_dashboard.py                      # prints the URL; the page lives while it runs
    python tutorials/09_dashboard.py --hold 120           # keep it up two more minutes to look around
    python tutorials/09_dashboard.py --screenshot out.png # headless Chromium photographs it mid-run

One call serves a page from this process (127.0.0.1, a free port) with every rank's state,
progress, memory, running op, recent log lines and last error, and a button for every rank's
stacks; ``/api/fleet`` is the same as JSON for scripts.  Nothing of it runs until it is called.
Here a small model trains data-parallel on 2x2 CPU workers, printing on the workers, while
the script reads its own dashboard; then rank 0 runs a slow function and the page shows it.
"""

import argparse
import json
import os
import shutil
import subprocess
import time
import urllib.request

import torch

import tdmesh
from tdmesh import remote


def report(step: int, loss: float) -> None:
    """Runs on every worker: its print shows in the page's log lines of that rank."""
    print(f"rank {os.environ['RANK']}: step {step} loss {loss:.4f}", flush=True)


def slow_on_rank_0(seconds: float) -> str:
    if int(os.environ["RANK"]) == 0:
        time.sleep(seconds)  # the page shows rank 0 running this, the others idle
    return "done"


def api(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "api/fleet", timeout=30).read())


def screenshot(url: str, path: str) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        print("no Chromium here: no screenshot (Debian: apt-get install chromium)")
        return
    subprocess.run([browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--disable-quic",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    "--window-size=1400,1250", "--virtual-time-budget=4000", f"--screenshot={os.path.abspath(path)}",
                    url], check=True, capture_output=True, timeout=120)
    print(f"screenshot: {path}")


def main(mesh: tdmesh.DeviceMesh, args) -> None:
    with mesh.activate():
        url = tdmesh.dashboard()  # printed once: "tdmesh dashboard: http://127.0.0.1:<port>/"
        torch.manual_seed(0)
        w = torch.randn(32, 1, requires_grad=True)
        for step in range(30):
            x = torch.randn(64, 32)
            loss = ((x @ w - x.sum(1, keepdim=True)) ** 2).mean()
            loss.backward()
            with torch.no_grad():
                w.grad.reduce_(("host", "gpu"), "avg")
                w -= 0.01 * w.grad
                w.grad = None
            if step % 10 == 0:
                remote(report).call(step, loss.detach()).result()
        time.sleep(2.5)  # a sample a second: let the page catch up
        view = api(url)
        print(f"the page's view: job {view['job']['state']}, {view['job']['issued']} ops issued")
        for rank in view["ranks"]:
            print(f"  rank {rank['rank']} host {rank['host']}: {rank['state']}, completed {rank['completed']}, "
                  f"RSS {rank['rss'] / 2**20:.0f} MiB, last log line: {rank['logs'][-1] if rank['logs'] else None!r}")

        slow = remote(slow_on_rank_0).call(6 if args.screenshot else 3)
        time.sleep(1.5)
        cell = api(url)["ranks"][0]
        busy = [s["running"] for s in cell["streams"] if s["running"]]
        print(f"while it runs, rank 0 is {cell['state']}: {busy[0]['what'] if busy else '-'}")
        main_stream = tdmesh.stacks()[0].split("Thread 'tdmesh-stream-0':")[1]
        print("rank 0's main stream is at:", main_stream.strip().splitlines()[-1].strip())
        if args.screenshot:
            screenshot(url, args.screenshot)
        print("slow function:", [value for _, value in slow.result()])
        if args.hold:
            print(f"the page stays up for {args.hold} s: {url}")
            time.sleep(args.hold)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--screenshot", help="save a PNG of the page, taken by headless Chromium")
    parser.add_argument("--hold", type=float, default=0, help="seconds to keep the page up at the end")
    args = parser.parse_args()
    if "RANK" in os.environ:
        main(tdmesh.world_mesh(), args)
    else:
        with tdmesh.local_mesh(hosts=2, gpus_per_host=2) as mesh:
            main(mesh, args)

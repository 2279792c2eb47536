"""A client script for the torchrun tests: computes on every rank, then behaves as argv asks."""
import sys

import torch

import tdmesh

mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
mesh = tdmesh.world_mesh()
print("mesh sizes", mesh.sizes, "argv", sys.argv[1:], "restart", tdmesh.restart_count(), flush=True)
with mesh.activate():
    x = torch.ones(2) * (mesh.process_idx() + 1)
    last = {d: n - 1 for d, n in mesh.sizes.items()}
    print("last rank value", tdmesh.fetch_shard(x, **last).result().tolist(), flush=True)
if mode == "dashboard":  # the page of rank 0's client: every rank of the torchrun job, sampled
    import json
    import time
    import urllib.request
    url = tdmesh.dashboard(mesh=mesh)
    deadline = time.monotonic() + 60
    while True:
        view = json.loads(urllib.request.urlopen(url + "api/fleet", timeout=30).read())
        if all(r["rss"] for r in view["ranks"]) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    print("dashboard ranks", [r["rank"] for r in view["ranks"]], "states", [r["state"] for r in view["ranks"]],
          "sampled", all(r["rss"] for r in view["ranks"]), flush=True)
    tdmesh.stop_dashboard()
if mode == "exit3":
    sys.exit(3)
if mode == "raise":
    raise ValueError("the script failed on purpose")
print("script done", flush=True)

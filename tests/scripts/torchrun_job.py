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
    from dashboard_view import sampled_view  # beside this script
    view = sampled_view(tdmesh.dashboard(mesh=mesh))
    print("dashboard ranks", [r["rank"] for r in view["ranks"]], "states", [r["state"] for r in view["ranks"]],
          "sampled", all(r["rss"] for r in view["ranks"]), flush=True)
    tdmesh.stop_dashboard()
if mode == "exit3":
    sys.exit(3)
if mode == "raise":
    raise ValueError("the script failed on purpose")
print("script done", flush=True)

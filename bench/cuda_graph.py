"""Exploration: what would replaying a compiled recording as a CUDA graph give?

    python -m bench.cuda_graph          (needs CUDA)

On one GPU worker, the dispatch bench's loop (N dependent adds of 100x100) run eagerly vs
captured once as a CUDA graph and replayed, compared with plain local eager CUDA and with the
same loop dispatched op by op from the client.  tdmesh does not replay recordings as graphs
yet; this measures the head-room.
"""

import argparse
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import helpers as h  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cuda_graph", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=10_000, help="dependent adds (default 10000)")
    args = h.parse(p, argv, iters=200)
    h.require_cuda("cuda_graph")
    h.ensure_importable_by_workers()
    import torch

    import tdmesh
    n, shape = args.iters, (100, 100)
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1) as mesh, mesh.activate():
        probe = tdmesh.remote("bench.helpers.graph_vs_eager",
                              propagate=lambda n, s: torch.empty(2, dtype=torch.float64))
        eager, replay = tdmesh.fetch_shard(probe(n, shape)).result().tolist()
        local, ones = torch.zeros(shape), torch.ones(shape)
        t0 = time.perf_counter()
        for _ in range(n):
            local = ones + local
        tdmesh.fetch_shard(local[0, 0]).result()
        dispatched = time.perf_counter() - t0
    print(f"{n:,} dependent adds of {shape[0]}x{shape[1]} fp32 on one GPU worker (torch {torch.__version__}):")
    print(f"  eager on the worker          {eager * 1e3:8.2f} ms   {n / eager:12,.0f} ops/s")
    print(f"  CUDA graph replay (worker)   {replay * 1e3:8.2f} ms   {n / replay:12,.0f} ops/s   "
          f"{eager / replay:5.1f}x eager")
    print(f"  dispatched from the client   {dispatched * 1e3:8.2f} ms   {n / dispatched:12,.0f} ops/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

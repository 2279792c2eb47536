"""Where a CUDA-graph replay of the small GPT step spends its time, ``zero_grad()`` against
``zero_grad(set_to_none=False)``, same run (GPU only); with ``--forms``, the step as a program against
the same step as a CUDA graph (``--keep-graph``: kept even where slower, to see why):

    python3 -m bench.graph_profile
    python3 -m bench.graph_profile --size gpt2 --dtype bf16 --batch-size 16 --forms --keep-graph

Per variant (each twice, alternating): ms per step over 30 replays (``--steps``) (batches made before the
timer), then 5 replays under ``tdmesh.profile``: rank 0's event categories per step, the GPU
kernels' span and busy time, and the host ops that took longest.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import runpy
import sys
import tempfile
import time

from bench import helpers as h

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tutorials"))
PROFILED = 5


def summarise(trace_path: str) -> None:
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if "dur" in e]
    cats: dict = collections.defaultdict(lambda: [0, 0.0])
    names: dict = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        cat = e.get("cat")
        cats[cat][0] += 1
        cats[cat][1] += e["dur"]
        if cat in ("cpu_op", "cuda_runtime"):
            names[(cat, e["name"][:60])][0] += 1
            names[(cat, e["name"][:60])][1] += e["dur"]
    per_step = {k: (v[0] // PROFILED, round(v[1] / PROFILED / 1e3, 3)) for k, v in cats.items()}
    print("  categories (count, ms per step):", per_step)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if kernels:
        span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
        busy = sum(e["dur"] for e in kernels)
        print(f"  GPU kernels: span {span / PROFILED / 1e3:.3f} ms per step, busy {busy / PROFILED / 1e3:.3f} ms")
    for (cat, name), (n, dur) in sorted(names.items(), key=lambda kv: -kv[1][1])[:10]:
        print(f"    {cat:13s} {name:60s} {n / PROFILED:7.1f}/step {dur / PROFILED / 1e3:8.3f} ms/step")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.graph_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=("tiny", "small", "gpt2"), default="small")
    p.add_argument("--steps", type=int, default=30, help="timed replays per variant")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--keep-graph", action="store_true",
                   help="keep each graph untimed (TDMESH_GRAPH_TRIALS=0): profile a graph even where it is slower")
    p.add_argument("--forms", action="store_true",
                   help="compare the step as a program and as a CUDA graph (zero_grad's default), not zero_grad's two")
    args = h.parse(p, argv, size="tiny", steps=2)
    h.require_cuda("graph_profile")
    if args.keep_graph:
        os.environ["TDMESH_GRAPH_TRIALS"] = "0"  # the workers start below: they read it
    import torch

    import tdmesh
    from bench.helpers import data_parallel_step, train_optimizer

    from nanogpt import GPT, sized
    train = runpy.run_path(os.path.join(ROOT, "tutorials", "05_train.py"))
    cfg, tokens = sized(args.size)
    from tdmesh.worker.graphs import TRIALS
    warm, timed = 5 + 2 * TRIALS, args.steps  # past the graph's trials (worker/graphs.py)
    batch = tdmesh.remote(train["seeded_batch"], propagate=lambda d, b, t, r, s: (
        torch.empty(b, t, dtype=torch.int64), torch.empty(b, t, dtype=torch.int64)))
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1) as mesh, mesh.activate():
        data = torch.tensor(tokens)
        rank = mesh.rank(mesh.names)
        variants = [(False, False), (False, True)] * 2 if args.forms else [(True, False), (True, True)] * 2
        for graph, keep in variants:
            tdmesh.random.set_manual_seed_remote(0)
            model = GPT(cfg)
            opt = train_optimizer(model.parameters(), True)
            step = data_parallel_step(model, opt, mesh, args.dtype == "bf16", set_to_none=not keep)
            fn = tdmesh.compile(step, cuda_graph=True if graph else False)
            xs = [batch(data, args.batch_size, cfg.block_size, rank, i) for i in range(warm + timed + PROFILED)]
            for x, y in xs[:warm]:
                loss = fn(x, y)
            tdmesh.fetch_shard(loss).result()
            start = time.perf_counter()
            for x, y in xs[warm:warm + timed]:
                loss = fn(x, y)
            tdmesh.fetch_shard(loss).result()
            per_step = (time.perf_counter() - start) / timed
            what = f"cuda_graph={graph}" if args.forms else f"zero_grad(set_to_none={not keep})"
            print(f"{what}: {per_step * 1e3:.3f} ms/step, mode {fn.mode}, "
                  f"{len(fn.last.kept_refs)} state refs", flush=True)
            with tdmesh.profile(tempfile.mkdtemp()) as traces:
                for x, y in xs[warm + timed:]:
                    loss = fn(x, y)
                tdmesh.fetch_shard(loss).result()
            summarise(os.path.join(traces, "rank0.trace.json"))


if __name__ == "__main__":
    main()

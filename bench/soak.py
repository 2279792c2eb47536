"""Soak: a million small ops with ten thousand live tensors; memory must stay flat.

Run from the repository root:

    python -m bench.soak                       # 1,000,000 ops, 10,000 live tensors (minutes on 2 cores)
    python -m bench.soak --ops 100000          # a quicker run
    python bench/soak.py --ops 200000 --live 1000 --samples 20

One CPU worker (``local_mesh(hosts=1, gpus_per_host=1)``).  After a warm-up, ``--live``
tensors of 4 elements are created and held in a list for the whole run; then the loop
``x = x + 1`` on a 4-element tensor runs ``--ops`` times under ``mesh.activate()`` with no
fetch until the end (so only the client's own progress probes keep its bookkeeping
bounded), then one fetch checks the value.  RSS (``VmRSS`` of ``/proc/<pid>/status``) of
the client and of the worker (pid from ``mesh.client.hellos``) is printed at the start,
``--samples`` times during the loop, and at the end, with the client's history length, the
worker's live refs and ops/s.  The last line is

    client RSS start X MiB end Y MiB; worker RSS start A MiB end B MiB

and the exit code is 1 when either process grew by more than ``--max-growth`` MiB.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

if __package__ in (None, ""):  # run as ``python bench/soak.py``
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import helpers as h  # noqa: E402

SHAPE = (4,)


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", type=int, default=1_000_000, help="ops in the loop (default 1,000,000)")
    p.add_argument("--live", type=int, default=10_000, help="tensors held alive during the loop (default 10,000)")
    p.add_argument("--warmup", type=int, default=20_000, help="ops before the start sample (default 20,000)")
    p.add_argument("--samples", type=int, default=10, help="RSS samples during the loop (default 10)")
    p.add_argument("--max-growth", type=float, default=64.0,
                   help="MiB either process may grow from start to end before the run counts as a leak")
    return h.parse(p, argv, ops=3000, live=200, warmup=500, samples=2)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no VmRSS for pid {pid}")


def main(argv=None) -> int:
    args = _parse(argv)
    os.environ.setdefault("TDMESH_DEVICE", "cpu")
    h.ensure_importable_by_workers()
    import torch

    import tdmesh

    print(f"soak: {args.ops:,} ops of x = x + 1 on {SHAPE}, {args.live:,} live tensors; {h.machine_line()}",
          flush=True)
    live_refs = tdmesh.remote("tdmesh.worker.builtins.live_refs")
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1) as mesh:
        client = mesh.client
        me, worker = os.getpid(), client.hellos[0].pid

        def sample(label: str, done: int | None = None, rate: float | None = None) -> tuple[float, float]:
            c, w = rss_mib(me), rss_mib(worker)
            extra = f"  ops {done:>10,}" if done is not None else ""
            extra += f"  {rate:>9,.0f} ops/s" if rate is not None else ""
            print(f"{label:<8} client RSS {c:8.1f} MiB  worker RSS {w:8.1f} MiB  history {len(client.history):>7,}"
                  f"{extra}", flush=True)
            return c, w

        def worker_refs() -> int:
            """Refs the worker holds."""
            return tdmesh.call_on_shard_and_fetch(live_refs).result()

        with mesh.activate():
            sample("launch")
            x = torch.zeros(SHAPE)
            for _ in range(args.warmup):  # allocators, caches and buffers reach their steady size
                x = x + 1
            assert tdmesh.inspect(x).tolist() == [float(args.warmup)] * SHAPE[0]
            before = worker_refs()
            gc.collect()
            sample("warm", args.warmup)
            live = [torch.full(SHAPE, float(i)) for i in range(args.live)]
            assert tdmesh.inspect(live[-1]).tolist() == [float(args.live - 1)] * SHAPE[0]
            gc.collect()
            start = sample("start")

            every = max(1, args.ops // max(1, args.samples))
            t0 = time.perf_counter()
            for i in range(1, args.ops + 1):
                x = x + 1
                if i % every == 0 and i != args.ops:
                    sample("loop", i, i / (time.perf_counter() - t0))
            issued = time.perf_counter() - t0
            value = tdmesh.inspect(x)
            elapsed = time.perf_counter() - t0
            expected = float(args.warmup + args.ops)
            assert value.tolist() == [expected] * SHAPE[0], (value, expected)
            assert tdmesh.inspect(live[0]).tolist() == [0.0] * SHAPE[0]
            assert tdmesh.inspect(live[args.live // 2]).tolist() == [float(args.live // 2)] * SHAPE[0]
            refs = worker_refs()
            gc.collect()
            end = sample("end", args.ops, args.ops / elapsed)
        print(f"ops/s {args.ops / elapsed:,.0f} (issue {args.ops / issued:,.0f} ops/s; {elapsed:.1f} s in all); "
              f"worker live refs {before} before the live list, {refs} at the end (live list {args.live:,})",
              flush=True)
        del live
    growth = (end[0] - start[0], end[1] - start[1])
    flat = max(growth) <= args.max_growth
    print(f"growth over {args.ops:,} ops: client {growth[0]:+.1f} MiB, worker {growth[1]:+.1f} MiB -> "
          f"{'flat' if flat else 'NOT FLAT'} (limit {args.max_growth:g} MiB)", flush=True)
    print(f"client RSS start {start[0]:.1f} MiB end {end[0]:.1f} MiB; "
          f"worker RSS start {start[1]:.1f} MiB end {end[1]:.1f} MiB", flush=True)
    return 0 if flat else 1


if __name__ == "__main__":
    sys.exit(main())

"""tdmesh ``reduce`` over every rank vs raw ``dist.all_reduce`` on the same tensors, same run.

    python -m bench.reduce                    # CPU workers (gloo), 1 KiB .. 16 MiB
    python -m bench.reduce --device cuda      # GPU workers (NCCL), 1 KiB .. 1 GiB
    python -m bench.reduce --quick            # CI smoke

For each size: (raw) one remote function runs ``iters`` ``dist.all_reduce`` calls on the
workers over the same process group users get from ``mesh.process_group``, timed on the
workers; (tdmesh) the client issues ``iters`` ``x.reduce_()`` ops and waits for the last
(a fetch of one element), timed on the client, so dispatch, transport and completion are
included.  Bus bandwidth = 2 (n-1)/n x bytes / time per op (NCCL's convention).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import helpers as h  # noqa: E402


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench.reduce", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-bytes", type=int, default=None, help="largest size (default 16 MiB cpu, 1 GiB cuda)")
    p.add_argument("--quick", action="store_true")
    return p.parse_args(argv)


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.0f} TiB"


def main(argv=None) -> None:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.device == "cpu":
        os.environ["TDMESH_DEVICE"] = "cpu"
    os.environ.setdefault("PYTHONPATH", h.REPO_ROOT)
    import torch
    import tdmesh
    max_bytes = args.max_bytes or (1 << 30 if args.device == "cuda" else 16 << 20)
    if args.quick:
        max_bytes = min(max_bytes, 1 << 20)
    sizes = []
    b = 1024
    while b <= max_bytes:
        sizes.append(b)
        b *= 4
    rows = []
    with tdmesh.local_mesh(hosts=1, gpus_per_host=args.workers) as mesh:
        n = len(mesh)
        pg = mesh.process_group(mesh.names)
        raw = tdmesh.remote("bench.helpers.raw_all_reduce_seconds",
                            propagate=lambda x, pg, iters: torch.empty((), dtype=torch.float64))
        with mesh.activate():
            for size in sizes:
                numel = size // 4
                iters = max(3, min(200, (256 << 20) // size)) if not args.quick else 3
                x = torch.ones(numel)
                y = torch.ones(numel)
                # every rank runs the raw loop (it is a collective); rank 0's timing is reported
                raw_s = float(tdmesh.fetch_shard(raw(x, pg, iters)).result())
                y.reduce_()                       # warm-up: creates the groups
                tdmesh.fetch_shard(y[:1]).result()
                start = time.perf_counter()
                for _ in range(iters):
                    y.reduce_()
                tdmesh.fetch_shard(y[:1]).result()
                ours_s = time.perf_counter() - start
                factor = 2 * (n - 1) / n
                raw_bw = factor * size / (raw_s / iters) / 1e9
                ours_bw = factor * size / (ours_s / iters) / 1e9
                rows.append((size, iters, raw_s / iters * 1e6, ours_s / iters * 1e6, raw_bw, ours_bw))
                del x, y
    print(f"\nreduce (all ranks, sum) vs raw dist.all_reduce; {n} {args.device} workers; "
          f"torch {torch.__version__}")
    print(f"{'size':>9} {'iters':>6} {'raw us/op':>11} {'tdmesh us/op':>13} {'raw GB/s':>9} "
          f"{'tdmesh GB/s':>12} {'ratio':>6}")
    for size, iters, raw_us, ours_us, raw_bw, ours_bw in rows:
        print(f"{_fmt_bytes(size):>9} {iters:>6} {raw_us:>11.1f} {ours_us:>13.1f} {raw_bw:>9.2f} "
              f"{ours_bw:>12.2f} {ours_bw / raw_bw:>6.2f}")


if __name__ == "__main__":
    main()

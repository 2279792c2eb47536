"""tdmesh ``reduce`` over every rank vs raw ``dist.all_reduce`` on the same tensors, same run.

    python -m bench.reduce                    # CPU workers (gloo), 1 KiB .. 16 MiB
    python -m bench.reduce --device cuda      # GPU workers (NCCL), 1 KiB .. 1 GiB
    python -m bench.reduce --quick            # CI smoke

For each size:
  raw     one remote function runs ``iters`` ``dist.all_reduce`` calls on the workers over the
          same process group users get from ``mesh.process_group``, timed on the workers
          (synchronising CUDA); ``iters`` is chosen so that the raw loop lasts ~``--seconds``.
  e2e     the client issues ``iters`` ``x.reduce_()`` ops and waits for the last (a fetch of
          one element), timed on the client: dispatch, transport, the pipeline's start and the
          final round trip are all included.
  steady  the same, timed for ``iters`` and for ``2 * iters`` ops; (T(2k) - T(k)) / k is the
          per-op time once the pipeline is full, without the one-off start and fetch.
Bus bandwidth = 2 (n-1)/n x bytes / time per op (NCCL's convention); ratios are tdmesh ÷ raw
bandwidth (1.0 = parity, below 1 = slower).
"""

from __future__ import annotations

import argparse
import os
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
    p.add_argument("--seconds", type=float, default=0.2, help="target length of each raw loop")
    p.add_argument("--quick", action="store_true")
    return h.parse(p, argv, quick=True)


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.0f} TiB"


def _timed_reduces(tdmesh, y, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        y.reduce_()
    tdmesh.fetch_shard(y[:1]).result()
    return time.perf_counter() - start


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
    seconds = 0.01 if args.quick else args.seconds
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
                x = torch.ones(numel)
                y = torch.ones(numel)
                # every rank runs the raw loop (it is a collective); rank 0's timing is reported
                probe_s = float(tdmesh.fetch_shard(raw(x, pg, 3)).result()) / 3
                iters = max(3 if args.quick else 20, min(20000, int(seconds / max(probe_s, 1e-7))))
                raw_s = float(tdmesh.fetch_shard(raw(x, pg, iters)).result())
                _timed_reduces(tdmesh, y, min(iters, 50))  # warm-up: groups, caches, allocator
                e2e_s = _timed_reduces(tdmesh, y, iters)
                double_s = _timed_reduces(tdmesh, y, 2 * iters)
                # noise can swamp the difference of two short runs: then there is no steady figure
                steady_s = double_s - e2e_s if double_s > e2e_s else float("nan")
                factor = 2 * (n - 1) / n
                bw = [factor * size / (t / iters) / 1e9 for t in (raw_s, e2e_s, steady_s)]
                rows.append((size, iters, raw_s / iters * 1e6, e2e_s / iters * 1e6, steady_s / iters * 1e6, *bw))
                del x, y
    print(f"\nreduce (all ranks, sum) vs raw dist.all_reduce; {n} {args.device} workers; "
          f"torch {torch.__version__}")
    print(f"{'size':>9} {'iters':>6} {'raw us/op':>10} {'e2e us/op':>10} {'steady us/op':>13} "
          f"{'raw GB/s':>9} {'e2e GB/s':>9} {'steady GB/s':>12} {'e2e/raw':>8} {'steady/raw':>11}")
    for size, iters, raw_us, e2e_us, steady_us, raw_bw, e2e_bw, steady_bw in rows:
        print(f"{_fmt_bytes(size):>9} {iters:>6} {raw_us:>10.1f} {e2e_us:>10.1f} {steady_us:>13.1f} "
              f"{raw_bw:>9.2f} {e2e_bw:>9.2f} {steady_bw:>12.2f} {e2e_bw / raw_bw:>8.2f} {steady_bw / raw_bw:>11.2f}")


if __name__ == "__main__":
    main()

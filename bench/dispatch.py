"""tdmesh's port of Monarch's ``python/tests/dispatch_bench.py`` (see MONARCH_NOTES.md §6.1).

Run from the repository root:

    python -m bench.dispatch                 # N=10,000 adds of 100x100 fp32, 1 and 2 workers
    python -m bench.dispatch --quick         # CI smoke: small N, fewer fetches
    python -m bench.dispatch --workers 4 --iters 20000
    python -m bench.dispatch --device cuda   # on a CUDA host: tensors on the GPUs

Sections (each timed section: one warm-up, then ``--repeats`` timed runs; best and median):
  (1) local       the loop ``local = ones + local`` in this process, before any mesh exists
  (2) dispatched  the same loop under ``mesh.activate()`` with one worker, then one fetch
  (3) remote fn   one remote function runs the whole loop on the worker, then a fetch
  (4) coalescing  the loop of (2) inside ``with tdmesh.coalescing():``
  (5) compiled    the loop as a ``@tdmesh.compile`` function called repeatedly, run by each
                  worker as a generated program (``cuda_graph=False``): (5a) one add per call,
                  N calls; (5b) 100 adds per call, N/100 calls; on CUDA, (5c) and (5d): the
                  same as CUDA graphs (``cuda_graph=True``: inputs copied in, result copied out)
  (6) fetch RTT   ``fetch_shard(t).result()`` of a 10-element tensor vs. a raw
                  pickle-over-TCP echo with tdmesh's framing, to a second process
  (7) N workers   (2) on a mesh of N workers (every op goes to all N ranks)
  --tls           instead: (2), (6) and (7) with plain sockets, then with every control-plane
                  connection in TLS (TDMESH_TLS_CERT etc., a CA made by tdmesh.certs), same process
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time

if __package__ in (None, ""):  # run as ``python bench/dispatch.py``
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import helpers as h  # noqa: E402

SHAPE = (100, 100)


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench.dispatch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=None, help="loop length N (default 10000; 500 with --quick)")
    p.add_argument("--workers", type=int, default=2, help="workers for section (7) (default 2; 0 or 1 skips it)")
    p.add_argument("--fetches", type=int, default=None,
                   help="fetch round trips for (6) (default 500; 100 with --quick)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per section (default 3)")
    p.add_argument("--quick", action="store_true", help="small N for a CI smoke run")
    p.add_argument("--tls", action="store_true", help="only the cost of TLS: (2), (6), (7) plain, then in TLS")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (default; forces CPU workers even where CUDA exists) or cuda")
    args = h.parse(p, argv, quick=True, repeats=1, fetches=20)
    if args.iters is None:
        args.iters = 500 if args.quick else 10_000
    if args.fetches is None:
        args.fetches = 100 if args.quick else 500
    return args


def _timed_loop(fn, n: int, repeats: int, warmup_n: int) -> list[float]:
    """Warm up with ``fn(warmup_n)``, then time ``fn(n)`` ``repeats`` times."""
    fn(warmup_n)
    return h.repeat(lambda: fn(n), repeats)


def bench_local(n: int, repeats: int, device: str) -> list[float]:
    import torch
    if device == "cuda":
        torch.set_default_device("cuda")
    try:
        def run(k):
            h.run_loop_local(k, SHAPE)
            h.synchronize(device)
        return _timed_loop(run, n, repeats, min(n, 1000))
    finally:
        if device == "cuda":
            torch.set_default_device(None)


def bench_dispatched(mesh, n: int, repeats: int) -> tuple[list[float], list[float]]:
    """Total times (loop + fetch) and, for the same runs, the time the loop took to issue."""
    import tdmesh
    issue: list[float] = []

    def run(k):
        with mesh.activate():
            t0 = time.perf_counter()
            local = h.run_loop_local(k, SHAPE)  # the same Python loop; every add is a remote op
            issue.append(time.perf_counter() - t0)
            value = tdmesh.fetch_shard(local).result()
        assert value.shape == SHAPE  # the fetch is on CPU; read it outside the mesh
        return value

    times = _timed_loop(run, n, repeats, min(n, 1000))
    issue_times = issue[1:repeats + 1]  # the timed runs only, not the warm-up
    # check the answer once, outside the timers: a loop of k adds of ones gives k everywhere
    value = run(3)
    assert float(value.min()) == float(value.max()) == 3.0, value
    return times, issue_times


def bench_coalesced(mesh, n: int, repeats: int) -> list[float]:
    """(4) the loop of (2) inside ``tdmesh.coalescing()``: one batch per rank at the end."""
    import tdmesh

    def run(k):
        with mesh.activate():
            with tdmesh.coalescing():
                local = h.run_loop_local(k, SHAPE)
            return tdmesh.fetch_shard(local).result()

    times = _timed_loop(run, n, repeats, min(n, 1000))
    value = run(4)
    assert float(value.min()) == float(value.max()) == 4.0, value
    return times


def bench_compiled(mesh, n: int, repeats: int, body: int, cuda_graph: bool = False) -> list[float]:
    """(5) a compiled function doing ``body`` adds, called n/body times: one message per call."""
    import torch

    import tdmesh

    @tdmesh.compile(cuda_graph=cuda_graph)
    def step(local, ones):
        for _ in range(body):
            local = ones + local
        return local

    def run(k):
        with mesh.activate():
            local = torch.zeros(SHAPE)
            ones = torch.ones(SHAPE)
            for _ in range(k // body):
                local = step(local, ones)
            return tdmesh.fetch_shard(local).result()

    times = _timed_loop(run, n, repeats, min(n, 1000))
    value = run(3 * body)
    assert float(value.min()) == float(value.max()) == 3.0 * body, value
    return times


def bench_remote_function(mesh, n: int, repeats: int) -> list[float]:
    import torch

    import tdmesh
    device = mesh.client.device.type
    run_loop = tdmesh.remote("bench.helpers.run_loop_local",
                             propagate=lambda n, shape, device=None: torch.ones(shape))

    def run(k):
        with mesh.activate():
            local = run_loop(k, SHAPE, device)
            return tdmesh.fetch_shard(local).result()

    times = _timed_loop(run, n, repeats, min(n, 1000))
    value = run(5)
    assert float(value.min()) == float(value.max()) == 5.0, value
    return times


def bench_fetch_rtt(mesh, fetches: int):
    import torch

    import tdmesh
    warm = max(20, fetches // 10)
    with mesh.activate():
        t = torch.arange(10, dtype=torch.float32)
        for _ in range(warm):
            tdmesh.fetch_shard(t).result()
        fetch_times = []
        for _ in range(fetches):
            t0 = time.perf_counter()
            tdmesh.fetch_shard(t).result()
            fetch_times.append(time.perf_counter() - t0)
    # The floor: the same small tensor pickled, framed, echoed by a second process.
    proc, sock = h.start_echo_server()
    try:
        local = torch.arange(10, dtype=torch.float32)
        for _ in range(warm):
            h.raw_round_trip(sock, local)
        raw_times = []
        for _ in range(fetches):
            t0 = time.perf_counter()
            back = h.raw_round_trip(sock, local)
            raw_times.append(time.perf_counter() - t0)
        assert torch.equal(back, local)
        # The socket floor: an opaque bytes object of the pickled tensor's size, no tensor pickling.
        blob = b"x" * len(pickle.dumps(local, protocol=pickle.HIGHEST_PROTOCOL))
        for _ in range(warm):
            h.raw_round_trip(sock, blob)
        bytes_times = []
        for _ in range(fetches):
            t0 = time.perf_counter()
            h.raw_round_trip(sock, blob)
            bytes_times.append(time.perf_counter() - t0)
    finally:
        sock.close()
        proc.wait(timeout=30)
    return fetch_times, raw_times, bytes_times, len(blob)


def bench_tls(n: int, reps: int, fetches: int, workers: int) -> None:
    """(2), (6) and (7) with plain sockets, then with every connection in TLS: the price of encryption."""
    import tempfile

    import tdmesh
    from tdmesh.certs import make_certificates
    best: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as certs:
        tls_env = make_certificates(certs)
        for mode, env in (("plain", {}), ("TLS", tls_env)) * 2:  # alternated: drift hits both alike
            os.environ.update(env)
            try:
                with tdmesh.local_mesh(hosts=1, gpus_per_host=1, pool=False) as mesh:
                    version = getattr(next(iter(mesh.client.conns.values())).sock, "version", lambda: "-")()
                    times, _ = bench_dispatched(mesh, n, reps)
                    fetch_times = bench_fetch_rtt(mesh, fetches)[0]
                with tdmesh.local_mesh(hosts=1, gpus_per_host=workers, pool=False) as mesh:
                    many, _ = bench_dispatched(mesh, n, reps)
            finally:
                for name in env:
                    os.environ.pop(name)
            row = [n / min(times), statistics.median(fetch_times), n / min(many), version]
            old = best.get(mode)
            best[mode] = row if old is None else [max(row[0], old[0]), min(row[1], old[1]), max(row[2], old[2]),
                                                   version]
    rows = best
    plain, tls = rows["plain"], rows["TLS"]
    print(f"\n(8) the cost of TLS ({tls[3]}, certificates checked both ways), plain and TLS alternated twice, best "
          f"of {2 * reps} each; fetch: the lower of two medians of {fetches}:")
    h.print_table(["measure", "plain", "TLS", "TLS / plain"], [
        ["(2) dispatched, 1 worker, ops/s", f"{plain[0]:,.0f}", f"{tls[0]:,.0f}", f"{tls[0] / plain[0]:.3f}x"],
        ["(6) fetch round trip", h.fmt_us(plain[1]), h.fmt_us(tls[1]), f"{tls[1] / plain[1]:.2f}x"],
        [f"(7) dispatched, {workers} workers (a relay), ops/s", f"{plain[2]:,.0f}", f"{tls[2]:,.0f}",
         f"{tls[2] / plain[2]:.3f}x"]])


def main(argv=None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    h.ensure_importable_by_workers()
    import torch
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("--device cuda: CUDA is not available here", file=sys.stderr)
            return 2
        os.environ.pop("TDMESH_DEVICE", None)
    else:
        os.environ["TDMESH_DEVICE"] = "cpu"  # CPU workers even on a CUDA host
    import tdmesh

    n, reps = args.iters, args.repeats
    print(f"tdmesh dispatch bench: N={n:,} adds of {SHAPE[0]}x{SHAPE[1]} fp32 on {args.device}, "
          f"{reps} timed runs per section after a warm-up; torch {torch.__version__}; {h.machine_line()}",
          flush=True)

    if args.tls:
        bench_tls(n, reps, args.fetches, max(2, args.workers))
        return 0
    results: dict[str, list[float]] = {}
    # (1) before any mesh exists
    results["local"] = bench_local(n, reps, args.device)

    with tdmesh.local_mesh(hosts=1, gpus_per_host=1) as mesh:
        results["dispatched"], issue_1w = bench_dispatched(mesh, n, reps)
        results["remote"] = bench_remote_function(mesh, n, reps)
        results["coalesced"] = bench_coalesced(mesh, n, reps)
        results["compiled1"] = bench_compiled(mesh, n, reps, 1)
        results["compiled100"] = bench_compiled(mesh, n, reps, 100)
        if args.device == "cuda":
            results["graph1"] = bench_compiled(mesh, n, reps, 1, cuda_graph=True)
            results["graph100"] = bench_compiled(mesh, n, reps, 100, cuda_graph=True)
        fetch_times, raw_times, bytes_times, blob_len = bench_fetch_rtt(mesh, args.fetches)

    workers = args.workers
    if workers > 1 and args.device == "cuda" and workers > torch.cuda.device_count():
        print(f"(7) skipped: --workers {workers} needs {workers} GPUs, this host has {torch.cuda.device_count()}",
              flush=True)
        workers = 0
    if workers > 1:
        with tdmesh.local_mesh(hosts=1, gpus_per_host=workers) as mesh:
            results["workers"], _ = bench_dispatched(mesh, n, reps)

    # ------------------------------------------------------------------ report
    base_best, base_med = h.best_median(results["local"])
    labels = {
        "local": "(1) local loop, this process",
        "dispatched": "(2) dispatched, 1 worker, + fetch",
        "remote": "(3) one remote fn (whole loop), + fetch",
        "coalesced": "(4) (2) inside coalescing(), + fetch",
        "compiled1": "(5a) compiled fn of 1 add, N calls",
        "compiled100": "(5b) compiled fn of 100 adds, N/100 calls",
        "graph1": "(5c) (5a) as a CUDA graph",
        "graph100": "(5d) (5b) as a CUDA graph",
        "workers": f"(7) dispatched, {workers} workers, + fetch",
    }
    rows = []
    ops = {}
    for key, label in labels.items():
        if key not in results:
            continue
        best, med = h.best_median(results[key])
        ops[key] = (n / best, n / med)
        rows.append([label, f"{best * 1e3:,.1f}", f"{med * 1e3:,.1f}", h.fmt_rate(n / best), h.fmt_rate(n / med),
                     f"{base_best / best:.3f}x", f"{base_med / med:.3f}x"])
    print()
    h.print_table(["section", "best ms", "median ms", "ops/s best", "ops/s median", "vs (1) best", "vs (1) median"],
                  rows)

    f_med, f_p99 = statistics.median(fetch_times), h.percentile(fetch_times, 99)
    r_med, r_p99 = statistics.median(raw_times), h.percentile(raw_times, 99)
    print()
    print(f"(6) small-tensor fetch round trip (10 fp32 elements, {args.fetches} round trips after a warm-up):")
    h.print_table(["", "median", "p99", "min"], [
        ["tdmesh fetch_shard(t).result()", h.fmt_us(f_med), h.fmt_us(f_p99), h.fmt_us(min(fetch_times))],
        ["raw pickle+framed TCP echo", h.fmt_us(r_med), h.fmt_us(r_p99), h.fmt_us(min(raw_times))],
        ["ratio fetch / raw", f"{f_med / r_med:.2f}x", f"{f_p99 / r_p99:.2f}x",
         f"{min(fetch_times) / min(raw_times):.2f}x"],
        [f"raw framed TCP echo, {blob_len} B bytes", h.fmt_us(statistics.median(bytes_times)),
         h.fmt_us(h.percentile(bytes_times, 99)), h.fmt_us(min(bytes_times))],
    ])
    print("  (the raw tensor echo pickles and unpickles the tensor in both processes, i.e. twice each per round\n"
          "   trip; a fetch pickles it once on the worker and unpickles it once here, plus tdmesh's SendValue/\n"
          "   RequestStatus out and FetchResult/Status back.  The last row is the socket floor: a bytes object\n"
          "   of the same pickled size, no tensor (un)pickling.)")

    d_best = min(results["dispatched"])
    per_op_us = (d_best - base_best) / n * 1e6
    print()
    print(f"summary (N={n:,}, {SHAPE[0]}x{SHAPE[1]} fp32, device={args.device}, best of {reps}; "
          f"{os.cpu_count()} CPUs):")
    print(f"  local                    = {ops['local'][0]:,.0f} ops/s")
    print(f"  dispatched               = {ops['dispatched'][0]:,.0f} ops/s")
    print(f"  dispatched/local         = {base_best / d_best:.3f}x")
    print(f"  dispatch overhead        = {per_op_us:.1f} us/op  ((2)-(1))/N")
    print(f"  client issue time        = {min(issue_1w) / n * 1e6:.1f} us/op  (the loop of (2) alone, before the "
          f"fetch; the rest of (2) is the worker catching up)")
    print(f"  remote_function/local    = {base_best / min(results['remote']):.3f}x")
    print(f"  coalescing/local         = {base_best / min(results['coalesced']):.3f}x")
    print(f"  compiled(1 op)/local     = {base_best / min(results['compiled1']):.3f}x  "
          f"({n / min(results['compiled1']):,.0f} calls/s)")
    print(f"  compiled(100 ops)/local  = {base_best / min(results['compiled100']):.3f}x")
    if "graph1" in results:
        print(f"  graph(1 op)/local        = {base_best / min(results['graph1']):.3f}x  "
              f"({n / min(results['graph1']):,.0f} calls/s; plain dispatch {n / d_best:,.0f} ops/s)")
        print(f"  graph(100 ops)/local     = {base_best / min(results['graph100']):.3f}x")
    print(f"  fetch_rtt/raw_rtt        = {f_med / r_med:.2f}x  (median {h.fmt_us(f_med)} vs {h.fmt_us(r_med)}; "
          f"p99 {h.fmt_us(f_p99)} vs {h.fmt_us(r_p99)})")
    print(f"  fetch_rtt/bytes_rtt      = {f_med / statistics.median(bytes_times):.2f}x  (socket floor, median "
          f"{h.fmt_us(statistics.median(bytes_times))})")
    if "workers" in results:
        print(f"  dispatched_{workers}w            = {ops['workers'][0]:,.0f} ops/s "
              f"({ops['workers'][0] * workers:,.0f} rank-ops/s)")
        print(f"  workers_{workers}/workers_1      = {ops['workers'][0] / ops['dispatched'][0]:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

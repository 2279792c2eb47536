"""How the client's costs grow with the fleet: real CPU workers, and a simulated fleet of thousands.

Run from the repository root:

    python -m bench.scale                       # real layouts up to this host's cores, and the simulation
    python -m bench.scale --real 1x1,4x15       # hosts x ranks per host, real CPU workers
    python -m bench.scale --sim 1x1,32x32,256x32 --plot bench/scale.png
    python -m bench.scale --quick               # CI smoke: tiny layouts, few ops

(a) ``--real``: ``local_mesh(hosts=H, gpus_per_host=G)`` of CPU workers (the relays run, one per
    host, on a thread of its first worker), N adds of 100x100 then a fetch: dispatch ops/s and
    its ratio to the 1-worker row of the same run, the client's issue time per op, frames the
    client sent per op, the median fetch latency (from one rank, fleet idle) and exit time.
    ``--direct`` adds the same layouts with relays off (every rank connected to the client);
    ``--hogs N`` adds 1 worker beside N busy processes: the host's shared cores without tdmesh.
(b) ``--sim``: H processes of ``bench/sim_host.py`` (no torch), each the real relay of one host
    and a sink answering for its G ranks; the client is this process's real client.  Issue
    time per op (wall and the client thread's CPU), frames and bytes per op, fetch latency;
    ratios against the first layout (1x1: one sink connected directly, like a 1-rank fleet).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import helpers as h  # noqa: E402

SHAPE = (100, 100)
SIM_HOST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sim_host.py")


def _layouts(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in part.split("x")) for part in text.split(",") if part]  # type: ignore[misc]


def _fetch_latency(tdmesh, x, coords: dict, n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        tdmesh.fetch_shard(x, **coords).result()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure(tdmesh, torch, mesh, ops: int, fetches: int) -> dict:
    """N adds then a fetch on ``mesh``: issue time, end-to-end rate, frames and bytes per op, fetch latency."""
    client = mesh.client
    last = {d: mesh.sizes[d] - 1 for d in mesh.names}
    with mesh.activate():
        x = torch.zeros(SHAPE)
        small = torch.zeros(4)
        for _ in range(200):  # warm-up: op plans made, workers' code generated
            x = x + 1
        tdmesh.fetch_shard(x, **last).result()
        frames, sent = client.outbox.frames, _bytes_sent(client)
        cpu = time.thread_time()
        start = time.perf_counter()
        for _ in range(ops):
            x = x + 1
        issued = time.perf_counter()
        cpu = time.thread_time() - cpu
        client.flush()
        frames, sent = client.outbox.frames - frames, _bytes_sent(client) - sent
        tdmesh.fetch_shard(x, **last).result()
        done = time.perf_counter()
        latency = _fetch_latency(tdmesh, small, last, fetches)
    return {"issue_us": (issued - start) / ops * 1e6, "issue_cpu_us": cpu / ops * 1e6,
            "rate": ops / (done - start), "frames": frames / ops, "bytes": sent / ops, "fetch_ms": latency * 1e3}


def _bytes_sent(client) -> int:
    return client.outbox.bytes_sent


def _start_hogs(n: int) -> list[subprocess.Popen]:
    """``n`` processes that keep one core each busy: the control run that tells the host's
    shared cores apart from tdmesh's own per-op cost."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def run_real(layouts, ops: int, fetches: int, direct: bool, hogs: int = 0) -> list[dict]:
    import torch

    import tdmesh
    rows = []
    modes = [("relays", "auto")] + ([("direct", "0")] if direct else [])
    runs = [(hosts, gpus, label, value) for hosts, gpus in layouts for label, value in modes
            if label != "direct" or hosts * gpus > 1]
    if hogs:
        runs.append((1, 1, f"1 worker + {hogs} busy", "auto"))
    for hosts, gpus, label, value in runs:
        busy = _start_hogs(hogs) if label.endswith("busy") else []
        try:
            os.environ["TDMESH_RELAYS"] = value  # read by the workers local_mesh starts
            start = time.perf_counter()
            with tdmesh.local_mesh(hosts=hosts, gpus_per_host=gpus, pool=False) as mesh:
                started = time.perf_counter() - start
                row = _measure(tdmesh, torch, mesh, ops, fetches)
                exit_start = time.perf_counter()
        finally:
            for p in busy:
                p.kill()
                p.wait()
        mode = label if hosts * gpus > 1 or busy else "direct"
        row.update(layout=f"{hosts}x{gpus}", ranks=hosts * gpus, mode=mode, start_s=started,
                   exit_s=time.perf_counter() - exit_start)
        rows.append(row)
        print("row", json.dumps(row), flush=True)
    os.environ.pop("TDMESH_RELAYS", None)
    return rows


def _spawn_sim(hosts: int, per_host: int, fanout: int):
    """The simulated hosts; returns them and the function that wires them into a relay tree
    under the client once its gate listens (``accept_workers``'s ``announce``)."""
    from tdmesh.geometry.fanout import relay_parents, subtree_hosts
    direct = hosts * per_host == 1
    procs, ports = [], []
    for host in range(hosts):
        end = subtree_hosts(host, hosts, fanout).stop * per_host
        args = [sys.executable, SIM_HOST, str(host), str(host * per_host), str((host + 1) * per_host), str(end)]
        procs.append(subprocess.Popen(args + (["--direct"] if direct else []), stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True))
    for p in procs:
        ports.append(int(p.stdout.readline()))
    parents = relay_parents(hosts, fanout)

    def wire(client_host: str, client_port: int):
        """``accept_workers``'s ``announce``: the token first (the gate must know it before any
        host can connect), then the call that tells the hosts where their parent listens."""
        token = secrets.token_hex(16)

        def publish() -> None:
            for host, p in enumerate(procs):
                up = (client_host, client_port) if parents[host] < 0 else ("127.0.0.1", ports[parents[host]])
                p.stdin.write(f"{up[0]} {up[1]} {token}\n")
                p.stdin.flush()
        return token, publish
    return procs, wire


def run_sim(layouts, ops: int, fetches: int, fanout: int) -> list[dict]:
    import torch

    import tdmesh
    from tdmesh.engine.client import Client
    from tdmesh.fleet.job import Fleet, accept_workers
    from tdmesh.geometry.shape import Shape
    from tdmesh.geometry.slice import Slice
    from tdmesh.mesh import DeviceMesh
    rows = []
    for hosts, per_host in layouts:
        world = hosts * per_host
        start = time.perf_counter()
        procs, wire = _spawn_sim(hosts, per_host, fanout)
        try:
            conns, hellos, gate, relays = accept_workers(None, world, host="127.0.0.1", bind="127.0.0.1",
                                                         announce=wire, timeout=300)
            fleet = Fleet(Client(conns, hellos, relays=relays), gate=gate)
            started = time.perf_counter() - start
            mesh = DeviceMesh(Shape(("host", "gpu"), Slice.new_row_major([hosts, per_host])), fleet.client,
                              fleet=fleet)
            row = _measure(tdmesh, torch, mesh, ops, fetches)
            exit_start = time.perf_counter()
            fleet.exit()
            row.update(layout=f"{hosts}x{per_host}", ranks=world, mode="direct" if world == 1 else "relays",
                       start_s=started, exit_s=time.perf_counter() - exit_start, children=len(conns))
            rows.append(row)
            print("row", json.dumps(row), flush=True)
        finally:
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
    return rows


def print_rows(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    base = rows[0] if rows else None
    table = []
    for r in rows:
        table.append([r["layout"], str(r["ranks"]), r["mode"], f"{r['rate']:,.0f}", f"{r['rate'] / base['rate']:.2f}",
                      f"{r['issue_us']:.1f}", f"{r['issue_us'] / base['issue_us']:.2f}", f"{r['issue_cpu_us']:.1f}",
                      f"{r['frames']:.3f}", f"{r['fetch_ms']:.3f}", f"{r['fetch_ms'] / base['fetch_ms']:.2f}",
                      f"{r['start_s']:.2f}", f"{r['exit_s']:.2f}"])
    h.print_table(["layout", "ranks", "mode", "ops/s", "vs first", "issue us/op", "vs first", "issue cpu us/op",
                   "frames/op", "fetch ms", "vs first", "start s", "exit s"], table)


def plot(real: list[dict], sim: list[dict], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(no plot: matplotlib is not installed; pip install matplotlib for {path})")
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for rows, label, marker in ((real, "real CPU workers", "o"), (sim, "simulated fleet", "s")):
        rows = [r for r in rows if r["mode"] == "relays" or (r["mode"] == "direct" and r["ranks"] == 1)]
        if not rows:
            continue
        xs = [r["ranks"] for r in rows]
        line, = axes[0].plot(xs, [r["issue_us"] for r in rows], marker=marker, label=f"{label}, wall")
        axes[0].plot(xs, [r["issue_cpu_us"] for r in rows], marker=marker, linestyle="--", color=line.get_color(),
                     label=f"{label}, client CPU")
        axes[1].plot(xs, [r["fetch_ms"] for r in rows], marker=marker, label=label)
    for ax, title in zip(axes, ("client issue time per op (us)", "fetch latency from one rank (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks")
        ax.set_title(title)
        ax.set_yscale("log")  # the simulated hosts share this machine's cores: wall time grows by 50x, CPU by 1.5x
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cores = os.cpu_count() or 2
    default_real = "1x1,1x2,2x1" if cores <= 4 else f"1x1,1x8,4x{max(1, (cores - 4) // 4)}"
    parser.add_argument("--real", default=default_real, help="hosts x ranks layouts of real CPU workers")
    parser.add_argument("--sim", default="1x1,8x8,32x32,256x32", help="hosts x ranks layouts of the simulation")
    parser.add_argument("--ops", type=int, default=5000)
    parser.add_argument("--fetches", type=int, default=20)
    parser.add_argument("--fanout", type=int, default=32)
    parser.add_argument("--direct", action="store_true", help="also run the real layouts with relays off")
    parser.add_argument("--hogs", type=int, default=0,
                        help="also run 1 worker beside this many busy processes (a control for shared cores)")
    parser.add_argument("--plot", default="", help="write a PNG plot here")
    parser.add_argument("--quick", action="store_true", help="CI smoke: tiny layouts")
    parser.add_argument("--save", default="", help="also write the rows as JSON here")
    parser.add_argument("--load", default="", help="print (and --plot) rows a --save wrote; run nothing")
    args = h.parse(parser, argv, quick=True)
    if args.load:
        with open(args.load) as f:
            saved = json.load(f)
        print(saved["machine"])
        for title, key in (("(a) real CPU workers", "real"), ("(b) simulated fleet", "sim")):
            if saved[key]:
                print_rows(title + " (ratios against the first row)", saved[key])
        if args.plot:
            plot(saved["real"], saved["sim"], args.plot)
        return
    if args.quick:
        args.real, args.sim, args.ops, args.fetches = "1x1,2x1", "1x1,2x2,3x2", 300, 3
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["TDMESH_FANOUT"] = str(args.fanout)
    h.ensure_importable_by_workers()
    print(h.machine_line())
    print(f"{args.ops} adds of {SHAPE[0]}x{SHAPE[1]} fp32 then a fetch; fan-out {args.fanout}")
    real = run_real(_layouts(args.real), args.ops, args.fetches, args.direct, args.hogs) if args.real else []
    if real:
        print_rows("(a) real CPU workers (ratios against the first row)", real)
    sim = run_sim(_layouts(args.sim), args.ops, args.fetches, args.fanout) if args.sim else []
    if sim:
        print_rows("(b) simulated fleet: sinks behind real relays (ratios against the first row)", sim)
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"machine": h.machine_line(), "real": real, "sim": sim}, f, indent=1)
    if args.plot:
        plot(real, sim, args.plot)


if __name__ == "__main__":
    main()

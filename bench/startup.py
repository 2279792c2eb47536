"""Startup: cold (a fresh interpreter to the first fetched value) and warm (from the pool).

Run from the repository root:

    python -m bench.startup                     # 3 cold runs of 1 worker, warm runs, phases
    python -m bench.startup --gpus 2 --runs 5
    python -m bench.startup --monarch /path/to/venv/bin/python   # Monarch 0.7.0 side by side

Each cold run is a new ``python`` process that imports torch and tdmesh, enters
``local_mesh(hosts=1, gpus_per_host=G)``, runs ``torch.ones(3) + 1`` and fetches it, then
exits the mesh.  Phases: import, start (entering ``local_mesh``: workers spawned, booted and
connected), first fetch (the op and its round trip), the first collective (a reduce over the
workers and its fetch: a warm GPU worker makes its NCCL communicator there), exit (of a pooled
mesh: parking its workers); "to fetch" is start + first fetch (from the ``local_mesh`` call) and
"total" is import + that.  The same process then opens the
same mesh again: the warm rows time a mesh taken from the warm pool.  ``--monarch`` runs the
same steps with Monarch's tensor engine (``this_host().spawn_procs`` + ``spawn_tensor_engine``)
in the given interpreter, in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import helpers as h  # noqa: E402

TDMESH = """
import json, sys, time
t0 = time.perf_counter()
import torch, tdmesh
t1 = time.perf_counter()
rows = []
for warm in range({warm} + 1):
    a = time.perf_counter()
    with tdmesh.local_mesh(hosts=1, gpus_per_host={gpus}) as mesh:
        b = time.perf_counter()
        with mesh.activate():
            value = tdmesh.fetch_shard(torch.ones(3) + 1).result()
            c = time.perf_counter()
            total = tdmesh.fetch_shard(torch.ones(3).reduce("gpu")).result()  # the first collective
            e = time.perf_counter()
    d = time.perf_counter()
    assert value.tolist() == [2.0, 2.0, 2.0] and total.tolist() == [{gpus}.0] * 3
    rows.append(dict(import_s=t1 - t0 if not rows else 0.0, start_s=b - a, fetch_s=c - b, exit_s=d - e,
                     collective_s=e - c))
print("RESULT", json.dumps(rows))
"""

MONARCH = """
import json, time
t0 = time.perf_counter()
import torch
from monarch import fetch_shard
from monarch.actor import this_host
from monarch.mesh_controller import spawn_tensor_engine
t1 = time.perf_counter()
procs = this_host().spawn_procs(per_host={{"gpus": {gpus}}})
mesh = spawn_tensor_engine(procs)
t2 = time.perf_counter()
with mesh.activate():
    value = fetch_shard(torch.ones(3) + 1).result()
t3 = time.perf_counter()
mesh.exit()
procs.stop().get()
t4 = time.perf_counter()
assert value.tolist() == [2.0, 2.0, 2.0]
print("RESULT", json.dumps([dict(import_s=t1 - t0, start_s=t2 - t1, fetch_s=t3 - t2, exit_s=t4 - t3)]))
"""


def _run(python: str, code: str, env: dict) -> list[dict]:
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"{python} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def _row(name: str, runs: list[dict]) -> list[str]:
    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)
    to_fetch = statistics.median(r["start_s"] + r["fetch_s"] for r in runs)
    total = statistics.median(r["import_s"] + r["start_s"] + r["fetch_s"] for r in runs)
    collective = f"{med('collective_s'):.3f}" if all("collective_s" in r for r in runs) else "-"
    return [name, str(len(runs)), f"{med('import_s'):.3f}", f"{med('start_s'):.3f}", f"{med('fetch_s'):.3f}",
            f"{to_fetch:.3f}", f"{total:.3f}", collective, f"{med('exit_s'):.3f}"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=1, help="workers (gpus_per_host)")
    parser.add_argument("--runs", type=int, default=3, help="cold runs (fresh interpreters) of each system")
    parser.add_argument("--warm", type=int, default=3, help="warm meshes after each cold one")
    parser.add_argument("--monarch", default="", help="a Python with torchmonarch installed, for a side-by-side")
    args = h.parse(parser, argv, runs=1, warm=1)
    h.ensure_importable_by_workers()
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    print(h.machine_line())
    cold, warm, monarch = [], [], []
    for _ in range(args.runs):  # interleaved, so both systems see the same machine state
        rows = _run(sys.executable, TDMESH.format(gpus=args.gpus, warm=args.warm), env)
        cold.append(rows[0])
        warm.extend(rows[1:])
        if args.monarch:
            monarch.extend(_run(args.monarch, MONARCH.format(gpus=args.gpus), env))
    table = [_row("tdmesh cold", cold)]
    if warm:
        table.append(_row("tdmesh warm (pool)", warm))
    if monarch:
        table.append(_row("monarch cold", monarch))
    print(f"\n{args.gpus} worker(s); seconds, medians (to fetch = start + first fetch; total = import + to fetch)")
    h.print_table(["system", "runs", "import", "start", "first fetch", "to fetch", "total", "1st collective",
                   "exit"], table)
    if monarch:
        ours = statistics.median(r["import_s"] + r["start_s"] + r["fetch_s"] for r in cold)
        theirs = statistics.median(r["import_s"] + r["start_s"] + r["fetch_s"] for r in monarch)
        print(f"cold total, tdmesh / monarch: {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()

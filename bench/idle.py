"""What a fleet that does nothing costs: the CPU share of an idle client and of each idle worker.

    python -m bench.idle [--workers 2] [--seconds 20]

A user leaves a mesh open in a notebook for hours; its threads (the client's flusher, reader and
supervisor, each worker's message loop and heartbeat) should then cost next to nothing.  The
baseline is this same process before any mesh exists, over the same span (Python and torch
imported, no thread of tdmesh's).  Linux only (each worker's CPU is read from ``/proc``).
"""

from __future__ import annotations

import argparse
import os
import time

from bench import helpers as h


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU of process ``pid`` so far (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def share(pids: list[int], seconds: float) -> list[float]:
    """Each process's CPU over ``seconds``, in percent of one core."""
    before = [process_cpu_seconds(p) for p in pids]
    time.sleep(seconds)
    return [100 * (process_cpu_seconds(p) - b) / seconds for p, b in zip(pids, before)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seconds", type=float, default=20.0)
    args = h.parse(p, argv, seconds=0.5, workers=1)
    import torch

    import tdmesh
    me = os.getpid()
    [baseline] = share([me], args.seconds)
    with tdmesh.local_mesh(hosts=1, gpus_per_host=args.workers) as mesh:
        with mesh.activate():
            tdmesh.fetch_shard(torch.ones(3) + 1).result()  # the fleet has worked once, then idles
        workers = [hello.pid for hello in mesh.client.hellos.values()]
        client, *each = share([me, *workers], args.seconds)
    print(f"\nidle for {args.seconds:.0f} s, 1x{args.workers} {mesh.device_type} mesh, torch {torch.__version__}")
    print(f"  this process before the mesh : {baseline:6.2f}% of a core")
    print(f"  the client with the mesh open: {client:6.2f}% of a core  (+{client - baseline:.2f})")
    for rank, pct in enumerate(each):
        print(f"  worker {rank}                     : {pct:6.2f}% of a core")


if __name__ == "__main__":
    main()

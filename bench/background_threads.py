"""What the client's background threads cost the thread that issues: the add loop with each rule on and off.

    python -m bench.background_threads                 # 1 CPU worker
    python -m bench.background_threads --rounds 11 --ops 50000

The client has two threads besides the user's that wake while it issues: the reader, for every
answer to a progress probe, and the flusher, which sends what a thread leaves queued.  Each wake
takes the GIL from the issuing thread (on a 2-core VM ~100-200 us of its time).  The loop
``x = ones + x`` (100x100 float32) runs in one process under each variant, round by round (each
row its median round: the VM's speed drifts), timing wall clock and the issuing thread's CPU:

  as tdmesh runs        a probe every 100 ops once the last one is answered; the flusher sends
                        only after the issuing thread has queued nothing for the flush interval
  probes as before      a probe every 100 ops, answered or not (the rule before the twenty-seventh
                        session)
  flusher as before     the flusher sends whenever the last send is older than the interval, also
                        between two ops of a thread that is still issuing (the rule before)
  both as before
  no probes             as tdmesh runs, with no progress probes (the reader's wakes left out)
  flusher asleep        as tdmesh runs, with the flusher's sleeps 100x as long (its wakes left out)
  neither thread        no probes, and the flusher's sleeps 100x as long: the floor, what the loop
                        costs with neither thread waking (not a way to run: the workers' progress
                        goes unseen, a thread's last ops wait for a fetch)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import types

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import helpers as h  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.background_threads", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", type=int, default=30000, help="ops a round")
    p.add_argument("--rounds", type=int, default=7)
    args = h.parse(p, argv, ops=300, rounds=1)
    os.environ.setdefault("TDMESH_DEVICE", "cpu")
    h.ensure_importable_by_workers()
    import torch

    import tdmesh
    import tdmesh.engine.client as client_module
    import tdmesh.engine.flusher as flusher_module

    sleep_scale = [1.0]
    flusher_time = flusher_module.time
    flusher_module.time = types.SimpleNamespace(sleep=lambda s: time.sleep(s * sleep_scale[0]))  # type: ignore
    n = args.ops
    with contextlib.ExitStack() as undo:
        undo.callback(setattr, flusher_module, "time", flusher_time)  # bench's smoke tier: one process for all
        mesh = undo.enter_context(tdmesh.local_mesh(hosts=1, gpus_per_host=1, pool=False))
        undo.enter_context(mesh.activate())
        client = mesh.client
        supervisor = client.supervisor
        answered = supervisor.answered
        every = client._probe_every

        def old_probes(on: bool) -> None:
            supervisor.answered = (lambda seq: True) if on else answered

        def old_flusher(on: bool) -> None:
            if on:  # the flusher compares with the last send, as it did: the issuing thread's own sends only
                client_module.Client._last_queued = property(lambda self: self._last_flush,  # type: ignore
                                                             lambda self, value: None)
            elif isinstance(vars(client_module.Client).get("_last_queued"), property):
                del client_module.Client._last_queued  # type: ignore[attr-defined]

        def no_probes(on: bool) -> None:
            client._probe_every = 1 << 60 if on else every

        def flusher_asleep(on: bool) -> None:
            sleep_scale[0] = 100.0 if on else 1.0

        variants = {"as tdmesh runs": [], "probes as before": [old_probes], "flusher as before": [old_flusher],
                    "both as before": [old_probes, old_flusher], "no probes": [no_probes],
                    "flusher asleep": [flusher_asleep], "neither thread": [no_probes, flusher_asleep]}
        ones = torch.ones(100, 100)

        def loop() -> tuple[float, float]:
            x = torch.zeros(100, 100)
            wall, cpu = time.perf_counter(), time.thread_time()
            for _ in range(n):
                x = ones + x
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
            tdmesh.fetch_shard(x).result()
            return wall, cpu

        loop()
        times: dict[str, list] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, switches in variants.items():
                for switch in switches:
                    switch(True)
                try:
                    times[name].append(loop())
                finally:
                    for switch in switches:
                        switch(False)
    print(f"x = ones + x, {n} ops a round, median of {args.rounds} rounds; torch {torch.__version__}; "
          f"{h.machine_line()}")
    medians = {name: (sorted(w for w, _ in t)[len(t) // 2], sorted(c for _, c in t)[len(t) // 2])
               for name, t in times.items()}
    floor_wall, floor_cpu = medians["neither thread"]
    h.print_table(["variant", "wall us per op", "CPU us per op", "wall / neither thread"],
                  [[name, f"{w / n * 1e6:.2f}", f"{c / n * 1e6:.2f}", f"{w / floor_wall:.3f}x"]
                   for name, (w, c) in medians.items()])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``tdmesh.checkpoint``: save and load bandwidth per rank against plain file I/O of the same
bytes in the same run, sync and async, and what an async save costs the training it overlaps.

    python -m bench.checkpoint                    # 2 CPU workers, 256 MiB a rank, tiny GPT loop
    python -m bench.checkpoint --device cuda --workers 1 --mib 1024 --size small
    python -m bench.checkpoint --quick            # CI smoke

Bandwidth (each rank holds ``--mib`` MiB that differ between ranks, so each writes its own):
  plain write  every rank writes its tensors' bytes to one file and fsyncs it (DCP's
               FileSystemWriter writes one file a rank and fsyncs it): the floor on this disk
  save         ``tdmesh.checkpoint.save`` of the same tensors (SHA-256 of each tensor to find
               the replicated ones, DCP's plan, write, fsync, metadata)
  async save   ``async_save``: the call (each rank's copy of its tensors) and the whole save
  plain read   every rank reads its file back into its tensors
  load         ``tdmesh.checkpoint.load`` into the same tensors
GB/s are per rank (bytes of one rank / wall seconds of the call); ratios are tdmesh / plain
(1.0 = the plain file's speed).  The training rows run the data-parallel GPT step of
``bench.train_step`` without checkpoints, then with an ``async_save`` of model and optimizer
every ``--every`` steps (after one untimed save: a GPU worker's first allocates the pinned host
buffers later saves reuse), and print the mean step time of each and their ratio.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

from bench import helpers as h

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tutorials"))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bandwidth(mesh, mib: int, repeats: int, directory: str) -> list[tuple[str, float, float]]:
    """Rows (what, seconds, plain seconds): the best of ``repeats`` of each."""
    import torch

    import tdmesh
    import tdmesh.checkpoint as ckpt
    write = tdmesh.remote("bench.helpers.plain_write", propagate="inspect")
    read = tdmesh.remote("bench.helpers.plain_read", propagate="inspect")
    pieces = 8
    with mesh.activate():
        rank = mesh.process_idx()
        tensors = [torch.randn(mib * 2**20 // 4 // pieces) + rank for _ in range(pieces)]
        state = {f"t{i}": t for i, t in enumerate(tensors)}
        tdmesh.fetch_shard(tensors[-1][:1]).result()

        def sync():
            tdmesh.fetch_shard(tensors[0][:1]).result()

        def plain_w():
            write(tensors, os.path.join(directory, "plain"), rank)
            sync()

        def plain_r():
            read(tensors, os.path.join(directory, "plain"), rank)
            sync()

        calls: list[float] = []

        def async_save():
            start = time.perf_counter()
            done = ckpt.async_save(state, checkpoint_id=os.path.join(directory, "async"))
            sync()  # the copy has run on every rank: the stream moved past it
            calls.append(time.perf_counter() - start)
            done.result()

        rows = {}
        for name, fn in [("plain write", plain_w), ("save", lambda: ckpt.save(state, checkpoint_id=os.path.join(
                directory, "dcp"))), ("async save", async_save), ("plain read", plain_r),
                ("load", lambda: ckpt.load(state, checkpoint_id=os.path.join(directory, "dcp")))]:
            fn()  # warm: files exist, pages are allocated
            rows[name] = min(_timed(fn) for _ in range(repeats))
        rows["async call"] = min(calls[1:]) if len(calls) > 1 else calls[0]
    return [("save", rows["save"], rows["plain write"]), ("async save", rows["async save"], rows["plain write"]),
            ("async call", rows["async call"], rows["plain write"]), ("load", rows["load"], rows["plain read"])]


def training(mesh, size: str, steps: int, every: int, directory: str) -> tuple[float, float, int, float, list]:
    """(mean step seconds without checkpoints, mean of the steps that overlapped an async save's
    writing, how many did, mean step seconds of the loop with a save every ``every`` steps, the
    seconds each save waited for the one before it to end)."""
    import torch

    import tdmesh
    import tdmesh.checkpoint as ckpt
    from bench.helpers import data_parallel_step, train_optimizer

    from nanogpt import GPT, get_batch, sized
    cfg, tokens = sized(size)

    def seeded_batch(data, batch_size, block_size, rank, step):
        g = torch.Generator(device=data.device)
        g.manual_seed(1000 * int(rank) + step)
        return get_batch(data, batch_size, block_size, g)
    batch = tdmesh.remote(seeded_batch, propagate=lambda d, b, t, r, s: (
        torch.empty(b, t, dtype=torch.int64), torch.empty(b, t, dtype=torch.int64)))
    with mesh.activate():
        tdmesh.random.set_manual_seed_remote(0)
        model = GPT(cfg)
        opt = train_optimizer(model.parameters(), mesh.device_type == "cuda")
        step = tdmesh.compile(data_parallel_step(model, opt, mesh))
        data = torch.tensor(tokens)
        rank = mesh.rank(mesh.names)
        batches = [batch(data, 8, cfg.block_size, rank, i) for i in range(steps + 3)]
        for x, y in batches[:3]:  # trace, settle, record
            loss = step(x, y)
        tdmesh.fetch_shard(loss).result()

        waits: list[float] = []  # seconds a save waited for the one before it (saves that back up)

        def run(save: bool) -> tuple[list[float], list[bool]]:
            """Each step's seconds (its loss fetched, as a loop that logs it) and whether an
            async save was being written meanwhile; one save every ``every`` steps."""
            times, overlapped, pending, saves = [], [], None, 0
            for i, (x, y) in enumerate(batches[3:]):
                start = time.perf_counter()
                loss = step(x, y)
                if save and i % every == every // 2:
                    if pending is not None:
                        waited = time.perf_counter()
                        pending.result()
                        waits.append(time.perf_counter() - waited)
                    pending = ckpt.async_save({"model": model.state_dict(), "optim": opt.state_dict()},
                                              checkpoint_id=os.path.join(directory, f"train-{saves % 2}"))
                    saves += 1
                tdmesh.fetch_shard(loss).result()
                times.append(time.perf_counter() - start)
                overlapped.append(pending is not None and not pending.done())
            if pending is not None:
                pending.result()
            return times, overlapped
        # one save first, untimed: a worker's first save imports torch.distributed.checkpoint
        # (2.6 s on the H200 host, on the writing thread, slowing the steps beside it), and a GPU
        # worker's allocates the pinned host buffers of its copies, which torch's cache hands on
        ckpt.async_save({"model": model.state_dict(), "optim": opt.state_dict()},
                        checkpoint_id=os.path.join(directory, "train-warm")).result()
        plain, _ = run(False)
        saving, during = run(True)
        plain_again, _ = run(False)  # the loop's own drift, bracketing the saving run
    base = statistics.mean(plain + plain_again)
    hit = [t for t, d in zip(saving, during) if d]
    return base, statistics.mean(hit) if hit else base, len(hit), statistics.mean(saving), waits



def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--mib", type=int, default=256, help="MiB per rank for the bandwidth rows")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--size", choices=("tiny", "small"), default="tiny")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--dir", default=None, help="where the files go (default: a temporary directory)")
    p.add_argument("--quick", action="store_true")
    args = h.parse(p, argv, quick=True)
    h.require_cuda("checkpoint", args.device)
    if args.quick:
        args.mib, args.repeats, args.steps, args.every = 16, 1, 6, 3
    if args.device == "cpu":
        os.environ["TDMESH_DEVICE"] = "cpu"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    import tdmesh
    directory = tempfile.mkdtemp(prefix="tdmesh-bench-ckpt-", dir=args.dir)
    try:
        with tdmesh.local_mesh(hosts=1, gpus_per_host=args.workers) as mesh:
            rows = bandwidth(mesh, args.mib, args.repeats, directory)
            if args.steps:  # --steps 0: the bandwidth rows only
                plain_s, overlap_s, overlapping, loop_s, waits = training(mesh, args.size, args.steps, args.every,
                                                                          directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    gb = args.mib * 2**20 / 1e9
    print(f"\ntdmesh.checkpoint, {args.workers} {args.device} workers, {args.mib} MiB a rank (8 tensors, different on "
          f"each rank), files in {args.dir or tempfile.gettempdir()}, torch {torch.__version__}")
    print(f"{'':12s} {'tdmesh':>14s} {'plain file':>14s} {'ratio':>7s}")
    for name, ours, plain in rows:
        print(f"{name:12s} {gb / ours:9.2f} GB/s {gb / plain:9.2f} GB/s {plain / ours:7.2f}x")
    if not args.steps:
        return
    print(f"\ntraining, {args.size} GPT compiled, {args.steps} steps, each step's loss fetched: "
          f"{plain_s * 1e3:.2f} ms a step without checkpoints; the {overlapping} steps that overlapped an "
          f"async save's writing: {overlap_s * 1e3:.2f} ms = {overlap_s / plain_s:.3f}x; the loop with a save "
          f"every {args.every} steps: {loop_s * 1e3:.2f} ms a step = {loop_s / plain_s:.3f}x; its saves waited "
          f"{sum(waits) * 1e3:.0f} ms in all for the one before to end"
          + (" (saves this close back up: space them further)" if sum(waits) > 0.01 else ""))


if __name__ == "__main__":
    main()

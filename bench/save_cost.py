"""What one checkpoint save of a training state costs a worker in CPU time, against plain DCP.

    python -m bench.save_cost                   # 2 CPU workers, tiny GPT's model and optimizer
    python -m bench.save_cost --size small --saves 8

An async save overlaps training only as far as the worker has CPU to spare: on a machine whose
cores the training keeps busy, every CPU-ms a save takes is a ms some step waits.  Each worker
reports its own CPU time (``getrusage``) around each ``tdmesh.checkpoint.save`` and
``async_save`` of ``{"model": model.state_dict(), "optim": opt.state_dict()}`` (replicated, as
in data-parallel training; then once more with every rank's values different, the state
saved per rank); the baseline is ``torch.distributed.checkpoint.save`` of the same
state in this process with no process group (``no_dist=True``: no plan exchange at all), and
``torch.save`` of it.  The first save of each kind is left out (it imports DCP: over a second).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

from bench import helpers as h

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tutorials"))


def cpu_seconds(_):
    """This process's CPU seconds (user + system), as a tensor: run on each worker."""
    import torch
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return torch.tensor(usage.ru_utime + usage.ru_stime, dtype=torch.float64)


def _trained(size: str, on_cuda: bool):
    import torch

    from bench.helpers import train_optimizer

    from nanogpt import GPT, sized
    cfg, _ = sized(size)
    model = GPT(cfg)
    opt = train_optimizer(model.parameters(), on_cuda)
    x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size))
    out = model(x, x)
    (out[1] if isinstance(out, tuple) else out).backward()
    opt.step()
    return model, opt


def local_baseline(size: str, saves: int, directory: str) -> tuple[float, float, int]:
    """(CPU-ms of one plain ``dcp.save``, of one ``torch.save``, tensors): medians in this process."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.utils._pytree import tree_leaves
    torch.manual_seed(0)
    model, opt = _trained(size, False)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}

    def cpu_ms(fn) -> float:
        before = resource.getrusage(resource.RUSAGE_SELF)
        fn()
        after = resource.getrusage(resource.RUSAGE_SELF)
        return 1e3 * (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... a single process": meant
        plain = [cpu_ms(lambda i=i: dcp.save(state, checkpoint_id=os.path.join(directory, f"dcp{i}"), no_dist=True))
                 for i in range(saves + 1)][1:]
    pickled = [cpu_ms(lambda i=i: torch.save(state, os.path.join(directory, f"p{i}.pt"))) for i in range(saves + 1)][1:]
    tensors = sum(isinstance(x, torch.Tensor) for x in tree_leaves(state))
    return statistics.median(plain), statistics.median(pickled), tensors


def fleet(workers: int, size: str, saves: int, directory: str) -> dict[str, list[float]]:
    """Per kind ("save", "async_save", "save per rank"): each worker's median CPU-ms a save, and the wall ms."""
    import torch

    import tdmesh
    import tdmesh.checkpoint as ckpt
    usage = tdmesh.remote(cpu_seconds, propagate=lambda _: torch.empty((), dtype=torch.float64))
    out: dict[str, list[float]] = {}
    with tdmesh.local_mesh(hosts=1, gpus_per_host=workers) as mesh, mesh.activate():
        tdmesh.random.set_manual_seed_remote(0)  # one model on every rank: replicated, as under DDP
        model, opt = _trained(size, mesh.device_type == "cuda")

        def now() -> list[float]:
            return [float(v) for _, v in tdmesh.fetch_all(usage(0)).result()]
        for kind in ("save", "async_save", "save per rank"):
            if kind == "save per rank":  # every rank's values differ: each tensor a DTensor chunk in DCP's plan
                with torch.no_grad():
                    for param in model.parameters():
                        param.add_(mesh.process_idx())
            per_worker: list[list[float]] = [[] for _ in range(workers)]
            walls = []
            for i in range(saves + 1):
                state = {"model": model.state_dict(), "optim": opt.state_dict()}
                before, start = now(), time.perf_counter()
                if kind != "async_save":
                    ckpt.save(state, checkpoint_id=os.path.join(directory, f"{kind[:4]}{len(kind)}-{i}"))
                else:
                    ckpt.async_save(state, checkpoint_id=os.path.join(directory, f"{kind}{i}")).result()
                wall = time.perf_counter() - start
                after = now()
                if i:  # the first imports DCP
                    walls.append(1e3 * wall)
                    for w in range(workers):
                        per_worker[w].append(1e3 * (after[w] - before[w]))
            out[kind] = [statistics.median(v) for v in per_worker] + [statistics.median(walls)]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--size", choices=("tiny", "small"), default="tiny")
    p.add_argument("--saves", type=int, default=6)
    args = h.parse(p, argv, saves=2)
    h.require_cuda("save_cost", args.device)
    if args.device == "cpu":
        os.environ["TDMESH_DEVICE"] = "cpu"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    directory = tempfile.mkdtemp(prefix="tdmesh-bench-save-cost-")
    try:
        plain, pickled, tensors = local_baseline(args.size, args.saves, directory)
        rows = fleet(args.workers, args.size, args.saves, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"\none save of the {args.size} GPT's model and optimizer ({tensors} tensors, replicated), median of "
          f"{args.saves}; {args.workers} {args.device} workers")
    print(f"baseline, this process: dcp.save(no_dist=True) {plain:.1f} CPU-ms, torch.save {pickled:.1f} CPU-ms")
    for kind, values in rows.items():
        workers = ", ".join(f"{v:.1f}" for v in values[:-1])
        print(f"tdmesh.checkpoint.{kind:13s} CPU-ms per worker [{workers}] = {max(values[:-1]) / plain:.2f}x "
              f"plain dcp.save; wall {values[-1]:.1f} ms")


if __name__ == "__main__":
    main()

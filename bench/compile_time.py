"""How long ``tdmesh.compile(backend="inductor")`` takes to compile the tutorial GPT's step,
against ``torch.compile`` of the same model in this process, and on 1 worker against 2.

    python -m bench.compile_time                       # tiny GPT, CPU: torch.compile, 1 worker, 2 workers
    python -m bench.compile_time --device cuda --size gpt2 --dtype bf16 --batch-size 16 --workers 1

Every timing starts from an empty compile cache (a fresh ``TORCHINDUCTOR_CACHE_DIR``; the
workers inherit it).  The baseline is what a torch user writes: ``torch.compile(model)``,
the same optimizer eager, the first ``SETUP_STEPS`` steps timed to a synchronised loss (they
compile).  The tdmesh rows time the same first steps of the step compiled from step 0 (see
``bench/train_step.py``: the first two calls run as the eager ops they traced while the
gradients and the optimizer's state settle, the third traces, defines and compiles), each
call ended by a fetch, so the columns say where the time goes: the client's trace of the
call, and the worker's compile (dynamo's own counters, read from rank 0 after the run).
Printed: tdmesh / torch.compile (issue 26: at most 1.5x) and 2 workers / 1 (at most 1.2x).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from bench import helpers as h

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP_STEPS = 3
sys.path.insert(0, os.path.join(ROOT, "tutorials"))


def dynamo_compile_seconds() -> str:
    """On a worker: dynamo's compile-time table (its phases, seconds), as text."""
    import torch._dynamo.utils
    return torch._dynamo.utils.compile_times(repr="str")


def fresh_cache() -> str:
    path = tempfile.mkdtemp(prefix="tdmesh-bench-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


def baseline(args, cfg, tokens) -> float:
    """``torch.compile(model)``'s first steps in this process, from an empty cache."""
    import torch

    from bench.helpers import train_optimizer

    from nanogpt import GPT
    fresh_cache()
    device = args.device
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    opt = train_optimizer(model.parameters(), device == "cuda")
    compiled = torch.compile(model, backend="inductor" if args.backend == "inductor" else "aot_eager")
    data = torch.tensor(tokens)
    start = time.perf_counter()
    for i in range(SETUP_STEPS):
        g = torch.Generator().manual_seed(i)
        at = torch.randint(len(data) - cfg.block_size - 1, (args.batch_size,), generator=g)
        x = torch.stack([data[j:j + cfg.block_size] for j in at]).to(device)
        y = torch.stack([data[j + 1:j + 1 + cfg.block_size] for j in at]).to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            loss = compiled(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()
    return time.perf_counter() - start


def tdmesh_compile(args, cfg, tokens, workers: int) -> tuple[list[float], str]:
    """The first steps of the step compiled with backend="inductor" on ``workers`` workers,
    from an empty cache: seconds per call (each ended by a fetch) and rank 0's dynamo table."""
    import torch

    import tdmesh
    from bench.helpers import data_parallel_step, train_optimizer

    from nanogpt import GPT
    train = __import__("runpy").run_path(os.path.join(ROOT, "tutorials", "05_train.py"))
    fresh_cache()
    batch = tdmesh.remote(train["seeded_batch"], propagate=lambda d, b, t, r, s: (
        torch.empty(b, t, dtype=torch.int64), torch.empty(b, t, dtype=torch.int64)))
    with tdmesh.local_mesh(hosts=1, gpus_per_host=workers) as mesh, mesh.activate():
        data = torch.tensor(tokens)
        rank = mesh.rank(mesh.names)
        tdmesh.random.set_manual_seed_remote(0)
        model = GPT(cfg)
        opt = train_optimizer(model.parameters(), mesh.device_type == "cuda")
        step = tdmesh.compile(data_parallel_step(model, opt, mesh, args.dtype == "bf16"), backend=args.backend,
                              cuda_graph=False)

        calls = []
        for i in range(SETUP_STEPS):
            x, y = batch(data, args.batch_size, cfg.block_size, rank, i)
            tdmesh.fetch_shard(x).result()  # the batch is not the call's
            start = time.perf_counter()
            loss = step(x, y)
            tdmesh.fetch_shard(loss).result()
            calls.append(time.perf_counter() - start)
        table = tdmesh.call_on_shard_and_fetch(tdmesh.remote(dynamo_compile_seconds)).result()
    return calls, table


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--size", choices=("tiny", "small", "gpt2"), default="tiny")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--workers", default="1,2", help="comma-separated worker counts (default 1,2)")
    p.add_argument("--backend", choices=("inductor", "program"), default="inductor",
                   help="program: tdmesh's own (torch.compile's baseline then aot_eager): the bench's code end to "
                        "end without inductor's C++ compile (~40 s on 2 cores), as its smoke run takes it")
    args = h.parse(p, argv, workers="1", batch_size=2, backend="program")
    h.require_cuda("compile_time", args.device)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.device == "cpu":
        os.environ["TDMESH_DEVICE"] = "cpu"
    import torch
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    from nanogpt import sized
    cfg, tokens = sized(args.size)
    base_s = baseline(args, cfg, tokens)
    rows = [(w, *tdmesh_compile(args, cfg, tokens, w)) for w in (int(s) for s in args.workers.split(","))]
    print(f"\ncompile time, {args.size} GPT, {args.dtype}, {args.device}, batch {args.batch_size}, "
          f"first {SETUP_STEPS} steps from an empty cache, torch {torch.__version__}")
    baseline_backend = "" if args.backend == "inductor" else " (aot_eager)"
    print(f"  torch.compile(model), this process : {base_s:8.2f} s{baseline_backend}")
    one = None
    for workers, calls, table in rows:
        total = sum(calls)
        one = total if one is None else one
        per_call = ", ".join(f"{c:.2f}" for c in calls)
        print(f"  tdmesh {args.backend:8s}, {workers} worker(s)     : {total:8.2f} s  (calls {per_call} s)  "
              f"/torch.compile {total / base_s:.2f}x" + (f"  /1 worker {total / one:.2f}x" if workers != 1 else ""))
        print("    rank 0 dynamo phases: " + " ".join(table.split()) if table else "")


if __name__ == "__main__":
    main()

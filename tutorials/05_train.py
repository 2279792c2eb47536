"""Train a small GPT data-parallel over the whole mesh, driven from this one process.

    python tutorials/05_train.py                      # 2 CPU workers, tiny model (CI runs this)
    python tutorials/05_train.py --steps 200 --size small
    torchrun --standalone --nproc_per_node 8 -m tdmesh.worker tutorials/05_train.py --size small

Every worker holds a replica of the model (created under ``mesh.activate()``), draws its own
batches (each rank seeds its own generator), and after ``loss.backward()`` the gradients are
averaged over every mesh dim with ``reduce_``: data parallelism written as one program.

The step runs at the fastest path the host has: it is wrapped in ``tdmesh.compile`` from its
first call, as a ``torch.compile`` user writes it.  The first call makes the gradients and the
optimizer state (it runs as the eager ops it traced, so they exist as the program sees them);
``opt.zero_grad()`` makes new gradients at every step, so the second call runs eagerly too and
the third, which sends the same messages, becomes a recording of the whole step (forward,
backward, reduce, optimizer) that rewrites those gradients in place.  Each later step is one
message per worker, which runs it as a CUDA graph on GPU meshes and as one generated function
on CPU ones; every step equals the eager step.  ``--eager`` keeps every op dispatched from this
process instead.  The script says which path the workers took.
"""

import argparse
import os
import sys
import time

import torch

import tdmesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nanogpt import GPT, get_batch, sized  # noqa: E402


def seeded_batch(data, batch_size: int, block_size: int, rank, step: int):
    """Runs on each worker: a batch from that worker's own stream of random windows."""
    g = torch.Generator(device=data.device)
    g.manual_seed(1000 * int(rank) + step)
    return get_batch(data, batch_size, block_size, g)


def train(mesh: tdmesh.DeviceMesh, steps: int, size: str, batch_size: int, lr: float,
          eager: bool = False) -> list[float]:
    cfg, tokens = sized(size)
    batch = tdmesh.remote(seeded_batch, propagate=lambda d, b, t, r, s: (
        torch.empty(b, t, dtype=torch.int64), torch.empty(b, t, dtype=torch.int64)))
    losses = []
    with mesh.activate():
        tdmesh.random.set_manual_seed_remote(0)       # the same initial weights on every worker
        model = GPT(cfg)
        # The fast flags (README, Optimizers): fused AdamW is one remote op per step and reads
        # nothing back; on CPU meshes torch's default SGD loops over parameters, foreach does not.
        if mesh.device_type == "cuda":
            opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=lr * 100, momentum=0.9, foreach=True)
        data = torch.tensor(tokens)                   # the corpus, shipped once to every worker
        rank = mesh.rank(mesh.names)

        def train_step(x, y):
            loss = model(x, y)
            opt.zero_grad()
            loss.backward()
            # data parallel: average gradients everywhere (one message, bucketed like DDP)
            tdmesh.reduce_([p.grad for p in model.parameters()], mesh.names, "avg")
            opt.step()
            return loss.detach()

        step_fn = train_step if eager else tdmesh.compile(train_step)  # a CUDA graph wherever the step qualifies
        start = time.perf_counter()
        for step in range(steps):
            x, y = batch(data, batch_size, cfg.block_size, rank, step)
            loss = step_fn(x, y)
            if step % 10 == 0 or step == steps - 1:
                avg = loss.reduce(mesh.names, "avg")
                losses.append(tdmesh.fetch_shard(avg).result().item())
                print(f"step {step:4d}  loss {losses[-1]:.4f}  ({time.perf_counter() - start:.1f} s)", flush=True)
        if eager or step_fn.recording_id is None:
            print("path: eager (every op dispatched from this process)")
        else:
            modes = tdmesh.call_on_shard_and_fetch(tdmesh.remote("tdmesh.worker.builtins.recording_modes")).result()
            how = modes.get(step_fn.recording_id)
            print(f"path: tdmesh.compile, the workers run each step as {_PATHS.get(how, how)}")
    return losses


_PATHS = {"cuda_graph": "one CUDA graph", "program": "one generated function (a program)"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--size", choices=("tiny", "small"), default="tiny")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eager", action="store_true", help="dispatch every op from this process (no tdmesh.compile)")
    args = p.parse_args()
    if "RANK" in os.environ:
        losses = train(tdmesh.world_mesh(), args.steps, args.size, args.batch_size, args.lr, args.eager)
    else:
        with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh:
            losses = train(mesh, args.steps, args.size, args.batch_size, args.lr, args.eager)
    print(f"loss went from {losses[0]:.4f} to {losses[-1]:.4f}")
    if not losses[-1] < losses[0]:
        sys.exit("the loss did not go down")


if __name__ == "__main__":
    main()

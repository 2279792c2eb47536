"""Objects that live on the workers: a per-rank data loader, built once, asked for batches.

    python tutorials/07_worker_objects.py                     # 2 CPU workers (CI runs this)
    torchrun --standalone --nproc_per_node 2 -m tdmesh.worker tutorials/07_worker_objects.py

``mesh.spawn(ShardLoader, mesh, tokens, ...)`` builds one ``ShardLoader`` on every rank of the
mesh (the ``mesh`` argument arrives as that worker's own view of it, so each loader knows its
coordinate and keeps only its shard of the corpus and its own generator).  The batches never
pass through this process: ``loader.remote("next_batch", propagate=...)`` returns them as mesh
tensors that feed the model like any other, and ``loader.call("stats")`` fetches what each
rank's loader has to say.  A method that raises is a RemoteException; the loader lives on.
"""

import os
import sys

import torch

import tdmesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nanogpt import GPT, get_batch, sized  # noqa: E402


class ShardLoader:
    """One rank's loader: its contiguous shard of the token stream, random windows from it."""

    def __init__(self, mesh, tokens, batch_size: int, block_size: int, seed: int) -> None:
        self.rank, self.world = mesh.rank(mesh.names), len(mesh.shape.slice)
        per_rank = len(tokens) // self.world
        self.shard = torch.tensor(tokens[self.rank * per_rank:(self.rank + 1) * per_rank], device=mesh.device)
        self.batch_size, self.block_size = batch_size, block_size
        self.generator = torch.Generator(device=mesh.device).manual_seed(seed + self.rank)
        self.batches = 0

    def next_batch(self):
        self.batches += 1
        return get_batch(self.shard, self.batch_size, self.block_size, self.generator)

    def stats(self) -> str:
        return f"rank {self.rank}: {len(self.shard)} tokens, {self.batches} batches served"

    def seek(self, batch: int) -> None:
        if batch < 0:
            raise ValueError(f"cannot seek to batch {batch}")
        self.batches = batch


def train(mesh, steps: int = 30, batch_size: int = 8, lr: float = 0.3) -> list[float]:
    cfg, tokens = sized("tiny")
    losses = []
    with mesh.activate():
        tdmesh.random.set_manual_seed_remote(0)
        model = GPT(cfg)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, foreach=True)
        loader = mesh.spawn(ShardLoader, mesh, tokens, batch_size, cfg.block_size, seed=1)
        next_batch = loader.remote("next_batch", propagate=lambda: (
            torch.empty(batch_size, cfg.block_size, dtype=torch.int64),
            torch.empty(batch_size, cfg.block_size, dtype=torch.int64)))
        for step in range(steps):
            x, y = next_batch()                      # made on each worker, from its own shard
            loss = model(x, y)
            opt.zero_grad()
            loss.backward()
            tdmesh.reduce_([p.grad for p in model.parameters()], mesh.names, "avg")
            opt.step()
            if step % 10 == 0 or step == steps - 1:
                losses.append(tdmesh.fetch_shard(loss.detach().reduce(mesh.names, "avg")).result().item())
                print(f"step {step:3d}  loss {losses[-1]:.4f}", flush=True)
        for _, line in loader.call("stats").result():
            print(line)
        try:
            loader.call("seek", -1).result()
        except tdmesh.RemoteException as e:
            print(f"a method raised: {e.exc_type}: {e.message}; the loader lives on: "
                  f"{loader.call_one('stats').result()}")
    return losses


def main() -> None:
    if "RANK" in os.environ:
        losses = train(tdmesh.world_mesh())
    else:
        with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh:
            losses = train(mesh)
    print(f"loss went from {losses[0]:.4f} to {losses[-1]:.4f}")
    if not losses[-1] < losses[0]:
        sys.exit("the loss did not go down")


if __name__ == "__main__":
    main()

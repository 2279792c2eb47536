"""Pipeline parallelism: one GPT split into two stages on two sub-meshes, trained on a GPipe schedule.

    python tutorials/06_pipeline.py                   # 2 CPU workers, one per stage (CI runs this)
    torchrun --standalone --nproc_per_node 2 -m tdmesh.worker tutorials/06_pipeline.py

The mesh's ``gpu`` dim is the pipeline: stage 0 (the embeddings and the first half of the
blocks) lives on ``mesh.slice(gpu=0)``, stage 1 (the other blocks, the final norm, the head
and the loss) on ``mesh.slice(gpu=1)``.  An activation crosses with ``h.to_mesh(stage1)``;
``to_mesh`` is differentiable, so each microbatch's ``loss.backward()`` sends the
activation's gradient back to stage 0: there is no send/recv code in a pipeline step.

GPipe: every microbatch goes forward, then every microbatch goes backward (last first), then
each stage takes one optimizer step.  This process only issues ops; the workers run them as
they arrive, so stage 0 computes microbatch i + 1 while stage 1 is still on microbatch i.

To show that splitting changes nothing, the script trains the same model (same seed, same
microbatches, gradients accumulated the same way) on one mesh and checks the losses match.
"""

import argparse
import os
import sys
import time

import torch
import torch.nn as nn

import tdmesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nanogpt import GPT, get_batch, sized  # noqa: E402


class FirstStage(nn.Module):
    """Token and position embeddings and the first ``split`` blocks of ``gpt``."""

    def __init__(self, gpt: GPT, split: int) -> None:
        super().__init__()
        self.tok, self.pos, self.blocks = gpt.tok, gpt.pos, gpt.blocks[:split]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return x


class LastStage(nn.Module):
    """The remaining blocks, the final norm, the head and the loss."""

    def __init__(self, gpt: GPT, split: int) -> None:
        super().__init__()
        self.blocks, self.ln, self.head = gpt.blocks[split:], gpt.ln, gpt.head

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def seeded_gpt(mesh, cfg) -> GPT:
    """The same initial weights wherever it is built: each rank's generator is seeded alike."""
    with mesh.activate():
        tdmesh.random.set_manual_seed_remote(0)
        return GPT(cfg)


def microbatches(tokens, steps: int, batch_size: int, micro: int, block_size: int):
    """Per step, ``micro`` (inputs, targets) microbatches: local tensors, the same every run."""
    data, g = torch.tensor(tokens), torch.Generator().manual_seed(0)
    for _ in range(steps):
        x, y = get_batch(data, batch_size, block_size, g)
        yield list(zip(x.chunk(micro), y.chunk(micro)))


def train_pipeline(mesh, steps: int, batch_size: int, micro: int, lr: float) -> list[float]:
    cfg, tokens = sized("tiny")
    stage0, stage1 = mesh.slice(gpu=0), mesh.slice(gpu=1)
    split = cfg.n_layer // 2
    first = FirstStage(seeded_gpt(stage0, cfg), split)   # parameters on stage 0's workers
    last = LastStage(seeded_gpt(stage1, cfg), split)     # parameters on stage 1's workers
    with stage0.activate():
        opt0 = torch.optim.SGD(first.parameters(), lr=lr, momentum=0.9, foreach=True)
    with stage1.activate():
        opt1 = torch.optim.SGD(last.parameters(), lr=lr, momentum=0.9, foreach=True)
    losses = []
    start = time.perf_counter()
    for step, batch in enumerate(microbatches(tokens, steps, batch_size, micro, cfg.block_size)):
        pending = []
        for x, y in batch:                                # forward: every microbatch
            with stage0.activate():
                h = first(tdmesh.to_mesh(x, stage0))
            with stage1.activate():
                pending.append(last(h.to_mesh(stage1), tdmesh.to_mesh(y, stage1)) / micro)
        with stage1.activate():
            for loss in reversed(pending):                # backward: last microbatch first
                loss.backward()                           # crosses back to stage 0 by itself
            step_loss = sum(loss.detach() for loss in pending)
        for opt, stage in ((opt0, stage0), (opt1, stage1)):
            with stage.activate():
                opt.step()
                opt.zero_grad()
        losses.append(tdmesh.fetch_shard(step_loss).result().item())
        print(f"pipeline   step {step:3d}  loss {losses[-1]:.5f}  ({time.perf_counter() - start:.1f} s)", flush=True)
    return losses


def train_one_mesh(mesh, steps: int, batch_size: int, micro: int, lr: float) -> list[float]:
    """The same model, microbatches and accumulation order, on one mesh."""
    cfg, tokens = sized("tiny")
    model = seeded_gpt(mesh, cfg)
    losses = []
    with mesh.activate():
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, foreach=True)
        for step, batch in enumerate(microbatches(tokens, steps, batch_size, micro, cfg.block_size)):
            pending = [model(tdmesh.to_mesh(x, mesh), tdmesh.to_mesh(y, mesh)) / micro for x, y in batch]
            for loss in reversed(pending):
                loss.backward()
            step_loss = sum(loss.detach() for loss in pending)
            opt.step()
            opt.zero_grad()
            losses.append(tdmesh.fetch_shard(step_loss).result().item())
            print(f"one mesh   step {step:3d}  loss {losses[-1]:.5f}", flush=True)
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--micro", type=int, default=4, help="microbatches per step")
    p.add_argument("--lr", type=float, default=0.3)
    args = p.parse_args()
    run = (args.steps, args.batch_size, args.micro, args.lr)
    if "RANK" in os.environ:
        mesh = tdmesh.world_mesh()
        piped, single = train_pipeline(mesh, *run), train_one_mesh(mesh.slice(gpu=0), *run)
    else:
        with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh:
            piped, single = train_pipeline(mesh, *run), train_one_mesh(mesh.slice(gpu=0), *run)
    worst = max(abs(a - b) / abs(b) for a, b in zip(piped, single))
    print(f"pipeline losses match one mesh's: worst relative difference {worst:.2e}")
    print(f"loss went from {piped[0]:.4f} to {piped[-1]:.4f}")
    if worst > 1e-5:
        sys.exit("the pipeline's losses differ from one mesh's")
    if not piped[-1] < piped[0]:
        sys.exit("the loss did not go down")


if __name__ == "__main__":
    main()

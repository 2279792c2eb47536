"""bench.heal's baseline: the same fault healed by restarting the job (issue 28's restart-and-resume path).

    torchrun --standalone --nproc_per_node 2 --max-restarts 1 -m tdmesh.worker bench/heal_restart_job.py \\
        FOLDER SIZE BATCH

The tiny GPT trains with a checkpoint after each step; on the first run the last rank's worker is SIGKILLed
in step 5 (the time written to FOLDER/times); torchrun restarts every process, the script loads its last
checkpoint and writes the time the next step starts ("resumed"), then finishes the run.
"""
import os
import runpy
import signal
import sys
import time

import torch

import tdmesh
from bench.helpers import data_parallel_step, train_optimizer

from nanogpt import GPT, sized

folder, size, batch_size = sys.argv[1], sys.argv[2], int(sys.argv[3])
STEPS, FAULT = 8, 5
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
train = runpy.run_path(os.path.join(ROOT, "tutorials", "05_train.py"))
cfg, tokens = sized(size)
batch = tdmesh.remote(train["seeded_batch"], propagate=lambda d, b, t, r, s: (
    torch.empty(b, t, dtype=torch.int64), torch.empty(b, t, dtype=torch.int64)))


@tdmesh.remote(propagate=lambda rank: None)
def die_if(rank: int) -> None:
    if int(os.environ["RANK"]) == rank:
        os.kill(os.getpid(), signal.SIGKILL)


def note(key: str) -> None:
    with open(os.path.join(folder, "times"), "a") as f:
        f.write(f"{key} {time.time()}\n")


mesh = tdmesh.world_mesh()
with mesh.activate():
    data = torch.tensor(tokens)
    tdmesh.random.set_manual_seed_remote(0)
    model = GPT(cfg)
    opt = train_optimizer(model.parameters(), mesh.device_type == "cuda")
    step = data_parallel_step(model, opt, mesh)
    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    latest = tdmesh.checkpoint.latest(folder)
    first = 0
    if latest is not None:
        loss = step(*batch(data, batch_size, cfg.block_size, mesh.rank(mesh.names), 0))  # makes the optimizer's state
        state = {"model": model.state_dict(), "opt": opt.state_dict()}
        tdmesh.checkpoint.load(state, checkpoint_id=latest)
        first = int(os.path.basename(latest)[4:]) + 1
        note("resumed")
    for i in range(first, STEPS):
        loss = step(*batch(data, batch_size, cfg.block_size, mesh.rank(mesh.names), i))
        if i == FAULT and tdmesh.restart_count() == 0:
            note("killed")
            die_if(mesh.rank_list[-1])
        tdmesh.fetch_shard(loss).result()
        tdmesh.checkpoint.save({"model": model.state_dict(), "opt": opt.state_dict()},
                               checkpoint_id=os.path.join(folder, f"step{i}"))

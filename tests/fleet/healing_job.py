"""A small data-parallel training job for the healing tests, with named points where a worker can be made to die.

The job: a two-layer MLP with dropout on a 1x2 mesh, each rank its own batch, gradients averaged over "gpu"
(a collective per parameter), two AdamW optimizers (one per layer, so a death between them leaves a
half-applied update), an async checkpoint each step.  A fault is (step, point, rank, how): at that
point of that step, on its first run, an op on the mesh kills that rank's worker — SIGKILL, ``os._exit`` or
a segfault — in order with the step's other ops, so it lands exactly there on the worker's stream.
"""

from __future__ import annotations

import ctypes
import os
import signal

import torch

import tdmesh

POINTS = ("start", "forward", "backward", "collective", "optimizer", "checkpoint", "end")
HOWS = ("sigkill", "exit", "segfault")
STEPS = 6


@tdmesh.remote(propagate=lambda rank, how: None)
def die_if(rank: int, how: str) -> None:
    if int(os.environ["RANK"]) != rank:
        return
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "exit":
        os._exit(3)
    else:
        ctypes.string_at(0)  # a segfault


def run(faults=(), spares: int = 3, checkpoint_dir: str | None = None, steps: int = STEPS, read_every: int = 1,
        stash_every: int = 4):
    """The job's losses (from rank 0), each rank's final weights and AdamW moments, the heals, and the pids
    of every worker process the fleet had.  The loss is read after every ``read_every``-th step (None for
    the others; 0: none), so a fault is found as the next step ends, at a read, or as the job ends (ft.step's
    lagged commit); an LR scheduler steps between the steps, on the client alone.  ``stash_every``: how often
    the workers copy the state (a heal goes back to the newest confirmed copy)."""
    plan = {f[0]: f[1:] for f in faults}
    pids: set[int] = set()
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2, spares=spares, pool=False) as mesh, mesh.activate():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.25), torch.nn.GELU(),
                                    torch.nn.Linear(16, 4))
        opts = [torch.optim.AdamW(model[0].parameters(), lr=0.05), torch.optim.AdamW(model[3].parameters(), lr=0.05)]
        sched = torch.optim.lr_scheduler.StepLR(opts[0], step_size=2, gamma=0.5)
        ft = tdmesh.FaultTolerance(mesh, {"model": model, "opts": opts, "sched": sched}, replicated="gpu",
                                   max_heals=len(faults))
        ft.stash_every = stash_every
        pids.update(h.pid for h in mesh.client.hellos.values())

        # a fault strikes once, on its step's first run in a whole fleet: with ft.step's lag a later step is
        # issued before an earlier fault is found, and a second death then would be a simultaneous one
        fired: set[int] = set()

        def point(i: int, name: str) -> None:
            fault = plan.get(i)
            healthy = len(ft._heals) >= len([s for s in plan if s < i])
            if fault is not None and fault[0] == name and i not in fired and healthy:
                fired.add(i)
                die_if(fault[1], fault[2])

        def train_step(i: int):
            point(i, "start")
            x = torch.randn(6, 8) + mesh.rank("gpu")
            target = torch.randn(6, 4)
            h = model[1](model[0](x))
            point(i, "forward")
            loss = (model[3](model[2](h)) - target).pow(2).mean()
            loss.backward()
            point(i, "backward")
            for k, p in enumerate(model.parameters()):
                p.grad.reduce_("gpu", reduction="avg")
                if k == 1:
                    point(i, "collective")
            opts[0].step()
            point(i, "optimizer")
            opts[1].step()
            for opt in opts:
                opt.zero_grad()
            if checkpoint_dir is not None:
                saving = tdmesh.checkpoint.async_save({"model": model.state_dict()},
                                                      checkpoint_id=os.path.join(checkpoint_dir, f"step{i}"))
                point(i, "checkpoint")
                saving.result()
            point(i, "end")
            return loss

        losses = []
        for i in range(steps):
            loss = ft.step(train_step, i)
            sched.step()
            pids.update(h.pid for h in mesh.client.hellos.values())
            read = read_every and i % read_every == 0  # a value of a step read later is lost in a heal
            losses.append(tdmesh.fetch_shard(loss, host=0, gpu=0).result().item() if read else None)
        weights = [tdmesh.fetch_shard(list(model.parameters()), host=0, gpu=g).result() for g in (0, 1)]
        moments = [tdmesh.fetch_shard([s["exp_avg_sq"] for opt in opts for s in opt.state.values()], host=0,
                                      gpu=g).result() for g in (0, 1)]
        heals = list(ft.heals)
    return losses, weights, moments, heals, pids

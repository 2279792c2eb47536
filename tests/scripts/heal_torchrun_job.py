"""A torchrun job healed without a restart (issue 54): ``TDMESH_SPARES=1`` on 3 ranks, rank 1's worker killed.

    TDMESH_SPARES=1 torchrun --standalone --nproc_per_node 3 --max-restarts 1 -m tdmesh.worker \\
        tests/scripts/heal_torchrun_job.py [--fault]

Prints the world mesh (its repr names the spare), where a remote function ran (the mesh's ranks, not the
spare), the losses, the heals and ``restart_count``; with ``--fault`` the worker of rank 1 is SIGKILLed in
step 2.  The test compares the run with the fault against ``train`` on a local mesh without it.
"""
import os
import signal
import sys

import torch

import tdmesh


def rank_of() -> int:
    return int(os.environ["RANK"])


@tdmesh.remote(propagate=lambda rank: None)
def die_if(rank: int) -> None:
    if int(os.environ["RANK"]) == rank:
        os.kill(os.getpid(), signal.SIGKILL)


def train(mesh, fault: bool):
    """The job on ``mesh``: its losses, whether the replicas agree, its heals."""
    with mesh.activate():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        ft = tdmesh.FaultTolerance(mesh, {"model": model, "opt": opt}, replicated="gpu")

        def step(i: int):
            x = torch.randn(4, 8) + mesh.rank("gpu")
            loss = model(x).pow(2).mean()
            loss.backward()
            for p in model.parameters():
                p.grad.reduce_("gpu", reduction="avg")
            if fault and i == 2 and not ft.heals:
                die_if(1)
            opt.step()
            opt.zero_grad()
            return loss

        losses = [tdmesh.fetch_shard(ft.step(step, i)).result().item() for i in range(5)]
        weights = [tdmesh.fetch_shard(model[0].weight, host=0, gpu=g).result() for g in (0, 1)]
    return losses, torch.equal(weights[0], weights[1]), [(h.rank, h.step, h.replaced_by.split(" (")[0])
                                                         for h in ft.heals]


if __name__ == "__main__":
    world = tdmesh.world_mesh()
    print("MESH", repr(world), flush=True)
    with world.activate():
        print("RAN", sorted(v for _, v in tdmesh.remote(rank_of).call().get()), flush=True)
    losses, agree, heals = train(world, "--fault" in sys.argv)
    print("losses", losses, flush=True)
    print("replicas agree", agree, flush=True)
    print("heals", heals, flush=True)
    print("restart_count", tdmesh.restart_count(), flush=True)

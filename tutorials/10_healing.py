"""Lose a worker in the middle of a training step and keep going: healed in a fraction of a second, bit for bit.

    python tutorials/10_healing.py                       # 2 CPU workers + 1 spare (CI runs this)
    TDMESH_SPARES=1 torchrun --standalone --nproc_per_node 3 -m tdmesh.worker tutorials/10_healing.py

The small GPT of tutorial 05 trains data-parallel inside ``ft.step``, where ``ft`` is a
``tdmesh.FaultTolerance`` over the model and its optimizer.  At step ``--die-at`` the last rank's
worker is SIGKILLed in the middle of the step (after the backward, between the gradient's collective
and the optimizer).  The controller sees the death at once, releases the survivor from the collective
it was blocked in, puts the spare in the dead rank's place, copies the model and optimizer from the
surviving replica as they were when the step began (with the workers' generators), and runs the step
again.  The job then trains to the end, and the script checks that its losses are the losses of the
same job run without the fault, bit for bit (exit code 1 if not).  Under torchrun, ``TDMESH_SPARES=1``
keeps the last rank as the spare and no restart happens (``tdmesh.restart_count()`` stays 0).
"""

import argparse
import os
import signal
import sys

import torch

import tdmesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nanogpt import GPT, sized  # noqa: E402 - the tutorials' model, beside this file

train = __import__("runpy").run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "05_train.py"))


@tdmesh.remote(propagate=lambda rank: None)
def die_if(rank: int) -> None:
    """Runs on every worker; the one of ``rank`` is killed, in order with the step's ops."""
    if int(os.environ["RANK"]) == rank:
        os.kill(os.getpid(), signal.SIGKILL)


batch = tdmesh.remote(train["seeded_batch"], propagate=lambda d, b, t, r, s: (
    torch.empty(b, t, dtype=torch.int64), torch.empty(b, t, dtype=torch.int64)))


def run(mesh, steps: int, die_at: int | None) -> list[float]:
    cfg, tokens = sized("tiny")
    with mesh.activate():
        data = torch.tensor(tokens)  # the corpus, on every rank (the same everywhere: part of the state)
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        ft = tdmesh.FaultTolerance(mesh, {"model": model, "opt": opt, "data": data}, replicated="gpu")

        def step(i: int):
            x, y = batch(data, 8, cfg.block_size, mesh.rank(mesh.names), i)  # each rank its own batch
            loss = model(x, y)
            opt.zero_grad()
            loss.backward()
            tdmesh.reduce_([p.grad for p in model.parameters()], "gpu", "avg")
            if i == die_at and not ft.heals:  # the fault: only on the step's first run
                die_if(mesh.rank_list[-1])
            opt.step()
            return loss

        losses = []
        for i in range(steps):
            loss = ft.step(step, i)
            losses.append(tdmesh.fetch_shard(loss).result().item())
        for h in ft.heals:
            print(f"healed rank {h.rank} at step {h.step} in {h.seconds:.3f} s: {h.cause}; replaced by {h.replaced_by}")
    return losses


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--die-at", type=int, default=3)
    args = p.parse_args()
    if "RANK" in os.environ:  # under torchrun: the job's own mesh, its last rank the spare
        losses = run(tdmesh.world_mesh(), args.steps, args.die_at)
        print(f"losses {[round(v, 4) for v in losses]}; restart_count {tdmesh.restart_count()}")
        return 0
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2, spares=1) as mesh:
        healed = run(mesh, args.steps, args.die_at)
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh:
        plain = run(mesh, args.steps, None)
    print(f"healed run: {[round(v, 4) for v in healed]}")
    print(f"without the fault: {[round(v, 4) for v in plain]}")
    same = healed == plain
    print(f"the healed run's losses equal the run without the fault bit for bit: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

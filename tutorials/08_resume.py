"""Checkpoint a training job as it runs, lose a worker, and resume where it was: bit for bit.

    python tutorials/08_resume.py                     # 2 CPU workers: the notebook story (CI runs this)
    torchrun --standalone --nproc_per_node 2 --max-restarts 2 -m tdmesh.worker \\
        tutorials/08_resume.py --dir /tmp/resume      # the torchrun story: kill a worker, watch it resume

The small GPT of tutorial 05 trains data-parallel, and every ``--every`` steps the whole fleet's
state -- model, optimizer (momentum buffers), the step -- is saved with
``tdmesh.checkpoint.async_save``: each worker copies its tensors at the call and writes them in
the background through ``torch.distributed.checkpoint`` while training goes on; the next save
first waits for the one before.  A checkpoint is complete once DCP's ``.metadata`` is written
(last), so ``tdmesh.checkpoint.latest`` never picks one that a fault cut off.

Run by ``python``, the script plays the notebook story: a worker is killed at step ``--die-at``,
the mesh raises ``DeviceException``, and a new mesh loads the latest checkpoint and trains to the
end; it then trains the same steps without a fault and checks that the losses agree bit for bit
(exit code 1 if not).  Under torchrun (``--max-restarts``), kill a worker yourself (``kill -9``),
or pass ``--die-at`` (the job's first run kills one): torchrun restarts the job,
``tdmesh.restart_count()`` says so, and the script resumes from the latest checkpoint in
``--dir``.  A job restarted after its last checkpoint (the end) trains nothing and reports the
final loss saved with it.
"""

import argparse
import os
import shutil
import signal
import sys
import tempfile

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import tdmesh
import tdmesh.checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nanogpt import GPT, get_batch, sized  # noqa: E402


def seeded_batch(data, batch_size: int, block_size: int, rank, step: int):
    """Runs on each worker: the batch of (rank, step), so a resumed run sees the same data."""
    g = torch.Generator(device=data.device)
    g.manual_seed(1000 * int(rank) + step)
    return get_batch(data, batch_size, block_size, g)


def train(mesh, directory: str, steps: int, every: int, die_at: int | None = None) -> dict[int, float]:
    """Train from the latest checkpoint in ``directory`` (or from scratch) to ``steps``; returns
    {step: loss}, with the loss the checkpoint was saved after (so a job restarted once it was
    complete still reports its final loss).  ``die_at``: kill the mesh's last worker after that
    step (a fault: SIGKILL, as ``kill -9`` would)."""
    cfg, tokens = sized("tiny")
    batch = tdmesh.remote(seeded_batch, propagate=lambda d, b, t, r, s: (
        torch.empty(b, t, dtype=torch.int64), torch.empty(b, t, dtype=torch.int64)))
    losses: dict[int, float] = {}
    with mesh.activate():
        tdmesh.random.set_manual_seed_remote(0)
        model = GPT(cfg)
        opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9, foreach=True)
        model_sd, optim_sd = get_state_dict(model, opt)  # makes the optimizer's state, to load into
        start = 0
        latest = tdmesh.checkpoint.latest(directory)
        if latest is not None:
            state = {"model": model_sd, "optim": optim_sd, "step": 0, "loss": 0.0}
            tdmesh.checkpoint.load(state, checkpoint_id=latest)
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            start = state["step"]
            losses[start - 1] = state["loss"]
            print(f"resumed from {os.path.basename(latest)} (restart {tdmesh.restart_count()})", flush=True)
        data = torch.tensor(tokens)
        rank = mesh.rank(mesh.names)

        @tdmesh.compile
        def train_step(x, y):
            loss = model(x, y)
            opt.zero_grad()
            loss.backward()
            tdmesh.reduce_([p.grad for p in model.parameters()], mesh.names, "avg")
            opt.step()
            return loss.detach()

        saving = None
        for step in range(start, steps):
            loss = train_step(*batch(data, 8, cfg.block_size, rank, step))
            losses[step] = tdmesh.fetch_shard(loss.reduce(mesh.names, "avg")).result().item()
            print(f"step {step:3d}  loss {losses[step]!r}", flush=True)  # every digit: compared bit for bit
            if (step + 1) % every == 0:
                if saving is not None:
                    saving.result()  # one checkpoint at a time: the one before is complete first
                model_sd, optim_sd = get_state_dict(model, opt)  # keyed by parameter name, as load's
                state = {"model": model_sd, "optim": optim_sd, "step": step + 1, "loss": losses[step]}
                where = os.path.join(directory, f"step-{step + 1:05d}")
                saving = tdmesh.checkpoint.async_save(state, checkpoint_id=where)
            if step == die_at:
                print(f"after step {step}: the mesh's last worker is killed (--die-at {die_at})", flush=True)
                with mesh.slice(**{d: mesh.size(d) - 1 for d in mesh.names}).activate():
                    tdmesh.remote("signal.raise_signal", propagate="inspect")(signal.SIGKILL)  # a worker dies
        if saving is not None:
            saving.result()
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=5, help="steps between checkpoints")
    p.add_argument("--die-at", type=int, default=None,
                   help="the step after which a worker dies (default 12 under python; under torchrun none, "
                        "and only in the job's first run)")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a fresh temporary directory)")
    args = p.parse_args()
    directory = args.dir or tempfile.mkdtemp(prefix="tdmesh-resume-")
    if "RANK" in os.environ:  # under torchrun: a restart resumes from the latest checkpoint in --dir
        die_at = args.die_at if tdmesh.restart_count() == 0 else None
        losses = train(tdmesh.world_mesh(), directory, args.steps, args.every, die_at=die_at)
        print(f"final loss {losses[args.steps - 1]!r}")
        return
    try:
        with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh:
            train(mesh, directory, args.steps, args.every, die_at=12 if args.die_at is None else args.die_at)
    except tdmesh.DeviceException as e:
        print(f"the mesh failed: {str(e).splitlines()[0]}")
    print(f"latest complete checkpoint: {os.path.basename(tdmesh.checkpoint.latest(directory) or 'none')}")
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh:  # a new mesh resumes
        resumed = train(mesh, directory, args.steps, args.every)
    fresh = tempfile.mkdtemp(prefix="tdmesh-uninterrupted-")
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh:
        uninterrupted = train(mesh, fresh, args.steps, args.every)
    same = all(resumed[s] == uninterrupted[s] for s in resumed)  # the checkpoint's loss too
    print(f"resumed steps {min(resumed)}..{max(resumed)} equal the uninterrupted run's bit for bit: {same}")
    if args.dir is None:
        shutil.rmtree(directory, ignore_errors=True)
    shutil.rmtree(fresh, ignore_errors=True)
    if not same:
        sys.exit("the resumed run differs from the uninterrupted one")


if __name__ == "__main__":
    main()

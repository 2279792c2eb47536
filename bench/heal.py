"""Healing (``tdmesh.FaultTolerance``): what a worker's death costs, against the restart-and-resume path.

    python -m bench.heal                                   # tiny GPT, 1x2 CPU mesh + 1 spare
    python -m bench.heal --device cuda --workers 1         # one GPU: 1 worker + 1 spare on the same GPU
    python -m bench.heal --state-mb 64                     # restore throughput with 64 MB more state

Four figures, each with its baseline from the same run:
1. ``ft.step`` with no fault against the plain step (the same model and batches; blocks of each in turn,
   the median of per-block step times), as a ratio;
2. a heal: a worker SIGKILLed (from this process) in the middle of a step, the time from the kill to the
   step running again, split into detect (kill -> the client sees it), release (the survivors leave the
   broken session), re-form (the new generation's process group and connections), the lost values' scan,
   restore (every rank's state back, the new rank's copied from a replica) and the re-run of the step;
3. the same fault through the restart-and-resume path (issue 28): ``torchrun --max-restarts 1`` restarts
   every process, the script loads its last checkpoint (saved each step) and runs the step again; the time
   from the kill to that step starting, and the ratio;
4. the restore's copy throughput (the new rank's state from a replica) against the floor: the same bytes
   sent with gloo between two fresh processes of this machine.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--size", choices=("tiny", "small"), default="tiny")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--blocks", type=int, default=15, help="blocks of plain and ft.step steps, in turn")
    p.add_argument("--steps", type=int, default=20, help="steps per block")
    p.add_argument("--heals", type=int, default=3, help="faults healed (each with a spare)")
    p.add_argument("--state-mb", type=int, default=0, help="MB of replicated state added (restore throughput)")
    p.add_argument("--no-restart", action="store_true", help="skip the restart-and-resume baseline")
    from bench.helpers import parse
    args = parse(p, argv, blocks=1, steps=3, heals=1, no_restart=True)
    if args.device == "cpu":
        os.environ["TDMESH_DEVICE"] = "cpu"
    sys.path.insert(0, os.path.join(ROOT, "tutorials"))
    results = _in_process(args)
    if not args.no_restart:
        results["restart"] = _restart_path(args)
    if results["heals"] and not args.smoke:  # the floor starts two more interpreters: not in the smoke tier
        results["floor"] = _floor(results["copied_bytes"], args.device)
    _report(args, results)


def _in_process(args) -> dict:
    import torch

    import tdmesh
    from bench.helpers import data_parallel_step, train_optimizer

    from nanogpt import GPT, sized

    train = __import__("runpy").run_path(os.path.join(ROOT, "tutorials", "05_train.py"))
    cfg, tokens = sized(args.size)
    batch = tdmesh.remote(train["seeded_batch"], propagate=lambda d, b, t, r, s: (
        torch.empty(b, t, dtype=torch.int64), torch.empty(b, t, dtype=torch.int64)))
    out: dict = {}
    with tdmesh.local_mesh(hosts=1, gpus_per_host=args.workers, spares=args.heals, pool=False) as mesh, \
            mesh.activate():
        data = torch.tensor(tokens)
        tdmesh.random.set_manual_seed_remote(0)
        model = GPT(cfg)
        opt = train_optimizer(model.parameters(), mesh.device_type == "cuda")
        step = data_parallel_step(model, opt, mesh)
        extra = torch.zeros(args.state_mb * 2**18) if args.state_mb else None  # float32: 4 bytes each
        state = {"model": model, "opt": opt, "data": data, **({"extra": extra} if args.state_mb else {})}
        ft = tdmesh.FaultTolerance(mesh, state, replicated=mesh.names[-1], max_heals=args.heals)

        def one(i: int):  # the batch is made in the step: a new rank makes its own again
            return step(*batch(data, args.batch_size, cfg.block_size, mesh.rank(mesh.names), i))

        for i in range(3):  # warm: the first steps allocate and define ops
            ft.step(one, i)
        tdmesh.fetch_shard(one(3)).result()

        def block(first: int, healing: bool) -> float:
            began = time.perf_counter()
            for i in range(first, first + args.steps):
                loss = ft.step(one, i) if healing else one(i)
            tdmesh.fetch_shard(loss).result()
            return (time.perf_counter() - began) / args.steps

        plain, healing = [], []
        for b in range(args.blocks):  # in turn, which goes first alternating: a drift favours neither
            pair = [(False, 2 * b), (True, 2 * b + 1)][::1 if b % 2 == 0 else -1]
            for is_ft, k in pair:
                (healing if is_ft else plain).append(block(100 + k * args.steps, is_ft))
        out["plain_s"], out["ft_s"] = statistics.median(plain), statistics.median(healing)
        ratios = sorted(f / p for f, p in zip(healing, plain))
        out["ratio"] = statistics.median(ratios)
        out["ratio_iqr"] = (ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4])

        heals: list[dict] = []
        for h in range(args.heals):  # a worker SIGKILLed in the middle of a step, from here
            victim = mesh.client.hellos[mesh.rank_list[-1]].pid
            killed: list[float] = []

            def kill(pid: int = victim, killed: list = killed) -> None:
                killed.append(time.monotonic())
                os.kill(pid, signal.SIGKILL)
            timer = threading.Timer(out["plain_s"] / 2, kill)
            timer.start()
            began = time.monotonic()
            before = len(ft.heals)
            ft.step(one, 1000 + h)
            timer.join()
            while len(ft.heals) == before:  # the kill came after the step's end: the next step heals it
                ft.step(one, 1000 + h)
            ended = time.monotonic()
            record = ft.heals[-1]
            heal_end = record.seen_at + record.seconds
            heals.append(dict(record.phases, detect=record.seen_at - killed[0], rerun=ended - heal_end,
                              total=ended - killed[0], kill_after=killed[0] - began))
        out["heals"] = heals
        out["copied_bytes"] = sum(t.numel() * t.element_size() for t in _state_tensors(model, opt, data, extra))
    return out


def _state_tensors(model, opt, data, extra):
    tensors = list(model.parameters()) + [t for s in opt.state.values() for t in s.values() if hasattr(t, "numel")]
    return tensors + [data] + ([extra] if extra is not None else [])


RESTART_JOB = os.path.join(ROOT, "bench", "heal_restart_job.py")


def _restart_path(args) -> dict:
    """The same fault, healed by torchrun restarting the job from its checkpoint (issue 28's path)."""
    with tempfile.TemporaryDirectory(prefix="tdmesh_heal_restart_") as folder:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tutorials")]))
        began = time.monotonic()
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={args.workers}", "--max-restarts=1", "-m", "tdmesh.worker", RESTART_JOB,
                        folder, args.size, str(args.batch_size)], env=env, check=True, capture_output=True, timeout=600)
        wall = time.monotonic() - began
        with open(os.path.join(folder, "times")) as f:
            times = dict(line.split() for line in f)
    return {"kill_to_step": float(times["resumed"]) - float(times["killed"]), "wall_s": wall}


def _floor(nbytes: int, device: str) -> dict:
    """The same bytes between two fresh processes over gloo (send, recv), on this machine."""
    import torch.multiprocessing as mp
    port = _free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_floor_rank, args=(r, port, nbytes, device, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    seconds, fresh = queue.get(timeout=300)
    for proc in procs:
        proc.join(60)
    return {"seconds": seconds, "fresh": fresh, "bytes": nbytes}


def _floor_rank(rank: int, port: int, nbytes: int, device: str, queue) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    n = max(1, nbytes // 4)
    buf = torch.ones(n, device=dev)
    times: dict[bool, list] = {False: [], True: []}
    for fresh in (False, True) * 5:  # into the same buffer each time; into a new one, as a new rank receives
        dist.barrier()
        into = torch.empty(n, device=dev) if fresh and rank == 1 else buf
        began = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
        else:
            dist.recv(into, 0)
        times[fresh].append(time.perf_counter() - began)
    if rank == 1:
        queue.put((statistics.median(times[False]), statistics.median(times[True])))
    dist.destroy_process_group()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _report(args, r: dict) -> None:
    print(f"\nhealing, {args.size} GPT, {args.workers} {args.device} worker(s) + spares, batch {args.batch_size}"
          + (f", +{args.state_mb} MB state" if args.state_mb else ""))
    print(f"  step, plain            {r['plain_s'] * 1e3:8.2f} ms (median of {args.blocks} blocks of {args.steps})")
    print(f"  step, ft.step          {r['ft_s'] * 1e3:8.2f} ms   {r['ft_s'] / r['plain_s']:.3f}x the plain step; "
          f"block by block {r['ratio']:.3f}x (quartiles {r['ratio_iqr'][0]:.3f}-{r['ratio_iqr'][1]:.3f})")
    if not r["heals"]:
        return
    keys = ("detect", "release", "re-form", "lost values", "copy", "restore", "rerun", "total")
    print("  heal (s)  " + " ".join(f"{k:>11}" for k in keys))
    for h in r["heals"]:
        print("            " + " ".join(f"{h[k]:11.3f}" for k in keys))
    total = statistics.median(h["total"] for h in r["heals"])
    print(f"  heal: kill -> step running again (and done, with the steps run again before it), median {total:.3f} s")
    if "restart" in r:
        rs = r["restart"]
        print(f"  restart-and-resume: kill -> step running again {rs['kill_to_step']:.3f} s "
              f"(torchrun --max-restarts 1, checkpoint each step; job wall {rs['wall_s']:.1f} s): "
              f"heal {rs['kill_to_step'] / total:.1f}x faster")
    if "floor" not in r:
        return
    restore = statistics.median(h["restore"] for h in r["heals"])
    copy = statistics.median(h["copy"] for h in r["heals"])
    floor = r["floor"]
    print(f"  restore {r['copied_bytes'] / 2**20:.1f} MiB: the copy from the replica {copy * 1e3:.1f} ms "
          f"(the whole restore call {restore * 1e3:.1f} ms); floor, a gloo send of the same bytes between two "
          f"fresh processes: {floor['seconds'] * 1e3:.1f} ms into a buffer used before, {floor['fresh'] * 1e3:.1f} ms "
          f"into a new one (as a new rank receives): the copy at {floor['seconds'] / copy:.2f}x and "
          f"{floor['fresh'] / copy:.2f}x the floor's throughput")


if __name__ == "__main__":
    main()

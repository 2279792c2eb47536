"""What bounds tdmesh's eager training step: the client's issuing or the workers' running it.

    python -m bench.eager_bound                          # one CPU worker
    python3 -m bench.eager_bound --device cuda --size small
    python3 -m bench.eager_bound --device cuda --size gpt2 --dtype bf16 --batch-size 16

One worker, bench.train_step's eager step (forward, ``zero_grad``, backward: one message, the
workers' own autograd runs it, ``reduce_``, the optimizer), ``--steps`` steps a run and one
fetch at its end, as bench.train_step times it.  Rows, in ``--rounds`` rounds after one that
warms up, each its median over the rounds:

  local eager     the same model, optimizer and step in this process on the worker's device
                  type, with no mesh, synchronised at the run's end: the work one worker does,
                  at the cost of plain torch (DDP at world size 1 without its hooks)
  tdmesh          the step under ``mesh.activate()``: wall time per step, and the client's own
                  time to issue it, by phase (the rest of the wall time is the client waiting
                  for the workers at the run's end)
  decomposed      the client's issue time (and its forward's) with each ``nn.Linear`` issued as torch's
                  decomposition, op by op (``TDMESH_WHOLE_LINEAR=off``), in the same rounds: against the
                  default, one op a linear (``tdmesh/engine/composites.py``)
  workers alone   the same steps issued while the worker's stream is held by a remote
                  ``time.sleep``: the worker then runs them back to back with no wait for the
                  client, so its time is the step's bound from the workers' side (the
                  messages' decoding, done by the worker's message loop meanwhile, is not in it)

The step runs at the larger of the client's issue time and the workers' time; both are
printed against local eager, and the ratio the targets of issue 29 name (against DDP) is
bench.train_step's, on the same host.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import helpers as h  # noqa: E402

PHASES = ("forward", "zero_grad", "backward", "reduce_", "optimizer")


def _phased_step(model, opt, mesh, bf16: bool, phases: dict):
    """bench.helpers.data_parallel_step with a clock between its phases (``phases``: name -> seconds)."""
    import torch

    import tdmesh
    clock = time.perf_counter
    params = list(model.parameters())

    def step(x, y):
        t0 = clock()
        with torch.autocast(mesh.device_type if mesh is not None else x.device.type, dtype=torch.bfloat16,
                            enabled=bf16):
            loss = model(x, y)
        t1 = clock()
        opt.zero_grad(set_to_none=True)
        t2 = clock()
        loss.backward()
        t3 = clock()
        if mesh is not None:
            tdmesh.reduce_([p.grad for p in params], mesh.names, "avg")
        t4 = clock()
        opt.step()
        t5 = clock()
        for name, start, end in zip(PHASES, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5)):
            phases[name] += end - start
        return loss.detach()
    return step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.eager_bound", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--size", default="tiny", help="tutorials/nanogpt.py's sizes")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--hold", type=float, default=0.0,
                   help="seconds the worker's stream is held for `workers alone` (default: 3x the client's issue time)")
    args = h.parse(p, argv, steps=2, rounds=1)
    h.require_cuda("eager_bound", args.device)
    if args.device == "cpu":
        os.environ["TDMESH_DEVICE"] = "cpu"
    h.ensure_importable_by_workers()
    import torch

    import tdmesh
    sys.path.insert(0, os.path.join(h.REPO_ROOT, "tutorials"))
    from nanogpt import GPT, sized
    bf16 = args.dtype == "bf16"
    cfg, _ = sized(args.size)
    n = args.steps
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")

    torch.manual_seed(0)
    local_model = GPT(cfg).to(device)
    local_opt = h.train_optimizer(local_model.parameters(), args.device == "cuda")
    local_phases = dict.fromkeys(PHASES, 0.0)
    local_step = _phased_step(local_model, local_opt, None, bf16, local_phases)
    gen = torch.Generator().manual_seed(0)
    local_batches = [(torch.randint(cfg.vocab_size, (args.batch_size, cfg.block_size), generator=gen).to(device),
                      torch.randint(cfg.vocab_size, (args.batch_size, cfg.block_size), generator=gen).to(device))
                     for _ in range(n)]

    def run_local():
        for x, y in local_batches:
            loss = local_step(x, y)
        return float(loss)  # the run's end: its last kernel done

    with tdmesh.local_mesh(hosts=1, gpus_per_host=1, pool=False) as mesh:
        with mesh.activate():
            tdmesh.random.set_manual_seed_remote(0)
            model = GPT(cfg)
            opt = h.train_optimizer(model.parameters(), args.device == "cuda")
            batches = [(torch.randint(cfg.vocab_size, (args.batch_size, cfg.block_size)),
                        torch.randint(cfg.vocab_size, (args.batch_size, cfg.block_size))) for _ in range(n)]
            sleep = tdmesh.remote("time.sleep", propagate="inspect")
        phases = dict.fromkeys(PHASES, 0.0)
        step = _phased_step(model, opt, mesh, bf16, phases)
        client = mesh.client

        def run_tdmesh(hold: float = 0.0, whole: bool = True):
            """(wall seconds, the client's issue seconds, messages) for the run's ``n`` steps; the local
            runs between them run with no mesh active.  ``whole=False``: each ``nn.Linear`` as torch's
            decomposition, op by op (``TDMESH_WHOLE_LINEAR=off``, read at the activation)."""
            os.environ["TDMESH_WHOLE_LINEAR"] = "on" if whole else "off"
            with mesh.activate():
                tdmesh.fetch_shard(batches[-1][0]).result()
                first = client.last_seq
                start = time.perf_counter()
                if hold:
                    sleep(hold)
                for x, y in batches:
                    loss = step(x, y)
                issued = time.perf_counter() - start
                tdmesh.fetch_shard(loss).result()
                return time.perf_counter() - start, issued, client.last_seq - first

        run_tdmesh()
        run_local()
        _, issue_s, _ = run_tdmesh()
        hold = args.hold or max(0.5, 3 * issue_s)
        local_s: list = []
        wall_s: list = []
        issue_s_: list = []
        alone_s: list = []
        phase_s: dict = {name: [] for name in PHASES}
        local_phase_s: dict = {name: [] for name in PHASES}
        messages = decomposed_messages = 0
        decomposed_s: list = []
        decomposed_forward_s: list = []
        for round_ in range(args.rounds + 1):
            for name in PHASES:
                phases[name] = local_phases[name] = 0.0
            start = time.perf_counter()
            run_local()
            local = time.perf_counter() - start
            local_phases_now = dict(local_phases)
            for name in PHASES:
                phases[name] = 0.0
            wall, issued, messages = run_tdmesh()
            phases_now = dict(phases)
            phases["forward"] = 0.0
            _, decomposed, decomposed_messages = run_tdmesh(whole=False)
            decomposed_forward = phases["forward"]
            alone_wall, alone_issued, _ = run_tdmesh(hold)
            if alone_issued >= hold:
                print(f"note: the client issued the held run in {alone_issued:.3f} s, past the {hold:.3f} s hold: "
                      f"`workers alone` counts some of the client's time (--hold longer)")
            if round_:
                local_s.append(local / n)
                wall_s.append(wall / n)
                issue_s_.append(issued / n)
                decomposed_s.append(decomposed / n)
                decomposed_forward_s.append(decomposed_forward / n)
                alone_s.append((alone_wall - hold) / n)
                for name in PHASES:
                    phase_s[name].append(phases_now[name] / n)
                    local_phase_s[name].append(local_phases_now[name] / n)

    med = statistics.median
    local, wall = med(local_s), med(wall_s)
    print(f"eager bound: {args.size} GPT ({args.dtype}, batch {args.batch_size}), 1 {args.device} worker, {n} steps "
          f"a run, median of {args.rounds} rounds; {messages / n:.0f} messages a step ({decomposed_messages / n:.0f} "
          f"with each nn.Linear decomposed); torch {torch.__version__}; "
          f"{h.machine_line()}")
    rows = [["local eager (this process)", f"{local * 1e3:.2f}", "1.000x"],
            ["tdmesh step (wall)", f"{wall * 1e3:.2f}", f"{local / wall:.3f}x"],
            ["  the client issues it in", f"{med(issue_s_) * 1e3:.2f}", f"{local / med(issue_s_):.3f}x"],
            *[[f"    {name}", f"{med(phase_s[name]) * 1e3:.2f}",
               f"local's {med(local_phase_s[name]) * 1e3:.2f} ms"] for name in PHASES],
            ["  each nn.Linear decomposed (TDMESH_WHOLE_LINEAR=off)", f"{med(decomposed_s) * 1e3:.2f}",
             f"whole: {med(decomposed_s) / med(issue_s_):.3f}x faster"],
            ["    forward", f"{med(decomposed_forward_s) * 1e3:.2f}",
             f"whole: {med(decomposed_forward_s) / med(phase_s['forward']):.3f}x faster"],
            ["workers alone (stream held, then run back to back)", f"{med(alone_s) * 1e3:.2f}",
             f"{local / med(alone_s):.3f}x"]]
    h.print_table(["per step", "ms", "local eager / this"], rows)
    bound = "the client" if med(issue_s_) >= med(alone_s) else "the workers"
    print(f"bound by {bound}: the step is {wall / max(med(issue_s_), med(alone_s)):.2f}x the larger of the two")
    return 0


if __name__ == "__main__":
    sys.exit(main())

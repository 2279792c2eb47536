"""Step time of the tutorial GPT driven by tdmesh vs the same model under torchrun DDP.

    python -m bench.train_step                          # 2 CPU workers, tiny model
    python -m bench.train_step --device cuda --size small --workers 2
    python -m bench.train_step --device cuda --size gpt2 --dtype bf16 --batch-size 16
    python -m bench.train_step --clip            # every step also reads a value on the host
    python -m bench.train_step --paired 5        # and 5 rounds of DDP then tdmesh eager: the median ratio
    python -m bench.train_step --interleaved 40  # and 40 pairs of blocks of 20 steps, both fleets up: the median ratio

Same model (tutorials/nanogpt.py), same initial weights, same per-rank batches, same
optimizer, same number of workers, in one run: the DDP baseline runs under torchrun in a
subprocess first, then tdmesh drives a local mesh from this process.  The tdmesh step is
timed as the average over ``--steps`` steps ending in one fetch (so the workers' backlog is
included; the batches are made before the timer starts, as DDP's are), eagerly (every op
dispatched from this process) and as a ``tdmesh.compile``d step
compiled from step 0 on a fresh model (one message per step once it records; its first three
steps, which trace and compile, are timed apart); DDP's as the median step (synchronised), and
its mean beside it (the statistic of tdmesh's steps; ``--paired`` compares means).
Every variant trains the same steps from the same weights, so their final losses compare.  Gradients
are averaged with one bucketed ``tdmesh.reduce_`` per step, as DDP buckets them.
``--dtype bf16`` runs both forwards under ``torch.autocast(..., dtype=torch.bfloat16)``.
Ops per step: the aten ops one eager tdmesh step issues and one plain local step (the model
without DDP, in the baseline's process) dispatches, counted by the same ``OpCounter``; and
the messages (ops with a sequence number: aten ops, collectives, remote calls) per step.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from bench import helpers as h

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP_STEPS = 3  # untimed first steps (allocation; for a compiled step: eager, eager, trace)
sys.path.insert(0, os.path.join(ROOT, "tutorials"))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--size", choices=("tiny", "small", "gpt2"), default="tiny")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--inductor", action="store_true", help="also backend='inductor' (compiles for a while)")
    p.add_argument("--inductor-mode", default=None, metavar="MODE",
                   help="the inductor variants with torch.compile MODE's options (torch._inductor.list_mode_options, "
                        "less its own CUDA graphs: tdmesh captures the step), and DDP's compiled run in that mode "
                        "(max-autotune: with CUDA graphs, as reduce-overhead)")
    p.add_argument("--inductor-only", action="store_true",
                   help="of the compiled variants, only backend='inductor' (and its CUDA graph)")
    p.add_argument("--optimizer", default="fused", choices=h.OPTIMIZERS,
                   help="CUDA: AdamW fused (one opaque kernel) or foreach (torch's multi-tensor ops, which inductor "
                        "compiles with the step); the same for DDP")
    p.add_argument("--clip", action="store_true",
                   help="every variant clips gradients with error_if_nonfinite=True: a host read every step, "
                        "which a compiled step checks between the parts of its recording")
    p.add_argument("--keep-grads", action="store_true",
                   help="zero_grad(set_to_none=False): the same gradient tensors every step (default: torch's "
                        "default, new gradients every step, which a compiled step rewrites as its state)")
    p.add_argument("--overlap", action="store_true",
                   help="also the eager step with gradients reduced bucket by bucket while backward runs: by the "
                        "workers' own backward (tdmesh.reduce_grads_in_backward), and on a second stream through "
                        "tdmesh.grad_generator and through post-accumulate-grad hooks")
    p.add_argument("--buckets", type=int, default=None,
                   help="buckets of --overlap's reduction (default: DDP's sizes, the first 1 MiB, the others 25 MiB)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of --overlap's alternating measurement")
    p.add_argument("--interleaved", type=int, default=0, metavar="N",
                   help="also N pairs of blocks of --block steps, DDP's and tdmesh eager's alternating while both "
                        "fleets stay up (the one waiting uses no CPU), and the median of each pair's ratio: the "
                        "host's speed moves within seconds, a pair shares it")
    p.add_argument("--block", type=int, default=0, help="steps of an --interleaved block (default: --steps)")
    p.add_argument("--paired", type=int, default=0,
                   help="also N rounds of DDP (a torchrun run) then tdmesh eager, one after the other, and the median "
                        "of each round's ratio: the host's speed drifts between runs, a round's two halves share it")
    args = h.parse(p, argv, steps=2)
    h.require_cuda("train_step", args.device)
    args.block = args.block or args.steps
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if args.device == "cpu":
        env["TDMESH_DEVICE"] = os.environ["TDMESH_DEVICE"] = "cpu"

    def run_ddp(first: bool):
        """The DDP baseline under torchrun: (its median and mean step in seconds, its stdout, its
        DDP_STEP_SECONDS line); the first run also times DDP + torch.compile on CUDA."""
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                              str(args.workers), os.path.join(ROOT, "bench", "ddp_train.py"), "--steps",
                              str(args.steps), "--size", args.size, "--dtype", args.dtype, "--batch-size",
                              str(args.batch_size), "--optimizer", args.optimizer]
                             + (["--compile-mode", args.inductor_mode] if args.inductor_mode else [])
                             + (["--reduce-overhead"] if args.device == "cuda" and first else [])
                             + (["--clip"] if args.clip else []),
                             capture_output=True, text=True, env=env, timeout=600)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("DDP_STEP_SECONDS")), None)
        if line is None:
            sys.exit("the DDP baseline failed:\n" + out.stderr[-3000:])
        mean = next(float(ln.split()[1]) for ln in out.stdout.splitlines() if ln.startswith("DDP_MEAN_STEP_SECONDS"))
        return float(line.split()[1]), mean, out, line

    ddp_s, ddp_mean_s, out, line = run_ddp(first=True)
    serving = None
    if args.interleaved:  # a second DDP job that stays up and runs blocks when asked (bench/ddp_train.py: serve)
        from torch.distributed import TCPStore
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        serving = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.workers),
             os.path.join(ROOT, "bench", "ddp_train.py"), "--steps", str(args.steps), "--size", args.size, "--dtype",
             args.dtype, "--batch-size", str(args.batch_size), "--serve", f"127.0.0.1:{store.port}", "--block",
             str(args.block), "--optimizer", args.optimizer] + (["--clip"] if args.clip else []),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    ro_line = next((ln for ln in out.stdout.splitlines() if ln.startswith("DDP_RO_STEP_SECONDS")), None)
    for ln in out.stdout.splitlines():
        if ln.startswith("DDP_RO_FAILED"):
            print(f"(DDP + torch.compile(mode='reduce-overhead') did not run: {ln[len('DDP_RO_FAILED '):]})")
    plain_ops = int(next(ln for ln in out.stdout.splitlines() if ln.startswith("PLAIN_OPS_PER_STEP")).split()[1])

    import torch

    import tdmesh
    from bench import limits
    from bench.helpers import (
        OpCounter,
        count_kernels,
        data_parallel_step,
        overlapped_step,
        process_cpu_seconds,
        train_optimizer,
    )
    from tdmesh.worker.graphs import TRIALS as GRAPH_TRIALS

    from nanogpt import GPT, sized
    train = __import__("runpy").run_path(os.path.join(ROOT, "tutorials", "05_train.py"))
    cfg, tokens = sized(args.size)
    peak = flops = None
    if args.device == "cuda":  # the GPU's limit: before the fleet starts, the GPU is this process's alone
        peak = limits.matmul_peak(args.dtype)
        with torch.device("meta"):
            flops = limits.model_flops_per_step(GPT(cfg), cfg, args.batch_size * cfg.block_size)
    batch = tdmesh.remote(train["seeded_batch"], propagate=lambda d, b, t, r, s: (
        torch.empty(b, t, dtype=torch.int64), torch.empty(b, t, dtype=torch.int64)))
    with tdmesh.local_mesh(hosts=1, gpus_per_host=args.workers) as mesh, mesh.activate():
        if serving is not None:
            store.wait(["ready"])  # its start-up (imports, its own timed steps) is over: nothing else runs now
        data = torch.tensor(tokens)
        rank = mesh.rank(mesh.names)

        def fresh(overlap: str | None = None):
            """A new model and optimizer (the same initial weights as the DDP run) and its step,
            written as a user writes it: torch's default zero_grad (new gradients each step)."""
            tdmesh.random.set_manual_seed_remote(0)
            model = GPT(cfg)
            opt = train_optimizer(model.parameters(), mesh.device_type == "cuda", args.optimizer)
            if overlap is not None:
                return overlapped_step(model, opt, mesh, args.dtype == "bf16", set_to_none=not args.keep_grads,
                                       buckets=args.buckets, how=overlap)
            return data_parallel_step(model, opt, mesh, args.dtype == "bf16", set_to_none=not args.keep_grads,
                                      clip=args.clip)

        issue_s: dict = {}
        cpu_s: dict = {}  # fn -> (the client's, the workers') CPU seconds per step of its last timed run
        worker_pids = list(mesh.fleet.processes.pids().values()) if mesh.fleet.processes is not None else []

        def timed(fn, first: int, steps: int = args.steps) -> tuple[float, float]:
            # the batches are made before the timer starts, as DDP's loop makes each batch before its timer
            batches = [batch(data, args.batch_size, cfg.block_size, rank, i) for i in range(first, first + steps)]
            tdmesh.fetch_shard(batches[-1][0]).result()
            client_cpu, workers_cpu = time.process_time(), process_cpu_seconds(worker_pids)
            start = time.perf_counter()
            for x, y in batches:
                loss = fn(x, y)
            issue_s[fn] = (time.perf_counter() - start) / steps  # the client's own time per step
            final = tdmesh.fetch_shard(loss).result()
            wall = (time.perf_counter() - start) / steps
            cpu_s[fn] = ((time.process_time() - client_cpu) / steps,
                         (process_cpu_seconds(worker_pids) - workers_cpu) / steps)
            return wall, float(final)

        step = fresh()
        for i in range(SETUP_STEPS):  # the eager step's first steps allocate: not timed either
            loss = step(*batch(data, args.batch_size, cfg.block_size, rank, i))
        tdmesh.fetch_shard(loss).result()
        ours_s, final = timed(step, SETUP_STEPS)
        ours_issue_s = issue_s[step]
        paired = []  # (DDP s, tdmesh eager s) per round of --paired
        for _ in range(args.paired):
            paired.append((run_ddp(first=False)[1], timed(step, SETUP_STEPS)[0]))
        interleaved = []  # (DDP s, tdmesh eager s) per pair of blocks of --interleaved
        if serving is not None:
            for i in range(args.interleaved):
                for who in (("ddp", "tdmesh") if i % 2 == 0 else ("tdmesh", "ddp")):  # each first in half the pairs
                    if who == "ddp":
                        store.set(f"go/{i}", "run")
                        store.wait([f"done/{i}"])
                        ddp_block = float(store.get(f"done/{i}"))
                    else:
                        ours_block = timed(step, SETUP_STEPS, args.block)[0]
                interleaved.append((ddp_block, ours_block))
            store.set(f"go/{args.interleaved}", "stop")
            if serving.wait(timeout=120) != 0:
                sys.exit("the serving DDP job failed:\n" + serving.stderr.read()[-3000:])
        x, y = batch(data, args.batch_size, cfg.block_size, rank, 0)
        with OpCounter() as counted:  # torch's ops: a dispatch mode of the user's own, so every linear decomposed
            step(x, y)
        first = mesh.client.last_seq
        step(x, y)  # the messages of a step as the timed ones send them (each nn.Linear one op: engine/composites.py)
        messages = mesh.client.last_seq - first
        kernels = None
        busy: dict = {}  # label -> the GPU's busy seconds a step (rank 0, from a profiled step)
        if mesh.device_type == "cuda":  # one eager step under torch.profiler on every worker
            import tempfile
            with tdmesh.profile(tempfile.mkdtemp()) as traces:
                step(x, y)
            kernels = count_kernels(os.path.join(traces, "rank0.trace.json"))
            busy["tdmesh eager"] = limits.gpu_busy_s(os.path.join(traces, "rank0.trace.json"))
        overlapped: dict = {}
        if args.overlap:  # rounds of --steps steps, the three variants in turn (this VM's noise is
            # larger than the difference): each its own fresh model, trained the same steps
            steps_of = {how: fresh(how if how != "eager" else None) for how in ("eager", "workers", "generator",
                                                                                  "hooks")}
            for fn in steps_of.values():
                for i in range(SETUP_STEPS):
                    loss = fn(*batch(data, args.batch_size, cfg.block_size, rank, i))
                tdmesh.fetch_shard(loss).result()
            for _ in range(args.rounds):
                for how, fn in steps_of.items():
                    step_s, final_o = timed(fn, SETUP_STEPS)
                    overlapped.setdefault(how, []).append((step_s, final_o, issue_s[fn], *cpu_s[fn]))
        # compiled variants, each continuing the training: a generated program per worker, and on
        # CUDA that program captured as a CUDA graph; the first two calls (trace, definition,
        # warm-up and capture) are timed apart from the steps
        cuda = mesh.device_type == "cuda"
        # a step that reads a value on the host (--clip) is a graph per part that can be one: cuda_graph=None
        graph_label, graph = ("  + CUDA graphs", None) if args.clip else ("  + CUDA graph", True)
        variants = [] if args.inductor_only else \
            [("tdmesh compiled", "program", False)] + ([(graph_label, "program", graph)] if cuda else [])
        if args.inductor or args.inductor_only or args.inductor_mode:
            variants += [("tdmesh inductor", "inductor", False)] + ([(graph_label, "inductor", graph)] if cuda else [])
        compiled: list = []
        modes: dict = {}
        kernels_of: dict = {}  # label -> the kernels that took longest in its profiled step
        setup = SETUP_STEPS + (2 * GRAPH_TRIALS if cuda else 0)
        inductor_options = None
        if args.inductor_mode:
            from torch._inductor import list_mode_options
            inductor_options = {k: v for k, v in list_mode_options(args.inductor_mode).items()
                                if k != "triton.cudagraphs"}
        for label, backend, graph in variants:
            # compiled from step 0, as a torch.compile user writes it: the first call makes the
            # gradients and the optimizer's state (eager ops), the gradients settle at the third
            # call (a recording), which also compiles; on CUDA a graph's trials follow (worker/graphs.py:
            # TRIALS calls as a program, the capture, TRIALS replays), untimed, every compiled variant alike
            fn = tdmesh.compile(fresh(), backend=backend, cuda_graph=graph,
                                options=inductor_options if backend == "inductor" else None)
            start = time.perf_counter()
            for i in range(setup):
                loss = fn(*batch(data, args.batch_size, cfg.block_size, rank, i))
            tdmesh.fetch_shard(loss).result()
            setup_s = time.perf_counter() - start
            step_s, final_c = timed(fn, setup)
            compiled.append((label, step_s, final_c, issue_s[fn], setup_s))
            if cuda:  # one more step profiled: the GPU's busy time, and the mode each rank chose
                import tempfile
                with tdmesh.profile(tempfile.mkdtemp()) as traces:
                    tdmesh.fetch_shard(fn(*batch(data, args.batch_size, cfg.block_size, rank, 0))).result()
                trace = os.path.join(traces, "rank0.trace.json")
                busy[f"{label.strip()} ({backend})"] = limits.gpu_busy_s(trace)
                kernels_of[f"{label.strip()} ({backend})"] = limits.top_kernels(trace)
                modes[label, backend] = list(tdmesh.call_on_shard_and_fetch(tdmesh.remote(
                    "tdmesh.worker.builtins.recording_modes")).result().values())[-1]
                if backend == "inductor":  # how many graphs inductor made of the step, and what ran between them
                    graphs = tdmesh.call_on_shard_and_fetch(tdmesh.remote(
                        "tdmesh.worker.builtins.recording_graphs")).result().get(fn.recording_id)
                    modes[label, backend] += "; not an inductor program" if graphs is None else (
                        f"; {graphs['graphs']} inductor graph(s), between them: {graphs['outside'] or 'nothing'}")
    print(f"\ntrain step, {args.size} GPT, {args.dtype}, {args.workers} {args.device} workers, "
          f"batch {args.batch_size}/worker, zero_grad(set_to_none={not args.keep_grads}), "
          f"{'clip_grad_norm_(error_if_nonfinite=True), ' if args.clip else ''}"
          f"{'AdamW ' + args.optimizer + ', ' if args.device == 'cuda' else ''}torch {torch.__version__}")
    print(f"  torchrun DDP   : {ddp_s * 1e3:9.2f} ms/step   ({line.split('LOSS')[1].strip()} final loss; the median "
          f"step; the mean {ddp_mean_s * 1e3:.2f} ms)")
    if ro_line is not None:
        ro = ro_line.split()
        print(f"  DDP + compile  : {float(ro[1]) * 1e3:9.2f} ms/step   (torch.compile "
              f"mode='{args.inductor_mode or 'reduce-overhead'}'; "
              f"{ro[3]} final loss; first 3 steps incl. compile {float(ro[5]):.1f} s)  DDP/this "
              f"{ddp_s / float(ro[1]):.3f}x")
    print(f"  tdmesh         : {ours_s * 1e3:9.2f} ms/step   ({final:.4f} final loss; the client issues a step "
          f"in {ours_issue_s * 1e3:.2f} ms)")
    if overlapped:
        print(f"  --overlap, {args.rounds} rounds of {args.steps} steps in turn, median step (and issue) time; "
              f"{steps_of['hooks'].buckets()} bucket(s) ({'DDP sizes' if args.buckets is None else '--buckets'}) "
              f"reduced while backward runs (workers: by the workers' backward, DDP sizes; generator, hooks: on a "
              f"second stream):")
        median = {how: sorted(rows)[len(rows) // 2] for how, rows in overlapped.items()}
        for how, (step_s, _, issue_o, client_c, workers_c) in median.items():
            rounds = " ".join(f"{r[0] * 1e3:.2f}" for r in overlapped[how])
            print(f"    {how:<10}: {step_s * 1e3:7.2f} ms/step ({issue_o * 1e3:.2f} ms issue; rounds {rounds}; "
                  f"final loss {overlapped[how][-1][1]:.4f})  eager/this {median['eager'][0] / step_s:.3f}x")
            print(f"    {'':<10}  CPU a step (that round): client {client_c * 1e3:.2f} ms, workers "
                  f"{workers_c * 1e3:.2f} ms, together {(client_c + workers_c) / step_s:.2f} cores busy of "
                  f"{os.cpu_count()}")
    for label, step_s, final_c, issue_c, setup_s in compiled:
        print(f"  {label:<15}: {step_s * 1e3:9.2f} ms/step   ({final_c:.4f} final loss; issued in "
              f"{issue_c * 1e3:.2f} ms; first {setup} steps incl. trace + the graph's trials "
              f"{setup_s:.1f} s)  DDP/this "
              f"{ddp_s / step_s:.3f}x")
    print(f"  DDP/tdmesh     : {ddp_s / ours_s:9.3f}x  (1.0 = as fast as DDP; DDP's median step against tdmesh's "
          f"mean, which counts a slow step; mean against mean {ddp_mean_s / ours_s:.3f}x)")
    if paired:
        ratios = sorted(d / t for d, t in paired)
        print(f"  --paired       : {ratios[len(ratios) // 2]:9.3f}x  median DDP/tdmesh of {len(paired)} rounds "
              f"(DDP then tdmesh eager each, mean steps both): "
              + ", ".join(f"{d * 1e3:.2f}/{t * 1e3:.2f} ms = {d / t:.3f}x" for d, t in paired))
    if interleaved:
        ratios = sorted(d / t for d, t in interleaved)
        n = len(ratios)
        ddp_blocks, ours_blocks = sorted(d for d, _ in interleaved), sorted(t for _, t in interleaved)
        print(f"  --interleaved  : {ratios[n // 2]:9.3f}x  median DDP/tdmesh of {n} pairs of {args.block}-step blocks "
              f"(quartiles {ratios[n // 4]:.3f}-{ratios[(3 * n) // 4]:.3f}x; DDP's blocks "
              f"{ddp_blocks[n // 2] * 1e3:.2f} ms/step median, {ddp_blocks[0] * 1e3:.2f}-{ddp_blocks[-1] * 1e3:.2f}; "
              f"tdmesh eager's "
              f"{ours_blocks[n // 2] * 1e3:.2f}, {ours_blocks[0] * 1e3:.2f}-{ours_blocks[-1] * 1e3:.2f})")
    print(f"  ops per step   : {counted.ops} issued by tdmesh, {plain_ops} in a plain local step "
          f"({counted.ops / plain_ops:.2f}x); {messages} messages per tdmesh step")
    if kernels is not None:
        ddp_kernels = next((ln.split()[1] for ln in out.stdout.splitlines() if ln.startswith("DDP_KERNELS_PER_STEP")),
                           "?")
        print(f"  kernels/step   : {kernels} on tdmesh rank 0 (eager), {ddp_kernels} on DDP rank 0")
    if peak is not None:
        ddp_busy = next((float(ln.split()[1]) for ln in out.stdout.splitlines() if ln.startswith("DDP_BUSY_S")), None)
        if ddp_busy is not None:
            busy["torchrun DDP"] = ddp_busy
        print(f"  the GPU's limit: a {args.dtype} 8192^3 matmul runs at {peak / 1e12:.1f} TFLOP/s on this GPU "
              f"(this run); "
              f"the model {flops / 1e9:.1f} GFLOP a step a worker (6N + 12 L d T a token); MFU = those FLOPs over the "
              f"step's time, over that peak; busy = rank 0's kernels and copies a step (a profiled step)")
        rows = [("torchrun DDP", ddp_s)] + ([("DDP + compile", float(ro_line.split()[1]))] if ro_line else [])
        rows += [("tdmesh eager", ours_s)] + [(f"{label.strip()} ({backend})", step_s) for (label, step_s, *_), (
            _, backend, _) in zip(compiled, variants)]
        for label, step_s in rows:
            b = busy.get(label)
            print(limits.mfu_line(label, step_s, flops, peak)
                  + (f"  GPU busy {b * 1e3:7.2f} ms/step ({b / step_s:.0%} of the step)" if b is not None else ""))
        for (label, backend), mode in modes.items():
            print(f"    {label.strip()} ({backend}) ran as: {mode}")
        if kernels_of:
            best = min(rows[2:], key=lambda r: r[1])[0] if len(rows) > 2 else None
            if best in kernels_of:
                print(f"    the kernels that took longest in {best}'s step (ms, launches):")
                for name, ms, count in kernels_of[best]:
                    print(f"      {ms:8.3f} {count:5d}  {name[:110]}")


if __name__ == "__main__":
    main()

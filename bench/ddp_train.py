"""The DDP baseline of bench/train_step.py: the same model and batches under torchrun + DDP.

    torchrun --standalone --nproc_per_node 2 bench/ddp_train.py --steps 20 --size tiny --dtype fp32
Rank 0 prints ``DDP_STEP_SECONDS <median seconds per step> LOSS <final loss>``,
``DDP_MEAN_STEP_SECONDS <mean>`` (the statistic tdmesh's eager step is timed with: a slow step
counts), then ``PLAIN_OPS_PER_STEP <n>``: the aten ops one plain local step (the model without DDP, same
optimizer) dispatches, counted by bench.helpers.OpCounter.  ``--reduce-overhead`` (CUDA) also
trains a fresh copy as DDP under ``torch.compile(mode="reduce-overhead")`` (CUDA graphs, the
fastest way people train small models with torchrun) and prints ``DDP_RO_STEP_SECONDS <median>
LOSS <final> COMPILE_SECONDS <first 3 steps>`` (or ``DDP_RO_FAILED <why>``).  ``--serve HOST:PORT``
then runs blocks of ``--block`` steps when bench.train_step's ``--interleaved`` asks (``serve``).
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from tdmesh.config import cpu_forced

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tutorials"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.helpers import OPTIMIZERS, OpCounter, count_kernels, train_optimizer  # noqa: E402

from nanogpt import GPT, SIZES, get_batch, sized  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--size", default="tiny", choices=SIZES)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="bf16: autocast around the forward")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--reduce-overhead", action="store_true")
    p.add_argument("--compile-mode", default="reduce-overhead",
                   help="torch.compile's mode for --reduce-overhead's run (one with CUDA graphs: max-autotune)")
    p.add_argument("--clip", action="store_true", help="clip_grad_norm_(..., error_if_nonfinite=True) in every step")
    p.add_argument("--serve", default="", metavar="HOST:PORT",
                   help="after the timed steps, run blocks of --block steps when a TCPStore there says go (see serve)")
    p.add_argument("--block", type=int, default=5)
    p.add_argument("--optimizer", default="fused", choices=OPTIMIZERS, help="CUDA: train_optimizer's kind")
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not cpu_forced()
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    cfg, tokens = sized(args.size)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where tdmesh's workers initialise theirs: same generator, same weights
        model = GPT(cfg)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    opt = train_optimizer(model.parameters(), cuda, args.optimizer)
    data = torch.tensor(tokens, device=device)
    times = []
    for step in range(args.steps + 3):
        g = torch.Generator(device=device)
        g.manual_seed(1000 * rank + step)
        x, y = get_batch(data, args.batch_size, cfg.block_size, g)
        start = time.perf_counter()
        loss = _step(ddp, opt, x, y, args.dtype, device, args.clip)
        if step >= 3:
            times.append(time.perf_counter() - start)
    final_loss = loss.item()  # the steps the tdmesh run also takes (the profiled step below is one more)
    # before the plain step below: calling the wrapped model directly fires DDP's gradient hooks
    # kernels of one DDP step (forward, backward with its all-reduces, optimizer), every rank in it; not in a
    # serving job, whose blocks would run with the profiler's CUDA callbacks still attached to the process
    if cuda and not args.serve:
        import tempfile

        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _step(ddp, opt, x, y, args.dtype, device, args.clip)
        if rank == 0:
            path = os.path.join(tempfile.mkdtemp(), "ddp.trace.json")
            prof.export_chrome_trace(path)
            print(f"DDP_KERNELS_PER_STEP {count_kernels(path)}", flush=True)
            from bench.limits import gpu_busy_s
            print(f"DDP_BUSY_S {gpu_busy_s(path)}", flush=True)
    if rank == 0:
        print(f"DDP_STEP_SECONDS {statistics.median(times):.6f} LOSS {final_loss:.4f}", flush=True)
        print(f"DDP_MEAN_STEP_SECONDS {statistics.fmean(times):.6f}", flush=True)
        with OpCounter() as counted:  # one plain step: no DDP hooks, no collectives
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
                plain_loss = model(x, y)
            opt.zero_grad(set_to_none=False)
            plain_loss.backward()
            opt.step()
        print(f"PLAIN_OPS_PER_STEP {counted.ops}", flush=True)
    if args.serve:
        serve(args, ddp, opt, data, cfg, device, rank)
    if args.reduce_overhead and cuda:
        try:
            _reduce_overhead(args, cfg, data, device, rank)
        except Exception as e:  # noqa: BLE001 - the bench reports the missing baseline and goes on
            if rank == 0:
                print(f"DDP_RO_FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
    dist.destroy_process_group()


def serve(args, ddp, opt, data, cfg, device: torch.device, rank: int) -> None:
    """Blocks of ``--block`` steps on demand, for bench.train_step's ``--interleaved``: block ``i`` starts
    when the store at ``--serve`` holds ``go/i`` (``stop`` ends the loop) and rank 0 answers ``done/i``
    with its mean step in seconds.  Between blocks every rank waits in the store's socket, using no CPU,
    while tdmesh runs its block: each pair of blocks shares the host's speed of that moment."""
    host, port = args.serve.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False)
    if rank == 0:
        store.set("ready", "1")
    block = 0
    while True:
        store.wait([f"go/{block}"])
        if store.get(f"go/{block}") == b"stop":
            return
        batches = []
        for step in range(args.block):
            g = torch.Generator(device=device)
            g.manual_seed(1000 * rank + 100_000 + block * args.block + step)
            batches.append(get_batch(data, args.batch_size, cfg.block_size, g))
        start = time.perf_counter()
        for x, y in batches:
            _step(ddp, opt, x, y, args.dtype, device, args.clip)
        if rank == 0:
            store.set(f"done/{block}", f"{(time.perf_counter() - start) / args.block:.9f}")
        block += 1


def _step(ddp, opt, x, y, dtype: str, device: torch.device, clip: bool = False):
    """One synchronised DDP step (bf16: autocast around the forward; ``clip``: gradient clipping
    that raises on a non-finite norm, a host read every step); its loss."""
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
        loss = ddp(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0, error_if_nonfinite=True)
    opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return loss


def _reduce_overhead(args, cfg, data, device, rank) -> None:
    """The same training as DDP under torch.compile(mode="reduce-overhead") (or ``--compile-mode``), from the
    same weights."""
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    ddp = torch.compile(torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index]),
                        mode=args.compile_mode)
    opt = train_optimizer(model.parameters(), True, args.optimizer)
    times = []
    start = time.perf_counter()
    for step in range(args.steps + 3):
        if step == 3:
            compile_s = time.perf_counter() - start
        g = torch.Generator(device=device)
        g.manual_seed(1000 * rank + step)
        x, y = get_batch(data, args.batch_size, cfg.block_size, g)
        t = time.perf_counter()
        torch.compiler.cudagraph_mark_step_begin()
        loss = _step(ddp, opt, x, y, args.dtype, device, args.clip)
        if step >= 3:
            times.append(time.perf_counter() - t)
    if rank == 0:
        print(f"DDP_RO_STEP_SECONDS {statistics.median(times):.6f} LOSS {loss.item():.4f} "
              f"COMPILE_SECONDS {compile_s:.2f}", flush=True)


if __name__ == "__main__":
    main()

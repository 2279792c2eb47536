"""The DDP baseline of bench/train_step.py: the same model and batches under torchrun + DDP.

    torchrun --standalone --nproc_per_node 2 bench/ddp_train.py --steps 20 --size tiny
Rank 0 prints one line: ``DDP_STEP_SECONDS <median seconds per step>``.
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
from nanogpt import GPT, GPTConfig, encode, get_batch  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--size", default="tiny")
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not cpu_forced()
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    tokens, vocab = encode()
    cfg = GPTConfig.small(len(vocab)) if args.size == "small" else GPTConfig.tiny(len(vocab))
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    opt = (torch.optim.AdamW(model.parameters(), lr=3e-3, capturable=True) if cuda
           else torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9))
    data = torch.tensor(tokens, device=device)
    times = []
    for step in range(args.steps + 3):
        g = torch.Generator(device=device)
        g.manual_seed(1000 * rank + step)
        x, y = get_batch(data, args.batch_size, cfg.block_size, g)
        start = time.perf_counter()
        loss = ddp(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        if step >= 3:
            times.append(time.perf_counter() - start)
    if rank == 0:
        print(f"DDP_STEP_SECONDS {statistics.median(times):.6f} LOSS {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""What a CUDA graph replay costs to hand out its results: a clone each, or one multi-tensor copy.

    python3 -m bench.result_copies                 # the small GPT's gradients (+ its loss), on cuda:0

A compiled step's results are fresh tensors copied out of the graph's static outputs at every
replay (``tdmesh/worker/graphs.py``); under ``zero_grad()`` (set_to_none) the step's results are
every gradient.  Same process, same tensors, alternating rounds: ``out.clone()`` per result
(a kernel launch each) against ``torch.empty_like`` per result plus one ``torch._foreach_copy_``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from bench import helpers as h

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tutorials"))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=("tiny", "small", "gpt2"), default="small")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--rounds", type=int, default=7)
    args = h.parse(p, argv, size="tiny", iters=5, rounds=1)

    import torch

    from nanogpt import GPT, sized
    h.require_cuda("result_copies")
    cfg, _ = sized(args.size)
    with torch.device("cuda"):
        outs = [p.detach().clone() for p in GPT(cfg).parameters()] + [torch.zeros(())]

    def clones():
        return [o.clone() for o in outs]

    def one_copy():
        fresh = [torch.empty_like(o) for o in outs]
        torch._foreach_copy_(fresh, outs)
        return fresh

    def timed(fn) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.iters):
            kept = fn()
        del kept
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / args.iters

    for fn in (clones, one_copy):  # warm the allocator's blocks
        timed(fn)
    rows: dict = {clones: [], one_copy: []}
    for _ in range(args.rounds):
        for fn in rows:
            rows[fn].append(timed(fn))
    a, b = (statistics.median(rows[fn]) for fn in (clones, one_copy))
    mib = sum(o.numel() * o.element_size() for o in outs) / 2**20
    print(f"{len(outs)} results ({mib:.1f} MiB), {args.size} GPT, median of {args.rounds} rounds of {args.iters}:")
    print(f"  clone each          : {a * 1e6:8.1f} us per replay")
    print(f"  one multi-tensor copy: {b * 1e6:8.1f} us per replay   clone/this {a / b:.2f}x")


if __name__ == "__main__":
    main()

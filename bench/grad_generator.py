"""What ``tdmesh.grad_generator`` costs the client against torch's engine, same graph, same run.

    python -m bench.grad_generator

The tiny GPT's backward (tutorials/nanogpt.py), every parameter wanted: the median time of
``torch.autograd.grad(loss, params)`` against ``list(tdmesh.grad_generator(loss, params))``,
first on local tensors (the graph walk's own cost, in Python, over torch's C++ engine), then
on a 1x2 CPU mesh, where the time is the client's issuing of backward (each measured backward
starts after the forward's loss has been fetched, and its gradients are fetched after it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from bench import helpers as h

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tutorials"))


def _median_backward(model, x, y, kind: str, rounds: int, sync=None) -> float:
    import torch

    import tdmesh
    params = list(model.parameters())
    times = []
    for _ in range(rounds):
        loss = model(x, y)
        if sync:
            sync(loss)
        start = time.perf_counter()
        grads = torch.autograd.grad(loss, params) if kind == "engine" else list(tdmesh.grad_generator(loss, params))
        times.append(time.perf_counter() - start)
        if sync:
            sync(grads[0])
    return sorted(times)[rounds // 2]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=21)
    args = h.parse(p, argv, rounds=1)
    os.environ.setdefault("TDMESH_DEVICE", "cpu")
    import torch

    import tdmesh

    from nanogpt import GPT, sized
    cfg, _ = sized("tiny")
    torch.manual_seed(0)
    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (8, cfg.block_size))
    y = torch.randint(0, cfg.vocab_size, (8, cfg.block_size))
    nodes = len(tdmesh.grad_generator(model(x, y), list(model.parameters()))._runs)  # type: ignore[attr-defined]
    rows = []
    for kind in ("engine", "generator", "engine", "generator"):  # in turn: each its best-placed median
        rows.append((kind, "local", _median_backward(model, x, y, kind, args.rounds)))
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh, mesh.activate():
        remote = GPT(cfg)
        rx, ry = torch.tensor(x), torch.tensor(y)

        def sync(t):
            tdmesh.fetch_shard(t).result()
        for kind in ("engine", "generator", "engine", "generator"):
            rows.append((kind, "1x2 mesh", _median_backward(remote, rx, ry, kind, args.rounds, sync)))
    print(f"\ntiny GPT backward, {nodes} nodes, every parameter wanted, median of {args.rounds}, "
          f"torch {torch.__version__}")
    for where in ("local", "1x2 mesh"):
        engine = min(t for k, w, t in rows if k == "engine" and w == where)
        generator = min(t for k, w, t in rows if k == "generator" and w == where)
        print(f"  {where:<9}: torch.autograd.grad {engine * 1e3:7.2f} ms   grad_generator {generator * 1e3:7.2f} ms   "
              f"+{(generator - engine) * 1e6 / nodes:5.1f} us a node   engine/generator {engine / generator:.3f}x")


if __name__ == "__main__":
    main()

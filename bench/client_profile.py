"""Where the client's time per op goes: the dispatch loop and a small training step under cProfile.

    python -m bench.client_profile                      # CPU workers
    python -m bench.client_profile --device cuda        # GPU workers

Two loops run on a 1-worker mesh: ``x = ones + x`` (bench.dispatch's loop) and the tiny GPT's
training step (forward, backward, bucketed reduce, ``bench.helpers.train_optimizer``).  Each is
timed without a profiler first (best of ``--repeats``), then once under cProfile; the profile's
own time per function (``tottime``) is scaled by (time without profiler / time with it), so
the table reads as microseconds per op of an unprofiled run.  cProfile slows Python calls
more than C work, so the table overstates Python-heavy rows and understates C ones: read it
for where the time goes, the first line for how much there is.  Rows are grouped:

  torch          torch's own Python and C++ work (argument parsing, autograd, its dispatch)
                 (a Python builtin such as dict.get or pickle.dumps counts for its callers)
  dispatch       tdmesh.engine.dispatch / plan / placement / propagation: an aten call -> an op
  issue          tdmesh.engine.issue, tdmesh.engine.tensor: refs, proxies, the message
  send           tdmesh.engine.client.submit, history, encoding, sockets
  call site      tdmesh.errors.call_site: the user's line, for errors
  other          everything else (the user's model code, the optimizer's Python)
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import helpers as h  # noqa: E402
from bench.helpers import train_optimizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GROUPS = (("call site", ("errors.py",)),
          ("send", ("client.py", "history.py", "transport.py", "outbox.py", "flusher.py")),
          ("issue", ("issue.py", "tensor.py")),
          ("dispatch", ("dispatch.py", "plan.py", "placement.py", "propagation.py", "activation.py", "stream.py",
                        "_context.py", "_coalescing.py", "mesh.py", "wire.py")))


def _group(filename: str, name: str) -> str:
    if "/tdmesh/" in filename:
        for group, files in GROUPS:
            if any(filename.endswith(f) for f in files):
                return group
        return "dispatch"
    if "/torch/" in filename or filename == "~":  # torch's Python, and its C++ (torch._C methods)
        return "torch"
    return "other"


def profile(label: str, run, ops: int, repeats: int) -> None:
    """``run()`` issues ``ops`` client ops and waits for them."""
    run()
    best = min(_timed(run) for _ in range(repeats))
    prof = cProfile.Profile()
    prof.enable()
    profiled = _timed(run)
    prof.disable()
    scale = best / profiled
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows: dict[str, float] = {}
    top: list[tuple[float, str]] = []
    for (filename, line, name), (_, _, tottime, _, callers) in stats.items():
        us = tottime * scale / ops * 1e6
        top.append((us, f"{os.path.basename(filename)}:{line}({name})" if filename != "~" else name))
        if filename == "~" and "torch._C" not in name and callers:  # a builtin (dict.get, pickle): its callers'
            for (caller_file, _, caller_name), edge in callers.items():
                group = _group(caller_file, caller_name)
                rows[group] = rows.get(group, 0.0) + edge[2] * scale / ops * 1e6
        else:
            rows[_group(filename, name)] = rows.get(_group(filename, name), 0.0) + us
    print(f"\n{label}: {best / ops * 1e6:.1f} us per op without the profiler ({ops} ops, best of {repeats}); "
          f"profiled {profiled / ops * 1e6:.1f} us")
    for group, us in sorted(rows.items(), key=lambda kv: -kv[1]):
        print(f"  {group:10s} {us:6.2f} us/op")
    print("  top functions (own time, us/op):")
    for us, where in sorted(top, reverse=True)[:14]:
        print(f"    {us:6.2f}  {where}")


def _timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--iters", type=int, default=5000, help="adds per run of the dispatch loop")
    p.add_argument("--steps", type=int, default=10, help="training steps per run")
    p.add_argument("--repeats", type=int, default=3)
    args = h.parse(p, argv, iters=200, steps=1, repeats=1)
    h.require_cuda("client_profile", args.device)
    if args.device == "cpu":
        os.environ["TDMESH_DEVICE"] = "cpu"
    sys.path.insert(0, os.path.join(ROOT, "tutorials"))
    import torch

    import tdmesh

    from nanogpt import GPT, sized
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1) as mesh, mesh.activate():
        client = mesh.client
        ones = torch.ones(100, 100)

        def adds():
            x = torch.zeros(100, 100)
            for _ in range(args.iters):
                x = ones + x
            tdmesh.fetch_shard(x).result()

        profile("dispatch loop (x = ones + x)", adds, args.iters, args.repeats)
        tdmesh.random.set_manual_seed_remote(0)
        cfg, _ = sized("tiny")
        model = GPT(cfg)
        opt = train_optimizer(model.parameters(), mesh.device_type == "cuda")
        x = torch.randint(cfg.vocab_size, (8, cfg.block_size))
        y = torch.randint(cfg.vocab_size, (8, cfg.block_size))

        def steps():
            for _ in range(args.steps):
                loss = model(x, y)
                opt.zero_grad(set_to_none=False)
                loss.backward()
                tdmesh.reduce_([prm.grad for prm in model.parameters()], mesh.names, "avg")
                opt.step()
            tdmesh.fetch_shard(loss.detach()).result()

        steps()
        first = client.last_seq
        steps()
        per_step = (client.last_seq - first) / args.steps
        profile(f"tiny GPT training step ({per_step:.0f} messages per step)", steps, int(per_step * args.steps),
                args.repeats)


if __name__ == "__main__":
    main()

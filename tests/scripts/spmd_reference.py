"""The SPMD reference of tests/fleet/test_ecosystem_training.py: what every torchrun rank of a plain torch
script (no tdmesh) computes, saved per rank for the test to compare a mesh's ranks with.

    torchrun --standalone --nproc_per_node 2 tests/scripts/spmd_reference.py OUT_DIR SEED
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fleet"))
from ecosystem_models import Net, rank_values  # noqa: E402


def main() -> None:
    out, seed = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model = Net()
    draws = torch.randn(5)
    t = rank_values(seed, rank)
    reduced = {}
    for op in ("SUM", "AVG", "PRODUCT", "MIN", "MAX"):
        x = t.clone()
        if op == "AVG":  # gloo has no AVG: what NCCL's AVG gives
            dist.all_reduce(x, dist.ReduceOp.SUM)
            x /= world
        else:
            dist.all_reduce(x, getattr(dist.ReduceOp, op))
        reduced[op] = x
    b = t.clone()
    dist.broadcast(b, src=1)
    gathered = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(gathered, t)
    torch.save({"params": {k: v.detach() for k, v in model.state_dict().items()}, "draws": draws,
                "reduced": reduced, "broadcast": b, "gathered": gathered, "world": world},
               os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

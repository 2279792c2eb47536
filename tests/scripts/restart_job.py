"""A torchrun job that fails on its first run and resumes from its checkpoint on the restart.

    torchrun --standalone --nproc_per_node 2 --max-restarts 1 -m tdmesh.worker \\
        tests/scripts/restart_job.py CHECKPOINT
"""
import os
import sys

import torch

import tdmesh

checkpoint = sys.argv[1]
mesh = tdmesh.world_mesh()
restart = tdmesh.restart_count()
state = torch.load(checkpoint) if os.path.exists(checkpoint) else {"step": 0, "value": [1.0, 1.0]}
with mesh.activate():
    x = torch.tensor(state["value"])  # the checkpoint's value, on every rank
    x = x * 2
    total = x.reduce("gpu")  # a collective: every rank of the job takes part
    value = tdmesh.fetch_shard(x, host=0, gpu=1).result()
    summed = tdmesh.fetch_shard(total, host=0, gpu=0).result()
assert summed.tolist() == (value * 2).tolist(), (summed, value)
step = state["step"] + 1
if restart == 0:
    torch.save({"step": step, "value": value.tolist()}, checkpoint)
    print(f"run {restart}: step {step} value {value.tolist()}", flush=True)
    raise RuntimeError("failing the first run on purpose")
print(f"recovered on restart {restart} from step {state['step']}: value {value.tolist()}", flush=True)

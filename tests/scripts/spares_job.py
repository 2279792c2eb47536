"""A torchrun job with TDMESH_SPARES set: prints the world mesh, a reduce over it and where a remote function ran."""

import os

import torch

import tdmesh


def rank_of():
    return int(os.environ["RANK"])


mesh = tdmesh.world_mesh()
print("MESH", repr(mesh))
with mesh.activate():
    x = torch.ones(2) * (mesh.rank(("host", "gpu")) + 1)
    print("SUM", tdmesh.inspect(tdmesh.reduce(x, ("host", "gpu"))).tolist())
    print("RAN", sorted(v for _, v in tdmesh.remote(rank_of).call().get()))

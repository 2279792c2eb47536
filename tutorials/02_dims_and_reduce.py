"""Mesh dims, collectives and moving data between meshes.

    python tutorials/02_dims_and_reduce.py
    torchrun --standalone --nproc_per_node 4 -m tdmesh.worker tutorials/02_dims_and_reduce.py

Every (stream, set of dims) maps onto torch.distributed process groups (NCCL on GPUs, gloo
on CPUs), created once, the first time you reduce over those dims.
"""

import os

import torch

import tdmesh


def main(mesh: tdmesh.DeviceMesh) -> None:
    print(mesh)
    with mesh.activate():
        # a different value on every worker: 10 * host + gpu
        x = torch.ones(3) * (10 * mesh.rank("host") + mesh.rank("gpu"))

        per_host = x.reduce("gpu")                     # sum over the gpus of each host
        everywhere = x.reduce()                        # () = every dim
        gathered = x.reduce("gpu", "stack")            # [gpus, 3], in gpu order
        biggest = x.reduce("host", "max")
        print("sum over gpu on host 1:", tdmesh.fetch_shard(per_host, host=1, gpu=0).result())
        print("sum over all ranks    :", tdmesh.fetch_shard(everywhere).result())
        print("stack over gpu        :\n", tdmesh.fetch_shard(gathered, host=1, gpu=0).result())
        print("max over host         :", tdmesh.fetch_shard(biggest).result())

        # reduce-scatter: dim 0 (one row per gpu) is split over the gpu group
        rows = torch.arange(mesh.size("gpu") * 2.0).reshape(mesh.size("gpu"), 2)
        mine = rows.reduce("gpu", "sum", scatter=True)
        print("reduce-scatter, gpu 1 :", tdmesh.fetch_shard(mine, host=0, gpu=1).result())

        # move host 0's values to host 1 (dims matched by name), then compare
        host0, host1 = mesh.slice(host=0), mesh.slice(host=1)
        moved = x.slice_mesh(host=0).to_mesh(host1)
        print("host 0's x, now on host 1:", tdmesh.fetch_shard(moved, gpu=0).result())

        # a real torch.distributed ProcessGroup inside a remote function
        pg = mesh.process_group("gpu")
        summed = tdmesh.remote(all_reduce, propagate=lambda t, group: t)(x.clone(), pg)
        print("dist.all_reduce over gpu:", tdmesh.fetch_shard(summed, host=1, gpu=1).result())


def all_reduce(t, group):
    import torch.distributed as dist
    dist.all_reduce(t, group=group)
    return t


if __name__ == "__main__":
    if "RANK" in os.environ:
        main(tdmesh.world_mesh())
    else:
        with tdmesh.local_mesh(hosts=2, gpus_per_host=2) as mesh:
            main(mesh)

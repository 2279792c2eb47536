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
        last_host = mesh.size("host") - 1
        print(f"sum over gpu on host {last_host}:", tdmesh.fetch_shard(per_host, host=last_host, gpu=0).result())
        print("sum over all ranks    :", tdmesh.fetch_shard(everywhere).result())
        print("stack over gpu        :\n", tdmesh.fetch_shard(gathered, host=last_host, gpu=0).result())
        print("max over host         :", tdmesh.fetch_shard(biggest).result())

        # reduce-scatter: dim 0 (one row per gpu) is split over the gpu group
        rows = torch.arange(mesh.size("gpu") * 2.0).reshape(mesh.size("gpu"), 2)
        mine = rows.reduce("gpu", "sum", scatter=True)
        print("reduce-scatter, gpu 1 :", tdmesh.fetch_shard(mine, host=0, gpu=1).result())

        # move one host's (or, on a single host, one gpu's) values to another: dims matched by name
        dim = "host" if mesh.size("host") > 1 else "gpu"
        moved = x.slice_mesh(**{dim: 0}).to_mesh(mesh.slice(**{dim: 1}))
        other = {d: 0 for d in mesh.names if d != dim}
        print(f"{dim} 0's x, now on {dim} 1:", tdmesh.fetch_shard(moved, **other).result())

        # a real torch.distributed ProcessGroup inside a remote function
        pg = mesh.process_group("gpu")
        summed = tdmesh.remote(all_reduce, propagate=lambda t, group: t)(x.clone(), pg)
        print("dist.all_reduce over gpu:", tdmesh.fetch_shard(summed, host=last_host, gpu=1).result())


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

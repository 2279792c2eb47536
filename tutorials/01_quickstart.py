"""Quickstart: one Python program drives every worker of a mesh.

Run it on this machine (CPU workers over gloo, or one worker per GPU):
    python tutorials/01_quickstart.py
or across a torchrun job, where every rank is a worker and this script runs on rank 0:
    torchrun --standalone --nproc_per_node 2 -m tdmesh.worker tutorials/01_quickstart.py
"""

import os

import torch

import tdmesh


def checked_sqrt(t):
    """Runs on the workers; raises there when the data is wrong."""
    if (t < 0).any():
        raise IndexError(f"checked_sqrt: {int((t < 0).sum())} negative entries")
    return t.sqrt()


def main(mesh: tdmesh.DeviceMesh) -> None:
    print(mesh)                                        # names, sizes and the rank grid
    with mesh.activate():                              # torch ops now run on every worker
        x = torch.arange(6.0).reshape(2, 3)            # created on each worker, nothing waits
        y = x * (mesh.rank("gpu") + 1)                 # each worker scales by its own coordinate
        print("y:", y)                                 # a remote tensor: shape and dtype are local
        last = {d: n - 1 for d, n in mesh.sizes.items()}
        print("y on rank", last, "=\n", tdmesh.fetch_shard(y, **last).result())

        # Shape errors are caught on the client, at your line, before anything is sent.
        try:
            x @ x
        except RuntimeError as e:
            print("caught locally:", str(e).splitlines()[0])

        # Errors only the workers see fail the values that depend on them, nothing else.
        bad = tdmesh.remote(checked_sqrt, propagate=lambda t: t)(x - 3)   # negative entries
        try:
            tdmesh.fetch_shard(bad + 1).result()
        except tdmesh.RemoteException as e:
            print("remote error, reported at the fetch:", e.exc_type)
        print("unrelated values stay fetchable:", tdmesh.fetch_shard(y.sum()).result().item())


if __name__ == "__main__":
    if "RANK" in os.environ:                           # launched by torchrun -m tdmesh.worker
        main(tdmesh.world_mesh())
    else:
        with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh:
            main(mesh)

"""Remote functions, and what happens when things go wrong.

    python tutorials/04_remote_functions_and_errors.py

Any importable (or picklable) Python function can run on every worker.  ``propagate`` tells
the client what it returns without waiting: a callable on meta tensors, "inspect" for side
effects, or nothing (the function runs once for real on one rank and the answer is cached).
Errors never stop the program: they fail the values that depend on them, and surface where
you look at such a value, with your line and the worker's traceback.
"""

import os

import torch

import tdmesh


def normalize(x):
    return (x - x.mean()) / x.std()


def describe(x, mesh):
    return f"rank {mesh.rank(('host', 'gpu'))}: mean {x.mean().item():.2f} on {x.device}"


def fails_on_gpu_1(x, mesh):
    if mesh.rank("gpu") == 1:
        raise ValueError("gpu 1 refuses this input")
    return x * 2


def main(mesh: tdmesh.DeviceMesh) -> None:
    norm = tdmesh.remote(normalize)                                  # cached propagation
    with mesh.activate():
        x = torch.randn(100) * 5 + 3
        y = norm(x)
        norm(torch.randn(100))                                       # same shapes: a cache hit
        print("normalized std:", tdmesh.fetch_shard(y.std()).result().item(),
              f"(cache: {norm.cache_hits} hit, {norm.cache_misses} miss)")

        # one Python value from every rank
        for point, text in tdmesh.remote(describe).call(x, mesh).result():
            print("  ", point, "->", text)

        # a remote error: only what depends on it fails
        bad = tdmesh.remote(fails_on_gpu_1, propagate=lambda x, mesh: x * 2)(x, mesh)
        fine = x + 1
        try:
            tdmesh.fetch_shard(bad.sum()).result()                  # fails on every rank: one value
        except tdmesh.RemoteException as e:
            print("RemoteException from rank", e.rank, "->", e.exc_type + ":", e.message)
        print("unrelated value:", tdmesh.fetch_shard(fine[:3]).result())

        # misuse is caught on the client, at your line, before anything is sent
        try:
            x.view(3, 7)
        except RuntimeError as e:
            print("client-side error:", str(e).splitlines()[0][:80])
        try:
            with tdmesh.no_mesh.activate():
                local = torch.ones(100)
            x + local
        except TypeError as e:
            print("client-side error:", str(e).splitlines()[0][:80])


if __name__ == "__main__":
    if "RANK" in os.environ:
        main(tdmesh.world_mesh())
    else:
        with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh:
            main(mesh)

"""Streams and borrows: run communication beside compute.

    python tutorials/03_streams_and_overlap.py

Each stream is an ordered queue on every worker with its own thread (and its own CUDA
stream on GPUs), so work on two streams overlaps.  A tensor belongs to the stream that made
it; another stream uses it through a borrow, which orders the two streams for you.
"""

import os

import torch

import tdmesh


def main(mesh: tdmesh.DeviceMesh) -> None:
    comms = tdmesh.Stream("comms")
    with mesh.activate():
        grads = torch.ones(1000) * (mesh.rank("gpu") + 1)
        weights = torch.ones(100, 100)

        # lend the gradients to the comms stream; until the borrow is dropped, the main
        # stream may not touch them (a mutable borrow)
        g, borrow = comms.borrow(grads, mutable=True)
        with comms.activate():
            g.reduce_("gpu", "avg")                   # runs on the comms stream...
        for _ in range(10):
            weights = weights @ weights / 100         # ...while this runs on the main stream
        try:
            grads + 1
        except TypeError as e:
            print("the main stream must wait:", str(e).splitlines()[0][:70], "...")
        borrow.drop()                                 # give the gradients back
        print("averaged gradients:", tdmesh.fetch_shard(grads[:3]).result())

        # a read borrow lets both streams read, and neither write
        w, read = comms.borrow(weights)
        with comms.activate():
            norm = w.norm()
            print("norm computed on the comms stream:", tdmesh.fetch_shard(norm).result().item())
        read.drop()


if __name__ == "__main__":
    if "RANK" in os.environ:
        main(tdmesh.world_mesh())
    else:
        with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh:
            main(mesh)

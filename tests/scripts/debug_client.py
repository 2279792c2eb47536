"""A client script for the debugging tests: remote functions that stop at breakpoint().

argv[1]: "local" (a local_mesh of 2 CPU workers) or "torchrun" (tdmesh.world_mesh());
argv[2]: "both" (every rank stops; the results are fetched), "quit" (rank 1 stops, the
user quits pdb, and the script goes on with the same workers) or "slow" (rank 1 stops before
a 3 s sleep, which the user steps over, while the dashboard's JSON is read: rank 1 is in pdb).
"""
import json
import sys
import threading
import time
import urllib.request

import tdmesh


def stop_here(value):
    x = int(value) * 10 + 7
    breakpoint()
    y = x * 2
    return y


def stop_before_a_sleep(value):
    breakpoint()
    time.sleep(3)
    return int(value)


def plain(value):
    return int(value) + 100


def run(mesh, mode):
    with mesh.activate():
        ranks = mesh.process_idx()
        if mode == "slow":  # the dashboard watches meanwhile: rank 1 shows as in pdb
            states, stop = set(), threading.Event()
            url = tdmesh.dashboard(mesh=mesh)

            def watch():
                while not stop.wait(0.2):
                    view = json.loads(urllib.request.urlopen(url + "api/fleet", timeout=30).read())
                    states.add(view["ranks"][1]["state"])
            watcher = threading.Thread(target=watch)
            watcher.start()
            slow = tdmesh.remote(stop_before_a_sleep)
            print("slow", tdmesh.call_on_shard_and_fetch(slow, ranks, shard={"host": 0, "gpu": 1}).result(), flush=True)
            stop.set()
            watcher.join()
            print("the dashboard saw rank 1", sorted(states), flush=True)
        elif mode == "both":
            results = tdmesh.remote(stop_here).call(ranks).result()
            print("results", [v for _, v in results], flush=True)
        else:
            try:
                tdmesh.call_on_shard_and_fetch(tdmesh.remote(stop_here), ranks, shard={"host": 0, "gpu": 1}).result()
            except tdmesh.RemoteException as e:
                print("quit raised", type(e).__name__, "BdbQuit" in str(e), flush=True)
            after = tdmesh.call_on_shard_and_fetch(tdmesh.remote(plain), ranks, shard={"host": 0, "gpu": 1}).result()
            print("after quit", after, flush=True)


launch, mode = sys.argv[1], sys.argv[2]
if launch == "local":
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh:
        run(mesh, mode)
else:
    run(tdmesh.world_mesh(), mode)
print("script done", flush=True)

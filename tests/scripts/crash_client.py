"""A client that dies inside a ``local_mesh`` block, for tests/fleet/test_supervision.py.

    python tests/scripts/crash_client.py kill       # SIGKILLs itself: no cleanup runs at all
    python tests/scripts/crash_client.py interrupt  # raises KeyboardInterrupt inside the block
    python tests/scripts/crash_client.py wait       # computes until Ctrl-C (a SIGINT) arrives
    python tests/scripts/crash_client.py startup    # SIGKILLs itself while its workers still start

It prints ``pids P0 P1`` (its two workers' pids) once the mesh computes (``startup``: as soon
as both worker processes exist), so the test can check that every worker is gone after the
client is.
"""
import os
import signal
import sys
import threading
import time

import torch

import tdmesh

# A shell runs background jobs with SIGINT ignored, and Python then never installs its
# KeyboardInterrupt handler; this script models an interactive client, so take Ctrl-C back.
signal.signal(signal.SIGINT, signal.default_int_handler)

mode = sys.argv[1] if len(sys.argv) > 1 else "kill"


def die_while_workers_start() -> None:
    """Wait for the two worker processes to exist, then die before they can connect."""
    me = str(os.getpid())
    while True:
        children = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[1] == me:
                        children.append(int(pid))
            except (OSError, IndexError):
                pass
        if len(children) == 2:
            print("pids", *sorted(children), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.01)


if mode == "startup":
    threading.Thread(target=die_while_workers_start, daemon=True).start()
with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh, mesh.activate():
    x = torch.ones(4) * (mesh.process_idx() + 1)
    assert tdmesh.inspect(x, host=0, gpu=1).tolist() == [2.0] * 4
    print("pids", *[mesh.client.hellos[r].pid for r in sorted(mesh.client.hellos)], flush=True)
    if mode == "kill":
        for _ in range(100):  # leave work in flight
            x = x + 1
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "interrupt":
        x = x + 1
        raise KeyboardInterrupt
    elif mode == "wait":
        print("waiting for Ctrl-C", flush=True)
        while True:
            x = x + 1
            tdmesh.inspect(x, host=0, gpu=0)
            time.sleep(0.01)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
print("unreachable", flush=True)

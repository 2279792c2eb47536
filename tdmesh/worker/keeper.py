"""Under torchrun, a rank's process can keep its worker one level down, so that the worker's death heals.

torchrun's agent restarts the whole job when any of its processes fails; a healed worker must not be one of
them.  With ``TDMESH_HEALABLE`` (on by default when ``TDMESH_SPARES`` > 0) the process torchrun starts for a
rank is a keeper: it starts the rank's worker (and, on rank 0, the user's script) as children, forwards
torchrun's signals to them, and exits with the script's code (rank 0) or the worker's.  If the worker dies
while the client heals (``tdmesh.FaultTolerance`` marks the job's store), the keeper does not report the
death: it waits for the script's end (rank 0) or exits 0, and the job goes on without a restart.  The keeper
imports nothing heavy: torch only to read the store once its worker died.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

POLL = 0.1  # seconds between looks at the children


def wanted(serve: bool) -> bool:
    """Whether this torchrun process should keep its worker one level down."""
    from ..config import env_int, env_str
    if serve or env_str("TDMESH_KEPT") == "1":
        return False
    setting = env_str("TDMESH_HEALABLE")
    return setting == "1" or (setting == "auto" and env_int("TDMESH_SPARES") > 0)


def _dies_with_parent() -> None:  # in the child, before exec: the kernel kills it if the keeper dies
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def keep(script: str | None, script_args: list[str]) -> int:
    env = dict(os.environ, TDMESH_KEPT="1", TDMESH_RELAYS="0")  # a relay would die with its host's first worker
    worker = subprocess.Popen([sys.executable, "-m", "tdmesh.worker", "--kept", *([script] if script else [])],
                              env=env, preexec_fn=_dies_with_parent)  # the script: its folder goes on sys.path
    client = None
    if script and int(os.environ["RANK"]) == 0:
        client = subprocess.Popen([sys.executable, "-m", "tdmesh._script", script, *script_args],
                                  preexec_fn=_dies_with_parent)
    children = [p for p in (worker, client) if p is not None]

    def forward(signum, _frame) -> None:
        for p in children:
            if p.poll() is None:
                p.send_signal(signum)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, forward)
    worker_code = None
    while True:
        if worker_code is None and worker.poll() is not None:
            worker_code = worker.returncode
            if worker_code != 0 and not _healing():
                if client is not None:
                    client.kill()
                return 128 - worker_code if worker_code < 0 else worker_code
            if worker_code != 0:
                print(f"tdmesh keeper of rank {os.environ['RANK']}: its worker died ({worker_code}); the client "
                      f"heals the fleet, the job goes on", file=sys.stderr, flush=True)
            if client is None:
                return 0
        if client is not None and client.poll() is not None:
            code = client.returncode
            try:
                worker.wait(60 if worker_code is None else 0)
            except subprocess.TimeoutExpired:
                worker.kill()
            from .loop import say_rank_0_leaves
            code = 128 - code if code < 0 else code
            say_rank_0_leaves(code)
            return code
        time.sleep(POLL)


def _healing() -> bool:
    """Whether the client heals this job (``tdmesh.FaultTolerance`` set the key)."""
    try:
        from ..protocol.rendezvous import connect_store, job_scope
        return connect_store(timeout=10.0).check([f"{job_scope()}/healing"])
    except Exception:  # noqa: BLE001 - no store: no client to heal it
        return False

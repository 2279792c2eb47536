"""torchrun entry point: every rank runs a worker; rank 0 also runs the user's script.

    torchrun --nproc_per_node 8 -m tdmesh.worker train.py --lr 3e-4

Rank 0 starts train.py (as __main__, with its own argv) in a client process of its own
before touching CUDA, so the client never shares a GIL with worker 0 and torchelastic still
watches exactly one process per rank.  Rank 0 exits with the script's exit code; torchrun
itself exits 1 whenever a rank fails, and its root-cause summary shows rank 0's code.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import subprocess
import sys

HELP = __doc__ + """
modes:
  torchrun [flags] -m tdmesh.worker SCRIPT [ARGS...]
      a worker on every rank; SCRIPT runs on rank 0, where tdmesh.world_mesh() is the mesh
      of every rank, dims ("host", "gpu")
  torchrun [flags] -m tdmesh.worker
      attach mode: the workers wait for clients; rank 0 prints the endpoint and token for
      tdmesh.attach(endpoint, token), from a notebook or any process that reaches the store
  python -m tdmesh.worker --serve
      internal: the worker process that tdmesh.local_mesh starts (not for torchrun)

environment: TDMESH_BACKEND (nccl|gloo), TDMESH_DEVICE=cpu, TDMESH_LOG_LEVEL, TDMESH_LOG_FILE;
`kill -USR1 PID` prints a worker's stacks (every thread; to TDMESH_STACKS_DIR where set);
every TDMESH_* variable, with its default, is listed in tdmesh/config.py.
"""


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m tdmesh.worker", description=HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", action="store_true", help="internal: a tdmesh.local_mesh worker")
    parser.add_argument("--kept", action="store_true", help="internal: a torchrun rank's worker, below its keeper")
    parser.add_argument("script", nargs="?", help="the client script, run on rank 0 as __main__")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser.parse_args(argv)


def _start_client(script: str, script_args: list[str]) -> subprocess.Popen:
    """The client process (the user's script, which drives the fleet), spawned before any CUDA work."""
    return subprocess.Popen([sys.executable, "-m", "tdmesh._script", script, *script_args])


def _stacks_on_sigusr1() -> None:
    """``kill -USR1 <pid>`` writes every thread's Python stack, taken by faulthandler at the C
    level (so even while a stream thread is blocked inside an op), to stderr, or to
    ``$TDMESH_STACKS_DIR/stacks-<pid>.txt`` where that is set (the tests' time limit reads them)."""
    from ..config import env_str
    directory = env_str("TDMESH_STACKS_DIR")
    out = open(os.path.join(directory, f"stacks-{os.getpid()}.txt"), "w") if directory else sys.stderr  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=out, all_threads=True)


def main(argv=None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if "RANK" not in os.environ:
        print("tdmesh.worker must run under torchrun (or tdmesh.local_mesh):\n"
              "  torchrun --nproc_per_node 2 -m tdmesh.worker script.py", file=sys.stderr)
        return 2
    from .keeper import keep, wanted
    if wanted(args.serve):  # the worker one level below torchrun's process: its death can heal
        return keep(args.script, args.script_args)
    from torch.distributed.elastic.multiprocessing.errors import record
    return int(record(_main)(args) or 0)


def _main(args) -> int:
    if args.script:  # functions defined next to the script travel by import path
        sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
    from .loop import configure_logging, run_worker, say_rank_0_leaves
    configure_logging()
    _stacks_on_sigusr1()
    client = None
    if args.script and int(os.environ["RANK"]) == 0 and not args.kept:
        if not os.path.exists(args.script):  # rank 0 leaves at once, and torchrun ends the job
            print(f"tdmesh.worker: script {args.script!r} not found (cwd {os.getcwd()})", file=sys.stderr)
            return 2
        client = _start_client(args.script, args.script_args)
    try:
        code, clean = run_worker(attachable=not args.script and not args.serve and not args.kept)
    except KeyboardInterrupt:  # Ctrl-C reaches every process of the job: leave at once
        if client is not None:
            client.kill()
        sys.stderr.flush()
        os._exit(130)
    except BaseException:
        if client is not None:
            client.kill()
        raise
    if client is not None:
        client_code = client.wait()
        if client_code < 0:  # killed by a signal: report like a shell does
            client_code = 128 - client_code
        code = client_code
    if not args.kept:  # a keeper says it for its rank 0, with the script's code
        say_rank_0_leaves(code)  # under torchrun: the other ranks wait for it (loop.wait_for_rank_0_to_leave)
    if not clean:  # do not wait in teardown for streams stuck on dead peers
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())

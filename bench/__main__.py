"""The smoke tier in one process: ``python -m bench --smoke [NAME ...] [--json FILE]``.

Runs each bench's ``main(["--smoke"])`` in turn in this process (every bench of ``bench/`` by default), and
prints one line per bench: its exit code and seconds, and what it printed.  One process, not one per bench:
torch is imported once and the workers of a ``local_mesh`` are taken warm from the pool by the next bench
that asks for the same shape, so the tier costs its benches' own work, not 23 interpreters and fleets
(CI's budget for the whole tier is 90 s on 2 cores; tests/bench/test_smoke.py runs it).  Each bench gets
the environment it started with back, so one bench's settings never leak into the next.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import sys
import time
import traceback

from bench import helpers as h

# Modules of bench/ that are not benches, and what runs them.
NOT_BENCHES = {
    "__init__": "the package",
    "__main__": "this runner",
    "helpers": "shared pieces, imported by every bench",
    "sim_host": "a simulated host, started by bench.scale (whose smoke run prints its table (b))",
    "ddp_train": "the DDP baseline, run under torchrun by bench.train_step (whose smoke run prints its row)",
    "heal_restart_job": "bench.heal's restart-and-resume baseline, run under torchrun by bench.heal",
    "limits": "the GPU's limit (model FLOPs, the matmul peak, busy time), printed by bench.train_step on CUDA",
}


def benches() -> list[str]:
    """Every bench: the modules of bench/ that are not named in NOT_BENCHES."""
    here = os.path.dirname(os.path.abspath(__file__))
    return sorted(n[:-3] for n in os.listdir(here) if n.endswith(".py") and n[:-3] not in NOT_BENCHES)


class _Tee(io.TextIOBase):
    """What a bench prints: kept for the report, and still shown as it comes."""

    def __init__(self, stream) -> None:
        self.stream, self.kept = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def run(name: str) -> dict:
    """``bench.<name>``'s smoke run: its exit code (0, or what it exited with; 1 for an exception),
    seconds, and what it printed."""
    env = dict(os.environ)
    out, err = _Tee(sys.stdout), _Tee(sys.stderr)
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = importlib.import_module(f"bench.{name}").main(["--smoke"]) or 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            err.write(f"{e.code}\n")
    except BaseException:  # noqa: BLE001 - reported as this bench's failure; the tier goes on
        code = 1
        err.write(traceback.format_exc())
    finally:
        os.environ.clear()
        os.environ.update(env)
    return {"code": code, "seconds": time.perf_counter() - start, "stdout": out.kept.getvalue(),
            "stderr": err.kept.getvalue()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help="benches to run (default: all of bench/)")
    p.add_argument("--smoke", action="store_true", required=True, help=h.SMOKE_HELP)
    p.add_argument("--json", default="", help="also write each bench's result here")
    args = p.parse_args(argv)
    h.ensure_importable_by_workers()  # the same PYTHONPATH for every bench: warm workers fit them all
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TDMESH_DEVICE", "cpu")
    results = {}
    for name in args.names or benches():
        results[name] = run(name)
        print(f"bench.{name}: exit {results[name]['code']} in {results[name]['seconds']:.1f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    failed = [n for n, r in results.items() if r["code"] not in (0, h.NO_CUDA)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

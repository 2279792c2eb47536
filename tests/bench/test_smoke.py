"""The benches' smoke tier: every module of ``bench/`` runs in its ``--smoke`` mode (the same code
path as a real run, with few iterations at small sizes) and exits 0, or, for a bench that needs a
GPU on a host without one, with its one-line refusal (``bench.helpers.NO_CUDA``).

The list is ``bench/*.py`` itself, so a new bench is in the tier the moment it exists: a module
that is not a bench must be named in ``NOT_BENCHES`` with the bench whose smoke run runs it.
Nothing here asserts a timing; what is asserted is that each bench ran to its report."""

import os
import subprocess
import sys

import pytest
import torch

from bench.helpers import NO_CUDA

from paths import REPO

BENCH = os.path.join(REPO, "bench")
# Modules of bench/ that are not benches, and what runs them.
NOT_BENCHES = {
    "__init__": "the package",
    "helpers": "shared pieces, imported by every bench",
    "sim_host": "a simulated host, started by bench.scale (whose smoke run needs its table (b))",
    "ddp_train": "the DDP baseline, run under torchrun by bench.train_step (whose smoke run needs its row)",
}
GPU_ONLY = {"cuda_graph", "graph_profile", "result_copies"}
# A line of each bench's report: it ran to the end, not only to an exit code of 0.
REPORTS = {
    "background_threads": "neither thread", "checkpoint": "the loop with a save every", "client_profile": "tiny GPT",
    "compile_models": "compiled step ran as", "compile_time": "tdmesh inductor, 1 worker(s)",
    "dashboard": "with the page", "dispatch": "ops/s", "dispatch_floor": "GPT training step",
    "eager_bound": "workers alone", "fetch": "MiB", "grad_generator": "1x2 mesh", "hf_sweep": "rows: ",
    "idle": "the client with the mesh open", "reduce": "all_reduce", "save_cost": "plain dcp.save", "soak": "RSS",
    "scale": "(b) simulated fleet", "startup": "tdmesh warm", "train_step": "torchrun DDP", "transport": "zmq",
}
BENCHES = sorted(name[:-3] for name in os.listdir(BENCH) if name.endswith(".py") and name[:-3] not in NOT_BENCHES)


def test_every_bench_is_in_the_tier():
    """Each name above is a module of bench/ (none stale), and each bench's report is known."""
    modules = {name[:-3] for name in os.listdir(BENCH) if name.endswith(".py")}
    assert set(NOT_BENCHES) <= modules and GPU_ONLY <= modules
    assert set(BENCHES) - GPU_ONLY == set(REPORTS)


@pytest.mark.time_limit(300)
@pytest.mark.parametrize("name", BENCHES)
def test_bench_runs_in_its_smoke_mode(name):
    env = dict(os.environ, TDMESH_POOL_IDLE="0", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", f"bench.{name}", "--smoke"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=280)
    said = f"\n--- stdout ---\n{out.stdout[-4000:]}\n--- stderr ---\n{out.stderr[-4000:]}"
    if name in GPU_ONLY and not torch.cuda.is_available():
        assert out.returncode == NO_CUDA, said
        assert f"bench.{name} needs a CUDA device" in out.stderr, said
        return
    assert out.returncode == 0, said
    if name in REPORTS:
        assert REPORTS[name] in out.stdout, said

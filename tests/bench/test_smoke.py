"""The benches' smoke tier: every module of ``bench/`` runs in its ``--smoke`` mode (the same code
path as a real run, with few iterations at small sizes) and exits 0 having printed its report, or,
for a bench that needs a GPU on a host without one, exits with its one-line refusal
(``bench.helpers.NO_CUDA``).

The list is ``bench/*.py`` itself (``bench.__main__.benches``), so a new bench is in the tier the
moment it exists: a module that is not a bench must be named in ``NOT_BENCHES`` there, with what runs
it.  The benches run in one process, ``python -m bench --smoke`` (torch imported once, workers warm
from the pool): one interpreter and fleet per bench cost the tier more than its benches' own work.
Nothing here asserts a timing."""

import json
import os
import subprocess
import sys

import pytest
import torch

from bench.__main__ import NOT_BENCHES, benches
from bench.helpers import NO_CUDA

from paths import REPO

GPU_ONLY = {"cuda_graph", "graph_profile", "result_copies"}
# A line of each bench's report: it ran to the end, not only to an exit code of 0.
REPORTS = {
    "background_threads": "neither thread", "checkpoint": "the loop with a save every", "client_profile": "tiny GPT",
    "compile_models": "compiled step ran as", "compile_time": "tdmesh program , 1 worker(s)",
    "dashboard": "with the page", "dispatch": "ops/s", "dispatch_floor": "GPT training step",
    "eager_bound": "workers alone", "fetch": "MiB", "grad_generator": "1x2 mesh", "hf_sweep": "rows: ",
    "idle": "the client with the mesh open", "reduce": "all_reduce", "save_cost": "plain dcp.save", "soak": "RSS",
    "scale": "(b) simulated fleet", "startup": "tdmesh warm", "train_step": "torchrun DDP", "transport": "zmq",
    "ecosystem": "(2) GPT2LMHeadModel.from_pretrained", "heal": "heal: kill -> step running again",
}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """Each bench's result from one ``python -m bench --smoke`` run: {name: {code, seconds, stdout, stderr}}."""
    where = tmp_path_factory.mktemp("smoke") / "results.json"
    env = dict(os.environ, TDMESH_POOL_IDLE="30", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "bench", "--smoke", "--json", str(where)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=560)
    assert where.exists(), f"the smoke tier ended before writing its results:\n{out.stdout[-3000:]}\n" \
                           f"{out.stderr[-5000:]}"
    return json.loads(where.read_text())


def test_every_bench_is_in_the_tier():
    """Each name above is a module of bench/ (none stale), and each bench's report is known."""
    modules = {name[:-3] for name in os.listdir(os.path.join(REPO, "bench")) if name.endswith(".py")}
    assert set(NOT_BENCHES) <= modules and GPU_ONLY <= modules
    assert set(benches()) == modules - set(NOT_BENCHES)
    assert set(benches()) - GPU_ONLY == set(REPORTS)


@pytest.mark.time_limit(600)
@pytest.mark.parametrize("name", benches())
def test_bench_runs_in_its_smoke_mode(smoke, name):
    result = smoke[name]
    said = f"\n--- stdout ---\n{result['stdout'][-4000:]}\n--- stderr ---\n{result['stderr'][-4000:]}"
    if name in GPU_ONLY and not torch.cuda.is_available():
        assert result["code"] == NO_CUDA, said
        assert f"bench.{name} needs a CUDA device" in result["stderr"], said
        return
    assert result["code"] == 0, said
    if name in REPORTS:
        assert REPORTS[name] in result["stdout"], said

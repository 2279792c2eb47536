"""The fleet under real torchrun: standalone, two nodes through c10d, exit codes, --help."""

import os
import socket
import subprocess
import sys

import pytest

import tdmesh

from paths import SCRIPTS

SCRIPT = os.path.join(SCRIPTS, "torchrun_job.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def run(args, timeout=120, **kw):
    # rank 0 (the script) must fail first, even on a loaded machine
    env = dict(os.environ, OMP_NUM_THREADS="1", TDMESH_PEER_EXIT_DELAY="2.5")
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_help_explains_the_modes():
    out = run([sys.executable, "-m", "tdmesh.worker", "--help"])
    assert out.returncode == 0
    assert "torchrun" in out.stdout and "--serve" in out.stdout and "world_mesh" in out.stdout
    assert "``" not in out.stdout and ":func:" not in out.stdout  # terminal text, no reST markup
    assert "attach(endpoint, token)" in out.stdout and "internal" in out.stdout


def test_worker_outside_torchrun_says_how_to_launch():
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    out = subprocess.run([sys.executable, "-m", "tdmesh.worker", SCRIPT], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.returncode == 2 and "torchrun --nproc_per_node" in out.stderr


def test_world_mesh_outside_torchrun_raises_with_the_command():
    with pytest.raises(RuntimeError, match=r"torchrun --nproc_per_node N -m tdmesh.worker"):
        tdmesh.world_mesh()


def test_standalone_job_runs_the_script_on_rank_0_and_its_dashboard_shows_every_rank():
    out = run(TORCHRUN + ["--standalone", "--nproc_per_node", "2", "-m", "tdmesh.worker", SCRIPT, "dashboard"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("script done") == 1
    assert "mesh sizes {'host': 1, 'gpu': 2} argv ['dashboard'] restart 0" in out.stdout
    assert "dashboard ranks [0, 1] states ['idle', 'idle'] sampled True" in out.stdout
    assert "last rank value [2.0, 2.0]" in out.stdout


def test_script_exit_code_is_the_root_cause():
    out = run(TORCHRUN + ["--standalone", "--nproc_per_node", "2", "-m", "tdmesh.worker", SCRIPT, "exit3"])
    assert out.returncode != 0
    root = out.stderr.split("Root Cause", 1)[1]
    assert "rank      : 0" in root and "exitcode  : 3" in root


def test_script_that_raises_fails_the_job_and_is_torchruns_root_cause():
    out = run(TORCHRUN + ["--standalone", "--nproc_per_node", "2", "-m", "tdmesh.worker", SCRIPT, "raise"])
    assert out.returncode != 0
    root = out.stderr.split("Root Cause", 1)[1]
    assert "rank      : 0" in root and "ValueError: the script failed on purpose" in root
    assert "torchrun_job.py" in root and "error_file: <N/A>" not in root
    # once as the script's own traceback, once in torchrun's summary: never per worker
    assert out.stderr.count("ValueError: the script failed on purpose") == 2
    assert "last rank value [2.0, 2.0]" in out.stdout


def test_two_nodes_through_c10d_rendezvous():
    port = free_port()
    common = TORCHRUN + ["--nnodes", "2", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
                         "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"tdmesh-test-{port}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    nodes = [subprocess.Popen(common + ["--node-rank", str(i), "-m", "tdmesh.worker", SCRIPT, "ok"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(2)]
    outs = [p.communicate(timeout=180) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    stdout = outs[0][0] + outs[1][0]
    assert "mesh sizes {'host': 2, 'gpu': 2}" in stdout
    assert "last rank value [4.0, 4.0]" in stdout
    assert stdout.count("script done") == 1

"""The launch recipes that can run on one machine: run.sh (CPU mode) and multinode.sh (c10d)."""

import os
import py_compile
import socket
import subprocess

from paths import REPO as ROOT

SCRIPT = os.path.join(ROOT, "tests", "scripts", "torchrun_job.py")


def _env(**extra):
    env = dict(os.environ, TDMESH_PEER_EXIT_DELAY="0.5", **extra)
    env.pop("RANK", None)
    return env


def test_run_sh_cpu_mode_shows_rank_0_only():
    out = subprocess.run(["bash", os.path.join(ROOT, "launch", "run.sh"), SCRIPT, "ok"], capture_output=True,
                         text=True, timeout=180, cwd=ROOT, env=_env(NGPU="2", TDMESH_DEVICE="cpu"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[rank0]:script done" in out.stdout
    assert "mesh sizes {'host': 1, 'gpu': 2}" in out.stdout


def test_run_sh_usage_without_a_script():
    out = subprocess.run(["bash", os.path.join(ROOT, "launch", "run.sh")], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "usage" in out.stderr


def test_multinode_sh_two_nodes_on_one_machine():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(["bash", os.path.join(ROOT, "launch", "multinode.sh"), SCRIPT, "ok"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env=_env(NNODES="2", NODE_RANK=str(i), RDZV_ENDPOINT=f"127.0.0.1:{port}", NGPU="2",
                                       RDZV_ID=f"launch-test-{port}"))
             for i in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    stdout = outs[0][0] + outs[1][0]
    assert "mesh sizes {'host': 2, 'gpu': 2}" in stdout and "last rank value [4.0, 4.0]" in stdout


def test_other_recipes_are_well_formed():
    py_compile.compile(os.path.join(ROOT, "launch", "torchx_component.py"), doraise=True)
    for name in ("run.sh", "multinode.sh", "slurm.sbatch"):
        path = os.path.join(ROOT, "launch", name)
        assert subprocess.run(["bash", "-n", path]).returncode == 0
        assert open(path).readline().startswith("#!")
        assert "tdmesh.worker" in open(path).read()
    text = open(os.path.join(ROOT, "launch", "k8s.yaml")).read()
    assert text.startswith("# kubectl apply -f launch/k8s.yaml") and "--rdzv-backend c10d" in text
    try:
        import yaml
    except ImportError:
        return
    docs = list(yaml.safe_load_all(text))
    assert [d["kind"] for d in docs] == ["Service", "Job"]

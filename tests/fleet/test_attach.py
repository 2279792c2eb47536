"""Attach mode: torchrun without a script keeps the fleet serving; clients attach, detach,
and the next client attaches; a client that exits the mesh ends the job."""

import os
import re
import socket
import subprocess
import sys
import time

from paths import SCRIPTS

CLIENT = """
import sys, torch, tdmesh
endpoint, token, mode = sys.argv[1:4]
with tdmesh.attach(endpoint, token) as mesh:
    with mesh.activate():
        x = torch.ones(2) * mesh.process_idx()
        print("attached", mode, mesh.sizes, tdmesh.fetch_shard(x, host=0, gpu=1).result().tolist(), flush=True)
    if mode == "dashboard":  # an attached client's page: the serving fleet's ranks, sampled
        from dashboard_view import sampled_view  # tests/scripts, on PYTHONPATH
        view = sampled_view(tdmesh.dashboard(mesh=mesh))
        print("dashboard", [(r["rank"], r["state"], bool(r["rss"])) for r in view["ranks"]], flush=True)
        tdmesh.stop_dashboard()
    if mode == "end":
        mesh.exit()
    if mode == "lose":  # rank 1 dies; torchrun then stops the job
        die = tdmesh.remote("os._exit", propagate="inspect")
        with mesh.activate():
            die(9)
            try:
                tdmesh.fetch_shard(torch.ones(1), host=0, gpu=1).result(timeout=60)
            except tdmesh.DeviceException as e:
                print("lost:", e, flush=True)
"""


def _serving_fleet(tmp_path):
    log = open(tmp_path / "fleet.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             "-m", "tdmesh.worker"], stdout=log, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=tmp_path)
    deadline = time.time() + 60
    while time.time() < deadline:
        match = re.search(r"tdmesh\.attach\('([^']+)', token='([0-9a-f]+)'\)", open(tmp_path / "fleet.log").read())
        if match:
            return proc, match.group(1), match.group(2)
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the fleet never printed how to attach:\n" + open(tmp_path / "fleet.log").read())


def _client(tmp_path, *args):
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    path = os.pathsep.join(p for p in (SCRIPTS, os.environ.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=path))


def test_attach_detach_reattach_then_end_the_job(tmp_path):
    proc, endpoint, token = _serving_fleet(tmp_path)
    try:
        first = _client(tmp_path, endpoint, token, "first")
        assert first.returncode == 0, first.stderr[-2000:]
        assert "attached first {'host': 1, 'gpu': 2} [1.0, 1.0]" in first.stdout
        watched = _client(tmp_path, endpoint, token, "dashboard")
        assert watched.returncode == 0, watched.stderr[-2000:]
        assert "dashboard [(0, 'idle', True), (1, 'idle', True)]" in watched.stdout
        wrong = _client(tmp_path, endpoint, "0" * 32, "first")
        assert wrong.returncode != 0 and "PermissionError: wrong token" in wrong.stderr
        second = _client(tmp_path, endpoint, token, "end")
        assert second.returncode == 0, second.stderr[-2000:]
        assert "attached end" in second.stdout
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_lost_worker_is_named_with_its_host_and_pid(tmp_path):
    """Without a launcher to ask (attach and world_mesh), the client still names the rank,
    its host and its pid; leaving the block after catching the failure raises nothing."""
    proc, endpoint, token = _serving_fleet(tmp_path)
    try:
        out = _client(tmp_path, endpoint, token, "lose")
        assert out.returncode == 0, out.stderr[-2000:]
        assert re.search(rf"lost: worker rank [01] \(host {re.escape(socket.gethostname())}, pid \d+\) was lost",
                         out.stdout), out.stdout + out.stderr[-2000:]
        assert proc.wait(timeout=60) != 0  # torchrun reports the dead worker
    finally:
        if proc.poll() is None:
            proc.kill()

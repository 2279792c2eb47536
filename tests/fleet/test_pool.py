"""The warm pool: a clean local_mesh exit parks its workers, the next mesh of the same shape
takes them (fresh process groups, no refs, torch's state reset), other shapes and failed
fleets do not, and parked workers leave on timeout, on clear() and with the client."""
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch

import tdmesh
from tdmesh import inspect, remote
from tdmesh.fleet import pool


@pytest.fixture(autouse=True)
def warm(monkeypatch):
    monkeypatch.setenv("TDMESH_POOL_IDLE", "30")
    pool.clear()
    yield
    pool.clear()


def _pids(mesh) -> list[int]:
    return [mesh.client.hellos[r].pid for r in sorted(mesh.client.hellos)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids, within=10.0) -> list[int]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def set_state():
    torch.manual_seed(1234)
    torch.set_default_dtype(torch.float64)
    return torch.zeros(1)


def read_state():
    return torch.tensor([float(torch.initial_seed()), float(torch.get_default_dtype() == torch.float32)])


def worker_prints(text):
    print(text, flush=True)


def test_worker_output_goes_to_files_and_only_the_same_logging_setup_reuses_warm_workers(capfd):
    FILE, DEFAULT = tdmesh.LoggingLocation.FILE, tdmesh.LoggingLocation.DEFAULT
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1, logging=FILE) as mesh, mesh.activate():
        to_files = _pids(mesh)
        remote(worker_prints, propagate="inspect")("hello from a worker")
        inspect(torch.zeros(1))  # the print has run
    where = re.search(r"worker logs: (\S+)", capfd.readouterr().err)[1]
    assert where.startswith(os.path.join(tempfile.gettempdir(), "tdmesh_logs_"))
    stdout_logs = [os.path.join(d, f) for d, _, fs in os.walk(where) for f in fs if f == "stdout.log"]
    assert len(stdout_logs) == 1 and "hello from a worker" in open(stdout_logs[0]).read()
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1, logging=DEFAULT) as mesh:
        assert not set(_pids(mesh)) & set(to_files)  # workers writing to files cannot serve the terminal
    assert "worker logs: this terminal" in capfd.readouterr().err
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1, logging=FILE) as mesh:
        assert _pids(mesh) == to_files  # the same setup takes them, with the files they write to
    err = capfd.readouterr().err
    assert "from the warm pool" in err and f"worker logs: {where}" in err


def test_logging_arguments_that_contradict_are_refused():
    with pytest.raises(ValueError, match="log_dir='/tmp/unused' would not be used"):
        with tdmesh.local_mesh(logging=tdmesh.LoggingLocation.DEFAULT, log_dir="/tmp/unused"):
            pass
    with pytest.raises(TypeError, match="logging must be a tdmesh.LoggingLocation"):
        with tdmesh.local_mesh(logging="file"):
            pass


def test_the_next_mesh_of_the_same_shape_reuses_the_workers_with_a_fresh_state():
    with tdmesh.local_mesh(hosts=2, gpus_per_host=1) as mesh, mesh.activate():
        first = _pids(mesh)
        kept = torch.ones(3) * (mesh.rank("host") + 1)
        assert inspect(kept, host=1, gpu=0).tolist() == [2.0] * 3
        remote(set_state, propagate=lambda: torch.zeros(1, dtype=torch.float64))()
    assert pool.parked_count() == 1 and all(_alive(p) for p in first)
    start = time.monotonic()
    with tdmesh.local_mesh(hosts=2, gpus_per_host=1) as mesh, mesh.activate():
        assert _pids(mesh) == first
        x = torch.ones(3) * (mesh.rank("host") + 1)
        assert inspect(x.reduce("host"), host=0, gpu=0).tolist() == [3.0] * 3  # a fresh default group works
        state = inspect(remote(read_state, propagate=lambda: torch.zeros(2))(), host=1, gpu=0)
        elapsed = time.monotonic() - start
    assert state[1].item() == 1.0, "the default dtype was not reset"
    assert state[0].item() != 1234.0, "the last job's seed survived"
    assert elapsed < 5.0


def count_marked_tensors():
    import gc
    found = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.shape == (7, 7)
             and bool((o == 3.25).all())]
    return torch.tensor([float(len(found))])


def test_tensors_of_the_last_job_do_not_survive():
    count = remote(count_marked_tensors, propagate=lambda: torch.zeros(1))
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1) as mesh, mesh.activate():
        x = torch.full((7, 7), 3.25)
        assert inspect(count()).tolist() == [1.0]  # the control: the worker holds it now
        first = _pids(mesh)
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1) as mesh, mesh.activate():
        assert _pids(mesh) == first
        assert inspect(count()).tolist() == [0.0]
    del x


def test_another_shape_or_pool_false_starts_fresh_workers_and_parked_ones_stop_on_clear():
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh:
        first = _pids(mesh)
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1) as mesh:
        other = _pids(mesh)
    assert not set(other) & set(first)
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2, pool=False) as mesh:
        unpooled = _pids(mesh)
    assert not set(unpooled) & set(first)
    assert not _wait_gone(unpooled), "pool=False workers must stop with their mesh"
    assert pool.parked_count() == 2
    pool.clear()
    assert not _wait_gone(first + other)


def test_a_failed_fleet_is_not_pooled():
    with pytest.raises(tdmesh.DeviceException):
        with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh, mesh.activate():
            pids = _pids(mesh)
            os.kill(pids[1], signal.SIGKILL)
            inspect(torch.ones(2) + 1, host=0, gpu=0)
    assert pool.parked_count() == 0
    assert not _wait_gone(pids)


def test_parked_workers_leave_after_the_idle_timeout(monkeypatch):
    monkeypatch.setenv("TDMESH_POOL_IDLE", "1")
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1) as mesh:
        pids = _pids(mesh)
    assert not _wait_gone(pids, within=8.0)
    assert pool.parked_count() == 0


CLIENT = """
import sys, time, torch, tdmesh
with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh:
    print(" ".join(str(h.pid) for h in mesh.client.hellos.values()), flush=True)
print("parked", tdmesh.fleet.pool.parked_count(), flush=True)
""" + "{tail}"


@pytest.mark.parametrize("tail", ["", "import os; os._exit(0)"], ids=["atexit", "killed"])
def test_parked_workers_leave_with_their_client(tail):
    out = subprocess.run([sys.executable, "-c", CLIENT.format(tail=tail)], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, TDMESH_POOL_IDLE="60"))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[1] == "parked 1"
    assert not _wait_gone([int(p) for p in lines[0].split()], within=10.0)


def test_a_mesh_that_exits_into_the_pool_says_how_long_its_workers_stay_and_how_to_stop_them(capfd):
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1):
        pass
    err = capfd.readouterr().err
    assert re.search(r"tdmesh: 1 worker stays warm for [\d.]+ s for the next local_mesh of this shape; "
                     r"tdmesh\.pool\.clear\(\) stops it now \(TDMESH_POOL_IDLE=0 or local_mesh\(pool=False\)", err), err
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1, pool=False):
        pass
    assert "stays warm" not in capfd.readouterr().err
    pool.clear()



SLOW_TO_LEAVE = """
import os, signal, tdmesh
with tdmesh.local_mesh(hosts=1, gpus_per_host=1) as mesh:
    pids = [h.pid for h in mesh.client.hellos.values()]
os.kill(pids[0], signal.SIGSTOP)
tdmesh.pool.clear()
print(pids[0], flush=True)
"""


def test_a_parked_worker_slow_to_leave_is_stopped_without_elastics_lines():
    """A parked worker that does not leave when asked (a GPU's teardown can take seconds; here it
    is stopped with SIGSTOP) is stopped by the launcher without torch elastic's "Sending process N
    closing signal SIGTERM" and "Unable to shutdown process": stopping it is tdmesh's choice, not a
    crash to report (a user's script printed both at its exit on a GPU host)."""
    out = subprocess.run([sys.executable, "-c", SLOW_TO_LEAVE], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, TDMESH_POOL_IDLE="60"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert not _wait_gone([int(out.stdout.split()[0])])
    assert "stays warm" in out.stderr  # the script's own stderr is what is read here
    assert "closing signal" not in out.stderr and "Unable to shutdown" not in out.stderr, out.stderr


def test_torch_elastics_run_directory_goes_with_the_workers():
    """torch elastic makes a run directory at every start, even with nothing redirected (its error files):
    tdmesh makes it itself and removes it when the workers stop, at exit or when their pool lets them go
    (one directory a run piled up in /tmp: thousands after a day of tests)."""
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2, pool=False) as mesh:
        owned = mesh.fleet.processes.owned_dir
        assert owned and os.listdir(owned)  # torch's run directory is in it, not in a torchelastic_* of its own
    assert not os.path.exists(owned)
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh:
        parked = mesh.fleet.processes.owned_dir
    assert os.path.isdir(parked)  # the parked workers still use it
    pool.clear()
    assert not os.path.exists(parked)

"""The error contract's finer rules on real fleets (issue 11): failures of ops without
outputs surface at the next blocking call, once; functions of the user's script run
remotely with no NumPy warning; ValueMesh as numpy; TDMESH_LOG_FILE is the file written."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tdmesh
from tdmesh import RemoteException, fetch_shard, inspect, remote

from paths import REPO as ROOT


def fail_here(x):
    raise ValueError("no outputs, but a failure")


def the_rank(x):
    import torch.distributed as dist
    return dist.get_rank()


# ----------------------------------------------------------------------------- ops without outputs
def test_cholesky_check_raises_at_the_fetch_as_local_torch_raises(mesh1):
    with pytest.raises(Exception) as local:
        torch.linalg.cholesky(-torch.eye(2))
    with mesh1.activate():
        line = sys._getframe().f_lineno + 1
        factor = torch.linalg.cholesky(-torch.eye(2))  # linalg_cholesky_ex + _linalg_check_errors
        with pytest.raises(RemoteException) as err:
            inspect(factor)
        assert err.value.exc_type == type(local.value).__name__
        assert "positive-definite" in err.value.message
        assert any(f.lineno == line for f in err.value.call_site), err.value.call_site
        # observed now: later fetches work, and the mesh's exit has nothing left to raise
        assert inspect(torch.ones(2) + 1).tolist() == [2.0, 2.0]
        assert inspect(factor).shape == (2, 2)
    assert not mesh1.client.history.unobserved


def test_assert_async_raises_at_the_next_bool(mesh1):
    with mesh1.activate():
        zero = torch.zeros(())
        torch._assert_async(zero)  # an op with no outputs
        with pytest.raises(RemoteException, match="nonzero"):
            bool(torch.ones(()))
        assert bool(torch.ones(())) is True  # raised once
    assert not mesh1.client.history.unobserved


def test_a_side_effect_only_remote_function_raises_at_remote_call(mesh2x2):
    side_effect = remote(fail_here, propagate="inspect")
    ranks = remote(the_rank)
    with mesh2x2.activate():
        side_effect(torch.ones(1))
        with pytest.raises(RemoteException, match="no outputs, but a failure"):
            ranks.call(torch.ones(1)).result()
        values = ranks.call(torch.ones(1)).result()
    assert sorted(v for _, v in values) == [0, 1, 2, 3]
    assert not mesh2x2.client.history.unobserved


def test_a_fetch_issued_before_the_failing_op_is_not_its_observer(mesh1):
    with mesh1.activate():
        x = torch.arange(3.0)
        early = fetch_shard(x)
        torch._assert_async(torch.zeros(()))
        assert early.result().tolist() == [0.0, 1.0, 2.0]
        with pytest.raises(RemoteException, match="nonzero"):
            inspect(x)  # the first blocking call issued after the op
        assert inspect(x).tolist() == [0.0, 1.0, 2.0]


def test_any_sub_mesh_of_the_fleet_observes_it(mesh2x2):
    with mesh2x2.slice(host=0).activate():
        torch._assert_async(torch.zeros(()))
    with mesh2x2.slice(host=1).activate():
        with pytest.raises(RemoteException, match="nonzero"):
            inspect(torch.ones(1))
        assert inspect(torch.ones(1)).tolist() == [1.0]


def test_an_observed_output_less_failure_is_not_raised_at_exit():
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1) as mesh, mesh.activate():
        torch._assert_async(torch.zeros(()))
        with pytest.raises(RemoteException):
            inspect(torch.ones(1))
    # leaving the block raised nothing: the failure was observed above


def test_an_unobserved_output_less_failure_is_raised_at_exit():
    with pytest.raises(RemoteException, match="nonzero"):
        with tdmesh.local_mesh(hosts=1, gpus_per_host=1) as mesh, mesh.activate():
            torch._assert_async(torch.zeros(()))


# ----------------------------------------------------------------------------- dependencies
SCRIPT = textwrap.dedent("""
    import torch, tdmesh

    def scaled(x, k):  # defined in __main__: travels by value
        return x * k

    with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh, mesh.activate():
        f = tdmesh.remote(scaled, propagate=lambda x, k: x)
        print("value", tdmesh.fetch_shard(f(torch.ones(2), 3.0), host=0, gpu=1).result().tolist(), flush=True)
""")


def test_a_function_of_the_users_script_runs_remotely_and_no_process_warns_about_numpy(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, TDMESH_DEVICE="cpu", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                         cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "value [3.0, 3.0]" in out.stdout
    assert "Failed to initialize NumPy" not in out.stderr + out.stdout


def test_value_mesh_to_numpy(mesh2x2):
    ranks = remote(the_rank)
    pair = remote(lambda x: x * (1 + torch.distributed.get_rank()))
    odd = remote(lambda x: "even" if torch.distributed.get_rank() % 2 == 0 else 1)
    with mesh2x2.activate():
        numbers = ranks.call(torch.ones(1)).result().to_numpy()
        tensors = pair.call(torch.ones(2)).result().to_numpy()
        mixed = odd.call(torch.ones(1)).result().to_numpy()
    assert numbers.shape == (2, 2) and numbers.tolist() == [[0, 1], [2, 3]]
    assert tensors.shape == (2, 2, 2) and tensors[1, 0].tolist() == [3.0, 3.0]
    assert mixed.dtype == object and mixed.shape == (2, 2) and mixed[0, 1] == 1 and mixed[1, 0] == "even"


# ----------------------------------------------------------------------------- log files
def test_tdmesh_log_file_is_the_file_each_worker_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("TDMESH_LOG_FILE", str(tmp_path / "worker{rank}.log"))
    monkeypatch.setenv("TDMESH_LOG_LEVEL", "DEBUG")
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh:
        assert [mesh.client.hellos[r].log for r in (0, 1)] == [str(tmp_path / f"worker{r}.log") for r in (0, 1)]
        assert "worker0.log" in mesh.client.info.where_logs()
        with mesh.activate():
            with pytest.raises(RemoteException):
                inspect(remote(fail_here, propagate=lambda x: x)(torch.ones(1)))
    for r in (0, 1):
        assert "failed on worker" in (tmp_path / f"worker{r}.log").read_text()


def test_placement_errors_are_typed_with_a_code(mesh2x2):
    with mesh2x2.slice(host=0).activate():
        a = torch.ones(2)
    with mesh2x2.slice(host=1).activate():
        b = torch.ones(2)
    with pytest.raises(tdmesh.PlacementError) as err:
        a + b
    assert err.value.code == "WRONG_MESH" and isinstance(err.value, TypeError)
    a.drop()
    with pytest.raises(tdmesh.PlacementError) as err:
        a * 2
    assert err.value.code == "DROPPED"

"""Per-host relays with real workers: where frames go, what the client sees of the tree, and
failures through a relay (a killed relay host, a killed rank behind a relay, a silent one)."""
import os
import signal
import socket
import time

import pytest
import torch

import tdmesh
from tdmesh import DeviceException, fetch_shard, inspect
from tdmesh.config import SupervisionParams

HOST = socket.gethostname()
FAST = SupervisionParams(heartbeat_interval=0.5, heartbeat_timeout=3.0)


@pytest.fixture
def env(monkeypatch):
    """Environment for the workers local_mesh starts (they inherit this process's)."""
    return monkeypatch.setenv


def _pids(mesh) -> list[int]:
    return [mesh.client.hellos[r].pid for r in sorted(mesh.client.hellos)]


def _gone(pids, within: float = 10.0) -> list[int]:
    deadline = time.monotonic() + within
    left = list(pids)
    while left and time.monotonic() < deadline:
        left = [p for p in left if _alive(p)]
        time.sleep(0.05)
    return left


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def test_a_multi_host_mesh_talks_to_one_relay_per_host_and_a_frame_never_grows_with_its_ranks():
    with tdmesh.local_mesh(hosts=2, gpus_per_host=2) as mesh, mesh.activate():
        client = mesh.client
        assert client.children == [0, 2]
        assert client.relays == {0: (0, (0, 1)), 2: (1, (2, 3))}
        x = torch.arange(4.0) + mesh.rank("host") * 10 + mesh.rank("gpu")
        assert inspect(x, host=1, gpu=1).tolist() == [11.0, 12.0, 13.0, 14.0]
        # a sub-mesh's ops reach only its ranks; the others skip them
        row = mesh.slice(host=1)
        with row.activate():
            y = torch.ones(2) * 5
            assert inspect(y, gpu=0).tolist() == [5.0, 5.0]
        total = x.reduce("host")
        assert inspect(total, host=0, gpu=1).tolist() == [12.0, 14.0, 16.0, 18.0]
        client.flush()
        frames = client.outbox.frames
        with tdmesh.coalescing():  # held back until the block ends: then one flush
            for _ in range(50):
                x = x + 1
        client.flush()
        assert client.outbox.frames - frames == len(client.children)  # one frame per relay, not per rank
        assert inspect(x, host=0, gpu=0).tolist() == [50.0, 51.0, 52.0, 53.0]


def test_a_fetch_bigger_than_a_hello_frame_comes_back_through_a_relay(env):
    """A relay reads a child's first frame with a small limit; everything after may be large."""
    env("TDMESH_RELAYS", "1")  # one host: 'auto' would skip the relay where cores are few
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh, mesh.activate():
        assert mesh.client.relays
        big = torch.ones(5 * 1024 * 1024) * mesh.rank("gpu")  # 20 MiB of float32 per rank
        assert inspect(big.sum()).item() == 0.0
        back = fetch_shard(big, host=0, gpu=1).result(timeout=120)
        assert back.shape == (5 * 1024 * 1024,) and float(back.min()) == float(back.max()) == 1.0


def test_relays_off_connects_every_rank_to_the_client(env):
    env("TDMESH_RELAYS", "0")
    with tdmesh.local_mesh(hosts=2, gpus_per_host=1) as mesh, mesh.activate():
        assert mesh.client.children == [0, 1] and mesh.client.relays == {}
        assert inspect(torch.ones(2) * (mesh.rank("host") + 1), host=1, gpu=0).tolist() == [2.0, 2.0]


def test_one_host_with_fewer_cores_than_its_ranks_and_the_client_skips_its_relay(env, monkeypatch):
    """'auto' on one host: its first worker decides for the host (tdmesh.worker.loop._relay_pays) and the
    others follow it to the client.  The workers inherit this process's CPU affinity: one core here."""
    import contextlib
    import os
    cores = os.sched_getaffinity(0)
    with contextlib.ExitStack() as stack:
        os.sched_setaffinity(0, {min(cores)})
        try:
            mesh = stack.enter_context(tdmesh.local_mesh(hosts=1, gpus_per_host=2, pool=False))
        finally:
            os.sched_setaffinity(0, cores)
        stack.enter_context(mesh.activate())
        assert mesh.client.relays == {} and mesh.client.children == [0, 1]
        assert list(mesh.client.hellos) == [0, 1]  # in rank order, whichever rank connected first
        x = torch.ones(2) * mesh.rank("gpu")
        assert [inspect(x, host=0, gpu=g).tolist() for g in range(2)] == [[0.0, 0.0], [1.0, 1.0]]
    from tdmesh.worker.loop import _relay_pays
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert _relay_pays(1, 15) and not _relay_pays(1, 16) and _relay_pays(2, 64)
    env("TDMESH_RELAYS", "1")
    assert _relay_pays(1, 16)


def test_beyond_the_fanout_relays_form_a_tree(env):
    env("TDMESH_FANOUT", "2")  # 5 hosts: the client's children are 2 relays, behind which the rest connect
    with tdmesh.local_mesh(hosts=5, gpus_per_host=1) as mesh, mesh.activate():
        assert mesh.client.children == [0, 3]
        assert mesh.client.relays == {0: (0, (0, 1, 2)), 3: (3, (3, 4))}
        x = torch.ones(3) * mesh.rank("host")
        assert [inspect(x, host=h, gpu=0).tolist()[0] for h in range(5)] == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert inspect(x.reduce("host"), host=4, gpu=0).tolist() == [10.0] * 3


@pytest.mark.parametrize("victim", [2, 3], ids=["host 1's first worker, which runs its relay", "a rank behind it"])
def test_killing_a_worker_of_a_relayed_host_names_it(victim):
    with pytest.raises(DeviceException) as err:
        with tdmesh.local_mesh(hosts=2, gpus_per_host=2, supervision=FAST) as mesh, mesh.activate():
            pids = _pids(mesh)
            x = torch.ones(2) + 1
            assert inspect(x, host=1, gpu=1).tolist() == [2.0, 2.0]
            os.kill(pids[victim], signal.SIGKILL)
            start = time.monotonic()
            fetch_shard(x * 2, host=0, gpu=0).result(timeout=30)
    assert time.monotonic() - start < 5.0
    text = str(err.value)
    assert f"worker rank {victim} (host {HOST}, pid {pids[victim]}" in text and "SIGKILL" in text, text
    assert not _gone(pids), "workers outlived their fleet"


def test_a_silent_rank_behind_a_relay_is_reported_by_its_relay():
    with pytest.raises(DeviceException) as err:
        with tdmesh.local_mesh(hosts=1, gpus_per_host=2, supervision=FAST) as mesh, mesh.activate():
            pids = _pids(mesh)
            x = torch.ones(2) + 1
            assert inspect(x, host=0, gpu=1).tolist() == [2.0, 2.0]
            os.kill(pids[1], signal.SIGSTOP)  # alive, connected, silent
            start = time.monotonic()
            try:
                fetch_shard(x * 2, host=0, gpu=0).result(timeout=30)
            finally:
                elapsed = time.monotonic() - start
                os.kill(pids[1], signal.SIGCONT)
    assert elapsed < FAST.heartbeat_timeout + 3, elapsed
    text = str(err.value)
    assert "worker rank 1" in text and "heartbeat_timeout=3.0" in text, text
    assert not _gone(pids), "workers outlived their fleet"

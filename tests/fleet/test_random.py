"""tdmesh.random: seeding, saving and restoring the workers' generators (MONARCH_NOTES §5.K)."""

import pytest
import torch

import tdmesh
from tdmesh import fetch_shard, inspect
from tdmesh import random as trandom

COORDS = [(h, g) for h in range(2) for g in range(2)]


def local_rand(seed: int, n: int) -> torch.Tensor:
    """What ``torch.rand(n)`` draws right after ``torch.manual_seed(seed)``, without touching
    the client's global generator."""
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))


def every_shard(x, mesh) -> dict:
    return {(h, g): fetch_shard(x, host=h, gpu=g).result() for h, g in COORDS}


def cudnn_flags():
    return torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark


def test_same_seed_same_draws_other_seed_or_process_idx_differs(mesh1):
    with mesh1.activate():
        trandom.set_manual_seed_remote(12345)
        a = inspect(torch.rand(5))
        trandom.set_manual_seed_remote(12345)
        b = inspect(torch.rand(5))
        trandom.set_manual_seed_remote(12346)
        c = inspect(torch.rand(5))
        trandom.set_manual_seed_remote(12345, process_idx=1)
        d = inspect(torch.rand(5))
    assert torch.equal(a, b)
    assert torch.equal(a, local_rand(12345, 5))  # exactly torch's manual_seed semantics
    assert not torch.equal(a, c)
    assert not torch.equal(a, d) and torch.equal(d, local_rand(12345 ^ 1, 5))


def test_one_seed_gives_every_rank_the_same_stream(mesh2x2):
    with mesh2x2.activate():
        trandom.set_manual_seed_remote(12345)
        draws = every_shard(torch.rand(6), mesh2x2)
        # a remote process_idx gives one stream per rank: seed ^ global rank
        trandom.set_manual_seed_remote(12345, mesh2x2.process_idx())
        per_rank = every_shard(torch.rand(6), mesh2x2)
    first = draws[(0, 0)]
    assert all(torch.equal(first, v) for v in draws.values())
    for (h, g), v in per_rank.items():
        assert torch.equal(v, local_rand(12345 ^ (2 * h + g), 6))


def test_get_state_is_stable_until_a_draw_advances_it(mesh1):
    with mesh1.activate():
        trandom.set_manual_seed_remote(7)
        s1 = trandom.get_state()
        s2 = trandom.get_state()
        torch.rand(3)
        s3 = trandom.get_state()
        assert isinstance(s1, trandom.State) and type(s1.cpu) is tdmesh.Tensor and type(s1.cuda) is tdmesh.Tensor
        assert (s1.cpu.shape, s1.cpu.dtype, s1.cuda.shape, s1.cuda.dtype) == ((5056,), torch.uint8, (16,), torch.uint8)
        v1, v2, v3 = (trandom.State(*v) for v in inspect((s1, s2, s3)))  # a fetched State is a plain tuple
    assert torch.equal(v1.cpu, v2.cpu) and not torch.equal(v1.cpu, v3.cpu)
    g = torch.Generator().manual_seed(7)
    assert torch.equal(v1.cpu, g.get_state())
    assert torch.equal(v1.cuda, torch.zeros(16, dtype=torch.uint8))  # the dummy of a CPU worker


def test_set_state_replays_the_same_draws_on_every_rank(mesh2x2):
    with mesh2x2.activate():
        trandom.set_manual_seed_remote(3)
        saved = trandom.get_state()
        a = torch.rand(4)
        b = torch.rand(4)
        trandom.set_state(saved)
        c = torch.rand(4)
        got = {k: inspect((a, b, c), host=k[0], gpu=k[1]) for k in COORDS}
    for a_, b_, c_ in got.values():
        assert torch.equal(a_, c_) and not torch.equal(a_, b_)


def test_new_state_gives_reproducible_per_rank_streams(mesh2x2):
    with mesh2x2.activate():
        trandom.set_manual_seed_remote(0)
        orig = trandom.get_state()
        s1 = trandom.new_state(mesh2x2.rank(("host", "gpu")) + 4)
        s2 = trandom.new_state(mesh2x2.rank(("host", "gpu")) + 4)
        untouched = torch.rand(3)  # new_state left the current generator alone
        trandom.set_state(s1)
        x1 = torch.rand(3)
        trandom.set_state(s2)
        x2 = torch.rand(3)
        trandom.set_state(orig)
        x0 = torch.rand(3)
        stacked = [x.reduce("gpu", "stack").reduce("host", "stack") for x in (x0, x1, x2, untouched)]
        v0, v1, v2, vu = inspect(stacked)
        shards = every_shard(x1, mesh2x2)
    assert v1.shape == (2, 2, 3)
    assert torch.equal(v1, v2)
    assert torch.equal(v0, vu)
    for h, g in COORDS:
        assert not torch.equal(v1[h, g], v0[h, g])
        assert torch.equal(v1[h, g], local_rand(2 * h + g + 4, 3))
        assert torch.equal(shards[(h, g)], v1[h, g])
    rows = v1.reshape(4, 3)
    assert all(not torch.equal(rows[i], rows[j]) for i in range(4) for j in range(i + 1, 4))


def test_thin_wrappers(mesh1):
    with mesh1.activate():
        trandom.set_manual_seed_remote(11)
        saved = trandom.get_rng_state_remote()
        a = torch.rand(4)
        trandom.set_rng_state_remote(saved)
        b = torch.rand(4)
        trandom.set_manual_seed_remote(11)
        trandom.seed_remote()
        c = torch.rand(4)
        trandom.set_manual_seed_remote(11)
        trandom.random_seed_remote()
        d = torch.rand(4)
        assert saved.shape == (5056,) and saved.dtype == torch.uint8
        a, b, c, d = inspect((a, b, c, d))
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(a, d) and not torch.equal(c, d)


def test_misuse_is_reported_on_the_client(mesh1):
    with pytest.raises(ValueError, match="activate"):
        trandom.get_state()
    with mesh1.activate(), pytest.raises(TypeError, match="remote scalar tensor"):
        trandom.new_state(4)



def test_cuda_generators_of_cpu_workers_are_torchs_empty_list_and_no_ops(mesh2x2):
    with mesh2x2.activate():
        trandom.set_manual_seed_remote(21)
        trandom.cuda_manual_seed_all_remote(99)  # queued by torch until CUDA exists: the CPU stream is untouched
        after_cuda_seed = torch.rand(3)
        states = trandom.cuda_get_rng_state_all_remote()
        trandom.cuda_set_rng_state_all_remote(states)
        fetched = fetch_shard((states, after_cuda_seed), host=1, gpu=1).result()
    assert states.shape == (0, 16) and states.dtype == torch.uint8
    assert fetched[0].shape == (0, 16)
    assert torch.equal(fetched[1], local_rand(21, 3))


def test_cuda_rng_state_misuse_is_reported(mesh1):
    with mesh1.activate():
        with pytest.raises(TypeError, match=r"uint8 \[devices, 16\].*got \[16\]"):
            trandom.cuda_set_rng_state_all_remote(trandom.get_state().cuda)
        wrong_rows = torch.zeros(3, 16, dtype=torch.uint8)
        trandom.cuda_set_rng_state_all_remote(wrong_rows)
        with pytest.raises(tdmesh.RemoteException, match=r"0 CUDA devices\), got \[3, 16\]"):
            inspect(wrong_rows)

def test_make_deterministic_on_a_fresh_worker():
    # worker-global and permanent: its own fleet, not the shared session fixtures
    enabled = tdmesh.remote("torch.are_deterministic_algorithms_enabled")
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1) as mesh, mesh.activate():
        assert tdmesh.call_on_shard_and_fetch(enabled).result() is False
        trandom.make_deterministic()
        assert tdmesh.call_on_shard_and_fetch(enabled).result() is True
        env = tdmesh.call_on_shard_and_fetch(tdmesh.remote("os.getenv"), "CUBLAS_WORKSPACE_CONFIG").result()
        assert env == ":4096:8"
        assert tdmesh.call_on_shard_and_fetch(tdmesh.remote(cudnn_flags)).result() == (True, False)


@pytest.mark.gpu
def test_cuda_generators_are_seeded_saved_and_restored():
    n = min(torch.cuda.device_count(), 2)
    with tdmesh.local_mesh(hosts=1, gpus_per_host=n) as mesh, mesh.activate():
        trandom.set_manual_seed_remote(12345)
        x = torch.rand(4, device="cuda")
        same = [inspect(x, host=0, gpu=g) for g in range(n)]
        state = trandom.get_state()
        assert state.cpu.device.type == "cuda" and state.cuda.device.type == "cuda"
        a = torch.rand(4, device="cuda")
        b = torch.rand(4, device="cuda")
        trandom.set_state(state)
        c = torch.rand(4, device="cuda")
        mine = trandom.new_state(mesh.rank("gpu") + 4)
        trandom.set_state(mine)
        d = torch.rand(4, device="cuda")
        trandom.set_state(mine)
        e = torch.rand(4, device="cuda")
        fetched = [inspect((state, a, b, c, d, e), host=0, gpu=g) for g in range(n)]
    assert all(torch.equal(same[0], s) for s in same)
    for (cpu, cuda), a, b, c, d, e in fetched:
        assert cpu.shape == (5056,) and cuda.shape == (16,) and cuda.dtype == torch.uint8
        assert torch.equal(a, c) and not torch.equal(a, b)
        assert torch.equal(d, e) and not torch.equal(d, a)
    if n == 2:
        assert not torch.equal(fetched[0][4], fetched[1][4])

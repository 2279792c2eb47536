"""``tdmesh.checkpoint`` on real fleets, real files and torch's own ``torch.distributed.checkpoint``:
a training state saved from a 2x2 mesh loads back bit for bit, its replicated part loads onto a
1-rank mesh and into plain torch, an async save is a snapshot of the moment it was called, a
save cut off by a dead worker never loads, and what users already type (``torch.save``,
``dcp.save`` on the client, ``torch.load`` + ``load_state_dict`` of pretrained weights) works
or says what to use."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.utils._pytree import tree_flatten_with_path

import tdmesh
import tdmesh.checkpoint as ckpt

from paths import REPO

TUTORIAL = os.path.join(REPO, "tutorials", "08_resume.py")


def _reference() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _replicated_model(mesh) -> torch.nn.Module:
    """The reference's weights on every rank (load_state_dict of local weights ships them)."""
    weights = _reference().state_dict()  # local: made before the mesh is active
    with mesh.activate():
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        model.load_state_dict(weights)
    return model


def _step(mesh, model, opt) -> None:
    """One step on data that differs per rank, no gradient reduction: the ranks drift apart."""
    with mesh.activate():
        x = torch.ones(4, 6) * (mesh.process_idx() + 1).float()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _everywhere(mesh, tree) -> dict:
    """Every rank's value of each tensor of ``tree`` (a flat dict), fetched."""
    return {k: [v for _, v in tdmesh.fetch_all(t).result()] for k, t in tree.items()}


def _flat(sd) -> dict:
    out = {}
    for path, leaf in tree_flatten_with_path(sd)[0]:
        if type(leaf) is tdmesh.Tensor:
            out["".join(str(p) for p in path)] = leaf
    return out


def test_a_training_state_loads_back_bit_for_bit_per_rank_and_replicated(mesh2x2, tmp_path):
    model = _replicated_model(mesh2x2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _step(mesh2x2, model, opt)
    with mesh2x2.activate():
        shared = torch.arange(5.0)  # equal on every rank
        per_host = torch.ones(3) * mesh2x2.rank("host")  # equal along gpu, not along host
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "shared": shared, "per_host": per_host,
             "step": 1, "note": "first"}
    ckpt.save(state, checkpoint_id=tmp_path / "a")
    saved = _everywhere(mesh2x2, _flat(state))

    layout = json.loads((tmp_path / "a" / "tdmesh.json").read_text())
    assert layout["dims"] == {"host": 2, "gpu": 2}
    per_rank = layout["per_rank"]
    assert "['shared']" not in per_rank and per_rank["['per_host']"] == ["host"]
    assert per_rank["['model']['0.weight']"] == ["host", "gpu"]  # each rank trained on its own data
    assert ckpt.is_complete(tmp_path / "a") and ckpt.latest(tmp_path) == str(tmp_path / "a")

    _step(mesh2x2, model, opt)  # everything moves on...
    state["step"], state["note"] = 2, "second"
    with torch.no_grad():
        shared.zero_()
        per_host.zero_()
    moved = _everywhere(mesh2x2, _flat(state))
    assert not any(torch.equal(a, b) for a, b in zip(moved["['model']['0.weight']"], saved["['model']['0.weight']"]))
    ckpt.load(state, checkpoint_id=tmp_path / "a")  # ...and comes back: tensors in place, plain values set
    assert state["step"] == 1 and state["note"] == "first"
    again = _everywhere(mesh2x2, _flat(state))
    assert again.keys() == saved.keys(), set(again) ^ set(saved)
    for key in saved:
        assert all(torch.equal(a, b) for a, b in zip(again[key], saved[key])), key


def test_replicated_state_loads_onto_another_mesh_size_and_into_plain_torch(mesh2x2, mesh1, tmp_path):
    model = _replicated_model(mesh2x2)
    with mesh2x2.activate():
        per_rank = torch.ones(2) * mesh2x2.process_idx()
    ckpt.save({"model": model.state_dict(), "epoch": 3}, checkpoint_id=tmp_path / "rep")
    ckpt.save({"per_rank": per_rank}, checkpoint_id=tmp_path / "per")
    want = _reference().state_dict()

    small = _replicated_model(mesh1)
    with mesh1.activate(), torch.no_grad():
        for p in small.parameters():
            p.zero_()
    state = {"model": small.state_dict(), "epoch": 0}
    ckpt.load(state, checkpoint_id=tmp_path / "rep")
    assert state["epoch"] == 3
    for k, v in small.state_dict().items():
        assert torch.equal(tdmesh.fetch_shard(v).result(), want[k]), k

    plain = {"model": {k: torch.zeros_like(v) for k, v in want.items()}, "epoch": 0}
    dcp.load(plain, checkpoint_id=str(tmp_path / "rep"))  # this process has no process group: plain torch
    assert plain["epoch"] == 3 and all(torch.equal(plain["model"][k], want[k]) for k in want)
    dcp_to_torch_save(str(tmp_path / "per"), str(tmp_path / "per.pt"))
    stacked = torch.load(tmp_path / "per.pt")["per_rank"]
    assert torch.equal(stacked, torch.arange(4.0).view(2, 2, 1).expand(2, 2, 2))  # [host, gpu, *shape]

    with mesh1.activate():
        target = torch.zeros(2)
    with pytest.raises(tdmesh.RemoteException, match=r"saved per rank along \['host', 'gpu'\]"):
        ckpt.load({"per_rank": target}, checkpoint_id=tmp_path / "per")


def test_async_save_is_a_snapshot_of_its_call_and_resolves_its_future(mesh2x2, tmp_path):
    with mesh2x2.activate():
        value = torch.ones(1000) * mesh2x2.process_idx()
    done = ckpt.async_save({"value": value, "step": 5}, checkpoint_id=tmp_path / "async")
    with mesh2x2.activate(), torch.no_grad():
        value.add_(100)  # after the call: not in the checkpoint
        assert tdmesh.fetch_shard(value.sum()).result().item() == 100_000  # the stream went on
    assert done.result(timeout=120) is None and ckpt.is_complete(tmp_path / "async")
    state = {"value": value, "step": 0}
    ckpt.load(state, checkpoint_id=tmp_path / "async")
    assert state["step"] == 5
    assert [v[0].item() for _, v in tdmesh.fetch_all(value).result()] == [0.0, 1.0, 2.0, 3.0]


def test_a_save_cut_off_by_a_dead_worker_never_loads_and_a_new_mesh_resumes(tmp_path):
    die = tdmesh.remote("os._exit", propagate="inspect")
    with pytest.raises(tdmesh.DeviceException):
        with tdmesh.local_mesh(gpus_per_host=2, pool=False) as mesh, mesh.activate():
            big = torch.ones(8 * 1024 * 1024) * mesh.process_idx()  # 32 MiB a rank: the write takes a while
            ckpt.save({"big": big, "step": 1}, checkpoint_id=tmp_path / "step1")
            cut = ckpt.async_save({"big": big, "step": 2}, checkpoint_id=tmp_path / "step2")
            over = ckpt.async_save({"big": big, "step": 3}, checkpoint_id=tmp_path / "step1-again")
            with mesh.slice(gpu=1).activate():
                die(9)
            # the client may learn of the death first (DeviceException), or the surviving rank's gloo
            # read of its dead peer may fail the write first (a RemoteException naming that socket)
            cut_off = (tdmesh.DeviceException, tdmesh.RemoteException)
            with pytest.raises(cut_off):
                cut.result(timeout=120)
            with pytest.raises(cut_off):
                over.result(timeout=120)
            tdmesh.fetch_shard(big).result(timeout=120)  # the mesh's failure, raised here
    assert not ckpt.is_complete(tmp_path / "step2") and not ckpt.is_complete(tmp_path / "step1-again")
    assert ckpt.latest(tmp_path) == str(tmp_path / "step1")
    with tdmesh.local_mesh(gpus_per_host=2, pool=False) as mesh, mesh.activate():
        big = torch.zeros(8 * 1024 * 1024)
        state = {"big": big, "step": 0}
        with pytest.raises(tdmesh.RemoteException, match="not a complete checkpoint"):
            ckpt.load(state, checkpoint_id=tmp_path / "step2")
        ckpt.load(state, checkpoint_id=ckpt.latest(tmp_path))
        assert state["step"] == 1
        assert [v[:2].tolist() for _, v in tdmesh.fetch_all(big).result()] == [[0.0, 0.0], [1.0, 1.0]]


def test_what_users_already_type_works_or_names_tdmesh_checkpoint(mesh2x2, tmp_path):
    model = _replicated_model(mesh2x2)  # load_state_dict of local weights: shipped, bit for bit
    want = _reference().state_dict()
    torch.save(want, tmp_path / "pretrained.pt")
    with mesh2x2.activate():
        loaded = torch.load(tmp_path / "pretrained.pt", map_location="cpu")  # local tensors, as without a mesh
        assert all(type(v) is torch.Tensor for v in loaded.values())
        with torch.no_grad():
            model[0].weight.zero_()
        model.load_state_dict(loaded)
        for _, v in tdmesh.fetch_all(model[0].weight).result():
            assert torch.equal(v, want["0.weight"])
        with pytest.raises(tdmesh.UsageError, match="tdmesh.checkpoint.save"):
            torch.save(model.state_dict(), tmp_path / "x.pt")
        refused = r"cannot save mesh tensor '0.weight' from the client.*tdmesh.checkpoint"
        with pytest.raises(BaseException, match=refused):  # DCP wraps it in a CheckpointException (BaseException)
            dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "dcp"))
        with pytest.raises(TypeError, match="local tensor"):
            ckpt.save({"w": want["0.weight"]}, checkpoint_id=tmp_path / "l")


def test_get_state_dict_gives_a_fresh_optimizer_state_to_load_into(mesh2x2, tmp_path):
    model = _replicated_model(mesh2x2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    _step(mesh2x2, model, opt)
    with mesh2x2.activate():
        model_sd, optim_sd = get_state_dict(model, opt)
    ckpt.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_path / "s")
    saved = _everywhere(mesh2x2, _flat(optim_sd))

    fresh = _replicated_model(mesh2x2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.05)
    with mesh2x2.activate():  # it makes the optimizer's state (a step) to load into: on the mesh
        model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    ckpt.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_path / "s")
    got = _everywhere(mesh2x2, _flat(get_state_dict(fresh, fresh_opt)[1]))  # the optimizer's own tensors
    assert got.keys() == saved.keys()
    for key in saved:
        assert all(torch.equal(a, b) for a, b in zip(got[key], saved[key])), key


def _torchrun_resume(directory, *, die_at: int | None) -> tuple[int, str]:
    """tutorials/08_resume.py under torchrun (2 CPU ranks, 2 restarts); ``die_at``: the job's
    first run SIGKILLs its rank-1 worker after that step (in order on its stream, so the fault
    lands at that step however loaded the host is; torchrun then restarts the job)."""
    env = dict(os.environ, TDMESH_DEVICE="cpu", OMP_NUM_THREADS="1")
    fault = [] if die_at is None else ["--die-at", str(die_at)]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "--max-restarts", "2", "-m", "tdmesh.worker", TUTORIAL, "--dir", str(directory), *fault],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                          timeout=240)
    return proc.returncode, proc.stdout


def _losses(out: str) -> dict[int, str]:
    """{step: loss} of the job's last run (a restart prints its steps again from its checkpoint)."""
    found = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "step" and parts[2] == "loss":
            found[int(parts[1])] = parts[3]
    return found


def test_torchrun_restarts_the_job_after_a_worker_is_killed_and_it_resumes_bit_for_bit(tmp_path):
    rc, plain = _torchrun_resume(tmp_path / "plain", die_at=None)
    assert rc == 0, plain[-3000:]
    rc, out = _torchrun_resume(tmp_path / "killed", die_at=12)
    assert rc == 0, out[-3000:]
    # the first run killed its rank-1 worker after step 12, and torchrun restarted the job (neither torchrun's
    # log line, which names whichever failure it timed first, nor the client's error, which a SIGTERM from
    # torchrun can cut short, is certain to be printed)
    assert "after step 12: the mesh's last worker is killed" in out, out[-3000:]
    resumed = re.search(r"resumed from step-(\d+) \(restart 1\)", out)
    assert resumed, out[-3000:]
    start = int(resumed.group(1))
    assert 0 < start <= 12
    after = out[resumed.end():]
    want, got = _losses(plain), _losses(after)
    assert sorted(got) == list(range(start, 30))
    assert all(got[s] == want[s] for s in got), (got, want)  # every digit of each float: bit for bit
    final = re.search(r"final loss (\S+)", plain).group(1)
    assert re.search(r"final loss (\S+)", after).group(1) == final
    rc, again = _torchrun_resume(tmp_path / "plain", die_at=None)  # a job restarted once it was complete
    assert rc == 0, again[-3000:]
    assert "resumed from step-00030" in again and not _losses(again), again[-3000:]  # trains nothing
    assert re.search(r"final loss (\S+)", again).group(1) == final  # and reports the loss saved with its end


@pytest.mark.parametrize("kind", ["torch.save", "safetensors"])
def test_pretrained_weights_from_a_file_every_worker_reads_move_no_bytes_through_the_client(mesh2x2, tmp_path, kind):
    torch.manual_seed(1)
    ref = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 8))  # 0.5 MiB of weights
    path = tmp_path / ("weights.pt" if kind == "torch.save" else "weights.safetensors")
    if kind == "torch.save":
        torch.save(ref.state_dict(), path)
    else:
        safetensors = pytest.importorskip("safetensors.torch")
        safetensors.save_file(ref.state_dict(), str(path))
    with mesh2x2.activate():
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 8))
    outbox = mesh2x2.client.outbox
    sent = outbox.bytes_sent
    ckpt.load(model.state_dict(), checkpoint_id=path)
    assert outbox.bytes_sent - sent < 64 * 1024  # the request, not the weights (0.5 MiB to each of 4 ranks)
    for name, want in ref.state_dict().items():
        assert all(torch.equal(v, want) for _, v in tdmesh.fetch_all(model.state_dict()[name]).result()), name
    with mesh2x2.activate():
        other = torch.nn.Linear(256, 4)
    with pytest.raises(tdmesh.RemoteException, match=r"has no weight, bias .*names must be the file's"):
        ckpt.load(other.state_dict(), checkpoint_id=path)


def test_a_big_upload_is_taken_at_its_call_and_sent_once_to_each_child(mesh2x2):
    """Local weights ship through bulk frames (sent from the tensor's own memory, read in place by
    the workers): later writes to the local tensor never reach the mesh, as with torch's copy from
    pageable memory, and the bytes go once to each child of the client (a host's relay)."""
    with tdmesh.no_mesh.activate():
        local = torch.randn(3, 1 << 19)  # 6 MiB
        want = local.clone()
    outbox = mesh2x2.client.outbox
    sent = outbox.bytes_sent
    with mesh2x2.activate():
        shipped = torch.asarray(local)
        local.add_(1)
        param = torch.zeros(3, 1 << 19)
        param.copy_(local)  # what load_state_dict of local weights does
        local.add_(1)
    uploaded = outbox.bytes_sent - sent
    children = len(mesh2x2.client.conns)
    assert 2 * local.nbytes * children <= uploaded < 2 * local.nbytes * children + (64 << 10)
    for (_, a), (_, b) in zip(tdmesh.fetch_all(shipped).result(), tdmesh.fetch_all(param).result(), strict=True):
        assert torch.equal(a, want) and torch.equal(b, want + 1)


def _cached_plan_keys(_):
    """This worker's keys in DCP's plan cache (class-level, per process) that tdmesh made."""
    from torch.distributed.checkpoint.planner import SavePlanner
    return torch.tensor(len([k for k in SavePlanner._cached_final_save_plan if k.startswith("tdmesh/")]))


def test_saves_that_reuse_dcps_cached_plan_each_load_their_own_values(mesh2x2, tmp_path):
    """Repeated saves skip the plan exchange (DCP's plan cache, keyed per checkpoint group): a
    second save of the same structure, a save of the same structure on another mesh (another
    group) and a save whose structure changed must each load back as they were saved."""
    def state_of(mesh, base: float, extra: bool = False) -> dict:
        with mesh.activate():
            out = {"w": torch.ones(4) * mesh.process_idx() + base, "r": torch.arange(3.0) + base}
            if extra:
                out["extra"] = torch.full((2,), base)
        return out

    first = state_of(mesh2x2, 0.0)
    ckpt.save(first, checkpoint_id=tmp_path / "s1")
    with mesh2x2.activate(), torch.no_grad():
        first["w"].add_(10)
        first["r"].add_(10)
    ckpt.save(first, checkpoint_id=tmp_path / "s2")  # the same plan: the cached one
    keys = tdmesh.remote(_cached_plan_keys, propagate=lambda _: torch.empty((), dtype=torch.int64))
    with mesh2x2.activate():
        assert [int(v) for _, v in tdmesh.fetch_all(keys(0)).result()] == [1] * 4  # the cache is in use
    half = mesh2x2.slice(host=1)
    ckpt.save(state_of(half, 100.0), checkpoint_id=tmp_path / "s3")  # same structure, another group
    ckpt.save(state_of(mesh2x2, 200.0, extra=True), checkpoint_id=tmp_path / "s4")  # a changed plan

    def loaded(mesh, name: str, extra: bool = False) -> dict:
        target = state_of(mesh, -1.0, extra)
        ckpt.load(target, checkpoint_id=tmp_path / name)
        return {k: [v.tolist() for _, v in tdmesh.fetch_all(t).result()] for k, t in target.items()}

    assert loaded(mesh2x2, "s1") == {"w": [[float(i)] * 4 for i in range(4)], "r": [[0.0, 1.0, 2.0]] * 4}
    assert loaded(mesh2x2, "s2") == {"w": [[10.0 + i] * 4 for i in range(4)], "r": [[10.0, 11.0, 12.0]] * 4}
    assert loaded(half, "s3") == {"w": [[102.0] * 4, [103.0] * 4], "r": [[100.0, 101.0, 102.0]] * 2}  # ranks 2, 3
    assert loaded(mesh2x2, "s4", extra=True) == {"w": [[200.0 + i] * 4 for i in range(4)],
                                                 "r": [[200.0, 201.0, 202.0]] * 4, "extra": [[200.0] * 2] * 4}


_SAVES = st.lists(st.tuples(st.sets(st.sampled_from(("a", "b")), min_size=1),  # the keys saved
                            st.sampled_from(("a", "b", "ab", "")),  # which of them differ per rank
                            st.booleans(),  # on the whole mesh, or on host 1 only (another group)
                            st.integers(0, 50)), min_size=2, max_size=4)


@settings(max_examples=6, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(saves=_SAVES)
def test_drawn_sequences_of_saves_each_load_back_what_was_saved(mesh2x2, saves):
    """Hypothesis draws a sequence of saves (structures that repeat, change, per rank or not, on the
    mesh or a sub-mesh: DCP's plan cache hits and misses in orders nobody chose); each checkpoint,
    loaded afterwards into zeros, holds exactly what its save was given."""
    root = tempfile.mkdtemp(prefix="tdmesh-drawn-saves-")
    saved = []
    for n, (keys, per_rank, whole, base) in enumerate(saves):
        mesh = mesh2x2 if whole else mesh2x2.slice(host=1)
        with mesh.activate():
            state = {k: (torch.ones(3) * mesh.process_idx() if k in per_rank else torch.arange(3.0)) + base
                     for k in sorted(keys)}
        ckpt.save(state, checkpoint_id=os.path.join(root, str(n)))
        saved.append((mesh, sorted(keys), _everywhere(mesh, state)))
    for n, (mesh, keys, want) in enumerate(saved):
        with mesh.activate():
            target = {k: torch.zeros(3) for k in keys}
        ckpt.load(target, checkpoint_id=os.path.join(root, str(n)))
        got = _everywhere(mesh, target)
        assert all(torch.equal(a, b) for k in keys for a, b in zip(got[k], want[k])), (n, saves)

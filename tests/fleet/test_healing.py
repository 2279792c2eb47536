"""Healing (issue 54): a worker that dies in ``ft.step`` is replaced and the step runs again, bit for bit.

The differential test draws the faults with hypothesis — the step, the point of the step (before the
forward, in it, after the backward, between two gradient collectives, between two optimizers' updates, while
an async checkpoint is written, at the step's end), the rank, and how it dies (SIGKILL, ``os._exit``, a
segfault) — and how the job reads its loss (every step, every other or third step, never: ``ft.step``'s
lagged commit finds a fault as a later step issues a copy, at a read, or as the job ends) and how often the
workers copy the state, and compares the healed job with the same job run without faults: every loss read,
both ranks' weights and AdamW moments must be equal, with no process left behind.  ``TDMESH_HEAL_EXAMPLES``
sets the examples (3 faults each); the local soak runs it with 70 (210 faults).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from _processes import gone
from healing_job import HOWS, POINTS, STEPS, run
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import tdmesh
from tdmesh.config import env_int

EXAMPLES = env_int("TDMESH_HEAL_EXAMPLES")


@functools.lru_cache(maxsize=1)
def _reference(checkpoints: bool):
    return run((), spares=0, checkpoint_dir=_tmp("reference") if checkpoints else None)


def _tmp(name: str) -> str:
    import tempfile
    return tempfile.mkdtemp(prefix=f"tdmesh_heal_{name}_")


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _check(result, reference, faults) -> None:
    losses, weights, moments, heals, pids = result
    # a heal runs again from the window's first copy of the state: the fault's step or one before it
    assert [h.rank for h in heals] == [f[2] for f in sorted(faults)]
    assert all(h.step <= f[0] for h, f in zip(heals, sorted(faults), strict=True))
    assert [x for x in losses if x is not None] == [r for x, r in zip(losses, reference[0]) if x is not None]
    assert all(_same(w, r) for w, r in zip(weights, reference[1], strict=True))
    assert all(_same(m, r) for m, r in zip(moments, reference[2], strict=True))
    left = [pid for pid in pids if not gone(pid)]
    assert not left, f"worker processes left behind: {left}"


faults = st.lists(st.tuples(st.integers(0, STEPS - 1), st.sampled_from(POINTS), st.integers(0, 1),
                            st.sampled_from(HOWS)), min_size=3, max_size=3, unique_by=lambda f: f[0])


@pytest.mark.time_limit(max(600, 20 * EXAMPLES))  # ~8 s an example here, twice that on a busy machine
@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
          phases=(Phase.explicit, Phase.generate))  # no shrinking: each example is a fleet's run
@given(faults=faults, read_every=st.sampled_from((1, 2, 3, 0)), stash_every=st.sampled_from((1, 2, 4)))
def test_a_healed_job_ends_bit_for_bit_as_the_job_without_faults(faults, read_every, stash_every):
    directory = _tmp("drawn")
    _check(run(faults, spares=3, checkpoint_dir=directory, read_every=read_every, stash_every=stash_every),
           _reference(True), faults)


def test_with_no_spare_left_a_new_process_takes_the_dead_ones_place():
    faults = [(1, "collective", 1, "sigkill"), (3, "optimizer", 0, "exit")]
    result = run(faults, spares=1)
    _check(result, _reference(False), faults)
    assert [h.replaced_by.split(" (")[0] for h in result[3]] == ["a spare", "a new process"]


def test_more_faults_than_max_heals_raise_and_leave_nothing_running():
    pids = set()
    with pytest.raises(tdmesh.DeviceException, match="more than max_heals=0"):
        with tdmesh.local_mesh(hosts=1, gpus_per_host=2, spares=1, pool=False) as mesh, mesh.activate():
            pids.update(h.pid for h in mesh.client.hellos.values())
            w = torch.zeros(3)
            ft = tdmesh.FaultTolerance(mesh, {"w": w}, replicated="gpu", max_heals=0)
            from healing_job import die_if

            def step():
                w.add_(1)
                die_if(1, "sigkill")
            ft.step(step)
    assert all(gone(pid) for pid in pids)


def test_values_outside_the_state_are_lost_in_a_heal_and_say_so():
    from healing_job import die_if
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2, spares=1, pool=False) as mesh, mesh.activate():
        w = torch.ones(3)
        other = torch.full((2,), 5.0)
        sub = mesh.slice(gpu=1)  # made before the heal: it follows the fleet's new client
        ft = tdmesh.FaultTolerance(mesh, [w], replicated="gpu")

        def step():
            w.mul_(2)
            if not ft.heals:
                die_if(0, "sigkill")
            return w.sum()

        total = ft.step(step)
        assert tdmesh.fetch_shard(total).result().item() == 6.0
        assert torch.equal(tdmesh.fetch_shard(w, host=0, gpu=1).result(), torch.full((3,), 2.0))
        with pytest.raises(tdmesh.PlacementError, match="lost when tdmesh healed the fleet"):
            other + 1
        with pytest.raises(tdmesh.PlacementError, match="lost when tdmesh healed the fleet"):
            tdmesh.fetch_shard(other).result()
        assert len(ft.heals) == 1 and ft.heals[0].rank == 0 and "SIGKILL" in ft.heals[0].cause
        with sub.activate():
            assert tdmesh.fetch_shard(torch.arange(3.0) * 2).result().tolist() == [0.0, 2.0, 4.0]


def test_a_fault_in_the_last_step_heals_as_the_fleet_exits():
    """Nothing reads the last step's values: the fleet's exit confirms it first, heals, and exits cleanly."""
    from healing_job import die_if
    pids = set()
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2, spares=1, pool=False) as mesh, mesh.activate():
        w = torch.ones(3)
        ft = tdmesh.FaultTolerance(mesh, [w], replicated="gpu")
        pids.update(h.pid for h in mesh.client.hellos.values())

        def step(i: int):
            w.add_(i)
            if i == 2 and i not in fired:
                fired.add(i)
                die_if(1, "sigkill")
        fired: set[int] = set()
        for i in range(3):
            ft.step(step, i)
        pids.update(h.pid for h in mesh.client.hellos.values())
    assert [h.rank for h in ft.heals] == [1]
    assert all(gone(pid) for pid in pids)


def test_what_fault_tolerance_cannot_keep_is_refused_at_the_users_line():
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2, spares=1) as mesh, mesh.activate():
        w = torch.ones(4)
        with pytest.raises(tdmesh.UsageError, match="replicated="):
            tdmesh.FaultTolerance(mesh, [w])
        with pytest.raises(tdmesh.UsageError, match="has no dim 'dp'"):
            tdmesh.FaultTolerance(mesh, [w], replicated="dp")
        with pytest.raises(tdmesh.UsageError, match="shares its storage"):
            tdmesh.FaultTolerance(mesh, [w, w[:2]], replicated="gpu")
        with pytest.raises(tdmesh.UsageError, match="cannot keep state\\[0\\], a object"):
            tdmesh.FaultTolerance(mesh, [object()], replicated="gpu")
        with pytest.raises(tdmesh.UsageError, match="the mesh a launcher made"):
            tdmesh.FaultTolerance(mesh.slice(gpu=0), [w], replicated="host")
        with pytest.raises(tdmesh.UsageError, match=r"state\[0\] differs between ranks 0 and 1"):
            tdmesh.FaultTolerance(mesh, [w * mesh.rank("gpu")], replicated="gpu")
        ft = tdmesh.FaultTolerance(mesh, [w], replicated="gpu")
        with pytest.raises(tdmesh.UsageError, match="arguments hold a mesh tensor"):
            ft.step(lambda x: x, w)


def test_shrink_drops_the_dead_rank_and_the_replicas_agree_afterwards():
    from healing_job import die_if
    pids = set()
    with tdmesh.local_mesh(hosts=1, gpus_per_host=3, pool=False) as mesh, mesh.activate():
        pids.update(h.pid for h in mesh.client.hellos.values())
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ft = tdmesh.FaultTolerance(mesh, {"model": model, "opt": opt}, replicated="gpu", shrink=True)
        sizes = []

        def step(i: int):
            size = ft.mesh.size("gpu")
            sizes.append(size)
            g = torch.Generator().manual_seed(i)  # the global batch: each rank takes its share of it
            batch = torch.randn(12, 4, generator=g)
            share = 12 // size
            x = torch.stack([batch[r * share:(r + 1) * share] for r in range(size)])[ft.mesh.rank("gpu")]
            loss = model(x).pow(2).mean()
            loss.backward()
            for p in model.parameters():
                p.grad.reduce_("gpu", reduction="avg")
            if i == 2 and not ft.heals:
                die_if(1, "sigkill")
            opt.step()
            opt.zero_grad()
            return loss

        for i in range(4):
            ft.step(step, i)
        assert ft.mesh is mesh and mesh.size("gpu") == 2 and sizes[-1] == 2 and sizes[0] == 3
        assert [h.rank for h in ft.heals] == [1] and ft.heals[0].replaced_by.startswith("nothing: the mesh shrank")
        weights = [tdmesh.fetch_shard(model.weight, host=0, gpu=g).result() for g in (0, 1)]
        assert torch.equal(weights[0], weights[1])
        pids.update(h.pid for h in mesh.client.hellos.values())
    assert all(gone(pid) for pid in pids)


def test_under_torchrun_a_dead_worker_heals_without_a_restart():
    """TDMESH_SPARES=1 on 3 ranks: the last rank is a spare, outside the world mesh; each rank's worker runs
    below a keeper, so torchrun never sees rank 1's worker die; the job exits 0 on its first run, with the
    losses of the same job without the fault."""
    import runpy
    import subprocess
    import sys

    from paths import SCRIPTS
    script = os.path.join(SCRIPTS, "heal_torchrun_job.py")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3",
                          "--max-restarts", "1", "-m", "tdmesh.worker", script, "--fault"],
                         capture_output=True, text=True, timeout=180, env=dict(os.environ, TDMESH_SPARES="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    said = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh:
        losses, agree, heals = runpy.run_path(script, run_name="job")["train"](mesh, False)
    assert said["heals"] == "[(1, 2, 'a spare')]" and heals == []
    assert said["losses"] == str(losses) and agree
    assert said["restart_count"] == "0" and said["replicas"] == "agree True"
    # the spare: named in the world mesh's repr, outside the mesh (a remote function runs on ranks 0 and 1)
    assert said["MESH"] == "<DeviceMesh {host=1, gpu=2} ranks 0..1, spares 2>" and said["RAN"] == "[0, 1]"


def test_a_hung_worker_is_stopped_and_replaced():
    """A worker that stops heartbeating (SIGSTOP: alive, silent) is declared lost, SIGKILLed, and replaced."""
    import signal
    pids = set()
    quick = tdmesh.SupervisionParams(heartbeat_interval=0.3, heartbeat_timeout=2.0)
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2, spares=1, pool=False, supervision=quick) as mesh, \
            mesh.activate():
        pids.update(h.pid for h in mesh.client.hellos.values())
        w = torch.ones(3)
        ft = tdmesh.FaultTolerance(mesh, [w], replicated="gpu")
        hung = mesh.client.hellos[1].pid

        def step():
            if not ft.heals:
                os.kill(hung, signal.SIGSTOP)
            w.add_(1)
            return tdmesh.fetch_shard(w.reduce("gpu"), host=0, gpu=1).result()

        assert torch.equal(ft.step(step), torch.full((3,), 4.0))
        assert [h.rank for h in ft.heals] == [1] and "stopped heartbeating" in ft.heals[0].cause
        assert gone(hung, within=5.0)
        pids.update(h.pid for h in mesh.client.hellos.values())
    assert all(gone(pid) for pid in pids)


def _per_rank_job(checkpoint_dir: str, fault: bool) -> list:
    from healing_job import die_if
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2, spares=1, pool=False) as mesh, mesh.activate():
        torch.manual_seed(0)
        w = torch.ones(3) * (mesh.rank("gpu") + 1)  # each rank its own: no replica anywhere
        ft = tdmesh.FaultTolerance(mesh, {"w": w}, checkpoint_dir=checkpoint_dir)

        def step(i: int):
            w.mul_(1.5).add_(torch.rand(3))
            if fault and i == 2 and not ft.heals:
                die_if(1, "sigkill")

        for i in range(4):
            ft.step(step, i)
        assert len(ft.heals) == int(fault)
        return [tdmesh.fetch_shard(w, host=0, gpu=g).result() for g in (0, 1)]


def test_with_no_replica_a_new_rank_loads_the_steps_start_from_the_checkpoint(tmp_path):
    healed = _per_rank_job(str(tmp_path / "healed"), True)
    plain = _per_rank_job(str(tmp_path / "plain"), False)
    assert _same(healed, plain) and not torch.equal(healed[0], healed[1])
    assert sorted(os.listdir(tmp_path / "healed")) == ["step-00000003", "step-00000004"]

"""End-to-end: a client driving real worker processes (torch.distributed.elastic, gloo)."""

import os
import time

import pytest
import torch

import tdmesh
from tdmesh import fetch_shard, inspect, remote


def bogus_matmul(x, y):
    return x @ y  # shapes that do not fit: the worker raises here


def fail_on_gpu1(x, mesh):
    if mesh.rank("gpu") == 1:
        raise RuntimeError("fail_on_gpu1: this rank refuses")
    return x + 1


def return_exception():
    return ValueError("a value, not an error")


def scaled(x, k):
    return x * k


def add_into(x, y):
    x.add_(y)


def live_refs():
    from tdmesh.worker.builtins import live_refs as count
    return count()


def this_line() -> int:
    import inspect as pyinspect
    return pyinspect.currentframe().f_back.f_lineno


# ----------------------------------------------------------------------------- basics
def test_single_worker_ops_and_fetch(mesh1):
    with mesh1.activate():
        x = torch.ones(2, 3)
        x.sub_(1)
        y = torch.zeros(2, 3)
        z = x + y + 2
        assert isinstance(z, tdmesh.Tensor) and z.shape == (2, 3) and z.dtype == torch.float32
        value = fetch_shard(z).result()
    assert type(value) is torch.Tensor and value.device.type == "cpu"
    assert torch.equal(value, torch.full((2, 3), 2.0))


def wait_until(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_an_idle_clients_flusher_sleeps_until_something_is_queued(mesh1):
    """With nothing to send the flusher thread waits on its event (it woke every 2 ms: 2.6% of a
    core for an idle client); what a thread then leaves queued still goes out without a flush."""
    import sys
    client = mesh1.client

    def flusher_waits() -> bool:
        frame, names = sys._current_frames().get(client._flusher.ident), []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        return client._flusher_idle and names[:2] == ["wait", "wait"] and "flush_loop" in names

    with mesh1.activate():
        x = torch.zeros(3)
        wait_until(lambda: client.pending_messages() == 0)
        wait_until(flusher_waits)
        for _ in range(3):
            x = x + 1  # queued; this thread then issues nothing more
            wait_until(lambda: client.pending_messages() == 0)  # sent: by this thread or the flusher it woke
            wait_until(flusher_waits)
        value = inspect(x)
    assert torch.equal(value, torch.full((3,), 3.0))  # outside the activation: a local tensor on CUDA meshes too


def test_a_fleet_that_shares_too_few_cores_with_its_client_is_sent_work_every_5_ms(mesh1, mesh2x2):
    """The interval of timed sends follows this host's cores and the workers the Hellos place on it (on
    this suite's 2-core CI machine: 1 worker + the client fit, 4 do not)."""
    cores = len(os.sched_getaffinity(0))
    for mesh, workers in ((mesh1, 1), (mesh2x2, 4)):
        assert sum(h.hostname == mesh.client.hellos[0].hostname for h in mesh.client.hellos.values()) == workers
        assert mesh.client.flush_interval == (0.005 if workers + 1 > cores else 0.002)


def collector_settings():
    import gc
    return gc.get_threshold(), gc.get_freeze_count(), gc.isenabled()


def test_a_live_mesh_collects_garbage_less_often_and_its_workers_froze_what_they_started_with(mesh2x2):
    """tdmesh/garbage.py: the client's first threshold is raised while a mesh is live; each worker raised
    its own and froze the objects it held when its session began (its modules: some hundred thousand)."""
    import gc
    assert gc.get_threshold()[0] >= 5000
    with mesh2x2.activate():
        for h in range(2):
            for g in range(2):
                thresholds, frozen, enabled = tdmesh.call_on_shard_and_fetch(
                    remote(collector_settings), shard={"host": h, "gpu": g}).result()
                assert thresholds[0] == 5000 and enabled
                assert frozen > 10_000


def test_torch_tensor_ships_data(mesh2x2):
    with mesh2x2.activate():
        t = torch.tensor([1, 2, 4])
        got = inspect(t * 2, host=1, gpu=1)
    assert torch.equal(got, torch.tensor([2, 4, 8]))


def test_fetch_every_shard_sees_its_coordinates(mesh2x2):
    with mesh2x2.activate():
        coords = (mesh2x2.rank("host"), mesh2x2.rank("gpu"))
        combined = mesh2x2.rank(("gpu", "host"))
        for h in range(2):
            for g in range(2):
                got = fetch_shard(coords, {"host": h, "gpu": g}).result()
                assert (int(got[0]), int(got[1])) == (h, g)
                assert int(fetch_shard(combined, host=h, gpu=g).result()) == g * 2 + h
                assert int(fetch_shard(mesh2x2.process_idx(), host=h, gpu=g).result()) == 2 * h + g


def test_views_alias_and_inplace_mutation_reaches_the_base(mesh2x2):
    with mesh2x2.activate():
        base = torch.zeros(3, 4)
        row = base[1]
        col = base[:, 2]
        row.add_(5)
        col.mul_(2)
        got_base, got_row = inspect(base), inspect(row)
        assert row._r.aliases is base._r.aliases
    expected = torch.zeros(3, 4)
    expected[1] += 5
    expected[:, 2] *= 2
    assert torch.equal(got_base, expected)
    assert torch.equal(got_row, expected[1])


def test_fetching_a_view_ships_only_its_elements(mesh1):
    with mesh1.activate():
        big = torch.arange(1_000_000, dtype=torch.float32)
        small = big[10:13]
        value = fetch_shard(small).result()
    assert torch.equal(value, torch.tensor([10.0, 11.0, 12.0]))
    assert value.untyped_storage().nbytes() == 3 * 4


def test_ops_run_on_the_tensors_mesh_not_the_active_one(mesh2x2):
    host0, host1 = mesh2x2.slice(host=0), mesh2x2.slice(host=1)
    with host0.activate():
        x = torch.ones(2) * (host0.process_idx() + 1)
    with mesh2x2.activate():
        y = x * 5  # still on host0
    assert y.mesh is host0
    with host1.activate():
        z = x.cos()
    assert z.mesh is host0
    assert torch.equal(inspect(y, gpu=1), torch.full((2,), 10.0))


def test_sub_meshes_compute_independently(mesh2x2):
    results = []
    for h in range(2):
        sub = mesh2x2.slice(host=h)
        with sub.activate():
            results.append(torch.full((3,), float(h)) + sub.process_idx())
    assert torch.equal(inspect(results[0], gpu=1), torch.full((3,), 1.0))
    assert torch.equal(inspect(results[1], gpu=0), torch.full((3,), 3.0))


def test_split_and_flatten_meshes_compute(mesh2x2):
    split = mesh2x2.split(host=("oh", "ih"), ih=1)
    with split.activate():
        ones = inspect(torch.ones(3, 4), oh=1, ih=0, gpu=1)
    flat = mesh2x2.flatten("all")
    with flat.activate():
        zeros = inspect(2 * torch.zeros(3, 4), all=3)
        assert int(inspect(flat.rank("all"), all=2)) == 2
    assert torch.equal(ones, torch.ones(3, 4)) and torch.equal(zeros, torch.zeros(3, 4))


def test_many_chained_ops_then_one_fetch(mesh2x2):
    with mesh2x2.activate():
        torch.manual_seed(0)
        x = torch.zeros(4)
        for _ in range(2048):
            x = x + 1
        got = inspect(x, host=1, gpu=0)
    assert torch.equal(got, torch.full((4,), 2048.0))


def test_dead_proxies_are_deleted_on_the_workers(mesh1):
    count = remote(live_refs)
    with mesh1.activate():
        before = tdmesh.call_on_shard_and_fetch(count).result()
        xs = [torch.ones(10) for _ in range(50)]
        mid = tdmesh.call_on_shard_and_fetch(count).result()
        del xs
        after = tdmesh.call_on_shard_and_fetch(count).result()
    assert mid - before == 50
    assert after == before


def test_autograd_runs_remotely_and_matches_local(mesh2x2):
    with mesh2x2.activate():
        torch.manual_seed(3)
        w = torch.randn(4, 3).requires_grad_()
        x = torch.linspace(-1, 1, 20).reshape(5, 4)
        loss = ((x @ w).tanh() ** 2).mean()
        loss.backward()
        grad, w_value = fetch_shard((w.grad, w), host=1, gpu=1).result()
        remote_loss = inspect(loss, host=1, gpu=1)
    w_local = w_value.clone().requires_grad_()
    x_local = torch.linspace(-1, 1, 20).reshape(5, 4)
    local_loss = ((x_local @ w_local).tanh() ** 2).mean()
    local_loss.backward()
    assert torch.allclose(remote_loss, local_loss.detach())
    assert torch.allclose(grad, w_local.grad)


# ----------------------------------------------------------------------------- remote functions
def test_remote_function_with_callable_propagation(mesh2x2):
    fn = remote(scaled, propagate=lambda x, k: x * k)
    with mesh2x2.activate():
        out = fn(torch.ones(2, 2), 3)
        assert out.shape == (2, 2)
        got = inspect(out, host=0, gpu=1)
    assert torch.equal(got, torch.full((2, 2), 3.0))


def test_remote_inspect_propagation_and_mutation(mesh2x2):
    mutate = remote(add_into, propagate=add_into)  # the function itself runs on meta tensors
    with mesh2x2.activate():
        x = torch.zeros(3)
        view = x[:2]
        assert mutate(view, torch.ones(2)) is None
        got = inspect(x)
        logger = remote("builtins.print", propagate="inspect")
        assert logger("hello from every worker") is None
    assert torch.equal(got, torch.tensor([1.0, 1.0, 0.0]))


def test_call_on_shard_and_fetch(mesh2x2):
    with mesh2x2.activate():
        assert tdmesh.call_on_shard_and_fetch(remote("os.path.split"), "/fbs/fbc/foo/bar").result() == (
            "/fbs/fbc/foo", "bar")
        value = tdmesh.call_on_shard_and_fetch(remote(return_exception)).result()
    assert isinstance(value, ValueError) and str(value) == "a value, not an error"


def test_pickled_closures_run_remotely(mesh1):
    k = 7
    fn = remote(lambda x: x + k, propagate=lambda x: x)
    with mesh1.activate():
        got = inspect(fn(torch.zeros(2)))
    assert torch.equal(got, torch.full((2,), 7.0))


def test_future_timeout_is_retryable(mesh1):
    sleep = remote("time.sleep", propagate="inspect")
    with mesh1.activate():
        sleep(5.0)  # a margin: a client starved of its core for a second on a busy CI host still times out
        fut = fetch_shard(torch.ones(1))
        with pytest.raises(TimeoutError):
            fut.result(timeout=0.05)
        assert not fut.done()
        seen = []
        fut.add_callback(lambda f: seen.append(f))
        got = fut.result(timeout=30)
        assert fut.done() and fut.exception() is None and seen == [fut]
    assert torch.equal(got, torch.ones(1))


# ----------------------------------------------------------------------------- errors
def test_client_side_errors_raise_at_the_users_line(mesh2x2):
    local = torch.ones(2)
    host0 = mesh2x2.slice(host=0)
    with mesh2x2.activate():
        remote_t = torch.ones(2)
        with pytest.raises(TypeError, match="LOCAL_TENSOR") as info:
            line = this_line(); remote_t + local  # noqa: E702
        assert f"line {line}" in str(info.value) and os.path.basename(__file__) in str(info.value)
        with host0.activate():
            other = torch.ones(2)
        with pytest.raises(TypeError, match="WRONG_MESH"):
            remote_t + other
        x = torch.ones(3, 4)
        with pytest.raises(RuntimeError, match=r"a and b must have same reduction dim") as info:
            line = this_line(); x @ x  # noqa: E702
        assert f"line {line}" in str(info.value)
        # a Python value the client needs now is fetched (blocking) from the first rank
        assert remote_t.sum().item() == 2.0 and bool(remote_t.sum() > 1)


def test_the_ops_backward_runs_name_the_backward_call_and_a_hooks_ops_name_the_hook(mesh1):
    """Every op autograd's engine runs for ``loss.backward()`` or ``torch.autograd.grad`` is recorded at
    that call's line (the site errors name); ops a hook issues inside backward, at the hook's line."""
    from _sites import recorded_sites

    from tdmesh.errors import backward_sites
    hook_line = this_line() + 3

    def hook(p):
        p.grad.mul_(2)
    with mesh1.activate():
        w = torch.ones(3, requires_grad=True)
        w.register_post_accumulate_grad_hook(hook)
        loss = (w * 2).sin().sum() * w.cos().sum()
        with recorded_sites(mesh1.client) as sites:
            backward_line = this_line(); loss.backward(retain_graph=True)  # noqa: E702
            after_backward = list(sites)
            del sites[:]
            grad_line = this_line(); (g,) = torch.autograd.grad(loss, [w])  # noqa: E702
        got = inspect((w.grad, g))
    here = os.path.basename(__file__)
    assert len(after_backward) > 10 and sites and not backward_sites
    assert {f"line {backward_line}" in s or f"line {hook_line}" in s for s in after_backward} == {True}
    assert sum(f"line {hook_line}" in s for s in after_backward) == 1 and all(here in s for s in after_backward)
    assert all(f"line {grad_line}" in s and here in s for s in sites)
    local = torch.ones(3, requires_grad=True)
    (expected,) = torch.autograd.grad((local * 2).sin().sum() * local.cos().sum(), [local])
    assert torch.allclose(got[1], expected) and torch.allclose(got[0], 2 * expected)


def test_dropped_tensor_names_where_it_was_dropped(mesh2x2):
    with mesh2x2.activate():
        x = torch.ones(4)
        view = x[:2]
        drop_line = this_line(); x.drop()  # noqa: E702
        assert x.dropped and view.dropped
        with pytest.raises(TypeError, match=rf"DROPPED: tensor {view.ref} is dropped at:(.|\n)*line {drop_line}"):
            view + 1


def test_remote_error_fails_dependents_only(mesh2x2):
    bogus = remote(bogus_matmul, propagate=lambda x, y: torch.empty(3, 3))
    with mesh2x2.activate():
        x = torch.ones(3, 4)
        y = torch.ones(3, 4)
        line = this_line(); z = bogus(x, y)  # noqa: E702
        a = z + x[:, :3]
        b = x + y
        with pytest.raises(tdmesh.RemoteException) as info:
            fetch_shard(a).result()
        text = str(info.value)
        assert "bogus_matmul" in text and f"on rank {info.value.rank}" in text and f"line {line}" in text
        assert info.value.rank in range(4)
        assert "mat1 and mat2 shapes cannot be multiplied" in text
        assert info.value.exc_type == "RuntimeError"
        got_b = fetch_shard(b, host=1, gpu=1).result()
        # the error is reported once: a second dependent fetch carries the same root
        with pytest.raises(tdmesh.RemoteException) as again:
            fetch_shard(z, host=1, gpu=0).result()
        assert again.value.seq == info.value.seq
    assert torch.equal(got_b, torch.full((3, 4), 2.0))


def test_failure_on_one_rank_poisons_the_value_everywhere(mesh2x2):
    fn = remote(fail_on_gpu1, propagate=lambda x, mesh: x + 1)
    with mesh2x2.activate():
        x = torch.ones(2)
        z = fn(x, mesh2x2)
        with pytest.raises(tdmesh.RemoteException, match="this rank refuses") as info:
            fetch_shard(z * 2, host=0, gpu=0).result()
        assert info.value.rank in (1, 3)
        got = fetch_shard(2 * x, host=0, gpu=1).result()
    assert torch.equal(got, torch.full((2,), 2.0))


def test_fetch_shard_argument_errors(mesh2x2):
    with mesh2x2.activate():
        x = torch.ones(1)
        with pytest.raises(ValueError, match=r"Missing key.*\['gpu'\]"):
            fetch_shard(x, host=0)
        with pytest.raises(KeyError, match="zone"):
            fetch_shard(x, host=0, gpu=0, zone=1)
        got = fetch_shard(x, {"host": 1}, gpu=1).result()
    assert torch.equal(got, torch.ones(1))


def test_no_mesh_runs_local_ops_locally(mesh2x2):
    with mesh2x2.activate():
        r = torch.ones(2)
        value = fetch_shard(r).result()
        with tdmesh.no_mesh.activate():
            local = torch.ones(2) + value
        assert type(local) is torch.Tensor
    assert torch.equal(local, torch.full((2,), 2.0))
    with pytest.raises(ValueError, match="no device mesh is active"):
        tdmesh.get_active_mesh()


def test_activation_nests_and_takes_effect_on_call(mesh2x2):
    host1 = mesh2x2.slice(host=1)
    outer = mesh2x2.activate()
    try:
        assert tdmesh.get_active_mesh() is mesh2x2
        with host1.activate():
            assert tdmesh.get_active_mesh() is host1
        assert tdmesh.get_active_mesh() is mesh2x2
    finally:
        outer.deactivate()
    with pytest.raises(ValueError):
        tdmesh.get_active_mesh()



def test_deactivate_ends_a_plain_activate_and_refuses_a_mesh_that_is_not_active(mesh2x2):
    host1 = mesh2x2.slice(host=1)
    with pytest.raises(RuntimeError, match=r"is not the active mesh \(no mesh is active\)"):
        mesh2x2.deactivate()
    mesh2x2.activate()
    host1.activate()
    try:
        assert type(torch.ones(1)) is tdmesh.Tensor
        with pytest.raises(tdmesh.TdmeshError, match=r"\(the active mesh is <DeviceMesh \{gpu=2\} ranks 2..3>\)"):
            mesh2x2.deactivate()
        host1.deactivate()
        assert tdmesh.get_active_mesh() is mesh2x2
    finally:
        mesh2x2.deactivate()
    assert type(torch.ones(1)) is torch.Tensor  # the dispatch mode is gone with the last activation
    with pytest.raises(ValueError, match="no device mesh is active"):
        tdmesh.get_active_mesh()
    with mesh2x2.activate():
        mesh2x2.deactivate()  # inside a with: its exit then has nothing left to end
        with pytest.raises(ValueError, match="no device mesh is active"):
            tdmesh.get_active_mesh()
    with pytest.raises(ValueError, match="no device mesh is active"):
        tdmesh.get_active_mesh()

# ----------------------------------------------------------------------------- lifecycle
def test_unobserved_error_is_raised_when_the_mesh_exits():
    bogus = remote(bogus_matmul, propagate=lambda x, y: torch.empty(3, 3))
    with pytest.raises(tdmesh.RemoteException, match="bogus_matmul"):
        with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh, mesh.activate():
            bogus(torch.ones(3, 4), torch.ones(3, 4))


def test_exit_is_idempotent_and_leaves_no_process(tmp_path, capfd):
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2, log_dir=str(tmp_path), pool=False) as mesh:
        pids = [h.pid for h in mesh.client.hellos.values()]
        with mesh.activate():
            got = inspect(torch.ones(1))
        assert torch.equal(got, torch.ones(1))
        mesh.exit()
        mesh.exit()
        with pytest.raises(RuntimeError, match="exited"):
            with mesh.activate():
                torch.ones(1)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    err = capfd.readouterr().err
    assert "2 CPU workers" in err and str(tmp_path) in err
    logs = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs]
    assert sum(name.endswith("stderr.log") for name in logs) >= 2


def test_client_exception_shuts_the_fleet_down():
    with pytest.raises(KeyError, match="boom"):
        with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh:
            pids = [h.pid for h in mesh.client.hellos.values()]
            raise KeyError("boom")
    deadline = time.time() + 10
    while time.time() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            break
        time.sleep(0.1)
    assert not alive


def test_local_meshes_are_independent_fleets():
    with tdmesh.local_meshes(meshes=2, hosts_per_mesh=1, gpus_per_host=1) as (m0, m1):
        assert m0.client is not m1.client
        with m0.activate():
            a = torch.ones(2)
        with m1.activate():
            b = torch.full((2,), 3.0)
            with pytest.raises(TypeError, match="WRONG_MESH"):
                a + b
        got = (fetch_shard(a).result(), fetch_shard(b).result())
    assert torch.equal(got[0], torch.ones(2)) and torch.equal(got[1], torch.full((2,), 3.0))

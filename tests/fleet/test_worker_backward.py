"""``loss.backward()`` run by the workers' own autograd (``TDMESH_BACKWARD=auto``, the default):
one message instead of one per backward op, the same gradients as torch's engine on the client,
and every case the workers cannot run exactly (hooks, custom Functions, ``retain_grad``,
checkpointing, ``create_graph``) left to the client's engine, as before."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.checkpoint import checkpoint

import tdmesh
from tdmesh import fetch_shard
from tdmesh.engine import backward as worker_backward


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.GELU(), torch.nn.Linear(8, 3))


def _where(fn):
    """``fn()``'s result and where its backward calls ran: (on the workers, on the client)."""
    before = dict(worker_backward.COUNTS)
    out = fn()
    counts = worker_backward.COUNTS
    return out, (counts["workers"] - before["workers"], counts["client"] - before["client"])


def _grads(model):
    return fetch_shard([p.grad for p in model.parameters()]).result()


def _local(model):
    """The same model on the client, with the mesh model's current parameters."""
    local = _model()
    with torch.no_grad():
        for p, v in zip(local.parameters(), fetch_shard([p.detach() for p in model.parameters()]).result()):
            p.copy_(v)
    return local


def test_a_backward_is_one_message_and_gives_torchs_gradients(mesh2x2, monkeypatch):
    with mesh2x2.activate():
        model = _model()
        x = torch.randn(5, 6)
        loss = F.mse_loss(model(x), torch.zeros(5, 3))
        first = mesh2x2.client.last_seq
        _, (workers, client) = _where(loss.backward)
        assert (workers, client, mesh2x2.client.last_seq - first) == (1, 0, 1)
        assert all(type(p.grad) is tdmesh.Tensor and p.grad.shape == p.shape for p in model.parameters())
        got = _grads(model)
        monkeypatch.setenv("TDMESH_BACKWARD", "client")
        for p in model.parameters():
            p.grad = None
        loss = F.mse_loss(model(x), torch.zeros(5, 3))
        _, where = _where(loss.backward)
        assert where == (0, 1)
        want = _grads(model)
        local_x = fetch_shard(x).result()
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    local = _local(model)
    F.mse_loss(local(local_x), torch.zeros(5, 3)).backward()
    for a, p in zip(got, local.parameters()):
        torch.testing.assert_close(a, p.grad)


def test_gradients_accumulate_and_set_to_none_starts_again(mesh2x2):
    with mesh2x2.activate():
        model = _model()
        x = torch.randn(4, 6)
        model(x).sum().backward()
        once = _grads(model)
        grads = [p.grad for p in model.parameters()]
        (model(x) * 2).sum().backward()  # accumulates into the same gradients, as torch's engine does
        assert all(p.grad is g for p, g in zip(model.parameters(), grads))
        thrice = _grads(model)
        model.zero_grad()  # set_to_none
        (model(x) * 3).sum().backward()
        fresh = _grads(model)
    for a, b, c in zip(once, thrice, fresh):
        torch.testing.assert_close(b, 3 * a)
        torch.testing.assert_close(c, 3 * a)


def test_a_second_backward_raises_torchs_error_at_once_and_retain_graph_allows_it(mesh2x2):
    with mesh2x2.activate():
        model = _model()
        loss = model(torch.randn(4, 6)).square().mean()
        loss.backward(retain_graph=True)
        _, where = _where(loss.backward)
        assert where == (1, 0)
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            loss.backward()
        twice = _grads(model)
        model.zero_grad()
        loss = model(torch.randn(4, 6)).square().mean()
        assert all(torch.isfinite(g).all() for g in twice)


def test_frozen_parameters_get_no_gradient(mesh2x2):
    with mesh2x2.activate():
        model = _model()
        model[0].requires_grad_(False)
        _, where = _where(lambda: model(torch.randn(4, 6)).sum().backward())
        assert where == (1, 0)
        assert model[0].weight.grad is None and model[3].weight.grad is not None
        model[0].requires_grad_(True)  # mirrored back: the next backward reaches it on the workers
        _, where = _where(lambda: model(torch.randn(4, 6)).sum().backward())
        assert where == (1, 0) and model[0].weight.grad is not None
        assert fetch_shard(model[0].weight.grad).result().abs().sum() > 0


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def _hooked(model, x):
    seen = []
    h = model[0](x)
    h.register_hook(lambda g: seen.append(g.shape) or g * 0.5)
    return model[3](model[2](model[1](h))).sum(), seen


@pytest.mark.parametrize("case", ["custom_function", "tensor_hook", "retain_grad", "checkpoint", "leaf_hook",
                                  "module_hook", "create_graph", "inputs"])
def test_what_the_workers_cannot_run_runs_on_the_clients_engine_with_the_same_gradients(mesh2x2, monkeypatch, case):
    def step(model, x):
        seen: list = []
        if case == "custom_function":
            loss = _Twice.apply(model(x)).sum()
        elif case == "tensor_hook":
            loss, seen = _hooked(model, x)
        elif case == "retain_grad":
            h = model[0](x)
            h.retain_grad()
            loss = model[3](model[2](model[1](h))).sum()
            seen.append(h)
        elif case == "checkpoint":
            loss = checkpoint(model, x, use_reentrant=False).sum()
        elif case == "leaf_hook":
            model[3].bias.register_hook(lambda g: g * 3)
            loss = model(x).sum()
        elif case == "module_hook":  # torch wraps the module's inputs and outputs in a custom Function
            model[2].register_full_backward_hook(lambda m, grad_in, grad_out: (grad_in[0] * 0.5,))
            loss = model(x).sum()
        else:
            loss = model(x).square().sum()
        if case == "create_graph":
            loss.backward(create_graph=True)
        elif case == "inputs":
            loss.backward(inputs=list(model.parameters()))
        else:
            loss.backward()
        return seen

    with mesh2x2.activate():
        model = _model()
        x = torch.randn(4, 6)
        seen, where = _where(lambda: step(model, x))
        assert where == (0, 1)
        got = [g.detach() for g in _grads(model)]
        if case == "retain_grad":
            assert fetch_shard(seen[0].grad).result().shape == (4, 8)
        if case == "tensor_hook":
            assert seen == [torch.Size([4, 8])]
        monkeypatch.setenv("TDMESH_BACKWARD", "client")
        other = _model()
        for p in other.parameters():
            p.requires_grad_(True)
        with torch.no_grad():
            for p, q in zip(other.parameters(), model.parameters()):
                p.copy_(q)
        step(other, x)
        want = [g.detach() for g in _grads(other)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_the_workers_free_what_the_graph_saved_when_their_backward_ran(mesh2x2):
    """As torch's engine frees a graph's saved tensors as it runs it: with the loss still held after
    its backward, the workers hold only the loss beyond the model, its gradients and the batch."""
    live = tdmesh.remote("tdmesh.worker.builtins.live_refs")
    with mesh2x2.activate():
        model = _model()
        x = torch.randn(4, 6)
        model(x).square().mean().backward()  # the gradients exist from here on
        before = tdmesh.call_on_shard_and_fetch(live).result()
        loss = model(x).square().mean()
        during = tdmesh.call_on_shard_and_fetch(live).result()
        _, where = _where(loss.backward)
        after = tdmesh.call_on_shard_and_fetch(live).result()
    assert where == (1, 0)
    assert during >= before + 6  # the forward's saved activations...
    assert after == before + 1  # ...freed by the workers' backward: the loss is all that is left


def test_a_failure_in_the_forward_poisons_the_gradients_and_nothing_else(mesh2x2):
    chol = tdmesh.remote(torch.linalg.cholesky, propagate=lambda a: a)
    with mesh2x2.activate():
        w = torch.eye(2).requires_grad_()
        ok = torch.ones(2, requires_grad=True)
        bad = chol(-torch.eye(2))
        loss = (w * bad).sum() + ok.sum()
        loss.backward()
        with pytest.raises(tdmesh.RemoteException, match="cholesky|positive-definite"):
            fetch_shard(w.grad).result()
        assert fetch_shard(torch.ones(1)).result().tolist() == [1.0]


def test_a_remote_functions_result_carries_no_gradient_on_the_workers(mesh2x2):
    """As its proxy on the client: a value computed from a parameter by a remote function is a
    constant to the graph the client recorded, and so it is to the workers' copy."""
    double = tdmesh.remote(lambda p: p * 2, propagate=lambda p: torch.empty_like(p))
    with mesh2x2.activate():
        p = torch.ones(3).requires_grad_()
        c = double(p)
        assert not c.requires_grad
        _, where = _where(lambda: (p * c).sum().backward())
        assert where == (1, 0)
        assert fetch_shard(p.grad).result().tolist() == [2.0, 2.0, 2.0]


def test_no_grad_regions_are_not_recorded_on_the_workers(mesh2x2):
    with mesh2x2.activate():
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(4, 6)
        for _ in range(3):  # the optimizer writes the parameters in place under no_grad, on the workers too
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        with torch.no_grad():
            model[0].weight.mul_(0.5)
        _, where = _where(lambda: model(x).sum().backward())
        assert where == (1, 0)
        assert torch.isfinite(fetch_shard(model[0].weight.grad).result()).all()


def test_autograd_grad_runs_on_the_workers_and_leaves_dot_grad_alone(mesh2x2, monkeypatch):
    with mesh2x2.activate():
        model = _model()
        x = torch.randn(4, 6)
        params = list(model.parameters())
        loss = model(x).square().mean()
        first = mesh2x2.client.last_seq
        got, where = _where(lambda: torch.autograd.grad(loss, params))
        assert where == (1, 0) and mesh2x2.client.last_seq - first == 1
        assert all(p.grad is None for p in params) and all(g.shape == p.shape for g, p in zip(got, params))
        got = fetch_shard(list(got)).result()
        monkeypatch.setenv("TDMESH_BACKWARD", "client")
        want = fetch_shard(list(torch.autograd.grad(model(x).square().mean(), params))).result()
        bias = model[3].bias
        out = model(x).sum()
        # an input the graph does not reach: torch's engine answers (None with allow_unused, else its error)
        monkeypatch.setenv("TDMESH_BACKWARD", "auto")
        unused = torch.zeros(2, requires_grad=True)
        (none, g), where = _where(lambda: torch.autograd.grad(out, [unused, bias], allow_unused=True))
        assert none is None and where == (0, 1) and fetch_shard(g).result().tolist() == [4.0, 4.0, 4.0]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def _wide():
    torch.manual_seed(1)  # a 1.4 MB weight: DDP's first bucket closes at 1 MiB, so there are two
    return torch.nn.Sequential(torch.nn.Linear(600, 600), torch.nn.Tanh(), torch.nn.Linear(600, 3))


@pytest.mark.parametrize("where", ["workers", "client"])
def test_gradients_reduced_during_backward_equal_a_reduce_after_it(mesh2x2, monkeypatch, where):
    """Each rank's own batch; the registered gradients come out of backward averaged over the mesh,
    bucket by bucket on the workers' backward (or in one reduce_ after the client's), the same values
    as tdmesh.reduce_ after a plain backward."""
    def grads(register: bool):
        tdmesh.random.set_manual_seed_remote(0)  # the same model and batches both times
        model = _wide()
        x = torch.randn(4, 600) * (mesh2x2.rank(mesh2x2.names) + 1)
        handle = tdmesh.reduce_grads_in_backward(model.parameters(), mesh2x2.names, "avg") if register else None
        for _ in range(2):  # the second backward accumulates, and its total is reduced again (as DDP does)
            model.zero_grad()
            _, ran = _where(lambda: model(x).square().mean().backward())
        if handle is None:
            tdmesh.reduce_([p.grad for p in model.parameters()], mesh2x2.names, "avg")
        else:
            handle.remove()
        return [[v for _, v in tdmesh.fetch_all(p.grad).result()] for p in model.parameters()], ran

    with mesh2x2.activate():
        if where == "client":
            monkeypatch.setenv("TDMESH_BACKWARD", "client")
        reduced, ran = grads(True)
        after, _ = grads(False)
    assert ran == ((1, 0) if where == "workers" else (0, 1))
    for a, b in zip(reduced, after):  # per parameter, every rank's gradient
        torch.testing.assert_close(torch.stack(a), torch.stack(b))
        assert all(torch.equal(a[0], v) for v in a)  # every rank holds the mean


def test_a_failed_forward_with_reduction_in_backward_poisons_the_gradients_and_hangs_nobody(mesh2x2):
    chol = tdmesh.remote(torch.linalg.cholesky, propagate=lambda a: a)
    with mesh2x2.activate():
        w = torch.eye(2).requires_grad_()
        handle = tdmesh.reduce_grads_in_backward([w], mesh2x2.names)
        (w * chol(-torch.eye(2))).sum().backward()
        with pytest.raises(tdmesh.RemoteException, match="cholesky|positive-definite"):
            fetch_shard(w.grad).result()
        handle.remove()
        w.grad = None
        (w * 2).sum().backward()  # the mesh goes on
        assert fetch_shard(w.grad).result().tolist() == [[2.0, 2.0], [2.0, 2.0]]


def test_a_forward_failed_on_one_rank_with_reduction_in_backward_hangs_nobody(mesh2x2):
    """Where one rank's forward failed its backward is never run (its root is poisoned) but its peers'
    backward reduce their buckets: that rank still runs the buckets' collectives, with zeros (before,
    its peers waited in them until the process group timed out), and every rank's gradient is failed."""
    fails_on_rank_1 = tdmesh.remote(
        lambda x: torch.linalg.cholesky(-x) if torch.distributed.get_rank() == 1 else x * 1, propagate=lambda x: x)
    with mesh2x2.activate():
        w = torch.eye(2).requires_grad_()
        handle = tdmesh.reduce_grads_in_backward([w], mesh2x2.names)
        _, where = _where((w * fails_on_rank_1(torch.eye(2))).sum().backward)
        assert where == (1, 0)
        for host in range(2):
            for gpu in range(2):
                with pytest.raises(tdmesh.RemoteException, match="cholesky|positive-definite"):
                    fetch_shard(w.grad, host=host, gpu=gpu).result(timeout=60)
        handle.remove()
        w.grad = None
        (w * 2).sum().backward()  # the mesh goes on: no collective was left half-joined
        assert fetch_shard(w.grad).result(timeout=60).tolist() == [[2.0, 2.0], [2.0, 2.0]]


_ACTIVATIONS = {"tanh": torch.tanh, "relu": torch.relu, "gelu": F.gelu, "sigmoid": torch.sigmoid, "exp": torch.exp,
                "square": torch.square}


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(widths=st.lists(st.integers(1, 9), min_size=2, max_size=5),
       acts=st.lists(st.sampled_from(sorted(_ACTIVATIONS)), min_size=4, max_size=4),
       norm=st.booleans(), batch=st.integers(1, 5), reuse=st.booleans(), reduction=st.sampled_from(["sum", "mean"]))
def test_drawn_graphs_give_the_clients_gradients_on_the_workers(mesh2x2, monkeypatch, widths, acts, norm, batch,
                                                                  reuse, reduction):
    """Differential: hypothesis draws a graph (layer widths, activations, a LayerNorm, a tensor used twice,
    views and reductions); its gradients from the workers' own autograd equal the client's engine's."""
    def grads(mode: str):
        monkeypatch.setenv("TDMESH_BACKWARD", mode)
        tdmesh.random.set_manual_seed_remote(0)
        layers = [torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])]
        params = [p for layer in layers for p in layer.parameters()]
        h = torch.randn(batch, widths[0])
        first = None
        for i, layer in enumerate(layers):
            h = _ACTIVATIONS[acts[i % len(acts)]](layer(h)).clamp(-5, 5)
            if norm and h.shape[-1] > 1:
                h = F.layer_norm(h, h.shape[-1:])
            first = h if first is None else first
        out = h.reshape(-1)
        if reuse and first.shape == h.shape:
            out = out + (first * h).t().reshape(-1)
        loss = out.sum() if reduction == "sum" else out.mean()
        before = dict(worker_backward.COUNTS)
        loss.backward()
        assert worker_backward.COUNTS[mode if mode == "client" else "workers"] == before[
            mode if mode == "client" else "workers"] + 1
        return fetch_shard([p.grad for p in params]).result()

    monkeypatch.setenv("TDMESH_BACKWARD", "auto")  # read when the mesh is activated (its saved-tensor hooks)
    with mesh2x2.activate():
        on_workers = grads("auto")
        on_client = grads("client")
    for a, b in zip(on_workers, on_client):
        torch.testing.assert_close(a, b)


def test_a_forward_the_workers_did_not_record_runs_its_backward_on_the_client(mesh2x2, monkeypatch):
    """``TDMESH_BACKWARD`` is read when a mesh is activated (its saved-tensor hooks) and at each backward:
    a forward issued under 'client' that meets a backward under 'auto' stays on the client's engine
    (hypothesis found the workers refusing it, by its digest, before the nodes were marked)."""
    monkeypatch.setenv("TDMESH_BACKWARD", "client")
    with mesh2x2.activate():
        w = torch.ones(3).requires_grad_()
        loss = (w.exp() * 2).sum()
        monkeypatch.setenv("TDMESH_BACKWARD", "auto")
        _, where = _where(loss.backward)
        assert where == (0, 1)
        assert torch.allclose(fetch_shard(w.grad).result(), torch.full((3,), 2 * torch.e))


def test_module_to_a_dtype_converts_the_workers_values(mesh2x2):
    """``module.half()`` / ``.to(dtype)`` set each parameter's ``.data``: the proxy takes the converted
    value on the workers (it went on naming the old one: a float64 model failed at its first matmul, and
    ``.half().float()`` kept the unrounded weights), and stays a leaf the workers' backward reaches."""
    with mesh2x2.activate():
        model = _model()
        before = fetch_shard(model[0].weight.detach()).result()
        model.half()
        model.float()
        after = fetch_shard(model[0].weight.detach()).result()
        model.to(torch.float64)
        loss = model(torch.randn(4, 6, dtype=torch.float64)).sum()
        _, where = _where(loss.backward)
        assert where == (1, 0)
        grad = fetch_shard(model[0].weight.grad).result()
    assert torch.equal(after, before.half().float()) and not torch.equal(after, before)
    assert grad.dtype == torch.float64 and grad.shape == (8, 6)


def test_a_model_made_under_client_mode_runs_on_the_workers_from_its_second_backward(mesh2x2, monkeypatch):
    """Parameters made while ``TDMESH_BACKWARD=client`` require grad on the client only; the first backward
    under 'auto' runs on the client's engine and mirrors every leaf of its graph at once (it mirrored one
    leaf a backward: a 4-parameter model needed 5 steps, a GPT one step per parameter)."""
    monkeypatch.setenv("TDMESH_BACKWARD", "client")
    with mesh2x2.activate():
        model = _model()
        x = torch.randn(4, 6)
    monkeypatch.setenv("TDMESH_BACKWARD", "auto")
    with mesh2x2.activate():
        runs = []
        for _ in range(3):
            model.zero_grad()
            loss = model(x).sum()
            runs.append(_where(loss.backward)[1])
        assert "mirrored now" in worker_backward.CLIENT_REASON[0]
        grads = _grads(model)
    assert runs == [(0, 1), (1, 0), (1, 0)]
    local = _local(model)
    local(fetch_shard(x).result()).sum().backward()
    for got, p in zip(grads, local.parameters()):
        torch.testing.assert_close(got, p.grad)

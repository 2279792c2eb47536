"""Autograd and torch.optim on remote tensors, checked against the same math run locally.

MONARCH_NOTES §1.8 and §5 items 109-111; issue 5 part 4 and 6 (the training tutorial).
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import tdmesh
from tdmesh import fetch_shard

from paths import REPO as ROOT


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batch(shift=0.0):
    x = torch.linspace(-1, 1, 24).reshape(6, 4) + shift
    y = torch.linspace(0, 1, 18).reshape(6, 3) * (1 + shift)
    return x, y


def local_copy(params) -> torch.nn.Module:
    """A local MLP holding the (fetched) values ``params``."""
    with tdmesh.no_mesh.activate():
        model = mlp()
        with torch.no_grad():
            for p, v in zip(model.parameters(), params):
                p.copy_(v)
    return model


def test_mlp_loss_and_grads_equal_local_autograd(mesh2x2):
    with mesh2x2.activate():
        tdmesh.random.set_manual_seed_remote(0)
        model = mlp()
        params = [p for p in model.parameters()]
        assert all(isinstance(p, tdmesh.Tensor) and p.requires_grad for p in params)
        initial = fetch_shard([p.detach() for p in params], host=1, gpu=0).result()
        x, y = batch()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        assert all(isinstance(p.grad, tdmesh.Tensor) and p.grad.shape == p.shape for p in params)
        remote_loss, grads = fetch_shard((loss.detach(), [p.grad for p in params]), host=1, gpu=0).result()
        other_rank = fetch_shard([p.grad for p in params], host=0, gpu=1).result()

    local = local_copy(initial)
    with tdmesh.no_mesh.activate():
        lx, ly = batch()
        local_loss = F.mse_loss(local(lx), ly)
        local_loss.backward()
    assert torch.allclose(remote_loss, local_loss.detach(), atol=1e-6)
    for g, o, p in zip(grads, other_rank, local.parameters()):
        assert torch.allclose(g, p.grad, atol=1e-6)
        assert torch.equal(g, o)  # every rank ran the same program on the same data


def test_backward_under_no_mesh_runs_on_the_forward_mesh(mesh2x2):
    with mesh2x2.activate():
        w = torch.ones(3).requires_grad_()
        loss = (w * torch.arange(3.0)).sum()
    with tdmesh.no_mesh.activate():
        loss.backward()
    assert isinstance(w.grad, tdmesh.Tensor) and w.grad.mesh is mesh2x2
    assert torch.equal(fetch_shard(w.grad, host=1, gpu=1).result(), torch.arange(3.0))


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "sgd_foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=True),
    "sgd_fused": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, fused=True),
    # the rest of torch.optim (their steps run with the mesh's torch-function mode set aside:
    # tdmesh/engine/optimizers.py), each in its default implementation
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    "adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=0.01),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=0.01),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=0.01),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=0.01),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=0.01),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=0.01),
}


def _three_steps(model, opt, x, y) -> list:
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_steps_equal_local_steps(mesh2x2, name):
    make_opt = OPTIMIZERS[name]
    with mesh2x2.activate():
        model = mlp()
        initial = fetch_shard([p.detach() for p in model.parameters()]).result()
        losses = _three_steps(model, make_opt(model.parameters()), *batch())
        after, remote_losses = fetch_shard(([p.detach() for p in model.parameters()], losses), host=1, gpu=1).result()

    local = local_copy(initial)
    with tdmesh.no_mesh.activate():
        local_losses = _three_steps(local, make_opt(local.parameters()), *batch())
    for r, expected in zip(remote_losses, local_losses):
        assert torch.allclose(r, expected, atol=1e-6)
    for a, p, i in zip(after, local.parameters(), initial):
        assert not torch.equal(a, i)  # the steps did move the parameters
        assert torch.allclose(a, p.detach(), atol=1e-6)


def test_optimizers_choose_foreach_and_fused_as_for_plain_tensors_of_the_device(mesh1):
    """torch.optim defaults to foreach exactly for the device types it would for plain
    tensors (CUDA: foreach; CPU: single-tensor), and fused=True is accepted."""
    from torch.optim.optimizer import _default_to_fused_or_foreach
    with mesh1.activate():
        p = torch.zeros(3)
    plain = torch.zeros(3, device=mesh1.device_type) if mesh1.device_type == "cpu" else None
    chosen = _default_to_fused_or_foreach([p], differentiable=False, use_fused=False)
    assert chosen == ((False, True) if mesh1.device_type == "cuda" else (False, False))
    if plain is not None:
        assert chosen == _default_to_fused_or_foreach([plain], differentiable=False, use_fused=False)
    assert _default_to_fused_or_foreach([p], differentiable=False, use_fused=True) == (True, False)


def _ops_per_step(mesh, make_opt, n_params: int) -> int:
    with mesh.activate():
        params = [torch.ones(4).requires_grad_() for _ in range(n_params)]
        for q in params:
            q.grad = torch.full((4,), 0.5)
        opt = make_opt(params)
        opt.step()  # the first step creates the state
        before = mesh.client.last_seq
        opt.step()
        return mesh.client.last_seq - before


# (AdamW's foreach path without capturable=True reads every step counter on the host, one
# fetch per parameter per step, as torch's does for plain tensors; capturable needs CUDA: see tests/gpu)
@pytest.mark.parametrize("name", ["sgd_foreach", "adam_fused", "adamw_fused", "sgd_fused"])
def test_a_foreach_or_fused_step_is_a_few_remote_ops_whatever_the_number_of_parameters(mesh1, name):
    few, many = _ops_per_step(mesh1, OPTIMIZERS[name], 2), _ops_per_step(mesh1, OPTIMIZERS[name], 12)
    assert few == many and many <= 24, (few, many)
    single = _ops_per_step(mesh1, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False), 12)
    assert single >= 2 * 12 > many  # the single-tensor path: ops for every parameter


def test_compiled_data_parallel_step_equals_local_steps(mesh2x2):
    """forward, backward, one bucketed ``reduce_`` of every gradient and an SGD-with-momentum
    step, compiled (one warm-up step eagerly: it creates the grads and momentum buffers that
    the recording then updates in place); each rank's batch differs, so the average matters."""
    n = len(mesh2x2)
    with mesh2x2.activate():
        tdmesh.random.set_manual_seed_remote(0)  # one initial model on every rank
        model = mlp()
        initial = fetch_shard([p.detach() for p in model.parameters()]).result()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        shift = mesh2x2.rank(("host", "gpu")).float() * 0.1

        def step(x, y):
            opt.zero_grad(set_to_none=False)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            tdmesh.reduce_([p.grad for p in model.parameters()], ("host", "gpu"), "avg")
            opt.step()
            return loss.detach()

        compiled = tdmesh.compile(step)
        x, y = batch()
        xs, ys = x + shift, y * (1 + shift)
        losses = [step(xs, ys)] + [compiled(xs, ys) for _ in range(3)]
        assert compiled.traces == 1
        after, remote_losses = fetch_shard(([p.detach() for p in model.parameters()], losses),
                                           host=1, gpu=1).result()

    local = local_copy(initial)
    with tdmesh.no_mesh.activate():
        lopt = torch.optim.SGD(local.parameters(), lr=0.1, momentum=0.9)
        local_losses = []
        for _ in range(4):
            lopt.zero_grad()
            grads = None
            for r in range(n):  # the average of every rank's gradient, as reduce_ computes it
                lx, ly = batch(0.0)
                lx, ly = lx + r * 0.1, ly * (1 + r * 0.1)
                lopt.zero_grad()
                lloss = F.mse_loss(local(lx), ly)
                lloss.backward()
                if r == n - 1:
                    local_losses.append(lloss.detach())
                g = [p.grad.clone() for p in local.parameters()]
                grads = g if grads is None else [a + b for a, b in zip(grads, g)]
            for p, g in zip(local.parameters(), grads):
                p.grad = g / n
            lopt.step()
    for r, expected in zip(remote_losses, local_losses):
        assert torch.allclose(r, expected, atol=1e-5)
    for a, p, i in zip(after, local.parameters(), initial):
        assert not torch.equal(a, i)
        assert torch.allclose(a, p.detach(), atol=1e-5)


def test_grads_reduced_as_they_are_produced_by_hooks(mesh2x2):
    def average_over_gpu(p):
        p.grad.reduce_("gpu", "avg")   # a hook must return None; reduce_ returns the tensor

    with mesh2x2.activate():
        model = mlp()
        initial = fetch_shard([p.detach() for p in model.parameters()]).result()
        handles = [p.register_post_accumulate_grad_hook(average_over_gpu) for p in model.parameters()]
        rank = mesh2x2.rank("host") * 2 + mesh2x2.rank("gpu")  # per-rank data
        x, y = batch()
        x = x + rank
        y = y * (1 + rank)
        F.mse_loss(model(x), y).backward()
        for h in handles:
            h.remove()
        grads = {(h, g): fetch_shard([p.grad for p in model.parameters()], host=h, gpu=g).result()
                 for h in range(2) for g in range(2)}

    local_grads = {}
    for h in range(2):
        for g in range(2):
            local = local_copy(initial)
            with tdmesh.no_mesh.activate():
                r = 2 * h + g
                lx, ly = batch()
                F.mse_loss(local(lx + r), ly * (1 + r)).backward()
            local_grads[(h, g)] = [p.grad for p in local.parameters()]
    for h in range(2):
        expected = [(a + b) / 2 for a, b in zip(local_grads[(h, 0)], local_grads[(h, 1)])]
        assert not torch.allclose(local_grads[(h, 0)][0], local_grads[(h, 1)][0])  # the ranks did differ
        for g in range(2):
            for got, want in zip(grads[(h, g)], expected):
                assert torch.allclose(got, want, atol=1e-5)
    # hosts are not averaged together
    assert not torch.allclose(grads[(0, 0)][0], grads[(1, 0)][0])


def test_training_tutorial_loss_goes_down():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tutorials", "05_train.py"), "--steps", "20"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=dict(os.environ, TDMESH_DEVICE="cpu"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    first, last = (float(v) for v in out.stdout.split("loss went from ")[1].split()[::2][:2])
    assert last < first


class _OpNames:
    """The aten ops dispatched while active (above a mesh's own mode when one is active)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode
        names = self.names = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                names.append(str(func))
                return func(*args, **(kwargs or {}))
        self.mode = Mode()


def test_bf16_autocast_on_a_mesh_runs_the_ops_local_autocast_runs(mesh1):
    """torch.autocast is applied on the client (the proxies carry their device's autocast key):
    the workers get the same casts and bf16 ops a local autocast forward dispatches."""
    device = mesh1.device_type

    def forward_backward(model, x, y, recorder):
        with recorder.mode, torch.autocast(device, dtype=torch.bfloat16):
            out = model(x)
            loss = F.mse_loss(out.float(), y)
        loss.backward()
        return out, loss

    with mesh1.activate():
        model = mlp()
        initial = fetch_shard([p.detach() for p in model.parameters()]).result()
        x, y = batch()
        remote_ops = _OpNames()
        out, loss = forward_backward(model, x, y, remote_ops)
        got_out, got_grads = fetch_shard((out, [p.grad for p in model.parameters()])).result()
    local = local_copy(initial)
    if device == "cuda":
        local = local.cuda()
    with tdmesh.no_mesh.activate():
        lx, ly = (t.to(device) for t in batch())
        local_ops = _OpNames()
        lout, _ = forward_backward(local, lx, ly, local_ops)
    assert out.dtype == torch.bfloat16 and got_out.dtype == torch.bfloat16
    # autograd detaches a saved output unless saved-tensor hooks take it (a mesh's do: engine/saved.py)
    casts_and_ops = [[n for n in ops.names if n != "aten.detach.default"] for ops in (remote_ops, local_ops)]
    assert casts_and_ops[0] == casts_and_ops[1] and "aten._to_copy.default" in remote_ops.names
    torch.testing.assert_close(got_out, lout.detach().cpu())
    for g, p in zip(got_grads, local.parameters()):
        torch.testing.assert_close(g, p.grad.cpu())

"""torch's optimizers and ``zero_grad`` run with the mesh's torch-function mode set aside
(``tdmesh/engine/optimizers.py``): their many property reads cost nothing then; the user's code they
call (a closure, step hooks, a mode of the user's) still runs under it; the mode is back however the
step ends.  Their results equal local torch's: ``tests/fleet/test_autograd.py``'s optimizer table."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

import tdmesh
from tdmesh import fetch_shard
from tdmesh.engine import backward as worker_backward
from tdmesh.engine.activation import MeshFunctions


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


@pytest.fixture
def mode_calls(monkeypatch):
    """The calls the mesh's torch-function mode gets, by function name."""
    calls: list[str] = []
    original = MeshFunctions.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        calls.append(getattr(func, "__name__", str(func)))
        return original(self, func, types, args, kwargs)
    monkeypatch.setattr(MeshFunctions, "__torch_function__", counting)
    return calls


def _top_mode():
    depth = torch._C._len_torch_function_stack()
    return torch._C._get_function_stack_at(depth - 1) if depth else None


@pytest.mark.parametrize("make", [lambda ps: torch.optim.AdamW(ps, lr=0.01, fused=True),
                                  lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
                                  lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=False)],
                         ids=["adamw_fused", "sgd_foreach", "adam_for_loop"])
def test_torchs_optimizer_steps_and_zero_grad_skip_the_mode(mesh2x2, mode_calls, make):
    with mesh2x2.activate():
        model = _model()
        opt = make(model.parameters())
        x = torch.randn(5, 4)
        for _ in range(2):
            model(x).sum().backward()
            before = len(mode_calls)
            opt.step()
            opt.zero_grad()
            model.zero_grad()
            # what is left is torch's profiler ranges around them (record_function), no property reads
            assert {name for name in mode_calls[before:] if "record_function" not in name.lower()} == set()
        assert type(_top_mode()) is MeshFunctions
        assert all(p.grad is None for p in model.parameters())
        model(x).sum()  # ops outside the optimizer still meet the mode
        assert mode_calls


def test_a_step_with_a_closure_keeps_the_mode_and_its_backward_runs_on_the_workers(mesh2x2, mode_calls):
    with mesh2x2.activate():
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(5, 4)
        model(x).sum().backward()  # its leaves mirrored, its first step taken
        opt.step()

        def closure():
            opt.zero_grad()
            loss = model(x).sum()
            loss.backward()
            return loss
        before, counts = len(mode_calls), dict(worker_backward.COUNTS)
        loss = opt.step(closure)
        assert len(mode_calls) > before
        assert worker_backward.COUNTS["workers"] == counts["workers"] + 1
        assert isinstance(fetch_shard(loss).result().item(), float)


def _lbfgs_step(model, x, y) -> None:
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss
    opt.step(closure)


def test_lbfgs_runs_its_closure_under_the_mode_and_equals_local_torch(mesh2x2):
    """LBFGS reads the loss on the host (``float(closure())``): every rank gets the same data and weights."""
    local = _model()
    initial = [p.detach().clone() for p in local.parameters()]
    xs, ys = torch.randn(6, 4), torch.randn(6, 1)
    with mesh2x2.activate():
        model = _model()
        with torch.no_grad():
            for p, v in zip(model.parameters(), initial):
                p.copy_(v)  # the local weights shipped to every rank
        _lbfgs_step(model, torch.tensor(xs), torch.tensor(ys))
        after = fetch_shard([p.detach() for p in model.parameters()], host=1, gpu=1).result()
    _lbfgs_step(local, xs, ys)
    for got, p in zip(after, local.parameters()):
        torch.testing.assert_close(got, p.detach(), atol=1e-5, rtol=1e-5)


def test_step_hooks_and_a_users_mode_above_the_meshs_still_see_the_calls(mesh2x2, mode_calls):
    seen: list = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with mesh2x2.activate():
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
        tops: list = []
        handle = opt.register_step_pre_hook(lambda *_: tops.append(type(_top_mode())))
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        handle.remove()
        assert tops == [MeshFunctions]  # the user's hook runs under the mode
        model(torch.randn(5, 4)).sum().backward()
        before = len(mode_calls)
        with Watch():
            opt.step()
        assert seen  # a mode of the user's above the mesh's is not set aside, nor is the mesh's under it
        assert len(mode_calls) > before


def test_the_mode_is_back_when_a_step_raises(mesh2x2):
    with mesh2x2.activate():
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.randn(5, 4)).sum().backward()
        depth = torch._C._len_torch_function_stack()
        opt.param_groups[0]["lr"] = "not a number"  # -lr raises in the step
        with pytest.raises(TypeError):
            opt.step()
        assert torch._C._len_torch_function_stack() == depth and type(_top_mode()) is MeshFunctions
        assert type(torch.ones(2)) is tdmesh.Tensor  # factories still reach the mesh

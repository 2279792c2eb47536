"""``copy.deepcopy`` of mesh tensors and of models on a mesh (an EMA model, a target network, the best model
kept): an independent copy on the same mesh, as torch copies a local one.  Before the twenty-eighth session it
failed ("cannot pickle '_thread.RLock' object": torch's ``__deepcopy__`` copied the proxy's mesh and client)."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tdmesh import inspect


def _model(values: list | None = None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    if values is not None:
        with torch.no_grad():
            for p, v in zip(model.parameters(), values):
                p.copy_(torch.tensor(v, dtype=torch.float64))
    return model


def _train_with_ema(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[list, nn.Module]:
    """Three SGD steps of ``model``, an exponential moving average of it kept in a deep copy."""
    ema = copy.deepcopy(model)
    for p in ema.parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters()):
                e.mul_(0.9).add_(p, alpha=0.1)
    return [p.detach() for p in ema.parameters()] + [p.detach() for p in model.parameters()], ema


def test_an_ema_copy_of_a_model_follows_local_torch(mesh1):
    local = _model()
    values = [p.detach().tolist() for p in local.parameters()]
    g = torch.Generator().manual_seed(1)
    local_x, local_y = torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(5, 2, generator=g,
                                                                                          dtype=torch.float64)
    want, local_ema = _train_with_ema(local, local_x, local_y)
    with mesh1.activate():
        model = _model(values)
        x, y = torch.tensor(local_x.tolist(), dtype=torch.float64), torch.tensor(local_y.tolist(), dtype=torch.float64)
        got, ema = _train_with_ema(model, x, y)
        assert all(isinstance(p, nn.Parameter) and not p.requires_grad for p in ema.parameters())
        assert all(e is not p and e.ref != p.ref for e, p in zip(ema.parameters(), model.parameters()))
        got = [inspect(t) for t in got]
    for g_, w in zip(got, want):
        torch.testing.assert_close(g_, w, rtol=1e-12, atol=1e-12)


def test_a_deep_copy_keeps_requires_grad_grad_strides_and_attributes_and_refuses_non_leaves(mesh1):
    with mesh1.activate():
        w = torch.arange(6.0).reshape(2, 3).t().requires_grad_()
        (w * 2).sum().backward()
        w.tag = {"role": "weight"}
        twin = copy.deepcopy(w)
        assert twin.requires_grad and twin.is_leaf and twin.stride() == w.stride() and twin.tag == w.tag
        assert twin.tag is not w.tag and twin.grad is not w.grad
        with torch.no_grad():
            w.add_(100.0)  # the copy is its own memory on the workers
        got = inspect(twin), inspect(twin.grad)
        with pytest.raises(RuntimeError, match="graph leaves"):
            copy.deepcopy(w * 2)
    assert torch.equal(got[0], torch.arange(6.0).reshape(2, 3).t()) and torch.equal(got[1], torch.full((3, 2), 2.0))

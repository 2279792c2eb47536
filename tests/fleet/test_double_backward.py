"""Backward through a graph a ``create_graph=True`` backward made (double backward, gradient penalties,
Hessian-vector products, ``torch.autograd.functional``): local torch's values.  Such a backward runs on the
client's engine, whose nodes the workers hold no copy of (``tdmesh/engine/client_graphs.py``); until the
twenty-eighth session the next backward over them was sent to the workers, which refused it ("this worker's
autograd graph is not the client's ... a tdmesh bug") and the call failed."""

import pytest
import torch
import torch.nn.functional as F

from tdmesh import inspect
from tdmesh.engine import backward as backward_module


def _local_and_mesh(values: torch.Tensor) -> torch.Tensor:
    """A mesh copy of ``values`` (call under an activation)."""
    return torch.tensor(values.tolist(), dtype=values.dtype)


def _model(local: torch.nn.Module | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    if local is not None:  # the same values on the mesh (a mesh's random streams are not local torch's)
        with torch.no_grad():
            for p, q in zip(model.parameters(), local.parameters()):
                p.copy_(_local_and_mesh(q))
    return model


def _penalised_step(model, x, y, lam: float = 10.0):
    """One step of a gradient-penalty loss (WGAN-GP's): the gradient of the output with respect to
    the input, made with create_graph, enters the loss; ``loss.backward()`` then runs through it."""
    x = x.clone().requires_grad_()
    out = model(x)
    (grad_x,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    loss = F.mse_loss(out.squeeze(1), y) + lam * ((grad_x.norm(dim=1) - 1) ** 2).mean()
    loss.backward()
    return loss


def _train_then_plain_backward(model, x, y) -> list[float]:
    """Three SGD steps of the penalised loss (their losses), then one plain loss's backward: a graph with no
    node of a create_graph backward, which runs on the workers."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        losses.append(_penalised_step(model, x, y).item())
        opt.step()
    opt.zero_grad()
    F.mse_loss(model(x).squeeze(1), y).backward()
    return losses


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64)


def test_the_gradient_of_a_gradient(mesh1):
    local_t = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64, requires_grad=True)
    (g1,) = torch.autograd.grad((local_t ** 3).sin().sum(), local_t, create_graph=True)
    (want,) = torch.autograd.grad(g1.sum(), local_t)
    with mesh1.activate():
        t = _local_and_mesh(local_t.detach()).requires_grad_()
        (g1,) = torch.autograd.grad((t ** 3).sin().sum(), t, create_graph=True)
        assert g1.requires_grad and g1.grad_fn is not None
        (g2,) = torch.autograd.grad(g1.sum(), t)
        assert "create_graph" in backward_module.CLIENT_REASON[0]
        got = inspect(g2)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mesh_name", ["mesh1", "mesh2x2"])
def test_a_gradient_penalty_trains_as_local_torch_and_plain_steps_stay_on_the_workers(mesh_name, request):
    mesh = request.getfixturevalue(mesh_name)
    local_x, local_y = _inputs()
    local = _model()
    initial = _model()  # the same values, kept for the mesh's copy
    want_losses = _train_then_plain_backward(local, local_x, local_y)
    with mesh.activate():
        model = _model(initial)
        on_workers = backward_module.COUNTS["workers"]
        losses = _train_then_plain_backward(model, _local_and_mesh(local_x), _local_and_mesh(local_y))
        assert backward_module.COUNTS["workers"] == on_workers + 1  # the plain one, and only it
        grads = [inspect(p.grad) for p in model.parameters()]
    torch.testing.assert_close(losses, want_losses, rtol=1e-12, atol=1e-12)
    for got, p in zip(grads, local.parameters()):
        torch.testing.assert_close(got, p.grad, rtol=1e-12, atol=1e-12)


def test_backward_with_create_graph_then_a_backward_of_the_gradients(mesh1):
    """``loss.backward(create_graph=True)`` leaves gradients with a graph in ``.grad``; a loss made of
    them backpropagates into the same leaves (accumulating, as torch does)."""
    local = _model()
    local_x, _ = _inputs()
    local(local_x).pow(2).sum().backward(create_graph=True)
    sum(p.grad.pow(2).sum() for p in local.parameters()).backward()
    want = [p.grad.detach().clone() for p in local.parameters()]
    with mesh1.activate():
        model = _model(local)
        x = _local_and_mesh(local_x)
        model(x).pow(2).sum().backward(create_graph=True)
        assert all(p.grad.grad_fn is not None for p in model.parameters())
        sum(p.grad.pow(2).sum() for p in model.parameters()).backward()
        got = [inspect(p.grad) for p in model.parameters()]
        for p in model.parameters():  # the graph the gradients hold refers back to them: break the cycle
            p.grad = None
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_torch_autograd_functional_hessian_hvp_and_jvp(mesh1):
    local_x = torch.tensor([[0.3, -0.7, 1.1], [2.0, 0.1, -0.4]], dtype=torch.float64)
    direction = torch.tensor([[1.0, 0.5, -0.25], [0.0, 2.0, 1.0]], dtype=torch.float64)

    def energy(t):
        return (t.sin() * t.pow(2)).sum()

    def field(t):
        return t.exp() * t.cos()

    F_ = torch.autograd.functional
    want = (F_.hessian(energy, local_x), F_.hvp(energy, local_x, direction)[1], F_.jvp(field, local_x, direction)[1],
            F_.vhp(energy, local_x, direction)[1])
    with mesh1.activate():
        x, v = _local_and_mesh(local_x), _local_and_mesh(direction)
        got = (F_.hessian(energy, x), F_.hvp(energy, x, v)[1], F_.jvp(field, x, v)[1], F_.vhp(energy, x, v)[1])
        got = tuple(inspect(g) for g in got)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)

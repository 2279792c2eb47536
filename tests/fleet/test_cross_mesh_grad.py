"""Autograd across meshes: ``to_mesh`` (and ``slice_mesh(...).to_mesh``) is differentiable,
the gradient travelling back to the source (issue 17, part 1), checked against local autograd."""

import warnings

import pytest
import torch

import tdmesh
from tdmesh import fetch_shard


def test_a_chain_over_two_meshes_gets_the_gradients_of_local_autograd(mesh2x2):
    first, second = mesh2x2.slice(host=0), mesh2x2.slice(host=1)
    with first.activate():
        w = torch.linspace(-1, 1, 6).reshape(2, 3).requires_grad_()
        hidden = torch.tanh(w * 3)
    moved = hidden.to_mesh(second)
    assert moved.requires_grad and moved.mesh is second
    with second.activate():
        v = torch.arange(3.0).requires_grad_()
        loss = ((moved * v).sum(1) ** 2).sum()
        loss.backward()
    grad_w = [fetch_shard(w.grad, gpu=g).result() for g in range(2)]
    grad_v = fetch_shard(v.grad, gpu=1).result()
    with tdmesh.no_mesh.activate():
        lw = torch.linspace(-1, 1, 6).reshape(2, 3).requires_grad_()
        lv = torch.arange(3.0).requires_grad_()
        ((torch.tanh(lw * 3) * lv).sum(1) ** 2).sum().backward()
    for g in grad_w:
        assert torch.allclose(g, lw.grad, atol=1e-6)
    assert torch.allclose(grad_v, lv.grad, atol=1e-6)
    assert w.grad.mesh is first


def test_a_broadcast_move_sums_the_gradients_of_every_copy(mesh2x2):
    gpus = mesh2x2.slice(host=0)  # dims ("gpu",): moving to the whole mesh broadcasts over "host"
    with gpus.activate():
        w = torch.ones(4, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        copies = w.to_mesh(mesh2x2)
    with mesh2x2.activate():
        scale = (mesh2x2.rank("host") + 2).float()  # copies weighted 2 and 3
        (copies * scale).sum().backward()
    for g in range(2):
        assert torch.equal(fetch_shard(w.grad, gpu=g).result(), torch.full((4,), 5.0))


def test_a_sliced_tensor_gets_the_gradient_on_its_slice_and_zeros_elsewhere(mesh2x2):
    top = mesh2x2.slice(host=0)
    with mesh2x2.activate():
        v = torch.full((3,), 2.0, requires_grad=True)
    part = v.slice_mesh(host=1).to_mesh(top)
    with top.activate():
        (part * part).sum().backward()
    assert v.grad.mesh is mesh2x2
    for g in range(2):
        assert torch.equal(fetch_shard(v.grad, host=1, gpu=g).result(), torch.full((3,), 4.0))
        assert torch.equal(fetch_shard(v.grad, host=0, gpu=g).result(), torch.zeros(3))


@pytest.mark.parametrize("how", ["no_grad", "detach"])
def test_a_move_outside_autograd_records_nothing(mesh2x2, how):
    first, second = mesh2x2.slice(host=0), mesh2x2.slice(host=1)
    with first.activate():
        w = torch.ones(2, requires_grad=True)
    if how == "no_grad":
        with torch.no_grad():
            moved = w.to_mesh(second)
    else:
        moved = w.detach().to_mesh(second)
    assert not moved.requires_grad and moved.grad_fn is None
    assert torch.equal(fetch_shard(moved).result(), torch.ones(2))


def test_mismatched_meshes_fail_before_any_autograd_node(mesh2x2):
    with mesh2x2.activate():
        w = torch.ones(2, requires_grad=True)
    with pytest.raises(ValueError, match="does not have dimensions"):
        w.to_mesh(mesh2x2.slice(host=0))

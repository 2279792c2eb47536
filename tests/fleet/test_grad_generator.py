"""``tdmesh.grad_generator`` / ``grad_function`` on a mesh (MONARCH_NOTES tests 109-111): the
graphs of Monarch's tests on mesh tensors against local ``torch.autograd.grad``; backward
iterated under ``no_mesh`` runs on the forward mesh; a side stream's nodes run on that stream;
a ``grad_function`` move over two meshes; a reduction issued in the loop."""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import relu

import tdmesh
from tdmesh import fetch_shard, grad_generator


def _simple(v):
    a, b = torch.std_mean(v[0] + v[1])
    return [a, b], [v[1], v[0]]


def _pipeline(v):
    a = relu(v[0] @ v[1])
    a = relu(a @ v[2])
    std, _ = torch.std_mean(a)
    return [std + std], [v[2], a, v[1], v[0], v[3]]  # v[3] is unused: None


def _tree(v):
    t = v[0]
    t2, t3, t4, t5 = t + t, t * t, t / t, t - t
    return [(t2 * t3 + t4 * t5 + t2 * t4 + t3 * t5).sum()], [t2, t]


def _broadcast(v):
    return [(v[0] * (v[1][0] / v[1][0])).sum()], [v[0], v[1]]


GRAPHS = {"simple": _simple, "pipeline": _pipeline, "tree": _tree, "broadcast": _broadcast}


@pytest.mark.parametrize("name", GRAPHS)
def test_mesh_graphs_yield_the_gradients_of_local_autograd(mesh2x2, name):
    torch.manual_seed(0)
    data = [torch.rand(3, 3) + 0.5 for _ in range(4)]
    with tdmesh.no_mesh.activate():
        local = [d.clone().requires_grad_() for d in data]
        roots, wanted = GRAPHS[name](local)
        expected = torch.autograd.grad(roots, wanted, allow_unused=True)
    with mesh2x2.activate():
        remote = [torch.tensor(d).requires_grad_() for d in data]
        roots, wanted = GRAPHS[name](remote)
        got = list(grad_generator(roots, wanted))
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        if e is None:
            assert g is None
            continue
        assert isinstance(g, tdmesh.Tensor) and g.mesh is mesh2x2
        for host, gpu in ((0, 0), (1, 1)):
            torch.testing.assert_close(fetch_shard(g, host=host, gpu=gpu).result(), e)


def test_iterated_under_no_mesh_backward_runs_on_the_forward_mesh(mesh2x2):
    with mesh2x2.activate():
        x = torch.arange(3.0).requires_grad_()
        y = (x * 2).requires_grad_()
        z = (y * x).sum()
    with tdmesh.no_mesh.activate():
        gz, gy, gx = grad_generator(z, [z, y, x])
        assert all(g.mesh is mesh2x2 for g in (gz, gy, gx))
        assert torch.equal(fetch_shard(gx, host=1, gpu=0).result(), 4 * torch.arange(3.0))
        assert torch.equal(fetch_shard(gy).result(), torch.arange(3.0))
        assert torch.equal(fetch_shard(gz).result(), torch.tensor(1.0))


def test_a_side_streams_nodes_run_on_that_stream(mesh2x2):
    side = tdmesh.Stream("grad_side")
    with mesh2x2.activate():
        with side.activate():
            w = torch.ones(4).requires_grad_()
            loss = (w * 3).sin().sum()
        (g,) = grad_generator(loss, [w])  # main stream active: each node goes back to "grad_side"
        assert g.stream is side
        assert torch.allclose(fetch_shard(g).result(), torch.full((4,), 3 * torch.cos(torch.tensor(3.0)).item()))
        with pytest.raises(tdmesh.PlacementError, match="WRONG_STREAM"):
            loss.backward()  # torch's engine runs every node under the active stream


@tdmesh.grad_function
def move(x, mesh):
    """Monarch's example: a move whose backward sends the gradient back to the source mesh."""
    source = x.mesh
    return x.to_mesh(mesh).detach(), lambda g: (g.to_mesh(source), None)


def test_a_grad_function_move_over_two_meshes(mesh2x2):
    first, second = mesh2x2.slice(host=0), mesh2x2.slice(host=1)
    with first.activate():
        w0 = torch.linspace(-1, 1, 4).requires_grad_()
        hidden = torch.tanh(w0 * 2)
    moved = move(hidden, second)
    with second.activate():
        w1 = torch.arange(4.0).requires_grad_()
        loss = (moved * w1).sum()
        g1, g0 = grad_generator(loss, [w1, w0])
    assert g0.mesh is first and g1.mesh is second
    with tdmesh.no_mesh.activate():
        lw0, lw1 = torch.linspace(-1, 1, 4).requires_grad_(), torch.arange(4.0).requires_grad_()
        e1, e0 = torch.autograd.grad((torch.tanh(lw0 * 2) * lw1).sum(), [lw1, lw0])
    with first.activate():
        torch.testing.assert_close(fetch_shard(g0, gpu=1).result(), e0)
    with second.activate():
        torch.testing.assert_close(fetch_shard(g1, gpu=0).result(), e1)


def test_a_reduction_issued_in_the_loop_equals_one_after_backward(mesh2x2):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    state = model.state_dict()
    x, y = torch.randn(5, 4), torch.randn(5, 2)
    results = []
    for in_loop in (True, False):
        with mesh2x2.activate():
            remote = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
            remote.load_state_dict(state)
            rank = mesh2x2.rank(("host", "gpu")).float()
            loss = ((remote(torch.tensor(x) + rank) - torch.tensor(y)) ** 2).mean()
            params = list(remote.parameters())[::-1]  # the last layer's gradients come first
            grads = []
            for g in grad_generator(loss, params):
                if in_loop:
                    g.reduce_(("host", "gpu"))
                grads.append(g)
            if not in_loop:
                for g in grads:
                    g.reduce_(("host", "gpu"))
        results.append([fetch_shard(g, host=1, gpu=0).result() for g in grads])
    local = []
    for r in range(4):
        with tdmesh.no_mesh.activate():
            model.load_state_dict(state)
            loss = ((model(x + r) - y) ** 2).mean()
            local.append(torch.autograd.grad(loss, list(model.parameters())[::-1]))
    for a, b, *per_rank in zip(*results, *local):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, sum(per_rank))


class _LossModel(torch.nn.Module):
    """``model(x, y) -> loss``, as the benches' GPT is called."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 16),
                                       torch.nn.Tanh(), torch.nn.Linear(16, 3))

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.net(x), y)


@pytest.mark.parametrize("how", ["generator", "hooks"])
def test_the_benchs_overlapped_step_trains_as_the_plain_step(mesh2x2, how):
    """``bench/train_step.py --overlap``: gradients reduced in buckets on a second stream while
    backward runs give the losses and weights of one bucketed reduction after backward, bit for
    bit on two ranks (a sum of two values has one order; over four, gloo's ring sums each
    bucket's chunks in an order that depends on the bucket)."""
    import sys

    from paths import REPO
    sys.path.insert(0, REPO)
    from bench.helpers import data_parallel_step, overlapped_step
    torch.manual_seed(3)
    state = _LossModel().state_dict()
    data = [(torch.randn(4, 6), torch.randn(4, 3)) for _ in range(4)]
    runs = []
    pair = mesh2x2.slice(host=1)
    for make in (data_parallel_step, lambda *a: overlapped_step(*a, buckets=3, how=how)):
        with pair.activate():
            model = _LossModel()
            model.load_state_dict(state)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            step = make(model, opt, pair)
            rank = pair.rank("gpu").float()
            losses = [step(torch.tensor(x) * (1 + rank), torch.tensor(y)) for x, y in data]
            runs.append(fetch_shard([*losses, *model.parameters()], gpu=1).result())
    plain, overlapped = runs
    assert not torch.equal(plain[0], plain[-5])  # it trained
    for a, b in zip(plain, overlapped):
        assert torch.equal(a, b)

"""Shapes only the data decides inside a compiled function (``x[mask]``, ``nonzero``,
``unique``, ``tensor_split`` by a tensor), as guards: the trace reads the output shapes from
every rank (which must agree, as in eager) and splits the recording there; a replay reads them
again and goes on while they are the traced ones; new shapes go on from the read, as the
function run eagerly would (``tdmesh.programs.guards``, ``tdmesh.programs.resume``).  Each test
compares with the same function run eagerly on the same mesh."""

from __future__ import annotations

import warnings

import pytest
import torch

import tdmesh
from tdmesh import inspect


def _calls(mesh, make, inputs, backend="program"):
    """``make()``'s function called on ``torch.arange(6) * v`` for each v of ``inputs``, eagerly
    and compiled on the same mesh: (eager values, compiled values, compiled function)."""
    runs = []
    for compiled in (False, True):
        with mesh.activate(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            f, state = make()
            g = tdmesh.compile(f, backend=backend) if compiled else f
            outs = [inspect(g(torch.arange(6.0) * v)) for v in inputs]
            runs.append((outs, [inspect(t) for t in state], g))
    (eager, eager_state, _), (compiled, compiled_state, fn) = runs
    assert len(eager) == len(compiled)
    for e, c in zip(eager, compiled):
        assert all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(e, c)), (e, c)
    assert all(torch.equal(a, b) for a, b in zip(eager_state, compiled_state))
    return eager, compiled, fn


def _selecting():
    w = torch.zeros(6)

    def step(x):
        y = x + w
        picked = y[y > 4]               # boolean mask: its length only the data decides
        where = torch.nonzero(y > 7)     # so does nonzero's
        values, counts = torch.unique(y.floor() // 4, return_counts=True)
        w.add_(0.25)
        w.sub_(0.25)
        return picked * 2, where + 1, values.sum() + counts.max(), picked.sum()

    return step, [w]


def test_a_shape_only_the_data_decides_is_a_guard_and_new_shapes_go_on_from_the_read(mesh2x2):
    inputs = [1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 1, 3, 3, 3, 3]
    eager, _, fn = _calls(mesh2x2, _selecting, inputs)
    assert {tuple(e[0].shape) for e in eager} == {(1,), (3,), (4,)}  # the shapes did change
    assert fn.eager_because is None
    (rec,) = fn.recordings.values()
    assert len(rec.guards) == 3 and len(rec.segments) == 4
    assert all(g.function == "tdmesh.worker.builtins.describe" for g in rec.guards)
    assert rec.replays >= 2


def test_inductor_compiles_the_parts_around_a_shape_read(mesh1):
    _, _, fn = _calls(mesh1, _selecting, [1, 1, 1, 2, 2, 2, 2], backend="inductor")
    (rec,) = fn.recordings.values()
    assert rec.mode == "inductor" and rec.segments is not None and rec.replays >= 1


def _masked_step(model, opt):
    def step(x):
        opt.zero_grad()
        keep = x.sum(1) > 0.5
        loss = model(x[keep]).pow(2).mean()
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def test_a_masked_loss_trains_as_eager_with_the_graph_crossing_the_shape_read(mesh1):
    """The mask selects rows before backward: the forward's graph crosses the read, and
    backward goes through the selection; the selected count changes now and then."""
    torch.manual_seed(0)
    with tdmesh.no_mesh.activate():
        init = torch.nn.Linear(4, 2).state_dict()
    xs = [torch.full((5, 4), 0.1) * torch.arange(5.0)[:, None] * s for s in [1] * 4 + [3] * 5 + [1] * 5]
    runs = []
    for compiled in (False, True):
        with mesh1.activate(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = torch.nn.Linear(4, 2)
            model.load_state_dict(tdmesh.to_mesh(init, mesh1))
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

            step = _masked_step(model, opt)
            fn = tdmesh.compile(step) if compiled else step
            losses = [inspect(fn(tdmesh.to_mesh(x, mesh1))).item() for x in xs]
            runs.append((losses, [inspect(p.detach()) for p in model.parameters()], fn))
    (eager, eager_params, _), (compiled_losses, params, fn) = runs
    assert eager == compiled_losses
    assert all(torch.equal(a, b) for a, b in zip(eager_params, params))
    assert fn.eager_because is None
    assert sum(r.replays for r in fn.recordings.values()) >= 2


def test_ranks_that_disagree_on_a_replays_shapes_raise_as_eager_does(mesh2x2):
    with mesh2x2.activate(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shift = torch.zeros(())

        @tdmesh.compile
        def fn(x):
            return (x + shift)[x + shift > 2] * 2

        for _ in range(3):
            assert inspect(fn(torch.arange(4.0))).tolist() == [6.0]
        shift.copy_(mesh2x2.rank("gpu") * 1.0)  # rank gpu=1 selects two elements, gpu=0 one
        with pytest.raises(ValueError, match="disagree on its output shapes") as info:
            fn(torch.arange(4.0))
        assert "inside a compiled function" in str(info.value) and "nonzero_static" in str(info.value)
        shift.zero_()
        assert inspect(fn(torch.arange(4.0))).tolist() == [6.0]


def test_a_shape_that_changes_every_call_makes_the_function_eager_naming_fixed_size_forms(mesh1):
    with mesh1.activate():
        @tdmesh.compile
        def fn(x):
            return torch.nonzero(x > 0).sum()

        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            outs = [inspect(fn(torch.arange(10.0) - 10 + n)).item() for n in range(1, 9)]
    assert outs == [sum(range(11 - n, 10)) for n in range(1, 9)]
    eager = [w for w in said if "runs eagerly" in str(w.message)]  # (torch may warn too)
    text = [str(w.message) for w in eager]
    assert len(text) == 1 and "nonzero" in text[0] and "nonzero_static" in text[0], text
    assert eager[0].filename == __file__  # the user's line
    assert fn.eager_because is not None


def test_tensor_split_by_a_tensor_of_indices_is_a_guard(mesh1):
    def make():
        def step(x):
            cut = (x > 3).sum().reshape(1)  # the split point: a value torch reads on the host
            first, second = torch.tensor_split(x, cut)
            return first.sum(), second * 2

        return step, []

    eager, _, fn = _calls(mesh1, make, [1, 1, 1, 2, 2, 2, 2])
    assert fn.eager_because is None
    (rec,) = fn.recordings.values()
    assert rec.guards and rec.replays >= 2


def test_an_op_that_makes_a_sparse_tensor_runs_the_rest_of_the_call_eagerly(mesh1):
    """A sparse result's structure (nnz) is data too, and a replay's proxy could not follow
    it: the call goes on eagerly from the op, and the function is eager after 4 such calls."""
    with mesh1.activate():
        @tdmesh.compile
        def fn(x):
            return ((x * 2).to_sparse() * 3).to_dense() + 1

        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            outs = [inspect(fn(torch.eye(2) * i)).tolist() for i in range(6)]
    assert outs == [[[6.0 * i + 1, 1.0], [1.0, 6.0 * i + 1]] for i in range(6)]
    text = [str(w.message) for w in said if "runs eagerly" in str(w.message)]
    assert len(text) == 1 and "sparse result" in text[0] and "remote function" in text[0], text


def test_a_miss_at_a_later_shape_binds_the_outputs_of_an_earlier_one(mesh1):
    """The first selection keeps the same elements at every call (a guard that holds); the second's
    length changes: the call goes on from the second read, and the re-run's first selection (its
    proxy made from the read's value, the op matched, not sent) is bound to the replay's."""
    def make():
        def step(x):
            kept = x[x > 0]            # always five: its guard holds
            scale = kept.max()
            picked = kept[kept > 6]    # its length changes with x
            return kept * scale, picked + scale, picked.sum()

        return step, []

    eager, _, fn = _calls(mesh1, make, [1, 1, 1, 2, 2, 2, 2, 3, 3, 3])
    assert {tuple(e[0].shape) for e in eager} == {(5,)}  # arange(6) * v: five elements above 0
    assert {tuple(e[1].shape) for e in eager} == {(0,), (2,), (3,)}
    assert fn.eager_because is None
    (rec,) = fn.recordings.values()
    assert len(rec.guards) == 2 and rec.replays >= 1

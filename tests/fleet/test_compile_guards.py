"""Host reads inside a compiled function as guards (tdmesh.programs.guards, tdmesh.programs.resume):
a read value that stays the same replays the recording's parts with one read between them; a
new value goes on from the read, as the function run eagerly would; a value that changes at
every call makes the function eager with one warning; a re-run that cannot go on raises.
Each is compared with the same function run eagerly on the same mesh."""

from __future__ import annotations

import warnings

import pytest
import torch

import tdmesh
from tdmesh import inspect
from tdmesh.errors import UsageError


def _both(mesh, make, inputs, backend="program"):
    """Run ``make()``'s function eagerly and compiled on the same inputs: (eager, compiled, fn)."""
    results = []
    fn = None
    for compiled in (False, True):
        with mesh.activate():
            f, state = make()
            g = tdmesh.compile(f, backend=backend) if compiled else f
            outs = [inspect(g(torch.full((4,), float(v)))) for v in inputs]
            results.append((outs, [inspect(t) for t in state]))
            fn = g
    return results[0], results[1], fn


def _threshold_step():
    w = torch.zeros(4)
    hits = torch.zeros(())

    def step(x):
        y = x * 2 + w  # made before the read, used after it
        view = y[1:]   # a view of a tensor that crosses the read
        if bool(y.sum() > 40):
            hits.add_(1)
            w.sub_(1)
            return view * 10
        w.add_(x)
        return view + y[0]

    return step, [w, hits]


def test_a_read_that_keeps_its_value_replays_and_a_new_value_goes_on_from_the_read(mesh2x2):
    inputs = [1, 1, 1, 1, 9, 9, 9, 1, 1, 1, 1]
    eager, compiled, fn = _both(mesh2x2, _threshold_step, inputs)
    for e, c in zip(eager[0], compiled[0]):
        assert torch.equal(e, c)
    assert all(torch.equal(a, b) for a, b in zip(eager[1], compiled[1]))
    assert fn.eager_because is None
    # traced: the first call and the one after each miss (the first 9, the first 1 after the nines)
    (rec,) = fn.recordings.values()
    assert rec.guards and rec.segments is not None and rec.replays >= 2


def test_inductor_compiles_each_part_and_a_miss_goes_on_from_the_read(mesh1):
    eager, compiled, fn = _both(mesh1, _threshold_step, [1, 1, 1, 9, 1], backend="inductor")
    assert all(torch.equal(e, c) for e, c in zip(eager[0], compiled[0]))
    assert all(torch.equal(a, b) for a, b in zip(eager[1], compiled[1]))
    (rec,) = fn.recordings.values()
    assert rec.mode == "inductor" and len(rec.segments) == 2


def _train_both(mesh, module, make_opt, make_step, data) -> tuple[list, list, object]:
    """Train ``module()`` from the same weights eagerly and compiled from the first call, one call
    of ``make_step(model, opt)`` per batch of ``data``: both runs' (values, parameters) and the
    compiled function."""
    torch.manual_seed(0)
    with tdmesh.no_mesh.activate():
        init = module().state_dict()
    runs = []
    fn = None
    for compiled in (False, True):
        with mesh.activate(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = module()
            model.load_state_dict(tdmesh.to_mesh(init, mesh))
            fn = make_step(model, make_opt(model))
            fn = tdmesh.compile(fn) if compiled else fn
            values = [fn(tdmesh.to_mesh(x, mesh)) for x in data]
            runs.append(([None if v is None else inspect(v).item() for v in values],
                         [inspect(p.detach()) for p in model.parameters()]))
    (eager_values, eager_params), (values, params) = runs
    assert eager_values == values
    assert all(torch.equal(a, b) for a, b in zip(eager_params, params))
    return values, params, fn


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_a_read_before_backward_holds_the_graph_across_it(mesh1):
    def make_step(model, opt):
        def step(x):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            if bool(x.mean() < 0):  # the forward's graph crosses the read
                loss = loss * 3
            loss.backward()
            opt.step()
            return loss.detach()
        return step

    data = [torch.full((3, 4), float(v)) for v in (1, -1, 1, 1, -1, -1, 1)]
    _train_both(mesh1, lambda: torch.nn.Linear(4, 1), _sgd, make_step, data)


def test_a_value_that_changes_every_call_makes_the_function_eager_with_one_warning(mesh1):
    with mesh1.activate():
        counter = torch.zeros(())

        @tdmesh.compile
        def fn(x):
            counter.add_(1)
            n = int(counter.item())  # like a non-fused optimizer's step counter
            return x * n

        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            outs = [inspect(fn(torch.ones(2)))[0].item() for _ in range(8)]
        assert outs == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
        eager = [w for w in said if "runs eagerly" in str(w.message)]  # (torch may warn too)
        text = [str(w.message) for w in eager]
        assert len(text) == 1 and ".item()" in text[0] and "changes" in text[0] and "fused=True" in text[0], text
        assert eager[0].filename == __file__  # the user's line
        assert fn.eager_because is not None


def test_a_re_run_that_issues_other_ops_before_the_read_raises_and_the_mesh_goes_on(mesh1):
    with mesh1.activate():
        knob = {"scale": 2.0}
        flag = torch.zeros(())

        @tdmesh.compile
        def fn(x):
            y = x * knob["scale"]  # a Python value the recording cannot see
            if bool(flag > 0):
                return y + 1
            return y

        assert inspect(fn(torch.ones(2))).tolist() == [2.0, 2.0]
        assert inspect(fn(torch.ones(2))).tolist() == [2.0, 2.0]  # a replay
        knob["scale"] = 3.0
        flag.fill_(1)
        with pytest.raises(UsageError, match="did not issue the operations it issued before that read"):
            fn(torch.ones(2))
        assert inspect(torch.ones(2) + 1).tolist() == [2.0, 2.0]
        assert inspect(fn(torch.ones(2))).tolist() == [4.0, 4.0]  # traced again


def test_ranks_that_disagree_at_a_replays_read_raise_as_eager_does(mesh2x2):
    with mesh2x2.activate(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shift = torch.zeros(())

        @tdmesh.compile
        def fn(x):
            return x * 2 if bool((x + shift).sum() > 0) else x

        for _ in range(3):
            assert inspect(fn(torch.ones(2))).tolist() == [2.0, 2.0]
        shift.copy_(mesh2x2.rank("gpu") * -10.0)
        with pytest.raises(ValueError, match="disagree"):
            fn(torch.ones(2))
        shift.zero_()
        assert inspect(fn(torch.ones(2))).tolist() == [2.0, 2.0]


def test_cuda_graph_true_refuses_a_function_with_a_read(mesh1):
    with mesh1.activate():
        @tdmesh.compile(cuda_graph=True)
        def fn(x):
            return x * 2 if bool(x.sum() > 0) else x

        with pytest.raises(UsageError, match="reads a value on the host"):
            fn(torch.ones(2))


def test_gradient_clipping_that_checks_for_non_finite_norms_replays_past_its_read(mesh1):
    """``clip_grad_norm_(error_if_nonfinite=True)`` reads ``bool(norm is nan or inf)`` every step:
    a value that stays False, so the step replays (its parts) instead of running eagerly."""
    def make_step(model, opt):
        def step(x):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, error_if_nonfinite=True)
            opt.step()
            return loss.detach()
        return step

    data = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    _, _, fn = _train_both(mesh1, lambda: torch.nn.Linear(4, 2), _sgd, make_step, data)
    (rec,) = fn.recordings.values()
    assert rec.guards and rec.replays >= 3 and fn.eager_because is None
    # each part is a program on the worker (the first a CUDA graph on a GPU), the optimizer's part too, which
    # writes the gradients the first part made: state, not results of its own (it ran message by message
    # when it named them so)
    with mesh1.activate():
        modes = tdmesh.call_on_shard_and_fetch(tdmesh.remote("tdmesh.worker.builtins.recording_modes")).result()
    first = "cuda_graph" if mesh1.device_type == "cuda" else "program"
    assert [modes[seg.id] for seg in rec.segments if seg.id is not None] == [first, "program"], modes


def test_a_miss_binds_the_state_the_re_run_drops_before_that_state_is_freed(mesh1):
    """``zero_grad()`` in the re-run drops the gradients the replay wrote (the recording's state)
    and backward makes new ones, which the re-run binds to them at the read: their frees wait
    until then, even when the client flushes in between (a slow step: the flusher runs)."""
    import time

    def make_step(model, opt):
        def step(x):
            opt.zero_grad()  # set_to_none: the state the recording rewrites is dropped here
            time.sleep(0.05)
            model(x).pow(2).mean().backward()
            if bool(x.mean() < 0):
                for p in model.parameters():
                    p.grad.mul_(-1)
            opt.step()
        return step

    data = [torch.full((3, 4), float(v)) for v in (1, 1, 1, -1, 1)]
    _train_both(mesh1, lambda: torch.nn.Linear(4, 1), lambda m: torch.optim.SGD(m.parameters(), lr=0.1), make_step,
                data)


def test_a_miss_inside_a_foreach_optimizer_that_reads_its_step_counters(mesh1):
    """AdamW(foreach=True) reads each step counter with ``.item()``: every replay misses inside
    ``opt.step()``, after a data-dependent branch before backward that it passed; the re-run
    goes on from there and trains as eager torch does (the differential test's failing
    example of the 3,000-example run was this program; the next test is its cause, reduced)."""
    def make_step(model, opt):
        def step(x):
            opt.zero_grad(set_to_none=False)
            loss = model(x).pow(2).mean()
            if bool(x.mean() < 0):
                loss = loss * 2
            loss.backward()
            opt.step()
            return loss.detach()
        return step

    data = [torch.full((3, 4), float(v)) for v in (1, 1, 1, -1, -1, 1, 1)]
    _train_both(mesh1, lambda: torch.nn.Linear(4, 4),
                lambda m: torch.optim.AdamW(m.parameters(), lr=0.05, foreach=True), make_step, data)


def test_a_miss_re_runs_ops_that_write_a_tensor_the_replay_made_a_view_of(mesh1):
    """The replay's proxy of a view of a captured tensor is alive while the re-run writes that
    tensor: the re-run's op lists it among the aliases it writes, the trace's did not; the ops
    are the same all the same."""
    with mesh1.activate():
        w = torch.zeros(4)

        @tdmesh.compile
        def fn(x):
            v = w[1:]  # a view of a captured tensor, held across the read
            w.add_(x)
            if bool(x.sum() > 10):
                return v * 2
            return v + 1

        outs = [inspect(fn(torch.full((4,), float(s)))).tolist() for s in (1, 1, 1, 9, 1)]
    assert outs == [[2.0] * 3, [3.0] * 3, [4.0] * 3, [24.0] * 3, [14.0] * 3]

"""``tdmesh.compile`` from the first call: state the function makes, changes the program makes
between calls, and host reads -- each compared with the same code run eagerly on the mesh."""

from __future__ import annotations

import warnings

import pytest
import torch

import tdmesh
from tdmesh import inspect
from tdmesh.programs.recording import EAGER_AFTER


def _linear_step(mesh, set_to_none=True, scheduler=False, lr=0.1, **opt_kw):
    torch.manual_seed(0)
    with tdmesh.no_mesh.activate():
        state = torch.nn.Linear(4, 3).state_dict()
    with mesh.activate():
        lin = torch.nn.Linear(4, 3)
        lin.load_state_dict(tdmesh.to_mesh(state, mesh))
        opt = torch.optim.SGD(lin.parameters(), lr=lr, **opt_kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if scheduler else None

    def step(x):
        loss = lin(x).square().mean()
        opt.zero_grad(set_to_none=set_to_none)
        loss.backward()
        opt.step()
        return loss.detach()

    return lin, opt, sched, step


def _train(mesh, compiled: bool, steps=6, **kw):
    lin, opt, sched, step = _linear_step(mesh, **kw)
    fn = tdmesh.compile(step) if compiled else step
    with mesh.activate():
        x = tdmesh.to_mesh(torch.arange(20.0).reshape(5, 4) / 10, mesh)
        losses = []
        for _ in range(steps):
            losses.append(fn(x))
            if sched is not None:
                sched.step()
        got = [inspect(v).item() for v in losses], inspect([p.detach() for p in lin.parameters()])
    return got, fn, lin, opt


@pytest.mark.parametrize("set_to_none", [True, False])
def test_optimizer_state_made_in_the_first_call(mesh1, set_to_none):
    (want, want_params), _, _, _ = _train(mesh1, False, set_to_none=set_to_none, momentum=0.9)
    (got, params), fn, _, _ = _train(mesh1, True, set_to_none=set_to_none, momentum=0.9)
    assert got == want and all(torch.equal(a, b) for a, b in zip(params, want_params))
    # the momentum buffers (and, kept as None-then-new, the gradients) are state: eager first
    (rec,) = fn.recordings.values()
    assert fn.traces == (3 if set_to_none else 2)
    assert rec.replays == 6 - fn.traces
    assert len(rec.kept_refs) == (2 if set_to_none else 0)  # set_to_none: the new gradients, rewritten in place


def test_a_learning_rate_scheduler_is_not_baked_in(mesh1):
    """A float lr changed between calls makes the recording stale (the optimizer's settings are
    checked at each replay): every step traces again until the function runs eagerly, warning."""
    (want, _), _, _, _ = _train(mesh1, False, scheduler=True, steps=EAGER_AFTER + 3)
    with pytest.warns(UserWarning, match=r"runs eagerly from now on: .*the settings of SGD changed.*tensor lr="):
        (got, _), fn, _, _ = _train(mesh1, True, scheduler=True, steps=EAGER_AFTER + 3)
    assert got == want and fn.eager_because is not None


def test_a_tensor_learning_rate_updated_in_place_replays(mesh1):
    """The way out the warning names: a tensor lr is read where it is, so the scheduler's
    in-place updates reach the replays."""
    def run(compiled):
        lin, opt, _, step = _linear_step(mesh1, lr=torch.tensor(0.1), momentum=0.9, fused=True)
        with mesh1.activate():
            opt.param_groups[0]["lr"] = tdmesh.to_mesh(torch.tensor(0.1), mesh1)
            fn = tdmesh.compile(step) if compiled else step
            x = tdmesh.to_mesh(torch.ones(5, 4), mesh1)
            out = []
            for _ in range(6):
                out.append(inspect(fn(x)).item())
                opt.param_groups[0]["lr"].mul_(0.5)
        return out, fn
    want, _ = run(False)
    got, fn = run(True)
    assert got == want and fn.eager_because is None
    assert sum(r.replays for r in fn.recordings.values()) >= 2


def test_state_dropped_or_replaced_between_calls_is_traced_again(mesh1):
    """Gradients set to None outside, optimizer state replaced by load_state_dict: a replay
    would read tensors the program no longer holds, so the call traces again."""
    def run(compiled):
        lin, opt, _, step = _linear_step(mesh1, set_to_none=False, momentum=0.9)
        fn = tdmesh.compile(step) if compiled else step
        with mesh1.activate():
            x = tdmesh.to_mesh(torch.ones(5, 4), mesh1)
            out = [inspect(fn(x)).item() for _ in range(3)]
            saved = opt.state_dict()
            for p in lin.parameters():
                p.grad = None
            out += [inspect(fn(x)).item() for _ in range(3)]
            opt.load_state_dict(saved)  # new state tensors (copies), the old ones dropped
            out += [inspect(fn(x)).item() for _ in range(3)]
        return out, fn
    want, _ = run(False)
    got, fn = run(True)
    assert got == want and fn.eager_because is None


def test_state_that_grows_every_call_runs_eagerly_with_a_warning(mesh1):
    with mesh1.activate():
        history = []

        def fn(x):
            history.append(x * 2)  # a new tensor every call, the old ones kept: no recording can do it
            return x + 1

        compiled = tdmesh.compile(fn)
        with pytest.warns(UserWarning, match="runs eagerly from now on: it made new state"):
            for i in range(EAGER_AFTER + 2):
                compiled(torch.full((2,), float(i)))
        assert [inspect(h)[0].item() for h in history] == [2.0 * i for i in range(EAGER_AFTER + 2)]


def test_state_rebound_to_a_new_tensor_runs_eagerly_naming_in_place(mesh1):
    with mesh1.activate():
        ema = {"v": torch.zeros(2)}

        def fn(x):
            ema["v"] = ema["v"] * 0.5 + x  # reads the old tensor, leaves it unreachable
            return x

        compiled = tdmesh.compile(fn)
        with pytest.warns(UserWarning, match=r"update such state in place"):
            for _ in range(EAGER_AFTER + 1):
                compiled(torch.ones(2))
        want = 0.0
        for _ in range(EAGER_AFTER + 1):
            want = want * 0.5 + 1
        assert inspect(ema["v"])[0].item() == want


def test_in_place_state_made_lazily_compiles(mesh1):
    with mesh1.activate():
        box: dict = {}

        @tdmesh.compile
        def fn(x):
            if "total" not in box:
                box["total"] = torch.zeros(2)
            box["total"].add_(x)
            return x * 1

        for i in range(5):
            fn(torch.full((2,), float(i)))
        assert inspect(box["total"])[0].item() == 10.0
        assert fn.traces == 2 and fn.eager_because is None


def test_host_reads_of_ranks_that_disagree_raise(mesh2x2):
    with mesh2x2.activate():
        x = torch.ones(2, 2) * (mesh2x2.rank("gpu") + 1)
        with pytest.raises(ValueError, match=r"(?s)disagree on it:.*'gpu': 0}: False.*'gpu': 1}: True.*reduce"):
            bool(x[0, 1] > 1)
        for read in (lambda: x[0, 0].item(), lambda: float(x[0, 0]), lambda: x.tolist(), lambda: f"{x[0, 0]:.2f}",
                     lambda: torch.equal(x, torch.ones(2, 2))):
            with pytest.raises(ValueError, match="disagree"):
                read()
        same = x.reduce("gpu", "sum")
        assert same.tolist() == [[3.0, 3.0], [3.0, 3.0]]
        assert f"{same[0, 0]:.3f}" == "3.000" and same[0, 0].item() == 3.0 and bool(same[0, 0] > 2)
        nan = torch.full((), float("nan"))
        assert nan.item() != nan.item()  # NaN on every rank agrees
        with pytest.raises(TypeError, match="fetch_shard"):
            x.numpy()


def test_host_read_in_a_compiled_function_reads_every_rank(mesh2x2):
    with mesh2x2.activate(), warnings.catch_warnings():
        warnings.simplefilter("ignore")

        @tdmesh.compile
        def fn(x):
            return x * 2 if bool(x.sum() > 0) else x

        with pytest.raises(ValueError, match="disagree"):
            fn(torch.ones(2) * (mesh2x2.rank("gpu") - 0.5))
        assert inspect(fn(torch.ones(2)))[0].item() == 2.0


def test_state_made_with_a_local_constant_shipped_inside_settles(mesh1):
    """A local tensor copied to the mesh inside the step (``torch.tensor(local)``, as some
    Hugging Face code does) travels with its bytes: two traces of equal bytes are the same
    messages, so the state settles (it did not: each trace's buffer object compared unequal)."""
    with tdmesh.no_mesh.activate():
        two = torch.full((), 2.0)
    with mesh1.activate():
        box: dict = {}

        @tdmesh.compile
        def fn(x):
            box["y"] = x * torch.tensor(two)  # new state every call, the last one's dropped
            return x + 1

        for i in range(5):
            fn(torch.full((2,), float(i)))
        assert inspect(box["y"])[0].item() == 8.0
        assert fn.traces == 2 and fn.eager_because is None
        assert sum(r.replays for r in fn.recordings.values()) == 3

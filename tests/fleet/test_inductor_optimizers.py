"""A training step under ``tdmesh.compile(backend="inductor")`` takes the optimizer into inductor's
graphs: torch's multi-tensor optimizers write the parameters and their state with in-place
``_foreach_*_`` ops, which return nothing.  Before, those ops ran between the graphs as aten's
own kernels, each one splitting the step (on an H100 the GPT-2 step's foreach AdamW took twice the
fused kernel's time).  Hypothesis draws the optimizer, its flags and the model; the compiled
steps must give eager's parameters and optimizer state (inductor's kernels round differently:
close, not equal), and no ``_foreach_`` op may run outside the worker's graphs.  A second test writes
a compiled function's arguments, captured tensors and a view in place with the user's own calls."""

from __future__ import annotations

import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import tdmesh
from tdmesh import fetch_shard, remote

recording_graphs = remote("tdmesh.worker.builtins.recording_graphs")

OPTIMIZERS = {  # torch's multi-tensor optimizers whose CPU step reads no value on the host
    "sgd": (torch.optim.SGD, [{"momentum": 0.9}, {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
                              {"momentum": 0.5, "dampening": 0.1, "maximize": True}]),
    "rmsprop": (torch.optim.RMSprop, [{}, {"momentum": 0.9, "centered": True}, {"weight_decay": 0.01}]),
    "adadelta": (torch.optim.Adadelta, [{}, {"weight_decay": 0.01}]),
}
LAYERS = {"gelu": torch.nn.GELU, "tanh": torch.nn.Tanh, "layernorm": lambda: torch.nn.LayerNorm(8)}


@st.composite
def setups(draw) -> dict:
    name = draw(st.sampled_from(sorted(OPTIMIZERS)))
    return {"optimizer": name, "options": draw(st.sampled_from(OPTIMIZERS[name][1])),
            "layers": draw(st.lists(st.sampled_from(sorted(LAYERS)), max_size=2)),
            "set_to_none": draw(st.booleans()), "seed": draw(st.integers(0, 2**16))}


def _train(mesh, setup: dict, compiled: bool):
    """Two eager steps (the optimizer's state is made), then four more, compiled or not: the losses, the
    parameters and the optimizer's state at the end, the parameters before the four, and the compiled
    function (None when eager)."""
    with mesh.activate():
        tdmesh.random.set_manual_seed_remote(setup["seed"])
        model = torch.nn.Sequential(torch.nn.Linear(5, 8), *[LAYERS[k]() for k in setup["layers"]],
                                    torch.nn.Linear(8, 3))
        cls, _ = OPTIMIZERS[setup["optimizer"]]
        opt = cls(model.parameters(), lr=0.01, foreach=True, **setup["options"])
        data = [(torch.randn(6, 5), torch.randn(6, 3)) for _ in range(6)]

        def step(x, y):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=setup["set_to_none"])
            return loss.detach()

        for x, y in data[:2]:
            step(x, y)
        before = fetch_shard([p.detach() for p in model.parameters()]).result()
        fn = tdmesh.compile(step, backend="inductor") if compiled else step
        losses = [fn(x, y) for x, y in data[2:]]
        state = [[v for v in s.values() if isinstance(v, torch.Tensor)] for s in opt.state.values()]
        return fetch_shard([losses, [p.detach() for p in model.parameters()], state]).result(), before, \
            (fn if compiled else None)


def _close(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a, b, rtol=1e-3, atol=1e-5)
    return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor's CPU kernels need a C++ compiler")
@pytest.mark.time_limit(600)
@seed(55)
@settings(max_examples=3, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(setup=setups())
def test_a_multi_tensor_optimizer_runs_inside_the_inductor_graphs(mesh1, setup):
    eager, before, _ = _train(mesh1, setup, compiled=False)
    compiled, _, fn = _train(mesh1, setup, compiled=True)
    assert _close(eager, compiled), (setup, eager, compiled)
    assert not _close(before, eager[1]), setup  # the four steps moved the parameters
    assert fn.mode == "inductor", (fn.mode, fn.eager_because)
    with mesh1.activate():
        graphs = tdmesh.call_on_shard_and_fetch(recording_graphs).result()[fn.recording_id]
    assert graphs["graphs"] >= 1 and not [op for op in graphs["outside"] if "_foreach_" in op], (setup, graphs)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor's CPU kernels need a C++ compiler")
def test_in_place_multi_tensor_ops_write_the_callers_tensors_captures_and_views_as_eager_does(mesh1):
    """The user's own ``_foreach_*_`` calls in a compiled function: on its arguments (the caller sees them
    written), on tensors it captures, and on a view of an argument written before; four calls each."""
    def run(compiled: bool):
        with mesh1.activate():
            args = [torch.arange(4.0) + i for i in range(3)]
            captured = [torch.ones(2, 2) * i for i in range(3)]

            def body(a, x):
                torch._foreach_mul_(a, 2.0)
                torch._foreach_add_(captured, a[0][:2].sum(), alpha=0.5)  # a tensor operand: no host read
                v = a[1][1:3]
                torch._foreach_addcmul_([v], [v], [v], value=0.5)
                return x + v.sum()

            fn = tdmesh.compile(body, backend="inductor") if compiled else body
            outs = [fn(args, torch.ones(1)) for _ in range(4)]
            values = fetch_shard([args, captured, outs]).result()
            graphs = tdmesh.call_on_shard_and_fetch(recording_graphs).result()[fn.recording_id] if compiled else None
            return values, graphs

    eager, _ = run(False)
    compiled, graphs = run(True)
    assert _close(eager, compiled), (eager, compiled)
    assert graphs == {"graphs": 1, "outside": {}}, graphs


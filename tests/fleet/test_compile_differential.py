"""Eager against compiled, from the first call: hypothesis draws small training programs
(modules, optimizer and its flags, ``zero_grad`` placement and ``set_to_none``, gradient
accumulation, state made lazily inside the step, host reads, shapes the data decides) and runs each twice on a 1x2
CPU mesh, eagerly and under ``tdmesh.compile`` from its first call.  After every step the
losses, parameters, gradients, buffers and optimizer state of both ranks must be identical.

``TDMESH_DIFFERENTIAL_EXAMPLES`` sets the number of examples (CI: 150) and
``TDMESH_DIFFERENTIAL_SEED`` hypothesis's seed (CI: 26).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import tdmesh
from tdmesh.config import env_int

EXAMPLES = env_int("TDMESH_DIFFERENTIAL_EXAMPLES")
SEED = env_int("TDMESH_DIFFERENTIAL_SEED")
STEPS = 5  # state that is made anew every call settles at the third: steps 4 and 5 replay
# a read whose value changes at every call (a non-fused Adam's step counters) makes the function
# eager for good at the sixth call (a miss, a new trace, ... four in a row); a data-dependent
# branch takes either side in the steps drawn, and a mask keeps all rows or fewer
CHANGING_STEPS = 7
WIDTH = 4

LAYERS = ("linear", "layernorm", "batchnorm", "linear_relu_", "tanh", "gelu", "dropout0")
OPTIMIZERS = {  # name -> (class, keyword sets torch allows on CPU)
    "sgd": (torch.optim.SGD, [{}, {"momentum": 0.9}, {"momentum": 0.9, "nesterov": True},
                              {"momentum": 0.9, "weight_decay": 0.01}]),
    "adam": (torch.optim.Adam, [{}, {"amsgrad": True}, {"weight_decay": 0.01}]),
    "adamw": (torch.optim.AdamW, [{}, {"amsgrad": True}]),
}
FLAGS = [{}, {"foreach": True}, {"foreach": False}, {"fused": True}]


@st.composite
def programs(draw) -> dict:
    name = draw(st.sampled_from(sorted(OPTIMIZERS)))
    return {
        "embedding": draw(st.booleans()),
        "layers": draw(st.lists(st.sampled_from(LAYERS), min_size=1, max_size=4)),
        "optimizer": name,
        "options": {**draw(st.sampled_from(OPTIMIZERS[name][1])), **draw(st.sampled_from(FLAGS))},
        "set_to_none": draw(st.booleans()),
        "zero_grad": draw(st.sampled_from(["start", "end"])),
        "accumulate": draw(st.integers(1, 2)),
        "lazy_state": draw(st.booleans()),
        "host_read": draw(st.sampled_from([None, None, "item", "bool", "tolist", "branch", "select"])),
        "seed": draw(st.integers(0, 2**16)),
    }


class Model(torch.nn.Module):
    def __init__(self, prog: dict) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, WIDTH) if prog["embedding"] else None
        make = {"linear": lambda: torch.nn.Linear(WIDTH, WIDTH), "layernorm": lambda: torch.nn.LayerNorm(WIDTH),
                "batchnorm": lambda: torch.nn.BatchNorm1d(WIDTH),
                "linear_relu_": lambda: torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(inplace=True)),
                "tanh": torch.nn.Tanh, "gelu": torch.nn.GELU, "dropout0": lambda: torch.nn.Dropout(0.0)}
        self.body = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), *[make[k]() for k in prog["layers"]])
        self.lazy = prog["lazy_state"]
        self.running: torch.Tensor | None = None  # made at the first forward: lazily built state

    def forward(self, x):
        h = self.body(self.embed(x) if self.embed is not None else x)
        if self.lazy:
            if self.running is None:
                self.running = torch.zeros(WIDTH)
            self.running.mul_(0.5).add_(h.detach().mean(0))
            h = h + self.running
        return h


def _trainer(prog: dict, mesh, initial: dict):
    torch.manual_seed(0)
    with tdmesh.no_mesh.activate():
        model = Model(prog)
    with mesh.activate():
        model = Model(prog)  # parameters on the mesh, set to the same values for both runs
        model.load_state_dict(tdmesh.to_mesh(initial, mesh))
        cls, _ = OPTIMIZERS[prog["optimizer"]]
        opt = cls(model.parameters(), lr=0.05, **prog["options"])

    middle = 4.5 if prog["embedding"] else 0.0

    def step(x, y):
        if prog["zero_grad"] == "start":
            opt.zero_grad(set_to_none=prog["set_to_none"])
        total = None
        for i in range(prog["accumulate"]):
            out, target = model(x[i]), y[i]
            if prog["host_read"] == "select":  # rows a mask keeps: a shape the data decides, before backward
                keep = y[i].reduce("gpu", "avg")[:, 0] > -2.0  # the ranks agree on it; all rows, mostly
                out, target = out[keep], target[keep]
            loss = torch.nn.functional.mse_loss(out, target)
            if prog["host_read"] == "branch" and bool(x[i].float().mean().reduce("gpu", "avg") > middle):
                loss = loss * 2  # a branch the data decides, with the forward's graph held across the read
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        agreed = total.reduce("gpu", "avg")  # the ranks' losses differ: a host read of one would raise
        if prog["host_read"] == "item" and agreed.item() > 1e6:
            total = total * 0
        elif prog["host_read"] == "bool" and bool(agreed > 1e6):
            total = total * 0
        elif prog["host_read"] == "tolist" and agreed.tolist() > 1e6:
            total = total * 0
        opt.step()
        if prog["zero_grad"] == "end":
            opt.zero_grad(set_to_none=prog["set_to_none"])
        return total

    return model, opt, step


def _snapshot(model, opt, loss) -> list:
    tree = {"loss": loss,
            "params": [p.detach() for p in model.parameters()],
            "grads": [None if p.grad is None else p.grad.detach() for p in model.parameters()],
            "buffers": [b for b in model.buffers()] + ([model.running] if model.running is not None else []),
            "opt": [[v for v in s.values() if isinstance(v, torch.Tensor)] for s in opt.state.values()]}
    return [tdmesh.fetch_shard(tree, host=0, gpu=g).result() for g in (0, 1)]


def _run(prog: dict, mesh, initial: dict, data: list, compiled: bool) -> tuple[list, object]:
    model, opt, step = _trainer(prog, mesh, initial)
    fn = tdmesh.compile(step) if compiled else step
    snapshots = []
    with mesh.activate():
        for x, y in data:
            loss = fn(x, y)
            snapshots.append(_snapshot(model, opt, loss))
    return snapshots, fn


def _data(prog: dict, mesh) -> list:
    g = torch.Generator().manual_seed(prog["seed"])
    steps = []
    for _ in range(_steps(prog)):
        if prog["embedding"]:
            x = torch.randint(0, 9, (prog["accumulate"], 6), generator=g)
        else:
            x = torch.randn(prog["accumulate"], 6, WIDTH, generator=g)
        y = torch.randn(prog["accumulate"], 6, WIDTH, generator=g)
        with mesh.activate():
            rank = mesh.rank("gpu")  # the ranks train on different data
            x = tdmesh.to_mesh(x, mesh) + (rank if prog["embedding"] else rank * 0.5)
            steps.append((x, tdmesh.to_mesh(y, mesh) - rank))
    return steps


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


@pytest.fixture(scope="module")
def mesh1x2():
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as mesh:
        yield mesh


@pytest.mark.time_limit(max(600, 3 * EXAMPLES))  # ~0.5 s an example on 2 cores; a hang fails (tests/_watchdog.py)
@seed(SEED)
@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(prog=programs())
def test_compiled_training_equals_eager_from_the_first_step(mesh1x2, prog):
    torch.manual_seed(prog["seed"])
    with tdmesh.no_mesh.activate():
        initial = Model(prog).state_dict()
    data = _data(prog, mesh1x2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the host-read programs warn that they run eagerly
        eager, _ = _run(prog, mesh1x2, initial, data, compiled=False)
        compiled, fn = _run(prog, mesh1x2, initial, data, compiled=True)
    for i, (e, c) in enumerate(zip(eager, compiled)):
        assert _equal(e, c), f"step {i + 1} differs for {prog}:\neager    {e}\ncompiled {c}"
    replays = sum(r.replays for r in fn.recordings.values())
    if _changing(prog):  # a value that changes at every call: eager for good, with the warning
        assert fn.eager_because is not None and "changes" in fn.eager_because, (fn.eager_because, prog)
    elif prog["host_read"] not in ("branch", "select"):  # steps after the state settled replayed, past their reads
        assert replays >= 2 and fn.eager_because is None, (replays, fn.misses, prog)


def _changing(prog: dict) -> bool:
    """Whether the step reads a value that changes at every call: the loss (``item``, ``tolist``;
    ``bool`` reads whether it is large, always False), or the step counters that torch's
    Adam/AdamW read without fused=True (and capturable=False, CPU's only choice)."""
    return prog["host_read"] in ("item", "tolist") or (prog["optimizer"] != "sgd" and not prog["options"].get("fused"))


def _steps(prog: dict) -> int:
    return CHANGING_STEPS if _changing(prog) or prog["host_read"] in ("branch", "select") else STEPS

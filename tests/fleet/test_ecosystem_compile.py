"""``torch.compile`` on the client, and the op plans the client caches, across torch's modes.

Hypothesis draws a small function of matmuls, elementwise ops, reductions and views on mesh tensors, and a
sequence of modes it runs in -- plain, ``torch.compile`` (dynamo with each backend), ``torch.func.functionalize``,
``FakeTensorMode``, inference mode, ``no_grad``, autocast -- so that a plan made under one mode is reused under
the next.  Each run is compared with local torch running the same function under the same mode (fake mode: the
same metadata).  Before, ``torch.compile`` of such a function compiled tdmesh's own dispatch frames and baked a
plan into them: a second matmul came back with the first one's shape (a silent desync)."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import tdmesh

OPS = ["matmul", "relu", "add", "t_matmul", "sum0", "reshape", "mul_scalar", "softmax", "gelu"]
MODES = ["plain", "eager", "aot_eager", "inductor", "functionalize", "fake", "inference", "no_grad", "autocast"]


@pytest.fixture(scope="module")
def mesh():
    with tdmesh.local_mesh(hosts=1, gpus_per_host=1) as m:
        yield m


def program(ops: list[str], ws: list):
    """``f(x)`` applying ``ops`` in turn; ``ws`` are its captured weights (closures, as a model's)."""
    def f(x):
        for i, op in enumerate(ops):
            w = ws[i % len(ws)]
            if op == "matmul":
                x = x @ w[: x.shape[-1], : x.shape[-1]]
            elif op == "t_matmul":
                x = x @ w[: x.shape[-1], : x.shape[-1]].t()
            elif op == "relu":
                x = x.relu()
            elif op == "add":
                x = x + w[0, : x.shape[-1]]
            elif op == "sum0":
                x = x.sum(0, keepdim=True) + x
            elif op == "reshape":
                x = x.reshape(x.shape[-1], -1).t().reshape(x.shape)
            elif op == "mul_scalar":
                x = x * 1.5
            elif op == "softmax":
                x = torch.softmax(x, -1)
            else:
                x = torch.nn.functional.gelu(x)
        return x
    return f


def run(f, x, mode: str):
    if mode == "plain":
        return f(x)
    if mode in ("eager", "aot_eager", "inductor"):
        torch._dynamo.reset()
        return torch.compile(f, backend=mode)(x)
    if mode == "functionalize":
        return torch.func.functionalize(f)(x)
    if mode == "fake":
        with FakeTensorMode(allow_non_fake_inputs=True):
            return f(x)
    if mode == "inference":
        with torch.inference_mode():
            return f(x)
    if mode == "no_grad":
        with torch.no_grad():
            return f(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return f(x)


@settings(max_examples=40, deadline=None, database=None)
@given(ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=5), modes=st.lists(st.sampled_from(MODES),
       min_size=1, max_size=4), rows=st.integers(1, 5), width=st.integers(2, 6), seed=st.integers(0, 2**16))
def test_code_on_a_mesh_under_any_mode_equals_local_torch_under_it(mesh, ops, modes, rows, width, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g)
    ws = [torch.randn(8, 8, generator=g) for _ in range(2)]
    local = program(ops, ws)
    with mesh.activate(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dynamo's and tdmesh's notes on what runs eagerly
        mx, mws = torch.tensor(x), [torch.tensor(w) for w in ws]
        remote = program(ops, mws)
        for mode in ["plain", *modes, "plain"]:  # plans made in one mode, reused by the next
            got = run(remote, mx, mode)
            with tdmesh.no_mesh.activate():
                want = run(local, x, "eager" if mode in ("aot_eager", "inductor") else mode)
            assert tuple(got.shape) == tuple(want.shape) and got.dtype == want.dtype, (mode, ops)
            if mode != "fake":
                assert torch.equal(tdmesh.fetch_shard(got).result(), want), (mode, ops)

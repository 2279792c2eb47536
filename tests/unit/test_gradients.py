"""``tdmesh.grad_generator`` and ``gradient_execution_order`` on local tensors, against
``torch.autograd.grad``: the graphs of Monarch's own tests, then hypothesis-drawn graphs
(random ops over random leaves, wanted tensors in a random order, one or two roots)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.functional import relu

import tdmesh
from tdmesh import grad_generator, gradient_execution_order


def assert_same(got, expected) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert (g is None) == (e is None), (g, e)
        if e is not None:
            assert g.shape == e.shape and g.dtype == e.dtype
            torch.testing.assert_close(g, e, equal_nan=True)  # a drawn exp can overflow: nan where torch has nan


def test_two_roots_from_one_node():
    t, t2 = torch.rand(2, requires_grad=True), torch.rand(2, requires_grad=True)
    a, b = torch.std_mean(t + t2)
    assert_same(list(grad_generator([a, b], [t2, t])), torch.autograd.grad([a, b], [t2, t], retain_graph=True))


def test_a_pipeline_with_an_unused_tensor():
    t = torch.rand(3, 3, requires_grad=True)
    w = [torch.rand(3, 2, requires_grad=True) for _ in range(3)]
    v = [torch.rand(2, 3, requires_grad=True) for _ in range(3)]
    u = torch.rand(3, 2, requires_grad=True)
    _ = u * u
    a = relu(t @ (w[0] @ v[0]))
    a = relu(a @ (w[1] @ v[1]))
    a = relu(a @ (w[2] @ v[2]))
    std, _ = torch.std_mean(a)
    loss = std + std
    wanted = [t, w[2], v[2], u, w[1], v[1]]
    assert_same(list(grad_generator([loss], wanted)),
                torch.autograd.grad([loss], wanted, allow_unused=True, retain_graph=True))


def test_a_tree_and_an_intermediate_tensor():
    t = torch.rand(3, 3, requires_grad=True)
    t2, t3, t4, t5 = t + t, t * t, t / t, t - t
    total = (t2 * t3 + t4 * t5 + t2 * t4 + t3 * t5).sum()
    assert_same(list(grad_generator([total], [t2, t])), torch.autograd.grad([total], [t2, t], retain_graph=True))


def test_a_broadcast_input():
    t, t2 = torch.rand(3, 3, requires_grad=True), torch.rand(3, requires_grad=True)
    r = (t * (t2 / t2)).sum()
    assert_same(list(grad_generator(r, [t, t2])), torch.autograd.grad([r], [t, t2], retain_graph=True))


def test_execution_order_is_the_reverse_of_first_use():
    t = torch.rand(3, 3, requires_grad=True)
    w1, w2, w3 = (torch.rand(3, 3, requires_grad=True) for _ in range(3))
    u = torch.rand(3, 2, requires_grad=True)
    _ = u * u
    a = relu(relu(relu(t @ w1) @ w2) @ w3)
    std, _ = torch.std_mean(a)
    loss = std + std
    assert gradient_execution_order([loss], [w2, w3, w1, a]) == [3, 1, 0, 2]


def test_a_custom_function_and_grad_function():
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, scale):
            return x * 2 * scale, x.sin()

        @staticmethod
        def backward(ctx, g, h):  # h arrives as zeros: the second output is unused
            return g * 2 * ctx.needs_input_grad[0] * 3, None

    @tdmesh.grad_function
    def cube(x):
        return x ** 3, lambda g: g * 3 * x ** 2

    x = torch.rand(4, requires_grad=True)
    y, _ = Twice.apply(cube(x), 3)
    loss = y.sum()
    assert_same(list(grad_generator(loss, [x])), [3 * 2 * 3 * x.detach() ** 2])


def test_nothing_accumulates_into_grad_and_the_roots_gradient_is_used():
    w = torch.rand(3, requires_grad=True)
    y = w * w
    (g,) = grad_generator(y, [w], grad_roots=[torch.tensor([1.0, 2.0, 3.0])])
    torch.testing.assert_close(g, 2 * w.detach() * torch.tensor([1.0, 2.0, 3.0]))
    assert w.grad is None


def test_bad_arguments_fail_at_the_call():
    w = torch.rand(3, requires_grad=True)
    with pytest.raises(tdmesh.UsageError, match="only a one-element root"):
        grad_generator(w * 2, [w])
    with pytest.raises(tdmesh.UsageError, match="does not require grad"):
        grad_generator((w * 2).sum(), [torch.ones(3)])
    with pytest.raises(tdmesh.UsageError, match="expected a tensor"):
        grad_generator((w * 2).sum(), ["w"])


UNARY = {"sin": torch.sin, "tanh": torch.tanh, "relu": relu, "square": lambda x: x * x, "exp": torch.exp,
         "sum0": lambda x: x.sum(0, keepdim=True), "t": lambda x: x.t(), "chunk": lambda x: torch.chunk(x, 2, 1)[1]}
BINARY = {"add": torch.add, "mul": torch.mul, "sub": torch.sub, "matmul": lambda a, b: a @ b.t()}


@st.composite
def graphs(draw):
    leaves = draw(st.integers(1, 4))
    steps = draw(st.lists(st.tuples(st.sampled_from(sorted(UNARY) + sorted(BINARY)),
                                    st.integers(0, 99), st.integers(0, 99)), min_size=1, max_size=10))
    roots = draw(st.integers(1, 2))
    order = draw(st.permutations(range(leaves + len(steps))))
    wanted = order[:draw(st.integers(1, len(order)))]
    return leaves, steps, roots, wanted, draw(st.integers(0, 2**16))


def build(leaves, steps, seed):
    torch.manual_seed(seed)
    values = [torch.randn(4, 4, dtype=torch.float64, requires_grad=True) for _ in range(leaves)]
    for name, i, j in steps:
        a, b = values[i % len(values)], values[j % len(values)]
        if name in UNARY:
            out = UNARY[name](a)
        else:
            out = BINARY[name](a, b)
        values.append(out.expand(4, 4) if out.shape[0] == 1 else out.repeat(1, 2) if out.shape[1] == 2 else out)
    return values


@settings(max_examples=150, deadline=None)
@given(graphs())
def test_drawn_graphs_match_torch_autograd_grad(graph):
    leaves, steps, roots, wanted, seed = graph
    values = build(leaves, steps, seed)
    outs = [values[-1 - k].sum() for k in range(min(roots, len(values)))]
    chosen = [values[i] for i in wanted]
    expected = torch.autograd.grad(outs, chosen, allow_unused=True, retain_graph=True)
    assert_same(list(grad_generator(outs, chosen)), expected)
    order = gradient_execution_order(outs, chosen)
    assert sorted(order) == list(range(len(chosen)))


def test_each_node_remembers_the_stream_its_forward_ran_on_and_idle_switches_cost_nothing():
    from tdmesh.engine import autograd_context
    from tdmesh.engine.stream import DEFAULT_STREAM
    side = tdmesh.Stream("side")
    a = torch.rand(2, requires_grad=True)
    b = a * 2
    with side.activate():
        c = b * 3
    d = c * 4
    assert autograd_context.forward_context(b.grad_fn._sequence_nr())[:2] == (None, DEFAULT_STREAM)
    assert autograd_context.forward_context(c.grad_fn._sequence_nr())[:2] == (None, side)
    assert autograd_context.forward_context(d.grad_fn._sequence_nr())[:2] == (None, DEFAULT_STREAM)
    ranges = len(autograd_context._ranges.starts)
    for _ in range(100):  # switches with no node made under them leave no entry
        with side.activate():
            pass
    assert len(autograd_context._ranges.starts) == ranges

"""A CPU mesh's proxies take the CPU kernels' output layouts where torch's fake kernels do not
(tdmesh/engine/kernel_layouts.py), checked against those kernels on drawn shapes and layouts:
size-1 dims with any of the strides torch gives them, permuted (channels-last) and expanded
inputs, tensors with gaps, and sizes past the point where the kernel is asked on real inputs."""

import itertools

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tdmesh.engine.kernel_layouts import _batch_norm, _batch_norm_backward
from tdmesh.engine.propagation import TensorMeta, propagate, tensor_meta

aten = torch.ops.aten


class Proxy:
    """What propagation reads of a remote tensor: its metadata."""

    def __init__(self, t: torch.Tensor) -> None:
        self._meta = tensor_meta(t)


def _propagated(func, *args, **kwargs):
    """The proxies' metadata of ``func``'s outputs on a CPU mesh, for local inputs ``args``."""
    proxies = []

    def stand_in(x):
        if isinstance(x, torch.Tensor):
            proxies.append(Proxy(x))
            return proxies[-1]
        return x
    remote = [stand_in(a) for a in args]
    return propagate(func, tuple(remote), dict(kwargs), proxies, None, "cpu").leaves


@st.composite
def laid_out(draw, shape, allow_gaps=True):
    """A tensor of ``shape`` in a drawn layout: dims in any order, size-1 dims with a stride of
    1, of the dim outside them or of the whole tensor, optionally every other element (gaps) or
    expanded along one dim."""
    n = len(shape)
    order = draw(st.permutations(range(n))) if n else []
    gaps = allow_gaps and n > 0 and draw(st.booleans())
    base = torch.randn([shape[d] * (2 if gaps and i == n - 1 else 1) for i, d in enumerate(order)])
    if gaps:
        base = base[..., ::2]
    t = base.permute([order.index(d) for d in range(n)]) if n else base
    stride = list(t.stride())
    for d in range(n):
        if shape[d] == 1:
            stride[d] = draw(st.sampled_from([1, t.numel(), stride[d]]))
    t = t.as_strided(shape, stride, t.storage_offset())
    if n and not gaps and draw(st.integers(0, 4)) == 0:  # expanded along a dim
        d = draw(st.integers(0, n - 1))
        one = t.narrow(d, 0, 1)
        t = one.expand(shape)
    return t


shapes = st.lists(st.sampled_from([1, 1, 2, 3, 5]), min_size=2, max_size=5).map(tuple)


def _assert_as_the_kernel(leaves, real):
    real = [r for r in (real if isinstance(real, (tuple, list)) else (real,))]
    for leaf, r in zip(leaves, real):
        if isinstance(r, torch.Tensor):
            assert leaf.size == tuple(r.shape) and leaf.stride == tuple(r.stride()), (leaf, r.stride())


UNARY = [aten.sqrt.default, aten.neg.default, aten.relu.default, aten.sigmoid.default, aten.exp.default,
         aten.clone.default, aten.gelu.default, aten.hardtanh.default, aten.abs.default]
BINARY = [aten.add.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.hardtanh_backward.default,
          aten.threshold_backward.default, aten.sigmoid_backward.default, aten.maximum.default, aten.eq.Tensor]


@settings(deadline=None)  # the first example pays torch's fake-mode imports
@given(st.data(), shapes, st.sampled_from(UNARY))
def test_unary_outputs_are_laid_out_as_the_cpu_kernel_lays_them_out(data, shape, op):
    x = data.draw(laid_out(shape))
    _assert_as_the_kernel(_propagated(op, x), op(x))


@settings(deadline=None)  # the first example pays torch's fake-mode imports
@given(st.data(), shapes, st.sampled_from(BINARY), st.booleans())
def test_binary_outputs_are_laid_out_as_the_cpu_kernel_lays_them_out(data, shape, op, broadcast):
    a = data.draw(laid_out(shape))
    other = tuple(1 if broadcast and data.draw(st.booleans()) else n for n in shape)
    b = data.draw(laid_out(other))
    args = {aten.hardtanh_backward.default: (-0.5, 0.5), aten.threshold_backward.default: (0.0,)}.get(op, ())
    if op in (aten.hardtanh_backward.default, aten.threshold_backward.default, aten.sigmoid_backward.default):
        b = b.expand(shape)  # a gradient and its input have one shape
    _assert_as_the_kernel(_propagated(op, a, b, *args), op(a, b, *args))


@pytest.mark.parametrize("shape", [(160, 576, 1, 1), (300, 1, 250), (2, 1, 90, 400)])
def test_elementwise_outputs_past_the_probe_size_are_laid_out_as_the_kernel_lays_them_out(shape):
    """Over 65,536 elements the kernel runs on a copy shrunk to 2 a dim, in the same dim order."""
    for order in itertools.permutations(range(len(shape))):
        base = torch.randn([shape[d] for d in order]).permute([order.index(d) for d in range(len(shape))])
        other = torch.randn(shape)
        for op, args in [(aten.sqrt.default, (base,)), (aten.add.Tensor, (base, other)),
                         (aten.hardtanh_backward.default, (other, base, 0.0, 6.0))]:
            _assert_as_the_kernel(_propagated(op, *args), op(*args))


@settings(deadline=None)  # the first example pays torch's fake-mode imports
@given(st.data(), st.lists(st.sampled_from([1, 1, 2, 3]), min_size=3, max_size=5).map(tuple),
       st.booleans(), st.booleans())
def test_batch_norm_outputs_are_laid_out_as_the_cpu_kernel_lays_them_out(data, shape, training, affine):
    channels = shape[1]
    assume(not training or len(torch.empty(shape)[:, 0].flatten()) > 1)  # torch: "more than 1 value per channel"
    x = data.draw(laid_out(shape))
    g = data.draw(laid_out(shape))
    weight, bias = (torch.randn(channels), torch.randn(channels)) if affine else (None, None)
    mean, var = torch.zeros(channels), torch.ones(channels)
    out, saved_mean, saved_invstd = aten.native_batch_norm(x, weight, bias, mean, var, training, 0.1, 1e-5)
    grad_in = aten.native_batch_norm_backward(g, x, weight, mean, var, saved_mean, saved_invstd, training, 1e-5,
                                              [True, affine, affine])[0]
    # the rules themselves (they serve inputs past the probe's size)
    def meta(t):
        return None if t is None else tensor_meta(t)
    assert torch.empty_like(x, memory_format=_batch_norm(meta(x), meta(weight), meta(bias))).stride() == out.stride()
    assert torch.empty_like(x, memory_format=_batch_norm_backward(meta(g), meta(x))).stride() == grad_in.stride()
    # and what a proxy gets
    _assert_as_the_kernel(_propagated(aten.native_batch_norm.default, x, weight, bias, mean, var, training, 0.1,
                                      1e-5), (out,))


@pytest.mark.parametrize("channels_first", [True, False])
def test_a_large_batch_norm_takes_the_kernels_rule_without_running_it(channels_first):
    """A (N, C, 1, 1) batch after a global pool: contiguous and channels-last at once; the CPU
    kernel's output is contiguous where its input is contiguous (the fakes keep the input's strides)."""
    shape = (400, 576, 1, 1)
    x = torch.randn(400 * 576).as_strided(shape, (576, 1, 576, 576) if channels_first else (576, 1, 1, 1))
    weight, bias, mean, var = torch.randn(576), torch.randn(576), torch.zeros(576), torch.ones(576)
    out = aten.native_batch_norm(x, weight, bias, mean, var, True, 0.1, 1e-5)[0]
    leaves = _propagated(aten.native_batch_norm.default, x, weight, bias, mean, var, True, 0.1, 1e-5)
    assert leaves[0] == TensorMeta(shape, tuple(out.stride()), 0, torch.float32)


@settings(deadline=None)  # the first example pays torch's fake-mode imports
@given(st.data(), st.lists(st.sampled_from([1, 2, 3, 6]), min_size=4, max_size=4).map(tuple))
def test_small_inputs_of_other_ops_are_laid_out_as_the_kernel_lays_them_out(data, shape):
    """Not elementwise (a reduction, a pool, a softmax, a convolution): asked of the kernel on
    zeros laid out as the inputs, up to 65,536 elements."""
    x = data.draw(laid_out(shape))
    w = data.draw(laid_out((2, shape[1], 1, 1)))
    for op, args in [(aten.sum.dim_IntList, (x, [1], True)), (aten._softmax.default, (x, 1, False)),
                     (aten.max_pool2d_with_indices.default, (x, [1, 1])),
                     (aten.convolution.default, (x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)),
                     (aten.native_layer_norm.default, (x, [shape[-1]], None, None, 1e-5))]:
        _assert_as_the_kernel(_propagated(op, *args), op(*args))


def test_ops_that_draw_random_numbers_are_never_run_on_the_client():
    """The client's generator is the user's: propagation must not draw from it."""
    x = torch.randn(4, 1, 3).transpose(0, 2)
    state = torch.get_rng_state()
    for op, args in [(aten.bernoulli.p, (x, 0.5)), (aten.native_dropout.default, (x, 0.5, True)),
                     (aten.rand_like.default, (x,)), (aten.multinomial.default, (x.reshape(3, 4).abs(), 2))]:
        _propagated(op, *args)
    assert torch.equal(torch.get_rng_state(), state)


def test_an_op_whose_shrunk_inputs_it_refuses_is_asked_on_the_inputs_as_they_are():
    """``channel_shuffle(x, 3)`` looks elementwise, but 3 groups need 3 channels a group: the shrunk
    run fails and the small inputs run as they are."""
    x = torch.randn(2, 6, 8, 8).contiguous(memory_format=torch.channels_last)
    _assert_as_the_kernel(_propagated(aten.channel_shuffle.default, x, 3), aten.channel_shuffle(x, 3))

"""The client's metadata of a worker's tensor is the one the worker's device makes, found by
running Hugging Face models no one here wrote against local torch, bit for bit:

- SegFormer's depthwise convolution runs on a channels-last view: the CPU kernel's output is
  channels-last, the meta device's contiguous.  The client then took ``linear``'s
  ``matmul`` + ``add`` path (its input "non-contiguous") where torch took ``addmm``: parameters
  a rounding apart after two steps, no error.  Propagation now runs on fake CPU tensors.
- Longformer writes views in place: autograd rebuilds such a view's grad_fn by replaying its
  view ops on the client's proxies and as one ``as_strided`` on plain tensors, so the worker's
  graph was not the client's and backward refused.  Workers replay views too.
- MoE layers (Mixtral, Qwen2-MoE, OLMoE, gpt-oss...) call ``_grouped_mm`` in float32, which
  the CPU kernel runs and torch's meta kernel refuses (it checks CUDA's bfloat16 path): the
  workers now say its metadata.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _logs import kept_records

import tdmesh
from tdmesh import fetch_shard
from tdmesh.engine.backward import COUNTS


def _cpu_only(mesh):
    if mesh.device_type != "cpu":
        pytest.skip("CPU kernels' strides; the CUDA client still propagates on the meta device")


def _depthwise(x, w, b):
    """SegFormer's Mix-FFN convolution: a (batch, tokens, channels) input seen as a channels-last image."""
    y = F.conv2d(x.transpose(1, 2).view(2, 256, 4, 4), w, b, padding=1, groups=256)
    return y.flatten(2).transpose(1, 2)


def test_a_convolutions_proxy_has_the_strides_the_workers_output_has(mesh1):
    _cpu_only(mesh1)
    x, w, b = torch.randn(2, 16, 256), torch.randn(256, 1, 3, 3), torch.randn(256)
    fc = torch.randn(64, 256), torch.randn(64)
    want = _depthwise(x, w, b)
    assert want.is_contiguous()  # channels-last, flattened and transposed: contiguous locally
    with mesh1.activate():
        out = _depthwise(*tdmesh.to_mesh((x, w, b), mesh1))
        assert out.stride() == want.stride() and out.is_contiguous()
        # code that trusts strides reads the elements local torch reads
        strided = out.as_strided((2, 8, 64), (4096, 512, 2), 3)
        linear = F.linear(out, *tdmesh.to_mesh(fc, mesh1))  # addmm, as torch: bit for bit
        got = fetch_shard((out, strided, linear)).result()
    assert torch.equal(got[0], want)
    assert torch.equal(got[1], want.as_strided((2, 8, 64), (4096, 512, 2), 3))
    assert torch.equal(got[2], F.linear(want, *fc))


@pytest.mark.parametrize("memory_format", [torch.channels_last, torch.contiguous_format])
def test_a_channels_last_model_trains_as_it_trains_locally(mesh1, memory_format):
    _cpu_only(mesh1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3, groups=4),
                                torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 2))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 8, 8).contiguous(memory_format=memory_format)

    def train(model, x, fetch):
        model = model.to(memory_format=memory_format)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(3):
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return fetch((losses, [p.detach() for p in model.parameters()]))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a worker runs
    try:
        want = train(model, x, lambda v: v)
    finally:
        torch.set_num_threads(threads)
    with mesh1.activate():
        on_mesh = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3, groups=4),
                                      torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 2))
        on_mesh.load_state_dict(tdmesh.to_mesh(state, mesh1))
        before = COUNTS["workers"]
        got = train(on_mesh, tdmesh.to_mesh(x, mesh1), lambda v: fetch_shard(v).result())
        assert COUNTS["workers"] - before == 3  # channels-last leaves too: their gradients are laid out alike
    assert [float(v) for v in got[0]] == [float(v) for v in want[0]]
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))


def _write_views(x):
    """Longformer's pattern: views of an intermediate written in place, then used."""
    y = x * 2
    view = y.view(2, 3, 4).transpose(1, 2)
    view[:, :2, :1].masked_fill_(view[:, :2, :1] > 0, 0.0)
    return (view.exp() * y.view(2, 3, 4).transpose(1, 2)).sum()


def test_views_written_in_place_give_the_workers_the_clients_graph(mesh1):
    x = torch.randn(6, 4, requires_grad=True)
    _write_views(x).backward()
    with mesh1.activate():
        remote = tdmesh.to_mesh(x.detach(), mesh1).requires_grad_()
        before = COUNTS["workers"]
        _write_views(remote).backward()
        assert COUNTS["workers"] - before == 1  # one message: the workers' own autograd
        got = fetch_shard(remote.grad).result()
    torch.testing.assert_close(got, x.grad, rtol=0, atol=0)


def _grouped(a, w, offs):
    return torch._grouped_mm(a, w, offs=offs)


def test_grouped_mm_in_float32_runs_on_cpu_workers_as_locally(mesh1):
    _cpu_only(mesh1)
    a, w = torch.randn(12, 8, requires_grad=True), torch.randn(3, 8, 4, requires_grad=True)
    offs = torch.tensor([4, 8, 12], dtype=torch.int32)
    k = torch.randn(12, 4)  # the loss's weights: a dense gradient (torch's CPU backward refuses an expanded one)
    out = _grouped(a, w, offs)
    (out * k).sum().backward()
    with mesh1.activate():
        ra, rw = (tdmesh.to_mesh(t.detach(), mesh1).requires_grad_() for t in (a, w))
        rout = _grouped(ra, rw, tdmesh.to_mesh(offs, mesh1))
        (rout * tdmesh.to_mesh(k, mesh1)).sum().backward()
        got = fetch_shard((rout, ra.grad, rw.grad)).result()
        # where the CPU kernel refuses too, its own error reaches the user's line
        bad = tdmesh.to_mesh(torch.randn(3, 8, 6), mesh1)  # rows of 24 bytes: not a multiple of 16
        with pytest.raises(Exception, match="strides should be multiple of 16 bytes") as raised:
            torch._grouped_mm(ra.detach(), bad, offs=tdmesh.to_mesh(offs, mesh1))
        assert "test_device_metadata.py" in str(raised.value)
    assert torch.equal(got[0], out.detach())
    assert torch.equal(got[1], a.grad) and torch.equal(got[2], w.grad)


def test_shipped_tensors_keep_their_layout_as_to_device_does(mesh1):
    """``tdmesh.to_mesh`` (and ``torch.as_tensor(local)`` under a mesh) kept the values but made a
    channels-last batch contiguous: the workers' kernels then took other paths than local torch's."""
    cl = torch.randn(2, 3, 4, 4).contiguous(memory_format=torch.channels_last)
    local = [cl, torch.randn(5, 7).t(), torch.randn(3, 4)[:, ::2], torch.randn(2, 3)]
    with mesh1.activate():
        remote = tdmesh.to_mesh(local, mesh1)
        made = torch.as_tensor(cl)  # under a mesh: a copy of the local tensor on every rank
        on_workers = tdmesh.call_on_shard_and_fetch(tdmesh.remote(_strides), remote + [made]).result()
        got = fetch_shard(remote + [made]).result()
    want = [t.to("meta").stride() for t in local] + [cl.stride()]  # what .to(device) keeps
    assert [tuple(t.stride()) for t in remote + [made]] == [tuple(s) for s in want] == [tuple(s) for s in on_workers]
    assert all(torch.equal(a, b) for a, b in zip(got, local + [cl]))


def _strides(tensors):
    return [t.stride() for t in tensors]


def test_a_shape_error_is_the_users_and_torchs_fake_mode_logs_nothing(mesh1):
    """Propagation on fake tensors: torch's fake mode logs a traceback for every meta kernel that
    raises; a user's shape error is raised at the user's line, once, with nothing logged."""
    _cpu_only(mesh1)
    with kept_records() as records, mesh1.activate(), pytest.raises(RuntimeError, match="same reduction dim") as raised:
        torch.ones(2, 3) @ torch.ones(4, 5)
    assert "test_device_metadata.py" in str(raised.value) and "before anything was sent" in str(raised.value)
    assert not records

"""Any tensor a worker holds can be fetched, moved or refused, and never crashes a worker.

A remote function returns a tensor of a kind hypothesis draws (dense and its views, other dtypes, subclasses
that own their memory, a DTensor and a functional collective's pending result, wrapper subclasses that do
not, sparse, quantized, nested and meta tensors), and the test takes it one of three ways: by value
(``call_on_shard_and_fetch``), held as a mesh tensor and fetched from every rank, or held and moved to another
mesh (``slice_mesh(...).to_mesh(...)``).  Each way gives what the same code gives in local torch on that rank,
or a ``RemoteException`` whose text names the problem; after each, the fleet still computes.

Before, a DTensor or an ``AsyncCollectiveTensor`` fetched from a worker killed it (SIGSEGV: the packer read
``data_ptr()`` of a tensor that owns no memory).  A DTensor is held and fetched as its local shard: the value
that rank holds, as every mesh tensor is one value per rank.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

import tdmesh

HELD = ["dense", "transposed", "channels_last", "empty", "scalar", "expanded", "conj", "neg", "bool", "int64",
        "bf16", "parameter", "subclass", "dtensor_shard", "dtensor_replicate", "dtensor_partial", "pending_collective"]
BY_VALUE_ONLY = ["sparse_coo", "sparse_csr", "quantized", "nested"]  # a value fetched as it is; no mesh tensor holds it
REFUSED = {"wrapper_subclass": "owns no memory", "meta": "meta tensor"}
# what holding each kind of BY_VALUE_ONLY as a mesh tensor says: the client cannot describe it
HOLD_REFUSED = {"sparse_coo": "sparse_coo tensor", "sparse_csr": "sparse_csr tensor", "quantized": "quantized tensor",
                "nested": "nested tensor", "wrapper_subclass": "owns no memory", "meta": "meta tensor"}
KINDS = HELD + BY_VALUE_ONLY + list(REFUSED)


class Sub(torch.Tensor):
    """A user's tensor subclass that owns its memory (as_subclass of a plain tensor)."""


def base(seed: int, rank: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(seed)) + rank


def make(kind: str, seed: int, rank: int, tmesh=None):
    """The tensor of ``kind``, as rank ``rank`` makes it (on a worker ``tmesh`` is the mesh's torch DeviceMesh)."""
    v = base(seed, rank)
    if kind in ("dense", "wrapper_subclass_inner"):
        return v
    if kind == "transposed":
        return v.t()
    if kind == "channels_last":
        return v.reshape(1, 3, 2, 2).contiguous(memory_format=torch.channels_last)
    if kind == "empty":
        return v[:0]
    if kind == "scalar":
        return v[1, 2]
    if kind == "expanded":
        return v[0].expand(3, 4)
    if kind == "conj":
        return torch.complex(v, -v).conj()
    if kind == "neg":
        return torch._neg_view(v)
    if kind == "bool":
        return v > rank
    if kind == "int64":
        return (v * 10).long()
    if kind == "bf16":
        return v.bfloat16()
    if kind == "parameter":
        return torch.nn.Parameter(v)
    if kind == "subclass":
        return v.as_subclass(Sub)
    if kind == "sparse_coo":
        return (v * (v > 0)).to_sparse()
    if kind == "sparse_csr":
        return (v * (v > 0)).to_sparse_csr()
    if kind == "quantized":
        return torch.quantize_per_tensor(v, 0.1, 0, torch.qint8)
    if kind == "nested":
        return torch.nested.nested_tensor([v, v[:1]])
    if kind == "meta":
        return torch.empty(3, 4, device="meta")
    if kind == "wrapper_subclass":
        from torch.testing._internal.two_tensor import TwoTensor
        return TwoTensor(v, v)
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    if kind == "pending_collective":
        import torch.distributed._functional_collectives as fc
        return fc.all_reduce(v, "sum", tmesh["gpu"])
    placement = {"dtensor_shard": Shard(0), "dtensor_replicate": Replicate(), "dtensor_partial": Partial()}[kind]
    return DTensor.from_local(v, tmesh["gpu"], [placement], run_check=False)


def on_worker(kind: str, seed: int, tmesh):
    """The remote function: ``make`` with this worker's rank."""
    return make(kind, seed, torch.distributed.get_rank(), tmesh)


def expected(kind: str, seed: int, rank: int, ranks: int) -> torch.Tensor:
    """What rank ``rank`` holds of ``kind``: a DTensor's local shard, a collective's result, else ``make``'s."""
    if kind == "pending_collective":
        return sum(base(seed, r) for r in range(ranks))
    if kind.startswith("dtensor"):
        return base(seed, rank)
    return make(kind, seed, rank)


def same(got, want) -> bool:
    if want.is_nested:
        return all(torch.equal(a, b) for a, b in zip(got.unbind(), want.unbind()))
    if want.is_quantized:
        return got.is_quantized and torch.equal(got.dequantize(), want.dequantize())
    if want.layout is not torch.strided:
        return got.layout is want.layout and torch.equal(got.to_dense(), want.to_dense())
    return got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape) and torch.equal(
        got.resolve_conj().resolve_neg(), want.resolve_conj().resolve_neg())


@pytest.fixture(scope="module")
def mesh():
    with tdmesh.local_mesh(hosts=1, gpus_per_host=2) as m:
        yield m


def still_computes(mesh) -> None:
    with mesh.activate():
        assert tdmesh.fetch_shard(torch.ones(2) + 1, host=0, gpu=1).result().tolist() == [2.0, 2.0]


@settings(max_examples=150, deadline=None, database=None)
@example(kind="conj", seed=0, how="moved")  # once a hang: c10d refused the sender's view, its receiver waited on
@example(kind="neg", seed=0, how="moved")
@given(kind=st.sampled_from(KINDS), seed=st.integers(0, 2**16), how=st.sampled_from(["value", "held", "moved"]))
def test_any_tensor_a_worker_holds_is_fetched_moved_or_refused(mesh, kind, seed, how):
    # call_on_shard_and_fetch runs the function on its one rank: a collective there waits for ranks that never
    # join it, as in any SPMD program (the held path runs it on every rank)
    assume(not (how == "value" and kind == "pending_collective"))
    ranks = len(mesh.rank_list)
    wants = [expected(kind, seed, r, ranks) for r in range(ranks)] if kind not in REFUSED else None  # local torch
    with mesh.activate():
        tm = mesh.torch_mesh()
        if how == "value":
            fetch = tdmesh.call_on_shard_and_fetch(tdmesh.remote(on_worker), kind, seed, tm,
                                                   shard={"host": 0, "gpu": 1})
            if kind in REFUSED:
                with pytest.raises(tdmesh.RemoteException, match=REFUSED[kind]):
                    fetch.result()
            else:
                assert same(fetch.result(), wants[1]), kind
        else:
            shape, dtype = (wants[0].shape, wants[0].dtype) if kind not in HOLD_REFUSED else ((3, 4), torch.float32)
            held = tdmesh.remote(on_worker, propagate=lambda k, s, t: torch.empty(shape, dtype=dtype))(kind, seed, tm)
            if kind in HOLD_REFUSED:
                with pytest.raises(tdmesh.RemoteException, match=HOLD_REFUSED[kind]):
                    tdmesh.fetch_shard(held).result()
            elif how == "held":
                for g in range(ranks):
                    got = tdmesh.fetch_shard((held, held.clone()), host=0, gpu=g).result()
                    assert same(got[0], wants[g]) and same(got[1], got[0]), (kind, g)
            else:
                moved = held.slice_mesh(gpu=1).to_mesh(mesh.slice(gpu=0))
                assert same(tdmesh.fetch_shard(moved).result(), wants[1]), kind
    still_computes(mesh)


def test_a_result_unlike_its_propagation_is_the_functions_error_not_a_desync(mesh):
    """A remote function whose result's shape, dtype or layout is not what its propagation described fails
    (the client's proxy would describe another value than the worker's); the fleet goes on."""
    with mesh.activate():
        tm = mesh.torch_mesh()
        wrong_shape = tdmesh.remote(on_worker, propagate=lambda k, s, t: torch.empty(6, 2))("dense", 0, tm)
        wrong_dtype = tdmesh.remote(on_worker, propagate=lambda k, s, t: torch.empty(3, 4, dtype=torch.float64))(
            "dense", 0, tm)
        global_shape = tdmesh.remote(on_worker, propagate=lambda k, s, t: torch.empty(6, 4))("dtensor_shard", 0, tm)
        with pytest.raises(tdmesh.RemoteException, match=r"shape \[3, 4\] \(float32\), where its propagation "
                                                         r"described a strided one of shape \[6, 2\]"):
            tdmesh.fetch_shard(wrong_shape).result()
        with pytest.raises(tdmesh.RemoteException, match="float64"):
            tdmesh.fetch_shard(wrong_dtype).result()
        with pytest.raises(tdmesh.RemoteException, match=r"\[6, 4\]"):  # the global shape: a DTensor is held local
            tdmesh.fetch_shard(global_shape).result()
    still_computes(mesh)

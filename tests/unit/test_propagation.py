"""Output metadata without running ops: dense metadata and the structure of sparse tensors."""

import pytest
import torch

from tdmesh.engine.propagation import SparseMeta, TensorMeta, meta_tensor, propagate, sparse_meta, tensor_meta
from tdmesh.protocol import codec

_DENSE = torch.tensor([[0.0, 1.0, 0.0, 2.0], [3.0, 0.0, 0.0, 4.0]])
SPARSE = {
    "coo": _DENSE.to_sparse(),
    "coo coalesced": _DENSE.to_sparse().coalesce(),
    "coo hybrid": torch.ones(3, 4, 2).to_sparse(sparse_dim=2),
    "csr": _DENSE.to_sparse_csr(),
    "csr batched": torch.stack([_DENSE, _DENSE]).to_sparse_csr(),
    "csr int32 indices": torch.sparse_csr_tensor(torch.tensor([0, 1, 2], dtype=torch.int32),
                                                 torch.tensor([1, 3], dtype=torch.int32), torch.ones(2), (2, 4)),
    "csc": _DENSE.to_sparse_csc(),
    "bsr": _DENSE.to_sparse_bsr((1, 2)),
    "bsc": _DENSE.to_sparse_bsc((2, 1)),
}


@pytest.mark.parametrize("name", list(SPARSE))
def test_a_sparse_structure_round_trips_through_its_meta_stand_in(name):
    t = SPARSE[name]
    structure = sparse_meta(t)
    assert structure == SparseMeta(*codec.describe_tensor(t))  # what a worker's describe sends
    stand_in = meta_tensor(structure)
    assert stand_in.device.type == "meta" and stand_in.layout == t.layout and stand_in.shape == t.shape
    assert sparse_meta(stand_in) == structure and structure.nnz == t._nnz()


def test_dense_metadata_keeps_strides_and_offset():
    view = torch.arange(24.0).reshape(4, 6)[1:, ::2]
    meta = tensor_meta(view)
    assert meta == TensorMeta((3, 3), (6, 2), 6, torch.float32) == TensorMeta(*codec.describe_tensor(view))
    assert tensor_meta(meta_tensor(meta)) == meta


def test_propagation_marks_sparse_results():
    structure = sparse_meta(SPARSE["coo"])
    stand_in = meta_tensor(structure)

    class Remote:  # what propagate reads of a proxy: its identity and its metadata
        _meta = structure
    remote = Remote()
    out = propagate(torch.ops.aten.add.Tensor, (remote, remote), {}, [remote], None)
    assert out.sparse and out.leaves[0].layout is torch.sparse_coo  # (its nnz: the workers tell)
    assert stand_in.shape == SPARSE["coo"].shape
    dense = propagate(torch.ops.aten.mul.Tensor, (torch.ones(2), 2.0), {}, [], None)
    assert not dense.sparse and dense.leaves[0] == TensorMeta((2,), (1,), 0, torch.float32)

"""The long tail of torch under a mesh (issue 13): in-place view ops, shapes that only the
data decides, ops that answer with Python values, local data onto a mesh, library ops."""

import pytest
import torch

import tdmesh
from tdmesh import inspect

from opinfo_conformance import conformance


def test_vector_at_matrix_and_in_place_view_ops(mesh1):
    with mesh1.activate():
        v = torch.ones(3) @ torch.arange(12.0).reshape(3, 4)  # decomposes through squeeze_
        assert v.shape == (4,) and inspect(v).tolist() == [12.0, 15.0, 18.0, 21.0]
        x = torch.arange(6.0).reshape(2, 1, 3)
        view = x[0]  # a view taken before the in-place changes keeps its own metadata
        x.squeeze_(1)
        assert x.shape == (2, 3) and inspect(x).tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
        x.t_()
        assert (x.shape, x.stride()) == ((3, 2), (1, 3))
        assert inspect(x).tolist() == [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]
        x.unsqueeze_(0).transpose_(0, 2)
        assert x.shape == (2, 3, 1) and inspect(x).tolist() == [[[0.0], [1.0], [2.0]], [[3.0], [4.0], [5.0]]]
        x.mul_(2)  # the mutation reaches the earlier view, which shares the storage
        assert view.shape == (1, 3) and inspect(view).tolist() == [[0.0, 2.0, 4.0]]
        y = torch.arange(10.0)
        y.as_strided_((3,), (2,), 1)
        assert inspect(y).tolist() == [1.0, 3.0, 5.0]
        q = torch.quantile(torch.arange(5.0), torch.tensor([0.25, 0.5]))
        assert inspect(q).tolist() == [1.0, 2.0]


def test_data_dependent_shapes_take_one_round_trip_when_ranks_agree(mesh2x2):
    with mesh2x2.activate():
        x = torch.tensor([1.0, -2.0, 3.0, 0.0])
        masked = x[x > 0]
        assert masked.shape == (2,) and inspect(masked, host=1, gpu=1).tolist() == [1.0, 3.0]
        assert torch.nonzero(x).shape == (3, 1)
        values, counts = torch.unique(torch.tensor([3, 1, 3, 2]), return_counts=True)
        assert [t.tolist() for t in inspect((values, counts))] == [[1, 2, 3], [1, 1, 2]]
        assert inspect(masked.sum()).item() == 4.0  # the new tensors are ordinary remote tensors


def test_data_dependent_shapes_that_ranks_disagree_on_are_a_clear_error(mesh2x2):
    with mesh2x2.activate():
        per_rank = torch.arange(4.0) * mesh2x2.rank("gpu")
        with pytest.raises(ValueError) as err:
            torch.nonzero(per_rank)
        text = str(err.value)
        assert "the ranks of {host=2, gpu=2} disagree" in text and "{'host': 0, 'gpu': 1}: [[3, 1]]" in text
        assert "nonzero_static" in text and "test_coverage.py" in text
        assert inspect(per_rank + 1, host=0, gpu=1).tolist() == [1.0, 2.0, 3.0, 4.0]  # the mesh goes on


def test_python_valued_ops_fetch_like_item(mesh1):
    with mesh1.activate():
        x = torch.arange(3.0)
        assert torch.allclose(x, x + 1e-9) is True
        assert torch.equal(x, x * 1) is True
        assert bool(x.sum() > 2) is True


def test_local_data_goes_to_a_mesh_with_to_mesh(mesh2x2):
    local = torch.arange(6.0).reshape(2, 3).t()  # a strided view: it travels as its values
    remote = tdmesh.to_mesh(local, mesh2x2)
    both = tdmesh.to_mesh({"a": local, "b": torch.ones(2)}, mesh2x2)
    assert remote.mesh is mesh2x2 and remote.shape == (3, 2)
    with mesh2x2.activate():
        assert inspect(remote * 2, host=1, gpu=0).tolist() == (local * 2).tolist()
        assert inspect(both["b"] + both["a"][0]).tolist() == [1.0, 4.0]
        with pytest.raises(tdmesh.PlacementError, match=r"tdmesh.to_mesh\(tensor, mesh\)") as err:
            remote + local
        assert err.value.code == "LOCAL_TENSOR"


def test_ops_of_python_libraries_resolve_on_the_worker(mesh1):
    """``linear_cross_entropy``'s chunked variants call ops that ``torch.library.custom_op``
    registers in a module the worker has not imported: the op carries that module."""
    ops = {"nn.functional.linear_cross_entropy.chunked", "nn.functional.linear_cross_entropy.chunked_none"}
    if not hasattr(torch.nn.functional, "linear_cross_entropy"):
        pytest.skip("this torch has no linear_cross_entropy (torch 2.13 added it)")
    outcomes = conformance(mesh1, "cpu", torch.float32, only=ops)
    assert {o.op for o in outcomes} == ops and all(o.error is None for o in outcomes), outcomes


def test_ops_without_a_meta_kernel_run_and_learn_their_shape(mesh2x2):
    from library_ops import every_other, positives
    with mesh2x2.activate():
        x = torch.arange(7.0) * (1 + mesh2x2.rank("gpu"))
        y = every_other(x)  # no fake impl: one round trip learns the shape
        assert y.shape == (4,) and inspect(y + 1, host=1, gpu=1).tolist() == [1.0, 5.0, 9.0, 13.0]
        with pytest.raises(ValueError, match=r"torch cannot derive its output metadata.*disagree") as err:
            positives(torch.arange(4.0) - mesh2x2.rank("gpu"))
        assert "test_coverage.py" in str(err.value)


def test_torch_tensor_of_local_data_ships_it_under_a_mesh(mesh2x2):
    local = torch.arange(6.0).reshape(2, 3)
    with mesh2x2.activate():
        for made in (torch.tensor(local), torch.as_tensor(local), torch.asarray(local)):
            assert isinstance(made, tdmesh.Tensor) and made.mesh is mesh2x2
            assert inspect(made, host=1, gpu=1).tolist() == local.tolist()
        typed = torch.as_tensor(local, dtype=torch.int32)
        assert typed.dtype == torch.int32 and inspect(typed).tolist() == [[0, 1, 2], [3, 4, 5]]
        leaf = torch.tensor(local, requires_grad=True)
        assert leaf.requires_grad and leaf.is_leaf
        copy = torch.tensor(leaf.detach())  # remote data copies on the mesh
        assert copy.ref != leaf.ref and inspect(copy).tolist() == local.tolist()
        assert inspect(torch.tensor([1, 2])).tolist() == [1, 2]  # Python data, as before
        with pytest.raises(tdmesh.PlacementError, match=r"torch.tensor\(tensor\) under mesh.activate\(\)"):
            copy + local
    assert type(torch.as_tensor(local)) is torch.Tensor  # without a mesh, local stays local


def test_tensor_split_by_a_remote_tensor_of_indices(mesh2x2):
    with mesh2x2.activate():
        x = torch.arange(10.0)
        parts = torch.tensor_split(x, torch.tensor([2, 5]))
        assert [inspect(p).tolist() for p in parts] == [[0.0, 1.0], [2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0, 9.0]]
        assert [p.shape[0] for p in x.tensor_split(torch.tensor(3))] == [4, 3, 3]
        assert len(torch.tensor_split(x, tensor_indices_or_sections=torch.tensor([4]))) == 2
        assert len(torch.tensor_split(x, torch.tensor([1, 4]).cpu())) == 3  # a local CPU tensor, as torch asks
        gpu = mesh2x2.rank("gpu")
        with pytest.raises(ValueError, match=r"tensor_split reads the values of .* the ranks of \{host=2, gpu=2\} "
                                             r"disagree") as err:
            torch.tensor_split(x, torch.stack([gpu + 1, gpu + 3]))
        assert "{'host': 0, 'gpu': 1}: [2, 4]" in str(err.value) and "test_coverage.py" in str(err.value)


def _same(got, expected):
    if expected.layout is not torch.strided:
        assert got.layout == expected.layout
        got, expected = got.to_dense(), expected.to_dense()
    torch.testing.assert_close(got, expected)


SPARSE_OPS = {
    "to_dense": lambda s, d: s.to_dense(),
    "sparse.mm": lambda s, d: torch.sparse.mm(s, d),
    "matmul": lambda s, d: s @ d,
    "addmm": lambda s, d: torch.addmm(torch.ones(4, 3), s, d),
    "add": lambda s, d: s + s,
    "mul scalar": lambda s, d: s * 2,
    "coalesce": lambda s, d: s.coalesce(),
    "values": lambda s, d: s.coalesce().values(),
    "indices": lambda s, d: s.coalesce().indices(),
    "sparse.sum": lambda s, d: torch.sparse.sum(s, dim=1),
    "t": lambda s, d: s.t(),
    "sparse.softmax": lambda s, d: torch.sparse.softmax(s, 1),
    "to_sparse_csr": lambda s, d: s.to_sparse_csr(),
    "csr @ dense": lambda s, d: s.to_sparse_csr() @ d,
    "csr to_dense": lambda s, d: s.to_sparse_csr().to_dense(),
    "csc": lambda s, d: s.to_sparse_csc(),
    "bsr": lambda s, d: s.to_dense().to_sparse_bsr((2, 1)),
    "sampled_addmm": lambda s, d: torch.sparse.sampled_addmm(s.to_sparse_csr(), torch.ones(4, 2), torch.ones(2, 5)),
    "add_ in place": lambda s, d: s.add_(s.t().t() * 3),
    "dense.to_sparse": lambda s, d: d.to_sparse(),
}


@pytest.mark.parametrize("name", list(SPARSE_OPS))
def test_sparse_tensors_run_the_ops_torch_has_for_them(mesh1, name):
    torch.manual_seed(0)
    dense = torch.randn(4, 5)
    dense[dense < 0.3] = 0
    local, other = dense.to_sparse(), torch.randn(5, 3)
    expected = SPARSE_OPS[name](local.clone(), other)
    with mesh1.activate():
        remote = SPARSE_OPS[name](tdmesh.to_mesh(local, mesh1), tdmesh.to_mesh(other, mesh1))
        assert isinstance(remote, tdmesh.Tensor) and remote.layout == expected.layout
        assert remote.shape == expected.shape and remote.device.type == mesh1.device_type
        got = inspect(remote)
        if remote.layout is not torch.strided:  # the proxy's structure knows the worker's count
            assert remote._nnz() == got._nnz()  # (CUDA's sparse add leaves duplicates: CPU's may not)
        _same(got, expected)


def test_sparse_proxies_know_their_structure_and_follow_in_place_ops(mesh1):
    local = torch.sparse_coo_tensor(torch.tensor([[0, 1, 1], [2, 0, 2]]), torch.tensor([3.0, 4.0, 5.0]), (2, 3))
    extra = torch.sparse_coo_tensor(torch.tensor([[0], [0]]), torch.tensor([1.0]), (2, 3))
    remote = tdmesh.to_mesh(local, mesh1)
    assert (remote.is_sparse, remote.sparse_dim(), remote.dense_dim(), remote._nnz()) == (True, 2, 0, 3)
    assert not remote.is_coalesced() and "tdmesh.Tensor(shape=[2, 3]" in repr(remote)
    with mesh1.activate():
        remote.add_(tdmesh.to_mesh(extra, mesh1))
        assert remote._nnz() == 4  # the worker's tensor grew, and the proxy follows
        _same(inspect(remote), local + extra)
        built = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.tensor([1.0, 2.0]), (2, 2))
        assert built.is_sparse and built._nnz() == 2  # Python data lifts to the mesh, then builds there
        assert inspect(built.to_dense()).tolist() == [[0.0, 1.0], [2.0, 0.0]]

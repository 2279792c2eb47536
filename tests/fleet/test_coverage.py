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

"""Sparse gradients (``nn.Embedding(sparse=True)``, ``embedding_bag(sparse=True)``, ``gather(sparse_grad=True)``)
under the workers' backward (``TDMESH_BACKWARD=auto``): a sparse gradient has as many values as the indices
pick, which the client cannot describe before the workers run the backward, so such a graph runs on the
client's engine and trains as local torch does (before, the workers failed copying it into a dense
gradient and the client made a dense gradient that ``SparseAdam`` refused).  A dense embedding's backward
still runs on the workers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tdmesh import fetch_shard
from tdmesh.engine import backward as worker_backward

_INDICES = [[0, 2, 2, 5], [1, 5, 3, 0]]


def _loss(kind: str, weight, indices):
    if kind == "embedding_bag":
        return F.embedding_bag(indices.flatten(), weight, torch.tensor([0, 4]), mode="sum", sparse=True).square().sum()
    if kind == "gather":
        return torch.gather(weight, 0, indices[:, :3] % 6, sparse_grad=True).square().sum()
    return F.embedding(indices, weight, sparse=kind == "embedding").square().sum()


def _train(kind: str, weight: torch.Tensor) -> torch.Tensor:
    optimizer = torch.optim.SparseAdam([weight], lr=0.1) if kind != "dense" else torch.optim.Adam([weight], lr=0.1)
    indices = torch.tensor(_INDICES)
    for step in range(3):
        optimizer.zero_grad()
        _loss(kind, weight, (indices + step) % 6).backward()
        optimizer.step()
    return weight.detach()


def _weight() -> list:
    return (torch.arange(18.0).reshape(6, 3) / 10 - 0.8).tolist()


@pytest.mark.parametrize("kind", ["embedding", "embedding_bag", "gather", "dense"])
def test_a_sparse_gradient_trains_as_local_torch_on_the_clients_engine(mesh1, kind):
    want = _train(kind, torch.nn.Parameter(torch.tensor(_weight())))
    before = dict(worker_backward.COUNTS)
    with mesh1.activate():
        weight = torch.nn.Parameter(torch.tensor(_weight()))
        got = fetch_shard(_train(kind, weight)).result()
    ran = {k: worker_backward.COUNTS[k] - before[k] for k in before}
    assert ran == ({"workers": 3, "client": 0} if kind == "dense" else {"workers": 0, "client": 3}), ran
    if kind != "dense":
        assert "sparse gradient" in worker_backward.CLIENT_REASON[0]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)

"""Models and values shared by the ecosystem tests and their SPMD reference script (tests/scripts): a worker
imports this module too, so it holds nothing a worker could not import."""

import torch
from torch import nn


class Net(nn.Module):
    """A little of everything whose init draws: a conv, a batch norm, an embedding, linears, dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.conv = nn.Conv1d(6, 4, 3, padding=1)
        self.bn = nn.BatchNorm1d(4)
        self.fc = nn.Sequential(nn.Linear(4 * 5, 8), nn.GELU(), nn.Dropout(0.1), nn.Linear(8, 3))

    def forward(self, ids):
        h = self.emb(ids).transpose(1, 2)
        return self.fc(self.bn(self.conv(h)).flatten(1))


def rank_values(seed: int, rank: int) -> torch.Tensor:
    """A tensor that differs per rank (positive: products stay finite)."""
    return torch.rand(4, 3, generator=torch.Generator().manual_seed(seed + 101 * rank)) + 0.5

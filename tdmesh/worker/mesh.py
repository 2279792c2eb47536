"""The worker's view of a mesh: which ranks it holds and where this worker sits in it."""

from __future__ import annotations

from collections.abc import Sequence

from ..geometry.grouping import dims_rank, group_members
from ..geometry.shape import Shape


class WorkerMesh:
    """What a remote function receives for a ``DeviceMesh`` argument."""

    def __init__(self, shape: Shape, rank: int, device=None) -> None:
        self.shape = shape
        self.global_rank = rank
        self.device = device

    @property
    def names(self) -> tuple[str, ...]:
        return self.shape.labels

    @property
    def sizes(self) -> dict[str, int]:
        return self.shape.sizes

    def rank(self, dims: str | Sequence[str]) -> int:
        """This worker's coordinate along ``dims`` (row-major in the given order)."""
        return dims_rank(self.shape, self.global_rank, dims)

    def members(self, dims: str | Sequence[str]) -> list[int]:
        return group_members(self.shape, self.global_rank, dims)

    def __repr__(self) -> str:
        return f"WorkerMesh({self.shape}, rank={self.global_rank})"

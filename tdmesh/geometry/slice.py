"""Strided sets of ranks: the arithmetic under every mesh.

A ``Slice`` is ``offset + sum(c[k] * strides[k])`` for every coordinate ``c`` with
``0 <= c[k] < sizes[k]``.  Indexing is row-major over *coordinates* (the last dim moves
fastest), whatever the order of the strides, so a mesh's dims can be listed in any order
while its ranks stay put.  Pure Python on purpose: the client and the
workers both use it, and neither should need torch to do rank arithmetic.

>>> s = Slice(offset=0, sizes=[2, 3], strides=[3, 1])
>>> list(s)
[0, 1, 2, 3, 4, 5]
>>> s.coordinates(4)
[1, 1]
>>> Slice(offset=10, sizes=[10, 2], strides=[10, 5])[3]
25
>>> s.at(0, 1)
Slice(offset=3, sizes=[3], strides=[1])
>>> s.select(1, 1, 3, 1).index(5)
3
>>> Slice.from_list([1, 2, 4, 5, 6])
[Slice(offset=1, sizes=[2], strides=[1]), Slice(offset=4, sizes=[3], strides=[1])]
>>> Slice(offset=0, sizes=[2, 2], strides=[1, 1])
Traceback (most recent call last):
  ...
ValueError: Slice strides [1, 1] repeat stride 1 across dims of sizes 2 and 2; ranks would collide
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

__all__ = ["Slice", "row_major_strides", "ravel", "unravel"]


def row_major_strides(sizes: Sequence[int]) -> list[int]:
    """Strides of a dense row-major layout of ``sizes`` (last dim fastest)."""
    strides = [1] * len(sizes)
    for k in range(len(sizes) - 2, -1, -1):
        strides[k] = strides[k + 1] * sizes[k + 1]
    return strides


def ravel(coords: Sequence[int], sizes: Sequence[int]) -> int:
    """Row-major linear index of ``coords`` in a grid of ``sizes``."""
    index = 0
    for c, n in zip(coords, sizes):
        index = index * n + c
    return index


def unravel(index: int, sizes: Sequence[int]) -> list[int]:
    """Inverse of :func:`ravel`."""
    coords = [0] * len(sizes)
    for k in range(len(sizes) - 1, -1, -1):
        index, coords[k] = divmod(index, sizes[k])
    return coords


def _as_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Slice {name} must be an int, got {value!r} ({type(value).__name__})")
    return value


class Slice:
    """An immutable, hashable, picklable set of ranks laid out as a strided grid."""

    __slots__ = ("_offset", "_sizes", "_strides", "_len", "_hash")
    _offset: int
    _sizes: tuple[int, ...]
    _strides: tuple[int, ...]
    _len: int
    _hash: int

    def __init__(self, *, offset: int, sizes: Sequence[int], strides: Sequence[int]) -> None:
        offset = _as_int("offset", offset)
        sizes = tuple(_as_int("size", s) for s in sizes)
        strides = tuple(_as_int("stride", s) for s in strides)
        _validate(offset, sizes, strides)
        object.__setattr__(self, "_offset", offset)
        object.__setattr__(self, "_sizes", sizes)
        object.__setattr__(self, "_strides", strides)
        object.__setattr__(self, "_len", math.prod(sizes))
        object.__setattr__(self, "_hash", hash((Slice, offset, sizes, strides)))

    # -- value semantics -------------------------------------------------------------
    def __setattr__(self, name, value):
        raise AttributeError(f"Slice is immutable; cannot set {name!r}")

    def __delattr__(self, name):
        raise AttributeError(f"Slice is immutable; cannot delete {name!r}")

    def __reduce__(self):
        return (_rebuild, (self._offset, self._sizes, self._strides))

    def __eq__(self, other) -> bool:
        if not isinstance(other, Slice):
            return NotImplemented
        return (self._offset, self._sizes, self._strides) == (
            other._offset, other._sizes, other._strides)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return (f"Slice(offset={self._offset}, sizes={list(self._sizes)}, "
                f"strides={list(self._strides)})")

    # -- attributes --------------------------------------------------------------------
    @property
    def offset(self) -> int:
        return self._offset

    @property
    def sizes(self) -> tuple[int, ...]:
        return self._sizes

    @property
    def strides(self) -> tuple[int, ...]:
        return self._strides

    @property
    def ndim(self) -> int:
        return len(self._sizes)

    # -- rank <-> coordinates ----------------------------------------------------------
    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[int]:
        for i in range(self._len):
            yield self._get(i)

    def __contains__(self, rank) -> bool:
        try:
            self.coordinates(rank)
        except (ValueError, TypeError):
            return False
        return True

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(self._len)
            return tuple(self._get(j) for j in range(start, stop, step))
        i = _as_int("index", i)
        if i < 0:
            raise TypeError(f"Slice index must be non-negative, got {i} (ranks are indexed 0..{self._len - 1})")
        if i >= self._len:
            raise IndexError(f"Slice index {i} out of range for {self!r} of length {self._len}")
        return self._get(i)

    def _get(self, i: int) -> int:
        rank = self._offset
        for k in range(len(self._sizes) - 1, -1, -1):
            i, c = divmod(i, self._sizes[k])
            rank += c * self._strides[k]
        return rank

    def nditem(self, coords: Sequence[int]) -> int:
        """The rank at ``coords`` (one per dim).  Only the count of coordinates is checked."""
        if len(coords) != self.ndim:
            raise IndexError(f"{self!r} has {self.ndim} dims, got {len(coords)} coordinates {list(coords)}")
        return self._offset + sum(c * s for c, s in zip(coords, self._strides))

    def coordinates(self, rank: int) -> list[int]:
        """The coordinates of ``rank``; ``ValueError`` if the slice does not hold it."""
        rank = _as_int("rank", rank)
        pos = rank - self._offset
        if pos < 0:
            raise ValueError(f"rank {rank} is not in {self!r}: it lies below the offset")
        coords = [0] * self.ndim
        for k in sorted(range(self.ndim), key=lambda k: self._strides[k], reverse=True):
            if self._sizes[k] == 1:
                continue
            c, pos = divmod(pos, self._strides[k])
            if c >= self._sizes[k]:
                raise ValueError(f"rank {rank} is not in {self!r}: it lies past the end of dim {k}")
            coords[k] = c
        if pos:
            raise ValueError(f"rank {rank} is not in {self!r}: it falls between strides")
        return coords

    def index(self, rank: int) -> int:
        """Row-major position of ``rank``; the inverse of ``s[i]``."""
        return ravel(self.coordinates(rank), self._sizes)

    # -- sub-slices --------------------------------------------------------------------
    def _check_dim(self, dim: int) -> None:
        if isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim < self.ndim:
            raise IndexError(f"dim {dim!r} out of range for {self!r} with {self.ndim} dims (0..{self.ndim - 1})")

    def at(self, dim: int, index: int) -> Slice:
        """Fix ``dim`` at ``index`` and drop it."""
        self._check_dim(dim)
        if not 0 <= index < self._sizes[dim]:
            raise IndexError(f"index {index} out of range for dim {dim} of size {self._sizes[dim]}")
        return Slice(offset=self._offset + index * self._strides[dim],
                     sizes=self._sizes[:dim] + self._sizes[dim + 1:],
                     strides=self._strides[:dim] + self._strides[dim + 1:])

    def select(self, dim: int, begin: int, end: int, step: int = 1) -> Slice:
        """Keep ``range(begin, end, step)`` of ``dim`` (``end`` is clamped to the size)."""
        self._check_dim(dim)
        size = self._sizes[dim]
        if step < 1:
            raise ValueError(f"select step must be >= 1, got {step}")
        if not 0 <= begin < size:
            raise IndexError(f"select begin {begin} out of range for dim {dim} of size {size}")
        end = min(end, size)
        if end <= begin:
            raise ValueError(f"select range {begin}:{end} of dim {dim} is empty")
        sizes = list(self._sizes)
        strides = list(self._strides)
        sizes[dim] = -(-(end - begin) // step)
        strides[dim] *= step
        if sizes[dim] == 1:
            strides[dim] = self._strides[dim]
        return Slice(offset=self._offset + begin * self._strides[dim], sizes=sizes, strides=strides)

    def is_contiguous(self) -> bool:
        """True when the strides are the dense row-major strides of the sizes."""
        return all(n == 1 or s == r for n, s, r in
                   zip(self._sizes, self._strides, row_major_strides(self._sizes)))

    @staticmethod
    def new_row_major(sizes: Sequence[int], offset: int = 0) -> Slice:
        """A dense grid of ``sizes`` starting at ``offset``."""
        return Slice(offset=offset, sizes=sizes, strides=row_major_strides(sizes))

    @staticmethod
    def from_list(ranks: Sequence[int]) -> list[Slice]:
        """Cover ``ranks`` with 1-d arithmetic runs, scanning them in sorted order."""
        ordered = sorted(set(_as_int("rank", r) for r in ranks))
        runs: list[Slice] = []
        i = 0
        while i < len(ordered):
            start = ordered[i]
            if i + 1 == len(ordered):
                runs.append(Slice(offset=start, sizes=[1], strides=[1]))
                break
            step = ordered[i + 1] - start
            j = i + 1
            while j + 1 < len(ordered) and ordered[j + 1] - ordered[j] == step:
                j += 1
            runs.append(Slice(offset=start, sizes=[j - i + 1], strides=[step]))
            i = j + 1
        return runs


def _rebuild(offset, sizes, strides) -> Slice:
    return Slice(offset=offset, sizes=sizes, strides=strides)


def _validate(offset: int, sizes: tuple, strides: tuple) -> None:
    if len(sizes) != len(strides):
        raise ValueError(f"Slice needs one stride per size: sizes {list(sizes)} has {len(sizes)}, "
                         f"strides {list(strides)} has {len(strides)}")
    if offset < 0:
        raise ValueError(f"Slice offset must be >= 0, got {offset}")
    for s in sizes:
        if s < 1:
            raise ValueError(f"Slice sizes must be >= 1, got sizes {list(sizes)}")
    prev_stride: int | None = None
    prev_size, extent = 1, 1
    for stride, size in sorted(zip(strides, sizes)):
        if stride < 1:
            raise ValueError(f"Slice strides must be >= 1, got strides {list(strides)}")
        if prev_stride is not None:
            if stride == prev_stride and size > 1 and prev_size > 1:
                raise ValueError(f"Slice strides {list(strides)} repeat stride {stride} across dims of "
                                 f"sizes {prev_size} and {size}; ranks would collide")
            if stride % prev_stride:
                raise ValueError(f"Slice strides {list(strides)} are not rectangular: {stride} is not "
                                 f"a multiple of {prev_stride}")
        if stride < extent:
            raise ValueError(f"Slice stride {stride} is smaller than the extent {extent} of the dims inside "
                             f"it (sizes {list(sizes)}, strides {list(strides)}); ranks would collide")
        prev_stride, prev_size, extent = stride, size, stride * size

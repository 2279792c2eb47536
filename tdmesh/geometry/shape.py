"""Named dims over a :class:`~tdmesh.geometry.slice.Slice`: the geometry of a mesh.

``Shape`` is the pure value behind ``DeviceMesh``: selecting, renaming, splitting and
flattening dims only rewrites offset/sizes/strides, so every sub-mesh still names the
same global ranks in the same order.  No torch, no processes.

>>> s = Shape(("host", "gpu"), Slice.new_row_major([2, 8]))
>>> s
Shape({host=2, gpu=8}, Slice(offset=0, sizes=[2, 8], strides=[8, 1]))
>>> s.select("gpu", slice(3, 5)).ranks()
[3, 4, 11, 12]
>>> s.index(host=1).ranks()
[8, 9, 10, 11, 12, 13, 14, 15]
>>> s.split(host=("dp", "pp"), pp=1).sizes
{'dp': 2, 'pp': 1, 'gpu': 8}
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Iterable, Mapping, Sequence

from ..errors import UnknownDimError
from .slice import Slice, ravel, row_major_strides

__all__ = ["Shape", "UnknownDimError"]


def _unknown(dim, labels) -> UnknownDimError:
    return UnknownDimError(f"mesh has no dim {dim!r}; its dims are {list(labels)}")


class Shape:
    """An immutable ``(labels, slice)`` pair; one label per dim of the slice."""

    __slots__ = ("_labels", "_slice", "_hash")
    _labels: tuple[str, ...]
    _slice: Slice
    _hash: int

    def __init__(self, labels: Sequence[str], slice: Slice) -> None:
        labels = tuple(labels)
        if not isinstance(slice, Slice):
            raise TypeError(f"Shape needs a Slice, got {type(slice).__name__}")
        if len(labels) != slice.ndim:
            raise ValueError(f"Shape has {len(labels)} labels {list(labels)} for a {slice.ndim}-dim {slice!r}")
        for label in labels:
            if not isinstance(label, str) or not label.isidentifier():
                raise ValueError(f"dim names must be identifiers, got {label!r}")
        if len(set(labels)) != len(labels):
            raise ValueError(f"duplicate dim names in {list(labels)}")
        object.__setattr__(self, "_labels", labels)
        object.__setattr__(self, "_slice", slice)
        # computed once: shapes key the client's per-op caches (groups, reduce plans)
        object.__setattr__(self, "_hash", hash((Shape, labels, slice)))

    def __setattr__(self, name, value):
        raise AttributeError(f"Shape is immutable; cannot set {name!r}")

    def __reduce__(self):
        return (Shape, (self._labels, self._slice))

    def __eq__(self, other) -> bool:
        if not isinstance(other, Shape):
            return NotImplemented
        return self._labels == other._labels and self._slice == other._slice

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        return "{" + ", ".join(f"{n}={s}" for n, s in zip(self._labels, self._slice.sizes)) + "}"

    def __repr__(self) -> str:
        return f"Shape({self}, {self._slice!r})"

    @property
    def labels(self) -> tuple[str, ...]:
        return self._labels

    @property
    def slice(self) -> Slice:
        return self._slice

    @property
    def sizes(self) -> dict[str, int]:
        return dict(zip(self._labels, self._slice.sizes))

    @staticmethod
    def unity() -> Shape:
        """The shape of a single rank: no dims."""
        return Shape((), Slice(offset=0, sizes=[], strides=[]))

    def __len__(self) -> int:
        return len(self._slice)

    def dim(self, label: str) -> int:
        """Position of ``label``; :class:`UnknownDimError` names the valid dims."""
        try:
            return self._labels.index(label)
        except ValueError:
            raise _unknown(label, self._labels) from None

    def size(self, dims: None | str | Iterable[str] = None) -> int:
        """Number of ranks along ``dims`` (all dims when ``None``)."""
        if dims is None:
            return len(self._slice)
        if isinstance(dims, str):
            dims = (dims,)
        return math.prod(self._slice.sizes[self.dim(d)] for d in dims)

    def ranks(self) -> list[int]:
        """Global ranks in row-major order of the coordinates."""
        return list(self._slice)

    def coordinates(self, rank: int) -> dict[str, int]:
        """``{dim: coordinate}`` of ``rank``; ``ValueError`` if the shape does not hold it."""
        return dict(zip(self._labels, self._slice.coordinates(rank)))

    # -- selection ---------------------------------------------------------------------
    def at(self, label: str, index: int) -> Shape:
        """Fix ``label`` at ``index`` and drop the dim."""
        d = self.dim(label)
        size = self._slice.sizes[d]
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"index for dim {label!r} must be an int or a slice, got {index!r}")
        if not 0 <= index < size:
            raise IndexError(f"index {index} out of range for dim {label!r} of size {size} (valid: 0..{size - 1})")
        return Shape(self._labels[:d] + self._labels[d + 1:], self._slice.at(d, index))

    def select(self, label: str, pyslice: builtins.slice) -> Shape:
        """Restrict ``label`` to ``pyslice`` (Python semantics; negative steps rejected)."""
        d = self.dim(label)
        size = self._slice.sizes[d]
        if pyslice.step is not None and pyslice.step <= 0:
            raise ValueError(f"slice of dim {label!r} must have a positive step, got {pyslice.step}")
        start, stop, step = pyslice.indices(size)
        if stop <= start:
            raise ValueError(f"slice {_fmt(pyslice)} of dim {label!r} (size {size}) selects no ranks")
        return Shape(self._labels, self._slice.select(d, start, stop, step))

    def index(self, /, **coords: int | builtins.slice) -> Shape:
        """Apply ``at`` (ints) and ``select`` (slices) in keyword order."""
        shape = self
        for label, value in coords.items():
            shape = shape.select(label, value) if isinstance(value, slice) else shape.at(label, value)
        return shape

    # -- reshaping -------------------------------------------------------------------------
    def rename(self, /, **renames: str) -> Shape:
        """Rename dims; ranks, sizes and strides are unchanged."""
        for old in renames:
            self.dim(old)  # an unknown dim is an UnknownDimError, not a split size constraint
        return self.split(**{old: (new,) for old, new in renames.items()})

    def split(self, /, **kw: Sequence[str] | int) -> Shape:
        """Split dims into several: ``split(host=("dp", "pp"), gpu=("tp",), pp=4)``.

        A keyword naming an existing dim gives its new dim names; any other keyword gives
        the size of a new dim.  At most one new size per split is left to be inferred.
        """
        splits: dict[str, tuple[str, ...]] = {}
        constraints: dict[str, int] = {}
        for key, value in kw.items():
            if key in self._labels:
                if isinstance(value, str) or not isinstance(value, Sequence):
                    raise ValueError(f"split({key}=...) needs a sequence of new dim names for existing dim "
                                     f"{key!r}, got {value!r}")
                splits[key] = tuple(value)
            else:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"{key!r} is not an existing dim (dims are {list(self._labels)}); "
                                     f"expected an integer size constraint for a new dim, got {value!r}")
                if value < 1:
                    raise ValueError(f"size constraint {key}={value} must be >= 1")
                constraints[key] = value
        labels: list[str] = []
        sizes: list[int] = []
        strides: list[int] = []
        used: set[str] = set()
        for label, size, stride in zip(self._labels, self._slice.sizes, self._slice.strides):
            new_names = splits.get(label, (label,))
            if not new_names:
                raise ValueError(f"split of dim {label!r} needs at least one new name")
            new_sizes = _infer_sizes(label, size, new_names, constraints)
            used.update(n for n in new_names if n in constraints)
            for name in new_names:
                if name in labels:
                    raise ValueError(f"Duplicate dimension name {name!r} after split; dims would be "
                                     f"{labels + [name]}")
            labels.extend(new_names)
            sizes.extend(new_sizes)
            strides.extend(stride * s for s in row_major_strides(new_sizes))
        unused = set(constraints) - used
        if unused:
            raise ValueError(f"unused size constraints {sorted(unused)}: no split produces those dims "
                             f"(dims are {list(self._labels)})")
        return Shape(labels, Slice(offset=self._slice.offset, sizes=sizes, strides=strides))

    def flatten(self, name: str) -> Shape:
        """Merge every dim into one called ``name``; only dense meshes can be flattened."""
        if not self._slice.is_contiguous():
            raise ValueError(f"cannot flatten sparse mesh: {self._slice!r} has gaps between its ranks; "
                             f"only dense (row-major) meshes flatten")
        return Shape((name,), Slice(offset=self._slice.offset, sizes=[len(self)], strides=[1]))

    # -- drawing ---------------------------------------------------------------------------
    def to_table(self) -> str:
        """The rank grid as text: the last dim across, the other dims down."""
        if not self._labels:
            return f"(no dims) rank {self._slice.offset}"
        ranks = self.ranks()
        *row_dims, col_dim = self._labels
        ncols = self._slice.sizes[-1]
        width = max(len(str(r)) for r in ranks + [ncols - 1])
        head_w = max([len(",".join(f"{d}={c}" for d, c in zip(row_dims, self._slice.sizes[:-1])))] + [0])
        lines = [" " * head_w + (" | " if row_dims else "") + f"{col_dim}: "
                 + " ".join(str(c).rjust(width) for c in range(ncols))]
        nrows = len(ranks) // ncols
        for row in range(nrows):
            coords = _unravel_row(row, self._slice.sizes[:-1])
            label = ",".join(f"{d}={c}" for d, c in zip(row_dims, coords))
            cells = " ".join(str(r).rjust(width) for r in ranks[row * ncols:(row + 1) * ncols])
            lines.append(label.ljust(head_w) + (" | " if row_dims else "") + " " * (len(col_dim) + 2) + cells)
        return "\n".join(lines)


def _unravel_row(row: int, sizes: Sequence[int]) -> list[int]:
    out = []
    for n in reversed(sizes):
        row, c = divmod(row, n)
        out.append(c)
    return out[::-1]


def _infer_sizes(label: str, size: int, names: Sequence[str], constraints: Mapping[str, int]) -> list[int]:
    unknown = [n for n in names if n not in constraints]
    if len(names) == 1 and not unknown:
        known = constraints[names[0]]
        if known != size:
            raise ValueError(f"dim {label!r} has size {size}, not the {known} asked for {names[0]!r}")
        return [known]
    if len(unknown) > 1:
        raise ValueError(f"Cannot infer size of dims {unknown} when splitting {label!r} (size {size}); "
                         f"give all but one a size, e.g. {unknown[0]}=N")
    known = math.prod(constraints[n] for n in names if n in constraints)
    if unknown:
        if size % known:
            raise ValueError(f"dim {label!r} of size {size} cannot be evenly divided into sizes {known} "
                             f"and an inferred {unknown[0]!r}")
        inferred = size // known
    elif known != size:
        raise ValueError(f"sizes {[constraints[n] for n in names]} of {list(names)} multiply to {known}, "
                         f"not the size {size} of dim {label!r}")
    return [constraints[n] if n in constraints else inferred for n in names]


def _fmt(s: slice) -> str:
    return f"{'' if s.start is None else s.start}:{'' if s.stop is None else s.stop}" + (
        "" if s.step is None else f":{s.step}")


# re-exported for callers that want row-major arithmetic alongside shapes
__all__ += ["ravel"]

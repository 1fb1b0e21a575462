"""Named, multi-dimensional mesh shapes.

A ``Shape`` maps named coordinates (``{"hosts": 2, "gpus": 4}``) to ranks of an
underlying flat list of procs, like a strided numpy view over ``arange(n)``::

    >>> s = Shape(("hosts", "gpus"), (2, 4))
    >>> s.slice(gpus=1).ranks()
    [1, 5]
    >>> s.slice(hosts=slice(0, 1)).sizes
    {'hosts': 1, 'gpus': 4}

Indexing a dim with an int removes that dim; with a slice keeps it.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Shape:
    """Named dims over a strided view of flat ranks ``offset + sum(i * stride)``."""

    names: tuple[str, ...]
    dims: tuple[int, ...]
    offset: int = 0
    strides: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if len(self.names) != len(self.dims):
            raise ValueError(f"shape has {len(self.names)} names but {len(self.dims)} sizes")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"duplicate dimension names in {self.names}")
        for n, d in zip(self.names, self.dims):
            if not isinstance(n, str) or not n:
                raise ValueError(f"dimension names must be non-empty strings, got {n!r}")
            if not isinstance(d, int) or isinstance(d, bool) or d < 1:
                raise ValueError(f"dimension {n!r} must have a positive int size, got {d!r}")
        if self.strides is None:
            strides, acc = [], 1
            for d in reversed(self.dims):
                strides.append(acc)
                acc *= d
            object.__setattr__(self, "strides", tuple(reversed(strides)))

    @classmethod
    def from_sizes(cls, sizes: Mapping[str, int]) -> Shape:
        """``Shape.from_sizes({"hosts": 2, "gpus": 4})``."""
        if not isinstance(sizes, Mapping):
            raise TypeError(f"mesh sizes must be a dict of name -> size, got {sizes!r}")
        return cls(tuple(sizes), tuple(sizes.values()))

    @property
    def sizes(self) -> dict[str, int]:
        return dict(zip(self.names, self.dims))

    def __len__(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n

    def ranks(self) -> list[int]:
        """Flat ranks of the underlying list, in row-major order of this shape."""
        return list(_ranks(self))

    def coordinates(self) -> Iterator[dict[str, int]]:
        """Every point's coordinates, row-major."""
        for idx in itertools.product(*(range(d) for d in self.dims)):
            yield dict(zip(self.names, idx))

    def slice(self, **kwargs: int | slice) -> Shape:
        """Select along named dims: an int drops the dim, a slice keeps it."""
        assert self.strides is not None
        for k in kwargs:
            if k not in self.names:
                raise KeyError(f"mesh has no dimension {k!r}; its dimensions are {list(self.names)}")
        names, dims, strides, offset = [], [], [], self.offset
        for n, d, s in zip(self.names, self.dims, self.strides):
            if n not in kwargs:
                names.append(n), dims.append(d), strides.append(s)
                continue
            sel = kwargs[n]
            if isinstance(sel, bool) or not isinstance(sel, (int, slice)):
                raise TypeError(f"index for dimension {n!r} must be an int or a slice, got {sel!r}")
            if isinstance(sel, int):
                i = sel + d if sel < 0 else sel
                if not 0 <= i < d:
                    raise IndexError(f"index {sel} out of range for dimension {n!r} of size {d}")
                offset += i * s
                continue
            start, stop, step = sel.indices(d)
            if step <= 0:
                raise ValueError(f"slice step for dimension {n!r} must be positive, got {step}")
            count = len(range(start, stop, step))
            if count == 0:
                raise ValueError(f"slice {sel} selects nothing from dimension {n!r} of size {d}")
            offset += start * s
            names.append(n), dims.append(count), strides.append(s * step)
        return Shape(tuple(names), tuple(dims), offset, tuple(strides))

    def index_of(self, rank: int) -> int:
        """Position of flat ``rank`` in this shape's row-major order."""
        try:
            return self.ranks().index(rank)
        except ValueError:
            raise ValueError(f"rank {rank} is not in {self}") from None

    def point(self, i: int) -> Point:
        """The ``i``-th point (row-major) of this shape."""
        if not 0 <= i < len(self):
            raise IndexError(f"point {i} out of range for shape {self} of {len(self)} points")
        coords, rem = {}, i
        for n, d in reversed(list(zip(self.names, self.dims))):
            coords[n] = rem % d
            rem //= d
        return Point(i, {n: coords[n] for n in self.names}, len(self))

    def __str__(self) -> str:
        return "{" + ", ".join(f"'{n}': {d}" for n, d in zip(self.names, self.dims)) + "}"


@functools.lru_cache(maxsize=4096)
def _ranks(shape: Shape) -> tuple[int, ...]:
    # Cached: every call on a mesh asks for its ranks, and shapes are immutable.
    assert shape.strides is not None
    return tuple(shape.offset + sum(i * s for i, s in zip(idx, shape.strides))
                 for idx in itertools.product(*(range(d) for d in shape.dims)))


class Point(Mapping):
    """A rank within a mesh: ``p.rank`` is its flat index, ``p["gpus"]`` a coordinate."""

    __slots__ = ("rank", "_coords", "size")

    def __init__(self, rank: int, coords: dict[str, int], size: int) -> None:
        self.rank = rank
        self._coords = coords
        self.size = size

    def __getitem__(self, name: str) -> int:
        try:
            return self._coords[name]
        except KeyError:
            raise KeyError(f"no dimension {name!r}; dimensions are {list(self._coords)}") from None

    def __iter__(self):
        return iter(self._coords)

    def __len__(self) -> int:
        return len(self._coords)

    def __int__(self) -> int:
        return self.rank

    def __index__(self) -> int:
        return self.rank

    def __eq__(self, other: object) -> bool:
        if isinstance(other, int):
            return self.rank == other
        if isinstance(other, Point):
            return self.rank == other.rank and self._coords == other._coords
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.rank)  # equal to its rank, so hashed as it: ``{4: "x"}[point]`` finds it

    def __repr__(self) -> str:
        return f"Point(rank={self.rank}, {self._coords})"

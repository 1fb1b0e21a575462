"""Named, multi-dimensional mesh shapes.

A ``Shape`` maps named coordinates (``{"hosts": 2, "gpus": 4}``) to ranks of an
underlying flat list of procs, like a strided numpy view over ``arange(n)``::

    >>> s = Shape(("hosts", "gpus"), (2, 4))
    >>> s.slice(gpus=1).ranks()
    [1, 5]
    >>> s.slice(hosts=slice(0, 1)).sizes
    {'hosts': 1, 'gpus': 4}

Indexing a dim with an int removes that dim; with a slice keeps it. ``split``, ``rename`` and
``flatten`` relabel the same ranks (Monarch's ``MeshTrait``)::

    >>> s.split(gpus=("pairs", "pos"), pos=2).sizes
    {'hosts': 2, 'pairs': 2, 'pos': 2}
    >>> s.slice(gpus=1).flatten("replicas").ranks()
    [1, 5]
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


class DimensionError(KeyError, TypeError, ValueError):
    """A mesh has no dimension of that name. A ``KeyError`` (whose message prints as written, not quoted),
    a ``TypeError`` as Monarch's ``slice`` raises for it, and a ``ValueError`` as Monarch raises for an
    unknown dimension elsewhere."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True, slots=True)
class Shape:
    """Named dims over a strided view of flat ranks ``offset + sum(i * stride)``."""

    names: tuple[str, ...]
    dims: tuple[int, ...]
    offset: int = 0
    strides: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.dims, NDSlice):  # Monarch's form: Shape(labels, NDSlice(offset=, sizes=, strides=))
            sl = self.dims
            object.__setattr__(self, "names", tuple(self.names))
            object.__setattr__(self, "dims", tuple(sl.sizes))
            object.__setattr__(self, "offset", sl.offset)
            object.__setattr__(self, "strides", tuple(sl.strides))
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

    def coordinates(self, rank: int | None = None):
        """Where flat ``rank`` lies in this shape, as ``{dim: index}`` (Monarch's); with no rank, every point's
        coordinates, row-major (an iterator)."""
        if rank is None:
            return (dict(zip(self.names, idx)) for idx in itertools.product(*(range(d) for d in self.dims)))
        return dict(self.point(self.index_of(rank)))

    @property
    def labels(self) -> list[str]:
        """The dims' names (Monarch's name for ``names``)."""
        return list(self.names)

    def at(self, label: str, index: int) -> Shape:
        """One index of dim ``label``; the dim goes (Monarch's)."""
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"at({label!r}, ...) takes an int index, got {index!r}; select() takes a slice")
        return self.slice(**{label: index})

    def select(self, label: str, sel: slice) -> Shape:
        """Dim ``label`` restricted to the slice ``sel``; the dim stays (Monarch's)."""
        if not isinstance(sel, slice):
            raise TypeError(f"select({label!r}, ...) takes a slice, got {sel!r}; at() takes an int")
        return self.slice(**{label: sel})

    def index(self, **kwargs: int) -> Shape:
        """``shape.index(hosts=0, gpus=3)``: those dims fixed, and gone (Monarch's)."""
        for k, v in kwargs.items():
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"index({k}=...) takes an int, got {v!r}")
        return self.slice(**kwargs)

    @staticmethod
    def unity() -> Shape:
        """The shape of one rank and no dims."""
        return Shape((), ())

    def slice(self, **kwargs: int | slice) -> Shape:
        """Select along named dims: an int drops the dim, a slice keeps it."""
        assert self.strides is not None
        for k in kwargs:
            if k not in self.names:
                raise DimensionError(f"mesh has no dimension {k!r}; its dimensions are {list(self.names)}")
        names, dims, strides, offset = [], [], [], self.offset
        for n, d, s in zip(self.names, self.dims, self.strides):
            if n not in kwargs:
                names.append(n)
                dims.append(d)
                strides.append(s)
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
            names.append(n)
            dims.append(count)
            strides.append(s * step)
        return Shape(tuple(names), tuple(dims), offset, tuple(strides))

    def split(self, **kwargs) -> Shape:
        """Split dims into several: ``split(hosts=("dp", "pp"), pp=2)``. A keyword naming one of this shape's
        dims gives the names it becomes; any other keyword gives the size of one of those new names (one
        name per split dim may be left out: its size is what remains). Dims not named stay as they are."""
        splits: dict[str, tuple[str, ...]] = {}
        sizes: dict[str, int] = {}
        for k, v in kwargs.items():
            if k in self.names:
                if isinstance(v, str) or not isinstance(v, Sequence) or not v:
                    raise ValueError(f"split({k}=...) takes a non-empty sequence of new dimension names, such "
                                     f"as ('{k}_a', '{k}_b'); got {v!r}")
                splits[k] = tuple(v)
            elif isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{k!r} is not a dimension of mesh {self}: split() expected an int size for a "
                                 f"new dimension, got {v!r}")
            elif v < 1:
                raise ValueError(f"split(): the size of the new dimension {k!r} must be positive, got {v}")
            else:
                sizes[k] = v
        names: list[str] = []
        dims: list[int] = []
        strides: list[int] = []
        assert self.strides is not None
        for n, d, s in zip(self.names, self.dims, self.strides):
            to = splits.get(n, (n,))
            unknown = [t for t in to if t not in sizes]
            if len(unknown) > 1:
                raise ValueError(f"split(): cannot infer the sizes of both {unknown[0]!r} and {unknown[1]!r} "
                                 f"from dimension {n!r}; give one, e.g. {unknown[1]}=2")
            known = 1
            for t in to:
                known *= sizes.get(t, 1)
            if unknown:
                if d % known:
                    raise ValueError(f"split(): dimension {n!r} of size {d} is not divisible into {to} "
                                     f"with sizes {tuple(sizes.get(t, '?') for t in to)}")
                sizes[unknown[0]] = d // known
            elif known != d:
                raise ValueError(f"split(): dimension {n!r} of size {d} does not split into {to} with sizes "
                                 f"{tuple(sizes[t] for t in to)} (their product is {known})")
            step = s
            new = []
            for t in reversed(to):
                new.append((t, sizes.pop(t), step))
                step *= new[-1][1]
            for t, size, stride in reversed(new):
                if t in names:
                    raise ValueError(f"split(): duplicate dimension name {t!r}")
                names.append(t)
                dims.append(size)
                strides.append(stride)
        if sizes:
            raise ValueError(f"split(): sizes given for dimensions that no split made: {sorted(sizes)}")
        return Shape(tuple(names), tuple(dims), self.offset, tuple(strides))

    def rename(self, **kwargs: str) -> Shape:
        """``rename(hosts="dp", gpus="tp")``: the same dims under new names."""
        for k, v in kwargs.items():
            if not isinstance(v, str):
                raise ValueError(f"rename({k}=...) takes the dimension's new name (a str), got {v!r}")
            if k not in self.names:
                raise DimensionError(f"mesh {self} has no dimension {k!r} to rename")
        return self.split(**{k: (v,) for k, v in kwargs.items()})

    def flatten(self, name: str) -> Shape:
        """All dims as one, ``name``, in row-major order. The ranks must lie evenly spaced (one dim is an
        offset, a size and a stride): flatten before slicing where a slice would leave gaps."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"flatten() takes the new dimension's name (a non-empty str), got {name!r}")
        assert self.strides is not None
        kept = [(d, s) for d, s in zip(self.dims, self.strides) if d > 1]
        stride = kept[-1][1] if kept else 1
        for (_, s), (d2, s2) in zip(kept, kept[1:]):
            if s != s2 * d2:
                raise ValueError(f"cannot flatten mesh {self}: its ranks are not evenly spaced, as one "
                                 f"dimension's are (flatten before slicing)")
        return Shape((name,), (len(self),), self.offset, (stride,))

    @property
    def extent(self) -> Extent:
        return Extent(self.names, self.dims)

    @property
    def ndslice(self) -> NDSlice:
        """The ranks as Monarch's ``NDSlice`` (offset, sizes, strides)."""
        return NDSlice(offset=self.offset, sizes=list(self.dims), strides=list(self.strides or ()))

    @property
    def region(self) -> Region:
        return Region(self.names, self.ndslice)

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
        return Point(i, self.extent)

    def __str__(self) -> str:
        return "{" + ", ".join(f"'{n}': {d}" for n, d in zip(self.names, self.dims)) + "}"


@functools.lru_cache(maxsize=4096)
def _ranks(shape: Shape) -> tuple[int, ...]:
    # Cached: every call on a mesh asks for its ranks, and shapes are immutable.
    assert shape.strides is not None
    return tuple(shape.offset + sum(i * s for i, s in zip(idx, shape.strides))
                 for idx in itertools.product(*(range(d) for d in shape.dims)))


class Point(Mapping):
    """A rank within a mesh, as Monarch's ``Point(rank, extent)``: ``p.rank`` is its row-major index in
    ``p.extent``, ``p["gpus"]`` a coordinate, ``p.size("gpus")`` that dim's size (``p.size()``: all ranks)."""

    __slots__ = ("rank", "extent", "_coords")

    def __init__(self, rank: int, extent: Extent | Mapping[str, int]) -> None:
        if not isinstance(extent, Extent):
            if not isinstance(extent, Mapping):
                raise TypeError(f"Point(rank, extent): extent must be an Extent or a dict of dim -> size, "
                                f"got {extent!r}")
            extent = Extent(list(extent), list(extent.values()))
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < extent.nelements:
            raise IndexError(f"Point: rank {rank!r} is not in extent {extent} of {extent.nelements} ranks")
        self.rank = rank
        self.extent = extent
        coords, rem = {}, rank
        for n, d in reversed(list(zip(extent.labels, extent.sizes))):
            coords[n] = rem % d
            rem //= d
        self._coords = {n: coords[n] for n in extent.labels}

    def size(self, label: str | None = None) -> int:
        """The size of dim ``label`` of this point's mesh; with no label, the number of its ranks."""
        return self.extent.nelements if label is None else self.extent[label]

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
            return self.rank == other.rank and self.extent == other.extent
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.rank)  # equal to its rank, so hashed as it: ``{4: "x"}[point]`` finds it

    def __reduce__(self):
        return Point, (self.rank, self.extent)

    def __repr__(self) -> str:
        return f"Point(rank={self.rank}, {self._coords})"

    def __str__(self) -> str:
        """Monarch's form: each dim's coordinate over its size, ``{'hosts': 0/1, 'gpus': 1/2}``."""
        return "{" + ", ".join(f"{n!r}: {c}/{self.extent[n]}" for n, c in self._coords.items()) + "}"


class Extent(Mapping):
    """The sizes of a mesh's dims, as Monarch's ``mesh.extent``: ``extent["gpus"]``, ``extent.labels``,
    ``extent.sizes``, ``extent.nelements``."""

    __slots__ = ("labels", "sizes")

    def __init__(self, labels: Sequence[str], sizes: Sequence[int]) -> None:
        if len(labels) != len(sizes):
            raise ValueError(f"Extent has {len(labels)} labels but {len(sizes)} sizes")
        for n, d in zip(labels, sizes):  # as Shape checks them: a mesh has no dim of size -1
            if not isinstance(n, str) or not n:
                raise ValueError(f"Extent: labels must be non-empty strings, got {n!r}")
            if not isinstance(d, int) or isinstance(d, bool) or d < 1:
                raise ValueError(f"Extent: dimension {n!r} must have a positive int size, got {d!r}")
        self.labels = list(labels)
        self.sizes = list(sizes)

    @property
    def nelements(self) -> int:
        n = 1
        for d in self.sizes:
            n *= d
        return n

    @property
    def region(self) -> Region:
        """These sizes over ranks ``0..n-1``, row-major (Monarch's)."""
        return Region(list(self.labels), NDSlice.new_row_major(list(self.sizes)))

    def __getitem__(self, label: str) -> int:
        try:
            return self.sizes[self.labels.index(label)]
        except ValueError:
            raise KeyError(f"no dimension {label!r}; dimensions are {self.labels}") from None

    def __iter__(self):
        return iter(self.labels)

    def __len__(self) -> int:
        return len(self.labels)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Extent):
            return (self.labels, self.sizes) == (other.labels, other.sizes)
        return Mapping.__eq__(self, other)

    __hash__ = None  # type: ignore[assignment]  # like a dict

    def __repr__(self) -> str:
        return "{" + ", ".join(f"'{n}': {d}" for n, d in zip(self.labels, self.sizes)) + "}"


class NDSlice:
    """Monarch's ``NDSlice``: the flat values ``offset + sum(i_k * strides[k])`` for ``0 <= i_k < sizes[k]``, in
    row-major order of the coordinates ``i``.

    >>> s = NDSlice(offset=1, sizes=[2, 3], strides=[4, 1])
    >>> list(s), s.index(6), s.coordinates(6), s.nditem([1, 2])
    ([1, 2, 3, 5, 6, 7], 4, [1, 1], 7)
    """

    __slots__ = ("_offset", "_sizes", "_strides")

    def __init__(self, *, offset: int, sizes: Sequence[int], strides: Sequence[int]) -> None:
        sizes, strides = list(sizes), list(strides)
        if len(sizes) != len(strides):
            raise ValueError(f"NDSlice: {len(sizes)} sizes but {len(strides)} strides")
        for what, xs in (("offset", [offset]), ("sizes", sizes), ("strides", strides)):
            if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in xs):
                got = f"{offset!r} ({type(offset).__name__})" if what == "offset" else repr(xs)  # '0', not 0
                raise ValueError(f"NDSlice: {what} must be non-negative ints, got {got}")
        if any(d == 0 for d in sizes):
            raise ValueError(f"NDSlice: every size must be positive, got {sizes}")
        self._offset, self._sizes, self._strides = offset, sizes, strides

    @property
    def ndim(self) -> int:
        return len(self._sizes)

    @property
    def offset(self) -> int:
        return self._offset

    @property
    def sizes(self) -> list[int]:
        return list(self._sizes)

    @property
    def strides(self) -> list[int]:
        return list(self._strides)

    def __len__(self) -> int:
        n = 1
        for d in self._sizes:
            n *= d
        return n

    def nditem(self, coordinates: Sequence[int]) -> int:
        """The value at ``coordinates`` (an IndexError when out of bounds)."""
        if len(coordinates) != len(self._sizes):
            raise IndexError(f"NDSlice: {len(coordinates)} coordinates for {len(self._sizes)} dims")
        v = self._offset
        for c, d, st in zip(coordinates, self._sizes, self._strides):
            if not 0 <= c < d:
                raise IndexError(f"NDSlice: coordinate {c} out of range for a dim of size {d}")
            v += c * st
        return v

    def get(self, index: int) -> int:
        """The value at row-major position ``index`` (the inverse of ``index``)."""
        if not 0 <= index < len(self):
            raise IndexError(f"NDSlice: index {index} out of range for {len(self)} values")
        coords = []
        for d in reversed(self._sizes):
            index, c = divmod(index, d)
            coords.append(c)
        return self.nditem(coords[::-1])

    def coordinates(self, value: int) -> list[int]:
        """The coordinates of ``value`` (a ValueError when it is not in the slice)."""
        rest = value - self._offset
        coords = [0] * len(self._sizes)
        # largest strides first; dims of size 1 (any stride) stay at 0
        for k in sorted(range(len(self._sizes)), key=lambda k: -self._strides[k]):
            if self._sizes[k] > 1 and self._strides[k] > 0:
                c = min(rest // self._strides[k], self._sizes[k] - 1) if rest >= 0 else -1
                coords[k] = c
                rest -= c * self._strides[k]
        if rest == 0 and all(c >= 0 for c in coords):
            return coords
        # strides that do not nest (not from slicing a row-major mesh): look the value up
        for point in itertools.product(*(range(d) for d in self._sizes)):
            if self.nditem(point) == value:
                return list(point)
        raise ValueError(f"{value} is not in {self!r}")

    def index(self, value: int) -> int:
        """The row-major position of ``value`` (the inverse of ``get``)."""
        i = 0
        for c, d in zip(self.coordinates(value), self._sizes):
            i = i * d + c
        return i

    def __iter__(self):
        return (self.nditem(c) for c in itertools.product(*(range(d) for d in self._sizes)))

    def __getitem__(self, i):
        values = tuple(self)
        return values[i]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NDSlice) and (self._offset, self._sizes, self._strides) == (
            other._offset, other._sizes, other._strides)

    def __hash__(self) -> int:
        return hash((self._offset, tuple(self._sizes), tuple(self._strides)))

    def __reduce__(self):
        return (_ndslice, (self._offset, self._sizes, self._strides))

    def __repr__(self) -> str:
        return f"NDSlice(offset={self._offset}, sizes={self._sizes}, strides={self._strides})"

    @staticmethod
    def new_row_major(sizes: Sequence[int]) -> NDSlice:
        """The contiguous slice of ``sizes``, from 0."""
        strides, acc = [], 1
        for d in reversed(list(sizes)):
            strides.append(acc)
            acc *= d
        return NDSlice(offset=0, sizes=list(sizes), strides=strides[::-1])

    @staticmethod
    def from_list(ranks: Sequence[int]) -> list[NDSlice]:
        """1-d slices that together hold exactly ``ranks`` (sorted, duplicates dropped): runs of evenly spaced
        ranks, each as long as it can be."""
        rs = sorted(set(ranks))
        out: list[NDSlice] = []
        i = 0
        while i < len(rs):
            if i + 1 == len(rs):
                out.append(NDSlice(offset=rs[i], sizes=[1], strides=[1]))
                break
            step, j = rs[i + 1] - rs[i], i + 1
            while j + 1 < len(rs) and rs[j + 1] - rs[j] == step:
                j += 1
            out.append(NDSlice(offset=rs[i], sizes=[j - i + 1], strides=[step]))
            i = j + 1
        return out


def _ndslice(offset, sizes, strides) -> NDSlice:
    return NDSlice(offset=offset, sizes=sizes, strides=strides)


class Region:
    """Monarch's ``Region``: labels over an ``NDSlice`` of ranks."""

    __slots__ = ("_labels", "_slice")

    def __init__(self, labels: Sequence[str], slice: NDSlice) -> None:  # Monarch's name
        if len(labels) != slice.ndim:
            raise ValueError(f"Region: {len(labels)} labels for a slice of {slice.ndim} dims")
        self._labels, self._slice = list(labels), slice

    @property
    def labels(self) -> list[str]:
        return list(self._labels)

    def slice(self) -> NDSlice:
        return self._slice

    def as_shape(self) -> Shape:
        sl = self._slice
        return Shape(tuple(self._labels), tuple(sl.sizes), sl.offset, tuple(sl.strides))

    def point_of_base_rank(self, rank: int) -> Point:
        """The point of this region at flat rank ``rank``."""
        return Point(self._slice.index(rank), Extent(self._labels, self._slice.sizes))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Region) and (self._labels, self._slice) == (other._labels, other._slice)

    def __hash__(self) -> int:
        return hash((tuple(self._labels), self._slice))

    def __reduce__(self):
        return (Region, (self._labels, self._slice))

    def __repr__(self) -> str:
        return f"Region({self._labels}, {self._slice!r})"


class MeshTrait:
    """What every mesh (procs, actors, values) offers over its ``_shape``: ``slice``, ``split``, ``rename``,
    ``flatten``, ``size``, ``sizes``, ``extent``, ``len``. A mesh says how to make itself over another
    shape of the same ranks (``_new_with_shape``) and what to call itself in errors (``_what``)."""

    _shape: Shape

    def _new_with_shape(self, shape: Shape):
        raise NotImplementedError

    def _what(self) -> str:
        return f"mesh {self._shape}"

    def slice(self, **kwargs):
        """Select along named dims: ``mesh.slice(hosts=0, gpus=slice(0, 2))`` (an int drops its dim)."""
        return self._new_with_shape(self._shape.slice(**kwargs))

    def split(self, **kwargs):
        """``mesh.split(hosts=("dp", "pp"), gpus=("tp", "cp"), pp=2, cp=2)``: the same ranks, more dims."""
        return self._new_with_shape(self._shape.split(**kwargs))

    def rename(self, **kwargs: str):
        """``mesh.rename(hosts="dp", gpus="tp")``."""
        return self._new_with_shape(self._shape.rename(**kwargs))

    def flatten(self, name: str):
        """The same ranks as one dim ``name``."""
        return self._new_with_shape(self._shape.flatten(name))

    def size(self, dim: str | Sequence[str] | None = None) -> int:
        """The number of ranks: in all (``dim`` None), along ``dim``, or over several dims."""
        if dim is None:
            return len(self._shape)
        if isinstance(dim, str):
            if dim not in self._shape.names:
                raise DimensionError(f"{self._what()} has no dimension {dim!r}; its dimensions are "
                               f"{list(self._shape.names)}")
            return self._shape.dims[self._shape.names.index(dim)]
        n = 1
        for d in dim:
            n *= self.size(d)
        return n

    @property
    def sizes(self) -> dict[str, int]:
        return self._shape.sizes

    @property
    def shape(self) -> Shape:
        return self._shape

    @property
    def extent(self) -> Extent:
        return self._shape.extent

    def __len__(self) -> int:
        return len(self._shape)

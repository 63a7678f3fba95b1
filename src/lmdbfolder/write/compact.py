"""Compact sample lists: paths as one buffer of bytes, labels as one int32 array.

A ``SourceList`` of ImageNet (1.28M files) held as Python lists costs about
120 MB of ``str`` and ``int`` objects, and every forked reader process that
touches them (a refcount is a write) ends with a private copy of the pages
they sit on. ``PathList`` keeps the file system's bytes of every path in one
``bytes`` object plus an ``array('Q')`` of offsets (~45 bytes a path), and
``LabelList`` the labels in an ``array('i')`` (4 bytes a label): three
Python objects in all, whatever the count, so a fork shares them for free.

Both behave like the lists they replace (indexing, slicing, ``len``,
iteration, ``==`` against any sequence) and pickle compactly (Ray, spawn).
They also write the pack's label and path tables straight from their
buffers (``labels_table`` and ``paths_table`` in ``lmdbfolder.format``),
without building a Python object per sample.
"""

from __future__ import annotations

import array
import itertools
import os
from typing import Any, Collection, Iterable, Iterator, Sequence, overload

import numpy as np

from lmdbfolder.format import labels_table, paths_table

__all__ = ["PathList", "LabelList"]


def _u64(offsets: array.array) -> np.ndarray:
    return np.frombuffer(offsets, dtype=np.uint64)


def _kept_runs(n: int, drop: Collection[int]) -> list[tuple[int, int]]:
    """The ranges ``[a, b)`` of ``0..n-1`` left when the indices in ``drop`` are removed."""
    runs, start = [], 0
    for d in sorted(set(drop)):
        if start < d:
            runs.append((start, d))
        start = d + 1
    if start < n:
        runs.append((start, n))
    return runs


class PathList(Sequence[str]):
    """Relative paths in one buffer: path ``i`` is ``os.fsdecode(names[offsets[i]:offsets[i + 1]])``.

    Built from any iterable of ``str`` (file names as ``os.fsdecode`` gives
    them, so names that are not valid UTF-8 round-trip). Slices share the
    buffer (a shard's slice copies only its offsets); pickling writes only
    the part a slice covers.
    """

    __slots__ = ("_names", "_offsets")
    __hash__ = None  # type: ignore[assignment]  # mutable-looking sequence, like list

    def __init__(self, paths: Iterable[str] = ()) -> None:
        if isinstance(paths, PathList):
            self._names: bytes = paths._names
            self._offsets: array.array = paths._offsets
            return
        items = paths if isinstance(paths, (list, tuple)) else list(paths)
        self._names, self._offsets = _encode(items)

    @classmethod
    def from_parts(cls, names: bytes, offsets: array.array) -> PathList:
        """A PathList over ``names`` with the ``len + 1`` offsets ``offsets`` (an ``array('Q')``)."""
        if offsets.typecode != "Q" or not len(offsets):
            raise ValueError("offsets must be a non-empty array('Q')")
        out = cls.__new__(cls)
        out._names, out._offsets = names, offsets
        return out

    def __len__(self) -> int:
        return len(self._offsets) - 1

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> PathList: ...
    def __getitem__(self, index: int | slice) -> str | PathList:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return PathList([self[i] for i in range(start, stop, step)])
            return PathList.from_parts(self._names, self._offsets[start : max(start, stop) + 1])
        return os.fsdecode(self.raw(index))

    def raw(self, index: int) -> bytes:
        """Path ``index`` as the file system's bytes."""
        n = len(self)
        i = index.__index__()
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"path index {index} out of range for {n} paths")
        return self._names[self._offsets[i] : self._offsets[i + 1]]

    def iter_raw(self) -> Iterator[bytes]:
        """Every path as the file system's bytes, in order."""
        names, offsets = self._names, self._offsets
        for i in range(len(offsets) - 1):
            yield names[offsets[i] : offsets[i + 1]]

    def __iter__(self) -> Iterator[str]:
        for name in self.iter_raw():
            yield os.fsdecode(name)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PathList):
            return len(self) == len(other) and all(a == b for a, b in zip(self.iter_raw(), other.iter_raw()))
        if isinstance(other, (list, tuple, Sequence)) and not isinstance(other, (str, bytes)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    @property
    def nbytes(self) -> int:
        """Bytes of memory the names and offsets this list covers take."""
        return int(self._offsets[-1] - self._offsets[0]) + len(self._offsets) * self._offsets.itemsize

    def _compacted(self) -> tuple[bytes, array.array]:
        """Names and offsets of just this list (a slice's own part, offsets from 0)."""
        first, last = self._offsets[0], self._offsets[-1]
        if first == 0 and last == len(self._names):
            return self._names, self._offsets
        offsets = array.array("Q")
        offsets.frombytes((_u64(self._offsets) - np.uint64(first)).tobytes())
        return self._names[first:last], offsets

    def table(self, drop: Collection[int] = ()) -> bytearray:
        """The pack's path table (``format.paths_table``) of every path but the indices in ``drop``."""
        names, offsets = self._compacted()
        if not drop:
            return paths_table(_u64(offsets), memoryview(names))
        runs = _kept_runs(len(self), drop)
        offs = _u64(offsets)
        lengths = np.concatenate([np.diff(offs[a : b + 1]) for a, b in runs]) if runs else np.zeros(0, np.uint64)
        new = np.zeros(len(lengths) + 1, np.uint64)
        np.cumsum(lengths, out=new[1:])
        joined = b"".join(memoryview(names)[offs[a] : offs[b]] for a, b in runs)
        return paths_table(new, memoryview(joined))

    def __reduce__(self) -> tuple[Any, ...]:
        return (PathList.from_parts, self._compacted())

    def __repr__(self) -> str:
        head = ", ".join(repr(p) for p in self[:3])
        return f"PathList([{head}{', ...' if len(self) > 3 else ''}], len={len(self)})"


def _encode(paths: Sequence[str]) -> tuple[bytes, array.array]:
    """One buffer of every path's file-system bytes, and the ``len + 1`` offsets."""
    # One join and one encode in C, not a bytes object per path: the
    # encoding (UTF-8 with surrogateescape on Linux) works code point by code
    # point, so encoding the joined text equals joining the encoded names.
    # Offsets come from the lengths of the str when all of it is ASCII (one
    # byte a character), else from each name's encoding, one at a time. At
    # most the joined text and its bytes exist beside the caller's list.
    joined = "".join(paths)
    ascii_only = joined.isascii()
    names = os.fsencode(joined)
    del joined
    lengths: Iterable[int] = map(len, paths) if ascii_only else map(len, map(os.fsencode, paths))
    offsets = array.array("Q", [0])
    offsets.extend(itertools.accumulate(lengths))
    return names, offsets


class LabelList(Sequence[int]):
    """Labels in one ``array('i')`` (int32), with the behaviour of a list of ints."""

    __slots__ = ("_labels",)
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, labels: Iterable[int] = ()) -> None:
        if isinstance(labels, LabelList):
            self._labels: array.array = labels._labels
        elif isinstance(labels, array.array) and labels.typecode == "i":
            self._labels = labels
        else:
            try:
                self._labels = array.array("i", labels)
            except OverflowError:
                raise ValueError("labels must fit in int32 (-1 .. 2**31-1)") from None

    @property
    def array(self) -> array.array:
        """The labels as the underlying ``array('i')`` (not a copy)."""
        return self._labels

    def __len__(self) -> int:
        return len(self._labels)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> LabelList: ...
    def __getitem__(self, index: int | slice) -> int | LabelList:
        if isinstance(index, slice):
            return LabelList(self._labels[index])
        return self._labels[index]  # type: ignore[no-any-return]

    def __iter__(self) -> Iterator[int]:
        return iter(self._labels)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LabelList):
            return self._labels == other._labels
        if isinstance(other, (list, tuple, array.array, Sequence)) and not isinstance(other, (str, bytes)):
            return len(self) == len(other) and all(a == b for a, b in zip(self._labels, other))
        return NotImplemented

    def table(self, drop: Collection[int] = ()) -> bytes:
        """The pack's label table (``format.labels_table``) of every label but the indices in ``drop``."""
        if not drop:
            return labels_table(self._labels)
        kept = array.array("i")
        for a, b in _kept_runs(len(self), drop):
            kept.extend(self._labels[a:b])
        return labels_table(kept)

    def __reduce__(self) -> tuple[Any, ...]:
        return (LabelList, (self._labels,))

    def __repr__(self) -> str:
        head = ", ".join(str(x) for x in self._labels[:6])
        return f"LabelList([{head}{', ...' if len(self) > 6 else ''}], len={len(self)})"

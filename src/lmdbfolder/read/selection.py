"""Which packed samples a dataset shows: ImageFolder's filters, applied to a pack when it is read.

``LMDBFolder`` takes ImageFolder's ``extensions``, ``is_valid_file``,
``allow_empty`` and a ``find_classes`` override. A pack already holds the
sample list that ImageFolder would have built by walking the tree, so these
filter that list instead of the file system, with ImageFolder's rules:

* ``extensions`` (a string or a tuple, matched case-insensitively at the end
  of the path) and ``is_valid_file`` (called with the sample's path under the
  source root) exclude each other;
* ``class_to_idx`` keeps the samples of the classes it names, labelled with
  its indices, in the pack's order (which is ImageFolder's: sorted class
  names, then the sorted walk);
* a class that ends up without samples is an error (``NoSamplesError``, a
  ``FileNotFoundError``) unless ``allow_empty``.

The result is a ``Selection``: the pack index of every dataset position and,
where they differ from the stored ones, the targets. Both are numpy arrays, so
a dataset sends them to its worker processes as a few bytes per sample. It
also answers the per-sample questions (which record, which target), so the
dataset holds no "is anything selected" branches of its own.

Paths: a sample's path is the source root recorded in the manifest joined
with the stored relative path (``sample_path``); ``relative_to_pack`` and
``PathIndex`` go back from such a path to the stored sample.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from lmdbfolder.errors import NoSamplesError
from lmdbfolder.format import Manifest, ShardIndex, SourceRecord
from lmdbfolder.packfile import class_counts

__all__ = [
    "Selection",
    "Subset",
    "select",
    "source_root_of",
    "sample_path",
    "relative_to_pack",
    "PathIndex",
    "normalize_extensions",
]


@dataclass(frozen=True, eq=False)
class Selection:
    """The samples a dataset shows: every record of the pack, in order.

    ``indices``: the pack index of each dataset position (None: every record, in order).
    ``labels``: the target of each position where they differ from the stored labels (else None).
    ``total``: the number of records in the pack.

    ``Selection.of`` builds the right kind: this class when the dataset shows
    the pack as it is (a position is a pack index: nothing to translate, the
    reader checks the range), ``Subset`` otherwise. The dataset asks the same
    questions of either (``fetch``, ``fetch_many``, ``target``), so which kind it
    holds is decided once, when the selection is made.
    """

    indices: np.ndarray | None
    labels: Any
    total: int

    @staticmethod
    def of(indices: np.ndarray | None, labels: Any, total: int) -> Selection:
        """The selection of these positions (None: every record) with these targets (None: the stored ones)."""
        if indices is None and labels is None:
            return Selection(None, None, total)
        return Subset(indices, labels, total)

    def __len__(self) -> int:
        return self.total if self.indices is None else len(self.indices)

    def fetch(self, reader: Any, index: int) -> tuple[Any, int | None]:
        """``(record, position)`` of dataset index ``index`` (position None: the record's own label is the target)."""
        return reader.get(index), None

    def fetch_many(self, reader: Any, indices: Sequence[int], prefetch: bool) -> tuple[list[Any], list[int | None]]:
        """``fetch`` for a batch of dataset indices: the records read together (``get_many``)."""
        return reader.get_many(indices, prefetch=prefetch), [None] * len(indices)

    def pack_index(self, position: int) -> int:
        """The pack index of an in-range dataset ``position``."""
        return position

    def target(self, label: int, position: int | None) -> Any:
        """The target of the sample at ``position`` whose stored label is ``label``."""
        return label

    def stored_labels(self, reader: Any) -> list[Any]:
        """Every position's target, in order (``targets``)."""
        return list(reader.labels.tolist())

    def position(self, index: Any, where: str) -> int:
        """``index`` as a position in range (negative counts from the end); IndexError
        naming ``where`` (the pack) when it is out of range, TypeError if not an integer."""
        try:
            i = index.__index__()
        except AttributeError:
            raise TypeError(f"sample index must be an integer, got {type(index).__name__}") from None
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {index} is out of range for {where} ({n} samples)")
        return int(i)


@dataclass(frozen=True, eq=False)
class Subset(Selection):
    """Some records of the pack, in some order, possibly relabelled (see ``Selection``)."""

    def fetch(self, reader: Any, index: int) -> tuple[Any, int | None]:
        position = self.position(index, reader.path)
        return reader.get(self.pack_index(position)), position

    def fetch_many(self, reader: Any, indices: Sequence[int], prefetch: bool) -> tuple[list[Any], list[int | None]]:
        where = reader.path
        positions: list[int | None] = [self.position(i, where) for i in indices]
        return reader.get_many([self.pack_index(p) for p in positions], prefetch=prefetch), positions  # type: ignore[arg-type]

    def pack_index(self, position: int) -> int:
        return position if self.indices is None else int(self.indices[position])

    def target(self, label: int, position: int | None) -> Any:
        if self.labels is None or position is None:
            return label
        target = self.labels[position]
        return int(target) if isinstance(target, np.integer) else target

    def stored_labels(self, reader: Any) -> list[Any]:
        if self.labels is not None:
            return self.labels.tolist() if isinstance(self.labels, np.ndarray) else list(self.labels)
        stored = reader.labels
        if self.indices is None:
            return list(stored.tolist())
        return list(np.frombuffer(stored, dtype=np.int32)[self.indices].tolist())


def source_root_of(meta: Manifest | ShardIndex) -> str:
    """The folder the pack was made from, as recorded in its manifest ("" if none is recorded)."""
    record = SourceRecord.of(meta.source)
    return record.root or "" if record is not None else ""


def sample_path(root: str, relpath: str) -> str:
    """A sample's path as ImageFolder's ``samples`` would hold it: under ``root``."""
    return os.path.join(root, relpath) if root else relpath


def relative_to_pack(path: Any, roots: Sequence[str]) -> str:
    """The stored relative path for ``path``: with the first of ``roots`` it starts with
    removed, or unchanged (a relative path, or an absolute one a list file stored as such)."""
    p = os.fspath(path)
    if os.path.isabs(p):
        for root in roots:
            base = root.rstrip(os.sep)
            if base and p.startswith(base + os.sep):
                return p[len(base) + 1 :]
    return p


def normalize_extensions(extensions: str | Sequence[str]) -> tuple[str, ...]:
    """``extensions`` as torchvision's ``has_file_allowed_extension`` takes it: a tuple, lower case."""
    if isinstance(extensions, str):
        return (extensions.lower(),)
    exts = tuple(extensions)
    if not all(isinstance(e, str) for e in exts):
        raise TypeError(f"extensions must be a string or a tuple of strings, got {extensions!r}")
    return tuple(e.lower() for e in exts)


def select(
    reader: Any,
    root: str,
    class_to_idx: Mapping[str, int],
    *,
    extensions: str | Sequence[str] | None = None,
    is_valid_file: Callable[[str], bool] | None = None,
    allow_empty: bool = False,
) -> Selection:
    """Apply ImageFolder's filters to the samples of the pack ``reader`` (see the module docstring).

    ``root`` is the folder that sample paths start with (what ``is_valid_file``
    and ``extensions`` see). Reads only the label table unless a path filter is
    given.
    """
    if extensions is not None and is_valid_file is not None:
        raise ValueError("Both extensions and is_valid_file cannot be not None at the same time")
    if is_valid_file is not None and not callable(is_valid_file):
        raise TypeError(f"is_valid_file must be a callable taking a path, got {type(is_valid_file).__name__}")
    n = len(reader)
    pack_classes: list[str] = list(reader.classes)
    if (
        is_valid_file is None
        and extensions is None
        and (not pack_classes or dict(class_to_idx) == dict(reader.class_to_idx))
    ):
        # Nothing to filter (every dataset opened as ImageFolder would be): the
        # class counts known since open say whether a class is empty; the label
        # table is not read.
        if pack_classes:
            counts = reader.class_counts()
            _check_empty(reader, counts, counts, pack_classes, class_to_idx, extensions, is_valid_file, allow_empty)
        return Selection.of(None, None, n)
    labels = np.frombuffer(reader.labels, dtype=np.int32) if n else np.zeros(0, np.int32)
    keep = np.ones(n, dtype=bool)
    new_labels: np.ndarray | None = None
    if pack_classes and dict(class_to_idx) != dict(reader.class_to_idx):
        # Another class list (a find_classes override): keep the classes it names,
        # labelled with its indices.
        known = np.zeros(len(pack_classes) + 1, dtype=bool)
        lut = np.zeros(len(pack_classes) + 1, dtype=np.int64)
        for k, name in enumerate(pack_classes):
            if name in class_to_idx:
                known[k] = True
                lut[k] = _class_index(class_to_idx, name)
        slot = np.where((labels >= 0) & (labels < len(pack_classes)), labels, len(pack_classes))
        keep &= known[slot]
        new_labels = lut[slot]
    if extensions is not None or is_valid_file is not None:
        exts = None if extensions is None else normalize_extensions(extensions)
        paths = reader.paths()
        for i in np.flatnonzero(keep):
            full = sample_path(root, paths[i])
            ok = full.lower().endswith(exts) if exts is not None else bool(is_valid_file(full))  # type: ignore[misc]
            if not ok:
                keep[i] = False
    if pack_classes:
        after = class_counts(labels[keep], len(pack_classes))
        _check_empty(
            reader, reader.class_counts(), after, pack_classes, class_to_idx, extensions, is_valid_file, allow_empty
        )
    indices = None if keep.all() else np.flatnonzero(keep).astype(np.int64)
    if new_labels is not None:
        new_labels = new_labels[keep]
    return Selection.of(indices, new_labels, n)


def _class_index(class_to_idx: Mapping[str, int], name: str) -> int:
    value = class_to_idx[name]
    try:
        return int(value.__index__())
    except AttributeError:
        raise TypeError(f"class_to_idx[{name!r}] must be an integer, got {value!r}") from None


def _check_empty(
    reader: Any,
    before: np.ndarray,
    after: np.ndarray,
    pack_classes: list[str],
    class_to_idx: Mapping[str, int],
    extensions: Any,
    is_valid_file: Any,
    allow_empty: bool,
) -> None:
    # ImageFolder raises for a class without a file. For a pack of an ImageFolder
    # tree that includes classes packed with --allow-empty; for packs whose class
    # list was made up (list files, imports) only the classes a filter emptied.
    # ``before``/``after``: samples per class index in the pack / after the filters.
    position = {name: k for k, name in enumerate(pack_classes)}
    record = SourceRecord.of(reader.meta.source)
    layout = record.layout if record is not None else None
    empty = []
    for name in class_to_idx:
        k = position.get(name)
        without = k is None or after[k] == 0
        if without and (layout == "imagefolder" or k is None or before[k] > 0):
            empty.append(name)
    if not empty or allow_empty:
        return
    why = f"Found no valid file for the classes {', '.join(sorted(empty))}"
    if extensions is not None:
        exts = normalize_extensions(extensions)
        why += f". Supported extensions are: {', '.join(exts)}"
    hint = None
    if extensions is None and is_valid_file is None and all(position.get(name) is not None for name in empty):
        hint = (
            "the pack keeps classes without images (packed with --allow-empty, or every file of the class was "
            "skipped); pass allow_empty=True, as ImageFolder needs for such a folder"
        )
    raise NoSamplesError(reader.path, empty, why, hint)


class PathIndex:
    """Stored relative path -> pack index (the first sample, if one is listed twice), built once."""

    def __init__(self, reader: Any, roots: Sequence[str]) -> None:
        self._reader = reader
        self._roots = [r for r in roots if r]
        self._table: dict[str, int] | None = None

    def __call__(self, path: Any) -> int:
        """The pack index of the sample at ``path`` (under a root, or as stored); ValueError if none."""
        if self._table is None:
            table: dict[str, int] = {}
            for i, p in enumerate(self._reader.paths()):
                table.setdefault(p, i)
            self._table = table
        rel = relative_to_pack(path, self._roots)
        try:
            return self._table[rel]
        except KeyError:
            where = f" (paths start with {self._roots[0]})" if self._roots else ""
            raise ValueError(f"{os.fspath(path)!r} is not a sample of the pack {self._reader.path}{where}") from None

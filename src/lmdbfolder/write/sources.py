"""Build the complete, ordered sample list of a source before anything is written.

Three layouts are supported:

* ``imagefolder``: ``root/<class>/**/<image>``, with exactly the rules of
  ``torchvision.datasets.ImageFolder`` (sorted class folders, a recursive walk
  that follows symlinks, the same case-insensitive extension list, labels
  0..C-1 in class order, an error for classes without images);
* ``flat``: every image under ``root`` (recursively), no labels, ordered by
  relative path;
* ``list``: a text file of ``relative/path label`` lines (the Caffe
  ``convert_imageset`` / "FileListDataset" input); labels are class indices
  or class names (``path cat``).

The folder layouts take ImageFolder's filters: ``extensions`` (matched
case-insensitively at the end of the name) or ``is_valid_file`` (called with
the file's full path, as torchvision does; the two exclude each other), and
``match``, a regular expression the path relative to the root must contain
(``re.search``; the CLI's ``--match``), on top of either.

Only the standard library is used; no file is opened except the list file
(only a regular one, ``pagefile.open_regular``: a FIFO or a device is refused).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from lmdbfolder.errors import ListFileError, OptionError, PackError, SourceError, SourceNotFoundError, os_hint
from lmdbfolder.format import IMPORTED_LAYOUT_PREFIX, MAX_MANIFEST_BYTES, NO_LABEL, SOURCE_LAYOUTS, SourceRecord
from lmdbfolder.pagefile import open_regular
from lmdbfolder.text import printable
from lmdbfolder.write.compact import LabelList, PathList

__all__ = [
    "IMG_EXTENSIONS",
    "LAYOUTS",
    "SourceList",
    "SourceSpec",
    "check_update_filters",
    "scan",
    "scan_imagefolder",
    "scan_flat",
    "read_list_file",
]

#: torchvision.datasets.folder.IMG_EXTENSIONS, matched case-insensitively.
IMG_EXTENSIONS: tuple[str, ...] = (
    ".jpg",
    ".jpeg",
    ".png",
    ".ppm",
    ".bmp",
    ".pgm",
    ".tif",
    ".tiff",
    ".webp",
)
#: The layouts a source may have: what a manifest's ``source`` records (``format.SOURCE_LAYOUTS``).
LAYOUTS = SOURCE_LAYOUTS
#: The longest line a list file may have (a path and a label: paths are at most a few KB).
MAX_LIST_LINE = 1 << 16


@dataclass
class SourceList:
    """The ordered samples of a source: sample ``i`` is ``relpaths[i]`` with ``labels[i]``.

    ``relpaths`` are relative to ``root`` (or absolute, when a list file says so).
    Whatever sequences are passed in, they are kept compact: ``relpaths`` as a
    ``PathList`` (one buffer of bytes) and ``labels`` as a ``LabelList`` (an
    int32 array), which index, slice, iterate and compare like lists
    (``write.compact``). A million Python strings would cost ~100 MB, and
    every forked reader process would end with its own copy of them.
    """

    root: str
    layout: str
    relpaths: Sequence[str]
    labels: Sequence[int]
    classes: list[str]
    class_to_idx: dict[str, int]
    list_file: str | None = None
    extensions: tuple[str, ...] = field(default=IMG_EXTENSIONS)
    #: the ``match`` regular expression, and the name of the ``is_valid_file`` callable, if any.
    match: str | None = None
    is_valid_file: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.relpaths, PathList):
            self.relpaths = PathList(self.relpaths)
        if not isinstance(self.labels, LabelList):
            self.labels = LabelList(self.labels)
        if len(self.relpaths) != len(self.labels):
            raise ValueError(f"{len(self.relpaths)} paths but {len(self.labels)} labels")

    def __len__(self) -> int:
        return len(self.relpaths)

    def abspath(self, index: int) -> str:
        """The file to read for sample ``index``."""
        return os.path.join(self.root, self.relpaths[index])

    def mean_file_size(self, max_stat: int = 5000) -> float:
        """Mean size of the files, from up to ``max_stat`` evenly spaced ``stat`` calls.

        Enough to plan a pack (map size, free space, shard count) without
        stat-ing a million files. Files that cannot be stat-ed are left out.
        """
        sizes = [size for _, size in self.sample_file_sizes(max_stat)]
        return sum(sizes) / len(sizes) if sizes else 0.0

    def sample_file_sizes(self, max_stat: int = 5000) -> list[tuple[int, int]]:
        """``(index, size)`` of up to ``max_stat`` evenly spaced samples (every one when
        there are fewer than ``2 * max_stat``). Files that cannot be stat-ed are left out.

        The distribution, not only the mean, sizes a pack: LMDB stores each
        record in whole pages (``write.sizing``).
        """
        n = len(self)
        out = []
        for i in range(0, n, max(1, n // max_stat)):
            try:
                out.append((i, os.stat(self.abspath(i)).st_size))
            except OSError:
                continue
        return out

    def hash_samples(self, h: Any) -> Any:
        """Feed every path and label, in order, to the hash object ``h``; returns ``h``."""
        paths = self.relpaths
        raw = paths.iter_raw() if isinstance(paths, PathList) else (os.fsencode(p) for p in paths)
        for path, label in zip(raw, self.labels):
            h.update(path)
            h.update(b"\0%d\n" % label)
        return h

    def describe(self) -> dict[str, object]:
        """JSON-ready description stored in the pack's manifest."""
        out: dict[str, object] = {
            "layout": self.layout,
            "root": self.root,
            "list_file": self.list_file,
            "extensions": list(self.extensions),
        }
        if self.match is not None:
            out["match"] = self.match
        if self.is_valid_file is not None:
            out["is_valid_file"] = self.is_valid_file
        return out

    def filter_fingerprint(self) -> dict[str, object]:
        """The file filters, for the resume fingerprint: only those that differ from
        ImageFolder's defaults, so packs started before filters existed still resume.
        (What an ``is_valid_file`` callable kept is in the list of files itself.)"""
        out: dict[str, object] = {}
        if self.extensions != IMG_EXTENSIONS:
            out["extensions"] = sorted(self.extensions)  # the order does not change what is packed
        if self.match is not None:
            out["match"] = self.match
        return out


def _check_root(root: str) -> str:
    root = os.path.abspath(os.path.expanduser(os.fspath(root)))
    if not os.path.exists(root):
        raise SourceNotFoundError(root, "does not exist", "check the source path")
    if not os.path.isdir(root):
        raise SourceError(root, "is not a directory", "pass the folder that holds the images")
    return root


def _unlisted(exc: OSError) -> None:
    """``os.walk``'s ``onerror``: a folder of the source that cannot be listed (mode 000,
    vanished) is an error, never a class or a folder of images silently left out."""
    where = exc.filename if exc.filename is not None else "a folder of the source"
    raise SourceError(
        where, f"cannot list this folder ({exc.strerror or exc}): its images would be left out", os_hint(exc)
    )


def _walk(top: str) -> Any:
    """``os.walk(top, followlinks=True)`` (torchvision's walk), failing on a folder it cannot list."""
    return os.walk(top, onerror=_unlisted, followlinks=True)


#: Decides whether a file (full path; root-relative path) is packed.
_Keep = Callable[[str, str], bool]


def _file_filter(
    extensions: Sequence[str] | str | None, is_valid_file: Callable[[str], bool] | None, match: str | None
) -> tuple[_Keep, tuple[str, ...], dict[str, str | None]]:
    """(keep(full path, relative path), extensions recorded, SourceList fields) for the filters,
    with ImageFolder's rule: ``extensions`` (default: IMG_EXTENSIONS) or ``is_valid_file``, not both."""
    if extensions is not None and is_valid_file is not None:
        raise OptionError(
            "pass extensions or is_valid_file, not both (as for torchvision's DatasetFolder)",
            "is_valid_file decides alone; to combine it with extensions, check the extension inside it",
        )
    if is_valid_file is not None and not callable(is_valid_file):
        raise OptionError(f"is_valid_file must be a callable taking a path, got {type(is_valid_file).__name__}")
    if isinstance(extensions, str):
        extensions = (extensions,)
    exts = IMG_EXTENSIONS if extensions is None else tuple(e.lower() for e in extensions)
    if extensions is not None and (not exts or not all(isinstance(e, str) and e for e in exts)):
        raise OptionError(f"extensions must be non-empty strings such as '.jpg', got {extensions!r}")
    pattern = None
    if match is not None:
        try:
            pattern = re.compile(match)
        except re.error as exc:
            raise OptionError(f"match is not a valid regular expression ({exc}): {match!r}") from None
    valid = is_valid_file

    def keep(full: str, rel: str) -> bool:
        ok = bool(valid(full)) if valid is not None else full.lower().endswith(exts)
        if ok and pattern is not None:
            ok = pattern.search(rel.replace(os.sep, "/")) is not None
        return ok

    name = None if is_valid_file is None else _callable_name(is_valid_file)
    return keep, (() if is_valid_file is not None else exts), {"match": match, "is_valid_file": name}


def _callable_name(fn: Callable[[str], bool]) -> str:
    """The name recorded for an ``is_valid_file`` callable: ``module.qualname``."""
    module = getattr(fn, "__module__", None) or ""
    return f"{module}.{getattr(fn, '__qualname__', type(fn).__qualname__)}".lstrip(".")


def _what_counts(exts: tuple[str, ...], fields: dict[str, str | None]) -> str:
    # For "no images found" messages: what the filters let through.
    what = f"is_valid_file ({fields['is_valid_file']})" if fields["is_valid_file"] else "supported extensions are "
    if not fields["is_valid_file"]:
        what += ", ".join(exts)
    if fields["match"] is not None:
        what += f"; paths must match {fields['match']!r}"
    return what


def _no_valid_file(empty: list[str], exts: tuple[str, ...], fields: dict[str, str | None]) -> str:
    # ImageFolder's own words (torchvision.datasets.folder.make_dataset), then our filters.
    why = f"Found no valid file for the classes {', '.join(sorted(empty))}. "
    if fields["is_valid_file"]:
        why += f"(is_valid_file {fields['is_valid_file']} kept none of their files)"
    else:
        why += f"Supported extensions are: {', '.join(exts)}"
    if fields["match"] is not None:
        why += f"; paths must match {fields['match']!r}"
    return why


def _is_class_folder(entry: os.DirEntry[str]) -> bool:
    """``entry.is_dir()`` (links followed, as torchvision does); SourceError naming the entry
    when it cannot be told (a symbolic link that leads back to itself, as torchvision
    raises it too), never the source folder around it."""
    try:
        return entry.is_dir()
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SourceError(
                entry.path,
                "is a symbolic link that loops (it leads back to itself), so it is neither a class folder nor a file",
                "remove the link, or point it at the folder it stands for",
            ) from None
        raise SourceError(
            entry.path, f"cannot tell whether it is a class folder ({exc.strerror or exc})", os_hint(exc)
        ) from None


def scan_imagefolder(
    root: str,
    *,
    extensions: Sequence[str] | str | None = None,
    allow_empty: bool = False,
    is_valid_file: Callable[[str], bool] | None = None,
    match: str | None = None,
) -> SourceList:
    """List an ImageFolder tree exactly as ``torchvision.datasets.ImageFolder`` does
    (``extensions`` defaults to ImageFolder's ``IMG_EXTENSIONS``; see the module docstring
    for ``is_valid_file`` and ``match``)."""
    root = _check_root(root)
    keep, exts, fields = _file_filter(extensions, is_valid_file, match)
    try:
        with os.scandir(root) as entries:
            classes = sorted(e.name for e in entries if _is_class_folder(e))
    except OSError as exc:
        raise SourceError(root, f"cannot list this folder ({exc.strerror or exc})", os_hint(exc)) from None
    if not classes:
        raise SourceNotFoundError(
            root,
            "Couldn't find any class folder (an ImageFolder tree is root/<class>/<image>)",
            "for a folder of images without classes use --flat; for a `path label` file use --list",
        )
    class_to_idx = {c: i for i, c in enumerate(classes)}
    relpaths: list[str] = []
    labels: list[int] = []
    empty = []
    for cls in classes:
        before = len(relpaths)
        target = os.path.join(root, cls)
        # sorted(os.walk(...)) and sorted(fnames): the order torchvision uses.
        for dirpath, _, fnames in sorted(_walk(target)):
            rel_dir = os.path.relpath(dirpath, root)
            for fname in sorted(fnames):
                rel = os.path.join(rel_dir, fname)
                if keep(os.path.join(dirpath, fname), rel):
                    relpaths.append(rel)
        labels.extend([class_to_idx[cls]] * (len(relpaths) - before))
        if len(relpaths) == before:
            empty.append(cls)
    if empty and not allow_empty:
        raise SourceNotFoundError(
            root,
            _no_valid_file(empty, exts, fields),
            "remove the empty class folders, or pass --allow-empty to keep them as classes",
        )
    return SourceList(root, "imagefolder", relpaths, labels, classes, class_to_idx, extensions=exts, **fields)


def scan_flat(
    root: str,
    *,
    extensions: Sequence[str] | str | None = None,
    is_valid_file: Callable[[str], bool] | None = None,
    match: str | None = None,
) -> SourceList:
    """List every image under ``root`` (recursively), sorted by relative path, unlabelled
    (filters as for ``scan_imagefolder``)."""
    root = _check_root(root)
    keep, exts, fields = _file_filter(extensions, is_valid_file, match)
    relpaths = []
    for dirpath, _, fnames in _walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        for fname in fnames:
            rel = fname if rel_dir == "." else os.path.join(rel_dir, fname)
            if keep(os.path.join(dirpath, fname), rel):
                relpaths.append(rel)
    if not relpaths:
        raise SourceNotFoundError(root, f"no images found; {_what_counts(exts, fields)}")
    relpaths.sort()
    return SourceList(root, "flat", relpaths, [NO_LABEL] * len(relpaths), [], {}, extensions=exts, **fields)


def _numbered_classes_bytes(n: int) -> int:
    """Bytes that the class names ``"0".."n-1"`` take in a manifest at least
    (``"i",`` in ``classes`` and ``"i":i,`` in ``class_to_idx``: 3 x digits + 7)."""
    total, digits, low = 0, 1, 0
    while low < n:
        high = min(n, 10**digits)
        total += (high - low) * (3 * digits + 7)
        low, digits = high, digits + 1
    return total


def read_list_file(list_file: str, root: str, *, classes: Sequence[str] | None = None) -> SourceList:
    """Read ``relative/path label`` lines; paths are relative to ``root``.

    The label is the last whitespace-separated token, so paths may contain
    spaces. Blank lines and lines starting with ``#`` are ignored.

    Labels are either all integers (class indices; class names default to
    ``"0" .. str(max_label)``, pass ``classes`` to name them) or, as soon as
    one label is not an integer, class names (``path cat``): the classes are
    then the distinct names sorted as ImageFolder sorts its class folders
    (Python's string order, so ``"10"`` before ``"9"``), and each label is the
    name's index. A path listed twice (the same file after normalising the
    path, with the same or another label) is refused, naming both lines.
    """
    root = _check_root(root)
    list_file = os.path.abspath(os.path.expanduser(os.fspath(list_file)))
    relpaths, tokens, lines = _list_lines(list_file)
    if not relpaths:
        raise SourceError(list_file, "the list file holds no `path label` lines")
    numbers = [_as_int(t) for t in tokens]
    if all(n is not None for n in numbers):
        labels = [int(n) for n in numbers if n is not None]
        names = _numbered_classes(list_file, labels, lines, classes)
    else:
        names = sorted(set(tokens))
        if classes is not None and list(classes) != names:
            raise SourceError(
                list_file,
                "the labels are class names, and they are not the class names given",
                "pass classes only with integer labels",
            )
        index = {name: i for i, name in enumerate(names)}
        labels = [index[t] for t in tokens]
    return SourceList(root, "list", relpaths, labels, names, {c: i for i, c in enumerate(names)}, list_file=list_file)


def _list_lines(list_file: str) -> tuple[list[str], list[str], list[tuple[int, str]]]:
    """The ``path label`` lines of ``list_file``: (paths, label texts, (line number, line) of
    each); ListFileError for a line too long, without a label, or a path listed twice."""
    relpaths: list[str] = []
    tokens: list[str] = []
    lines: list[tuple[int, str]] = []
    seen: dict[str, int] = {}
    try:
        # utf-8-sig drops a BOM; surrogateescape keeps undecodable bytes as in file names.
        # Only a regular file (a FIFO would block, /dev/zero never end), lines of bounded length.
        fd = open_regular(list_file)
        with open(fd, encoding="utf-8-sig", errors="surrogateescape") as f:
            for lineno, line in enumerate(iter(lambda: f.readline(MAX_LIST_LINE + 1), ""), start=1):
                if len(line) > MAX_LIST_LINE:
                    raise ListFileError(
                        list_file, lineno, line[:80] + "...", f"a line of more than {MAX_LIST_LINE:,} characters"
                    )
                text = line.strip()
                if not text or text.startswith("#"):
                    continue
                parts = text.rsplit(None, 1)
                if len(parts) != 2:
                    raise ListFileError(list_file, lineno, text, "expected `path label`")
                path, label_text = parts
                key = os.path.normpath(path)
                if key in seen:
                    first = seen[key]
                    raise ListFileError(
                        list_file,
                        lineno,
                        text,
                        f"{path!r} is listed twice, on lines {first} and {lineno} (a sample must appear once)",
                    )
                seen[key] = lineno
                relpaths.append(path)
                tokens.append(label_text)
                lines.append((lineno, text))
    except OSError as exc:
        raise SourceError(list_file, f"cannot read the list file ({exc.strerror})", os_hint(exc)) from None
    return relpaths, tokens, lines


def _numbered_classes(
    list_file: str, labels: list[int], lines: list[tuple[int, str]], classes: Sequence[str] | None
) -> list[str]:
    """The class names of integer ``labels``: ``classes``, or ``"0" .. str(max label)``;
    ListFileError for a label out of range, or one that would name too many classes."""
    for (lineno, text), label in zip(lines, labels):
        if label < 0 or label >= 1 << 31:
            raise ListFileError(list_file, lineno, text, f"label {label} is outside 0..2**31-1")
    n_classes = max(labels) + 1
    if classes is None and _numbered_classes_bytes(n_classes) > MAX_MANIFEST_BYTES:
        # Checked before the names are made: a stray label of 2**31-1
        # would otherwise build two billion strings (and exhaust memory).
        top = labels.index(n_classes - 1)
        raise ListFileError(
            list_file,
            lines[top][0],
            lines[top][1],
            f"label {n_classes - 1:,} means {n_classes:,} classes (0..{n_classes - 1:,}), more than "
            f"a manifest of {MAX_MANIFEST_BYTES:,} bytes can name; labels are class indices from 0",
        )
    if classes is None:
        return [str(i) for i in range(n_classes)]
    names = list(classes)
    if len(names) < n_classes:
        raise SourceError(list_file, f"labels go up to {n_classes - 1} but only {len(names)} class names were given")
    return names


def _as_int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


@dataclass(frozen=True)
class SourceSpec:
    """Which files of a source folder to pack: the scan keywords of ``pack``, as one value.

    ``pack``, ``pack_sharded`` and ``pack_ray`` take these as keywords (``layout``,
    ``list_file``, ``allow_empty``, ``extensions``, ``is_valid_file``, ``match``;
    see ``lmdbfolder.pack``), build one ``SourceSpec`` at their entry and turn
    it into the sample list with ``scan``, the one place that scans. Values are
    checked by the scan, as they always were, so that a pack into its own source
    is refused before a bad filter is (``check_outside_source`` runs first).
    ``layout=None`` (the default) is ``"imagefolder"``, or for an update the
    pack's own (``for_update``).

    Example:
        >>> spec = SourceSpec(extensions=(".jpg",), match="^train/")
        >>> sources = spec.scan("dataset")  # doctest: +SKIP
    """

    layout: str | None = None
    list_file: str | os.PathLike[str] | None = None
    allow_empty: bool = False
    extensions: Sequence[str] | str | None = None
    is_valid_file: Callable[[str], bool] | None = None
    match: str | None = None

    def scan(self, root: str | os.PathLike[str]) -> SourceList:
        """The complete, ordered sample list of ``root`` (see the module docstring)."""
        return scan(
            root,
            layout=self.layout or "imagefolder",
            list_file=self.list_file,
            allow_empty=self.allow_empty,
            extensions=self.extensions,
            is_valid_file=self.is_valid_file,
            match=self.match,
        )

    def for_update(self, recorded: Any, where: str) -> SourceSpec:
        """The spec of an update of the pack at ``where`` whose manifest records the
        source ``recorded`` (its ``source``, ``SourceList.describe``).

        The layout and extensions not given are the pack's, so that the update
        holds the samples a fresh pack with the pack's filters would; those given
        must be the pack's (OptionError naming both otherwise: other filters make
        another dataset, which is a fresh pack). A ``match`` the pack records must
        be given again (OptionError naming it otherwise: a pattern read from a pack
        is never run). A list file is always given (the manifest's path is not
        opened). A pack that records no layout (``source`` missing): the spec as
        given. ``allow_empty`` is not recorded: as given.
        """
        found = _Filters.recorded(recorded, where)
        if found is None:
            return self
        if found.layout == "list" and self.list_file is None and self.layout in (None, "list"):
            raise OptionError(
                f"{where} was packed from a list file (--list); this update gives none",
                "pass the list file with --list FILE (the pack records its path, and never opens it)",
            )
        layout = "list" if self.list_file is not None else (self.layout or found.layout)
        spec = dataclasses.replace(self, layout=layout)
        if layout == found.layout != "list":
            if self.extensions is None and self.is_valid_file is None:
                if found.is_valid_file is not None:
                    raise OptionError(
                        f"{where} was packed with the is_valid_file callable {printable(found.is_valid_file, 200)}, "
                        "which a pack records only by name",
                        "update it from Python with the same is_valid_file, or pack afresh with --overwrite",
                    )
                if found.extensions is not None:
                    spec = dataclasses.replace(spec, extensions=found.extensions)
            if self.match is None and found.match is not None:
                # A pattern read from a pack is never run: Python's re has no time limit,
                # and a pack is a claim. The user gives it again (compared as text).
                raise OptionError(
                    f"{where} was packed with --match {printable(repr(found.match), 300)}; this update gives "
                    "none, and an update never runs a pattern read from a pack",
                    "pass the same --match again, or pack afresh with --overwrite",
                )
        _refuse_other(found, _Filters.of_spec(spec), where)
        return spec


_LAYOUT_WORDS = {
    "imagefolder": "the ImageFolder layout (neither --flat nor --list)",
    "flat": "--flat",
    "list": "--list",
}


@dataclass(frozen=True)
class _Filters:
    """Which files of a source a pack holds, as an update compares them: the layout,
    and for the folder layouts the extensions (None: not recorded), the ``match``
    and the name of the ``is_valid_file`` callable."""

    layout: str
    extensions: tuple[str, ...] | None
    match: str | None
    is_valid_file: str | None

    @classmethod
    def recorded(cls, source: Any, where: str) -> _Filters | None:
        """The filters a manifest's ``source`` records (None: it records no layout);
        PackError when they are not what a pack records (a forged or damaged manifest:
        ``format.SourceRecord``'s rules)."""
        record = SourceRecord.of(source)
        if record is None or not record.recorded:
            return None
        if record.layout is not None and record.layout.startswith(IMPORTED_LAYOUT_PREFIX):
            # A valid pack (``verify`` says so) whose samples came from another LMDB, not a folder.
            raise OptionError(
                f"{where} was imported from another LMDB (`lmdbfolder import`; its source is "
                f"{printable(record.layout, 60)} {printable(record.root or '?', 200)}), not packed from a source "
                "folder, so an update cannot bring it up to date with one",
                "pack the folder afresh with --overwrite, or import the LMDB again",
            )
        if record.problem is not None or record.layout is None:
            raise PackError(
                f"{where}: its manifest records a source layout or file filters that are not valid "
                "(the pack is damaged, or was not written by lmdbfolder)",
                "run `lmdbfolder verify` on it; pack afresh with --overwrite",
            )
        extensions = None if record.extensions is None else tuple(e.lower() for e in record.extensions)
        return cls(record.layout, extensions, record.match, record.is_valid_file)

    @classmethod
    def of_spec(cls, spec: SourceSpec) -> _Filters:
        """The filters ``spec`` asks for (values the scan will check: any type compares unequal)."""
        exts: Any = spec.extensions
        if spec.is_valid_file is not None:
            exts = ()
        elif exts is None:
            exts = IMG_EXTENSIONS
        elif isinstance(exts, str):
            exts = (exts.lower(),)
        else:
            exts = tuple(e.lower() if isinstance(e, str) else e for e in exts)
        valid = None if spec.is_valid_file is None else _callable_name(spec.is_valid_file)
        layout = "list" if spec.list_file is not None else (spec.layout or "imagefolder")
        return cls(layout, exts, spec.match, valid)

    @classmethod
    def of_sources(cls, sources: SourceList) -> _Filters:
        return cls(sources.layout, tuple(sources.extensions), sources.match, sources.is_valid_file)


def _filter_words(flag: str, value: str | None) -> str:
    return f"no {flag}" if value is None else f"{flag} {printable(value, 200)}"


def _refuse_other(recorded: _Filters, given: _Filters, where: str) -> None:
    """OptionError when ``given`` (an update's filters) are not the pack's ``recorded`` ones."""
    pair: tuple[str, ...]
    if recorded.layout != given.layout:
        pair = (_LAYOUT_WORDS[recorded.layout], _LAYOUT_WORDS.get(given.layout, repr(given.layout)))
        flag = "--list" if "list" in (recorded.layout, given.layout) else "--flat"
        if recorded.layout == "list":
            hint = "pass the list file with --list FILE (the pack records its path, and never opens it)"
        else:
            hint = f"leave out {flag} (an update uses the pack's layout), or pack afresh with --overwrite"
    elif recorded.layout == "list":
        return  # the list file names the samples: no filter applies
    elif recorded.is_valid_file != given.is_valid_file:
        pair = tuple(
            "is_valid_file " + printable(f.is_valid_file, 200) if f.is_valid_file else "no is_valid_file"
            for f in (recorded, given)
        )
        hint = "pass the same is_valid_file, or pack afresh with --overwrite"
    elif (
        recorded.is_valid_file is None
        and recorded.extensions is not None
        and frozenset(recorded.extensions) != frozenset(given.extensions or ())
    ):
        pair = tuple(_filter_words("--extensions", ",".join(map(str, f.extensions or ()))) for f in (recorded, given))
        hint = "leave out --extensions (an update uses the pack's), or pack afresh with --overwrite"
    elif recorded.match != given.match:
        pair = tuple(_filter_words("--match", None if f.match is None else repr(f.match)) for f in (recorded, given))
        # A recorded pattern is never run from the pack: the user gives it again.
        hint = (
            "leave out --match (the pack has none)"
            if recorded.match is None
            else f"give the pack's own {pair[0]} again"
        ) + ", or pack afresh with --overwrite"
    else:
        return
    raise OptionError(
        f"{where} was packed with {pair[0]}; this update asks for {pair[1]}. An update keeps the pack's source "
        "layout and file filters: other ones select other files, which is another dataset",
        hint,
    )


def check_update_filters(recorded: Any, sources: SourceList, where: str) -> None:
    """OptionError unless ``sources`` were scanned with the layout and file filters that a
    pack's manifest records as its ``source`` (``recorded``; nothing recorded: no check)."""
    found = _Filters.recorded(recorded, where)
    if found is not None:
        _refuse_other(found, _Filters.of_sources(sources), where)


def scan(
    root: str | os.PathLike[str],
    *,
    layout: str | None = "imagefolder",
    list_file: str | os.PathLike[str] | None = None,
    allow_empty: bool = False,
    extensions: Sequence[str] | str | None = None,
    is_valid_file: Callable[[str], bool] | None = None,
    match: str | None = None,
) -> SourceList:
    """Build the sample list of ``root`` for the given ``layout``
    (``list_file`` implies ``layout="list"``; None: ``"imagefolder"``).

    ``extensions``, ``is_valid_file`` and ``match`` filter the files of the
    folder layouts (see the module docstring); a list file names its files,
    so they are refused with ``layout="list"``.
    """
    root = os.fspath(root)
    list_file = None if list_file is None else os.fspath(list_file)
    if list_file is not None:
        layout = "list"
    layout = layout or "imagefolder"
    filters: dict[str, Any] = dict(extensions=extensions, is_valid_file=is_valid_file, match=match)
    if layout == "imagefolder":
        return scan_imagefolder(root, allow_empty=allow_empty, **filters)
    if layout == "flat":
        return scan_flat(root, **filters)
    if layout == "list":
        if list_file is None:
            raise ValueError("layout='list' needs list_file")
        given = sorted(k for k, v in filters.items() if v is not None)
        if given:
            raise OptionError(
                f"{', '.join(given)} filter the files of a folder; a list file names its files itself",
                "remove the unwanted lines from the list file instead",
            )
        return read_list_file(list_file, root)
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")

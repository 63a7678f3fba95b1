"""Check a pack: manifest, key set, every record's header and checksum, labels,
and optionally that every image decodes.

``verify`` never stops at the first problem: it reports each bad record by
index and original path, so the user knows exactly what to repack.
"""

from __future__ import annotations

import io
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from PIL import Image

from lmdbfolder import packdir
from lmdbfolder.codecs import decode_rgb, raw_rgb, truncation
from lmdbfolder.errors import CorruptRecordError, NotAPackError
from lmdbfolder.format import (
    LABELS_KEY,
    META_KEY,
    NO_LABEL,
    PATHS_KEY,
    RESERVED_PREFIX,
    RecordHeader,
    decode_key,
    decode_record,
    shard_matches,
    tables_digest,
)
from lmdbfolder.progress import Progress
from lmdbfolder.read.reader import Reader
from lmdbfolder.read.sharded import ShardedReader
from lmdbfolder.tools.info import pack_info
from lmdbfolder.write.options import Resize
from lmdbfolder.write.sources import scan

__all__ = ["Problem", "VerifyReport", "verify", "verify_sharded", "KNOWN_RESERVED_KEYS"]

KNOWN_RESERVED_KEYS = frozenset({META_KEY, LABELS_KEY, PATHS_KEY})


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a pack. ``index``/``path`` are None for pack-level problems."""

    kind: str
    message: str
    index: int | None = None
    path: str | None = None

    def __str__(self) -> str:
        where = "" if self.index is None else f"record {self.index}" + (f" ({self.path})" if self.path else "") + ": "
        return f"{self.kind}: {where}{self.message}"


@dataclass
class VerifyReport:
    """What ``verify`` checked and what it found."""

    path: str
    count: int
    checked: int = 0
    payload_bytes: int = 0
    decoded: bool = False
    seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems

    @property
    def bad_indices(self) -> list[int]:
        """Sorted indices of records with at least one problem."""
        return sorted({p.index for p in self.problems if p.index is not None})

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready report (``lmdbfolder verify --json``)."""
        out = asdict(self)
        out["ok"] = self.ok
        out["bad_indices"] = self.bad_indices
        return out


def verify(
    path: str | os.PathLike[str],
    *,
    decode: bool = False,
    against: str | os.PathLike[str] | None = None,
    list_file: str | os.PathLike[str] | None = None,
    progress: bool | None = None,
) -> VerifyReport:
    """Check every record of the pack at ``path``.

    Checks: the manifest parses and its version is supported; the keys are
    exactly ``0..count-1`` plus the known reserved keys; every record header
    is well formed, its payload length and CRC-32 match, its label agrees
    with the label table and the class list, and every encoded JPEG and PNG
    ends with its end marker (a pack made before that check existed may hold
    files cut short). With ``decode=True`` every image
    is also decoded (as ImageFolder would load it). With ``against=SRC`` the
    source folder is scanned again (same layout; ``list_file`` overrides the
    recorded list file) and the pack must hold the same files (minus those
    the pack skipped), with the same labels and the same bytes (for raw
    packs: the same decoded pixels).

    Returns:
        A VerifyReport; ``report.ok`` is False if anything is wrong.

    Example:
        >>> report = verify("train.lmdb")  # doctest: +SKIP
        >>> report.ok, report.checked  # doctest: +SKIP
        (True, 1281167)

    A sharded pack is checked shard by shard and against its index
    (``verify_sharded``).
    """
    found = packdir.require_pack(path)
    if found.kind is packdir.Kind.SHARDED:
        report = verify_sharded(found.path, decode=decode, progress=progress)
        if against is not None:
            start = time.perf_counter()
            skipped = pack_info(found.path)["skipped"]
            with ShardedReader(found.path) as sharded:
                _against_by_index(sharded, report, os.fspath(against), list_file, skipped)
            report.seconds += time.perf_counter() - start
        return report
    start = time.perf_counter()
    reader = Reader(found.path, readahead=True)
    report = VerifyReport(reader.path, len(reader), decoded=decode)
    try:
        sources = None
        if against is not None:
            sources = _source_files(reader, report, os.fspath(against), list_file, reader.meta.get("skipped", []))
        _check_records(reader, report, decode, progress, sources)
    finally:
        reader.close()
    report.seconds = time.perf_counter() - start
    return report


def _against_by_index(
    reader: Any, report: VerifyReport, src: str, list_file: str | os.PathLike[str] | None, skipped: list[Any]
) -> None:
    """The source comparison for readers without one database to scan (sharded packs)."""
    sources = _source_files(reader, report, src, list_file, skipped)
    if sources is None:
        return
    resize = _pack_resize(reader.meta)
    for index, path in enumerate(reader.paths()):
        if path in sources:
            record = reader.get(index)
            value = bytes(record.payload)
            header = RecordHeader(
                record.encoding, record.channels, record.width, record.height, record.label, 0, len(value)
            )
            _compare_with_source(report, index, header, value, path, *sources[path], reader.store, resize)


def _source_files(
    reader: Any, report: VerifyReport, src: str, list_file: str | os.PathLike[str] | None, skipped_items: list[Any]
) -> dict[str, tuple[str, int]] | None:
    """Relative path -> (file, label) of the source, compared as a list with the pack's paths."""
    recorded = reader.meta.get("source") or {}
    layout = recorded.get("layout")
    if layout not in ("imagefolder", "flat", "list"):
        report.problems.append(
            Problem("source", f"cannot compare with a source folder: the pack's layout is {layout!r}")
        )
        return None
    listing = os.fspath(list_file) if list_file is not None else recorded.get("list_file")
    # The same file filters as the pack. An is_valid_file callable cannot be run again:
    # then every file is listed, and only the pack's own files are compared.
    filters: dict[str, Any] = {}
    chosen_by_callable = layout != "list" and bool(recorded.get("is_valid_file"))
    if chosen_by_callable:
        filters["is_valid_file"] = lambda _path: True
    elif layout != "list" and recorded.get("extensions"):
        filters["extensions"] = tuple(recorded["extensions"])
    if layout != "list" and recorded.get("match") is not None:
        filters["match"] = recorded["match"]
    sources = scan(src, layout=layout, list_file=listing if layout == "list" else None, allow_empty=True, **filters)
    skipped = {item.get("path") for item in skipped_items if isinstance(item, dict)}
    packed = reader.paths()
    expected = [p for p in sources.relpaths if p not in skipped]
    if chosen_by_callable:
        in_pack_only = set(packed)
        expected = [p for p in expected if p in in_pack_only]
    if expected != packed:
        in_pack = set(packed)
        in_source = set(expected)
        for p in expected:
            if p not in in_pack:
                report.problems.append(Problem("source", f"{p} is in the source but not in the pack"))
        for i, p in enumerate(packed):
            if p not in in_source:
                report.problems.append(Problem("source", "is in the pack but not in the source", i, p))
        if in_pack == in_source:
            report.problems.append(Problem("source", "the pack holds the source's files in a different order"))
    return {p: (sources.abspath(i), sources.labels[i]) for i, p in enumerate(sources.relpaths)}


def _pack_resize(meta: dict[str, Any]) -> Resize | None:
    return Resize.from_params(meta.get("params") or {})


def _check_records(
    reader: Reader,
    report: VerifyReport,
    decode: bool,
    progress: bool | None,
    sources: dict[str, tuple[str, int]] | None = None,
) -> None:
    count = len(reader)
    labels = reader.labels
    n_classes = len(reader.classes)
    paths = reader.paths()
    resize = _pack_resize(reader.meta)
    if len(paths) != count:
        report.problems.append(Problem("manifest", f"path table holds {len(paths)} paths, expected {count}"))
    expected = 0
    with Progress(count, "verify", enabled=progress) as bar:
        for key, value in reader.raw_items():
            if key.startswith(RESERVED_PREFIX):
                if key not in KNOWN_RESERVED_KEYS:
                    report.problems.append(Problem("extra", f"unexpected reserved key {key!r}"))
                continue
            try:
                index = decode_key(key)
            except ValueError:
                report.problems.append(Problem("extra", f"unexpected key {key!r}"))
                continue
            if index >= count:
                report.problems.append(Problem("extra", f"record key {index} is beyond the count {count}", index))
                continue
            for missing in range(expected, index):
                report.problems.append(Problem("missing", "record is missing", missing, paths[missing]))
            expected = index + 1
            report.checked += 1
            report.payload_bytes += len(value)
            bar.update(1, len(value))
            record = _check_one(report, index, value, paths[index], labels[index], n_classes, decode)
            if record is not None and sources is not None and paths[index] in sources:
                _compare_with_source(report, index, *record, paths[index], *sources[paths[index]], reader.store, resize)
        for missing in range(expected, count):
            report.problems.append(Problem("missing", "record is missing", missing, paths[missing]))


def _check_one(
    report: VerifyReport, index: int, value: memoryview, path: str, label: int, n_classes: int, decode: bool
) -> tuple[RecordHeader, memoryview] | None:
    """Check one record; returns its header and payload, or None if it cannot be parsed."""
    try:
        header, payload = decode_record(value, index=index, verify=True)
    except CorruptRecordError as exc:
        report.problems.append(Problem(exc.kind, exc.why, index, path))
        return None
    if header.label != label:
        report.problems.append(
            Problem("label", f"header label {header.label} differs from the label table's {label}", index, path)
        )
    if not (header.label == NO_LABEL or 0 <= header.label < n_classes):
        report.problems.append(
            Problem("label", f"label {header.label} is not a class index (0..{n_classes - 1})", index, path)
        )
    cut = truncation(payload, header.encoding)
    if cut is not None:
        report.problems.append(Problem("truncated", f"{cut}: the file was cut short before it was packed", index, path))
    if decode:
        try:
            decode_rgb(payload, header.encoding, header.width, header.height).load()
        except Exception as exc:  # Pillow raises many exception types for bad data
            report.problems.append(Problem("decode", f"{type(exc).__name__}: {exc}", index, path))
    return header, payload


def _compare_with_source(
    report: VerifyReport,
    index: int,
    header: RecordHeader,
    payload: bytes | memoryview,
    path: str,
    source: str,
    label: int,
    store: str,
    resize: Resize | None = None,
) -> None:
    if header.label != label:
        report.problems.append(
            Problem("source", f"label {header.label} differs from the source's {label}", index, path)
        )
    try:
        with open(source, "rb") as f:
            data = f.read()
    except OSError as exc:
        report.problems.append(Problem("source", f"cannot read the source file {source}: {exc.strerror}", index, path))
        return
    if resize is not None:
        # A pack resized at pack time holds new bytes for the images it shrank:
        # for those, the stored size must be the one the resize gives.
        try:
            with Image.open(io.BytesIO(data)) as img:
                target = resize.target(*img.size)
        except Exception as exc:  # Pillow raises many exception types for bad data
            report.problems.append(Problem("source", f"the source file no longer opens: {exc}", index, path))
            return
        if target is not None:
            if (header.width, header.height) != target:
                report.problems.append(
                    Problem(
                        "source",
                        f"stored {header.width}x{header.height}, the resize gives {target[0]}x{target[1]}",
                        index,
                        path,
                    )
                )
            return
    if store == "raw":
        try:
            pixels, width, height = raw_rgb(data)
        except Exception as exc:  # Pillow raises many exception types for bad data
            report.problems.append(Problem("source", f"the source file no longer decodes: {exc}", index, path))
            return
        same = (width, height) == (header.width, header.height) and pixels == payload
    else:
        same = data == payload
    if not same:
        report.problems.append(Problem("source", f"differs from the source file {source}", index, path))


def verify_sharded(path: str | os.PathLike[str], *, decode: bool = False, progress: bool | None = None) -> VerifyReport:
    """``verify`` for a sharded pack: every shard in full, and each against the index.

    A missing or unreadable shard, a count, class list or store that differs
    from the index, and tables that do not match the index's checksum are
    reported as problems naming the shard; record problems carry the global
    index and the shard's name.
    """
    start = time.perf_counter()
    root, index = packdir.load_index(path)
    report = VerifyReport(root, index["count"], decoded=decode)
    offset = 0
    for entry in index["shards"]:
        name = entry["name"]
        shard_path = os.path.join(root, name)
        first = offset
        offset += entry["count"]
        if not os.path.isdir(shard_path):
            report.problems.append(Problem("shard", f"shard {name} is missing"))
            continue
        try:
            sub = verify(shard_path, decode=decode, progress=progress)
            with Reader(shard_path) as reader:
                digest = tables_digest(*reader.tables())
                same_manifest = "manifest_sha256" not in entry or shard_matches(entry, *reader.tables())
                meta = reader.meta
        except NotAPackError as exc:
            report.problems.append(Problem("shard", f"shard {name} cannot be read: {exc.message}"))
            continue
        if sub.count != entry["count"]:
            report.problems.append(
                Problem("shard", f"shard {name} holds {sub.count} samples, the index says {entry['count']}")
            )
        if digest != entry["tables_sha256"]:
            report.problems.append(
                Problem("checksum", f"shard {name}: its tables do not match the index's tables_sha256")
            )
        if not same_manifest:
            report.problems.append(
                Problem("checksum", f"shard {name}: its manifest does not match the index's manifest_sha256")
            )
        for key in ("classes", "class_to_idx", "store"):
            if meta[key] != index[key]:
                report.problems.append(Problem("shard", f"shard {name}: its {key} differ from the index's"))
        for p in sub.problems:
            report.problems.append(
                Problem(p.kind, f"{name}: {p.message}", None if p.index is None else first + p.index, p.path)
            )
        report.checked += sub.checked
        report.payload_bytes += sub.payload_bytes
    report.seconds = time.perf_counter() - start
    return report

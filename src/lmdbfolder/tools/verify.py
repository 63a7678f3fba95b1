"""Check a pack: everything a reader relies on, looked up exactly as readers do it.

``verify`` never stops at the first problem: it reports each bad record by
index and original path, so the user knows exactly what to repack. It reads
the pack only through ``PageFile`` (the readers' own lookups: no LMDB code
runs on the file, so no damage can take the command down), and it checks:

* the file itself (``PageFile.audit``): both B-trees page by page, overflow
  extents, separator keys, the free list, every page in use or free exactly
  once, and the meta page's counters;
* the tables by the format's own rules, the ones a reader applies and the
  exhaustive ones an open skips (``format.PackTables.audit``: one copy of
  the rules, each broken one a problem): the manifest, the format-2 table
  checksums (``__check__``), the label and path tables, labels that are
  class indices, the record order (no key twice, every key below
  ``next_record``), ``record_classes``, informational fields of the
  documented types;
* every record ``0..count-1`` looked up through the tree as ``Reader.get``
  does (format 3: under its ``__order__`` key), with the CRC (bound to the
  key and the pack in formats 2 and 3), the header label against the label
  table (format 3: through ``record_classes``) and, in a pack of the files'
  bytes as they are, the payload's length against ``__stats__``
  (``format.SAMPLE_RECORDS``, the rules ``pack --update`` checks of every
  record it keeps: two swapped ``__order__`` entries), raw sizes against the
  payload, the encoding against the pack's store, the header's size and
  components against the payload's own header and Pillow's
  decompression-bomb limit (``Encoding.check``, what every decode path checks
  first: a valid CRC proves nothing about who wrote a pack); and that no
  other key is stored (format 3: none that ``__order__`` does not name).

So it cannot say OK for a pack on which some ``Reader.get(i)`` fails.
"""

from __future__ import annotations

import array
import dataclasses
import io
import os
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from lmdbfolder import packdir, packfile
from lmdbfolder.encodings import PayloadMismatch, encoding_of, raw_rgb, truncation
from lmdbfolder.errors import CorruptRecordError, FormatVersionError, LmdbFolderError, NotAPackError, PackChangedError
from lmdbfolder.format import (
    CHECK_KEY,
    DAMAGED_HINT,
    HISTORY_KEY,
    INVALID,
    KEY,
    LABELS_KEY,
    META_KEY,
    NO_LABEL,
    ORDER_KEY,
    PATHS_KEY,
    RECORD_CLASSES,
    RESERVED_PREFIX,
    SAMPLE_RECORDS,
    SKIPPED_KEY,
    SOURCE_LAYOUTS,
    STATS_KEY,
    Manifest,
    PackTables,
    RecordHeader,
    ShardEntry,
    ShardIndex,
    check_table,
    decode_check,
    decode_key,
    decode_meta,
    decode_record,
    shard_matches,
    tables_digest,
)
from lmdbfolder.pagefile import P_LEAF, PageDamage, PageFile, read_regular
from lmdbfolder.progress import Progress
from lmdbfolder.read.sharded import ShardedReader, out_of_place
from lmdbfolder.text import plural, printable
from lmdbfolder.tools.fields import FieldChecks, check_fields
from lmdbfolder.tools.info import pack_info
from lmdbfolder.write.options import Resize
from lmdbfolder.write.sources import scan

__all__ = [
    "Problem",
    "VerifyReport",
    "verify",
    "verify_sharded",
    "against_index",
    "KNOWN_RESERVED_KEYS",
    "NO_BINDING_NOTE",
]

#: The reserved keys of a format-1 pack; format 2 adds ``__check__`` and ``__skipped__``.
KNOWN_RESERVED_KEYS = frozenset({META_KEY, LABELS_KEY, PATHS_KEY})
_RESERVED_V2 = KNOWN_RESERVED_KEYS | {CHECK_KEY, SKIPPED_KEY, STATS_KEY, HISTORY_KEY}
_RESERVED_V3 = _RESERVED_V2 | {ORDER_KEY}
#: Said of every format-1 pack (a note, not a problem).
NO_BINDING_NOTE = (
    "format version 1: records are not bound to their index and pack, so a record stored under another "
    "index with a valid checksum cannot be detected, and the tables carry no checksums; "
    "repack it (lmdbfolder pack) to get format 2"
)


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
    """What ``verify`` checked and what it found. ``notes`` are not problems
    (for example that a format-1 pack lacks the record binding)."""

    path: str
    count: int
    checked: int = 0
    payload_bytes: int = 0
    decoded: bool = False
    seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

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
    annotations: str | os.PathLike[str] | None = None,
) -> VerifyReport:
    """Check every record and table of the pack at ``path`` (see the module docstring).

    Also: every encoded JPEG and PNG ends with its end marker (a pack made
    before that check existed may hold files cut short). With
    ``decode=True`` every image is also decoded (as ImageFolder would load
    it). With ``against=SRC`` the source folder is scanned again (same
    layout; ``list_file`` overrides the recorded list file) and the pack must
    hold the same files (minus those the pack skipped), with the same labels
    and the same bytes (for raw packs: the same decoded pixels). A pack of several
    fields is compared with ``SRC`` listed again as its layout (its split, scale,
    folders from the manifest; COCO's and a table's file: ``annotations``, else the
    file of the recorded name in ``SRC`` or beside it): the same samples, in the same
    order, and every field the same bytes as its file (or value).

    Raises NotAPackError only when there is nothing to check against: no
    LMDB file, a truncated one, or no readable manifest.

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
    if against is not None and _holds_fields(found.path):
        report = verify(found.path, decode=decode, progress=progress)
        start = time.perf_counter()
        _against_fields(found.path, report, os.fspath(against), annotations)
        report.seconds += time.perf_counter() - start
        return report
    if found.kind is packdir.Kind.SHARDED:
        report = verify_sharded(found.path, decode=decode, progress=progress)
        if against is not None:
            start = time.perf_counter()
            try:
                skipped = pack_info(found.path)["skipped"]
                with ShardedReader(found.path) as sharded:
                    _against_by_index(sharded, report, os.fspath(against), list_file, _dicts(skipped))
            except NotAPackError as exc:  # a missing or unreadable shard: reported above, by shard
                report.problems.append(Problem("source", f"cannot compare with the source: {exc.message}"))
            report.seconds += time.perf_counter() - start
        return report
    return _verify_single(found.path, decode, against, list_file, progress)


def _holds_fields(path: str) -> bool:
    """Whether the pack at ``path`` holds samples of several fields (False when it cannot be
    opened: the checks say why)."""
    from lmdbfolder.read.fields import samples_manifest
    from lmdbfolder.read.opening import open_pack

    try:
        with open_pack(path) as reader:
            return samples_manifest(reader) is not None
    except (LmdbFolderError, OSError):
        return False


def _layout_file(src: str, name: Any, given: str | os.PathLike[str] | None) -> str | None:
    """COCO's annotation file or a table: ``given``, else the file of the recorded ``name`` in
    ``src``, beside it, or in an ``annotations`` folder beside it (COCO's own tree)."""
    if given is not None:
        return os.fspath(given)
    if not isinstance(name, str) or not name or os.path.basename(name) != name:
        return None
    up = os.path.dirname(os.path.abspath(src))
    for folder in (src, up, os.path.join(up, "annotations")):
        if os.path.isfile(os.path.join(folder, name)):
            return os.path.join(folder, name)
    return None


def _against_fields(path: str, report: VerifyReport, src: str, annotations: str | os.PathLike[str] | None) -> None:
    """``verify --against SRC`` of a pack of several fields: ``SRC`` listed as the pack's
    layout; the samples the pack holds (those it skipped left out), in its order, and each
    field's bytes against its file (or the value the layout reads from its annotation file)."""
    from lmdbfolder.format.fields import split_field_payloads
    from lmdbfolder.read.fields import samples_manifest
    from lmdbfolder.read.opening import open_pack
    from lmdbfolder.write.fields import SampleError
    from lmdbfolder.write.layouts import LAYOUTS, scan_layout

    def cannot(why: str) -> None:
        report.problems.append(Problem("source", f"cannot compare with {printable(src, 300)}: {why}"))

    with open_pack(path) as reader:
        meta = samples_manifest(reader)
        if meta is None or meta.field_specs is None:
            return
        layout, info = meta.layout_name, meta.layout_info
        if layout not in LAYOUTS or info.get("source") == "basicsr-lmdb":
            what = "two BasicSR LMDBs" if info.get("source") == "basicsr-lmdb" else f"the layout {layout!r}"
            return cannot(f"the pack's samples came from {printable(str(what), 60)}, not from a folder")
        options: dict[str, Any] = {}
        if layout in ("voc", "ade20k", "cityscapes") and isinstance(info.get("split"), str):
            options["split"] = info["split"]
        elif layout == "pairs":
            options = {k: info.get(k) for k in ("scale", "gt_dir", "lq_dir", "filename_tmpl")}
        elif layout in ("coco", "table"):
            name = info.get("annotations" if layout == "coco" else "table")
            options["annotations"] = _layout_file(src, name, annotations)
            if options["annotations"] is None and name is None:
                # a pack of a CocoDetection object: the dataset did not know its file's name
                return cannot("the pack names no annotation file (packed from a dataset): pass it (--annotations FILE)")
            if options["annotations"] is None:
                return cannot(
                    f"its {printable(str(name), 200)} is not in it nor beside it: pass it (--annotations FILE)"
                )
            if layout == "table" and isinstance(info.get("image_column"), str):
                options["image_column"] = info["image_column"]
        try:
            samples = scan_layout(src, layout, **options)
        except (LmdbFolderError, OSError, ValueError) as exc:
            return cannot(f"it does not list as the {layout} layout ({printable(str(exc), 300)})")
        skipped = {item.get("path") for item in _dicts(pack_info(path).get("skipped")) if isinstance(item, dict)}
        expected = [s for s, p in enumerate(samples.relpaths) if p not in skipped]
        packed = reader.paths()
        if [samples.relpaths[s] for s in expected] != list(packed):
            in_pack, in_source = set(packed), {samples.relpaths[s] for s in expected}
            for p in sorted(in_source - in_pack)[:100]:
                report.problems.append(Problem("source", f"{printable(p, 300)} is in the source but not in the pack"))
            for i, p in enumerate(packed):
                if p not in in_source and len(report.problems) < 1000:
                    report.problems.append(Problem("source", "is in the pack but not in the source", i, p))
            if in_pack == in_source:
                report.problems.append(Problem("source", "the pack holds the source's samples in another order"))
            return
        names = [f.name for f in meta.field_specs]
        for i, s in enumerate(expected):
            files = samples.field_paths[s]
            try:
                theirs = samples.read(s)
                ours = split_field_payloads(reader.get(i).payload, len(names))
            except SampleError as exc:
                report.problems.append(Problem("source", f"the source sample cannot be read: {exc.why}", i, packed[i]))
                continue
            except (LmdbFolderError, OSError):
                continue  # a damaged record: the checks above reported it
            if isinstance(ours, str):
                continue  # reported by the checks above
            for k, name in enumerate(names):
                if bytes(ours[k]) != theirs[k]:
                    where = f"its file {files[k]}" if k < len(files) and files[k] else "the source's value"
                    report.problems.append(Problem("source", f"field {name} differs from {where}", i, packed[i]))


def _verify_single(
    path: str,
    decode: bool,
    against: str | os.PathLike[str] | None,
    list_file: str | os.PathLike[str] | None,
    progress: bool | None,
    entry: ShardEntry | None = None,
) -> VerifyReport:
    """``verify`` of a single pack; with ``entry`` (a sharded pack's index entry), of the
    version of it the index names (see ``packfile.open_version``)."""
    start = time.perf_counter()
    pf = packfile.open_data(path, True) if entry is None else _open_entry(path, entry)
    found = packdir.Found(path, packdir.Kind.PACK)
    try:
        pack = _Checked(pf, found.path)
        report = VerifyReport(found.path, pack.count, decoded=decode)
        pack.check_tables(report)
        sources = None
        if against is not None:
            if pack.path_list is None:
                report.problems.append(Problem("source", "cannot compare with the source: the path table is damaged"))
            else:
                sources = _source_files(pack, report, os.fspath(against), list_file, _dicts(pack.skipped), pack.labels)
        pack.check_records(report, decode, progress, sources)
    finally:
        pf.close()
    report.seconds = time.perf_counter() - start
    return report


def _open_entry(path: str, entry: ShardEntry) -> PageFile:
    """The version of the shard at ``path`` that its index ``entry`` names (formats 2 and 3:
    by pack id and manifest), else the current one (format 1; or a shard replaced since the
    index was written: the checks against the index then say what differs)."""
    if entry.pack_id is not None:
        try:
            return packfile.open_version(path, entry.pack_id, True, manifest_sha256=entry.manifest_sha256)
        except PackChangedError:
            pass
    return packfile.open_data(path, True)


def _dicts(items: Any) -> list[Any]:
    return items if isinstance(items, list) else []


class _Checked:
    """One pack as ``verify`` sees it: each table read and checked on its own, so
    that a damaged one is a problem to report and the rest is still checked."""

    def __init__(self, pf: PageFile, path: str) -> None:
        self.pf = pf
        self.path = path
        try:
            blob = pf.get(META_KEY)
            check_blob = pf.get(CHECK_KEY)
        except PageDamage as exc:
            raise NotAPackError(path, f"its manifest cannot be read: {exc.why}", DAMAGED_HINT) from None
        if blob is None:
            packfile.refuse_foreign(path, pf)  # a recipe's LMDB: say how to convert it
        self.damaged_meta: NotAPackError | None = None
        if blob is not None and check_blob is not None:
            try:
                check_table(decode_check(check_blob, where=path), META_KEY, blob, where=path)
            except NotAPackError as exc:
                self.damaged_meta = exc  # reported with the tables, if the manifest still parses
        try:
            self.meta = decode_meta(blob, where=path)  # nothing to check against without it
        except FormatVersionError:
            raise  # a newer format: "upgrade" says more than "damaged"
        except NotAPackError:
            if self.damaged_meta is not None:
                raise self.damaged_meta from None
            raise
        if blob is None:  # decode_meta refuses a missing manifest; this tells the type checker
            raise NotAPackError(path, "it has no manifest")
        self.meta_blob = blob
        self.count: int = self.meta.count
        self.version: int = self.meta.format_version
        self.tables = PackTables.of(self.meta, blob)
        self.binding = self.tables.binding
        self.label_map = self.meta.label_map
        #: Format 3: the record key of every sample (None: key = index, or the table is unreadable).
        self.order: Any = None
        self.labels: Any = None
        #: Per sample, the payload length its record must have (``SAMPLE_RECORDS.exact_sizes``; None: unknown).
        self.sizes: Any = None
        self.path_list: list[str] | None = None
        self.skipped: Any = []

    def paths(self) -> list[str]:
        """The paths, for the source comparison (``_source_files`` calls it)."""
        return self.path_list or []

    def check_tables(self, report: VerifyReport) -> None:
        """The file's structure, then every table by the format's own rules (``PackTables.audit``)."""
        for text in self.pf.audit():
            report.problems.append(Problem("structure", text))
        if self.version < 2:
            report.notes.append(NO_BINDING_NOTE)
        audit = self.tables.audit(packfile.PackSource(self.pf, self.path), self.meta_blob)
        report.problems += [Problem(exc.kind, exc.why) for exc in audit.problems]
        self.labels, self.path_list, self.order, self.skipped = audit.labels, audit.paths, audit.order, audit.skipped
        self.sizes = SAMPLE_RECORDS.exact_sizes(self.meta, audit.stats)
        for name in self.meta.invalid_fields:
            report.problems.append(Problem("manifest", f"the informational field {name!r} has the wrong type"))
        if _pack_resize(self.meta) == INVALID:
            report.problems.append(Problem("manifest", "the resize parameters (params) are invalid"))

    def check_records(
        self,
        report: VerifyReport,
        decode: bool,
        progress: bool | None,
        sources: dict[str, tuple[str, int | None]] | None,
    ) -> None:
        count, paths, labels = self.count, self.path_list, self.labels
        rules = _RecordRules(
            len(self.meta.classes),
            decode,
            self.binding,
            self.meta.store,
            self.label_map,
            _field_checks(self.meta, decode),
        )
        resize = _pack_resize(self.meta)
        if self.version >= 3 and self.order is None:
            return  # no record can be found without its key: the table problem is reported
        order = self.order
        headers = _Headers()
        with Progress(count, "verify", enabled=progress) as bar, warnings.catch_warnings():
            # Images between Pillow's limit and twice it are readable (ImageFolder warns): not a problem.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            for index in range(count):
                path = paths[index] if paths is not None else None
                key = index if order is None else int(order[index])
                try:
                    value = self.pf.get(KEY.pack(key))
                except PageDamage as exc:
                    report.problems.append(
                        Problem("page", f"the database is damaged where it is stored: {exc.why}", index, path)
                    )
                    continue
                if value is None:
                    report.problems.append(Problem("missing", "record is missing", index, path))
                    continue
                report.checked += 1
                report.payload_bytes += len(value)
                bar.update(1, len(value))
                label = labels[index] if labels is not None else None
                record = _check_one(report, rules, index, key, value, path, label, headers)
                if record is not None and sources is not None and path is not None and path in sources:
                    _compare_with_source(
                        report,
                        index,
                        *record,
                        path,
                        *sources[path],
                        rules.store,
                        resize if isinstance(resize, Resize) else None,
                    )
        self._check_samples(report, headers)
        self._check_keys(report)

    def _check_samples(self, report: VerifyReport, headers: _Headers) -> None:
        """Every record parsed against what binds it to its sample (``SAMPLE_RECORDS``, the
        rules ``pack --update`` checks before it keeps a record): its header label against
        the label table, its payload's length against ``__stats__``."""
        at = np.frombuffer(headers.at, dtype=np.int64)
        labels = None if self.labels is None else np.asarray(self.labels, dtype=np.int64)[at]
        sizes = None if self.sizes is None else self.sizes[at]
        lens = np.frombuffer(headers.lengths, dtype=np.int64)
        for k, kind, why in SAMPLE_RECORDS.mismatches(headers.labels, lens, labels, sizes, self.label_map):
            index = int(at[k])
            path = self.path_list[index] if self.path_list is not None else None
            report.problems.append(Problem(kind, f"the record {why}", index, path))

    def _check_keys(self, report: VerifyReport) -> None:
        """Every key in the tree is a record ``0..count-1`` (format 3: a key of
        ``__order__``, none listed twice) or a known reserved key."""
        known = _RESERVED_V3 if self.version >= 3 else _RESERVED_V2 if self.version >= 2 else KNOWN_RESERVED_KEYS
        # Distinct keys, to look each stored one up (a key named twice is the audit's problem).
        expected: Any = None if self.order is None else np.unique(self.order)
        try:
            for _pgno, _depth, kind, nodes in self.pf.pages():
                if kind != P_LEAF:
                    continue
                for _off, key, _lohi, _flags in nodes:
                    if key.startswith(RESERVED_PREFIX):
                        if key not in known:
                            report.problems.append(Problem("extra", f"unexpected reserved key {key[:64]!r}"))
                        continue
                    try:
                        index = decode_key(key)
                    except ValueError:
                        report.problems.append(Problem("extra", f"unexpected key {key[:64]!r}"))
                        continue
                    if expected is not None:
                        at = int(expected.searchsorted(index))
                        if at == len(expected) or int(expected[at]) != index:
                            report.problems.append(
                                Problem("extra", f"record key {index} is not one of {ORDER_KEY.decode()}")
                            )
                    elif self.version >= 3:
                        continue  # the order table is unreadable: reported above
                    elif index >= self.count:
                        report.problems.append(
                            Problem("extra", f"record key {index} is beyond the count {self.count}", index)
                        )
        except PageDamage:
            pass  # the audit has reported the page; the lookups have reported its records


def _why(exc: LmdbFolderError) -> str:
    return exc.why if isinstance(exc, NotAPackError) else str(getattr(exc, "why", exc))


def _against_by_index(
    reader: Any, report: VerifyReport, src: str, list_file: str | os.PathLike[str] | None, skipped: list[Any]
) -> None:
    """The source comparison for readers without one database to scan (sharded packs)."""
    sources = _source_files(reader, report, src, list_file, skipped, reader.labels)
    if sources is None:
        return
    resize = _pack_resize(reader.meta)
    if not isinstance(resize, Resize):
        resize = None
    for index, path in enumerate(reader.paths()):
        if path in sources:
            try:
                record = reader.get(index)
            except (LmdbFolderError, OSError):
                continue  # a damaged record: the checks of its shard have reported it
            value = bytes(record.payload)
            header = RecordHeader(
                record.encoding, record.channels, record.width, record.height, record.label, 0, len(value)
            )
            _compare_with_source(report, index, header, value, path, *sources[path], reader.store, resize)


def _source_files(
    reader: Any,
    report: VerifyReport,
    src: str,
    list_file: str | os.PathLike[str] | None,
    skipped_items: list[Any],
    labels: Any,
) -> dict[str, tuple[str, int | None]] | None:
    """Relative path -> (file, label) of the source, compared as a list with the pack's paths
    (``labels``: the pack's, None if its table is unreadable).

    The label is the pack's index of the source's class: classes are matched by name
    (a class folder added to the source renumbers the classes after it, and that is
    not a change of every sample's class), except for a list file of numbered labels.
    A source class the pack does not have is reported once, its files' label None."""
    scanned = _scan_source(reader.meta, report, src, list_file)
    if scanned is None:
        return None
    sources, pack_files_only = scanned
    skipped = {item.get("path") for item in skipped_items if isinstance(item, dict)}
    packed = reader.paths()
    expected = [p for p in sources.relpaths if p not in skipped]
    if pack_files_only:
        in_pack_only = set(packed)
        expected = [p for p in expected if p in in_pack_only]
    pack_classes = list(reader.meta.classes)
    numbered = sources.layout == "list" and sources.classes == [str(i) for i in range(len(sources.classes))]
    if expected != packed:
        _compare_lists(report, sources, expected, packed, pack_classes, labels, numbered)
    return _source_labels(report, sources, set(packed), pack_classes, numbered)


def _scan_source(
    meta: Manifest, report: VerifyReport, src: str, list_file: str | os.PathLike[str] | None
) -> tuple[Any, bool] | None:
    """The source scanned as the pack recorded it (layout, list file, filters), and whether
    only the pack's own files can be compared (files chosen by a callable or a regular
    expression, which are not run again); None (a problem said why) if the record is unusable."""
    recorded = meta.source_record  # the rules of a valid record: format.SourceRecord
    layout = recorded.layout if recorded is not None else None
    if layout not in SOURCE_LAYOUTS:
        report.problems.append(
            Problem("source", f"cannot compare with a source folder: the pack's layout is {str(layout)[:40]!r}")
        )
        return None
    if recorded is None or recorded.problem is not None:
        report.problems.append(Problem("source", "cannot compare with a source folder: the pack's source is invalid"))
        return None
    match, recorded_list = recorded.match, recorded.list_file
    listing = os.fspath(list_file) if list_file is not None else recorded_list
    # The same file filters as the pack. An is_valid_file callable cannot be run again,
    # and a regular expression read from a pack is never run (anyone may have written
    # it: "(a+)+$" backtracks for ever): then every file is listed, and only the pack's
    # own files are compared.
    filters: dict[str, Any] = {}
    chosen_by_callable = layout != "list" and bool(recorded.is_valid_file)
    chosen_by_match = layout != "list" and match is not None
    if chosen_by_callable:
        filters["is_valid_file"] = lambda _path: True
    elif layout != "list" and recorded.extensions:
        filters["extensions"] = recorded.extensions
    if chosen_by_match:
        report.notes.append(
            f"the pack was made with --match {printable(match, 80)!s}: a regular expression read from a pack is "
            "not run, so only the pack's own files were compared with the source (files it left out are not listed)"
        )
    sources = scan(src, layout=layout, list_file=listing if layout == "list" else None, allow_empty=True, **filters)
    return sources, chosen_by_callable or chosen_by_match


def _compare_lists(
    report: VerifyReport,
    sources: Any,
    expected: list[str],
    packed: list[str],
    pack_classes: list[str],
    labels: Any,
    numbered: bool,
) -> None:
    """Report the files only one side has (a whole class that only one side has: one
    problem, not one per file), or that the order differs."""
    new_classes = set() if numbered else set(sources.classes) - set(pack_classes)
    gone_classes = set() if numbered or labels is None else set(pack_classes) - set(sources.classes)
    in_pack = set(packed)
    in_source = set(expected)
    source_class = dict(zip(sources.relpaths, sources.labels))
    new_files: dict[str, list[str]] = {}
    for p in expected:
        if p not in in_pack:
            name = sources.classes[source_class[p]] if source_class[p] != NO_LABEL else None
            if name is not None and name in new_classes:
                new_files.setdefault(name, []).append(p)
            else:
                report.problems.append(Problem("source", f"{p} is in the source but not in the pack"))
    gone_records: dict[str, list[int]] = {}
    for i, p in enumerate(packed):
        if p not in in_source:
            label = labels[i] if labels is not None else NO_LABEL
            name = pack_classes[label] if 0 <= label < len(pack_classes) else None
            if name is not None and name in gone_classes:
                gone_records.setdefault(name, []).append(i)
            else:
                report.problems.append(Problem("source", "is in the pack but not in the source", i, p))
    for name, files in sorted(new_files.items()):
        report.problems.append(
            Problem(
                "source",
                f"class {printable(name, 200)} is in the source but not in the pack "
                f"({plural(len(files), 'file')}, first {printable(files[0], 200)})",
            )
        )
    for name, indices in sorted(gone_records.items()):
        report.problems.append(
            Problem(
                "source",
                f"class {printable(name, 200)} is in the pack but not in the source "
                f"({plural(len(indices), 'record')}, first {indices[0]}: {printable(packed[indices[0]], 200)})",
            )
        )
    if in_pack == in_source:
        report.problems.append(Problem("source", "the pack holds the source's files in a different order"))


def _source_labels(
    report: VerifyReport, sources: Any, packed: set[str], pack_classes: list[str], numbered: bool
) -> dict[str, tuple[str, int | None]]:
    """Relative path -> (file, the pack's index of its class; None: a class the pack lacks,
    reported once)."""
    pack_index = {name: i for i, name in enumerate(pack_classes)}
    out: dict[str, tuple[str, int | None]] = {}
    relabelled: dict[str, list[str]] = {}
    for i, p in enumerate(sources.relpaths):
        wanted: int | None = sources.labels[i]
        if not numbered and wanted != NO_LABEL:
            name = sources.classes[sources.labels[i]]
            wanted = pack_index.get(name)
            if wanted is None and p in packed:  # a list file that names a new class
                relabelled.setdefault(name, []).append(p)
        out[p] = (sources.abspath(i), wanted)
    for name, files in sorted(relabelled.items()):
        report.problems.append(
            Problem(
                "source",
                f"class {printable(name, 200)} of the source is not a class of the pack: "
                f"{plural(len(files), 'file')} of the pack {'is' if len(files) == 1 else 'are'} listed with it "
                f"(first {printable(files[0], 200)})",
            )
        )
    return out


def _pack_resize(meta: Manifest) -> Resize | str | None:
    """The pack-time resize recorded in the manifest, None, or ``INVALID`` for parameters that make no sense."""
    params = meta.shown.params
    if params is INVALID:
        return INVALID
    try:
        return Resize.from_params(params or {})
    except (TypeError, ValueError, KeyError, LmdbFolderError):
        return INVALID


@dataclass
class _Headers:
    """Per record parsed: its sample index, header label and payload length (compact arrays)."""

    at: array.array = field(default_factory=lambda: array.array("q"))
    labels: array.array = field(default_factory=lambda: array.array("i"))
    lengths: array.array = field(default_factory=lambda: array.array("q"))

    def add(self, index: int, label: int, length: int) -> None:
        """Record ``index``'s header label and payload length."""
        self.at.append(index)
        self.labels.append(label)
        self.lengths.append(length)


@dataclass(frozen=True)
class _RecordRules:
    """What every record of one pack is checked against (``_check_one``)."""

    #: The number of classes (a label is -1 or below it).
    n_classes: int
    #: Decode every image too (``verify(decode=True)``).
    decode: bool
    #: The pack's record binding (formats 2 and 3; None: format 1).
    binding: bytes | None
    #: The pack's store (``encoded`` or ``raw``).
    store: str
    #: Format 3 with ``record_classes``: header label -> sample label (``format.label_map``).
    mapping: list[int] | None
    #: Format 4: the checks of each record's fields (None: one image per record).
    fields: FieldChecks | None = None


def _field_checks(meta: Manifest, decode: bool) -> FieldChecks | None:
    """The checks of a format-4 pack's fields (None for one image per record)."""
    specs = meta.field_specs
    if specs is None:
        return None
    categories = meta.layout_info.get("categories")
    ids = (
        frozenset(c.get("id") for c in categories if isinstance(c, dict) and isinstance(c.get("id"), (int, str)))
        if isinstance(categories, list)
        else None
    )
    return FieldChecks(specs, meta.layout_name, ids, decode)


def _check_one(
    report: VerifyReport,
    rules: _RecordRules,
    index: int,
    key: int | None,
    value: memoryview,
    path: str | None,
    label: int | None,
    headers: _Headers,
) -> tuple[RecordHeader, memoryview] | None:
    """Check one record (stored under ``key``, default ``index``; format 3's header
    labels go through ``rules.mapping``, ``format.label_map``); its header label and
    length go to ``headers``, checked against its sample's tables once every record is
    (``_Checked._check_samples``). Returns its header (the label a sample's) and payload,
    or None if it cannot be parsed or names no class."""
    n_fields = len(rules.fields.fields) if rules.fields is not None else None
    try:
        header, payload = decode_record(
            value, index=index, verify=True, binding=rules.binding, key=key, fields=n_fields
        )
    except CorruptRecordError as exc:
        report.problems.append(Problem(exc.kind, exc.why, index, path))
        return None
    headers.add(index, header.label, header.payload_len)
    if rules.mapping is not None and header.label != NO_LABEL:
        sample_label = RECORD_CLASSES.sample_label(header.label, rules.mapping)
        if sample_label is None:
            return None  # a record of no class of the pack: ``_check_samples`` reports it
        header = dataclasses.replace(header, label=sample_label)
    n_classes, store, decode = rules.n_classes, rules.store, rules.decode
    if not (header.label == NO_LABEL or 0 <= header.label < n_classes):
        report.problems.append(
            Problem("label", f"label {header.label} is not a class index (0..{n_classes - 1})", index, path)
        )
    if rules.fields is not None:  # format 4: every field on its own (tools.fields)
        problems, notes = check_fields(payload, rules.fields)
        report.problems += [Problem("field", why, index, path) for why in problems]
        for note in notes:
            if len(report.notes) < 100:
                report.notes.append(f"sample {index} ({printable(path or '', 200)}): {note}")
        return None  # not compared with a source file: its bytes are several files'
    if store is not None and encoding_of(header.encoding).stores_pixels != (store == "raw"):
        report.problems.append(
            Problem("header", f"a {header.encoding} record in a pack of {store} images", index, path)
        )
    cut = truncation(payload, header.encoding)
    if cut is not None:
        report.problems.append(Problem("truncated", f"{cut}: the file was cut short before it was packed", index, path))
    # The header is a claim: what every reader checks before it draws a crop box from it.
    enc = encoding_of(header.encoding)
    try:
        enc.check(payload, header.width, header.height, header.channels)
        if header.width <= 0 and header.height <= 0 and not enc.stores_pixels:
            # Nothing claimed, so nothing above looked at the payload: the least every
            # read does is open it, so verify does too (a forged or unchecked record).
            with Image.open(io.BytesIO(payload)):
                pass
    except PayloadMismatch as exc:
        report.problems.append(Problem("header", str(exc), index, path))
        return header, payload
    except Exception as exc:  # Pillow raises many exception types for bad data (a bomb, a bad header)
        report.problems.append(Problem("decode", f"{type(exc).__name__}: {exc}", index, path))
        return header, payload
    if decode:
        try:
            img = enc.decode_rgb(payload, header.width, header.height)
            img.load()
            enc.expect(img, header.width, header.height)
        except PayloadMismatch as exc:
            report.problems.append(Problem("header", str(exc), index, path))
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
    label: int | None,
    store: str,
    resize: Resize | None = None,
) -> None:
    if label is not None and header.label != label:  # None: a class the pack lacks (reported once)
        report.problems.append(
            Problem("source", f"label {header.label} differs from the source's {label}", index, path)
        )
    try:
        data = read_regular(source)  # a FIFO in the source tree must not block verify
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
    report = VerifyReport(root, index.count, decoded=decode)
    offset = 0
    for k, entry in enumerate(index.shards):
        name = entry.name
        shard_path = os.path.join(root, name)
        first = offset
        offset += entry.count
        if not os.path.isdir(shard_path):
            report.problems.append(Problem("shard", f"shard {name} is missing"))
            continue
        try:
            sub = _verify_single(shard_path, decode, None, None, progress, entry)
        except NotAPackError as exc:
            hint = f" ({exc.hint})" if exc.hint and exc.hint != NotAPackError.hint else ""
            report.problems.append(Problem("shard", f"shard {name} cannot be read: {exc.message}{hint}"))
            continue
        for p in sub.problems:
            report.problems.append(
                Problem(p.kind, f"{name}: {p.message}", None if p.index is None else first + p.index, p.path)
            )
        for note in sub.notes:
            if note not in report.notes:
                report.notes.append(note)
        report.problems += against_index(shard_path, k, entry, index)
        report.checked += sub.checked
        report.payload_bytes += sub.payload_bytes
    report.seconds = time.perf_counter() - start
    return report


def against_index(shard_path: str, k: int, entry: ShardEntry, index: ShardIndex) -> list[Problem]:
    """What differs between shard ``k`` at ``shard_path`` and its ``entry`` of ``index``: its
    tables' digests, its pack_id, classes, store and place in the split (the records are
    ``_verify_single``'s). ``copy`` checks a downloaded pack by it before publishing."""
    name = entry.name
    problems: list[Problem] = []
    try:
        pf = _open_entry(shard_path, entry)
        try:
            blobs = [packfile.read_value(pf, key, shard_path) for key in (META_KEY, LABELS_KEY, PATHS_KEY)]
            if any(blob is None for blob in blobs):
                raise NotAPackError(shard_path, "its manifest, label table or path table is missing")
            digest = tables_digest(*blobs)  # type: ignore[arg-type]
            same_manifest = entry.manifest_sha256 is None or shard_matches(entry, *blobs)  # type: ignore[arg-type]
            meta = decode_meta(blobs[0], where=shard_path)
            pack_id = meta.version_pack_id
        finally:
            pf.close()
    except NotAPackError as exc:
        return [Problem("shard", f"shard {name} cannot be opened: {exc.message}")]
    if digest != entry.tables_sha256:
        problems.append(Problem("checksum", f"shard {name}: its tables do not match the index's tables_sha256"))
    if not same_manifest:
        problems.append(Problem("checksum", f"shard {name}: its manifest does not match the index's manifest_sha256"))
    if entry.pack_id is not None and entry.pack_id != pack_id:
        problems.append(Problem("shard", f"shard {name}: its pack_id differs from the index's"))
    if meta.count != entry.count:
        problems.append(Problem("shard", f"shard {name} holds {meta.count} samples, the index says {entry.count}"))
    for key, theirs, ours in (
        ("classes", meta.classes, index.classes),
        ("class_to_idx", meta.class_to_idx, index.class_to_idx),
        ("store", meta.store, index.store),
    ):
        if theirs != ours:
            problems.append(Problem("shard", f"shard {name}: its {key} differ from the index's"))
    misplaced = out_of_place(meta, k, len(index.shards))
    if misplaced:
        problems.append(Problem("shard", f"shard {name}: {misplaced}, the index lists it as shard {k}"))
    return problems

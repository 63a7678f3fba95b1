"""Bring a finished pack up to date with its source, in place: ``pack --update``.

The result is the dataset a fresh pack of the changed source would be, as
ImageFolder sees it (classes, ``class_to_idx``, sample order, targets,
pixels); the cost is a ``stat`` of every source file plus reading and
writing the files that changed (docs/design.md, "Updating a pack"):

1. ``_OldPack.load``: the pack's tables (paths, labels, the size and
   modification time of every sample's file, ``__stats__``), and every
   record's header label and length checked against them as ``verify``
   checks them (``_check_records``), never a record's payload.
2. ``_plan``: every source file is ``stat``-ed and sorted into kept (same
   path, size and time: its record stays where it is), relabelled (the same
   file under another class: its record is rewritten from the pack's bytes),
   skipped again (a file the pack skipped, unchanged) and to read (new, or
   changed; with ``check="content"``, or where the pack recorded no time,
   every file, and those whose record comes out the same are kept).
3. ``_stage``: the files to read go through the writer's reading pipeline
   into ``<dst>.update``, a small LMDB with a checkpoint (``_StageRun``), so
   an interrupted update resumes there. Nothing of ``<dst>`` changes yet.
4. ``_apply``: one LMDB write transaction on ``<dst>/data.mdb`` adds the new
   records under new keys, deletes the records no sample uses any more, and
   replaces the tables (``__order__``: which record each sample is; the
   labels, paths, stats, skipped files, history, manifest and checksums).
   The pack becomes format 3 (FORMAT.md). Datasets opened before keep reading
   the version they opened, in every process (the transaction writes only
   pages that version does not use, and LMDB's other meta page still names
   it: ``packfile.open_version``); a second update ends that, with
   PackChangedError. A dataset opened afterwards reads the new version.
5. ``<dst>.update`` is removed. The file is compacted (LMDB's compacting copy
   and a rename) only when half of it is free pages, and only at the start of
   the next update's step 4: a compacted file holds one version, and the one
   before this update must stay readable to the datasets opened before it
   until an update ends it anyway.

A kill at any point leaves ``<dst>`` as it was (steps 1-3 do not touch it,
step 4 is one transaction) or as it will be; the same command finishes the
update.
"""

from __future__ import annotations

import array
import datetime as _dt
import errno
import hashlib
import os
import shutil
import stat
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import lmdb
import numpy as np

from lmdbfolder import packdir, packfile
from lmdbfolder.errors import NotAPackError, OptionError, OutputExistsError, PackError, SourceError, os_refusal
from lmdbfolder.format import (
    CHECK_KEY,
    COMPACT_DIR,
    DATA_FILE,
    KEY,
    LOCK_FILE,
    META_KEY,
    NO_LABEL,
    PROGRESS_KEY,
    RECORD_HEADER,
    SAMPLE_RECORDS,
    SKIPPED_REPORT,
    UNKNOWN_MTIME,
    UPDATE_SUFFIX,
    Manifest,
    NewTables,
    PackTables,
    bind_record,
    decode_record,
    encode_check,
    encode_key,
    encode_record,
    new_pack_id,
)
from lmdbfolder.pagefile import PageDamage, PageFile
from lmdbfolder.progress import Progress
from lmdbfolder.text import describe_changes, disk_size, escape_field, plural, printable, skipped_line
from lmdbfolder.write import resume
from lmdbfolder.write.compact import LabelList, PathList
from lmdbfolder.write.loop import (
    Job,
    _labels_table,
    _Partial,
    _paths_table,
    _Run,
    _write_error,
    check_manifest_size,
    history_entry,
    nothing_to_pack,
    skipped_entries,
)
from lmdbfolder.write.options import CHECKS, CONTENT_CHECK, PackOptions
from lmdbfolder.write.records import Loaded, Skipped
from lmdbfolder.write.sources import SourceList, SourceSpec, check_update_filters
from lmdbfolder.write.threads import default_workers

__all__ = ["Changes", "Updated", "update", "check_updatable", "staging_path", "recorded_options", "update_spec"]

#: Free pages (a fraction of the file) from which a pack is compacted before an update
#: changes it. LMDB reuses the pages an update frees from the update after next on,
#: so the file stays about two updates' changes above what it holds; this much free
#: space comes only from removing many samples at once. A compacted file holds only
#: its current version, so the compaction waits for the next update, which ends the
#: version before it anyway: compacting right after the update that freed the pages
#: would leave the datasets opened before it nothing to read.
COMPACT_FREE_FRACTION = 0.5

# What ``_plan`` decides for each source file.
_KEEP, _RELABEL, _READ, _SKIP_AGAIN = 0, 1, 2, 3
# What a staged value holds: kind (u8), the file's size (u64) and mtime (i64) when it was
# read, a checksum (``_staged_digest``), then a record (unbound), nothing (the same record
# as the pack's), or a skip reason. A rerun reuses it only while the checksum holds and the
# file's size and mtime are still those (``_StageRun.refresh``).
_STAGED = struct.Struct("<BQq16s")
_RECORD, _SAME, _SKIPPED = 0, 1, 2
#: Bumped when the staged values change: a staging folder of another layout is started again.
_STAGED_LAYOUT = 2


def _staged_digest(j: int, kind: int, size: int, mtime: int, body: bytes | bytearray | memoryview) -> bytes:
    """The checksum of staged value ``j``: its position, kind, stat and body (SHA-256, the
    first 16 bytes; SHA-256 is the faster where the CPU has its instructions). A staged
    value damaged or altered since it was written, or moved under another position, no
    longer matches: it is read again from the source, never published."""
    h = hashlib.sha256(encode_key(j))
    h.update(struct.pack("<BQq", kind, size, mtime))
    h.update(body)
    return h.digest()[:16]


def _staged_value(j: int, kind: int, size: int, mtime: int, body: bytes | bytearray | memoryview = b"") -> bytes:
    """Staged value ``j``: ``_STAGED`` (with its checksum) and ``body``."""
    return b"".join((_STAGED.pack(kind, size, mtime, _staged_digest(j, kind, size, mtime, body)), body))


def _unstage(
    j: int, value: bytes | bytearray | memoryview, *, check_records: bool = True
) -> tuple[int, int, int, memoryview] | None:
    """(kind, size, mtime, body) of staged value ``j``; None when its checksum does not hold.
    ``check_records=False`` leaves a record's checksum to the caller that publishes it."""
    if len(value) < _STAGED.size:
        return None
    kind, size, mtime, digest = _STAGED.unpack_from(value)
    body = memoryview(value)[_STAGED.size :]
    if kind not in (_RECORD, _SAME, _SKIPPED):
        return None
    if (check_records or kind != _RECORD) and digest != _staged_digest(j, kind, size, mtime, body):
        return None
    return kind, size, mtime, body


def check_updatable(path: str, manifest_extra: Mapping[str, Any] | None = None) -> None:
    """Every rule an update checks of the pack at ``path`` before it writes (its tables,
    the exhaustive rules too, and a record of each class against ``record_classes``; its
    files and its staging folder: lmdbfolder's own, no link or FIFO): NotAPackError,
    OptionError for a pack that cannot be updated in place, or OutputExistsError, naming
    the path. A sharded update checks every shard so before it changes any.
    ``manifest_extra``: the fields and layout the update brings (samples of several
    fields), checked against the pack's as ``update`` does (None: not checked here)."""
    old = _OldPack.load(path)
    try:
        if manifest_extra is not None:
            _check_same_fields(old, manifest_extra)
    finally:
        old.pf.close()
    _check_staging(staging_path(path))


def staging_path(dst: str) -> str:
    """Where ``pack --update`` stages the files it reads for ``dst``: ``<dst>.update``."""
    return dst + UPDATE_SUFFIX


@dataclass
class Changes:
    """What an update changed: samples ``added`` (new paths), ``removed`` (paths gone,
    or now skipped), ``changed`` (same path, another record: new bytes or another
    class; ``relabelled`` of them only the class), the files ``read``, the files
    compared by content that were ``unchanged``, classes added and removed."""

    added: int = 0
    removed: int = 0
    changed: int = 0
    relabelled: int = 0
    read: int = 0
    unchanged: int = 0
    classes_added: list[str] = field(default_factory=list)
    classes_removed: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (``pack --update --json``)."""
        return {
            "added": self.added,
            "removed": self.removed,
            "changed": self.changed,
            "relabelled": self.relabelled,
            "read": self.read,
            "unchanged": self.unchanged,
            "classes_added": list(self.classes_added),
            "classes_removed": list(self.classes_removed),
        }

    def summary(self) -> str:
        """``+N / -M / ~K`` and the classes, for messages and ``info``."""
        return describe_changes(self.as_dict())


# -- the pack as it is --------------------------------------------------------------
@dataclass
class _OldPack:
    """The finished pack at ``path``: its tables, and its file for the records an update needs."""

    path: str
    pf: PageFile
    meta: Manifest
    labels: np.ndarray  # int32, per sample
    path_index: dict[bytes, int]  # path (file system bytes) -> sample index (the first of that path)
    repeats: dict[bytes, list[int]]  # a path several samples have (a table's rows) -> their indices
    stats: np.ndarray | None  # per sample: size, mtime_ns (None: not recorded)
    order: np.ndarray | None  # per sample: record key (None: the index)
    skipped: dict[bytes, dict[str, Any]]  # path -> {path, reason, size?, mtime_ns?}
    history: list[dict[str, Any]]
    binding: bytes
    record_classes: list[str]  # the class each record header's label names
    next_record: int
    check: dict[bytes, tuple[int, int]]  # __check__: the tables the pack has
    identity: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of the data.mdb read: the one the update writes

    @classmethod
    def load(cls, path: str) -> _OldPack:
        # What the update writes is the pack's own file, never one a link leads to.
        packdir.check_own_files(path, (DATA_FILE, LOCK_FILE, SKIPPED_REPORT), doing="an update", folders=(COMPACT_DIR,))
        before = os.lstat(os.path.join(path, DATA_FILE))
        pf = packfile.open_data(path, readahead=False)
        try:
            tables = packfile.load_tables(pf, path)
            meta = tables.meta
            if tables.version < 2 or tables.binding is None:
                raise OptionError(
                    f"{path} is a format-{tables.version} pack (an older lmdbfolder made it); "
                    "it cannot be updated in place",
                    "repack it with --overwrite (once); later changes can then use --update",
                )
            count = tables.count
            source = packfile.PackSource(pf, path)
            labels = np.frombuffer(bytes(tables.labels(source)), dtype=np.int32)
            blob = tables.paths(source)
            offsets = np.frombuffer(blob, dtype="<u8", count=count + 1)
            names = bytes(blob[(count + 1) * 8 :])
            bounds = offsets.tolist()
            path_index: dict[bytes, int] = {}
            repeats: dict[bytes, list[int]] = {}
            for i in range(count):
                name = names[bounds[i] : bounds[i + 1]]
                if path_index.setdefault(name, i) != i:  # a table's image named by several rows
                    repeats.setdefault(name, [path_index[name]]).append(i)
            stats = tables.stats(source)
            # Every rule, the exhaustive ones too: an update writes over what it trusts.
            order = tables.order(source, exhaustive=True) if tables.ordered else None
            items = tables.skipped(source)
            skipped = {os.fsencode(str(item.get("path"))): item for item in items} if isinstance(items, list) else {}
            history = tables.history(source)
            _check_records(source, tables, labels, order, stats, names, bounds)
        except BaseException:
            pf.close()
            raise
        if not history:  # a pack made before histories were kept
            history = [history_entry("pack", meta.created_at or "", str(meta.pack_id), count, added=count)]
        names_in_records = meta.record_classes if tables.version >= 3 else None
        return cls(
            path=path,
            pf=pf,
            meta=meta,
            labels=labels,
            path_index=path_index,
            repeats=repeats,
            stats=None if stats is None else np.array(stats),
            order=None if order is None else np.array(order),
            skipped=skipped,
            history=history,
            binding=tables.binding,
            record_classes=list(names_in_records if names_in_records is not None else meta.classes),
            next_record=meta.next_record if meta.next_record is not None and tables.version >= 3 else count,
            check=dict(tables.check or {}),
            identity=(before.st_dev, before.st_ino),
        )

    @property
    def count(self) -> int:
        return len(self.labels)

    @property
    def keys(self) -> np.ndarray:
        """The record key of every sample (u64)."""
        return np.arange(self.count, dtype=np.uint64) if self.order is None else self.order

    def key(self, i: int) -> int:
        """The record key of sample ``i``."""
        return i if self.order is None else int(self.order[i])

    def value(self, key: int) -> memoryview:
        """The stored record under ``key`` (a view of the pack's map); PackError if it cannot be read."""
        try:
            value = self.pf.get(KEY.pack(key))
        except Exception as exc:  # PageDamage: the pack is damaged where the update must read
            raise PackError(
                f"{self.path} is damaged where record key {key} is stored ({exc})",
                "run `lmdbfolder verify` on it; repack it with --overwrite",
            ) from None
        if value is None:
            raise PackError(f"{self.path} has no record under key {key}", "repack it with --overwrite")
        return value

    def value_of(self, key: bytes) -> memoryview:
        """The stored value of the reserved key (a table) ``key``."""
        value = packfile.read_value(self.pf, key, self.path)
        if value is None:
            raise PackError(f"{self.path} has no {key.decode()} table", "run `lmdbfolder verify` on it")
        return value

    def close(self) -> None:
        self.pf.close()


def _fields_of(meta: Manifest) -> int | None:
    """The number of fields of the pack's samples (``decode_record``'s ``fields``); None: one image."""
    specs = meta.field_specs
    return None if specs is None else len(specs)


#: Where a record header holds its label (``RECORD_HEADER``: the i32 before the CRC).
_HEADER_LABEL_AT = struct.calcsize(RECORD_HEADER.format[:-2])
_HEADER_LABEL = struct.Struct("<i")
#: What a refusal of records that are not their samples' says to do.
_RECORDS_HINT = (
    "its tables do not match its records (damaged or forged): nothing was written; run "
    "`lmdbfolder verify` on it, and pack it again with --overwrite"
)


def _check_records(
    source: packfile.PackSource,
    tables: PackTables,
    labels: np.ndarray,
    order: Any,
    stats: Any,
    names: bytes,
    bounds: list[int],
) -> None:
    """Refuse a pack whose records are not their samples' by the rules ``verify`` checks
    (``SAMPLE_RECORDS``: the header label through ``record_classes``, and the payload's
    length against ``__stats__``), before anything is written: an update keeps records
    by their ``__order__`` entry without reading them, so a swapped entry (or a permuted
    ``record_classes``) would go on serving another sample's image or class. Every
    record: one lookup and its 4-byte header label each (about 3 us), no payload read;
    ``Reader.get`` checks the rest of a header when it reads the record."""
    pf, count = source.pf, len(labels)
    keys = range(count) if order is None else order.tolist()
    header_labels = array.array("i", bytes(4 * count))
    payload_lens = array.array("q", bytes(8 * count))
    locate, pack_key, view, head = pf.locate, KEY.pack, pf.view, RECORD_HEADER.size
    try:
        for i, key in enumerate(keys):
            found = locate(pack_key(key))
            if found is None or found[1] < head:
                raise PackError(f"{source.where} has no record under key {key}", "repack it with --overwrite")
            off, size = found
            header_labels[i] = _HEADER_LABEL.unpack_from(view(off + _HEADER_LABEL_AT, 4))[0]
            payload_lens[i] = size - head
    except PageDamage as exc:
        raise PackError(
            f"{source.where} is damaged where a record is stored ({exc.why})",
            "run `lmdbfolder verify` on it; repack it with --overwrite",
        ) from None

    def describe(i: int) -> str:
        path = os.fsdecode(names[bounds[i] : bounds[i + 1]])
        return f"sample {i} ({printable(path, 200)}, record key {keys[i]})"

    SAMPLE_RECORDS.check(
        np.frombuffer(header_labels, dtype=np.int32),
        np.frombuffer(payload_lens, dtype=np.int64),
        labels,
        SAMPLE_RECORDS.exact_sizes(tables.meta, stats),
        tables.label_map,
        where=source.where,
        hint=_RECORDS_HINT,
        describe=describe,
    )


def check_options(old: _OldPack, options: PackOptions) -> PackOptions:
    """The options of the update: those the pack was made with (store, check, resize).

    Options that change every record cannot be changed by an update: that is a
    repack (OptionError saying so). ``check="content"`` keeps the pack's own
    check for the files it reads.
    """
    effective = options
    if options.check == CONTENT_CHECK:
        params = old.meta.params
        recorded = params.get("check") if params is not None else None
        effective = options.replace(check=recorded if recorded in CHECKS else "header")
    why = effective.differences(old.meta)
    if why is not None:
        raise OptionError(
            f"{old.path}: {why}; an update keeps the options of the pack (they apply to every record, "
            "not only to the files that changed)",
            "pass the options the pack was made with (see `lmdbfolder info`), or repack with --overwrite",
        )
    return effective


# -- what to do with each source file ------------------------------------------------
@dataclass
class _Plan:
    """Per source file of the new sample list (numpy arrays): its ``stat`` (size,
    mtime; -1 when it cannot be stat-ed), its sample index in the pack (-1: none),
    the action, and the label its record header carries (in ``record_classes``);
    the files to read (``todo``), in order."""

    sizes: np.ndarray
    mtimes: np.ndarray
    old_index: np.ndarray
    action: np.ndarray
    todo: list[int]
    record_classes: list[str]
    header_labels: np.ndarray

    def same_samples(self, old: _OldPack, sources: SourceList) -> bool:
        """Whether the source holds exactly the pack's samples (same files, classes and
        order) and skipped files: no file to read, nothing to relabel, nothing gone."""
        keep = self.action == _KEEP
        again = int(np.count_nonzero(self.action == _SKIP_AGAIN))
        if self.todo or again != len(old.skipped) or sources.classes != old.meta.classes:
            return False
        kept = self.old_index[keep]
        return len(kept) == old.count and bool(np.array_equal(kept, np.arange(old.count)))

    def todo_digest(self, sources: SourceList) -> str:
        h = hashlib.sha256()
        for s in self.todo:
            h.update(os.fsencode(sources.relpaths[s]))
            h.update(b"\0%d\0%d\n" % (self.header_labels[s], self.old_index[s]))
        return h.hexdigest()


def _raw_paths(sources: SourceList) -> list[bytes]:
    paths = sources.relpaths
    return list(paths.iter_raw()) if isinstance(paths, PathList) else [os.fsencode(p) for p in paths]


def _plan(
    old: _OldPack, sources: SourceList, compare_content: bool, sample_stat: Callable[[int], tuple[int, int]] | None
) -> _Plan:
    """``stat`` every source file and decide what to do with it (see ``_Plan``).

    One Python loop does what must be done per file (a ``stat``, a dictionary
    lookup of its path); the decisions are numpy expressions over the arrays.
    ``sample_stat(s)`` replaces the ``stat`` for samples of several files (their
    bytes and a digest of their files' sizes and times), whose paths may repeat (a
    table's rows naming one image): the k-th sample of a path is the pack's k-th.
    """
    n = len(sources)
    raw = _raw_paths(sources)
    root = os.fsencode(sources.root) + b"/"
    stat, find = os.stat, old.path_index.get
    found, sizes, mtimes = [-1] * n, [-1] * n, [UNKNOWN_MTIME] * n
    if sample_stat is not None:
        seen: dict[bytes, int] = {}
        for s, path in enumerate(raw):
            k = seen[path] = seen.get(path, -1) + 1
            same = old.repeats.get(path)
            found[s] = find(path, -1) if k == 0 else same[k] if same is not None and k < len(same) else -1
            sizes[s], mtimes[s] = sample_stat(s)
    for s, path in enumerate(raw if sample_stat is None else ()):
        found[s] = find(path, -1)
        try:
            st = stat(path if path.startswith(b"/") else root + path)
        except OSError:
            continue  # read it: the reader says why it is skipped
        sizes[s], mtimes[s] = st.st_size, st.st_mtime_ns
    old_index = np.array(found, dtype=np.int64)
    size_of, mtime_of = np.array(sizes, dtype=np.int64), np.array(mtimes, dtype=np.int64)
    labels = (
        np.frombuffer(sources.labels.array, dtype=np.int32)
        if isinstance(sources.labels, LabelList)
        else (np.array(list(sources.labels), dtype=np.int32))
    )
    # Record classes only grow: a class new to the pack is appended (header labels stay).
    record_classes = list(old.record_classes)
    for name in sources.classes:
        if name not in record_classes:
            record_classes.append(name)
    rc_index = {name: k for k, name in enumerate(record_classes)}
    # Label -1 indexes the last entry of each map: "no label".
    header_labels = np.array([rc_index[c] for c in sources.classes] + [NO_LABEL], dtype=np.int32)[labels]
    new_label_of_old = np.array(
        [sources.class_to_idx.get(c, -2) for c in old.meta.classes] + [NO_LABEL], dtype=np.int64
    )
    present = old_index >= 0
    oi = old_index[present]
    action = np.full(n, _READ, dtype=np.uint8)
    if old.stats is not None and not compare_content:
        old_size = old.stats["size"].astype(np.int64)
        old_mtime = old.stats["mtime_ns"]
        unchanged = np.zeros(n, dtype=bool)
        unchanged[present] = (
            (old_mtime[oi] != UNKNOWN_MTIME) & (old_mtime[oi] == mtime_of[present]) & (old_size[oi] == size_of[present])
        )
        relabel = np.zeros(n, dtype=bool)
        relabel[present] = new_label_of_old[old.labels[oi]] != labels[present]
        action[unchanged] = _KEEP
        action[unchanged & relabel] = _RELABEL
    # A file the pack skipped, unchanged: skipped again for the same reason, not read.
    if old.skipped and not compare_content:
        for s in np.flatnonzero(~present).tolist():
            item = old.skipped.get(raw[s])
            if item is not None and item.get("mtime_ns") == mtimes[s] != UNKNOWN_MTIME and item.get("size") == sizes[s]:
                action[s] = _SKIP_AGAIN
    todo = np.flatnonzero(action == _READ).tolist()
    return _Plan(size_of, mtime_of, old_index, action, todo, record_classes, header_labels)


# -- staging the files to read ------------------------------------------------------
class _StageRun(_Run):
    """The write loop over the files to read, into ``<dst>.update`` (keys: position in
    the list of files to read; values: ``_STAGED`` and the record or skip reason)."""

    def __init__(self, job: Job, state: _Partial, old: _OldPack, old_keys: Sequence[int]) -> None:
        super().__init__(job, state)
        self.old = old
        self.old_keys = old_keys  # per file to read: the record key of its sample in the pack, or -1

    def _value(self, j: int, result: Loaded | Skipped) -> bytes:
        """The staged value of file ``j`` read as ``result`` (SourceError for a skipped file
        under ``--strict``, after committing what is staged)."""
        if isinstance(result, Skipped):
            if self.options.strict:
                self._commit()
                raise SourceError(
                    self.sources.abspath(j),
                    result.reason,
                    "fix or remove the file and run the same command again to resume, "
                    "or update without --strict to skip such files",
                )
            return _staged_value(
                j, _SKIPPED, result.size, result.mtime_ns, result.reason.encode("utf-8", "surrogateescape")
            )
        self.input_bytes += result.source_bytes
        key = self.old_keys[j]
        if key >= 0 and _same_record(self.old.value(key), result.value):
            return _staged_value(j, _SAME, result.source_bytes, result.mtime_ns)
        return _staged_value(j, _RECORD, result.source_bytes, result.mtime_ns, result.value)

    def _write(self, todo: range, results: Iterable[Loaded | Skipped], progress: bool | None) -> None:
        state = self.state
        with Progress(len(self.sources), "update", enabled=progress, initial=state.next_source) as bar:
            for j, result in zip(todo, results):
                if self.interrupted:
                    raise KeyboardInterrupt
                value = self._value(j, result)
                if isinstance(result, Skipped):
                    bar.write(skipped_line(self.sources.relpaths[j], result.reason))
                else:
                    bar.update(1, result.source_bytes)
                self.batch.append((encode_key(j), value))
                self.batch_bytes += len(value)
                state.next_source = j + 1
                if len(self.batch) >= self.options.commit_every or self.batch_bytes >= self.batch_limit:
                    self._commit()
                if self.on_progress is not None:
                    self.on_progress(j + 1, len(self.sources))
        if self.interrupted:
            raise KeyboardInterrupt

    def refresh(self, sizes: np.ndarray, mtimes: np.ndarray) -> int:
        """Read again the files staged by an earlier run that can no longer be trusted:
        a staged value whose checksum does not hold (damaged or altered since), or a
        file whose size or mtime (``sizes``, ``mtimes``: the ``stat`` of this run, per
        file to read) differs from when it was staged (it changed while the update was
        stopped). Returns how many were read again."""
        state = self.state
        stale = []
        with state.env.begin(buffers=True) as txn:
            for j in range(state.next_source):
                value = txn.get(encode_key(j))
                staged = None if value is None else _unstage(j, value)
                if (
                    staged is None
                    or staged[2] == UNKNOWN_MTIME
                    or (staged[1], staged[2]) != (int(sizes[j]), int(mtimes[j]))
                ):
                    stale.append(j)
        puts: dict[bytes, bytes | bytearray | None] = {}
        held = 0
        for j in stale:
            again = self._value(j, self._load(j))
            puts[encode_key(j)] = again
            held += len(again)
            if held >= self.batch_limit:
                state.commit([], puts)
                puts, held = {}, 0
        if puts:
            state.commit([], puts)
        return len(stale)

    def finish(self) -> None:
        self._commit({PROGRESS_KEY: self.state.checkpoint()})
        self.state.env.sync(True)


def _same_record(old: memoryview, new: bytes | bytearray | memoryview) -> bool:
    """Whether a file read again gives the pack's record: the same header, label
    included (both in ``record_classes``' numbering, which only grows), and the same
    payload; not the CRC, which the binding makes differ."""
    new_view = memoryview(new)
    return len(old) == len(new_view) and old[:28] == new_view[:28] and old[32:] == new_view[32:]


def _stage(
    old: _OldPack,
    sources: SourceList,
    plan: _Plan,
    options: PackOptions,
    staging: str,
    progress: Any,
    loader: Callable[[int], Loaded | Skipped] | None = None,
) -> tuple[int, int]:
    """Read the files of ``plan.todo`` into ``staging`` (resuming what is there), by
    ``loader(s)`` when given (samples of several fields). Returns (bytes read by this run,
    files done before it)."""
    fingerprint = {
        "staged_layout": _STAGED_LAYOUT,
        "update_of": str(old.meta.pack_id),
        "todo": len(plan.todo),
        "todo_sha256": plan.todo_digest(sources),
        "root": sources.root,
        **options.fingerprint(),
    }
    _check_staging(staging)
    os.makedirs(staging, exist_ok=True)
    todo_sizes = np.maximum(plan.sizes[plan.todo], 0)
    mean = float(todo_sizes.mean()) if plan.todo else 0.0
    map_size = int(todo_sizes.sum() * 1.6 + len(plan.todo) * 8192 + (64 << 20))
    try:
        state = resume._open_partial(staging, fingerprint, map_size, [])
    except (OutputExistsError, NotAPackError):
        # Staged for another update (the source or the pack changed since): it holds only
        # copies of source files, so start it again.
        packdir.remove(staging)
        os.makedirs(staging)
        state = resume._open_partial(staging, fingerprint, map_size, [])
    done_before = state.next_source
    todo_sources = SourceList(
        sources.root,
        sources.layout,
        [sources.relpaths[s] for s in plan.todo],
        plan.header_labels[plan.todo].tolist(),
        plan.record_classes,
        {name: k for k, name in enumerate(plan.record_classes)},
        list_file=sources.list_file,
    )
    old_keys = [old.key(i) if i >= 0 else -1 for i in plan.old_index[plan.todo].tolist()]
    todo = plan.todo
    job = Job(
        sources=todo_sources,
        dst=staging,
        options=options,
        on_progress=progress.on_progress,
        loader=None if loader is None else (lambda j: loader(todo[j])),
    )
    run = _StageRun(job, state, old, old_keys)
    try:
        if done_before:  # staged by a run that stopped: reused only where it can be trusted
            run.refresh(plan.sizes[plan.todo], plan.mtimes[plan.todo])
        if state.next_source < len(plan.todo):
            if options.space_check:
                need = 2 * int(todo_sizes[state.next_source :].sum()) + (64 << 20)
                free = shutil.disk_usage(staging).free
                if need > free:
                    raise PackError(
                        f"the update needs about {disk_size(need)} but only {disk_size(free)} are free "
                        f"on the disk holding {staging}",
                        "free some space (pass --no-space-check to try anyway)",
                    )
            workers = options.workers
            if workers is None:
                # Reader processes pay off from a few hundred files; forking them costs
                # ~10 ms each, more than reading a few small files here.
                workers = min(default_workers(), max(1, (len(plan.todo) - state.next_source) // 256))
            run.write_all(workers, mean + 64, progress.bar)
    finally:
        state.close()
    return run.input_bytes, done_before


# -- the transaction ----------------------------------------------------------------
@dataclass
class _Result:
    meta: Manifest
    changes: Changes
    skipped: list[tuple[str, str]]


@dataclass(frozen=True)
class _Put:
    """A record the transaction writes under ``key``: staged file ``staged`` (its
    position in the files read), or the pack's record ``old_key`` with the header
    label ``label`` (a relabelled file). ``size``: its bytes."""

    key: int
    size: int
    staged: int = -1
    old_key: int = -1
    label: int = NO_LABEL


@dataclass
class _Assembly:
    """The new version, sample by sample, before anything is written."""

    keys: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))  # per sample: its record key
    sizes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    mtimes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    skipped: list[tuple[int, str]] = field(default_factory=list)
    skipped_stats: dict[int, tuple[int, int]] = field(default_factory=dict)
    puts: list[_Put] = field(default_factory=list)
    deletes: list[int] = field(default_factory=list)
    encodings: dict[str, int] = field(default_factory=dict)
    payload_bytes: int = 0
    next_key: int = 0
    changes: Changes = field(default_factory=Changes)


@dataclass
class _Samples:
    """Per source file while ``_assemble`` works: its record key, size and mtime, whether it
    is a sample (not skipped), the files skipped (index, reason); per sample of the pack,
    whether the new version still uses its record."""

    keys: np.ndarray
    sizes: np.ndarray
    mtimes: np.ndarray
    is_sample: np.ndarray
    used_old: np.ndarray
    skipped: list[tuple[int, str]]


def _assemble(old: _OldPack, sources: SourceList, plan: _Plan, staged: PageFile | None) -> _Assembly:
    """Each sample's record key (kept, or new), the records to put and to delete, the
    tables' contents and the manifest's totals. Reads the staged files' headers and the
    headers of the pack's records that go; no payload. Kept files are numpy
    expressions; only the files that changed take a Python loop."""
    out = _Assembly(
        encodings=dict(old.meta.encodings or {}),
        payload_bytes=old.meta.payload_bytes or 0,
        next_key=old.next_record,
    )
    work = _kept(out, old, sources, plan)
    _take_changed(out, old, sources, plan, staged, work)
    samples = np.flatnonzero(work.is_sample)
    if not len(samples):
        raise nothing_to_pack(sources.root, len(sources))
    out.keys, out.sizes, out.mtimes = work.keys[samples], work.sizes[samples], work.mtimes[samples]
    out.skipped = sorted(work.skipped)
    _drop_unused(out, old, work.used_old)
    changes, old_index = out.changes, plan.old_index
    in_source = np.zeros(old.count, dtype=bool)
    in_source[old_index[old_index >= 0]] = True
    now_skipped = sum(1 for s, _ in out.skipped if old_index[s] >= 0)  # were samples, are skipped now
    changes.removed = int(np.count_nonzero(~in_source)) + now_skipped
    old_classes = list(old.meta.classes)
    changes.classes_added = [c for c in sources.classes if c not in set(old_classes)]
    changes.classes_removed = [c for c in old_classes if c not in set(sources.classes)]
    return out


def _kept(out: _Assembly, old: _OldPack, sources: SourceList, plan: _Plan) -> _Samples:
    """The files kept as they are (numpy expressions) and those skipped again."""
    action, old_index = plan.action, plan.old_index
    work = _Samples(
        keys=np.zeros(len(sources), dtype=np.uint64),
        sizes=plan.sizes.copy(),
        mtimes=plan.mtimes.copy(),
        is_sample=action != _SKIP_AGAIN,
        used_old=np.zeros(old.count, dtype=bool),
        skipped=[],
    )
    keep = action == _KEEP
    work.keys[keep] = old.keys[old_index[keep]]
    work.used_old[old_index[keep]] = True
    for s in np.flatnonzero(~work.is_sample).tolist():
        item = old.skipped[os.fsencode(sources.relpaths[s])]
        work.skipped.append((s, str(item.get("reason", ""))))
        out.skipped_stats[s] = (int(work.sizes[s]), int(work.mtimes[s]))
    return work


def _count_in(out: _Assembly, value: bytes | memoryview, fields: int | None) -> None:
    encoding = decode_record(value, fields=fields)[0].encoding
    out.encodings[encoding] = out.encodings.get(encoding, 0) + 1
    out.payload_bytes += len(value)


def _take_changed(
    out: _Assembly, old: _OldPack, sources: SourceList, plan: _Plan, staged: PageFile | None, work: _Samples
) -> None:
    """The files relabelled (the pack's record, a new header label) and read (staged)."""
    changes, action, old_index = out.changes, plan.action, plan.old_index
    todo_at = {s: j for j, s in enumerate(plan.todo)}
    for s in np.flatnonzero((action == _RELABEL) | (action == _READ)).tolist():
        i = int(old_index[s])
        if action[s] == _RELABEL:
            old_key = old.key(i)
            value = old.value(old_key)
            key, out.next_key = out.next_key, out.next_key + 1
            out.puts.append(_Put(key, len(value), old_key=old_key, label=int(plan.header_labels[s])))
            _count_in(out, value, _fields_of(old.meta))
            changes.changed += 1
            changes.relabelled += 1
            work.keys[s] = key
            continue
        found = staged.get(encode_key(todo_at[s])) if staged is not None else None
        if found is None:
            raise PackError(f"the staged update has no entry for {sources.relpaths[s]}", "run the update again")
        # A record's checksum is checked where it is published (``_record``): hashed once there.
        unstaged = _unstage(todo_at[s], found, check_records=False)
        if unstaged is None:
            raise _damaged_staging(sources.relpaths[s])
        kind, size, mtime, body = unstaged
        changes.read += 1
        work.sizes[s], work.mtimes[s] = size, mtime
        if kind == _SKIPPED:
            work.is_sample[s] = False
            work.skipped.append((s, bytes(body).decode("utf-8", "surrogateescape")))
            if mtime != UNKNOWN_MTIME:
                out.skipped_stats[s] = (size, mtime)
        elif kind == _SAME:
            work.keys[s] = old.key(i)
            work.used_old[i] = True
            changes.unchanged += 1
        else:
            key, out.next_key = out.next_key, out.next_key + 1
            out.puts.append(_Put(key, len(body), staged=todo_at[s]))
            _count_in(out, body, _fields_of(old.meta))
            work.keys[s] = key
            if i >= 0:
                changes.changed += 1
            else:
                changes.added += 1


def _drop_unused(out: _Assembly, old: _OldPack, used_old: np.ndarray) -> None:
    """The records no sample uses any more (files removed, replaced or relabelled): deleted, uncounted."""
    for i in np.flatnonzero(~used_old).tolist():
        key = old.key(i)
        value = old.value(key)
        encoding = _encoding_of(value, _fields_of(old.meta))
        if encoding in out.encodings:
            out.encodings[encoding] -= 1
            if not out.encodings[encoding]:
                del out.encodings[encoding]
        out.payload_bytes -= len(value)
        out.deletes.append(key)


def _new_tables(
    old: _OldPack,
    sources: SourceList,
    plan: _Plan,
    new: _Assembly,
    options: PackOptions,
    fingerprint: dict[str, Any],
    manifest_extra: Mapping[str, Any],
) -> tuple[Manifest, dict[bytes, Any]]:
    """The manifest (format 3, a new ``pack_id``) and every table of the new version."""
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    pack_id = new_pack_id()
    changes = new.changes
    meta = old.meta.updated(
        count=len(new.keys),
        classes=sources.classes,
        class_to_idx=sources.class_to_idx,
        pack_id=pack_id,
        next_record=new.next_key,
        record_classes=plan.record_classes if plan.record_classes != list(sources.classes) else None,
        encodings=dict(sorted(new.encodings.items())),
        payload_bytes=new.payload_bytes,
        skipped_count=len(new.skipped),
        source=sources.describe(),
        fingerprint=fingerprint,
        params=options.params(),
        updated_at=now,
        extra=manifest_extra,
    )
    event = history_entry(
        "update",
        now,
        pack_id,
        len(new.keys),
        **{k: v for k, v in changes.as_dict().items() if k != "unchanged"},
        skipped=len(new.skipped),
    )
    skipped_set = {s for s, _ in new.skipped}
    blob = meta.to_json()
    check_manifest_size(blob, sources.root)
    tables = NewTables(
        blob,
        _labels_table(sources.labels, skipped_set),
        _paths_table(sources.relpaths, skipped_set),
        skipped_entries(sources.relpaths, new.skipped, new.skipped_stats),
        [*old.history, event],
        order=new.keys,
        stats=(new.sizes, new.mtimes),
    ).encode()
    return meta, tables


def _apply(
    old: _OldPack,
    sources: SourceList,
    plan: _Plan,
    options: PackOptions,
    staging: str | None,
    fingerprint: dict[str, Any],
    manifest_extra: Mapping[str, Any],
) -> _Result:
    """Change ``<dst>/data.mdb`` in one transaction: the new records, the tables."""
    staged = packfile.open_data(staging, readahead=True) if staging is not None else None
    try:
        new = _assemble(old, sources, plan, staged)
        meta, tables = _new_tables(old, sources, plan, new, options, fingerprint, manifest_extra)
        _commit(old, new.puts, new.deletes, tables, staged)
    finally:
        if staged is not None:
            staged.close()
    return _Result(meta, new.changes, [(sources.relpaths[s], r) for s, r in new.skipped])


def _encoding_of(value: memoryview, fields: int | None) -> str:
    try:
        return decode_record(value, fields=fields)[0].encoding
    except Exception:  # a damaged record: its encoding is not counted
        return ""


def _record(put: _Put, old: _OldPack, staged: PageFile | None) -> bytes | bytearray:
    """The bytes of ``put``, bound to the pack and its key (one record in memory at a time)."""
    if put.old_key >= 0:
        header, payload = decode_record(old.value(put.old_key), fields=_fields_of(old.meta))
        return encode_record(
            payload,
            label=put.label,
            encoding=header.encoding,
            width=header.width,
            height=header.height,
            channels=header.channels,
            binding=old.binding,
            index=put.key,
            flags=header.flags,  # a record of several fields stays one
        )
    found = staged.get(encode_key(put.staged)) if staged is not None else None
    if found is None:
        raise PackError(f"the staged update lost its file {put.staged}", "run the update again")
    # Checked on the copy that is published: the checksum the binding gives it vouches for these bytes.
    value = bytearray(found)
    unstaged = _unstage(put.staged, value)
    if unstaged is None or unstaged[0] != _RECORD:
        raise _damaged_staging(f"source file {put.staged} of the update")
    return bind_record(unstaged[3], old.binding, put.key)  # type: ignore[return-value]


def _damaged_staging(what: str) -> PackError:
    return PackError(
        f"the staged copy of {what} does not match its checksum (damaged or altered since it was staged); "
        "nothing was changed",
        "run the same command again: it reads the file again from the source",
    )


_WRITABLE_HINT = (
    "make {data} writable (`chmod u+w`; `lsattr` shows whether it is immutable: `chattr -i`), "
    "then run the same command again; nothing was changed"
)


def _check_writable(old: _OldPack, data: str) -> None:
    """PackError naming ``data`` (the pack's ``data.mdb``) when this process may not write
    it (a read-only or immutable file): said as what it is, before LMDB opens it."""
    try:
        fd = os.open(data, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ETXTBSY):
            raise PackError(f"cannot update {data}: {exc.strerror}", _WRITABLE_HINT.format(data=data)) from None
        if exc.errno == errno.ELOOP:  # a link put there since the update began
            _check_identity(old, data)
        raise PackError(*os_refusal(exc, "cannot update", data)) from None
    os.close(fd)
    _check_identity(old, data)


def _check_identity(old: _OldPack, data: str) -> None:
    """PackError when ``data`` is no longer the regular file the update read (replaced by
    another file or a link while it ran): it must not be written."""
    try:
        st = os.lstat(data)
        same = stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == old.identity
    except OSError:
        same = False
    if not same:
        raise PackError(
            f"{data} was replaced while the update ran (it is not the file the update read); nothing was changed",
            "check what replaced it, then run the same command again",
        )


def _commit(
    old: _OldPack,
    puts: list[_Put],
    deletes: list[int],
    tables: dict[bytes, Any],
    staged: PageFile | None = None,
) -> None:
    """One write transaction on the pack's ``data.mdb``: ``puts`` (their bytes made one at
    a time: LMDB keeps the transaction's pages, spilling them to free pages past its
    limit), ``deletes``, ``tables``. A map too small is grown and the transaction run again."""
    data = os.path.join(old.path, DATA_FILE)
    size = os.path.getsize(data)
    need = sum(p.size for p in puts) + sum(len(v) for v in tables.values())
    map_size = size + 2 * need + (64 << 20)
    lock = os.path.join(old.path, LOCK_FILE)
    _check_writable(old, data)
    try:
        # No lock file (MDB_NOLOCK): readers never use LMDB's, and the writer lock
        # (``<dst>.lock``) keeps writers apart. So nothing in the pack folder but data.mdb
        # is opened, and a refused open leaves nothing behind.
        env = lmdb.open(
            os.fsencode(old.path),
            map_size=map_size,
            subdir=True,
            readahead=False,
            meminit=False,
            max_dbs=0,
            sync=True,
            metasync=True,
            lock=False,
            writemap=False,  # a full disk must fail the commit, never SIGBUS
        )
    except lmdb.Error as exc:
        raise PackError(f"cannot open {old.path} to update it: {exc}", "run `lmdbfolder verify` on it") from None
    try:
        _check_identity(old, data)  # the file LMDB opened by name is still the one read
    except BaseException:
        env.close()
        raise
    try:
        while True:
            txn = env.begin(write=True)
            try:
                for put in puts:
                    txn.put(encode_key(put.key), _record(put, old, staged))
                for key in deletes:
                    txn.delete(encode_key(key))
                for name, value in tables.items():
                    txn.put(name, value)
                txn.commit()
                break
            except lmdb.MapFullError:
                txn.abort()
                env.set_mapsize(env.info()["map_size"] * 2)
            except lmdb.Error as exc:
                txn.abort()
                raise _write_error(old.path, exc) from exc
            except BaseException:
                txn.abort()
                raise
        env.sync(True)
    finally:
        env.close()
    if os.path.exists(lock):
        os.remove(lock)  # readers never use it


def _recorded_manifest(dst: str | os.PathLike[str]) -> tuple[str, Manifest] | None:
    """(path of the pack, manifest) of the pack at ``dst`` (a sharded pack: its first
    shard's manifest, whose options and source record are every shard's), or None when
    ``dst`` holds no readable pack."""
    from lmdbfolder.format import decode_meta

    found = packdir.inspect(dst)
    try:
        if found.kind is packdir.Kind.SHARDED:
            root, index = packdir.load_index(found.path)
            path = os.path.join(root, index.shards[0].name)
        elif found.kind is packdir.Kind.PACK:
            path = found.path
        else:
            return None
        return found.path, decode_meta(packfile.read_manifest(path), where=path)
    except (NotAPackError, OptionError, TypeError, ValueError, KeyError, IndexError):
        return None


def recorded_options(dst: str | os.PathLike[str]) -> PackOptions | None:
    """The content options (store, check, resize) the pack at ``dst`` was made with
    (a sharded pack: its first shard's), or None when ``dst`` holds no readable pack.
    What ``lmdbfolder pack --update`` uses for the options it is not given."""
    from lmdbfolder.write.options import Resize

    found = _recorded_manifest(dst)
    if found is None:
        return None
    meta = found[1]
    try:
        params: dict[str, Any] = meta.params or {}
        check = params.get("check")
        return PackOptions(
            store=meta.store,
            check=check if check in ("none", "header", "decode") else "header",
            resize=Resize.from_params(params),
        )
    except (OptionError, TypeError, ValueError, KeyError):
        return None


def update_spec(spec: SourceSpec, dst: str | os.PathLike[str]) -> SourceSpec:
    """The source spec of an update of ``dst``: ``spec`` with the layout and file filters
    it does not give taken from the pack's manifest, those it gives checked against it
    (``SourceSpec.for_update``; OptionError naming both when they differ). A ``dst``
    that holds no readable pack (it will be packed): ``spec`` as it is."""
    found = _recorded_manifest(dst)
    if found is None:
        return spec
    path, meta = found
    refuse_fields(path, meta)
    return spec.for_update(meta.source, path)


def refuse_fields(path: str, meta: Manifest) -> None:
    """OptionError for a pack of several fields (format 4) that an update of a folder of
    classes (no ``--layout``) was asked for: it needs the layout it was packed from."""
    specs = meta.field_specs
    if specs is not None:
        layout = meta.layout_name or "L"
        raise OptionError(
            f"{path} holds samples of several fields ({', '.join(f.name for f in specs)}) "
            f"packed from the {layout} layout; an update without --layout would read a folder of classes",
            f"update it with `lmdbfolder pack SRC DST --layout {layout} --update` (and that layout's flags)",
        )


#: Layout details an update may change (COCO's categories come with the annotations it reads).
_UPDATABLE_INFO = ("categories",)
#: Layout details compared only when both the pack and the update record them: the name of COCO's
#: annotation file, which a pack made by ``pack_dataset`` of a ``CocoDetection`` does not know
#: (torchvision and pycocotools keep no file name), so either may update the other's pack.
_KNOWN_BY_ONE_INFO = ("annotations",)


def _check_same_fields(old: _OldPack, manifest_extra: Mapping[str, Any]) -> None:
    """OptionError unless the update brings the samples the pack holds: the same fields (none,
    for a pack of one image per sample), the same layout with the same split, scale, columns."""
    fields = manifest_extra.get("fields")
    specs = old.meta.field_specs
    old_fields = None if specs is None else [f.to_json() for f in specs]
    if fields is None and old_fields is None:
        return
    if fields is None:
        refuse_fields(old.path, old.meta)

    def names(given: list[dict[str, Any]] | None) -> str:
        return "one image and a class" if given is None else ", ".join(str(f["name"]) for f in given)

    if old_fields != fields:
        raise OptionError(
            f"{old.path} holds samples of {names(old_fields)}, the update brings {names(fields)}",
            "update it from the source it was packed from, or pack it again with --overwrite",
        )
    layout = manifest_extra.get("layout") or {}
    given = {k: v for k, v in (layout.get("info") or {}).items() if k not in _UPDATABLE_INFO}
    had = {
        k: v
        for k, v in _as_recorded_now(old.meta.layout_name, old.meta.layout_info).items()
        if k not in _UPDATABLE_INFO
    }
    for key in _KNOWN_BY_ONE_INFO:
        if (key in given) != (key in had):
            given.pop(key, None)
            had.pop(key, None)
    if layout.get("name") != old.meta.layout_name or given != had:
        raise OptionError(
            f"{old.path} was packed from the {old.meta.layout_name} layout ({_describe(had)}), "
            f"the update lists the {layout.get('name')} layout ({_describe(given)}): another dataset",
            "give the layout, split and flags the pack was made with (see `lmdbfolder info`), "
            "or pack it again with --overwrite",
        )


def _as_recorded_now(layout: str | None, info: Mapping[str, Any]) -> dict[str, Any]:
    """A pack's ``layout_info`` as this version records it: ``pack_dataset`` of a
    ``VOCSegmentation`` or ``Cityscapes`` recorded the year (``{"year": "2012"}``) and
    torchvision's mask folder (``{"mode": "gtFine"}``) where the layouts record the year's
    folder (``VOC2012``) and the mode (``fine``); both describe the same dataset."""
    now = dict(info)
    if layout == "voc" and "year" in now and "year_folder" not in now:
        now["year_folder"] = f"VOC{now.pop('year')}"
    # layouts.segmentation.CITYSCAPES_MODES, not imported: the layouts import write.fields,
    # which imports this module (tests/test_layers.py refuses the cycle).
    if layout == "cityscapes" and now.get("mode") in ("gtFine", "gtCoarse"):
        now["mode"] = "fine" if now["mode"] == "gtFine" else "coarse"
    return now


def _describe(info: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} {printable(str(v), 200)}" for k, v in info.items()) or "no options"


# -- the entry point ------------------------------------------------------------------
class _Progress:
    """The progress hooks of an update (a bar, and ``on_progress`` of the caller)."""

    def __init__(self, bar: bool | None, on_progress: Any) -> None:
        self.bar = bar
        self.on_progress = on_progress


@dataclass
class Updated:
    """What ``update`` did: the pack's manifest now, what changed (None: no sample
    changed, nothing was read), the bytes read, the files staged before this run
    (an interrupted update resumed), and the skipped source files."""

    meta: Manifest
    changes: Changes | None
    read_bytes: int
    resumed_from: int
    skipped: list[tuple[str, str]]
    compacted: bool = False


def update(
    sources: SourceList,
    dst: str,
    options: PackOptions,
    *,
    manifest_extra: Mapping[str, Any] | None = None,
    on_progress: Any = None,
    loader: Callable[[int], Loaded | Skipped] | None = None,
    stat: Callable[[int], tuple[int, int]] | None = None,
) -> Updated:
    """Bring the finished pack ``dst`` up to date with ``sources`` (the caller holds the
    writer lock): the steps of the module docstring. Samples of several fields
    (``write.fields``): ``loader(s)`` reads source ``s``'s record and ``stat(s)`` says what is
    compared of it instead of its file's ``stat``."""
    staging = staging_path(dst)
    old = _OldPack.load(dst)
    try:
        _check_same_fields(old, manifest_extra or {})
        # Before anything is written: every way out (the report, the staged files) goes
        # through the staging folder, which must be ours, never a link or a planted folder.
        _check_staging(staging)
    except BaseException:
        old.close()
        raise
    try:
        effective = check_options(old, options)
        # Other filters select other files: added (or dropped) silently, they would mix
        # another dataset into this one (``update_spec`` fills in the pack's own).
        if old.meta.field_specs is None:  # a layout of several fields: ``_check_same_fields``
            check_update_filters(old.meta.source, sources, dst)
        fingerprint = resume.pack_fingerprint(sources, effective, manifest_extra)
        plan = _plan(old, sources, options.check == CONTENT_CHECK or old.stats is None, stat)
        if plan.same_samples(old, sources):
            if old.meta.fingerprint != fingerprint or old.meta.differs_from(manifest_extra):
                # The same samples from a source described otherwise (moved, or a
                # shard whose place in its split moved): the manifest only.
                meta = _rewrite_manifest(old, sources, effective, fingerprint, dict(manifest_extra or {}))
            else:
                meta = old.meta
            _finish_up(dst, staging, old)
            skipped = [(str(item.get("path")), str(item.get("reason", ""))) for item in old.skipped.values()]
            return Updated(meta, None, 0, 0, skipped)
        read_bytes, before = 0, 0
        if plan.todo:
            progress = _Progress(options.progress, on_progress)
            read_bytes, before = _stage(old, sources, plan, effective, staging, progress, loader)
        staged = staging if plan.todo else None
        # The version before ``old`` ends with this transaction: the free pages the
        # last update left can go now (``old`` stays the current version, and the
        # transaction opens the compacted file).
        compacted = _compact_if_sparse(dst)
        if compacted:
            # The compacted data.mdb is a new file of ours (made and renamed by this
            # update): the one the transaction must find, not the file read before.
            st = os.lstat(os.path.join(dst, DATA_FILE))
            old.identity = (st.st_dev, st.st_ino)
        result = _apply(old, sources, plan, effective, staged, fingerprint, dict(manifest_extra or {}))
    finally:
        old.close()
    _write_report(dst, staging, sources.root, result.skipped)
    if os.path.lexists(staging):
        packdir.remove(staging)
    return Updated(result.meta, result.changes, read_bytes, before, result.skipped, compacted)


def _rewrite_manifest(
    old: _OldPack,
    sources: SourceList,
    options: PackOptions,
    fingerprint: dict[str, Any],
    manifest_extra: Mapping[str, Any],
) -> Manifest:
    """Put a manifest with this source's description into the pack, in one transaction;
    the samples, their tables and the pack id stay as they are."""
    meta = old.meta.described(
        source=sources.describe(), fingerprint=fingerprint, params=options.params(), extra=manifest_extra
    )
    tables: dict[bytes, Any] = {META_KEY: meta.to_json()}
    check_manifest_size(tables[META_KEY], sources.root)
    covered = {key: old.value_of(key) for key in old.check if key != META_KEY}
    tables[CHECK_KEY] = encode_check({**covered, META_KEY: tables[META_KEY]})
    _commit(old, [], [], tables)
    return meta


def _finish_up(dst: str, staging: str, old: _OldPack) -> None:
    """An update that finds nothing to do: remove a staging folder an interrupted one
    left (its transaction had committed), and write ``skipped.txt`` again."""
    items = [(str(item.get("path")), str(item.get("reason", ""))) for item in old.skipped.values()]
    source = old.meta.source_record
    root = source.root or "" if source is not None else ""
    _write_report(dst, staging, root, items)
    if os.path.lexists(staging):
        packdir.remove(staging)


def _check_staging(staging: str) -> None:
    """OutputExistsError unless ``staging`` is missing or provably ours (``packdir``: a real
    folder holding only files an update writes, no link, no FIFO)."""
    if os.path.lexists(staging):
        packdir.check_replaceable(staging, hint=f"it is in the way of the update's staging folder: remove {staging}")


def _write_report(dst: str, staging: str, root: str, skipped: Sequence[tuple[str, str]]) -> None:
    """``<dst>/skipped.txt`` for the new version: written in the staging folder (ours, so
    a kill leaves nothing foreign in ``dst``), then renamed into place."""
    path = os.path.join(dst, SKIPPED_REPORT)
    if not skipped:
        if os.path.exists(path):
            os.remove(path)
        return
    os.makedirs(staging, exist_ok=True)
    tmp = os.path.join(staging, SKIPPED_REPORT)
    if os.path.lexists(tmp):
        os.remove(tmp)  # a report of an interrupted run (a link is removed, never followed)
    # A new file (O_EXCL never follows a link): what is renamed into the pack is what was written here.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with open(fd, "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write(
            f"# {plural(len(skipped), 'source file')} not packed (path<TAB>reason), relative to {root}\n"
            "# a backslash, tab, newline or carriage return in a path or reason is written as \\\\, \\t, \\n, \\r\n"
        )
        for p, reason in skipped:
            f.write(f"{escape_field(p)}\t{escape_field(reason)}\n")
    os.replace(tmp, path)


def _compact_if_sparse(dst: str) -> bool:
    """Compact the pack an update is about to change when half of it is free pages
    (``COMPACT_FREE_FRACTION``): LMDB's compacting copy of its current version, renamed
    over ``data.mdb`` (a process that has the old file mapped keeps reading it)."""
    from lmdbfolder.write.output import _compact_if_needed

    if not _compact_if_needed(dst, free_fraction=COMPACT_FREE_FRACTION):
        return False
    packdir.fsync_path(dst)
    return True

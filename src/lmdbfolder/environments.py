"""Opening a finished pack's ``data.mdb`` for reading, and its checked tables.

Every read of a finished pack goes through ``lmdbfolder.pagefile.PageFile``
(its own read-only map, every page checked; docs/design.md, "Integrity"), not
through py-lmdb, whose reads can be killed by SIGBUS on a damaged file. That
also ends the rules py-lmdb imposed on readers (one environment per path and
process, never used across ``fork()``): a ``PageFile`` is a plain file map,
so every reader opens its own, in every process, and nothing needs a lock file.

This module turns a pack directory into a ``PageFile`` (``open_data``: a
file that is not an LMDB, or is truncated, is a NotAPackError naming the
pack) and reads its tables with every check a reader relies on
(``load_tables``): the manifest (size and nesting bounded), the format-2 table
checksums (``__check__``) over the manifest and the label table, labels that
are class indices, and the identity of the pack (its ``pack_id``, or a digest
of a format-1 manifest) that a worker process compares with what its parent
opened. The write side uses ``read_manifest``/``read_tables``.
"""

from __future__ import annotations

import array
import hashlib
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from lmdbfolder.errors import FormatVersionError, NotAPackError, PackChangedError, os_hint
from lmdbfolder.format import (
    CHECK_KEY,
    DAMAGED_HINT,
    DATA_FILE,
    HISTORY_KEY,
    LABELS_KEY,
    LEGACY_KEYS,
    LEGACY_META_FILES,
    META_KEY,
    ORDER_KEY,
    PATHS_KEY,
    SKIPPED_KEY,
    STATS_KEY,
    Manifest,
    check_labels,
    check_paths,
    check_table,
    decode_check,
    decode_history,
    decode_labels,
    decode_meta,
    decode_skipped,
    label_values,
    order_values,
    stats_values,
)
from lmdbfolder.pagefile import PageDamage, PageFile

__all__ = [
    "open_data",
    "open_version",
    "refuse_foreign",
    "PackTables",
    "load_tables",
    "labels_table",
    "class_counts",
    "paths_table",
    "order_table",
    "stats_table",
    "history_items",
    "skipped_items",
    "read_skipped",
    "read_value",
    "read_manifest",
    "read_tables",
]


def open_data(path: str, readahead: bool = True, *, previous: bool = False) -> PageFile:
    """The ``PageFile`` of the pack directory ``path`` (absolute); with ``previous``, of
    the version before the current one (``PageFile``'s ``previous``).

    Raises NotAPackError if ``data.mdb`` is missing, not an LMDB (0.9) file,
    or truncated.
    """
    data = os.path.join(path, DATA_FILE)
    try:
        return PageFile(data, readahead=readahead, previous=previous)
    except PageDamage as exc:
        if exc.kind == "format":
            raise NotAPackError(path, f"{DATA_FILE} is not an LMDB file ({exc.why})") from None
        if exc.kind == "truncated":
            raise NotAPackError(
                path,
                f"{DATA_FILE} is truncated: {exc.why.removeprefix('it is truncated: ')}",
                "the file was cut short (an interrupted copy?): copy it again with `lmdbfolder copy`, or repack it",
            ) from None
        raise NotAPackError(path, f"{DATA_FILE} is damaged: {exc.why}", DAMAGED_HINT) from None
    except OSError as exc:
        raise NotAPackError(path, f"cannot read {DATA_FILE} ({exc.strerror})", os_hint(exc)) from None


def refuse_foreign(path: str, pf: PageFile) -> None:
    """Raise NotAPackError for an LMDB without a manifest that a recipe made, naming the conversion."""
    recipe = None
    if any(os.path.exists(os.path.join(path, name)) for name in LEGACY_META_FILES):
        recipe = "a BasicSR-style image LMDB (meta_info beside data.mdb)"
    elif any(read_value(pf, key, path) is not None for key in LEGACY_KEYS):
        recipe = "a folder2lmdb-style LMDB (pickled samples with __len__/__keys__)"
    if recipe is not None:
        raise NotAPackError(
            path,
            f"it is {recipe}, not an lmdbfolder pack",
            f"convert it with `lmdbfolder import {path} NEW` (pickles are read safely), then use NEW",
        )


def read_value(pf: PageFile, key: bytes, where: str) -> memoryview | None:
    """The value of a reserved key (a table), or None; NotAPackError when the pages on the way are damaged."""
    try:
        return pf.get(key)
    except PageDamage as exc:
        raise NotAPackError(where, f"its {key.decode()} table cannot be read: {exc.why}", DAMAGED_HINT) from None


def _required(pf: PageFile, key: bytes, where: str, what: str) -> memoryview:
    value = read_value(pf, key, where)
    if value is None:
        raise NotAPackError(where, f"its {what} (key {key.decode()}) is missing", DAMAGED_HINT)
    return value


@dataclass(frozen=True)
class PackTables:
    """What a reader needs of a pack before its first record, every part checked."""

    meta: Manifest
    #: Samples per class index (the label table's counts), from the check at open.
    class_counts: np.ndarray
    #: Format 2: what every record's CRC is bound to (the pack id); None for format 1.
    binding: bytes | None
    #: Format 2: the parsed ``__check__``; None for format 1.
    check: dict[bytes, tuple[int, int]] | None
    #: Names this pack among all others: its ``pack_id`` (format 2), or the
    #: SHA-256 of its manifest (format 1).
    identity: str
    #: SHA-256 of the manifest's bytes: the same bytes are the same pack, so a
    #: process reopening the file need not parse the manifest again.
    manifest_sha256: bytes
    #: Format 3 with ``record_classes``: header label -> sample label
    #: (``format.label_map``; -2 for a class the pack no longer has). None: the same.
    label_map: np.ndarray | None = None

    @property
    def ordered(self) -> bool:
        """Whether sample ``i`` is the record under key ``__order__[i]`` (format 3), not key ``i``."""
        return self.version >= 3

    @property
    def version(self) -> int:
        """The pack's format version."""
        return self.meta.format_version


def identity_of(pf: PageFile, where: str, known: PackTables | None = None) -> str:
    """The identity ``load_tables`` gives the pack in ``pf``, read again (cheaply: the manifest only).

    With ``known`` (the tables read before), a manifest of the same bytes
    gives ``known.identity`` without being parsed again: a DataLoader worker
    opening each shard of a sharded pack parsed every shard's manifest twice.
    """
    blob = _required(pf, META_KEY, where, "manifest")
    digest = hashlib.sha256(blob).digest()
    if known is not None and digest == known.manifest_sha256:
        return known.identity
    return decode_meta(blob, where=where).identity(digest)


def open_version(
    path: str,
    identity: str,
    readahead: bool = True,
    known: PackTables | None = None,
    manifest_sha256: str | None = None,
) -> PageFile:
    """The ``PageFile`` of the version ``identity`` (a ``PackTables.identity``) of the pack
    at ``path``: the current one, or the one before it.

    ``pack --update`` changes a pack in one LMDB transaction, which leaves the
    version before it intact (its pages are not reused before the commit after
    next, see ``PageFile.committed_txnid``) and LMDB keeps its meta page: so a
    dataset opened before one update reads the version it opened in every
    process it starts, and a sharded pack whose shards were updated but whose
    index was not yet rewritten reads as the old version. Raises
    PackChangedError when neither is ``identity`` (replaced, or updated
    twice), NotAPackError for a file that is not a pack.

    ``manifest_sha256`` (hex; a sharded pack's index has it) prefers, of two
    versions with that identity, the one with that manifest: an update that
    changes only a shard's manifest (its place in the split) keeps its id.
    """
    pf = open_data(path, readahead)
    try:
        found = identity_of(pf, path, known)
    except BaseException:
        pf.close()
        raise
    if found == identity and (manifest_sha256 is None or _manifest_digest(pf, path) == manifest_sha256):
        return pf
    try:
        previous: PageFile | None = open_data(path, readahead, previous=True)
    except NotAPackError:
        previous = None
    if previous is not None:
        try:
            before = identity_of(previous, path, known)
        except NotAPackError:  # the commit before an update's holds no manifest (an unfinished pack's batch)
            before = None
        usable = before == identity and previous.committed_txnid() <= previous.txnid + 1
        if usable and (found != identity or _manifest_digest(previous, path) == manifest_sha256):
            pf.close()
            return previous
        previous.close()
    if found == identity:
        return pf  # the id matches, the manifest does not: the caller (verify) says so
    pf.close()
    raise PackChangedError(
        path,
        f"was replaced since this dataset was opened (it was pack {identity}, it is now pack {found}: "
        "repacked, updated with `lmdbfolder pack --update` more than once, or copied over); "
        "reading on would mix samples of two versions",
    )


def _manifest_digest(pf: PageFile, where: str) -> str:
    return hashlib.sha256(_required(pf, META_KEY, where, "manifest")).hexdigest()


def load_tables(pf: PageFile, where: str) -> PackTables:
    """Read and check the manifest and the label table of the pack in ``pf``.

    Checks: the manifest (``decode_meta``); for format 2, ``__check__`` and
    the manifest's and label table's length and CRC-32 against it, and that
    the path table has the length it gives; the label table's length (4 x
    count) and that every label is -1 or a class index. NotAPackError names
    what is wrong. The path table is checked when first used (``paths_table``).
    """
    meta_blob = read_value(pf, META_KEY, where)
    if meta_blob is None:
        refuse_foreign(where, pf)  # a recipe's LMDB: say how to convert it
    check_blob = read_value(pf, CHECK_KEY, where)
    check = None
    if check_blob is not None and meta_blob is not None:
        # Checked before the manifest is parsed: a damaged one is said to be
        # damaged, not "invalid". Unless it names a newer format version: a
        # newer writer may mean something else by __check__, and "upgrade"
        # is the answer then (decode_meta raises FormatVersionError).
        check = decode_check(check_blob, where=where)
        try:
            check_table(check, META_KEY, meta_blob, where=where)
        except NotAPackError as damaged:
            try:
                decode_meta(meta_blob, where=where)
            except FormatVersionError:
                raise
            except NotAPackError:
                pass
            raise damaged from None
    meta = decode_meta(meta_blob, where=where)
    if meta_blob is None:  # decode_meta refuses a missing manifest; this tells the type checker
        raise NotAPackError(where, "it has no manifest")
    if meta.format_version >= 2 and check is None:
        check = decode_check(None, where=where)  # raises: format 2 has table checksums
    elif meta.format_version < 2:
        check = None
    labels_blob = _required(pf, LABELS_KEY, where, "label table")
    if check is not None:
        check_table(check, LABELS_KEY, labels_blob, where=where)
    # Checked and counted in place: the copy (labels_table) is made when a
    # caller asks for it, which opening a dataset does not (its first-touch page
    # faults were half of LMDBFolder's open at 1.28M samples).
    labels = label_values(labels_blob, meta.count, where=where)
    check_labels(labels, len(meta.classes), where=where)
    counts = class_counts(labels, len(meta.classes))
    del labels
    try:
        found = pf.locate(PATHS_KEY)
    except PageDamage as exc:
        raise NotAPackError(where, f"its {PATHS_KEY.decode()} table cannot be read: {exc.why}", DAMAGED_HINT) from None
    if found is None:
        raise NotAPackError(where, f"its path table (key {PATHS_KEY.decode()}) is missing", DAMAGED_HINT)
    if check is not None and PATHS_KEY in check and found[1] != check[PATHS_KEY][0]:
        raise NotAPackError(where, f"its {PATHS_KEY.decode()} table has the wrong length", DAMAGED_HINT)
    if meta.format_version >= 3:
        _order_blob(pf, check, meta.count, where)  # the record keys: present, of the right length
    digest = hashlib.sha256(meta_blob).digest()
    mapping = meta.label_map
    return PackTables(
        meta,
        counts,
        meta.binding,
        check,
        meta.identity(digest),
        digest,
        None if mapping is None else np.asarray(mapping, dtype=np.int64),
    )


def _order_blob(pf: PageFile, check: dict[bytes, tuple[int, int]] | None, count: int, where: str) -> memoryview:
    blob = _required(pf, ORDER_KEY, where, "record order")
    if check is None or ORDER_KEY not in check:
        raise NotAPackError(where, f"its table checksums do not cover {ORDER_KEY.decode()}", DAMAGED_HINT)
    if len(blob) != check[ORDER_KEY][0]:
        raise NotAPackError(where, f"its {ORDER_KEY.decode()} table has the wrong length", DAMAGED_HINT)
    order_values(blob, count, where=where)
    return blob


def order_table(pf: PageFile, tables: PackTables, where: str) -> np.ndarray:
    """Format 3: the record key of every sample (a zero-copy u64 view of ``pf``'s map),
    checked against ``__check__``."""
    blob = _order_blob(pf, tables.check, tables.meta.count, where)
    if tables.check is not None:
        check_table(tables.check, ORDER_KEY, blob, where=where)
    return order_values(blob, tables.meta.count, where=where)  # type: ignore[no-any-return]


def labels_table(pf: PageFile, tables: PackTables, where: str) -> array.array:
    """The label table as a compact ``array('i')`` (a copy), checked again: against
    ``__check__`` for format 2 (the bytes ``load_tables`` checked), every label
    for format 1."""
    blob = _required(pf, LABELS_KEY, where, "label table")
    if tables.check is not None:
        check_table(tables.check, LABELS_KEY, blob, where=where)
    labels = decode_labels(blob, tables.meta.count, where=where)
    if tables.check is None:
        check_labels(labels, len(tables.meta.classes), where=where)
    return labels


def class_counts(labels: Any, classes: int) -> np.ndarray:
    """Samples per class index ``0..classes-1`` of int32 labels (any buffer);
    labels outside that range are not counted.

    Labels sorted by class (every ImageFolder pack) are counted by binary
    search: under 1 ms at 1.28M samples. Work goes in chunks, so temporaries
    stay under a megabyte whatever the count (``bincount`` alone would make
    an 8-byte copy of every label).
    """
    values = labels if isinstance(labels, np.ndarray) else np.frombuffer(labels, dtype=np.int32)
    n = len(values)
    if n and values[0] >= 0 and values[-1] < classes and _is_sorted(values):
        edges = np.searchsorted(values, np.arange(classes + 1, dtype=values.dtype), side="left")
        return np.diff(edges)
    counts = np.zeros(classes, dtype=np.int64)
    for start in range(0, n, _CHUNK):
        chunk = values[start : start + _CHUNK]
        chunk = chunk[(chunk >= 0) & (chunk < classes)]
        counts += np.bincount(chunk, minlength=classes)[:classes]
    return counts


def _is_sorted(values: np.ndarray) -> bool:
    n = len(values)
    return all(
        bool(np.all(values[start + 1 : start + _CHUNK + 1] >= values[start : min(n - 1, start + _CHUNK)]))
        for start in range(0, n - 1, _CHUNK)
    )


_CHUNK = 1 << 15


def paths_table(pf: PageFile, tables: PackTables, where: str) -> memoryview:
    """The path table, checked (against ``__check__`` for format 2, and its offsets)."""
    blob = _required(pf, PATHS_KEY, where, "path table")
    if tables.check is not None:
        check_table(tables.check, PATHS_KEY, blob, where=where)
    check_paths(blob, tables.meta.count, where=where)
    return blob


def _optional_table(pf: PageFile, tables: PackTables, key: bytes, where: str) -> memoryview | None:
    """An optional table (``__stats__``, ``__history__``): None when the pack has none
    (its ``__check__`` does not name it), checked against ``__check__`` otherwise."""
    if tables.check is None or key not in tables.check:
        return None
    blob = _required(pf, key, where, f"{key.decode()} table")
    check_table(tables.check, key, blob, where=where)
    return blob


def stats_table(pf: PageFile, tables: PackTables, where: str) -> np.ndarray | None:
    """The size and modification time each sample's source file had when it was read
    (a zero-copy view with fields ``size`` and ``mtime_ns``), or None for a pack
    without them (written before they were recorded, or by ``import``)."""
    blob = _optional_table(pf, tables, STATS_KEY, where)
    return None if blob is None else stats_values(blob, tables.meta.count, where=where)  # type: ignore[no-any-return]


def history_items(pf: PageFile, tables: PackTables, where: str) -> list[dict[str, Any]]:
    """The pack's history (``__history__``: the pack, then each update), oldest first;
    [] for a pack without one."""
    blob = _optional_table(pf, tables, HISTORY_KEY, where)
    return [] if blob is None else decode_history(blob, where=where)


def skipped_items(pf: PageFile, tables: PackTables, where: str) -> list[dict[str, Any]] | str:
    """The source files the writer left out (``{path, reason}``), or ``"invalid"``.

    Format 2 keeps them in ``__skipped__`` (checked against ``__check__``);
    format 1 in the manifest.
    """
    if tables.version < 2:
        items = tables.meta.shown.skipped
        return [] if items is None else items if isinstance(items, list) else str(items)
    blob = read_value(pf, SKIPPED_KEY, where)
    if tables.check is None or SKIPPED_KEY not in tables.check:
        return []
    if blob is None:
        raise NotAPackError(where, f"its list of skipped files (key {SKIPPED_KEY.decode()}) is missing", DAMAGED_HINT)
    check_table(tables.check, SKIPPED_KEY, blob, where=where)
    return decode_skipped(blob, where=where)


def read_skipped(path: str) -> list[dict[str, Any]]:
    """The source files the finished pack at ``path`` left out (``{path, reason}``),
    from ``__skipped__`` (format 2) or the manifest (format 1); NotAPackError if unreadable."""
    pf = open_data(path, readahead=False)
    try:
        items = skipped_items(pf, load_tables(pf, path), path)
    finally:
        pf.close()
    return items if isinstance(items, list) else []


def read_manifest(path: str) -> bytes | None:
    """The stored manifest (``__meta__``) of the pack at ``path``, or None if it has none."""
    pf = open_data(path, readahead=False)
    try:
        blob = read_value(pf, META_KEY, path)
        return None if blob is None else bytes(blob)
    finally:
        pf.close()


def read_tables(path: str) -> tuple[bytes, bytes, bytes]:
    """The manifest, label table and path table of the pack at ``path``, as stored.

    Raises NotAPackError naming the missing or unreadable one. (Format 2: each
    is checked against ``__check__`` too.)
    """
    pf = open_data(path, readahead=False)
    try:
        blobs = [_required(pf, key, path, f"{key.decode()} table") for key in (META_KEY, LABELS_KEY, PATHS_KEY)]
        meta = decode_meta(blobs[0], where=path)
        if meta.format_version >= 2:
            check = decode_check(read_value(pf, CHECK_KEY, path), where=path)
            for key, blob in zip((META_KEY, LABELS_KEY, PATHS_KEY), blobs):
                check_table(check, key, blob, where=path)
        return bytes(blobs[0]), bytes(blobs[1]), bytes(blobs[2])
    finally:
        pf.close()

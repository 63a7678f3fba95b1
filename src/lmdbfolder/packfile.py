"""A pack opened on a ``PageFile``: its ``data.mdb`` mapped for reading, its tables loaded.

Every read of a finished pack goes through ``lmdbfolder.pagefile.PageFile``
(its own read-only map, every page checked; docs/design.md, "Integrity"), not
through py-lmdb, whose reads can be killed by SIGBUS on a damaged file. That
also ends the rules py-lmdb imposed on readers (one environment per path and
process, never used across ``fork()``): a ``PageFile`` is a plain file map,
so every reader opens its own, in every process, and nothing needs a lock file.

This module turns a pack directory into a ``PageFile`` (``open_data``: a
file that is not an LMDB, or is truncated, is a NotAPackError naming the
pack), finds the version of it a dataset opened (``open_version``), and gives
the format's ``PackTables`` their bytes (``PackSource``; ``load_tables``: the
manifest, ``__check__``, the label table, and the identity of the pack that a
worker process compares with what its parent opened). The rules the tables
obey are the format's (``format.tables``); this module adds only where the
bytes come from and what a damaged page on the way means. The write side
uses ``read_manifest``/``read_tables``.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from lmdbfolder.errors import NotAPackError, PackChangedError, os_hint
from lmdbfolder.format import (
    CHECK_KEY,
    DAMAGED_HINT,
    DATA_FILE,
    LABELS_KEY,
    LEGACY_KEYS,
    LEGACY_META_FILES,
    META_KEY,
    PATHS_KEY,
    RETAINED_FILE,
    check_table,
    decode_check,
    decode_meta,
)
from lmdbfolder.format.tables import PackTables, TableDamage, class_counts, identity
from lmdbfolder.pagefile import PageDamage, PageFile

__all__ = [
    "open_data",
    "open_version",
    "refuse_foreign",
    "PackSource",
    "PackTables",
    "load_tables",
    "class_counts",
    "read_skipped",
    "read_value",
    "read_manifest",
    "read_tables",
]


def open_data(path: str, readahead: bool = True, *, previous: bool = False, name: str = DATA_FILE) -> PageFile:
    """The ``PageFile`` of the pack directory ``path`` (absolute); with ``previous``, of
    the version before the current one (``PageFile``'s ``previous``); ``name``: the
    file in it (``data.mdb``, or a shard's ``RETAINED_FILE``).

    Raises NotAPackError if ``data.mdb`` is missing, not an LMDB (0.9) file,
    or truncated.
    """
    data = os.path.join(path, name)
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
        raise TableDamage(where, f"its {key.decode()} table cannot be read: {exc.why}", DAMAGED_HINT) from None


class PackSource:
    """The tables of the pack in ``pf`` as the format reads them (``format.TableSource``):
    a damaged page on the way to one is a NotAPackError naming the table."""

    def __init__(self, pf: PageFile, where: str) -> None:
        self.pf = pf
        self.where = where

    def get(self, key: bytes) -> memoryview | None:
        """The value of ``key`` (zero-copy), or None."""
        return read_value(self.pf, key, self.where)

    def size(self, key: bytes) -> int | None:
        """The length of ``key``'s value, found without touching its pages."""
        try:
            found = self.pf.locate(key)
        except PageDamage as exc:
            raise TableDamage(self.where, f"its {key.decode()} table cannot be read: {exc.why}", DAMAGED_HINT) from None
        return None if found is None else int(found[1])


def _required(pf: PageFile, key: bytes, where: str, what: str) -> memoryview:
    value = read_value(pf, key, where)
    if value is None:
        raise NotAPackError(where, f"its {what} (key {key.decode()}) is missing", DAMAGED_HINT)
    return value


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
    return identity(decode_meta(blob, where=where), digest)


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
    retained = _open_retained(path, identity, readahead, known, manifest_sha256)
    if retained is not None:
        pf.close()
        return retained
    if found == identity:
        return pf  # the id matches, the manifest does not: the caller (verify) says so
    pf.close()
    raise PackChangedError(
        path,
        f"was replaced since this dataset was opened (it was pack {identity}, it is now pack {found}: "
        "repacked, updated with `lmdbfolder pack --update` more than once, or copied over); "
        "reading on would mix samples of two versions",
    )


def _open_retained(
    path: str, identity: str, readahead: bool, known: PackTables | None, manifest_sha256: str | None
) -> PageFile | None:
    """The version ``identity`` from the shard's ``RETAINED_FILE`` (its current or previous
    one, with that manifest when ``manifest_sha256`` is given), or None.

    A sharded update that changes a shard whose index still names the version before
    its current one (an earlier run was interrupted before the new index) keeps the
    file as it was under that name until the new index is in place."""
    if not os.path.isfile(os.path.join(path, RETAINED_FILE)):
        return None
    for previous in (False, True):
        try:
            pf = open_data(path, readahead, previous=previous, name=RETAINED_FILE)
        except NotAPackError:
            continue
        try:
            usable = identity_of(pf, path, known) == identity and pf.committed_txnid() <= pf.txnid + 1
            if usable and (manifest_sha256 is None or _manifest_digest(pf, path) == manifest_sha256):
                return pf
        except NotAPackError:
            pass
        pf.close()
    return None


def _manifest_digest(pf: PageFile, where: str) -> str:
    return hashlib.sha256(_required(pf, META_KEY, where, "manifest")).hexdigest()


def load_tables(pf: PageFile, where: str) -> PackTables:
    """Read and check the tables a reader needs at open (``PackTables.load``) of the pack in
    ``pf``: a recipe's LMDB without a manifest is named, with how to convert it."""
    source = PackSource(pf, where)
    meta_blob = source.get(META_KEY)
    if meta_blob is None:
        refuse_foreign(where, pf)  # a recipe's LMDB: say how to convert it
        decode_meta(None, where=where)  # raises: "it has no manifest"
        raise NotAPackError(where, "it has no manifest")  # not reached; tells the type checker
    return PackTables.load(source, meta_blob)


def read_skipped(path: str) -> list[dict[str, Any]]:
    """The source files the finished pack at ``path`` left out (``{path, reason}``),
    from ``__skipped__`` (format 2) or the manifest (format 1); NotAPackError if unreadable."""
    pf = open_data(path, readahead=False)
    try:
        items = load_tables(pf, path).skipped(PackSource(pf, path))
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

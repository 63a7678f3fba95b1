"""Read a single pack: lazily, read-only, lock-free, once per process, fork- and spawn-safe,
and safely: no damage to the pack can kill the process (docs/design.md, "Integrity").

Rules this module enforces (see docs/design.md, "Opening a pack"):

* Every read goes through ``lmdbfolder.pagefile.PageFile`` (opened by
  ``lmdbfolder.packfile``): the pack's own read-only map, every page
  checked before it is used, never py-lmdb. A damaged record raises
  ``CorruptRecordError`` naming its index, original path and the pack;
  every other record stays readable.
* The map is opened on first use in each process. The constructor reads
  and checks the tables and closes it again, so a parent process that never
  reads a sample holds nothing open when it starts its workers.
* Each (re)opening in a new process opens the version the tables were read
  from (``pack_id``, or a digest of a format-1 manifest): the current one,
  or, after one ``pack --update``, the one before it, which an update leaves
  intact (``packfile.open_version``). A pack replaced (or updated twice)
  under a live dataset raises PackChangedError in the worker instead of
  mixing two versions.
* After every read, a process checks that no second transaction has
  committed since the version it reads (``PageFile.committed_txnid``): from
  then on LMDB may reuse that version's pages, so it raises PackChangedError
  instead of returning what it read.
* Format 3 (an updated pack): sample ``i`` is the record under key
  ``__order__[i]`` (its CRC bound to that key), and a record header's label
  names a class of ``record_classes`` (mapped to the sample's label here).
* ``Reader`` pickles without any handle (``__getstate__``), so it can be sent
  to spawned DataLoader workers.

A sharded pack is read by ``lmdbfolder.read.sharded.ShardedReader``;
``lmdbfolder.read.opening.open_pack`` opens either.
"""

from __future__ import annotations

import array
import ctypes
import ctypes.util
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
from PIL import Image

from lmdbfolder import packdir, packfile
from lmdbfolder.encodings import decode_hint, encoding_of
from lmdbfolder.errors import CorruptRecordError, DecodeError, LmdbFolderError, NotAPackError, PackChangedError
from lmdbfolder.format import (
    KEY,
    LABELS_KEY,
    META_KEY,
    NO_LABEL,
    Manifest,
    ShardIndex,
    decode_paths,
    decode_record,
    path_at,
)
from lmdbfolder.pagefile import PageDamage, PageFile

__all__ = ["Record", "Reader", "PackAPI", "PREFETCH_GAP"]

#: Records closer than this in the file are prefetched with one request.
PREFETCH_GAP = 64 << 10
_PAGE = 4096


@dataclass(frozen=True, slots=True)
class Record:
    """One stored sample. ``payload`` is a zero-copy view into the memory map,
    valid until the Reader that returned it is closed."""

    index: int
    label: int
    encoding: str
    width: int
    height: int
    channels: int
    payload: memoryview


class PackAPI:
    """What every reader offers on top of its own ``meta``, ``get``, ``paths``,
    ``labels``, ``path_of`` and ``close``: derived metadata and conveniences.

    ``Reader`` and ``ShardedReader`` both provide it (each keeps its own
    state; nothing here touches a handle).
    """

    #: The manifest (``Reader``) or the index (``ShardedReader``): typed, and a
    #: read-only mapping of its JSON object.
    meta: Manifest | ShardIndex
    path: str

    def __len__(self) -> int:
        raise NotImplementedError

    def get(self, index: int) -> Record:
        """Return sample ``index``."""
        raise NotImplementedError

    def paths(self) -> list[str]:
        """Original relative paths of all samples, in index order."""
        raise NotImplementedError

    def path_of(self, index: int) -> str:
        """Original relative path of sample ``index``."""
        raise NotImplementedError

    def close(self) -> None:
        """Release this process's handles."""
        raise NotImplementedError

    def class_counts(self) -> np.ndarray:
        """Samples per class index (``len(classes)`` counts)."""
        raise NotImplementedError

    @property
    def classes(self) -> list[str]:
        """Class names, index = label."""
        return list(self.meta.classes)

    @property
    def class_to_idx(self) -> dict[str, int]:
        """Class name -> label."""
        return dict(self.meta.class_to_idx)

    @property
    def store(self) -> str:
        """``"encoded"`` (original file bytes) or ``"raw"`` (RGB pixels)."""
        return str(self.meta.store)

    def index_of(self, relpath: str) -> int:
        """Index of the sample packed from ``relpath`` (first one, if listed twice).

        Builds a path -> index table on first use (kept in this process only).
        Raises KeyError if no sample has that path.
        """
        table = self.__dict__.get("_index_by_path")
        if table is None:
            table = {}
            for i, p in enumerate(self.paths()):
                table.setdefault(p, i)
            self.__dict__["_index_by_path"] = table
        try:
            return table[relpath]
        except KeyError:
            raise KeyError(f"no sample was packed from {relpath!r} in {self.path}") from None

    def read_bytes(self, index: int) -> bytes:
        """The stored payload of sample ``index`` as an independent ``bytes`` copy."""
        return bytes(self.get(index).payload)

    def image(self, index: int) -> Image.Image:
        """Sample ``index`` decoded to an RGB ``PIL.Image``, exactly as ImageFolder loads it
        (DecodeError when it does not decode, or its header is one its payload denies:
        ``Encoding.check``)."""
        rec = self.get(index)
        try:
            enc = encoding_of(rec.encoding)
            enc.check(rec.payload, rec.width, rec.height, rec.channels)
            return enc.expect(enc.decode_rgb(rec.payload, rec.width, rec.height), rec.width, rec.height)
        except Exception as exc:  # Pillow raises many exception types for bad data
            hint = decode_hint(exc)
            raise DecodeError(rec.index, self.path_of(rec.index), f"{type(exc).__name__}: {exc}", hint) from exc

    def __iter__(self) -> Iterator[Record]:
        for i in range(len(self)):
            yield self.get(i)

    def _check_index(self, index: int) -> int:
        try:
            i = index.__index__()
        except AttributeError:
            raise TypeError(f"sample index must be an integer, got {type(index).__name__}") from None
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {index} is out of range for {self.path} ({n} samples)")
        return i

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Reader(PackAPI):
    """Random access to the samples of a single pack.

    Args:
        path: the pack directory (or its ``data.mdb``). A sharded pack (a
            directory holding ``index.json``) is opened with
            ``lmdbfolder.open_pack`` instead, which returns a ``ShardedReader``
            with the same API.
        readahead: let the kernel read ahead around each access. True suits
            image-sized records (cold random reads of ~100 KB records are
            several times faster); set False for tiny records larger than RAM.
        verify_checksums: check every record's CRC-32 on read (default;
            CorruptRecordError on mismatch). In a format-2 pack the CRC also
            binds the record to its index and to the pack, so a record found
            in the wrong place fails it too. It costs about 0.3 % of a JPEG
            decode (docs/design.md, "Integrity"); False skips it.

        pack_id: open this version of the pack (format 2 and 3): the current
            one, or the one before it while ``pack --update`` has changed the
            pack once since (a sharded pack's index names its shards' ids);
            PackChangedError when it is neither. ``manifest_sha256`` (hex)
            prefers, of two versions with that id, the one with that manifest.

    The constructor reads and checks the manifest, the label table and (format
    2) the table checksums, then closes the file again; samples are read
    through a lazily opened, per-process map. A pack that is damaged where a
    record is stored raises CorruptRecordError for that record only.

    A Reader reads the version of the pack it opened, in every process: after
    one ``pack --update`` (which changes the pack in place, in one
    transaction) it still reads the version before it; after a second one, or
    when the pack was replaced (``--overwrite``, a copy), it raises
    PackChangedError. To read the new version, open the pack again.

    Example:
        >>> from lmdbfolder import Reader
        >>> with Reader("train.lmdb") as r:  # doctest: +SKIP
        ...     rec = r.get(0)
        ...     print(len(r), r.classes[rec.label], rec.encoding, rec.width, rec.height)
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        readahead: bool = True,
        verify_checksums: bool = True,
        pack_id: str | None = None,
        manifest_sha256: str | None = None,
    ) -> None:
        found = packdir.require_pack(path)
        if found.kind is packdir.Kind.SHARDED:
            raise NotAPackError(
                found.path,
                "it is a sharded pack, not a single one",
                "open it with `lmdbfolder.open_pack(path)` (a ShardedReader with the same API)",
            )
        self.path = found.path
        self.readahead = readahead
        self.verify_checksums = verify_checksums
        if pack_id is None:
            pf = packfile.open_data(self.path, readahead)
        else:
            pf = packfile.open_version(self.path, pack_id, readahead, manifest_sha256=manifest_sha256)
        try:
            tables = packfile.load_tables(pf, self.path)
        finally:
            pf.close()
        self.meta: Manifest = tables.meta
        self._tables = tables
        self._labels: array.array | None = None  # copied from the pack when first asked for
        self._binding = tables.binding
        self._count: int = self.meta.count
        # Format 4: the number of fields each record holds (its payload is their offsets
        # and bytes: ``format.split_field_payloads``); None for one image per record.
        specs = self.meta.field_specs
        self._fields: int | None = len(specs) if specs is not None else None
        self._reset_handles()

    def _reset_handles(self) -> None:
        self._pid: int | None = None
        self._pf: PageFile | None = None
        self._paths: memoryview | None = None
        self._order: np.ndarray | None = None  # format 3: sample -> record key, from this process's map
        self._handle_lock = threading.Lock()

    # -- metadata ------------------------------------------------------------
    def __len__(self) -> int:
        return self._count

    @property
    def labels(self) -> array.array:
        """Label of every sample (a compact ``array('i')``; -1 = unlabelled).

        Read from the pack at first use (opening only checks the table in place).
        """
        if self._labels is None:
            pf = self._file()
            labels = self._tables.labels(packfile.PackSource(pf, self.path))
            self._check_unchanged(pf)
            self._labels = labels
        return self._labels

    def class_counts(self) -> np.ndarray:
        """Samples per class index (``len(classes)`` counts), known since open."""
        return self._tables.class_counts

    @property
    def format_version(self) -> int:
        """The pack's format version (1 packs lack the record-to-index binding)."""
        return self._tables.version

    @property
    def pack_id(self) -> str | None:
        """The pack's random id (format 2), which every record's CRC is bound to; None for format 1."""
        return self.meta.version_pack_id

    @property
    def identity(self) -> str:
        """What names this pack among all others (its ``pack_id``, or a digest of a format-1 manifest)."""
        return self._tables.identity

    def path_of(self, index: int) -> str:
        """Original relative path of sample ``index``."""
        i = self._check_index(index)
        path = path_at(self._paths_blob(), self._count, i)
        self._check_unchanged(self._file())
        return path

    def paths(self) -> list[str]:
        """Original relative paths of all samples, in index order."""
        paths = decode_paths(self._paths_blob(), self._count, where=self.path)
        self._check_unchanged(self._file())
        return paths

    def skipped(self) -> list[dict[str, Any]] | str:
        """The source files the writer left out (``{path, reason}`` dicts), or
        ``"invalid"`` when a format-1 manifest holds something else there."""
        return self._tables.skipped(packfile.PackSource(self._file(), self.path))

    def history(self) -> list[dict[str, Any]]:
        """The pack's history, oldest first: how it was packed, then each ``pack --update``
        (``event``, ``at``, ``pack_id``, ``count``, ``added``, ``removed``, ``changed``,
        ``classes_added``, ...); [] for a pack written before histories were kept."""
        pf = self._file()
        items = self._tables.history(packfile.PackSource(pf, self.path))
        self._check_unchanged(pf)
        return items

    def _paths_blob(self) -> memoryview:
        blob = self._paths
        if blob is None or self._pid != os.getpid():
            pf = self._file()
            blob = self._tables.paths(packfile.PackSource(pf, self.path))  # checked once per process
            self._paths = blob
        return blob

    def _safe_path(self, i: int) -> str | None:
        # For error messages: the path of a damaged record, if the path table can say.
        try:
            return path_at(self._paths_blob(), self._count, i)
        except LmdbFolderError:
            return None

    def tables(self) -> tuple[memoryview, memoryview, memoryview]:
        """The stored manifest, label table and path table: zero-copy views (checked
        against ``__check__`` in a format-2 pack)."""
        pf = self._file()
        meta = packfile.read_value(pf, META_KEY, self.path)
        labels = packfile.read_value(pf, LABELS_KEY, self.path)
        if meta is None or labels is None:
            raise NotAPackError(self.path, "its manifest or label table is missing")
        return meta, labels, self._paths_blob()

    # -- samples ---------------------------------------------------------------
    def get(self, index: int) -> Record:
        """Return sample ``index`` (negative indices count from the end).

        The payload is a memoryview into the map: no copy is made. Use
        ``read_bytes`` for an independent copy.
        """
        i = self._check_index(index)
        pf = self._file()
        record = self._record(i, self._lookup(pf, i), i)
        self._check_unchanged(pf)
        return record

    def get_many(self, indices: Sequence[int], *, prefetch: bool = True) -> list[Record]:
        """The records of ``indices``, in that order (for batch samplers).

        With ``prefetch`` (Linux, macOS), the kernel is asked to start reading
        every record's pages before any of them is touched
        (``madvise(MADV_WILLNEED)`` on the map, neighbouring records merged),
        meant for storage that serves many requests at once (NVMe, network
        block devices). It costs a few microseconds per batch. On the
        development VM it made no measurable difference: the kernel's 8 MB
        readahead already dominates there (docs/design.md).
        """
        return self._get_many([self._check_index(i) for i in indices], prefetch, 0)

    def _get_many(self, idx: list[int], prefetch: bool, offset: int) -> list[Record]:
        # ``offset`` is added to the index each Record reports (a shard's first global index).
        pf = self._file()
        values = [self._lookup(pf, i) for i in idx]
        if prefetch and len(values) > 1:
            self._prefetch(values)
        records = [self._record(i, v, i + offset) for i, v in zip(idx, values)]
        self._check_unchanged(pf)
        return records

    def prefetch(self, indices: Sequence[int]) -> None:
        """Ask the kernel to start reading these records now, without waiting
        (``madvise(MADV_WILLNEED)``): call it with the next batch's indices
        while working on the current one. A no-op where madvise is missing."""
        pf = self._file()
        values = []
        for i in indices:
            try:
                values.append(pf.get(KEY.pack(self._key(self._check_index(i)))))
            except PageDamage:
                continue  # advice only: the read of that record will say what is wrong
        self._prefetch(values)

    def _prefetch(self, values: list[Any]) -> None:
        if _MADVISE is None:
            return
        spans = []
        for v in values:
            if v is not None and len(v):
                start = np.frombuffer(v, np.uint8).__array_interface__["data"][0]
                spans.append((start, start + len(v)))
        spans.sort()
        run_start, run_end = -1, -1
        for start, end in spans:
            if start - run_end > PREFETCH_GAP:
                if run_end > 0:
                    _will_need(run_start, run_end)
                run_start = start
            run_end = max(run_end, end)
        if run_end > 0:
            _will_need(run_start, run_end)

    def _key(self, i: int) -> int:
        """The record key of sample ``i`` (format 3: its ``__order__`` entry; else ``i``)."""
        order = self._order
        return i if order is None else int(order[i])

    def _check_unchanged(self, pf: PageFile) -> None:
        """After a read: PackChangedError unless what was read is the version this process
        opened (at most one transaction has committed to the file since it was mapped)."""
        committed = pf.committed_txnid()
        if committed > pf.txnid + 1:
            raise PackChangedError(
                self.path,
                f"was updated in place more than once since this process opened it (transaction {pf.txnid}, "
                f"now {committed}): the pages of the version it reads may have been reused",
            )

    def _lookup(self, pf: PageFile, i: int) -> memoryview:
        """The stored value of record ``i``; CorruptRecordError (index, path, pack) when it cannot be found."""
        try:
            value = pf.get(KEY.pack(self._key(i)))
            if value is None:
                raise CorruptRecordError(i, "the record is missing from the database")
        except PageDamage as exc:
            raise CorruptRecordError(
                i, f"the database is damaged where it is stored: {exc.why}", self._safe_path(i), self.path, kind="page"
            ) from None
        except CorruptRecordError as exc:
            raise exc.locate(self._safe_path(i), self.path) from None
        return value

    def _record(self, i: int, value: memoryview, reported: int) -> Record:
        # ``i`` is the index in this pack; ``reported`` the one the Record carries.
        try:
            header, payload = decode_record(
                value,
                index=i,
                verify=self.verify_checksums,
                binding=self._binding,
                key=self._key(i),
                fields=self._fields,
            )
        except CorruptRecordError as exc:
            raise exc.locate(self._safe_path(i), self.path) from None
        label = header.label
        mapping = self._tables.label_map
        if mapping is not None and label != NO_LABEL:
            # Format 3: the header names a class of record_classes.
            if not 0 <= label < len(mapping) or mapping[label] < 0:
                raise CorruptRecordError(
                    i,
                    f"its header label {label} names no class of the pack (record_classes)",
                    self._safe_path(i),
                    self.path,
                )
            label = int(mapping[label])
        return Record(reported, label, header.encoding, header.width, header.height, header.channels, payload)

    def raw_items(self) -> Iterator[tuple[bytes, memoryview]]:
        """Every key and stored value in key order (records, then reserved keys).

        For tools that look at the database itself; values are zero-copy
        views. Raises CorruptRecordError at the first damaged page.
        """
        try:
            yield from self._file().items()
        except PageDamage as exc:
            raise CorruptRecordError(
                None, f"the database is damaged: {exc.why}", None, self.path, kind="page"
            ) from None

    def _file(self) -> PageFile:
        # One map per process, shared by its threads (nothing in it changes). In
        # a new process (a forked or spawned worker) it is opened again, and the
        # pack found there must be the one the tables were read from.
        pf = self._pf
        if pf is not None and self._pid == os.getpid():
            return pf
        if self._pid != os.getpid():
            self._reset_handles()  # inherited from the parent: its lock and map are not ours to use
        with self._handle_lock:
            if self._pf is None:
                # The version the tables were read from: the current one, or the
                # one before it after one update (packfile.open_version).
                pf = packfile.open_version(self.path, self._tables.identity, self.readahead, self._tables)
                if self._tables.ordered:
                    try:
                        self._order = self._tables.order(packfile.PackSource(pf, self.path))
                    except BaseException:
                        pf.close()
                        raise
                self._pf = pf
                self._pid = os.getpid()
            return self._pf

    # -- lifetime --------------------------------------------------------------
    def close(self) -> None:
        """Release this process's map. Payload views from ``get`` keep what they show alive."""
        if self._pid == os.getpid() and self._pf is not None:
            self._pf.close()
        self._reset_handles()

    def __enter__(self) -> Reader:
        return self

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_pid", "_pf", "_paths", "_order", "_handle_lock", "_index_by_path"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_handles()

    def __repr__(self) -> str:
        return f"Reader({self.path!r}, count={self._count}, classes={len(self.meta.classes)}, store={self.store!r})"


def _load_madvise() -> Any:
    # madvise(MADV_WILLNEED) on a range of the map starts reading those pages
    # of data.mdb in the background (the kernel's readahead for that range).
    if sys.platform not in ("linux", "darwin"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _load_madvise()
_MADV_WILLNEED = 3  # Linux and macOS


def _will_need(start: int, end: int) -> None:
    aligned = start - start % _PAGE
    _MADVISE(aligned, end - aligned, _MADV_WILLNEED)  # advice only: a failure changes nothing

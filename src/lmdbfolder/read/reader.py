"""Read a single pack: lazily, read-only, lock-free, once per process, fork- and spawn-safe.

Rules this module enforces (see docs/design.md, "Opening an environment"):

* The LMDB environment is opened on first use in each process, through the
  per-process registry of ``lmdbfolder.environments`` (read-only,
  ``lock=False``; a forked child closes what it inherited and opens its own).
* ``Reader`` pickles without any handle (``__getstate__``), so it can be sent
  to spawned DataLoader workers.
* Reading the metadata at construction opens the environment only briefly and
  closes it again, so a parent process that never reads a sample holds nothing
  open when it starts its workers.

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
from typing import Any, Iterator, Sequence, cast

import lmdb
import numpy as np
from PIL import Image

from lmdbfolder import environments, packdir
from lmdbfolder.codecs import decode_rgb
from lmdbfolder.errors import CorruptRecordError, DecodeError, NotAPackError
from lmdbfolder.format import (
    KEY,
    LABELS_KEY,
    LEGACY_KEYS,
    LEGACY_META_FILES,
    META_KEY,
    PATHS_KEY,
    decode_labels,
    decode_meta,
    decode_paths,
    decode_record,
    path_at,
)

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

    meta: dict[str, Any]
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

    @property
    def classes(self) -> list[str]:
        """Class names, index = label."""
        return list(self.meta["classes"])

    @property
    def class_to_idx(self) -> dict[str, int]:
        """Class name -> label."""
        return dict(self.meta["class_to_idx"])

    @property
    def store(self) -> str:
        """``"encoded"`` (original file bytes) or ``"raw"`` (RGB pixels)."""
        return str(self.meta["store"])

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
        """Sample ``index`` decoded to an RGB ``PIL.Image``, exactly as ImageFolder loads it."""
        rec = self.get(index)
        try:
            return decode_rgb(rec.payload, rec.encoding, rec.width, rec.height)
        except Exception as exc:  # Pillow raises many exception types for bad data
            raise DecodeError(rec.index, self.path_of(rec.index), f"{type(exc).__name__}: {exc}") from exc

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
        verify_checksums: check every payload's CRC-32 on read
            (CorruptRecordError on mismatch).

    The constructor reads the manifest and labels and closes the environment
    again; samples are read through a lazily opened, per-process handle.

    Example:
        >>> from lmdbfolder import Reader
        >>> with Reader("train.lmdb") as r:  # doctest: +SKIP
        ...     rec = r.get(0)
        ...     print(len(r), r.classes[rec.label], rec.encoding, rec.width, rec.height)
    """

    def __init__(self, path: str | os.PathLike[str], *, readahead: bool = True, verify_checksums: bool = False) -> None:
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
        env = environments.acquire(self.path, readahead)
        try:
            with env.begin(buffers=True) as txn:
                meta_blob = txn.get(META_KEY)
                if meta_blob is None:
                    _refuse_foreign(self.path, txn)
                self.meta: dict[str, Any] = decode_meta(meta_blob, where=self.path)
                count = self.meta["count"]
                labels_blob = txn.get(LABELS_KEY)
                if labels_blob is None:
                    raise NotAPackError(self.path, "its label table (key __labels__) is missing")
                self._labels = decode_labels(labels_blob, count, where=self.path)
                if txn.get(PATHS_KEY) is None:
                    raise NotAPackError(self.path, "its path table (key __paths__) is missing")
        finally:
            environments.release(self.path)
        self._count: int = count
        self._reset_handles()

    def _reset_handles(self) -> None:
        self._pid: int | None = None
        self._local = threading.local()
        self._txns: list[lmdb.Transaction] = []
        self._handle_lock = threading.Lock()

    # -- metadata ------------------------------------------------------------
    def __len__(self) -> int:
        return self._count

    @property
    def labels(self) -> array.array:
        """Label of every sample (a compact ``array('i')``; -1 = unlabelled)."""
        return self._labels

    def path_of(self, index: int) -> str:
        """Original relative path of sample ``index``."""
        i = self._check_index(index)
        return path_at(self._paths_blob(), self._count, i)

    def paths(self) -> list[str]:
        """Original relative paths of all samples, in index order."""
        return decode_paths(self._paths_blob(), self._count, where=self.path)

    def _paths_blob(self) -> memoryview:
        blob = self._txn().get(PATHS_KEY)
        if blob is None:
            raise NotAPackError(self.path, "its path table (key __paths__) is missing")
        return cast(memoryview, blob)

    def tables(self) -> tuple[memoryview, memoryview, memoryview]:
        """The stored manifest, label table and path table: zero-copy views, valid until ``close()``."""
        txn = self._txn()
        blobs = []
        for key in (META_KEY, LABELS_KEY, PATHS_KEY):
            blob = txn.get(key)
            if blob is None:
                raise NotAPackError(self.path, f"its {key.decode()} table is missing")
            blobs.append(cast(memoryview, blob))
        return blobs[0], blobs[1], blobs[2]

    # -- samples ---------------------------------------------------------------
    def get(self, index: int) -> Record:
        """Return sample ``index`` (negative indices count from the end).

        The payload is a memoryview into the map: no copy is made. It stays
        valid until ``close()``; use ``read_bytes`` for an independent copy.
        """
        i = self._check_index(index)
        return self._record(i, self._txn().get(KEY.pack(i)), i)

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
        txn = self._txn()
        values = [txn.get(KEY.pack(i)) for i in idx]
        if prefetch and len(values) > 1:
            self._prefetch(values)
        return [self._record(i, v, i + offset) for i, v in zip(idx, values)]

    def prefetch(self, indices: Sequence[int]) -> None:
        """Ask the kernel to start reading these records now, without waiting
        (``madvise(MADV_WILLNEED)``): call it with the next batch's indices
        while working on the current one. A no-op where madvise is missing."""
        txn = self._txn()
        self._prefetch([txn.get(KEY.pack(self._check_index(i))) for i in indices])

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

    def _record(self, i: int, value: Any, reported: int) -> Record:
        # ``i`` is the index in this pack; ``reported`` the one the Record carries.
        try:
            if value is None:
                raise CorruptRecordError(i, "the record is missing from the database")
            header, payload = decode_record(value, index=i, verify=self.verify_checksums)
        except CorruptRecordError as exc:
            raise exc.locate(path_at(self._paths_blob(), self._count, i), self.path) from None
        return Record(reported, header.label, header.encoding, header.width, header.height, header.channels, payload)

    def raw_items(self) -> Iterator[tuple[bytes, memoryview]]:
        """Every key and stored value in key order (records, then reserved keys).

        For tools that check the database itself (``verify``); values are
        zero-copy views, valid until ``close()``.
        """
        cursor = self._txn().cursor()
        try:
            for key, value in cursor:
                yield bytes(key), cast(memoryview, value)
        finally:
            cursor.close()

    def _txn(self) -> lmdb.Transaction:
        # One long-lived read transaction per process and thread: packs never
        # change, so it never goes stale, and it keeps payload views valid.
        pid = os.getpid()
        if self._pid != pid:
            self._reset_handles()
            self._pid = pid
        txn = getattr(self._local, "txn", None)
        if txn is None:
            env = environments.acquire(self.path, self.readahead)
            txn = env.begin(buffers=True)
            with self._handle_lock:
                self._txns.append(txn)
            self._local.txn = txn
        return txn

    # -- lifetime --------------------------------------------------------------
    def close(self) -> None:
        """Release this process's handle. Payload views from ``get`` become invalid."""
        if self._pid == os.getpid():
            with self._handle_lock:
                txns, self._txns = self._txns, []
            for txn in txns:
                try:
                    txn.abort()
                except lmdb.Error:
                    pass
                environments.release(self.path)
        self._reset_handles()

    def __enter__(self) -> Reader:
        return self

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_pid", "_local", "_txns", "_handle_lock", "_index_by_path"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_handles()

    def __repr__(self) -> str:
        return f"Reader({self.path!r}, count={self._count}, classes={len(self.meta['classes'])}, store={self.store!r})"


def _refuse_foreign(path: str, txn: lmdb.Transaction) -> None:
    """Raise NotAPackError for an LMDB without a manifest that a recipe made, naming the conversion."""
    recipe = None
    if any(os.path.exists(os.path.join(path, name)) for name in LEGACY_META_FILES):
        recipe = "a BasicSR-style image LMDB (meta_info beside data.mdb)"
    elif any(txn.get(key) is not None for key in LEGACY_KEYS):
        recipe = "a folder2lmdb-style LMDB (pickled samples with __len__/__keys__)"
    if recipe is not None:
        raise NotAPackError(
            path,
            f"it is {recipe}, not an lmdbfolder pack",
            f"convert it with `lmdbfolder import {path} NEW` (pickles are read safely), then use NEW",
        )


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

"""Read a pack: lazily, read-only, lock-free, once per process, fork- and spawn-safe.

Rules this module enforces (see docs/design.md, "Opening an environment"):

* The LMDB environment is opened on first use in each process, read-only,
  with ``lock=False`` (packs are immutable, so no reader table is needed and a
  read-only directory works).
* py-lmdb refuses to open a path twice in one process, so environments are
  shared through a per-process registry, reference-counted by readers.
* A forked child must not use its parent's environment. The registry notices
  the PID change, closes the inherited handles in the child (which leaves the
  parent's intact) and opens its own.
* ``Reader`` pickles without any handle (``__getstate__``), so it can be sent
  to spawned DataLoader workers.

Reading the metadata at construction opens the environment only briefly and
closes it again, so a parent process that never reads a sample holds nothing
open when it starts its workers.
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

from lmdbfolder.codecs import decode_rgb
from lmdbfolder.errors import CorruptRecordError, DecodeError, NotAPackError
from lmdbfolder.files import dir_size
from lmdbfolder.format import (
    DATA_FILE,
    KEY,
    LABELS_KEY,
    META_KEY,
    PARTIAL_SUFFIX,
    PATHS_KEY,
    SHARD_INDEX_FILE,
    decode_labels,
    decode_meta,
    decode_paths,
    decode_record,
    path_at,
)

__all__ = ["Record", "Reader", "resolve_pack_path", "pack_info", "is_sharded", "PREFETCH_GAP"]

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


class _EnvRegistry:
    """The environments this process has open, one per pack directory."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._envs: dict[str, lmdb.Environment] = {}
        self._users: dict[str, int] = {}

    def _forget_inherited(self) -> None:
        # Runs in a forked child: the handles belong to the parent. Closing them
        # here unmaps the child's copy only; the parent's stay valid.
        for env in self._envs.values():
            try:
                env.close()
            except lmdb.Error:
                pass
        self._envs.clear()
        self._users.clear()
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def acquire(self, path: str, readahead: bool) -> lmdb.Environment:
        if os.getpid() != self._pid:
            self._forget_inherited()
        with self._lock:
            env = self._envs.get(path)
            if env is None:
                env = _open_env(path, readahead)
                self._envs[path] = env
                self._users[path] = 0
            self._users[path] += 1
            return env

    def release(self, path: str) -> None:
        if os.getpid() != self._pid:
            self._forget_inherited()
            return
        with self._lock:
            if path not in self._users:
                return
            self._users[path] -= 1
            if self._users[path] <= 0:
                env = self._envs.pop(path)
                del self._users[path]
                env.close()


_REGISTRY = _EnvRegistry()


def is_sharded(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` is a sharded pack: a directory holding ``index.json`` (or that file)."""
    p = os.path.abspath(os.fspath(path))
    if os.path.basename(p) == SHARD_INDEX_FILE and os.path.isfile(p):
        return True
    return os.path.isfile(os.path.join(p, SHARD_INDEX_FILE)) and not os.path.exists(os.path.join(p, DATA_FILE))


def resolve_pack_path(path: str | os.PathLike[str]) -> str:
    """Return the absolute pack directory for ``path`` or raise NotAPackError.

    ``path`` may be the pack directory or its ``data.mdb``.
    """
    p = os.path.abspath(os.fspath(path))
    if os.path.isfile(p) and os.path.basename(p) == DATA_FILE:
        p = os.path.dirname(p)
    if p.endswith(PARTIAL_SUFFIX) or (not os.path.exists(p) and os.path.isdir(p + PARTIAL_SUFFIX)):
        raise NotAPackError(
            p,
            "it is an unfinished pack (the writer stopped before the end)",
            "run the same `lmdbfolder pack` command again to finish it",
        )
    if not os.path.exists(p):
        raise NotAPackError(p, "no such file or directory")
    if not os.path.isdir(p):
        raise NotAPackError(p, "it is a file, expected a pack directory holding data.mdb")
    if not os.path.isfile(os.path.join(p, DATA_FILE)):
        if any(name.endswith((".lmdb", ".lmdb" + PARTIAL_SUFFIX)) and "-of-" in name for name in os.listdir(p)):
            raise NotAPackError(
                p,
                f"it holds shards but no {SHARD_INDEX_FILE} (an unfinished sharded pack)",
                "rerun the pack command to finish it, or run `lmdbfolder index` on it once every shard is packed",
            )
        raise NotAPackError(p, "the directory holds no data.mdb")
    return p


def _open_env(path: str, readahead: bool) -> lmdb.Environment:
    try:
        env = lmdb.open(
            path,
            subdir=True,
            readonly=True,
            lock=False,
            create=False,
            readahead=readahead,
            meminit=False,
            max_spare_txns=0,
        )
    except lmdb.InvalidError:
        raise NotAPackError(path, "data.mdb is not an LMDB file") from None
    except lmdb.Error as exc:
        raise NotAPackError(path, f"LMDB cannot open it: {exc}") from None
    try:
        _check_not_truncated(path, env)
    except BaseException:
        env.close()
        raise
    return env


def _check_not_truncated(path: str, env: lmdb.Environment) -> None:
    # A data.mdb cut short (an interrupted copy or download) still opens, but
    # touching a page past its end kills the process with SIGBUS. The meta
    # pages at the front say how many pages the database uses: check first.
    needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    size = os.path.getsize(os.path.join(path, DATA_FILE))
    if size < needed:
        raise NotAPackError(
            path,
            f"data.mdb is truncated: it holds {size:,} bytes but the database needs {needed:,}",
            "the file was cut short (an interrupted copy?): copy it again with `lmdbfolder copy`, or repack it",
        )


class Reader:
    """Random access to the samples of a pack.

    Args:
        path: the pack directory (or its ``data.mdb``). For a sharded pack
            (a directory holding ``index.json``) the result is a
            ``lmdbfolder.sharded.ShardedReader`` with the same API.
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

    def __new__(cls, path: str | os.PathLike[str] | None = None, *args: Any, **kwargs: Any) -> Reader:
        # ``Reader(path)`` opens a single pack or a sharded one with the same API.
        if cls is Reader and path is not None and is_sharded(path):
            from lmdbfolder.sharded import ShardedReader

            return super().__new__(ShardedReader)
        return super().__new__(cls)

    def __init__(self, path: str | os.PathLike[str], *, readahead: bool = True, verify_checksums: bool = False) -> None:
        self.path = resolve_pack_path(path)
        self.readahead = readahead
        self.verify_checksums = verify_checksums
        env = _REGISTRY.acquire(self.path, readahead)
        try:
            with env.begin() as txn:
                self.meta: dict[str, Any] = decode_meta(txn.get(META_KEY), where=self.path)
                count = self.meta["count"]
                labels_blob = txn.get(LABELS_KEY)
                if labels_blob is None:
                    raise NotAPackError(self.path, "its label table (key __labels__) is missing")
                self._labels = decode_labels(labels_blob, count, where=self.path)
                if txn.get(PATHS_KEY) is None:
                    raise NotAPackError(self.path, "its path table (key __paths__) is missing")
        finally:
            _REGISTRY.release(self.path)
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
    def classes(self) -> list[str]:
        """Class names, index = label."""
        return list(self.meta["classes"])

    @property
    def class_to_idx(self) -> dict[str, int]:
        """Class name -> label."""
        return dict(self.meta["class_to_idx"])

    @property
    def labels(self) -> array.array:
        """Label of every sample (a compact ``array('i')``; -1 = unlabelled)."""
        return self._labels

    @property
    def store(self) -> str:
        """``"encoded"`` (original file bytes) or ``"raw"`` (RGB pixels)."""
        return str(self.meta["store"])

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
            self._index_by_path = table
        try:
            return table[relpath]
        except KeyError:
            raise KeyError(f"no sample was packed from {relpath!r} in {self.path}") from None

    # -- samples ---------------------------------------------------------------
    def get(self, index: int) -> Record:
        """Return sample ``index`` (negative indices count from the end).

        The payload is a memoryview into the map: no copy is made. It stays
        valid until ``close()``; use ``read_bytes`` for an independent copy.
        """
        i = self._check_index(index)
        return self._record(i, self._txn().get(KEY.pack(i)))

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
        txn = self._txn()
        idx = [self._check_index(i) for i in indices]
        values = [txn.get(KEY.pack(i)) for i in idx]
        if prefetch and len(values) > 1:
            self._prefetch(values)
        return [self._record(i, v) for i, v in zip(idx, values)]

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

    def _record(self, i: int, value: Any) -> Record:
        try:
            if value is None:
                raise CorruptRecordError(i, "the record is missing from the database")
            header, payload = decode_record(value, index=i, verify=self.verify_checksums)
        except CorruptRecordError as exc:
            raise exc.locate(path_at(self._paths_blob(), self._count, i), self.path) from None
        return Record(i, header.label, header.encoding, header.width, header.height, header.channels, payload)

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
        for i in range(self._count):
            yield self.get(i)

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

    def _check_index(self, index: int) -> int:
        try:
            i = index.__index__()
        except AttributeError:
            raise TypeError(f"sample index must be an integer, got {type(index).__name__}") from None
        if i < 0:
            i += self._count
        if not 0 <= i < self._count:
            raise IndexError(f"index {index} is out of range for {self.path} ({self._count} samples)")
        return i

    def _txn(self) -> lmdb.Transaction:
        # One long-lived read transaction per process and thread: packs never
        # change, so it never goes stale, and it keeps payload views valid.
        pid = os.getpid()
        if self._pid != pid:
            self._reset_handles()
            self._pid = pid
        txn = getattr(self._local, "txn", None)
        if txn is None:
            env = _REGISTRY.acquire(self.path, self.readahead)
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
                _REGISTRY.release(self.path)
        self._reset_handles()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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


def pack_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Summary of a pack from its manifest, without reading any record.

    Returns a JSON-ready dict: path, format and version, count, classes,
    store, encodings, payload bytes, size on disk, source and creation info.
    For a sharded pack it also holds ``num_shards`` and ``shards``.
    """
    if is_sharded(path):
        from lmdbfolder.sharded import sharded_info

        return sharded_info(path)
    reader = Reader(path)
    meta = reader.meta
    size = dir_size(reader.path)
    return {
        "path": reader.path,
        "format": meta["format"],
        "format_version": meta["format_version"],
        "count": meta["count"],
        "num_classes": len(meta["classes"]),
        "classes": meta["classes"],
        "store": meta["store"],
        "encodings": meta.get("encodings", {}),
        "payload_bytes": meta.get("payload_bytes"),
        "size_on_disk": size,
        "source": meta.get("source"),
        "created_by": meta.get("created_by"),
        "created_at": meta.get("created_at"),
        "skipped": meta.get("skipped", []),
    }

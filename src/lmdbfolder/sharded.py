"""Reading a sharded pack: its index, ``ShardedReader``, ``info`` and ``verify``.

A sharded pack (written by ``lmdbfolder.shards``) is a directory of ordinary
packs and one ``index.json`` (FORMAT.md, "Sharded packs"). ``ShardedReader``
gives it the API of a single pack: a global index is mapped to (shard, local
index) by binary search over the cumulative counts, and each shard is opened
lazily, once per process, when it is first read. ``Reader(path)`` returns a
``ShardedReader`` when ``path`` holds an index, so ``LMDBFolder`` opens either.
"""

from __future__ import annotations

import array
import bisect
import dataclasses
import os
import threading
import time
from typing import Any

from lmdbfolder.errors import NotAPackError
from lmdbfolder.files import dir_size
from lmdbfolder.format import (
    LABELS_KEY,
    META_KEY,
    PATHS_KEY,
    SHARD_INDEX_FILE,
    decode_shard_index,
    tables_digest,
)
from lmdbfolder.reader import Reader, Record
from lmdbfolder.verify import Problem, VerifyReport, verify

__all__ = ["ShardedReader", "read_tables", "load_index", "sharded_info", "verify_sharded"]


def read_tables(reader: Reader) -> tuple[bytes, bytes, bytes]:
    """The manifest, label and path tables of one shard, as stored (for the index checksum)."""
    txn = reader._txn()  # the same per-process handle every read of this pack uses
    blobs = []
    for key in (META_KEY, LABELS_KEY, PATHS_KEY):
        blob = txn.get(key)
        if blob is None:
            raise NotAPackError(reader.path, f"its {key.decode()} table is missing")
        blobs.append(bytes(blob))
    return blobs[0], blobs[1], blobs[2]


def load_index(path: str | os.PathLike[str]) -> tuple[str, dict[str, Any]]:
    """(pack directory, parsed index.json) of a sharded pack; NotAPackError naming what is wrong."""
    p = os.path.abspath(os.fspath(path))
    if os.path.basename(p) == SHARD_INDEX_FILE:
        p = os.path.dirname(p)
    index_file = os.path.join(p, SHARD_INDEX_FILE)
    try:
        with open(index_file, "rb") as f:
            blob = f.read()
    except OSError as exc:
        raise NotAPackError(p, f"cannot read {SHARD_INDEX_FILE} ({exc.strerror})") from None
    return p, decode_shard_index(blob, where=index_file)


# -- reading -------------------------------------------------------------------------
class ShardedReader(Reader):
    """Random access to a sharded pack, with the API of ``Reader``.

    ``Reader(path)`` returns one of these when ``path`` holds ``index.json``.
    Global index ``i`` lives in shard ``k = bisect(shard_offsets, i) - 1`` at
    local index ``i - shard_offsets[k]``. Opening reads only ``index.json``
    and checks that every shard directory exists; each shard is opened (and
    checked against the index: count, classes, store, tables checksum) the
    first time it is used in a process, through the fork- and spawn-safe
    per-process handles of ``Reader``.

    Example:
        >>> from lmdbfolder import Reader
        >>> r = Reader("train-sharded")  # doctest: +SKIP
        >>> len(r), r.num_shards, r.locate(1000)  # doctest: +SKIP
        (1281167, 8, (0, 1000))
    """

    def __init__(self, path: str | os.PathLike[str], *, readahead: bool = True, verify_checksums: bool = False) -> None:
        self.path, self.meta = load_index(path)
        self.readahead = readahead
        self.verify_checksums = verify_checksums
        entries = self.meta["shards"]
        self._names: list[str] = [e["name"] for e in entries]
        starts = [0]
        for e in entries:
            starts.append(starts[-1] + e["count"])
        self._starts: list[int] = starts
        self._count: int = self.meta["count"]
        missing = [n for n in self._names if not os.path.isdir(os.path.join(self.path, n))]
        if missing:
            raise NotAPackError(
                self.path,
                f"{len(missing)} of {len(self._names)} shards are missing: {', '.join(missing[:10])}"
                + (" ..." if len(missing) > 10 else ""),
                "copy the missing shard directories next to index.json (or repack them with "
                "`lmdbfolder pack ... --shard-index I`)",
            )
        self._reset_shards()

    def _reset_shards(self) -> None:
        self._readers: list[Reader | None] = [None] * len(self._names)
        self._shard_lock = threading.Lock()
        self._owner_pid = os.getpid()
        self._labels_cache: array.array | None = None

    # -- shards ----------------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        """Number of shards."""
        return len(self._names)

    @property
    def shards(self) -> list[str]:
        """The shard directories, in global order."""
        return [os.path.join(self.path, n) for n in self._names]

    @property
    def shard_offsets(self) -> list[int]:
        """Global index of each shard's first sample, then the total count (``num_shards + 1`` values)."""
        return list(self._starts)

    def locate(self, index: int) -> tuple[int, int]:
        """``(shard, local index)`` of global sample ``index``."""
        i = self._check_index(index)
        k = bisect.bisect_right(self._starts, i) - 1
        return k, i - self._starts[k]

    def shard(self, k: int) -> Reader:
        """The Reader of shard ``k``, opened and checked on first use in this process."""
        if os.getpid() != self._owner_pid:
            # A forked child: the inherited Readers are safe (they reopen their
            # handles), but a lock held by another thread at fork time is not.
            self._shard_lock = threading.Lock()
            self._owner_pid = os.getpid()
        reader = self._readers[k]
        if reader is None:
            with self._shard_lock:
                reader = self._readers[k]
                if reader is None:
                    reader = self._open_shard(k)
                    self._readers[k] = reader
        return reader

    def _open_shard(self, k: int) -> Reader:
        entry = self.meta["shards"][k]
        path = os.path.join(self.path, entry["name"])
        where = f"shard {k} of {len(self._names)} listed in {os.path.join(self.path, SHARD_INDEX_FILE)}"
        reader = Reader(path, readahead=self.readahead, verify_checksums=self.verify_checksums)
        try:
            hint = "the shard was replaced or repacked: restore the original, or run `lmdbfolder index` again"
            if len(reader) != entry["count"]:
                raise NotAPackError(
                    path, f"it holds {len(reader)} samples, the index says {entry['count']} ({where})", hint
                )
            for key in ("classes", "class_to_idx", "store"):
                if reader.meta[key] != self.meta[key]:
                    raise NotAPackError(path, f"its {key} differ from the index's ({where})", hint)
            if tables_digest(*read_tables(reader)) != entry["tables_sha256"]:
                raise NotAPackError(path, f"its tables do not match the index's tables_sha256 ({where})", hint)
        finally:
            reader.close()  # checked; its handle is reopened lazily when a sample is read
        return reader

    # -- the Reader API ------------------------------------------------------------
    @property
    def labels(self) -> array.array:
        """Label of every sample, in global order (opens every shard once)."""
        if self._labels_cache is None:
            labels = array.array("i")
            for k in range(len(self._names)):
                labels.extend(self.shard(k).labels)
            self._labels_cache = labels
        return self._labels_cache

    def get(self, index: int) -> Record:
        """Return sample ``index`` (global; negative indices count from the end); see ``Reader.get``."""
        k, local = self.locate(index)
        record = self.shard(k).get(local)
        return dataclasses.replace(record, index=local + self._starts[k])

    def path_of(self, index: int) -> str:
        """Original relative path of global sample ``index``."""
        k, local = self.locate(index)
        return self.shard(k).path_of(local)

    def paths(self) -> list[str]:
        """Original relative paths of all samples, in global order."""
        return [p for k in range(len(self._names)) for p in self.shard(k).paths()]

    def raw_items(self) -> Any:
        """Not available: a sharded pack has no single database (iterate over ``shards``)."""
        raise TypeError(f"{self.path} is a sharded pack; read each of its shards (ShardedReader.shards) instead")

    def close(self) -> None:
        """Release this process's handles on every shard."""
        for reader in self._readers:
            if reader is not None:
                reader.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_readers", "_shard_lock", "_owner_pid", "_labels_cache", "_index_by_path"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_shards()

    def __repr__(self) -> str:
        return (
            f"ShardedReader({self.path!r}, count={self._count}, shards={len(self._names)}, "
            f"classes={len(self.meta['classes'])}, store={self.store!r})"
        )


# -- info and verify -----------------------------------------------------------------
def sharded_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``pack_info`` of a sharded pack: the index's summary plus each shard's name, count and size."""
    reader = ShardedReader(path)
    meta = reader.meta
    shards = []
    skipped: list[dict[str, Any]] = []
    size = os.path.getsize(os.path.join(reader.path, SHARD_INDEX_FILE))
    for entry, shard_path in zip(meta["shards"], reader.shards):
        skipped.extend(Reader(shard_path).meta.get("skipped", []))
        shard_size = dir_size(shard_path)
        size += shard_size
        shards.append({"name": entry["name"], "count": entry["count"], "size_on_disk": shard_size})
    return {
        "path": reader.path,
        "format": meta["format"],
        "format_version": meta["index_version"],
        "pack_format_version": meta["pack_format_version"],
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
        "num_shards": len(shards),
        "shards": shards,
        "skipped": skipped,
    }


def verify_sharded(path: str | os.PathLike[str], *, decode: bool = False, progress: bool | None = None) -> VerifyReport:
    """``verify`` for a sharded pack: every shard in full, and each against the index.

    A missing or unreadable shard, a count, class list or store that differs
    from the index, and tables that do not match the index's checksum are
    reported as problems naming the shard; record problems carry the global
    index and the shard's name.
    """
    start = time.perf_counter()
    root, index = load_index(path)
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
                digest = tables_digest(*read_tables(reader))
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

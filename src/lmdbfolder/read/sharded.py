"""Reading a sharded pack: ``ShardedReader``.

A sharded pack (written by ``lmdbfolder.write.shards``) is a directory of
ordinary packs and one ``index.json`` (FORMAT.md, "Sharded packs").
``ShardedReader`` gives it the API of a single pack (``PackAPI``): a global
index is mapped to (shard, local index) by binary search over the cumulative
counts, and each shard is an ordinary ``Reader``, opened lazily, once per
process, when it is first read. ``lmdbfolder.read.opening.open_pack`` opens
either kind.
"""

from __future__ import annotations

import array
import bisect
import contextlib
import os
import threading
from typing import Any, Mapping, Sequence

import numpy as np

from lmdbfolder import packdir
from lmdbfolder.errors import NotAPackError, PackChangedError
from lmdbfolder.format import SHARD_INDEX_FILE, Manifest, ShardIndex, shard_matches, shard_place
from lmdbfolder.read.reader import PackAPI, Reader, Record
from lmdbfolder.read.staging import MAPPED_PER_PROCESS, ShardHold, StagedPack
from lmdbfolder.text import printable

__all__ = ["ShardedReader", "out_of_place"]

#: Shards of a staged pack one process keeps mapped at most (the least recently
#: opened is closed): each one mapped is held in the cache, never evicted.
_STAGED_OPEN = MAPPED_PER_PROCESS


class ShardedReader(PackAPI):
    """Random access to a sharded pack, with the API of ``Reader``.

    Global index ``i`` lives in shard ``k = bisect(shard_offsets, i) - 1`` at
    local index ``i - shard_offsets[k]``. Opening reads only ``index.json``
    and checks that every shard directory exists; each shard is opened (and
    checked against the index: count, classes, store, tables checksum) the
    first time it is used in a process, through the fork- and spawn-safe
    per-process handles of ``Reader``.

    Example:
        >>> import lmdbfolder
        >>> r = lmdbfolder.open_pack("train-sharded")  # doctest: +SKIP
        >>> len(r), r.num_shards, r.locate(1000)  # doctest: +SKIP
        (1281167, 8, (0, 1000))
    """

    #: The pack's ``index.json``: typed, and a read-only mapping of its JSON object.
    meta: ShardIndex

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        readahead: bool = True,
        verify_checksums: bool = True,
        staging: StagedPack | None = None,
    ) -> None:
        #: For a pack in object storage (``open_pack(url, cache_dir=...)``): the
        #: cache its shards are staged into, each when first needed (``path`` is
        #: the cache folder). None: a local pack.
        self.staging = staging
        if staging is not None:
            path = staging.root
        found = packdir.require_pack(path)
        if found.kind is not packdir.Kind.SHARDED:
            raise NotAPackError(found.path, f"it is a single pack, not a sharded one (it holds no {SHARD_INDEX_FILE})")
        self.path, self.meta = packdir.load_index(found.path)
        self.readahead = readahead
        self.verify_checksums = verify_checksums
        self._names: list[str] = self.meta.names
        starts = [0]
        for e in self.meta.shards:
            starts.append(starts[-1] + e.count)
        self._starts: list[int] = starts
        self._count: int = self.meta.count
        missing = [] if staging else [n for n in self._names if not os.path.isdir(os.path.join(self.path, n))]
        if missing:
            raise packdir.missing_shards(self.path, missing, len(self._names))
        self._reset_shards()

    def _reset_shards(self) -> None:
        self._readers: list[Reader | None] = [None] * len(self._names)
        self._shard_lock = threading.Lock()
        self._owner_pid = os.getpid()
        self._labels_cache: array.array | None = None
        self._open_order: list[int] = []  # staged packs: the shards this process has mapped, oldest first
        self._holds: dict[int, ShardHold | None] = {}  # staged packs: what keeps each mapped shard in the cache

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
            if self.staging is not None:
                # A staged shard is (re)opened only under its cache lock, never by
                # path behind the cache's back (it may have been evicted since).
                self._readers = [None] * len(self._names)
                self._open_order = []
                self._holds = {}  # the parent's: the fork dropped this process's copies
        reader = self._readers[k]
        if reader is None:
            with self._shard_lock:
                reader = self._readers[k]
                if reader is None:
                    reader = self._open_shard(k)
                    self._readers[k] = reader
        return reader

    def _open_shard(self, k: int) -> Reader:
        if self.staging is None:
            return self._check_shard(k, os.path.join(self.path, self.meta.shards[k].name), keep_open=False)
        # Staged: fetched into the cache if it is not there, then opened and mapped, and
        # held there (a shared lock) until this process closes it: a mapped shard is never
        # evicted, as its disk space would stay in use, unseen by the cache's limit. So
        # this process first lets go of the oldest beyond a few, and of what the limit
        # needs evicted (what no rank needs any more; all it may evict when the cache is full).
        excess = self._open_order[: max(0, len(self._open_order) + 1 - _STAGED_OPEN)]
        self.staging.let_go(self._open_order, k, self._close_staged, excess)
        reader, hold = self.staging.open_held(k, lambda path: self._check_shard(k, path, keep_open=True))
        self._holds[k] = hold
        self._open_order.append(k)
        return reader

    def _close_staged(self, k: int) -> None:
        """Close this process's map of staged shard ``k``, then let the cache evict it."""
        with contextlib.suppress(ValueError):
            self._open_order.remove(k)
        reader, self._readers[k] = self._readers[k], None
        if reader is not None:
            reader.close()
        hold = self._holds.pop(k, None)
        if hold is not None:
            hold.release()

    def _check_shard(self, k: int, path: str, *, keep_open: bool) -> Reader:
        entry = self.meta.shards[k]
        index_file = os.path.join(self.path, SHARD_INDEX_FILE)
        hint = "the shard was replaced or repacked: restore the original, or run `lmdbfolder index` again"
        if self.staging is not None:
            # The cache's index.json is a copy: what disagrees is the pack in storage.
            index_file = f"{self.staging.url}/{SHARD_INDEX_FILE}"
            hint = (
                "the pack in storage is inconsistent (its index.json does not describe this shard, which "
                "matched the index's digests): upload it again (`lmdbfolder copy PACK URL`)"
            )
        where = f"shard {k} of {len(self._names)} listed in {index_file}"
        try:
            # Format 2 and 3: the version of the shard the index names (its current
            # one, or the one before it while an update has rewritten the shard
            # but not yet the index); its own table checksums are checked on open.
            reader = Reader(
                path,
                readahead=self.readahead,
                verify_checksums=self.verify_checksums,
                pack_id=entry.pack_id,
                manifest_sha256=entry.manifest_sha256,
            )
        except PackChangedError:
            raise PackChangedError(
                path,
                f"does not hold the shard the index names: its pack_id differs from the index's ({where}; "
                "repacked, updated with `lmdbfolder pack --update`, or copied over)",
                hint
                if self.staging is not None
                else "open the pack again if it was updated; else restore the shard, or run `lmdbfolder index` again",
            ) from None
        try:
            if len(reader) != entry.count:
                raise NotAPackError(
                    path, f"it holds {len(reader)} samples, the index says {entry.count} ({where})", hint
                )
            for key, theirs, ours in (
                ("classes", reader.meta.classes, self.meta.classes),
                ("class_to_idx", reader.meta.class_to_idx, self.meta.class_to_idx),
                ("store", reader.meta.store, self.meta.store),
            ):
                if theirs != ours:
                    raise NotAPackError(path, f"its {key} differ from the index's ({where})", hint)
            misplaced = out_of_place(reader.meta, k, len(self._names))
            if misplaced:
                raise NotAPackError(path, f"{misplaced}, the index lists it as {where}", hint)
            if entry.pack_id is None and not shard_matches(entry, *reader.tables()):
                # Version-1 shards: the stored manifest's hash and the tables' lengths
                # (format.shard_matches): microseconds, where hashing the tables took
                # milliseconds per shard per worker.
                what = "manifest_sha256/tables_bytes" if entry.manifest_sha256 is not None else "tables_sha256"
                raise NotAPackError(path, f"its manifest or tables do not match the index's {what} ({where})", hint)
            if keep_open:
                reader._file()  # mapped now, while the shard cannot be evicted
        except BaseException:
            reader.close()
            raise
        if not keep_open:
            reader.close()  # checked; its handle is reopened lazily when a sample is read
        return reader

    # -- the Reader API ------------------------------------------------------------
    def __len__(self) -> int:
        return self._count

    @property
    def labels(self) -> array.array:
        """Label of every sample, in global order (opens every shard once)."""
        if self._labels_cache is None:
            labels = array.array("i")
            for k in range(len(self._names)):
                labels.extend(self.shard(k).labels)
            self._labels_cache = labels
        return self._labels_cache

    def class_counts(self) -> np.ndarray:
        """Samples per class index, summed over the shards (opens every shard once,
        unless the index lists each shard's classes, as an uploaded pack's does)."""
        # Every shard has the index's classes (checked when it opens).
        total = np.zeros(len(self.meta.classes), dtype=np.int64)
        listed = [e.class_counts for e in self.meta.shards]
        if self.staging is not None and all(c is not None for c in listed):
            for counts in listed:
                for c, n in counts:  # type: ignore[union-attr]  # checked above
                    if 0 <= c < len(total):
                        total[c] += n
            if int(total.sum()) == self._count:
                return total
            total[:] = 0  # the index contradicts itself: count from the shards
        for k in range(len(self._names)):
            total += self.shard(k).class_counts()
        return total

    def get(self, index: int) -> Record:
        """Return sample ``index`` (global; negative indices count from the end); see ``Reader.get``."""
        k, local = self.locate(index)
        return self.shard(k)._get_many([local], False, self._starts[k])[0]

    def get_many(self, indices: Sequence[int], *, prefetch: bool = True) -> list[Record]:
        """The records of ``indices`` (global), in that order; see ``Reader.get_many``.

        The indices are grouped by shard, each shard fetches (and prefetches)
        its own together, and the records come back in the order asked.
        """
        by_shard: dict[int, tuple[list[int], list[int]]] = {}
        for position, index in enumerate(indices):
            k, local = self.locate(index)
            slots, locals_ = by_shard.setdefault(k, ([], []))
            slots.append(position)
            locals_.append(local)
        out: list[Record | None] = [None] * len(indices)
        for k, (slots, locals_) in by_shard.items():
            for position, record in zip(slots, self.shard(k)._get_many(locals_, prefetch, self._starts[k])):
                out[position] = record
        return out  # type: ignore[return-value]  # every slot was filled

    def prefetch(self, indices: Sequence[int]) -> None:
        """Ask the kernel to start reading these records (global indices); see ``Reader.prefetch``."""
        by_shard: dict[int, list[int]] = {}
        for index in indices:
            k, local = self.locate(index)
            by_shard.setdefault(k, []).append(local)
        for k, locals_ in by_shard.items():
            self.shard(k).prefetch(locals_)

    def path_of(self, index: int) -> str:
        """Original relative path of global sample ``index``."""
        k, local = self.locate(index)
        return self.shard(k).path_of(local)

    def paths(self) -> list[str]:
        """Original relative paths of all samples, in global order."""
        return [p for k in range(len(self._names)) for p in self.shard(k).paths()]

    def close(self) -> None:
        """Release this process's handles on every shard (a staged pack's shards are then
        evictable; each is opened through the cache again when next read)."""
        if self.staging is not None:
            if os.getpid() == self._owner_pid:  # a forked child's inherited maps are not its own
                with self._shard_lock:
                    for k in list(self._open_order):
                        self._close_staged(k)
            return
        for reader in self._readers:
            if reader is not None:
                reader.close()

    def __enter__(self) -> ShardedReader:
        return self

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in (
            "_readers",
            "_shard_lock",
            "_owner_pid",
            "_labels_cache",
            "_index_by_path",
            "_open_order",
            "_holds",
        ):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_shards()

    def __repr__(self) -> str:
        return (
            f"ShardedReader({self.path!r}, count={self._count}, shards={len(self._names)}, "
            f"classes={len(self.meta.classes)}, store={self.store!r})"
        )


def out_of_place(meta: Manifest | Mapping[str, Any], k: int, num_shards: int) -> str | None:
    """What is wrong when a shard whose manifest is ``meta`` is listed as shard ``k`` of
    ``num_shards`` in an index (an index whose entries were reordered, or shards of
    another split), or None: a shard records its place in the split (the ``shard``
    manifest field; a shard packed before it existed records none)."""
    place = shard_place(meta)
    if place is None or place == (k, num_shards):
        return None
    # Read from a pack: escaped and bounded before it is printed.
    index, num = printable(place[0], 20), printable(place[1], 20)
    return f"it was packed as shard {index} of {num} of its split"

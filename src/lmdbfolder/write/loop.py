"""The write loop: records appended in order, in batched transactions, each with a checkpoint.

``_Run`` takes the records from the reading pipeline (reader processes or
threads, in source order), appends them to the open ``<dst>.partial``
(``_Partial``) in batches and commits each batch together with a
checkpoint (``__progress__``), so an interrupted pack resumes from its last
commit. A batch is as small as the disk's flush latency allows
(``batch_bytes``). The last transaction writes the label and path tables,
the skipped list and the manifest (``_Run.finish``).

Names with a leading underscore are shared by the write modules only.
"""

from __future__ import annotations

import array
import datetime as _dt
import errno
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import lmdb
from PIL import Image

from lmdbfolder._version import __version__
from lmdbfolder.errors import PackError, SourceError
from lmdbfolder.format import (
    MAX_MANIFEST_BYTES,
    PROGRESS_KEY,
    SYNC_PROBE,
    UNKNOWN_MTIME,
    Manifest,
    NewTables,
    bind_record,
    encode_key,
    encode_labels,
    encode_paths,
    encode_progress,
    new_pack_id,
)
from lmdbfolder.progress import Progress
from lmdbfolder.text import disk_size, plural, skipped_line
from lmdbfolder.write.compact import LabelList, PathList
from lmdbfolder.write.options import PackOptions
from lmdbfolder.write.processes import ProcessReader, processes_available
from lmdbfolder.write.records import Alloc, Loaded, Skipped, load_sample
from lmdbfolder.write.runtime import _interrupt_latch, _Latch
from lmdbfolder.write.sources import SourceList
from lmdbfolder.write.threads import ordered_map

__all__ = [
    "Job",
    "DEFAULT_COMMIT_BYTES",
    "MIN_BATCH_BYTES",
    "batch_bytes",
    "sync_latency",
    "check_manifest_size",
    "nothing_to_pack",
]

#: The most bytes a batch holds before it commits (unless commit_bytes says).
#: The batch stays in memory until it commits (so it can be replayed after the
#: map grows); this bounds the writer's memory for large images. Batches are
#: usually much smaller: see MIN_BATCH_BYTES.
DEFAULT_COMMIT_BYTES = 64 << 20
#: Smallest batch. Small batches keep LMDB's dirty pages and the records
#: being copied in the CPU cache between the copy into the batch and the
#: write to the file; with 2 MB instead of 64 MB batches a warm 1 GB pack took
#: 1.1 s instead of 2.2 s (benchmarks/bench_pack.py --compare).
MIN_BATCH_BYTES = 2 << 20
#: Every commit waits for one flush of the disk (fdatasync). Batches grow until
#: that wait costs at most about 10% at 1 GB/s: bytes >= flush latency x this.
SYNC_BUDGET_BYTES_PER_SECOND = 10 << 30


@dataclass(frozen=True)
class Job:
    """What one pack writes: ``pack_sources``'s arguments, resolved once at its entry.

    ``sources`` into the pack directory ``dst`` (absolute) with ``options``.
    ``loader(i)`` replaces reading ``sources.abspath(i)`` from disk (``lmdbfolder
    import``: samples from another database), and ``mean_size``, their expected
    payload bytes, then sizes the map. ``manifest_extra`` adds optional
    manifest fields (a shard's place in its split), also fingerprinted.
    ``on_progress(done, total)`` is called after each source file.
    """

    sources: SourceList
    dst: str
    options: PackOptions
    loader: Callable[[int], Loaded | Skipped] | None = None
    mean_size: float | None = None
    manifest_extra: Mapping[str, Any] = field(default_factory=dict)
    on_progress: Callable[[int, int], None] | None = None


class _Partial:
    """The open ``<dst>.partial`` environment and the checkpoint it holds."""

    def __init__(
        self,
        path: str,
        env: lmdb.Environment,
        fingerprint: dict[str, Any],
        progress: dict[str, Any],
    ) -> None:
        self.path = path
        self.env = env
        # Held while records are copied into the map. py-lmdb releases the GIL
        # around every single put; reader threads that grabbed it in between
        # turned each put into a GIL hand-off (hundreds of thousands of futex
        # calls per GB). Readers wait at this gate instead (see _Run._load).
        self.gate = threading.Lock()
        self.fingerprint = fingerprint
        self.next_source: int = progress.get("next_source", 0)
        self.next_index: int = progress.get("next_index", 0)
        self.skipped: list[tuple[int, str]] = [(int(s), str(r)) for s, r in progress.get("skipped", [])]
        #: Size and modification time of the skipped files that could be opened (source index ->).
        self.skipped_stats: dict[int, tuple[int, int]] = {
            int(s): (int(size), int(mtime)) for s, size, mtime in progress.get("skipped_stats", [])
        }
        self.encodings: dict[str, int] = dict(progress.get("encodings", {}))
        self.payload_bytes: int = progress.get("payload_bytes", 0)
        self.grew: bool = bool(progress.get("grew", False))
        self.resumed_from = self.next_source
        self.finished: bool = bool(progress.get("finished", False))
        # Every record's CRC is bound to this id (format 2): kept across resumes.
        self.pack_id: str = str(progress.get("pack_id") or new_pack_id())
        self.binding = bytes.fromhex(self.pack_id)

    def checkpoint(self) -> bytes:
        return encode_progress(
            {
                "pack_id": self.pack_id,
                "fingerprint": self.fingerprint,
                "next_source": self.next_source,
                "next_index": self.next_index,
                "skipped": self.skipped,
                "skipped_stats": [[s, *st] for s, st in self.skipped_stats.items()],
                "encodings": self.encodings,
                "payload_bytes": self.payload_bytes,
                "grew": self.grew,
            }
        )

    def commit(
        self,
        batch: list[tuple[bytes, bytes | bytearray | memoryview]],
        extra: dict[bytes, bytes | bytearray | None],
    ) -> None:
        """Append ``batch`` and put ``extra`` (None deletes) in one transaction.

        On MDB_MAP_FULL the transaction is aborted, the map doubled and the
        same batch replayed, so the user never sees MapFullError.
        """
        while True:
            txn = self.env.begin(write=True)
            try:
                if batch:
                    # Appending needs every key so far to sort below the batch; the
                    # checkpoint key sorts above all record keys, so it is deleted
                    # and put back in the same transaction.
                    txn.delete(PROGRESS_KEY)
                    with self.gate, txn.cursor() as cursor:
                        _consumed, added = cursor.putmulti(batch, append=True)
                    if added != len(batch):
                        raise PackError(
                            f"{self.path}: only {added} of {len(batch)} records were added (duplicate keys)",
                            "start over with --restart",
                        )
                for key, value in extra.items():
                    if value is None:
                        txn.delete(key)
                    else:
                        txn.put(key, value)
                txn.commit()
                return
            except lmdb.MapFullError:
                txn.abort()
                self.grow(self.env.info()["map_size"] * 2)
            except lmdb.Error as exc:
                txn.abort()
                raise _write_error(self.path, exc) from exc
            except BaseException:
                txn.abort()
                raise

    def grow(self, map_size: int) -> None:
        """Enlarge the map (aborted transactions only; see commit)."""
        self.env.set_mapsize(map_size)
        self.grew = True

    def close(self) -> None:
        try:
            self.env.close()
        except lmdb.Error:
            pass


class _Run:
    """One run of the write loop over the sources not yet done."""

    def __init__(self, job: Job, state: _Partial) -> None:
        self.sources = job.sources
        self.loader = job.loader
        self.options = job.options
        self.manifest_extra = dict(job.manifest_extra)
        self.on_progress = job.on_progress
        self.state = state
        self.batch_limit = self.options.commit_bytes or DEFAULT_COMMIT_BYTES  # as used (write_all)
        self.input_bytes = 0
        self.batch: list[tuple[bytes, bytes | bytearray | memoryview]] = []
        self.procs: ProcessReader | None = None
        self.interrupted = _Latch()
        self.batch_bytes = 0
        self.max_pixels = Image.MAX_IMAGE_PIXELS
        # Size and modification time of every record written by this run, in
        # order (records of an interrupted run before it: not known, see finish).
        self.first_stat = state.next_index
        self.sizes = array.array("Q")
        self.mtimes = array.array("q")

    @property
    def count(self) -> int:
        return self.state.next_index

    @property
    def payload_bytes(self) -> int:
        return self.state.payload_bytes

    @property
    def encodings(self) -> dict[str, int]:
        return dict(sorted(self.state.encodings.items()))

    def _load_gated(self, s: int) -> Loaded | Skipped:
        with self.state.gate:  # wait while the writer copies a batch into the map
            pass
        if self.loader is not None:
            return self.loader(s)
        return self._load(s)

    def _load(self, s: int, alloc: Alloc | None = None) -> Loaded | Skipped:
        return load_sample(
            self.sources.abspath(s),
            self.sources.labels[s],
            store=self.options.store,
            check=self.options.check,
            max_pixels=self.max_pixels,
            resize=self.options.resize,
            alloc=alloc,
        )

    def _commit(self, extra: dict[bytes, bytes | bytearray | None] | None = None) -> None:
        extra = dict(extra or {})
        if PROGRESS_KEY not in extra:
            checkpoint = extra[PROGRESS_KEY] = self.state.checkpoint()
            if self.options.commit_bytes is None:  # it grows with the skipped list: keep it a small part of a batch
                self.batch_limit = max(self.batch_limit, min(DEFAULT_COMMIT_BYTES, 64 * len(checkpoint)))
        self.state.commit(self.batch, extra)
        self.batch = []
        self.batch_bytes = 0
        if self.procs is not None:
            self.procs.release()  # the records are in LMDB: their shared memory can be reused

    def _commit_if_any(self) -> None:
        if self.batch:
            self._commit()

    def write_all(self, workers: int, mean_value_size: float, progress: bool | None) -> None:
        """Write every source not yet done, then the tables and the manifest (``finish``)."""
        with _interrupt_latch() as self.interrupted:
            self._write_all(workers, mean_value_size, progress)

    def _write_all(self, workers: int, mean_value_size: float, progress: bool | None) -> None:
        todo = range(self.state.next_source, len(self.sources))
        # Read ahead of the writer: the batch being filled, the one committing,
        # and a couple of records per reader.
        if self.options.commit_bytes is None:
            self.batch_limit = batch_bytes(self.state.path, DEFAULT_COMMIT_BYTES, mean_value_size)
        ahead = 2 * self.batch_limit + workers * 2 * int(mean_value_size)
        if workers > 1 and self.loader is None and processes_available():
            with ProcessReader(
                todo, self._load, workers=workers, ring_bytes=ahead, on_full=self._commit_if_any
            ) as procs:
                self.procs = procs
                try:
                    self._write(todo, procs, progress)
                    self.finish()  # while the shared memory holding the last batch is mapped
                finally:
                    self.procs = None
                    self.batch = []  # its views of the shared memory, before the ring is unmapped
            return
        inflight = int(min(4096, max(2 * workers, ahead / max(mean_value_size, 1.0))))
        results = ordered_map(self._load_gated, todo, workers=workers, max_inflight=inflight)
        try:
            self._write(todo, results, progress)
        finally:
            results.close()
        self.finish()

    def _write(self, todo: range, results: Iterable[Loaded | Skipped], progress: bool | None) -> None:
        state = self.state
        interrupted = self.interrupted
        with Progress(len(self.sources), "pack", enabled=progress, initial=state.next_source) as bar:
            for s, result in zip(todo, results):
                if interrupted:
                    raise KeyboardInterrupt  # a Ctrl-C that Python swallowed (see _interrupt_latch)
                if isinstance(result, Skipped):
                    if self.options.strict:
                        self._commit()  # keep everything before it: the rerun resumes here
                        raise SourceError(
                            self.sources.abspath(s),
                            result.reason,
                            "fix or remove the file and run the same command again to resume, "
                            "or pack without --strict to skip such files",
                        )
                    state.skipped.append((s, result.reason))
                    if result.mtime_ns != UNKNOWN_MTIME:
                        state.skipped_stats[s] = (result.size, result.mtime_ns)
                    bar.write(skipped_line(self.sources.relpaths[s], result.reason))
                    bar.update(1)  # the bar counts source files: a skipped one is done too
                else:
                    value = bind_record(result.value, state.binding, state.next_index)
                    self.batch.append((encode_key(state.next_index), value))
                    self.batch_bytes += len(result.value)
                    state.next_index += 1
                    state.encodings[result.encoding] = state.encodings.get(result.encoding, 0) + 1
                    state.payload_bytes += len(result.value)
                    self.input_bytes += result.source_bytes
                    self.sizes.append(result.source_bytes)
                    self.mtimes.append(result.mtime_ns)
                    bar.update(1, result.source_bytes)
                state.next_source = s + 1
                if len(self.batch) >= self.options.commit_every or self.batch_bytes >= self.batch_limit:
                    self._commit()
                if self.on_progress is not None:
                    self.on_progress(s + 1, len(self.sources))
        if interrupted:
            raise KeyboardInterrupt

    def finish(self) -> None:
        """Commit the last batch together with the tables and the manifest."""
        state = self.state
        skipped = {s for s, _ in state.skipped}
        kept = len(self.sources) - len(skipped)
        if kept != state.next_index:
            raise PackError(
                f"{state.path}: the checkpoint counts {state.next_index} records but {kept} sources were kept",
                "start over with --restart",
            )
        if not kept:
            raise nothing_to_pack(self.sources.root, len(self.sources))
        # Straight from the compact sample list: no Python object per sample.
        manifest = self._manifest()
        meta = manifest.to_json()
        check_manifest_size(meta, self.sources.root)
        event = history_entry(
            "pack", str(manifest.created_at), state.pack_id, kept, added=kept, skipped=len(state.skipped)
        )
        tables = NewTables(
            meta,
            _labels_table(self.sources.labels, skipped),
            _paths_table(self.sources.relpaths, skipped),
            skipped_entries(self.sources.relpaths, state.skipped, state.skipped_stats),
            [event],
            # Format 4 has format 3's record order: the identity in a fresh pack.
            order=range(kept) if manifest.ordered else None,
            # Files were read: what `pack --update` compares later.
            stats=self._stats(kept) if self.loader is None else None,
        )
        self._commit({**tables.encode(), PROGRESS_KEY: None})
        state.env.sync(True)

    def _stats(self, kept: int) -> tuple[array.array, array.array]:
        """``__stats__``: the size and mtime each record's file had when it was read.

        Records written before a resume were read by a run that ended: their
        files may have changed while it was stopped, and a ``stat`` now would
        vouch for bytes that were read before. Their time is recorded as
        unknown, so an update compares their bytes instead.
        """
        before = self.first_stat
        sizes = array.array("Q", bytes(8 * before)) + self.sizes
        mtimes = array.array("q", [UNKNOWN_MTIME]) * before + self.mtimes
        if len(sizes) != kept:  # a finished partial published by a rerun: nothing read this time
            sizes = array.array("Q", bytes(8 * kept))
            mtimes = array.array("q", [UNKNOWN_MTIME]) * kept
        return sizes, mtimes

    def _manifest(self) -> Manifest:
        sources, state = self.sources, self.state
        return Manifest.new_pack(
            count=state.next_index,
            classes=sources.classes,
            class_to_idx=sources.class_to_idx,
            store=self.options.store,
            pack_id=state.pack_id,
            encodings=self.encodings,
            payload_bytes=state.payload_bytes,
            source=sources.describe(),
            fingerprint=state.fingerprint,
            skipped_count=len(state.skipped),
            params=self.options.params(),
            created_by=f"lmdbfolder {__version__}",
            created_at=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            extra=self.manifest_extra,
        )


def skipped_entries(
    relpaths: Sequence[str], skipped: Sequence[tuple[int, str]], stats: Mapping[int, tuple[int, int]]
) -> list[dict[str, Any]]:
    """The ``__skipped__`` entries: path and reason, and the file's size and mtime
    when it could be opened (an update then skips it again without reading it)."""
    out: list[dict[str, Any]] = []
    for s, reason in skipped:
        entry: dict[str, Any] = {"path": relpaths[s], "reason": reason}
        if s in stats:
            entry["size"], entry["mtime_ns"] = stats[s]
        out.append(entry)
    return out


def nothing_to_pack(root: Any, sources: int) -> SourceError:
    """The error of a pack (or update) left with no image: none found, or every one skipped."""
    if not sources:
        return SourceError(
            root,
            "it holds no image file (its class folders are empty); a pack needs at least one image",
            "add images to it (an update cannot empty a pack: remove the pack yourself if that is what you want)",
        )
    return SourceError(
        root,
        f"every one of its {plural(sources, 'source file')} was skipped; nothing to pack",
        "`lmdbfolder pack SRC DST --dry-run` lists each skipped file and why: fix or replace those files",
    )


def history_entry(event: str, at: str, pack_id: str, count: int, **changes: Any) -> dict[str, Any]:
    """One ``__history__`` entry: ``event`` (``"pack"`` or ``"update"``), when (``at``,
    UTC ISO 8601), the pack id it made, its sample count, and what changed
    (``added``, ``removed``, ``changed``, ``skipped``, ``classes_added``, ...)."""
    return {"event": event, "at": at, "pack_id": pack_id, "count": count, **changes}


def _labels_table(labels: Sequence[int], skipped: set[int]) -> bytes:
    if isinstance(labels, LabelList):
        return labels.table(skipped)
    return encode_labels([label for s, label in enumerate(labels) if s not in skipped])


def _paths_table(paths: Sequence[str], skipped: set[int]) -> bytes | bytearray:
    if isinstance(paths, PathList):
        return paths.table(skipped)
    return encode_paths(p for s, p in enumerate(paths) if s not in skipped)


def check_manifest_size(manifest: bytes | bytearray, root: str) -> None:
    """SourceError when a manifest (or its class list alone) is longer than readers accept
    (``format.MAX_MANIFEST_BYTES``): a pack no reader would open is never written."""
    if len(manifest) > MAX_MANIFEST_BYTES:
        raise SourceError(
            root,
            f"the pack's manifest would be {len(manifest):,} bytes, more than the {MAX_MANIFEST_BYTES:,} "
            "a reader accepts (the class names take most of it)",
            "use fewer classes or shorter class names (with --list, label numbers are the class names)",
        )


def batch_bytes(directory: str, commit_bytes: int, mean_value_size: float) -> int:
    """Bytes per write transaction for a pack written in ``directory``.

    As small as the disk's flush latency allows (``MIN_BATCH_BYTES``, or
    enough that one fdatasync per batch costs about 10% at 1 GB/s), at least
    four records, at most ``commit_bytes``.
    """
    latency = sync_latency(directory)
    want = max(MIN_BATCH_BYTES, 4 * mean_value_size, latency * SYNC_BUDGET_BYTES_PER_SECOND)
    return int(max(1, min(commit_bytes, want)))


def sync_latency(directory: str, rounds: int = 3) -> float:
    """Seconds one small write + fdatasync takes in ``directory`` (the median of ``rounds``).

    Returns infinity when it cannot be measured (then batches stay large).
    """
    path = os.path.join(directory, SYNC_PROBE)
    times = []
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            block = b"\0" * 4096
            for i in range(rounds):
                os.pwrite(fd, block, i * len(block))
                start = time.perf_counter()
                getattr(os, "fdatasync", os.fsync)(fd)
                times.append(time.perf_counter() - start)
        finally:
            os.close(fd)
            os.remove(path)
    except OSError:
        return float("inf")
    return sorted(times)[len(times) // 2]


_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def _write_error(path: str, exc: lmdb.Error) -> PackError:
    text = str(exc)
    code = getattr(exc, "errno", None)
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        free = -1
    full = code in _DISK_FULL or any(w in text for w in ("No space left", "File too large", "Disk quota"))
    if full or "Input/output error" in text:
        # LMDB reports a short write (what a filling disk produces) as EIO.
        what = "the disk is full" if full else "a write failed (a full or failing disk)"
        return PackError(
            f"cannot write {path}: {what} ({text}; {disk_size(max(free, 0))} free); "
            "everything committed so far is kept",
            "free some space and run the same command again: it resumes where it stopped",
        )
    return PackError(
        f"LMDB failed while writing {path}: {text}", "run the same command again to resume from the last commit"
    )

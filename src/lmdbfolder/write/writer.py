"""Pack a source (ImageFolder tree, flat folder or list file) into an LMDB.

How a pack is written (see docs/design.md, "Writing"):

1. The whole sample list is built first (``sources.scan``).
2. Source files are read, checked and turned into records (``records``) by
   reader processes (``processes``) or threads (``threads``) and appended in
   order by one writer, in batched transactions.
3. Each transaction also stores a checkpoint (``__progress__``): how many
   source files are done, which were skipped and a fingerprint of the
   sources and options. Commits are durable, so an interrupted pack resumes
   from its last commit when the same command is run again.
4. The last transaction writes the label and path tables and the manifest.
   The pack is built in ``<dst>.partial``, compacted if it has free pages,
   flushed, and renamed to ``<dst>`` in one step: a directory named ``<dst>``
   is always a complete dataset.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as _dt
import errno
import hashlib
import json
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import lmdb
from PIL import Image

from lmdbfolder import environments, packdir
from lmdbfolder._version import __version__
from lmdbfolder.errors import NotAPackError, OptionError, OutputExistsError, PackError, SourceError
from lmdbfolder.format import (
    CHECK_KEY,
    COMPACT_DIR,
    DATA_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    LABELS_KEY,
    LOCK_FILE,
    MAX_MANIFEST_BYTES,
    META_KEY,
    PARTIAL_SUFFIX,
    PATHS_KEY,
    PROGRESS_KEY,
    SKIPPED_KEY,
    SKIPPED_REPORT,
    SYNC_PROBE,
    bind_record,
    decode_meta,
    decode_progress,
    decode_skipped,
    encode_check,
    encode_key,
    encode_labels,
    encode_meta,
    encode_paths,
    encode_progress,
    encode_skipped,
    new_pack_id,
)
from lmdbfolder.progress import Progress
from lmdbfolder.text import escape_field, plural
from lmdbfolder.write import sizing
from lmdbfolder.write.compact import LabelList, PathList
from lmdbfolder.write.lock import writer_lock
from lmdbfolder.write.options import DEFAULT_COMMIT_EVERY, PackOptions, pack_options
from lmdbfolder.write.processes import ProcessReader, processes_available
from lmdbfolder.write.records import Alloc, Loaded, Skipped, load_sample
from lmdbfolder.write.sources import SourceList, SourceSpec
from lmdbfolder.write.threads import default_workers, ordered_map

__all__ = [
    "PackResult",
    "pack",
    "pack_sources",
    "pack_fingerprint",
    "describe_change",
    "check_outside_source",
    "DEFAULT_COMMIT_EVERY",
    "DEFAULT_COMMIT_BYTES",
    "MIN_BATCH_BYTES",
    "batch_bytes",
    "sync_latency",
    "per_second",
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
_COMPACT_FREE_FRACTION = 0.01


def per_second(amount: float, seconds: float) -> float:
    """``amount / seconds``, 0 for a run that took no measurable time."""
    return amount / seconds if seconds > 0 else 0.0


@dataclass
class PackResult:
    """Summary of a finished pack."""

    path: str
    count: int
    input_bytes: int
    payload_bytes: int
    seconds: float
    store: str
    encodings: dict[str, int] = field(default_factory=dict)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    resumed_from: int = 0
    compacted: bool = False
    #: True when ``path`` already held this pack (same sources, same options):
    #: nothing was read or written, and the numbers are the existing pack's.
    already_packed: bool = False

    @property
    def images_per_second(self) -> float:
        """Samples written per second of wall time (this run; 0 when nothing was to do)."""
        if self.already_packed:
            return 0.0
        return per_second(self.count + len(self.skipped) - self.resumed_from, self.seconds)

    @property
    def mb_per_second(self) -> float:
        """Source megabytes (10**6) read per second of wall time (this run)."""
        return per_second(self.input_bytes / 1e6, self.seconds)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary (used by ``lmdbfolder pack --json``)."""
        return {
            "path": self.path,
            "count": self.count,
            "input_bytes": self.input_bytes,
            "payload_bytes": self.payload_bytes,
            "seconds": round(self.seconds, 3),
            "images_per_second": round(self.images_per_second, 1),
            "mb_per_second": round(self.mb_per_second, 1),
            "store": self.store,
            "encodings": self.encodings,
            "skipped": [{"path": p, "reason": r} for p, r in self.skipped],
            "resumed_from": self.resumed_from,
            "compacted": self.compacted,
            "already_packed": self.already_packed,
        }


def pack(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    options: PackOptions | None = None,
    *,
    layout: str = "imagefolder",
    list_file: str | os.PathLike[str] | None = None,
    allow_empty: bool = False,
    extensions: Sequence[str] | str | None = None,
    is_valid_file: Callable[[str], bool] | None = None,
    match: str | None = None,
    **fields: Any,
) -> PackResult:
    """Pack the images under ``src`` into a new LMDB pack at ``dst``.

    Args:
        src: the source folder (for ``layout="list"``, the folder that the
            list file's relative paths start from).
        dst: the pack directory to create, outside ``src``. It must not exist
            unless ``overwrite=True`` (and then it must be an lmdbfolder pack),
            or unless it is already the pack this call would write: then
            nothing is done and the result says ``already_packed``.
        options: how to write it, a ``PackOptions``; its fields may also be
            given (or overridden) as keywords, e.g. ``pack(src, dst, store="raw")``.
        layout: ``"imagefolder"`` (``src/<class>/**/<image>``, torchvision's
            rules), ``"flat"`` (all images, unlabelled) or ``"list"``.
        list_file: a ``relative/path label`` file; implies ``layout="list"``.
        allow_empty: keep ImageFolder class folders that hold no image.
        extensions: the file name endings to pack (case-insensitive; default:
            ImageFolder's ``IMG_EXTENSIONS``). Recorded in the manifest
            (``source.extensions``) and part of the resume fingerprint.
        is_valid_file: instead of ``extensions``, a callable that gets each
            file's full path and says whether to pack it (ImageFolder's
            ``is_valid_file``); its name is recorded in the manifest.
        match: a regular expression that the path relative to ``src`` must
            contain (``re.search``, ``/`` separators), on top of either filter
            (``pack --match``); recorded and fingerprinted.

    The options (``PackOptions`` fields):
        store: ``"encoded"`` keeps each file's bytes unchanged; ``"raw"``
            stores decoded RGB pixels (no decode at training time, larger).
        check: ``"header"`` (each header read as Pillow reads it; default), ``"decode"``
            (decode every image once) or ``"none"``. Files that fail are
            skipped and reported.
        strict: stop at the first file that cannot be read or fails the check
            (the partial pack stays resumable) instead of skipping it.
        commit_every: samples per write transaction.
        commit_bytes: bytes per write transaction (whichever limit comes
            first). None (default): as small as the disk's flush latency
            allows, 2 MB on most disks, at most 64 MB (see ``batch_bytes``).
        workers: reader processes on Linux when no other Python thread runs,
            else reader threads (default: 2x CPUs, at least 4); 1 reads in
            the calling thread.
        overwrite: replace an existing pack (or unfinished pack) at ``dst``.
        restart: discard an unfinished pack at ``dst`` instead of resuming it.
        space_check: refuse to start when the estimated output does not fit
            on the disk.
        progress: draw a progress bar (``None``: only on a terminal).
        resize: shrink images larger than ``resize.max_size`` and re-encode
            them (a ``Resize``; ``pack --max-size N --quality Q``).

    Returns:
        A PackResult with the count, bytes, time and the skipped files.
        Rerunning a finished ``pack`` with the same source and options does
        nothing and returns the existing pack's result with
        ``already_packed=True``; the same ``dst`` with other sources or
        options raises OutputExistsError saying what differs.

    Example:
        >>> from lmdbfolder import pack
        >>> result = pack("imagenet/train", "train.lmdb")  # doctest: +SKIP
        >>> result.count, len(result.skipped)  # doctest: +SKIP
        (1281167, 0)
    """
    opts = pack_options(options, fields)
    check_outside_source(src, dst)  # before the scan, which would see a DST inside SRC as a class
    spec = SourceSpec(layout, list_file, allow_empty, extensions, is_valid_file, match)
    return pack_sources(spec.scan(src), dst, opts)


def pack_sources(
    sources: SourceList,
    dst: str | os.PathLike[str],
    options: PackOptions | None = None,
    *,
    loader: Callable[[int], Loaded | Skipped] | None = None,
    mean_size: float | None = None,
    manifest_extra: Mapping[str, Any] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    **fields: Any,
) -> PackResult:
    """Pack an already built sample list (see ``sources.scan``) into ``dst``; see ``pack``.

    The whole run holds the writer lock of ``dst`` (``write.lock``): a second
    pack of the same ``dst`` meanwhile fails at once, saying which process
    holds it. Other arguments: see ``_pack_sources``.
    """
    with writer_lock(os.path.abspath(os.path.expanduser(os.fspath(dst)))):
        return _pack_sources(
            sources,
            dst,
            options,
            loader=loader,
            mean_size=mean_size,
            manifest_extra=manifest_extra,
            on_progress=on_progress,
            **fields,
        )


def _pack_sources(
    sources: SourceList,
    dst: str | os.PathLike[str],
    options: PackOptions | None = None,
    *,
    loader: Callable[[int], Loaded | Skipped] | None = None,
    mean_size: float | None = None,
    manifest_extra: Mapping[str, Any] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    **fields: Any,
) -> PackResult:
    """``pack_sources`` with the writer lock held.

    ``options`` and ``fields`` are ``pack``'s. ``loader(i)`` replaces reading
    ``sources.abspath(i)`` from disk (used by ``lmdbfolder import``, whose
    samples come from another database); then ``mean_size``, the expected
    bytes per sample, sizes the map. ``manifest_extra`` adds optional
    manifest fields (a shard's place in its split); they are part of the
    resume fingerprint. ``on_progress(done, total)`` is called after each
    source file (packed or skipped). ``resize`` (pack-time downscaling)
    applies to files read from disk only.
    """
    opts = pack_options(options, fields)
    workers = default_workers() if opts.workers is None else opts.workers
    dst = os.path.abspath(os.path.expanduser(os.fspath(dst)))
    start_time = time.perf_counter()
    if loader is None:
        check_outside_source(sources.root, dst)
    check_manifest_size(encode_meta({"classes": sources.classes, "class_to_idx": sources.class_to_idx}), sources.root)
    fingerprint = pack_fingerprint(sources, opts, manifest_extra)
    existing = _existing_result(dst, fingerprint, opts, start_time)
    if existing is not None:
        return existing
    partial = _prepare_output(dst, overwrite=opts.overwrite, restart=opts.restart)
    plan = sizing.plan(sources, opts, mean_size=mean_size)
    state = _open_partial(partial, fingerprint, plan.map_size, sources.relpaths)
    if state.env.stat()["psize"] != plan.page_size:  # a partial made where pages have another size
        plan = plan.with_page_size(state.env.stat()["psize"])
        state.env.set_mapsize(max(state.env.info()["map_size"], plan.map_size))
    run = _Run(sources, state, opts, loader, manifest_extra, on_progress)
    try:
        if not state.finished:  # else: written before, stopped before it was published
            if opts.space_check:
                _check_free_space(partial, plan, state.next_source)
            with _keep_freed_memory():
                run.write_all(workers, plan.mean_value_size, opts.progress)
    finally:
        state.close()
    # Compact only when free pages are measured above 1%. Neither growing the
    # map nor a resume leaves any by itself: MDB_MAP_FULL aborts a transaction
    # whose pages were never written to the file (no writemap), and a crash
    # loses only pages that were free or past the end in the last commit
    # (measured: the same page count and 0.2% free either way). Forcing the
    # copy after either cost a full rewrite of an ImageNet pack (282 s, 2x its
    # size on disk, all of it in RSS through the map).
    compacted = _compact_if_needed(partial)
    _write_skipped_report(partial, sources, state.skipped)
    _publish(partial, dst)
    return PackResult(
        dst,
        run.count,
        run.input_bytes,
        run.payload_bytes,
        time.perf_counter() - start_time,
        opts.store,
        run.encodings,
        [(sources.relpaths[s], reason) for s, reason in state.skipped],
        state.resumed_from,
        compacted,
    )


# -- the write loop ------------------------------------------------------------
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

    def __init__(
        self,
        sources: SourceList,
        state: _Partial,
        options: PackOptions,
        loader: Callable[[int], Loaded | Skipped] | None,
        manifest_extra: Mapping[str, Any] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.sources = sources
        self.loader = loader
        self.options = options
        self.manifest_extra = dict(manifest_extra or {})
        self.on_progress = on_progress
        self.state = state
        self.batch_limit = options.commit_bytes or DEFAULT_COMMIT_BYTES  # as used (write_all)
        self.input_bytes = 0
        self.batch: list[tuple[bytes, bytes | bytearray | memoryview]] = []
        self.procs: ProcessReader | None = None
        self.interrupted = _Latch()
        self.batch_bytes = 0
        self.max_pixels = Image.MAX_IMAGE_PIXELS

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
                    bar.write(f"skipped {self.sources.relpaths[s]}: {result.reason}")
                else:
                    value = bind_record(result.value, state.binding, state.next_index)
                    self.batch.append((encode_key(state.next_index), value))
                    self.batch_bytes += len(result.value)
                    state.next_index += 1
                    state.encodings[result.encoding] = state.encodings.get(result.encoding, 0) + 1
                    state.payload_bytes += len(result.value)
                    self.input_bytes += result.source_bytes
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
            raise SourceError(self.sources.root, "every source file was skipped; nothing to pack")
        # Straight from the compact sample list: no Python object per sample.
        tables = {
            META_KEY: encode_meta(self._manifest()),
            LABELS_KEY: _labels_table(self.sources.labels, skipped),
            PATHS_KEY: _paths_table(self.sources.relpaths, skipped),
            SKIPPED_KEY: encode_skipped([{"path": self.sources.relpaths[s], "reason": r} for s, r in state.skipped]),
        }
        check_manifest_size(tables[META_KEY], self.sources.root)
        self._commit({**tables, CHECK_KEY: encode_check(tables), PROGRESS_KEY: None})
        state.env.sync(True)

    def _manifest(self) -> dict[str, Any]:
        sources, state = self.sources, self.state
        manifest = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "count": state.next_index,
            "classes": sources.classes,
            "class_to_idx": sources.class_to_idx,
            "store": self.options.store,
            "encodings": self.encodings,
            "payload_bytes": state.payload_bytes,
            "checksum": "crc32",
            "source": sources.describe(),
            "fingerprint": state.fingerprint,
            "pack_id": state.pack_id,
            "skipped_count": len(state.skipped),
            "created_by": f"lmdbfolder {__version__}",
            "created_at": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "params": self.options.params(),
        }
        clash = sorted(set(self.manifest_extra) & set(manifest))
        if clash:
            raise ValueError(f"manifest_extra must not replace the manifest fields {clash}")
        manifest.update(self.manifest_extra)
        return manifest


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


class _Latch:
    """Whether a SIGINT arrived during the pack (true once it has)."""

    def __init__(self) -> None:
        self.hit = False

    def __bool__(self) -> bool:
        return self.hit


@contextlib.contextmanager
def _interrupt_latch() -> Iterator[_Latch]:
    """Remember a Ctrl-C as well as raising it, while Python's own handler is in place.

    Python raises KeyboardInterrupt wherever the main thread is when the
    signal is handled; inside a ``__del__`` (multiprocessing's connections
    have one) or a weakref callback it only prints "Exception ignored", and
    the pack ran on to the end. The writer checks the latch before each
    record instead of trusting the raise. A handler the program installed
    itself is left alone, as is any thread but the main one.
    """
    latch = _Latch()
    import signal

    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield latch
        return

    def on_sigint(signum: int, frame: Any) -> None:
        latch.hit = True
        signal.default_int_handler(signum, frame)

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield latch
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def _keep_freed_memory() -> Iterator[None]:
    """Let glibc keep freed heap memory while packing, then restore its defaults.

    Every record passes through a ~100 KB buffer of ours and a dirty page
    buffer of LMDB's; with glibc's defaults each is returned to the kernel
    when freed and faulted in again for the next record. Keeping them cut the
    kernel time of a 1 GB pack by about a quarter (benchmarks/bench_pack.py).
    """
    mallopt = _glibc_mallopt()
    if mallopt is None:
        yield
        return
    mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    try:
        yield
    finally:
        mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)
        mallopt(_M_MMAP_THRESHOLD, _DEFAULT_MMAP_THRESHOLD)


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_DEFAULT_TRIM_THRESHOLD = 128 * 1024
_DEFAULT_MMAP_THRESHOLD = 128 * 1024


def _glibc_mallopt() -> Any:
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None  # not glibc (musl, ...): nothing to tune
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


# -- planning ------------------------------------------------------------------
def pack_fingerprint(
    sources: SourceList, options: PackOptions, manifest_extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """What identifies a pack of ``sources`` written with ``options``: the
    resume checkpoint and the finished manifest both store it.

    A resumed pack must share it with the run that started it, and a finished
    pack with the same fingerprint is what a rerun of the same command would
    write again (``pack`` then does nothing). It costs a hash of the sample
    list (paths and labels), no file is read.
    """
    h = sources.hash_samples(hashlib.sha256())
    fingerprint = {
        "layout": sources.layout,
        "root": sources.root,
        "list_file": sources.list_file,
        "samples": len(sources),
        "samples_sha256": h.hexdigest(),
        "classes_sha256": hashlib.sha256(json.dumps(sources.classes, ensure_ascii=True).encode()).hexdigest(),
        **sources.filter_fingerprint(),
        **options.fingerprint(),
    }
    if manifest_extra:
        fingerprint["manifest_extra"] = dict(manifest_extra)
    return fingerprint


def check_outside_source(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Refuse (OptionError) a pack directory ``dst`` inside the source folder ``src``, or around it.

    A pack written into its own source becomes part of it (``DST.partial``
    while it is written, then ``DST``): the next scan would see it, and an
    ImageFolder tree would gain a class folder without images. For a list
    file, ``src`` is the folder its paths start from.
    """
    root = os.path.abspath(os.path.expanduser(os.fspath(src)))
    out = os.path.abspath(os.path.expanduser(os.fspath(dst)))
    if not os.path.isdir(root):
        return  # the scan reports a missing source
    for path in (out, out + PARTIAL_SUFFIX):
        if packdir.overlap(path, root):
            inside = os.path.realpath(path) != os.path.realpath(root) and os.path.realpath(root).startswith(
                os.path.realpath(path) + os.sep
            )
            if os.path.realpath(path) == os.path.realpath(root):
                where = "it is the source folder"
            elif inside:
                where = f"the source folder {root} is inside it"
            else:
                where = f"it is inside the source folder {root}"
            suggestion = os.path.join(os.path.dirname(root.rstrip(os.sep)) or os.sep, os.path.basename(out))
            raise OptionError(
                f"cannot pack into {path}: {where}, so the pack would become part of the source it packs",
                f"choose an output path outside {root}"
                + (f", for example {suggestion}" if not packdir.overlap(suggestion, root) else ""),
            )


def _existing_result(
    dst: str, fingerprint: dict[str, Any], options: PackOptions, start_time: float
) -> PackResult | None:
    """The finished pack at ``dst`` if it is the one this run would write (nothing to do).

    None when ``dst`` does not exist, ``overwrite`` is set, or it is not a
    readable pack (``_prepare_output`` then decides). A pack of other
    sources or options raises OutputExistsError saying what differs.
    """
    if options.overwrite or os.path.islink(dst) or packdir.inspect(dst).kind is not packdir.Kind.PACK:
        return None
    try:
        blob = environments.read_manifest(dst)
        meta = decode_meta(blob, where=dst)
        skipped_items = environments.read_skipped(dst) if meta.get("fingerprint") == fingerprint else []
    except NotAPackError:
        return None
    old = meta.get("fingerprint")
    if old != fingerprint:
        what = (
            describe_change(old, fingerprint)
            if isinstance(old, dict)
            else "it records no fingerprint (an older lmdbfolder made it)"
        )
        raise OutputExistsError(
            dst,
            f"already holds a pack of other sources or options: {what}",
            "pass --overwrite to replace it, or choose another output path",
        )
    skipped = [(str(item.get("path")), str(item.get("reason", ""))) for item in skipped_items]
    return PackResult(
        dst,
        int(meta["count"]),
        0,
        int(meta.get("payload_bytes") or 0),
        time.perf_counter() - start_time,
        str(meta["store"]),
        dict(meta.get("encodings") or {}),
        skipped,
        already_packed=True,
    )


_FINGERPRINT_WORDS = {
    "layout": "the source layout",
    "root": "the source folder",
    "list_file": "the list file",
    "samples": "the number of source files",
    "samples_sha256": "the list of source files or their labels",
    "classes_sha256": "the class names",
    "extensions": "--extensions",
    "match": "--match",
    "store": "--store",
    "check": "--check",
    "resize": "--max-size/--quality/--resize-side/--format",
    "manifest_extra": "the shard's place in its split",
}


def describe_change(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """In words, how the fingerprint ``new`` (this run) differs from ``old`` (on disk)."""
    changes = []
    for key, words in _FINGERPRINT_WORDS.items():
        if old.get(key) != new.get(key):
            if key.endswith("sha256") or key == "manifest_extra":
                changes.append(f"{words} changed")
            else:
                changes.append(f"{words} was {old.get(key)!r}, now {new.get(key)!r}")
    return "; ".join(changes) or "the options changed"


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


def _check_free_space(partial: str, plan: sizing.Plan, done: int) -> None:
    """Refuse to start when the disk holding ``partial`` has less room than what is
    left to write once ``done`` sources are (the upper bound of ``plan.remaining``)."""
    free = shutil.disk_usage(partial).free
    need = plan.remaining(done).upper + (1 << 20)  # and skipped.txt, the sync probe, lock.mdb
    if need > free:
        raise PackError(
            f"the pack needs about {need / 1e9:,.2f} GB but only {free / 1e9:,.2f} GB are free "
            f"on the disk holding {partial}",
            "free some space or pack to another disk (pass --no-space-check to try anyway)",
        )


# -- the output directory ------------------------------------------------------
def _prepare_output(dst: str, *, overwrite: bool, restart: bool) -> str:
    """Check the output path; return ``<dst>.partial`` (existing, to resume, or new).

    Whether ``dst`` and ``<dst>.partial`` may be replaced is ``packdir``'s
    call: only a directory that is provably an lmdbfolder pack (or our own
    unfinished one) ever is.
    """
    if os.path.lexists(dst):
        if not overwrite:
            raise OutputExistsError(dst)
        packdir.check_replaceable(dst)
    partial = dst + PARTIAL_SUFFIX
    if os.path.lexists(partial) and (overwrite or restart):
        packdir.remove(partial)
    if os.path.islink(partial):
        raise OutputExistsError(partial, "is a symbolic link", "remove it or choose another output path")
    if not os.path.lexists(partial):
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.mkdir(partial)
    elif not os.path.isdir(partial):
        raise OutputExistsError(
            partial, "is in the way (it is not a directory)", "remove it or choose another output path"
        )
    return partial


def _open_env(partial: str, map_size: int) -> lmdb.Environment:
    try:
        return lmdb.open(
            partial,
            map_size=map_size,  # sizing.plan's, which holds room on top of the estimate
            subdir=True,
            readahead=False,
            meminit=False,
            max_dbs=0,
            # Every commit is durable, so that a resume can trust it; metasync
            # off keeps the last commit's meta page unsynced, which a crash can
            # only roll back (to the commit before), never corrupt.
            sync=True,
            metasync=False,
            # Never writemap: with it, a full disk kills the process (SIGBUS)
            # instead of failing the commit. (Measured, it was also slower here.)
            writemap=False,
        )
    except lmdb.Error as exc:
        raise OutputExistsError(
            partial, f"holds something LMDB cannot open ({exc})", "remove it, or pass --restart to start over"
        ) from None


def _open_partial(partial: str, fingerprint: dict[str, Any], map_size: int, relpaths: Sequence[str]) -> _Partial:
    """Open ``<dst>.partial``; resume its checkpoint if it has one that matches."""
    env = _open_env(partial, map_size)
    try:
        if env.info()["map_size"] < map_size:
            env.set_mapsize(map_size)
        with env.begin() as txn:
            blob = txn.get(PROGRESS_KEY)
            has_meta = txn.get(META_KEY) is not None
            has_records = txn.get(encode_key(0)) is not None
    except BaseException:
        env.close()
        raise
    if blob is None:
        if has_meta:
            return _finished_partial(partial, env, fingerprint, relpaths)
        if has_records:
            env.close()
            raise OutputExistsError(
                partial, "holds records but no checkpoint to resume from", "pass --restart to start over"
            )
        return _Partial(partial, env, fingerprint, {})
    progress = decode_progress(blob, where=partial)
    if "pack_id" not in progress and progress.get("next_index", 0) > 0:
        env.close()
        raise OutputExistsError(
            partial,
            "holds an unfinished pack started by an older lmdbfolder (format 1); this one writes format 2",
            "pass --restart to start over, or finish it with the lmdbfolder version that started it",
        )
    if progress.get("fingerprint") != fingerprint:
        env.close()
        raise OutputExistsError(
            partial,
            "holds an unfinished pack started with different sources or options: "
            + describe_change(progress.get("fingerprint") or {}, fingerprint),
            "rerun with the original sources and options to resume it, or pass --restart to start over",
        )
    return _Partial(partial, env, fingerprint, progress)


def _finished_partial(
    partial: str, env: lmdb.Environment, fingerprint: dict[str, Any], relpaths: Sequence[str]
) -> _Partial:
    """A partial pack whose last transaction (the manifest) committed, but which
    was not published (for example the disk filled up while compacting it)."""
    with env.begin() as txn:
        meta = decode_meta(txn.get(META_KEY), where=partial)
        skipped_blob = txn.get(SKIPPED_KEY)
    if meta.get("fingerprint") != fingerprint:
        env.close()
        raise OutputExistsError(
            partial,
            "holds a finished but unpublished pack of different sources or options: "
            + describe_change(meta.get("fingerprint") or {}, fingerprint),
            "pass --restart to start over",
        )
    # Same sources (the fingerprint matched): find the skipped ones' positions
    # without a dict of every path.
    skipped = meta.get("skipped", []) if skipped_blob is None else decode_skipped(skipped_blob, where=partial)
    wanted = {item["path"] for item in skipped}
    position = {p: i for i, p in enumerate(relpaths) if p in wanted} if wanted else {}
    progress = {
        "next_source": len(relpaths),
        "next_index": meta["count"],
        "skipped": [[position[item["path"]], item.get("reason", "")] for item in skipped],
        "encodings": meta.get("encodings", {}),
        "payload_bytes": meta.get("payload_bytes", 0),
        "grew": True,  # unknown: it may have (informational only)
        "finished": True,
        "pack_id": meta.get("pack_id"),
    }
    return _Partial(partial, env, fingerprint, progress)


def _free_fraction(env: lmdb.Environment) -> float:
    stat = env.stat()
    used = stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"] + 2  # 2 meta pages
    total = env.info()["last_pgno"] + 1
    return max(0.0, (total - used) / total)


def _compact_if_needed(partial: str, *, force: bool = False) -> bool:
    """Rewrite data.mdb without free pages (LMDB's consistent copy with
    compaction) when they are at least 1% of it, or when ``force``."""
    env = lmdb.open(partial, readonly=True, lock=False, subdir=True)
    try:
        if not force and _free_fraction(env) < _COMPACT_FREE_FRACTION:
            return False
        tmp = os.path.join(partial, COMPACT_DIR)
        shutil.rmtree(tmp, ignore_errors=True)
        os.mkdir(tmp)
        try:
            env.copy(tmp, compact=True)
        except lmdb.Error:
            # No room for the compacted copy (it needs as much space as the
            # pack): publish the pack as it is; it is complete, just not dense.
            shutil.rmtree(tmp, ignore_errors=True)
            return False
    finally:
        env.close()
    packdir.fsync_path(os.path.join(tmp, DATA_FILE))
    os.replace(os.path.join(tmp, DATA_FILE), os.path.join(partial, DATA_FILE))
    os.rmdir(tmp)
    return True


def _write_skipped_report(partial: str, sources: SourceList, skipped: list[tuple[int, str]]) -> None:
    path = os.path.join(partial, SKIPPED_REPORT)
    if not skipped:
        if os.path.exists(path):
            os.remove(path)
        return
    with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write(
            f"# {plural(len(skipped), 'source file')} not packed (path<TAB>reason), relative to {sources.root}\n"
            "# a backslash, tab, newline or carriage return in a path or reason is written as \\\\, \\t, \\n, \\r\n"
        )
        for s, reason in skipped:
            f.write(f"{escape_field(sources.relpaths[s])}\t{escape_field(reason)}\n")


def _publish(partial: str, dst: str) -> None:
    """Make the finished pack visible at ``dst`` in one rename, after it is on disk."""
    lock = os.path.join(partial, LOCK_FILE)
    if os.path.exists(lock):
        os.remove(lock)  # readers open with lock=False; a stale lock file is just clutter
    packdir.fsync_path(os.path.join(partial, DATA_FILE))
    packdir.publish(partial, dst)


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
            f"cannot write {path}: {what} ({text}; {max(free, 0) / 1e9:,.2f} GB free); "
            "everything committed so far is kept",
            "free some space and run the same command again: it resumes where it stopped",
        )
    return PackError(
        f"LMDB failed while writing {path}: {text}", "run the same command again to resume from the last commit"
    )

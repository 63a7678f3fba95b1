"""Pack a source (ImageFolder tree, flat folder or list file) into an LMDB: the entry points.

How a pack is written (see docs/design.md, "Writing"), and which module does it:

1. The whole sample list is built first (``sources``: ``SourceSpec.scan``).
2. ``sizing.plan`` decides the map size and the free-space estimate, once.
3. ``output`` checks the output path and makes ``<dst>.partial``; ``resume``
   tells whether the pack is already written, or opens the partial pack and
   resumes its checkpoint when sources and options are the same.
4. Source files are read, checked and turned into records (``records``) by
   reader processes (``processes``) or threads (``threads``) and appended in
   order by one writer, in batched transactions (``loop``). Each transaction
   also stores a checkpoint (``__progress__``): how many source files are
   done, which were skipped and a fingerprint of the sources and options.
   Commits are durable, so an interrupted pack resumes from its last commit
   when the same command is run again.
5. The last transaction writes the label and path tables and the manifest.
   The pack is compacted if it has free pages, flushed, and renamed to
   ``<dst>`` in one step (``output``): a directory named ``<dst>`` is always
   a complete dataset.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from lmdbfolder.errors import SkippedFilesWarning
from lmdbfolder.format import SKIPPED_REPORT, encode_meta
from lmdbfolder.text import printable
from lmdbfolder.write import output, planner, resume, sizing, update
from lmdbfolder.write.lock import writer_lock
from lmdbfolder.write.loop import Job, _Run, check_manifest_size
from lmdbfolder.write.options import PackOptions, pack_options
from lmdbfolder.write.planner import Kind, PackRequest, Plan, updatable
from lmdbfolder.write.records import Loaded, Skipped
from lmdbfolder.write.sources import SourceList, SourceSpec
from lmdbfolder.write.threads import default_workers
from lmdbfolder.write.update import Changes

__all__ = ["PackResult", "execute_single", "pack", "pack_sources", "per_second", "warn_skipped"]


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
    #: After ``update=True`` changed the pack: what changed (added, removed,
    #: changed samples, classes). None for a pack written anew, or when the
    #: pack was already up to date (``already_packed``).
    changes: Changes | None = None

    @property
    def images_per_second(self) -> float:
        """Samples written per second of wall time (this run; 0 when nothing was to do)."""
        if self.already_packed:
            return 0.0
        if self.changes is not None:  # an update: the files it read
            return per_second(self.changes.read - self.resumed_from, self.seconds)
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
            "changes": None if self.changes is None else self.changes.as_dict(),
        }


def pack(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    options: PackOptions | None = None,
    *,
    layout: str | None = None,
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
            rules; the default), ``"flat"`` (all images, unlabelled) or
            ``"list"``. None: ``"imagefolder"``, or with ``update`` the pack's.
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

    The options are ``PackOptions``' fields (its docstring says what each does):
    ``store``, ``check``, ``strict``, ``commit_every``, ``commit_bytes``,
    ``workers``, ``overwrite``, ``update`` (bring the pack at ``dst`` up to date
    with ``src`` in place, reading only the changed files), ``restart``,
    ``space_check``, ``progress`` and ``resize``.

    Skipped files are also announced with a ``SkippedFilesWarning`` naming
    their count and ``DST/skipped.txt`` (the command line lists them itself).
    The CLI's names ``max_size``, ``quality``, ``resize_side`` and
    ``resize_format`` work as keywords too (they make ``resize``).

    Returns:
        A PackResult with the count, bytes, time and the skipped files
        (``result.skipped``: ``(relative path, reason)`` each; and, after an
        update, ``changes``). Rerunning a finished ``pack`` with the same
        source and options does nothing and returns the existing pack's result
        with ``already_packed=True`` (so does an update that finds nothing
        changed); the same ``dst`` with other sources or options raises
        OutputExistsError saying what differs, unless ``update``.

    Example:
        >>> from lmdbfolder import pack
        >>> result = pack("imagenet/train", "train.lmdb")  # doctest: +SKIP
        >>> result.count, len(result.skipped)  # doctest: +SKIP
        (1281167, 0)
    """
    request = PackRequest(
        src,
        dst,
        SourceSpec(layout, list_file, allow_empty, extensions, is_valid_file, match),
        pack_options(options, fields),
    )
    return execute_single(planner.plan(request))


def execute_single(planned: Plan) -> PackResult:
    """The executor of a single pack (``Kind.SINGLE``) and of its update in place
    (``Kind.UPDATE``): ``pack_sources`` of the planned sample list, then the
    ``SkippedFilesWarning`` (none when the pack was already written)."""
    if planned.kind not in (Kind.SINGLE, Kind.UPDATE):
        raise ValueError(f"execute_single runs single packs and their updates, not a {planned.kind.value} plan")
    result = pack_sources(planned.sources, planned.dst, planned.options)
    if not result.already_packed:
        warn_skipped(result.skipped, os.path.join(result.path, SKIPPED_REPORT), stacklevel=4)
    return result


def warn_skipped(skipped: Sequence[tuple[str, str]], listed_in: str, *, stacklevel: int = 3) -> None:
    """Warn (``SkippedFilesWarning``) that ``skipped`` files were left out, with the
    first few and where the whole list is; nothing when none were."""
    if not skipped:
        return
    n = len(skipped)
    # A warning reaches a terminal: file names (anyone's) with their control characters escaped.
    first = "; ".join(f"{printable(path, 1000)}: {printable(reason)}" for path, reason in skipped[:3])
    first += "; ..." if n > 3 else ""
    warnings.warn(
        f"{n:,} source file{'s' if n != 1 else ''} could not be packed and {'were' if n != 1 else 'was'} skipped "
        f"({first}); listed in {listed_in} and in the result's .skipped (strict=True stops at the first instead)",
        SkippedFilesWarning,
        stacklevel=stacklevel,
    )


def pack_sources(
    sources: SourceList,
    dst: str | os.PathLike[str],
    options: PackOptions | None = None,
    *,
    loader: Callable[[int], Loaded | Skipped] | None = None,
    mean_size: float | None = None,
    manifest_extra: Mapping[str, Any] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    stat: Callable[[int], tuple[int, int]] | None = None,
    **fields: Any,
) -> PackResult:
    """Pack an already built sample list (see ``sources.scan``) into ``dst``; see ``pack``.

    ``options`` and ``fields`` are ``pack``'s. ``loader(i)`` replaces reading
    ``sources.abspath(i)`` from disk (used by ``lmdbfolder import``, whose
    samples come from another database); then ``mean_size``, the expected
    bytes per sample, sizes the map. ``manifest_extra`` adds optional
    manifest fields (a shard's place in its split); they are part of the
    resume fingerprint. ``on_progress(done, total)`` is called after each
    source file (packed or skipped). ``resize`` (pack-time downscaling)
    applies to files read from disk only. ``stat(i)``, with a loader: what
    ``update=True`` compares of sample ``i`` instead of its file's size and
    mtime (samples of several files: ``write.fields``); without it, an update
    of a pack written with a loader is a new pack.

    The whole run holds the writer lock of ``dst`` (``write.lock``): a second
    pack of the same ``dst`` meanwhile fails at once, saying which process
    holds it.
    """
    job = Job(
        sources=sources,
        dst=os.path.abspath(os.path.expanduser(os.fspath(dst))),
        options=pack_options(options, fields),
        loader=loader,
        mean_size=mean_size,
        manifest_extra=dict(manifest_extra or {}),
        on_progress=on_progress,
        stat=stat,
    )
    with writer_lock(job.dst):
        return _write(job)


def _update(job: Job, start_time: float) -> PackResult:
    """``pack_sources`` of an update (``write.update``)."""
    done = update.update(
        job.sources,
        job.dst,
        job.options,
        manifest_extra=job.manifest_extra,
        on_progress=job.on_progress,
        loader=job.loader,
        stat=job.stat,
    )
    meta = done.meta
    return PackResult(
        job.dst,
        meta.count,
        done.read_bytes,
        meta.payload_bytes or 0,
        time.perf_counter() - start_time,
        meta.store,
        dict(meta.encodings or {}),
        done.skipped,
        resumed_from=done.resumed_from,
        compacted=done.compacted,
        already_packed=done.changes is None,
        changes=done.changes,
    )


def _write(job: Job) -> PackResult:
    """``pack_sources`` with the writer lock held."""
    sources, dst, opts = job.sources, job.dst, job.options
    workers = default_workers() if opts.workers is None else opts.workers
    start_time = time.perf_counter()
    if job.loader is None:
        output.check_outside_source(sources.root, dst)
    check_manifest_size(encode_meta({"classes": sources.classes, "class_to_idx": sources.class_to_idx}), sources.root)
    if opts.update:
        if (job.loader is None or job.stat is not None) and updatable(dst):
            return _update(job, start_time)
        # Nothing to update: pack it (or finish the pack started there).
        opts = opts.for_new_pack()
        job = dataclasses.replace(job, options=opts)
    fingerprint = resume.pack_fingerprint(sources, opts, job.manifest_extra)
    existing = resume._existing_pack(dst, fingerprint, opts)
    if existing is not None:
        meta, skipped = existing
        return PackResult(
            dst,
            meta.count,
            0,
            meta.payload_bytes or 0,
            time.perf_counter() - start_time,
            meta.store,
            dict(meta.encodings or {}),
            skipped,
            already_packed=True,
        )
    partial = output._prepare_output(dst, overwrite=opts.overwrite, restart=opts.restart)
    plan = sizing.plan(sources, opts, mean_size=job.mean_size)
    state = resume._open_partial(partial, fingerprint, plan.map_size, sources.relpaths)
    if state.env.stat()["psize"] != plan.page_size:  # a partial made where pages have another size
        plan = plan.with_page_size(state.env.stat()["psize"])
        state.env.set_mapsize(max(state.env.info()["map_size"], plan.map_size))
    run = _Run(job, state)
    try:
        if not state.finished:  # else: written before, stopped before it was published
            if opts.space_check:
                output._check_free_space(partial, plan, state.next_source)
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
    compacted = output._compact_if_needed(partial)
    output._write_skipped_report(partial, sources, state.skipped)
    output._publish(partial, dst)
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

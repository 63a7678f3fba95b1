"""``pack --dry-run``: what a pack would hold, before hours of work.

``dry_run`` scans the source as ``pack`` would (the same ``SourceSpec``),
checks every file as the pack would (the same ``load_sample``, with the same
options: what it would skip, and why), and sizes the result with the pack's
own model (``sizing.plan``). Nothing is written: not ``DST``, not
``DST.partial``, no lock. Checking reads every file once, so it costs about
what reading them costs in the pack itself; ``check_files=False`` (``pack
--dry-run --check none``) only scans and estimates.
"""

from __future__ import annotations

import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from lmdbfolder import packdir
from lmdbfolder.progress import Progress
from lmdbfolder.write import planner, sizing
from lmdbfolder.write.options import PackOptions, pack_options
from lmdbfolder.write.planner import Kind, PackRequest, Plan
from lmdbfolder.write.records import Skipped, load_sample
from lmdbfolder.write.sources import SourceList, SourceSpec
from lmdbfolder.write.threads import default_workers, ordered_map

__all__ = ["DryRun", "dry_run", "execute_dry_run"]


@dataclass
class DryRun:
    """What ``pack(src, dst, ...)`` would do (``pack --dry-run``); nothing was written."""

    src: str
    dst: str
    layout: str
    #: source files found (before any check)
    files: int
    classes: list[str]
    #: files per class (ImageFolder trees and labelled lists)
    class_counts: dict[str, int]
    #: files the check would skip, as ``(relative path, reason)``
    would_skip: list[tuple[str, str]] = field(default_factory=list)
    #: whether every file was checked (``check != "none"``)
    checked: bool = True
    check: str = "header"
    #: the pack's size on disk as the writer's own model expects it, and its upper bound
    estimated_bytes: int = 0
    estimated_upper_bytes: int = 0
    #: free bytes on the disk that would hold DST
    free_bytes: int = 0
    #: what is at DST already (``packdir.Kind``'s words: "a pack", "an unfinished pack", ...), None: nothing
    dst_exists: str | None = None
    #: what ``pack`` would do with what is at DST (None: nothing there)
    dst_note: str | None = None
    seconds: float = 0.0

    @property
    def would_pack(self) -> int:
        """Samples the pack would hold."""
        return self.files - len(self.would_skip)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (``lmdbfolder pack --dry-run --json``)."""
        return {
            "dry_run": True,
            "src": self.src,
            "dst": self.dst,
            "layout": self.layout,
            "files": self.files,
            "would_pack": self.would_pack,
            "classes": self.classes,
            "class_counts": self.class_counts,
            "would_skip": [{"path": p, "reason": r} for p, r in self.would_skip],
            "checked": self.checked,
            "check": self.check,
            "estimated_bytes": self.estimated_bytes,
            "estimated_upper_bytes": self.estimated_upper_bytes,
            "free_bytes": self.free_bytes,
            "dst_exists": self.dst_exists,
            "dst_note": self.dst_note,
            "seconds": round(self.seconds, 3),
        }


def dry_run(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    options: PackOptions | None = None,
    *,
    layout: str | None = "imagefolder",
    list_file: str | os.PathLike[str] | None = None,
    allow_empty: bool = False,
    extensions: Sequence[str] | str | None = None,
    is_valid_file: Callable[[str], bool] | None = None,
    match: str | None = None,
    **fields: Any,
) -> DryRun:
    """What ``pack(src, dst, options, ...)`` (same arguments) would pack, skip and take on disk.

    Every file is checked with the pack's ``check`` (and ``store``, ``resize``)
    by ``workers`` threads, with a progress bar or progress lines as the
    pack's; ``check="none"`` checks nothing. Errors that ``pack`` would raise
    before it starts (a DST inside SRC, no class folder, an empty class, a bad
    list file) are raised here too.
    """
    source = SourceSpec(layout, list_file, allow_empty, extensions, is_valid_file, match)
    return execute_dry_run(planner.plan(PackRequest(src, dst, source, pack_options(options, fields), dry_run=True)))


def execute_dry_run(planned: Plan) -> DryRun:
    """The executor of ``Kind.DRY_RUN``: every planned file through the pack's check, and the
    pack's size model; nothing is written."""
    if planned.kind is not Kind.DRY_RUN:
        raise ValueError(f"execute_dry_run runs dry runs, not a {planned.kind.value} plan")
    sources, opts = planned.sources, planned.options
    dst_path = os.path.abspath(os.path.expanduser(os.fspath(planned.dst)))
    skipped = _check_files(sources, opts) if opts.check != "none" else []
    estimate = sizing.plan(sources, opts).estimate
    labels = Counter(sources.labels[i] for i in range(len(sources)))
    return DryRun(
        src=sources.root,
        dst=dst_path,
        layout=sources.layout,
        files=len(sources),
        classes=list(sources.classes),
        class_counts={name: labels.get(k, 0) for name, k in sources.class_to_idx.items()},
        would_skip=skipped,
        checked=opts.check != "none",
        check=opts.check,
        estimated_bytes=estimate.expected,
        estimated_upper_bytes=estimate.upper,
        free_bytes=_free_bytes(dst_path),
        dst_exists=_what_is_there(dst_path),
        dst_note=_what_pack_would_do(dst_path),
        seconds=time.perf_counter() - planned.start_time,
    )


def _check_files(sources: SourceList, opts: PackOptions) -> list[tuple[str, str]]:
    """Every file through the pack's own check; the skipped ones and why, in order."""
    from PIL import Image

    max_pixels = Image.MAX_IMAGE_PIXELS
    workers = default_workers() if opts.workers is None else opts.workers

    def check(i: int) -> str | None:
        result = load_sample(
            sources.abspath(i),
            sources.labels[i],
            store=opts.store,
            check=opts.check,
            max_pixels=max_pixels,
            resize=opts.resize,
        )
        return result.reason if isinstance(result, Skipped) else None

    skipped = []
    results = ordered_map(check, range(len(sources)), workers=workers, max_inflight=4 * workers)
    try:
        with Progress(len(sources), "dry run: check", enabled=opts.progress) as bar:
            for i, reason in enumerate(results):
                if reason is not None:
                    skipped.append((sources.relpaths[i], reason))
                bar.update(1)
    finally:
        results.close()
    return skipped


def _free_bytes(dst: str) -> int:
    """Free bytes on the disk of ``dst`` (its nearest existing parent)."""
    path = dst
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def _what_is_there(dst: str) -> str | None:
    """What ``dst`` holds already (``packdir.inspect``'s words), or None for nothing."""
    kind = packdir.inspect(dst).kind
    return None if kind is packdir.Kind.MISSING else kind.value


def _what_pack_would_do(dst: str) -> str | None:
    """What is at ``dst`` and what ``pack`` does with it, as its refusals say it (None: nothing there)."""
    kind = packdir.inspect(dst).kind
    if kind in (packdir.Kind.PACK, packdir.Kind.SHARDED):
        return (
            f"holds {kind.value} already: pack does nothing if it was packed from this source with these "
            "options; other ones need --overwrite, or --update to bring it up to date"
        )
    if kind in (packdir.Kind.UNFINISHED, packdir.Kind.UNFINISHED_SHARDED):
        return f"holds {kind.value}: the same pack command resumes it"
    if kind is packdir.Kind.FILE:
        return "is a file: pack refuses to replace it, even with --overwrite; choose another output path"
    if kind is packdir.Kind.OTHER:
        try:
            empty = not os.listdir(dst)
        except OSError:
            empty = False
        if empty:
            return "is an empty directory: pack uses it with --overwrite"
        return (
            "is a directory that is not a pack: pack refuses to replace it, even with --overwrite; "
            "choose another output path"
        )
    return None

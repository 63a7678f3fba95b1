"""Sharded packs: a directory of ordinary packs (the shards) and one small JSON index.

Layout (FORMAT.md, "Sharded packs")::

    DST/
      train-00000-of-00004.lmdb/    an ordinary pack of sources 0 .. a-1
      train-00001-of-00004.lmdb/    an ordinary pack of sources a .. b-1
      ...
      index.json                    shard names, counts, checksums, classes

* The split is deterministic and contiguous: shard ``i`` of ``N`` packs the
  sources ``floor(i*S/N) .. floor((i+1)*S/N) - 1`` of the complete sample list
  (``S`` files). So the global sample order of a sharded pack is the order of
  the single pack of the same source, and any machine that scans the same
  source can pack any shard by itself (``pack_shard``): a Slurm array, a
  Kubernetes job or Ray (``lmdbfolder.write.ray``).
* Every shard is written by the ordinary writer (``pack_sources`` on a slice
  of the sample list), so resuming, skipping bad files and ``strict`` work
  exactly as for a single pack. Each shard's manifest records its place in
  the split (the optional ``shard`` field).
* Skipped files shift counts, so the index is built from the finished
  shards' real counts (``write_index``), never from the plan.
* Reading is in ``lmdbfolder.read.sharded``: ``open_pack(DST)`` (and so
  ``LMDBFolder``) opens a sharded pack with the API of a single one.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import math
import os
import re
import reprlib
import shutil
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from lmdbfolder import packdir, packfile
from lmdbfolder._version import __version__
from lmdbfolder.encodings import DEFAULT_RESIZE_FORMAT
from lmdbfolder.errors import NotAPackError, OptionError, OutputExistsError, PackError, SourceError
from lmdbfolder.format import (
    COPYING_SUFFIX,
    DAMAGED_HINT,
    DATA_FILE,
    META_KEY,
    RETAINED_FILE,
    SHARD_FIELD,
    SHARD_INDEX_FILE,
    SHARD_INDEX_TMP,
    Manifest,
    ShardEntry,
    ShardIndex,
    ShardPlace,
    ShardSplit,
    check_paths,
    decode_meta,
    parse_shard_name,
    shard_identity,
    shard_name,
    tables_digest,
)
from lmdbfolder.progress import Progress
from lmdbfolder.text import disk_size, printable, skipped_line
from lmdbfolder.write import planner, sizing
from lmdbfolder.write.compact import PathList
from lmdbfolder.write.options import PackOptions, pack_options
from lmdbfolder.write.planner import DEFAULT_PREFIX, Kind, Plan, request_from_settings
from lmdbfolder.write.resume import describe_change, pack_fingerprint
from lmdbfolder.write.sources import SourceList
from lmdbfolder.write.update import Changes, check_updatable
from lmdbfolder.write.writer import pack_sources, per_second, warn_skipped

__all__ = [
    "DEFAULT_PREFIX",
    "ShardResult",
    "ShardedPackResult",
    "parse_size",
    "plan_split",
    "choose_num_shards",
    "sources_digest",
    "shard_field",
    "shard_sources",
    "prepare_sharded_output",
    "plan_sharded_output",
    "finished_sharded_pack",
    "pack_shard",
    "pack_sharded",
    "execute_sharded",
    "write_index",
    "update_sharded",
    "LoadedSamples",
]

SPLIT_METHOD = "contiguous"


# -- planning --------------------------------------------------------------------
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtp]?)(i?)b?\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(text: str | int) -> int:
    """Bytes in a size such as ``4GB`` (10**9), ``4GiB`` (2**30), ``500M`` or ``1234``."""
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE.match(text)
        if m is None:
            raise ValueError(f"cannot read the size {text!r}; write it like 4GB, 500MB or 2GiB")
        base = 1024 if m.group(3) else 1000
        value = int(float(m.group(1)) * base ** _POWERS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"a size must be positive, got {text!r}")
    return value


def plan_split(total: int, num_shards: int) -> list[tuple[int, int]]:
    """The contiguous split: ``[start, stop)`` source ranges of the ``num_shards`` shards.

    Shard ``i`` gets sources ``floor(i*total/num_shards)`` up to
    ``floor((i+1)*total/num_shards)``: sizes differ by at most one, and the
    ranges depend only on the two numbers.
    """
    if num_shards < 1:
        raise ValueError(f"the number of shards must be positive, got {num_shards}")
    if num_shards > total:
        raise ValueError(f"cannot split {total} samples into {num_shards} shards")
    return [(i * total // num_shards, (i + 1) * total // num_shards) for i in range(num_shards)]


def choose_num_shards(
    sources: SourceList, *, shards: int | None = None, shard_size: int | str | None = None, store: str = "encoded"
) -> int:
    """The number of shards: ``shards`` itself, or enough shards of about ``shard_size`` bytes.

    Raises SourceError when there are fewer source files than shards.
    """
    if (shards is None) == (shard_size is None):
        raise ValueError("pass exactly one of shards and shard_size")
    if shard_size is not None:
        size = parse_size(shard_size)
        shards = max(1, math.ceil(sizing.estimate_pack_bytes(sources, store) / size))
    if shards is None:
        raise ValueError("pass exactly one of shards and shard_size")
    if shards < 1:
        raise ValueError(f"the number of shards must be positive, got {shards}")
    if shards > len(sources):
        raise SourceError(
            sources.list_file or sources.root,
            f"cannot split {len(sources)} source files into {shards} shards",
            "use fewer shards (or a larger --shard-size)",
        )
    return shards


def sources_digest(sources: SourceList) -> str:
    """SHA-256 (hex) of the complete sample list: every path and label, and the class names.

    Every shard records it, so ``write_index`` can tell shards of one split
    from shards packed from another scan.
    """
    h = hashlib.sha256()
    h.update(json.dumps([sources.layout, sources.classes], ensure_ascii=True).encode())
    return sources.hash_samples(h).hexdigest()


def shard_field(
    sources: SourceList, index: int, num_shards: int, *, prefix: str = DEFAULT_PREFIX, digest: str | None = None
) -> dict[str, Any]:
    """The ``shard`` manifest field of shard ``index``: its place in the split (FORMAT.md)."""
    start, stop = plan_split(len(sources), num_shards)[index]
    return {
        "split": SPLIT_METHOD,
        "prefix": prefix,
        "index": index,
        "num_shards": num_shards,
        "first_source": start,
        "sources": stop - start,
        "total_sources": len(sources),
        "sources_sha256": digest or sources_digest(sources),
    }


def shard_sources(sources: SourceList, start: int, stop: int) -> SourceList:
    """The samples ``start .. stop-1`` of ``sources``, keeping the global classes and labels."""
    return dataclasses.replace(sources, relpaths=sources.relpaths[start:stop], labels=sources.labels[start:stop])


# -- results -----------------------------------------------------------------------
@dataclass
class ShardResult:
    """What packing one shard did."""

    name: str
    index: int
    path: str
    count: int
    sources: int
    seconds: float = 0.0
    input_bytes: int = 0
    payload_bytes: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)
    resumed_from: int = 0
    kept: bool = False

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary."""
        out = dataclasses.asdict(self)
        out["skipped"] = [{"path": p, "reason": r} for p, r in self.skipped]
        out["seconds"] = round(self.seconds, 3)
        return out


@dataclass
class ShardedPackResult:
    """Summary of a finished sharded pack."""

    path: str
    count: int
    shards: list[ShardResult]
    seconds: float
    store: str = "encoded"
    #: True when ``path`` already held this sharded pack (same sources, split
    #: and options): nothing was read or written.
    already_packed: bool = False
    #: After ``update=True`` changed the pack: what changed, over all shards.
    changes: Changes | None = None

    @property
    def input_bytes(self) -> int:
        """Source bytes read in this run."""
        return sum(s.input_bytes for s in self.shards)

    @property
    def skipped(self) -> list[tuple[str, str]]:
        """Every skipped file, ``(relative path, reason)``, in source order."""
        return [item for s in self.shards for item in s.skipped]

    @property
    def images_per_second(self) -> float:
        """Source files handled per second of wall time in this run (packed or skipped)."""
        return per_second(sum(s.sources - s.resumed_from for s in self.shards if not s.kept), self.seconds)

    @property
    def mb_per_second(self) -> float:
        """Source megabytes (10**6) read per second of wall time (this run)."""
        return per_second(self.input_bytes / 1e6, self.seconds)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary (``lmdbfolder pack --shards N --json``)."""
        return {
            "path": self.path,
            "count": self.count,
            "num_shards": len(self.shards),
            "input_bytes": self.input_bytes,
            "seconds": round(self.seconds, 3),
            "images_per_second": round(self.images_per_second, 1),
            "mb_per_second": round(self.mb_per_second, 1),
            "store": self.store,
            "skipped": [{"path": p, "reason": r} for p, r in self.skipped],
            "shards": [s.as_dict() for s in self.shards],
            "already_packed": self.already_packed,
            "changes": None if self.changes is None else self.changes.as_dict(),
        }


# -- the output directory --------------------------------------------------------
def prepare_sharded_output(
    dst: str | os.PathLike[str],
    *,
    prefix: str = DEFAULT_PREFIX,
    num_shards: int,
    only: int | None = None,
    overwrite: bool = False,
    restart: bool = False,
) -> str:
    """Make ``dst`` ready to receive the shards of an ``num_shards``-way split; return its path.

    A new directory is created; an unfinished sharded pack of the same split is
    kept so that it resumes. Anything else is refused unless ``overwrite``
    (which replaces only what is provably an lmdbfolder pack). ``only`` is the
    shard index when a single shard is packed (``--shard-index``): then only
    that shard and the now stale ``index.json`` are removed. ``restart``
    discards unfinished shards (all of them, or shard ``only``) instead of
    resuming them.
    """
    dst = os.path.abspath(os.path.expanduser(os.fspath(dst)))
    if not os.path.lexists(dst):
        os.makedirs(dst, exist_ok=True)  # array jobs may all get here at once
        return dst
    if os.path.islink(dst) or not os.path.isdir(dst):
        raise OutputExistsError(dst, "exists and is not a directory", "choose another output path")
    names = set(os.listdir(dst))
    if DATA_FILE in names:
        if not overwrite:
            raise OutputExistsError(dst, "already holds a single (unsharded) pack")
        packdir.remove(dst)
        os.makedirs(dst)
        return dst
    entries = packdir.shard_entries(dst)
    foreign = sorted(names - set(entries) - {SHARD_INDEX_FILE, SHARD_INDEX_TMP})
    if foreign:
        raise OutputExistsError(
            dst,
            f"exists and holds other files ({', '.join(foreign[:5])}); refusing to write shards into it",
            "choose another output path",
        )
    finished_index = SHARD_INDEX_FILE in names
    if only is None:
        if finished_index and not overwrite:
            raise OutputExistsError(dst, "already holds a finished sharded pack")
        other = sorted(n for n, (p, _, total, _) in entries.items() if (p, total) != (prefix, num_shards))
        if other and not (overwrite or restart):
            raise OutputExistsError(
                dst,
                f"holds shards of another split ({', '.join(other[:3])}); it cannot be resumed as {num_shards} shards",
                "pass --restart to start over (or --overwrite), or rerun with the original --shards",
            )
        if overwrite or restart:
            for name in entries:
                packdir.remove(os.path.join(dst, name))
            for name in (SHARD_INDEX_FILE, SHARD_INDEX_TMP):
                if name in names:
                    os.remove(os.path.join(dst, name))
        return dst
    if finished_index:
        if not overwrite:
            raise OutputExistsError(
                dst,
                "already holds a finished sharded pack (index.json)",
                "pass --overwrite to repack this shard (the index is removed; run `lmdbfolder index` afterwards)",
            )
        os.remove(os.path.join(dst, SHARD_INDEX_FILE))
    return dst


def plan_sharded_output(
    sources: SourceList,
    dst: str | os.PathLike[str],
    options: PackOptions,
    shards: int | None,
    shard_size: int | str | None,
    shard_index: int | None,
    prefix: str,
) -> tuple[int, str]:
    """The number of shards and the prepared ``dst`` of a sharded pack of ``sources``
    (``pack_sharded`` and ``pack_ray`` start with it)."""
    if shard_index is not None and shards is None:
        raise ValueError("shard_index needs the number of shards (shards=N), the same for every job")
    num = choose_num_shards(sources, shards=shards, shard_size=shard_size, store=options.store)
    if shard_index is not None and not 0 <= shard_index < num:
        raise ValueError(f"shard_index must be in 0..{num - 1}, got {shard_index}")
    path = prepare_sharded_output(
        dst, prefix=prefix, num_shards=num, only=shard_index, overwrite=options.overwrite, restart=options.restart
    )
    return num, path


def finished_sharded_pack(
    sources: SourceList,
    dst: str | os.PathLike[str],
    options: PackOptions,
    shards: int | None,
    shard_size: int | str | None,
    shard_index: int | None,
    prefix: str,
    start_time: float,
) -> ShardedPackResult | None:
    """The finished sharded pack at ``dst`` when it is what this run would write (nothing to do).

    It is when ``dst`` holds ``index.json`` and every shard this run would
    pack (all of them, or shard ``shard_index``) carries the fingerprint the
    writer would give it: same sample list, source folder, list file, classes,
    split and store/check/resize options (``pack_fingerprint``; no image is
    read). Another such pack raises OutputExistsError saying what differs.
    None when there is no finished index or ``overwrite`` is set.
    """
    dst = os.path.abspath(os.fspath(dst))
    if options.overwrite or os.path.islink(dst) or not os.path.isfile(os.path.join(dst, SHARD_INDEX_FILE)):
        return None
    try:
        _, index = packdir.load_index(dst)
    except NotAPackError:
        return None
    num = choose_num_shards(sources, shards=shards, shard_size=shard_size, store=options.store)
    if shard_index is not None and not 0 <= shard_index < num:
        return None  # plan_sharded_output says what is wrong
    found_split = None if index.split is None else index.split.prefix
    why = None
    if (found_split, index.num_shards) != (prefix, num):
        why = f"it was packed as {index.num_shards} shards named {found_split}-*, this run packs {num} named {prefix}-*"
    results: list[ShardResult] = []
    digest = sources_digest(sources)
    ranges = plan_split(len(sources), num)
    todo = [] if why is not None else (range(num) if shard_index is None else [shard_index])
    for i in todo:
        name = shard_name(prefix, i, num)
        path = os.path.join(dst, name)
        meta = _finished_manifest(path) if packdir.inspect(path).kind is packdir.Kind.PACK else None
        if meta is None:
            why = f"its shard {name} is missing or not a finished pack"
            break
        lo, hi = ranges[i]
        extra = {SHARD_FIELD: shard_field(sources, i, num, prefix=prefix, digest=digest)}
        expected = pack_fingerprint(shard_sources(sources, lo, hi), options, extra)
        found = meta.fingerprint
        if found != expected:
            why = f"{name}: " + (describe_change(found, expected) if found is not None else "it records no fingerprint")
            break
        skipped = [(str(item.get("path")), str(item.get("reason", ""))) for item in meta.skipped_items]
        results.append(
            ShardResult(
                name,
                i,
                path,
                meta.count,
                hi - lo,
                payload_bytes=meta.payload_bytes or 0,
                skipped=skipped,
                kept=True,
            )
        )
    if why is not None:
        raise OutputExistsError(
            dst,
            f"already holds a finished sharded pack of other sources or options: {why}",
            "pass --overwrite to replace it, or choose another output path",
        )
    count = index.count if shard_index is None else results[0].count
    return ShardedPackResult(dst, count, results, time.perf_counter() - start_time, index.store, already_packed=True)


# -- packing -----------------------------------------------------------------------
def _finished_manifest(path: str) -> Manifest | None:
    """The manifest of the finished pack at ``path``, or None if it is not one."""
    try:
        return decode_meta(packfile.read_manifest(path), where=path)
    except NotAPackError:
        return None


def _same_shard(path: str, expected: dict[str, Any], options: PackOptions) -> tuple[bool, str, int]:
    """(whether ``path`` is this shard, finished, with these options; why not; its count)."""
    if packdir.inspect(path).kind is not packdir.Kind.PACK:
        return False, "it is not a finished pack", 0
    meta = _finished_manifest(path)
    if meta is None:
        return False, "it is not a readable lmdbfolder pack", 0
    if meta.shard != expected:
        return False, "it was packed as part of another split", 0
    why = options.differences(meta)
    if why is not None:
        return False, why, 0
    return True, "", meta.count


def pack_shard(
    sources: SourceList,
    dst: str | os.PathLike[str],
    index: int,
    num_shards: int,
    options: PackOptions | None = None,
    *,
    prefix: str = DEFAULT_PREFIX,
    digest: str | None = None,
    staging: str | os.PathLike[str] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    loader: Callable[[int], Any] | None = None,
    manifest_extra: Mapping[str, Any] | None = None,
    mean_size: float | None = None,
    stat: Callable[[int], tuple[int, int]] | None = None,
    **fields: Any,
) -> ShardResult:
    """Pack shard ``index`` of the ``num_shards``-way contiguous split of ``sources`` into ``dst``.

    ``sources`` is the complete sample list (``sources.scan``); the shard is
    written to ``dst/<prefix>-<index>-of-<num_shards>.lmdb`` by the ordinary
    writer, so an interrupted shard resumes when this is called again, bad
    files are skipped (or stop it with ``strict``) and reported. A shard that
    is already finished with the same split and options is kept as it is
    (``ShardResult.kept``). ``dst`` must have been prepared with
    ``prepare_sharded_output`` (``pack_sharded`` and the CLI do it).
    ``options``/``fields``: as for ``lmdbfolder.pack``.

    ``staging``: build the shard in this (node-local) directory and copy it
    into ``dst`` when it is finished, for a ``dst`` on a network file system,
    where LMDB must not be written. ``digest`` is ``sources_digest(sources)``
    if the caller has it already. ``on_progress(done, total)`` is called as
    source files of this shard are handled. ``loader(i)``, ``manifest_extra``,
    ``mean_size`` and ``stat(i)``: ``pack_sources``' (``i`` the index in the whole of
    ``sources``; samples of several fields are packed so, their stamps recorded for
    ``update_sharded``).

    Example:
        >>> from lmdbfolder.write.sources import scan
        >>> sources = scan("imagenet/train")  # doctest: +SKIP
        >>> pack_shard(sources, "train-sharded", 3, 8)  # doctest: +SKIP
    """
    opts = pack_options(options, fields)
    dst = os.path.abspath(os.path.expanduser(os.fspath(dst)))
    name = shard_name(prefix, index, num_shards)
    target = os.path.join(dst, name)
    expected = shard_field(sources, index, num_shards, prefix=prefix, digest=digest)
    start, stop = expected["first_source"], expected["first_source"] + expected["sources"]
    if os.path.lexists(target) and not opts.overwrite:
        same, why, count = _same_shard(target, expected, opts)
        if not same:
            raise OutputExistsError(
                target,
                f"already holds a shard that does not fit this pack: {why}",
                "pass --overwrite to repack it, or choose another output path",
            )
        return ShardResult(name, index, target, count, stop - start, kept=True)
    part = shard_sources(sources, start, stop)
    extra = {**(manifest_extra or {}), SHARD_FIELD: expected}
    more: dict[str, Any] = {}
    if loader is not None:
        more = {"loader": lambda s: loader(start + s), "mean_size": mean_size}
        if stat is not None:
            more["stat"] = lambda s: stat(start + s)
    if staging is None:
        result = pack_sources(part, target, opts, manifest_extra=extra, on_progress=on_progress, **more)
    else:
        built = os.path.join(os.path.abspath(os.path.expanduser(os.fspath(staging))), name)
        os.makedirs(os.path.dirname(built), exist_ok=True)
        if os.path.lexists(built):
            same, _, count = _same_shard(built, expected, opts)
            if same:  # finished on the staging disk before, never copied in
                _move_into(built, target)
                return ShardResult(name, index, target, count, stop - start, kept=True)
            if packdir.inspect(built).kind is packdir.Kind.PACK:
                packdir.remove(built)  # a finished shard of other options: repack it
        result = pack_sources(
            part, built, opts.replace(overwrite=False), manifest_extra=extra, on_progress=on_progress, **more
        )
        _move_into(built, target)
    return ShardResult(
        name,
        index,
        target,
        result.count,
        stop - start,
        result.seconds,
        result.input_bytes,
        result.payload_bytes,
        list(result.skipped),
        result.resumed_from,
    )


def _move_into(built: str, target: str) -> None:
    """Copy the finished shard ``built`` (on a staging disk) into place at ``target``, then remove it."""
    tmp = target + COPYING_SUFFIX
    packdir.clear_temp_dir(tmp)
    packdir.make_temp_dir(tmp)
    try:
        packdir.copy_single(built, tmp)
        packdir.publish(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # made by this call, a moment ago
        raise
    packdir.remove(built)


def pack_sharded(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    options: PackOptions | None = None,
    **settings: Any,
) -> ShardedPackResult:
    """Pack ``src`` into a sharded pack at ``dst``: ``shards`` shards, or shards of about ``shard_size``.

    The shards are packed one after the other in this process (each with the
    parallel reading pipeline); ``lmdbfolder.write.ray.pack_ray`` packs them in
    parallel on a Ray cluster. Rerunning the same call after an interruption
    keeps the finished shards and resumes the unfinished one. The index is
    written last, from the finished shards.

    Keywords (``settings``):
        shards, shard_size: the number of shards, or the size of each
            (``"4GB"``, ``"500MB"``, ``"2GiB"`` or bytes); one of them.
        shard_index: pack only that shard of the ``shards``-way split and
            write no index (one job of a Slurm array; ``write_index`` once all
            are done).
        prefix: shard names start with it (default ``"train"``).
        staging: see ``pack_shard``.
        layout, list_file, allow_empty, extensions, is_valid_file, match: the
            source, as for ``lmdbfolder.pack`` (with ``update``, the layout and
            extensions not given are the pack's, and its ``match`` must be
            given again).
        the ``PackOptions`` fields: as for ``lmdbfolder.pack`` (they override
            ``options``'); with ``update``, a sharded ``dst`` is updated in
            place (``update_sharded``).

    Example:
        >>> from lmdbfolder import pack_sharded
        >>> result = pack_sharded("imagenet/train", "train", shard_size="4GB")  # doctest: +SKIP
        >>> result.count, len(result.shards)  # doctest: +SKIP
        (1281167, 36)

    Rerunning a finished sharded pack with the same source, split and
    options does nothing (``already_packed``; see ``finished_sharded_pack``).
    """
    return execute_sharded(planner.plan(request_from_settings(src, dst, options, settings, sharded=True)))


def execute_sharded(planned: Plan) -> ShardedPackResult:
    """The executor of a sharded pack written here (``Kind.SHARDED``: every shard one after
    the other, or shard ``shard_index`` alone) and of its update in place
    (``Kind.UPDATE_SHARDED``), then the ``SkippedFilesWarning`` (none when nothing was to do)."""
    sharding, opts, sources = planned.sharding, planned.options, planned.sources
    if planned.kind is Kind.UPDATE_SHARDED:
        out = update_sharded(
            sources, planned.dst, opts, shards=sharding.shards, shard_index=sharding.shard_index, prefix=sharding.prefix
        )
    elif planned.kind is Kind.SHARDED:
        out = _pack_shards(planned)
    else:
        raise ValueError(f"execute_sharded runs sharded packs and their updates, not a {planned.kind.value} plan")
    if not out.already_packed:
        warn_skipped(out.skipped, "each shard's skipped.txt", stacklevel=4)
    return out


def _pack_shards(planned: Plan) -> ShardedPackResult:
    """``Kind.SHARDED``: the shards to pack (all, or ``shard_index``) one after the other, then the index."""
    sharding, opts, sources = planned.sharding, planned.options, planned.sources
    shards, shard_index, prefix = sharding.shards, sharding.shard_index, sharding.prefix
    done = finished_sharded_pack(
        sources, planned.dst, opts, shards, sharding.shard_size, shard_index, prefix, planned.start_time
    )
    if done is not None:
        return done
    num, dst = plan_sharded_output(sources, planned.dst, opts, shards, sharding.shard_size, shard_index, prefix)
    todo = range(num) if shard_index is None else [shard_index]
    split = plan_split(len(sources), num)
    desc = f"pack {num} shards" if shard_index is None else f"pack shard {shard_index}"
    # Each shard's own bar is off; this one bar counts every shard's files.
    shard_opts = opts.replace(overwrite=opts.overwrite and shard_index is not None, progress=False)
    shard_args: dict[str, Any] = dict(prefix=prefix, digest=sources_digest(sources), staging=sharding.staging)
    results = []
    with Progress(sum(split[i][1] - split[i][0] for i in todo), desc, enabled=opts.progress) as bar:
        for i in todo:
            results.append(_pack_one_shard(bar, sources, dst, i, num, split[i], shard_opts, shard_args))
    seconds = time.perf_counter() - planned.start_time
    if shard_index is not None:
        return ShardedPackResult(dst, results[0].count, results, seconds, opts.store)
    index = write_index(dst, prefix=prefix)
    return ShardedPackResult(dst, index.count, results, time.perf_counter() - planned.start_time, opts.store)


def _pack_one_shard(
    bar: Progress,
    sources: SourceList,
    dst: str,
    i: int,
    num: int,
    bounds: tuple[int, int],
    options: PackOptions,
    shard_args: dict[str, Any],
) -> ShardResult:
    """``pack_shard`` of shard ``i``, counting its files on ``bar`` and listing its skipped files there."""
    reported = [0]

    def report(done: int, total: int) -> None:
        bar.update(done - reported[0])
        reported[0] = done

    result = pack_shard(sources, dst, i, num, options, on_progress=report, **shard_args)
    bar.update(bounds[1] - bounds[0] - reported[0])
    for path, reason in result.skipped:
        bar.write(skipped_line(path, reason))
    return result


# -- updating ----------------------------------------------------------------------
def update_sharded(
    sources: SourceList,
    dst: str | os.PathLike[str],
    options: PackOptions,
    *,
    shards: int | None = None,
    shard_index: int | None = None,
    prefix: str = DEFAULT_PREFIX,
    loaded: LoadedSamples | None = None,
) -> ShardedPackResult:
    """Bring the finished sharded pack ``dst`` up to date with ``sources`` (``pack_sharded(...,
    update=True)``): each shard is updated in place (``write.update``) with its part of the new
    sample list, and the index is written again. ``loaded``: how samples of several fields
    are read and placed (``write.fields``; None: ``sources`` are files read from disk).

    The split is kept: each source file of the pack stays in its shard, and a new
    file goes to the shard of the pack's file before it (the first shard for files
    before all of them). A shard whose samples did not change is not rewritten
    (when its place in the split moved, its manifest says so: one small
    transaction). Until the new index is in place, the index names each shard's
    previous version, which an update leaves readable (``packfile.open_version``):
    readers see the old pack, then the new one.
    """
    start_time = time.perf_counter()
    if shard_index is not None:
        raise OptionError(
            "--update updates every shard of a sharded pack in one run: drop --shard-index",
            "run `lmdbfolder pack SRC DST --update` once (it reads only the files that changed)",
        )
    root, index = packdir.load_index(dst)
    entries = index.shards
    prefix = _kept_prefix(root, entries, shards, prefix)
    extra = None if loaded is None else loaded.manifest_extra
    for entry in entries:
        # Every shard against every rule an update checks, before any is changed: a forged
        # table in the last shard (or the fields of another layout) must not leave the
        # first ones updated.
        check_updatable(os.path.join(root, entry.name), extra)
    for entry in entries:
        _keep_indexed_version(os.path.join(root, entry.name), entry)
    if loaded is None:
        bounds = _split_bounds(sources, _owners(root, entries)[1], len(entries), root)
        order = None
    else:
        sources, order, bounds = _place_loaded(sources, root, entries, loaded.left_out)
    results, changes = _update_shards(sources, root, entries, bounds, prefix, options, loaded, order)
    old_classes = list(index.classes)
    changes.classes_added = [c for c in sources.classes if c not in set(old_classes)]
    changes.classes_removed = [c for c in old_classes if c not in set(sources.classes)]
    if all(_indexed(root, entry) for entry in entries):
        _drop_retained(root, entries)
        return ShardedPackResult(
            root, index.count, results, time.perf_counter() - start_time, options.store, already_packed=True
        )
    written = write_index(root, prefix=prefix, history=[*_history_of(index), _update_event(results, changes)])
    _drop_retained(root, entries)
    return ShardedPackResult(
        root, written.count, results, time.perf_counter() - start_time, options.store, changes=changes
    )


def _keep_indexed_version(path: str, entry: ShardEntry) -> None:
    """Keep the version of the shard at ``path`` that the index names readable through the
    update about to change it (FORMAT.md, "Sharded packs").

    An update changes a shard in one transaction and the index afterwards; LMDB keeps the
    version before the current one, so a run killed before the new index leaves a shard
    whose previous version is the indexed one, which readers open. A second run would
    end that version with its own transaction (or its compaction): so ``data.mdb`` as it
    is stays in the shard as ``RETAINED_FILE`` (a second name for the file, never written
    again), and the update goes on in a compacted copy of its current version. The file
    goes once the new index is in place (``_drop_retained``)."""
    retained = os.path.join(path, RETAINED_FILE)
    if _holds_indexed(path, entry, previous=False):
        if os.path.lexists(retained):
            os.remove(retained)  # a run that wrote the index was killed before removing it
        return
    if os.path.lexists(retained):
        return  # kept by an earlier run (when it holds the indexed version, readers find it there)
    if not _holds_indexed(path, entry, previous=True):
        return  # the indexed version is gone already: the new index is the only repair
    from lmdbfolder.write.output import _compact_if_needed

    data = os.path.join(path, DATA_FILE)
    os.link(data, retained)
    if not _compact_if_needed(path, force=True):
        os.remove(retained)  # the same file under two names: the update would write both
        raise PackError(
            f"cannot update {path}: its index still names the version before its current one (an earlier "
            "update was interrupted before it wrote the index), and there is no room for the copy that "
            "keeps that version readable while this update changes the shard",
            f"free about {disk_size(os.path.getsize(data))} on its disk, then run the update again",
        )
    packdir.fsync_path(path)


def _holds_indexed(path: str, entry: ShardEntry, *, previous: bool) -> bool:
    """Whether the shard's ``data.mdb`` holds, as its current (or ``previous``) version,
    the one the index names (its manifest's digest)."""
    try:
        pf = packfile.open_data(path, readahead=False, previous=previous)
    except NotAPackError:
        return False
    try:
        blob = packfile.read_value(pf, META_KEY, path)
        return blob is not None and hashlib.sha256(blob).hexdigest() == entry.manifest_sha256
    except NotAPackError:
        return False
    finally:
        pf.close()


def _drop_retained(root: str, entries: Sequence[ShardEntry]) -> None:
    """Remove the shards' ``RETAINED_FILE``s: the index on disk names their current versions."""
    for entry in entries:
        retained = os.path.join(root, entry.name, RETAINED_FILE)
        if os.path.lexists(retained):
            os.remove(retained)


def _kept_prefix(root: str, entries: Sequence[ShardEntry], shards: int | None, prefix: str) -> str:
    """The prefix of the pack's shards, after checking that the update keeps its split
    (``shards``, ``prefix``: what the command asked for) and that every shard is there."""
    num = len(entries)
    found_prefix = parse_shard_name(entries[0].name)
    if shards is not None and shards != num:
        raise OptionError(
            f"{root} has {num} shards, not {shards}: an update keeps the split of the pack",
            f"pass --shards {num} (or no shard count); to split it anew, repack with --overwrite",
        )
    if found_prefix is not None and prefix not in (DEFAULT_PREFIX, found_prefix[0]):
        raise OptionError(f"{root} holds shards named {found_prefix[0]}-*, not {prefix}-*")
    missing = [e.name for e in entries if not os.path.isdir(os.path.join(root, e.name))]
    if missing:  # as readers say it, before any shard is read
        raise packdir.missing_shards(root, missing, num)
    return found_prefix[0] if found_prefix else prefix


def _update_shards(
    sources: SourceList,
    root: str,
    entries: Sequence[ShardEntry],
    bounds: list[int],
    prefix: str,
    options: PackOptions,
    loaded: LoadedSamples | None = None,
    order: Sequence[int] | None = None,
) -> tuple[list[ShardResult], Changes]:
    """Each shard updated in place with its part ``bounds[k]:bounds[k + 1]`` of ``sources``;
    the results and the changes summed over the shards. ``loaded``: samples read by its
    loader, ``order[s]`` being the loader's index of ``sources[s]``."""
    num = len(entries)
    digest = sources_digest(sources)
    shard_opts = options.replace(progress=False)
    results: list[ShardResult] = []
    changes = Changes()
    with Progress(len(sources), f"update {num} shards", enabled=options.progress) as bar:
        for k, entry in enumerate(entries):
            lo, hi = bounds[k], bounds[k + 1]
            target = os.path.join(root, entry.name)
            claim = {
                "split": SPLIT_METHOD,
                "prefix": prefix,
                "index": k,
                "num_shards": num,
                "first_source": lo,
                "sources": hi - lo,
                "total_sources": len(sources),
                "sources_sha256": digest,
            }
            reported = [0]

            def report(done: int, total: int, reported: list[int] = reported) -> None:
                bar.update(done - reported[0])
                reported[0] = done

            result = pack_sources(
                shard_sources(sources, lo, hi),
                target,
                shard_opts,
                manifest_extra={**(loaded.manifest_extra if loaded else {}), SHARD_FIELD: claim},
                on_progress=report,
                **({} if loaded is None else loaded.for_part(order, lo)),
            )
            bar.update(hi - lo - reported[0])
            if result.changes is not None:
                for path, reason in result.skipped:
                    bar.write(skipped_line(path, reason))
                for key in ("added", "removed", "changed", "relabelled", "read", "unchanged"):
                    setattr(changes, key, getattr(changes, key) + getattr(result.changes, key))
            results.append(
                ShardResult(
                    entry.name,
                    k,
                    target,
                    result.count,
                    hi - lo,
                    result.seconds,
                    result.input_bytes,
                    result.payload_bytes,
                    list(result.skipped),
                    result.resumed_from,
                    kept=result.changes is None,
                )
            )
    return results, changes


def _history_of(index: ShardIndex) -> list[dict[str, Any]]:
    """The sharded pack's history (one made up of its creation when it kept none)."""
    if index.history is not None:
        return list(index.history)
    return [{"event": "pack", "at": index.created_at, "count": index.count, "added": index.count}]


def _update_event(results: list[ShardResult], changes: Changes) -> dict[str, Any]:
    """The history entry of a sharded update: when, the count, what changed, which shards."""
    entry_changes = {k: v for k, v in changes.as_dict().items() if k not in ("read", "unchanged")}
    return {
        "event": "update",
        "at": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "count": sum(r.count for r in results),
        **entry_changes,
        "shards_updated": [r.name for r in results if not r.kept],
    }


def _shard_paths(path: str) -> tuple[list[bytes], list[bytes]]:
    """The source files of the shard at ``path``, as bytes: its samples', and its skipped files."""
    meta_blob, _, paths_blob = packfile.read_tables(path)
    count = decode_meta(meta_blob, where=path).count
    offsets = struct.unpack_from(f"<{count + 1}Q", paths_blob)
    names = paths_blob[(count + 1) * 8 :]
    listed = [names[a:b] for a, b in zip(offsets, offsets[1:])]
    return listed, [os.fsencode(str(item.get("path"))) for item in packfile.read_skipped(path)]


def _owners(root: str, entries: Sequence[ShardEntry]) -> tuple[dict[bytes, list[int]], dict[bytes, list[int]]]:
    """Per source path of the pack, the shards that hold it, one per sample of that path
    (a table's rows may name one image), in order: as samples only, and with the shards'
    skipped files too (each shard's tables read once for both)."""
    samples: dict[bytes, list[int]] = {}
    held: dict[bytes, list[int]] = {}
    for k, entry in enumerate(entries):
        listed, skipped = _shard_paths(os.path.join(root, entry.name))
        for relpath in listed:
            samples.setdefault(relpath, []).append(k)
            held.setdefault(relpath, []).append(k)
        for relpath in skipped:
            held.setdefault(relpath, []).append(k)
    return samples, held


def _split_bounds(sources: SourceList, owner: Mapping[bytes, Sequence[int]], num: int, root: str) -> list[int]:
    """Where each shard's part of the new sample list starts (and, last, its length):
    every file of the pack stays in its shard; a new file joins the shard of the
    pack's file before it (shard 0 before all of them). A path of several samples
    (``owner`` names several shards) puts its j-th sample in the shard of the pack's
    j-th, or in the current shard when that one is behind: its samples are alike."""
    bounds = [0] + [-1] * (num - 1) + [len(sources)]
    current = 0
    seen: dict[bytes, int] = {}
    raw = sources.relpaths.iter_raw() if isinstance(sources.relpaths, PathList) else map(os.fsencode, sources.relpaths)
    for s, path in enumerate(raw):
        held = owner.get(path)
        if held is None:
            continue
        if len(held) == 1:
            k = held[0]
        else:
            j = seen[path] = seen.get(path, -1) + 1
            k = max(held[min(j, len(held) - 1)], current)
        if k == current:
            continue
        if k < current:
            raise OptionError(
                f"{root}: the source lists {os.fsdecode(path)!r} after files of a later shard, so the "
                "order of the source's files changed across shards; an update keeps each file in its shard",
                "repack the sharded pack with --overwrite",
            )
        for skipped_shard in range(current + 1, k + 1):
            bounds[skipped_shard] = s
        current = k
    for k in range(current + 1, num):
        bounds[k] = len(sources)
    empty = [k for k in range(num) if bounds[k] == bounds[k + 1]]
    if empty:
        raise OptionError(
            f"{root}: every file of shard {empty[0]} is gone from the source; an update keeps the split, "
            "and a shard cannot be empty",
            "repack the sharded pack with --overwrite (choose the number of shards anew)",
        )
    return bounds


@dataclass(frozen=True)
class LoadedSamples:
    """How ``update_sharded`` reads samples of several fields (``write.fields``) and where
    it places those a fresh pack lists last.

    ``loader(i)``, ``stat(i)`` and ``mean_size``: ``pack_sources``' for source ``i`` of the
    whole list (``stat`` is what an update of records made by a loader compares: without
    it, ``pack_sources`` would pack the shard anew); ``manifest_extra``: the fields and
    layout, in every shard's manifest (and checked against each shard's before any
    changes). The last ``left_out`` sources are samples left out while listing (a missing
    partner...): a fresh pack lists them after the others (``write.fields``), so they say
    nothing of the order of the shards. The update lists each again in the shard that held
    its path, a new one in the last shard.
    """

    loader: Callable[[int], Any]
    stat: Callable[[int], tuple[int, int]]
    manifest_extra: Mapping[str, Any]
    mean_size: float | None = None
    left_out: int = 0

    def for_part(self, order: Sequence[int] | None, start: int) -> dict[str, Any]:
        """``pack_sources``' loader keywords for the part of the list from ``start`` on
        (``order[s]``: the loader's index of source ``s``; None: the same)."""
        at: Callable[[int], int] = (lambda s: start + s) if order is None else (lambda s: order[start + s])
        loader, stat = self.loader, self.stat
        return {"loader": lambda s: loader(at(s)), "stat": lambda s: stat(at(s)), "mean_size": self.mean_size}


def _place_loaded(
    sources: SourceList, root: str, entries: Sequence[ShardEntry], left_out: int
) -> tuple[SourceList, list[int], list[int]]:
    """The new sample list of an update of samples of several fields, in shard order: the
    listed samples split as ``_split_bounds`` does by the shards that hold them as samples
    (a file a shard lists as skipped may be one the fresh pack put last, out of order),
    each shard followed by the samples left out while listing that it held (new ones: the
    last shard). Returns that list, the index in ``sources`` of each of its sources, and
    the shards' bounds in it."""
    listed = len(sources) - left_out
    num = len(entries)
    samples, held = _owners(root, entries)
    first = _split_bounds(shard_sources(sources, 0, listed), samples, num, root)
    extra: list[list[int]] = [[] for _ in range(num)]
    for s in range(listed, len(sources)):
        extra[held.get(os.fsencode(sources.relpaths[s]), [num - 1])[0]].append(s)
    order: list[int] = []
    bounds = [0]
    for k in range(num):
        order += range(first[k], first[k + 1])
        order += extra[k]
        bounds.append(len(order))
    relpaths, labels = list(sources.relpaths), list(sources.labels)
    placed = dataclasses.replace(sources, relpaths=[relpaths[s] for s in order], labels=[labels[s] for s in order])
    return placed, order, bounds


def _indexed(root: str, entry: ShardEntry) -> bool:
    """Whether the shard ``entry`` of the index is the shard on disk, manifest and all."""
    meta = packfile.read_manifest(os.path.join(root, entry.name))
    return meta is not None and entry.manifest_sha256 == hashlib.sha256(meta).hexdigest()


# -- the index ---------------------------------------------------------------------
def _find_split(dst: str, prefix: str | None) -> tuple[str, int, dict[int, str], set[int]]:
    entries = packdir.shard_entries(dst)
    groups: dict[tuple[str, int], tuple[dict[int, str], set[int]]] = {}
    for name, (p, i, total, finished) in entries.items():
        if prefix is not None and p != prefix:
            continue
        done, unfinished = groups.setdefault((p, total), ({}, set()))
        if finished:
            done[i] = name
        else:
            unfinished.add(i)
    if not groups:
        raise NotAPackError(
            dst,
            "it holds no shard" + (f" named {prefix}-*" if prefix else ""),
            "pack the shards first (`lmdbfolder pack SRC DST --shards N`, or --shard-index I per job)",
        )
    if len(groups) > 1:
        kinds = ", ".join(shard_name(p, 0, n).replace("-00000-", "-*-") for p, n in sorted(groups))
        raise NotAPackError(
            dst, f"it holds shards of several splits ({kinds})", "remove the ones that do not belong, or pass --prefix"
        )
    (found_prefix, total), (done, unfinished) = next(iter(groups.items()))
    return found_prefix, total, done, unfinished


#: The pack options (manifest ``params`` key: command-line flag) that decide what a
#: shard stores, so all shards of a pack share them (``commit_every`` and the like do not).
_SHARED_OPTIONS = {
    "check": "--check",
    "max_size": "--max-size",
    "quality": "--quality",
    "resize_side": "--resize-side",
    "resize_format": "--format",
}


def _option_difference(meta: Manifest, first: Manifest, first_name: str) -> str | None:
    """How the shard with manifest ``meta`` was packed differently from ``first_name``
    (manifest ``first``): the first option that differs, or None."""

    def options(m: Manifest) -> dict[str, Any]:
        params = m.params or {}
        out: dict[str, Any] = {"--store": m.store}
        out.update({flag: params.get(key) for key, flag in _SHARED_OPTIONS.items()})
        if out["--max-size"] is not None and out["--format"] is None:
            out["--format"] = DEFAULT_RESIZE_FORMAT  # recorded only when not the default
        return out

    mine, theirs = options(meta), options(first)
    for flag, value in mine.items():
        if value != theirs[flag]:
            return f"it was packed {_said(flag, value)}, {first_name} {_said(flag, theirs[flag])}"
    return None


def _said(flag: str, value: Any) -> str:
    return f"without {flag}" if value is None else f"with {flag} {printable(value, 40)}"


def write_index(
    dst: str | os.PathLike[str],
    *,
    prefix: str | None = None,
    history: list[dict[str, Any]] | None = None,
) -> ShardIndex:
    """Check the finished shards in ``dst`` and write ``dst/index.json``; return the index
    (a ``format.ShardIndex``: typed, and a read-only mapping of its JSON object).

    Every shard of the split must be present and finished, and all must come
    from the same scan (same sample list and classes), be packed with the same
    options (--store, --check, --max-size, --quality, --resize-side, --format) and tile it
    without gaps. Missing or unfinished shards are named in the error.
    ``prefix`` selects the shards named ``<prefix>-*`` when several splits
    share ``dst``; an ``index.json`` of another split already there is not
    replaced (OutputExistsError: a directory holds one index). The index is
    written atomically (a temporary file renamed).
    ``history``: the sharded pack's history (``pack --update`` passes it);
    None keeps the history of the index being replaced, if any.

    Example:
        >>> index = write_index("train-sharded")  # doctest: +SKIP
        >>> index.count, len(index.shards)  # doctest: +SKIP
        (1281167, 8)
    """
    dst = os.path.abspath(os.path.expanduser(os.fspath(dst)))
    if not os.path.isdir(dst):
        raise NotAPackError(dst, "no such directory")
    found_prefix, total, done, unfinished = _find_split(dst, prefix)
    _require_every_shard(dst, found_prefix, total, done, unfinished)
    if history is None:
        _check_same_split(dst, found_prefix, total)
        history = _index_history(dst)
    tiling = _Tiling(dst, found_prefix, total, done[0])
    for i in range(total):
        tiling.add(i, done[i])
    index = tiling.index(history)
    packdir.write_atomically(dst, SHARD_INDEX_FILE, index.to_json(), SHARD_INDEX_TMP)
    return index


def _require_every_shard(dst: str, prefix: str, total: int, done: dict[int, str], unfinished: set[int]) -> None:
    """NotAPackError naming the shards of the split that are missing or unfinished, if any."""
    missing = [i for i in range(total) if i not in done]
    if not missing:
        return
    described = [shard_name(prefix, i, total) + (" (unfinished)" if i in unfinished else "") for i in missing[:10]]
    more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
    raise NotAPackError(
        dst,
        f"{len(missing)} of {total} shards {'is' if len(missing) == 1 else 'are'} missing: "
        f"{', '.join(described)}{more}",
        f"pack them (`lmdbfolder pack SRC {dst} --shards {total} --shard-index I`), then run `lmdbfolder index` again",
    )


@dataclass
class _Tiling:
    """The shards of one split, checked in order as they tile it (``add``), and the
    index they make (``index``): each shard's manifest, tables and place in the split
    against the first shard's and against where the one before ended."""

    dst: str
    prefix: str
    total: int
    first_name: str
    first: Manifest | None = None
    first_place: ShardPlace | None = None
    next_source: int = 0
    first_index: int = 0
    entries: list[ShardEntry] = field(default_factory=list)
    encodings: dict[str, int] = field(default_factory=dict)
    versions: set[int] = field(default_factory=set)

    def add(self, i: int, name: str) -> None:
        """Shard ``i`` (the folder ``name``), checked and entered."""
        path = os.path.join(self.dst, name)
        meta_blob, labels_blob, paths_blob = packfile.read_tables(path)
        meta = decode_meta(meta_blob, where=path)
        _check_table_counts(path, meta.count, labels_blob, paths_blob)
        place = self._place(path, meta)
        if self.first is None:
            self.first, self.first_place = meta, place
        self._check_belongs(path, f"{name} in {self.dst}", i, meta, place)
        for enc, n in (meta.encodings or {}).items():
            self.encodings[enc] = self.encodings.get(enc, 0) + n
        self.versions.add(meta.format_version)
        identity = shard_identity(meta_blob, labels_blob, paths_blob)
        self.entries.append(
            ShardEntry(
                name=name,
                count=meta.count,
                tables_sha256=tables_digest(meta_blob, labels_blob, paths_blob),
                first_index=self.first_index,
                first_source=place.first_source,
                sources=place.sources,
                skipped=meta.skipped_count if meta.skipped_count is not None else len(meta.skipped_items),
                payload_bytes=meta.payload_bytes,
                data_bytes=os.path.getsize(os.path.join(path, DATA_FILE)),
                manifest_sha256=identity["manifest_sha256"],
                tables_bytes=tuple(identity["tables_bytes"]),
                pack_id=meta.version_pack_id,
            )
        )
        self.next_source += place.sources
        self.first_index += meta.count

    def _place(self, path: str, meta: Manifest) -> ShardPlace:
        """The shard's ``shard`` field (its place in the split), checked to be one."""
        info = meta.as_stored(SHARD_FIELD)
        if info is None:
            raise NotAPackError(path, "it is a complete pack but was not packed as a shard (no `shard` field)")
        place = ShardPlace.of(info)
        problem = place.problem
        wrong_type = [key for key in meta.invalid_fields if key in _SUMMED_FIELDS]
        if wrong_type and not problem:
            fields = ", ".join(f"{key}={reprlib.repr(meta.as_stored(key))}" for key in wrong_type)
            problem = f"{fields} {'is not of its' if len(wrong_type) == 1 else 'are not of their'} FORMAT.md type"
        if problem:
            raise NotAPackError(
                path,
                f"its manifest is invalid: {problem}",
                "it is damaged, or was not written by lmdbfolder: repack this shard "
                "(`lmdbfolder pack ... --shard-index`), then run `lmdbfolder index` again",
            )
        return place

    def _check_belongs(self, path: str, where: str, i: int, meta: Manifest, place: ShardPlace) -> None:
        """NotAPackError unless shard ``i`` comes from the first shard's scan, classes and
        options, and starts where the shard before it ended."""
        first, first_place = self.first, self.first_place
        if first is None or first_place is None:  # add() sets them first: never so
            raise NotAPackError(path, "no first shard to compare it with")
        wrong = (place.prefix, place.index, place.num_shards, place.split) != (
            self.prefix,
            i,
            self.total,
            SPLIT_METHOD,
        )
        same_scan = (place.total_sources, place.sources_sha256) == (
            first_place.total_sources,
            first_place.sources_sha256,
        )
        if wrong or not same_scan or place.first_source != self.next_source:
            raise NotAPackError(
                path,
                f"it does not belong to this split ({where}): it was packed from another scan of the source, "
                "or with other shard options",
                "repack it with `lmdbfolder pack ... --shard-index` from the same source and options",
            )
        for key, mine, theirs in (
            ("classes", meta.classes, first.classes),
            ("class_to_idx", meta.class_to_idx, first.class_to_idx),
        ):
            if mine != theirs:
                raise NotAPackError(
                    path, f"its {key} differ from those of {self.first_name}", "repack it from the same source"
                )
        differs = _option_difference(meta, first, self.first_name)
        if differs is not None:
            raise NotAPackError(
                path,
                f"{differs}: the shards of a pack must be packed with the same options",
                f"repack it with `lmdbfolder pack ... --shards {self.total} --shard-index {i}` and the options of "
                "the other shards, or repack the others with its options",
            )

    def index(self, history: list[dict[str, Any]] | None) -> ShardIndex:
        """The index of the shards added, which must cover the whole split."""
        first = self.first
        if first is None:  # _find_split found a split of at least one shard, all of them done
            raise NotAPackError(self.dst, "it holds no shard")
        first_place = self.first_place
        if first_place is None:
            raise NotAPackError(self.dst, "it holds no shard")
        split_sources = first_place.total_sources
        if self.next_source != split_sources:
            raise NotAPackError(
                self.dst,
                f"the shards cover {self.next_source} source files, the split has {split_sources}",
                f"repack the shards from one scan of the source (`lmdbfolder pack SRC {self.dst} --shards "
                f"{self.total}`, or --shard-index I per job), then run `lmdbfolder index` again",
            )
        entries = self.entries
        return ShardIndex(
            # Shards an update changed are format 3, the others keep theirs: the index
            # names the newest, which a reader must understand.
            pack_format_version=max(self.versions),
            count=self.first_index,
            classes=first.classes,
            class_to_idx=first.class_to_idx,
            store=first.store,
            shards=entries,
            num_shards=self.total,
            split=ShardSplit(SPLIT_METHOD, self.prefix, self.total, self.next_source, first_place.sources_sha256),
            encodings=dict(sorted(self.encodings.items())),
            payload_bytes=sum(e.payload_bytes or 0 for e in entries),
            skipped=sum(e.skipped or 0 for e in entries),
            checksum="sha256 of each shard's manifest (checked on open) and tables (verify); crc32 of every record",
            source=first.source,
            created_by=f"lmdbfolder {__version__}",
            created_at=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            history=history or None,
        )


#: Bytes a sample takes in the label table (an int32, FORMAT.md).
_LABEL_BYTES = struct.calcsize("<i")


def _check_table_counts(path: str, count: int, labels: bytes, paths: bytes) -> None:
    """NotAPackError unless the shard's label and path tables hold the ``count`` samples
    its manifest claims: the index sums these counts, and a reader finds samples by them."""
    held = len(labels) // _LABEL_BYTES
    if len(labels) != count * _LABEL_BYTES:
        raise NotAPackError(
            path,
            f"its manifest says count={count}, its tables hold {held} samples"
            + ("" if len(labels) % _LABEL_BYTES == 0 else f" ({len(labels)} bytes of labels)"),
            DAMAGED_HINT,
        )
    check_paths(paths, count, where=path)


#: The informational manifest fields the index is built from (summed or copied).
_SUMMED_FIELDS = ("encodings", "payload_bytes", "skipped_count", "skipped", "source")


#: The ``shard`` manifest field's members (FORMAT.md) and their types.


def _check_same_split(dst: str, prefix: str, total: int) -> None:
    """OutputExistsError when ``dst/index.json`` indexes another split than ``prefix``-*
    of ``total`` shards: a directory has one index, and replacing another split's
    would lose that split (and hand its history to this one)."""
    try:
        _, old = packdir.load_index(dst)
    except NotAPackError:
        return  # none, or unreadable: nothing of value to keep
    named = parse_shard_name(old.shards[0].name)
    if named is None or named[0] == prefix and named[2] == total:
        return
    old_split = shard_name(named[0], 0, named[2]).replace("-00000-", "-*-")
    new_split = shard_name(prefix, 0, total).replace("-00000-", "-*-")
    raise OutputExistsError(
        dst,
        f"already has an {SHARD_INDEX_FILE} of the split {old_split}; "
        f"writing the index of {new_split} would replace it",
        f"keep each split in its own folder (move the {prefix}-* shards), or remove {SHARD_INDEX_FILE} first "
        f"to index {new_split} here",
    )


def _index_history(dst: str) -> list[dict[str, Any]] | None:
    """The history of the index at ``dst`` (None: no index, or none recorded)."""
    try:
        _, old = packdir.load_index(dst)
    except NotAPackError:
        return None
    return old.history

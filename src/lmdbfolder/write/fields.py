"""Pack samples of several named fields (an image and its mask, an image pair, an image and its
annotations): the sample list (``FieldSamples``), the checks of each field and the writer
(``pack_field_samples``).

The list is built before anything is written (by ``write.layouts`` for folders on disk, by
``write.from_dataset`` for dataset objects); ``read(i)`` gives sample ``i``'s payloads in field
order, each of its field's kind (FORMAT.md, "Several fields per sample"):

* ``image``, ``mask``: the source file's bytes, unchanged (a mask's palette and mode are kept
  because its bytes are). Both must decode; a mask in a lossy encoding (JPEG, lossy WebP) is
  packed but reported (``PackResult.lossy_masks`` is not a thing: a ``LossyMaskWarning``).
* ``json``: compact UTF-8 JSON (``encode_json``), at most ``MAX_JSON_FIELD_BYTES``.
* ``array``: the ``.npy`` bytes of a numpy array (``encode_array``: never pickled), bounded in
  dimensions and size.

The records are written by ``pack_sources`` with a loader (resumable, atomic, skipped samples
listed with their files), one record per sample holding every field (``format.encode_fields``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import threading
import time
import warnings
from typing import Any, Callable, Sequence

from PIL import Image

from lmdbfolder import packdir
from lmdbfolder.errors import LossyMaskWarning, OptionError
from lmdbfolder.format import (
    NO_LABEL,
    RECORD_HEADER,
    SHARD_INDEX_FILE,
    SKIPPED_REPORT,
    UNKNOWN_MTIME,
    decode_record,
    encode_header_into,
    shard_name,
)
from lmdbfolder.format.fields import (
    FIELD_KINDS,
    FIELDS_FLAG,
    IMAGE_KINDS,
    MAX_FIELDS,
    FieldSpec,
    array_problem,
    decode_json,
    pack_field_payloads,
)
from lmdbfolder.text import printable
from lmdbfolder.write.options import CONTENT_CHECK, PackOptions, pack_options
from lmdbfolder.write.planner import DEFAULT_PREFIX
from lmdbfolder.write.records import Loaded, Skipped, load_bytes
from lmdbfolder.write.shards import (
    LoadedSamples,
    ShardedPackResult,
    ShardResult,
    _same_shard,
    pack_shard,
    parse_size,
    plan_split,
    prepare_sharded_output,
    shard_field,
    sources_digest,
    update_sharded,
    write_index,
)
from lmdbfolder.write.sources import SourceList
from lmdbfolder.write.update import recorded_options
from lmdbfolder.write.writer import PackResult, pack_sources, warn_skipped

__all__ = ["FIELD_KINDS", "FieldSpec", "SampleError", "FieldSamples", "pack_field_samples", "check_fields"]

_HEAD = RECORD_HEADER.size
#: Encodings that lose information: a mask stored in one is reported.
_LOSSY = ("jpeg",)


class SampleError(Exception):
    """A sample that cannot be packed (``FieldSamples.read(i)`` raises it): it is skipped and
    listed with its files (``paths``, relative to the source root) and ``why``."""

    def __init__(self, why: str, paths: Sequence[str] = ()) -> None:
        super().__init__(why)
        self.why = why
        self.paths = tuple(paths)


@dataclasses.dataclass
class FieldSamples:
    """The samples of several fields a pack will hold, listed before anything is written."""

    #: where the samples come from: ``"voc"``, ``"ade20k"``, ``"cityscapes"``, ``"coco"``,
    #: ``"pairs"``, ``"table"``, ``"dataset"``... (recorded in the manifest's ``layout``)
    layout: str
    #: the source root (messages, update)
    root: str
    fields: tuple[FieldSpec, ...]
    #: per sample: the stored path ('/'-separated, relative to root) of its first field's file
    relpaths: list[str]
    #: per sample: each field's file relpath ('' for a field that is not a file)
    field_paths: list[tuple[str, ...]]
    #: per sample: class index, or NO_LABEL
    labels: list[int]
    classes: list[str]
    #: sample i's payloads, in field order; may raise SampleError
    read: Callable[[int], list[bytes]]
    #: (file path(s), why) of samples left out while listing (missing partners ...)
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    #: JSON-able, kept in the manifest (e.g. {"split": "train"}, {"scale": 4}, COCO categories)
    layout_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: the expected bytes per sample (sizes the map); 0: from the first fields' files
    mean_size: float = 0.0
    #: per sample, what ``pack --update`` compares (``sample_stamp``): (its bytes, a digest of
    #: each of its files' path, size and modification time and of its other fields' values), or
    #: (-1, UNKNOWN_MTIME) when a file cannot be ``stat``-ed. None: an update reads every sample
    #: again and keeps those whose record comes out the same.
    stamp: Callable[[int], tuple[int, int]] | None = None


def _lossy(encoding: str, data: bytes | bytearray | memoryview) -> bool:
    if encoding in _LOSSY:
        return True
    # A WebP is lossy when it holds a "VP8 " (not "VP8L") bitstream chunk.
    return encoding == "webp" and b"VP8 " in bytes(memoryview(data)[:4096])


@dataclasses.dataclass
class _Checked:
    """What ``check_fields`` learnt of a sample: its record, or why it is skipped, and the
    masks it holds in a lossy encoding (stored, and reported)."""

    result: Loaded | Skipped
    lossy: tuple[str, ...] = ()


def check_fields(
    payloads: Sequence[bytes | bytearray | memoryview],
    fields: Sequence[FieldSpec],
    label: int,
    *,
    check: str = "header",
    max_pixels: int | None = None,
    paths: Sequence[str] = (),
) -> _Checked:
    """Check every field of one sample and build its record (not yet bound to its index).

    Images and masks get ``pack``'s check of an image (``check``: ``"header"``, ``"decode"``,
    ``"none"``; masks are always decoded unless ``"none"``: a mask is small and its pixels are
    the labels), a mask of another size than the sample's first image is refused, ``json``
    fields must parse within the bounds and ``array`` fields be plain ``.npy`` arrays. A field
    that fails makes the whole sample a ``Skipped`` naming the field and its file (``paths``).
    """

    def skipped(k: int, why: str) -> _Checked:
        where = fields[k].name + (f" ({paths[k]})" if k < len(paths) and paths[k] else "")
        return _Checked(Skipped(f"{where}: {why}"))

    if len(payloads) != len(fields):
        return _Checked(Skipped(f"the sample has {len(payloads)} fields, the pack {len(fields)}"))
    shapes: list[tuple[int, int] | None] = []
    first: tuple[str, int, int, int] | None = None
    lossy: list[str] = []
    size = 0
    for k, (spec, data) in enumerate(zip(fields, payloads)):
        size += len(data)
        shapes.append(None)
        if spec.kind in IMAGE_KINDS:
            if not len(data):
                return skipped(k, "empty (0 bytes)")
            field_check = "decode" if spec.kind == "mask" and check != "none" else check
            loaded = load_bytes(data, NO_LABEL, check=field_check, max_pixels=max_pixels)
            if isinstance(loaded, Skipped):
                return skipped(k, loaded.reason)
            header, _ = decode_record(memoryview(loaded.value))
            if header.width and header.height:
                shapes[k] = (header.width, header.height)
            if first is None and k == 0:
                first = (header.encoding, header.width, header.height, header.channels)
            if spec.kind == "mask" and _lossy(header.encoding, data):
                lossy.append(spec.name + (f" ({paths[k]})" if k < len(paths) and paths[k] else ""))
        elif spec.kind == "json":
            try:
                decode_json(data, spec.name)
            except ValueError as exc:
                return skipped(k, str(exc))
        elif spec.kind == "array":
            problem = array_problem(data)
            if problem is not None:
                return skipped(k, problem)
    image_shape = next((shapes[k] for k, f in enumerate(fields) if f.kind == "image" and shapes[k]), None)
    for k, spec in enumerate(fields):
        if spec.kind == "mask" and image_shape is not None and shapes[k] is not None and shapes[k] != image_shape:
            w, h = shapes[k]  # type: ignore[misc]
            return skipped(k, f"the mask is {w}x{h} but the image is {image_shape[0]}x{image_shape[1]}")
    value = pack_field_payloads(payloads, room=_HEAD)
    encoding, width, height, channels = first or ("other", 0, 0, 0)
    encode_header_into(
        value, label=label, encoding=encoding, width=width, height=height, channels=channels, flags=FIELDS_FLAG
    )
    return _Checked(Loaded(value, encoding, size), tuple(lossy))


def _check_samples(samples: FieldSamples) -> None:
    fields = tuple(samples.fields)
    if not fields or len(fields) > MAX_FIELDS:
        raise OptionError(f"{samples.root}: a pack of several fields holds 1 to {MAX_FIELDS} fields, not {len(fields)}")
    if not all(isinstance(f, FieldSpec) for f in fields):
        raise OptionError(f"{samples.root}: the fields must be FieldSpec objects")
    if len({f.name for f in fields}) != len(fields):
        raise OptionError(f"{samples.root}: two fields have the same name ({', '.join(f.name for f in fields)})")
    n = len(samples.relpaths)
    if len(samples.labels) != n or len(samples.field_paths) != n:
        raise ValueError(
            f"{n} samples but {len(samples.labels)} labels and {len(samples.field_paths)} field paths: "
            "FieldSamples lists each sample once in each"
        )


def pack_field_samples(
    samples: FieldSamples,
    dst: str | os.PathLike[str],
    options: PackOptions | None = None,
    *,
    shards: int | None = None,
    shard_size: int | str | None = None,
    prefix: str = DEFAULT_PREFIX,
    **settings: Any,
) -> PackResult | ShardedPackResult:
    """Pack ``samples`` into a new pack of several fields at ``dst`` (format 4).

    ``pack``'s rules: ``dst`` is never overwritten without ``overwrite=True``, an interrupted
    pack resumes when the same call is made again, the pack appears at ``dst`` only when
    complete. Every field of every sample is checked (``check_fields``); a sample that fails,
    or whose ``read`` raises ``SampleError`` or OSError, is skipped and listed with its files
    (``result.skipped``, ``dst/skipped.txt``), as are ``samples.skipped`` (left out while
    listing). Masks in a lossy encoding are packed and reported (``LossyMaskWarning``).

    ``options`` (or its fields as keywords): ``check``, ``strict``, ``workers`` (threads that
    call ``samples.read``), ``overwrite``, ``restart``, ``progress``, ``commit_every``...
    ``store="raw"`` and ``resize`` are refused: fields are stored as they come.

    ``update=True`` brings the finished pack at ``dst`` up to date with ``samples`` in place,
    as ``pack(update=True)`` does (docs/updates.md): samples added, removed, and read again when
    any of their files changed (``samples.stamp``: size and modification time; ``check="content"``
    or no stamp: every sample is read and those whose record is the same are kept), in one
    transaction. The pack must hold the same fields from the same layout (its split, scale,
    columns); ``result.changes`` says what changed. A sharded pack is updated as it is split
    (``shards`` left out, or its number of shards), each shard in place as ``pack_sharded(...,
    update=True)`` does (``update_sharded``: every sample stays in its shard, a new one joins the
    shard of the sample before it; until the new ``index.json`` is in place readers see the old
    version): a ``ShardedPackResult`` with ``changes``.

    ``shards`` (a number) or ``shard_size`` (``"4GB"``...) make a sharded pack instead
    (``dst/<prefix>-NNNNN-of-NNNNN.lmdb`` and ``dst/index.json``, as ``pack_sharded``; each
    shard a pack of several fields): a ``ShardedPackResult``. An interrupted run resumes
    where it stopped; a finished one is kept (``already_packed``).
    """
    opts = pack_options(options, settings)
    if opts.store != "encoded" or opts.resize is not None:
        raise OptionError(
            "samples of several fields are stored as their files are: store='raw' and resize are not supported",
            "leave them out",
        )
    sharded = shards is not None or shard_size is not None
    update_shards = opts.update and packdir.inspect(dst).kind is packdir.Kind.SHARDED
    if opts.update and sharded and not update_shards:
        opts = opts.for_new_pack()  # no sharded pack to update: pack it (or finish the one started there)
    _check_samples(samples)
    fields = tuple(samples.fields)
    check = opts.check
    if check == CONTENT_CHECK:  # an update comparing every sample: read them with the pack's own check
        recorded = recorded_options(dst)
        check = recorded.check if recorded is not None else "header"
    n = len(samples.relpaths)
    lossy: list[tuple[str, str]] = []
    lock = threading.Lock()
    max_pixels = Image.MAX_IMAGE_PIXELS

    def stat(i: int) -> tuple[int, int]:
        if samples.stamp is None:
            return -1, UNKNOWN_MTIME
        if i >= n:  # left out while listing: the same reason, listed again without a read
            reason = samples.skipped[i - n][1].encode("utf-8", "surrogateescape")
            return len(reason), int.from_bytes(hashlib.blake2b(reason, digest_size=8).digest(), "little") >> 1
        try:
            return samples.stamp(i)
        except OSError:
            return -1, UNKNOWN_MTIME

    def load(i: int) -> Loaded | Skipped:
        # Stamped before reading: a file changed meanwhile has another stamp at the next update.
        size, stamp = stat(i)
        if i >= n:  # a sample left out while listing: listed with the others
            return Skipped(samples.skipped[i - n][1], size, stamp)
        paths = samples.field_paths[i]
        try:
            payloads = samples.read(i)
        except SampleError as exc:
            named = ", ".join(exc.paths or [p for p in paths if p])
            why = f"{exc.why}" + (f" ({named})" if named and named not in exc.why else "")
            # A file that could not be stat-ed (gone: a dataset that lists it anyway) has no
            # size: 0, as records.Skipped has then (its unknown stamp is read again next time).
            return Skipped(why, max(size, 0), stamp)
        except OSError as exc:
            return Skipped(f"cannot read it: {exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else ""))
        checked = check_fields(payloads, fields, samples.labels[i], check=check, max_pixels=max_pixels, paths=paths)
        if checked.lossy:
            with lock:
                lossy.extend((samples.relpaths[i], name) for name in checked.lossy)
        if stamp == UNKNOWN_MTIME:
            return checked.result
        if isinstance(checked.result, Loaded):
            return dataclasses.replace(checked.result, source_bytes=size, mtime_ns=stamp)
        return Skipped(checked.result.reason, size, stamp)  # unchanged, it is skipped again unread

    relpaths = list(samples.relpaths) + [path for path, _ in samples.skipped]
    labels = list(samples.labels) + [NO_LABEL] * len(samples.skipped)
    sources = SourceList(
        samples.root,
        samples.layout,
        relpaths,
        labels,
        list(samples.classes),
        {name: k for k, name in enumerate(samples.classes)},
    )
    extra = {
        "fields": [f.to_json() for f in fields],
        "layout": {"name": samples.layout, "info": samples.layout_info},
    }
    result: PackResult | ShardedPackResult
    if update_shards:
        loaded = LoadedSamples(load, stat, extra, samples.mean_size or None, len(samples.skipped))
        result = update_sharded(sources, dst, opts, shards=shards, prefix=prefix, loaded=loaded)
    elif sharded:
        result = _pack_sharded(samples, sources, dst, opts, load, stat, extra, shards, shard_size, prefix)
    else:
        result = pack_sources(
            sources, dst, opts, loader=load, mean_size=samples.mean_size or None, manifest_extra=extra, stat=stat
        )
    if not result.already_packed:
        listed = os.path.join(result.path, SKIPPED_REPORT) if isinstance(result, PackResult) else "each shard's"
        warn_skipped(result.skipped, listed + (" skipped.txt" if not isinstance(result, PackResult) else ""))
        if lossy:
            first = "; ".join(f"{printable(p, 200)}: {printable(name, 200)}" for p, name in lossy[:3])
            warnings.warn(
                f"{len(lossy):,} mask{'s are' if len(lossy) != 1 else ' is'} stored in a lossy encoding ({first}"
                f"{'; ...' if len(lossy) > 3 else ''}): their class indices are not exact near edges; "
                "save masks as PNG",
                LossyMaskWarning,
                stacklevel=2,
            )
    return result


def _pack_sharded(
    samples: FieldSamples,
    sources: SourceList,
    dst: str | os.PathLike[str],
    opts: PackOptions,
    load: Callable[[int], Loaded | Skipped],
    stat: Callable[[int], tuple[int, int]],
    extra: dict[str, Any],
    shards: int | None,
    shard_size: int | str | None,
    prefix: str,
) -> ShardedPackResult:
    """``pack_field_samples`` as a sharded pack: each shard by ``pack_shard`` with the loader, then the index."""
    start = time.perf_counter()
    n = len(sources)
    if (shards is None) == (shard_size is None):
        raise OptionError("pass one of shards and shard_size", "shards=N, or shard_size='4GB'")
    # The samples left out while listing come last in ``sources``: a shard of only those would
    # have nothing to pack, so every shard must start before them.
    listed = len(samples.relpaths)
    if shards is None:
        mean = samples.mean_size or sources.mean_file_size()
        shards = max(1, min(listed, math.ceil(mean * listed / parse_size(shard_size or 0))))
        while shards > 1 and plan_split(n, shards)[-1][0] >= listed:
            shards -= 1
    if not 1 <= shards <= n or plan_split(n, shards)[-1][0] >= listed:
        raise OptionError(
            f"cannot split {listed} samples (and {len(samples.skipped)} left out) into {shards} shards "
            "that each hold a sample",
            "use fewer shards (or a larger shard_size)",
        )
    root = os.path.abspath(os.path.expanduser(os.fspath(dst)))
    digest = sources_digest(sources)
    names = [shard_name(prefix, i, shards) for i in range(shards)]
    if not opts.overwrite and os.path.isfile(os.path.join(root, SHARD_INDEX_FILE)):
        kept = [
            _same_shard(
                os.path.join(root, names[i]), shard_field(sources, i, shards, prefix=prefix, digest=digest), opts
            )
            for i in range(shards)
        ]
        if all(same for same, _, _ in kept):
            results = [
                ShardResult(names[i], i, os.path.join(root, names[i]), count, b - a, kept=True)
                for i, ((_, _, count), (a, b)) in enumerate(zip(kept, plan_split(n, shards)))
            ]
            return ShardedPackResult(root, sum(r.count for r in results), results, 0.0, already_packed=True)
    root = prepare_sharded_output(
        root, prefix=prefix, num_shards=shards, overwrite=opts.overwrite, restart=opts.restart
    )
    each = opts.replace(overwrite=False, restart=False)
    results = [
        pack_shard(
            sources,
            root,
            i,
            shards,
            each,
            prefix=prefix,
            digest=digest,
            loader=load,
            manifest_extra=extra,
            mean_size=samples.mean_size or None,
            stat=stat,
        )
        for i in range(shards)
    ]
    index = write_index(root, prefix=prefix)
    return ShardedPackResult(root, index.count, results, time.perf_counter() - start)

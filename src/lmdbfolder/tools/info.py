"""``pack_info``: a summary of a pack (single or sharded) from its metadata,
``pack_statistics``: samples per class and image sizes, from the label table and
the record headers (never an image payload), and ``format_info``: both as the
text of ``lmdbfolder info``.

Informational manifest fields (FORMAT.md) are shown as they are when they
have their documented type and as ``"invalid"`` when not: a damaged or
hostile field never makes ``info`` fail.
"""

from __future__ import annotations

import os
import statistics
from collections import Counter
from typing import Any

from lmdbfolder import packdir
from lmdbfolder.errors import CorruptRecordError
from lmdbfolder.format import INVALID, NO_LABEL, SHARD_INDEX_FILE, Manifest, ShardIndex, SourceRecord
from lmdbfolder.read.fields import samples_manifest
from lmdbfolder.read.opening import open_pack
from lmdbfolder.read.reader import Reader
from lmdbfolder.read.sharded import ShardedReader
from lmdbfolder.text import describe_changes, megabytes, plural, printable
from lmdbfolder.tools.fields import FieldStats

__all__ = ["pack_info", "pack_statistics", "format_info", "DEFAULT_SIZE_SAMPLE", "SHOWN_CLASSES", "INVALID"]

#: Record headers ``pack_statistics`` reads for the image-size distribution by
#: default (evenly spaced over the pack): a few thousand page reads, so
#: ``lmdbfolder info`` stays quick on a cold million-record pack.
DEFAULT_SIZE_SAMPLE = 10_000
#: How many of the smallest and largest classes are named.
SHOWN_CLASSES = 3
#: Records of a pack of several fields whose fields ``pack_statistics`` looks at, at most.
FIELD_SAMPLE = 2000


def pack_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Summary of a pack from its manifest, without reading any record.

    Returns a JSON-ready dict: path, format and version, count, classes,
    store, encodings, payload bytes, size on disk, source and creation info.
    For a sharded pack it also holds ``num_shards`` and ``shards`` (each
    shard's name, count and size), and ``pack_format_version``.
    ``pack_statistics`` adds the samples per class and the image sizes.

    Example:
        >>> pack_info("train.lmdb")["count"]  # doctest: +SKIP
        1281167
    """
    found = packdir.require_pack(path)
    if found.kind is packdir.Kind.SHARDED:
        return _sharded_info(found.path)
    with Reader(found.path) as reader:
        meta = reader.meta
        info = _summary(reader.path, meta, packdir.dir_size(reader.path))
        info.update(
            format_version=meta.format_version,
            pack_id=reader.pack_id,
            skipped=reader.skipped(),
            history=reader.history(),
        )
    specs = meta.field_specs
    if specs is not None:  # format 4: the fields of every sample, and where they came from
        info["fields"] = [f.to_json() for f in specs]
        info["layout"] = meta.layout_name
    if meta.format_version < 2:
        info["note"] = "format version 1: records are not bound to their index and pack (repack to get format 2)"
    return info


def pack_statistics(path: str | os.PathLike[str], *, sizes: int | None = DEFAULT_SIZE_SAMPLE) -> dict[str, Any]:
    """Samples per class and the image size distribution of a pack (single or sharded).

    Returns a JSON-ready dict:

    * ``class_counts``: class name -> samples (every class, in class order;
      unlabelled samples, label -1, count under ``"(unlabelled)"``);
    * ``smallest_classes`` / ``largest_classes``: the ``SHOWN_CLASSES``
      classes with the fewest / most samples, ``[name, count]`` pairs;
    * ``encodings``: encoding -> ``{"count", "share"}`` (from the manifest);
    * ``image_sizes``: ``min``/``median``/``max`` of ``width`` and ``height``
      over ``sampled`` records (of ``count``), read from the 32-byte record
      headers only. ``sizes`` is how many evenly spaced records to read
      (None or 0: all of them; a negative number: none, ``image_sizes`` is None).
      Records whose size is unknown (``--check none`` on a format the writer
      could not sniff) are counted in ``unknown``, damaged ones in ``unreadable``.

    The counts come from the label table (no record is read).
    """
    # Only the headers are looked at: no CRC over payloads (a cold pack would be
    # read in full). A record that cannot be read is counted, not fatal.
    with open_pack(path, verify_checksums=False) as reader:
        classes = reader.classes
        labels = reader.labels
        counted = Counter(labels)
        counts = {name: counted.get(i, 0) for i, name in enumerate(classes)}
        if counted.get(NO_LABEL):
            counts["(unlabelled)"] = counted[NO_LABEL]
        ranked = sorted(((counts[name], name) for name in classes), key=lambda t: t[0])  # stable: class order
        n = len(reader)
        encodings = reader.meta.encodings or {}  # None: absent, or not of its type
        out: dict[str, Any] = {
            "path": reader.path,
            "count": n,
            "class_counts": counts,
            "smallest_classes": [[name, c] for c, name in ranked[:SHOWN_CLASSES]],
            "largest_classes": [[name, c] for c, name in sorted(ranked, key=lambda t: -t[0])[:SHOWN_CLASSES]],
            "encodings": {k: {"count": v, "share": round(v / n, 4) if n else 0.0} for k, v in encodings.items()},
            "image_sizes": None,
        }
        if (sizes is not None and sizes < 0) or n == 0:
            return out
        samples_meta = samples_manifest(reader)
        if samples_meta is not None:
            out["field_stats"] = _field_stats(reader, samples_meta, sizes)
        step = 1 if not sizes or sizes >= n else n / sizes
        picks = sorted({int(k * step) for k in range(n if step == 1 else int(sizes or n))})
        widths, heights, unknown, unreadable = [], [], 0, 0
        for i in picks:
            try:
                record = reader.get(i)
            except CorruptRecordError:
                unreadable += 1
                continue
            if record.width and record.height:
                widths.append(record.width)
                heights.append(record.height)
            else:
                unknown += 1

        def spread(values: list[int]) -> dict[str, float] | None:
            if not values:
                return None
            return {"min": min(values), "median": statistics.median(values), "max": max(values)}

        out["image_sizes"] = {
            "sampled": len(picks),
            "of": n,
            "unknown": unknown,
            "unreadable": unreadable,
            "width": spread(widths),
            "height": spread(heights),
        }
    return out


def _field_stats(reader: Any, meta: Manifest, sizes: int | None) -> dict[str, Any]:
    """A pack of several fields: each field's encodings and the per-category (COCO) or
    per-mask-value counts, from up to ``FIELD_SAMPLE`` evenly spaced records (``sizes``
    when smaller; 0 or None: ``FIELD_SAMPLE``)."""
    n = len(reader)
    want = min(n, sizes or FIELD_SAMPLE, FIELD_SAMPLE)
    stats = FieldStats(tuple(meta.field_specs or ()))
    layout = meta.layout_name
    for k in range(want):
        try:
            stats.add(reader.get(int(k * n / want)).payload, layout)
        except CorruptRecordError:
            continue
    categories = meta.layout_info.get("categories") or []
    names = [(c.get("id"), c.get("name")) for c in categories if isinstance(c, dict)]
    return stats.as_dict(names)


def _summary(path: str, meta: Manifest | ShardIndex, size: int) -> dict[str, Any]:
    """The fields a pack's manifest and a sharded pack's index have in common."""
    shown = meta.shown
    return {
        "path": path,
        "format": meta.format,
        "count": meta.count,
        "num_classes": len(meta.classes),
        "classes": meta.classes,
        "store": meta.store,
        "encodings": {} if shown.encodings is None else shown.encodings,
        "payload_bytes": shown.payload_bytes,
        "size_on_disk": size,
        "source": shown.source,
        "created_by": shown.created_by,
        "created_at": shown.created_at,
        "updated_at": shown.updated_at,
    }


def _sharded_info(path: str) -> dict[str, Any]:
    reader = ShardedReader(path)
    meta = reader.meta
    shards = []
    skipped: list[dict[str, Any]] = []
    size = os.path.getsize(os.path.join(reader.path, SHARD_INDEX_FILE))
    for entry, shard_path in zip(meta.shards, reader.shards):
        with Reader(shard_path) as shard:
            items = shard.skipped()
        if isinstance(items, list):
            skipped.extend(items)
        shard_size = packdir.dir_size(shard_path)
        size += shard_size
        shards.append({"name": entry.name, "count": entry.count, "size_on_disk": shard_size})
    info = _summary(reader.path, meta, size)
    first = samples_manifest(reader)
    if first is not None and first.field_specs is not None:  # shards of several fields: the first says
        info["fields"] = [f.to_json() for f in first.field_specs]
        info["layout"] = first.layout_name
    info.update(
        format_version=meta.index_version,
        pack_format_version=meta.pack_format_version,
        num_shards=len(shards),
        shards=shards,
        skipped=skipped,
        history=list(meta.history or []),  # None: absent, or not a list of objects
    )
    return info


def format_info(info: dict[str, Any], skipped_shown: int = 20) -> str:
    """The text of ``lmdbfolder info``: one ``key: value`` line per field, aligned,
    then the first ``skipped_shown`` skipped source files, one per line, and how
    many more there are (``--json`` and the pack's ``skipped.txt`` list them all).

    ``info`` is ``pack_info``'s dict updated with ``pack_statistics``' (its
    ``encodings`` turned into ``encoding_shares``: encoding -> share), as
    ``lmdbfolder info --json`` prints it. Informational fields that read
    ``"invalid"`` (a damaged or foreign manifest) are shown as such.

    Example:
        >>> print(format_info(info))  # doctest: +SKIP
        pack:         /data/train.lmdb
        ...
    """
    # Every string here may come from a pack someone else wrote: printable() escapes
    # terminal control sequences in it and bounds its length.
    skipped = info["skipped"] if isinstance(info["skipped"], list) else []
    rows = _main_rows(info, skipped, skipped_shown)
    if "shards" in info:
        names = [printable(s["name"], 80) for s in info["shards"]]
        shown_shards = ", ".join(names[:2]) + (", ..." if len(names) > 2 else "")
        rows.insert(3, ("shards", f"{info['num_shards']:,} ({shown_shards})"))
    after_classes = [k for k, _ in rows].index("classes") + 1
    rows[after_classes:after_classes] = _class_rows(info) + _field_rows(info)
    sizes_info = info.get("image_sizes")
    if sizes_info and sizes_info["width"]:
        # before "skipped", whose list follows the rows
        rows.insert([k for k, _ in rows].index("skipped"), ("image sizes", _image_sizes_text(sizes_info)))
    created = [k for k, _ in rows].index("created") + 1
    rows[created:created] = _history_rows(info.get("history") or [])
    width = max(len(k) for k, _ in rows)
    lines = [f"{key + ':' if key else '':<{width + 2}}{value}" for key, value in rows]
    return "\n".join(lines + _skipped_lines(skipped, skipped_shown, sharded="shards" in info))


def _main_rows(info: dict[str, Any], skipped: list[Any], skipped_shown: int) -> list[tuple[str, str]]:
    """The rows of ``format_info`` that every pack has, in their order."""
    classes = info["classes"]
    shown = ", ".join(printable(c, 60) for c in classes[:5]) + (", ..." if len(classes) > 5 else "")
    payload = info["payload_bytes"]
    version = f"{info['format']} version {info['format_version']}"
    if info.get("pack_id"):
        version += f" (pack {info['pack_id']})"
    return [
        ("pack", printable(info["path"], None)),
        ("format", version + (f"; {info['note']}" if info.get("note") else "")),
        ("samples", f"{info['count']:,}"),
        ("classes", f"{info['num_classes']:,}" + (f" ({shown})" if classes else "")),
        ("store", info["store"]),
        ("encodings", _encodings_text(info)),
        ("payload", megabytes(payload) if isinstance(payload, int) else str(payload)),
        ("size on disk", megabytes(info["size_on_disk"])),
        ("source", _source_text(info.get("source") or {})),
        ("created", f"{printable(info.get('created_at'), 40)} by {printable(info.get('created_by'), 80)}"),
        ("skipped", _skipped_text(info["skipped"], skipped, skipped_shown)),
    ]


def _field_rows(info: dict[str, Any]) -> list[tuple[str, str]]:
    """A pack of several fields: the layout, each field (kind, encodings), and the counts per
    COCO category or per mask value, from the records ``pack_statistics`` looked at."""
    if not info.get("fields"):
        return []
    stats = info.get("field_stats") or {}
    encodings = {f["name"]: f["encodings"] for f in stats.get("fields", [])}
    rows = [("layout", printable(info.get("layout") or "-", 40))]
    for f in info["fields"]:
        seen = encodings.get(f["name"]) or {}
        shown = ", ".join(f"{printable(k, 20)} {v:,}" for k, v in seen.items())
        rows.append((f"field {printable(f['name'], 64)}", f"{f['kind']}" + (f" ({shown})" if shown else "")))
    looked = stats.get("looked_at")
    if stats.get("categories"):
        cats = sorted(stats["categories"], key=lambda c: -c["annotations"])
        text = ", ".join(f"{printable(c['name'] or c['id'], 40)} {c['annotations']:,}" for c in cats[:8])
        rows.append(("categories", text + (", ..." if len(cats) > 8 else "") + f" (annotations in {looked:,} samples)"))
    if stats.get("mask_values"):
        values = list(stats["mask_values"].items())
        text = ", ".join(f"{printable(v, 12)}: {n:,}" for v, n in values[:12])
        rows.append(("mask values", text + (", ..." if len(values) > 12 else "") + f" (samples, of {looked:,})"))
    return rows


def _encodings_text(info: dict[str, Any]) -> str:
    """``jpeg 990 (99%), png 10 (1%)``: each encoding's count and share (or the invalid marker)."""
    encodings = info["encodings"]
    if not isinstance(encodings, dict):
        return str(encodings)
    shares = info["encoding_shares"]
    return ", ".join(f"{printable(k, 20)} {v:,} ({shares.get(k, 0):.0%})" for k, v in encodings.items()) or "-"


def _source_text(source: Any) -> str:
    """The source line: layout, root or list file, and the file filters."""
    record = SourceRecord.of(source)
    if record is None:
        return str(source)
    where = record.list_file or record.root or ""
    return printable(f"{record.layout or '?'} {where}{_filters(record)}")


def _skipped_text(recorded: Any, skipped: list[Any], skipped_shown: int) -> str:
    """The ``skipped`` row: how many, and whether all are listed below (``recorded``: the
    field as the pack has it, shown as it is when it is not a list)."""
    if not isinstance(recorded, list):
        return str(recorded)
    if not skipped:
        return plural(0, "source file")
    below = " (listed below)" if len(skipped) <= skipped_shown else f" (the first {skipped_shown:,} below)"
    return plural(len(skipped), "source file") + below


def _image_sizes_text(sizes: dict[str, Any]) -> str:
    """The ``image sizes`` row: the spread of the widths and heights sampled from record headers."""
    w, h = sizes["width"], sizes["height"]
    return (
        f"width {w['min']:,}..{w['max']:,} (median {w['median']:,g}), "
        f"height {h['min']:,}..{h['max']:,} (median {h['median']:,g}) px, "
        f"from {sizes['sampled']:,} of {plural(sizes['of'], 'record header')}"
        + (f" ({sizes['unknown']:,} without a size)" if sizes["unknown"] else "")
        + (f" ({sizes['unreadable']:,} damaged)" if sizes.get("unreadable") else "")
    )


def _skipped_lines(skipped: list[Any], skipped_shown: int, *, sharded: bool) -> list[str]:
    """The first ``skipped_shown`` skipped files, one a line, and how many more there are."""
    lines = [
        f"  {printable(item.get('path'), 1000)}: {printable(item.get('reason'))}"
        if isinstance(item, dict)
        else f"  {INVALID}"
        for item in skipped[:skipped_shown]
    ]
    if len(skipped) > skipped_shown:
        # A pack of a million files can have skipped tens of thousands: a terminal's worth, not all.
        listed = "each shard's skipped.txt" if sharded else "the pack's skipped.txt"
        lines.append(
            f"  ... and {len(skipped) - skipped_shown:,} more (`lmdbfolder info --json` and {listed} list them all)"
        )
    return lines


def _history_rows(history: list[dict[str, Any]], shown: int = 10) -> list[tuple[str, str]]:
    """The ``history`` lines of ``info``: the pack, then each update, oldest first
    (the last ``shown``); every field is bounded, since it is read from the pack."""
    if not history:
        return []
    rows = []
    for item in history[-shown:]:
        at = printable(item.get("at", "?"), 32)
        count = item.get("count")
        total = f"{count:,} samples" if type(count) is int else "?"
        if item.get("event") == "truncated":  # a long history is held (and kept) in part
            dropped = item.get("dropped")
            rows.append(("", f"... {dropped:,} earlier events not kept" if type(dropped) is int else "..."))
        elif item.get("event") == "update":
            rows.append(("", f"{at}  updated: {describe_changes(item)} -> {total}"))
        else:
            rows.append(("", f"{at}  packed: {total}"))
    earlier = len(history) - shown
    first = f"{plural(len(history), 'event')}" + (f", the last {shown} (all: --json)" if earlier > 0 else "")
    return [("history", first), *rows]


def _class_rows(info: dict[str, Any], every_up_to: int = 20) -> list[tuple[str, str]]:
    """The per-class lines of ``info``: every class's count for a few classes,
    else the spread and the smallest and largest classes."""
    counts: dict[str, int] = info.get("class_counts") or {}
    if not counts:
        return []
    if len(counts) <= every_up_to:
        return [("per class", ", ".join(f"{printable(name, 60)} {n:,}" for name, n in counts.items()))]
    values = sorted(counts.values())
    median = values[len(values) // 2]

    def named(pairs: list[list[Any]]) -> str:
        return ", ".join(f"{printable(name, 60)} {n:,}" for name, n in pairs)

    return [
        ("per class", f"{values[0]:,}..{values[-1]:,} samples (median {median:,}); every count: --json"),
        ("smallest", named(info["smallest_classes"])),
        ("largest", named(info["largest_classes"])),
    ]


def _filters(record: SourceRecord) -> str:
    """The file filters a source record holds, as ``pack``'s flags (what ``--update`` keeps)."""
    from lmdbfolder.write.sources import IMG_EXTENSIONS

    words = []
    exts = record.extensions
    if record.is_valid_file is not None:
        words.append(f"is_valid_file {record.is_valid_file}")
    elif exts is not None and record.layout != "list" and exts != IMG_EXTENSIONS:
        words.append("--extensions " + ",".join(exts))
    if record.match is not None:
        words.append(f"--match {record.match!r}")
    return f" ({' '.join(words)})" if words else ""

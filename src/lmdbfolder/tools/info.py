"""``pack_info``: a summary of a pack (single or sharded) from its metadata, no record read.

Informational manifest fields (FORMAT.md) are shown as they are when they
have their documented type and as ``"invalid"`` when not: a damaged or
hostile field never makes ``info`` fail.
"""

from __future__ import annotations

import os
from typing import Any

from lmdbfolder import packdir
from lmdbfolder.format import INVALID, SHARD_INDEX_FILE, informational
from lmdbfolder.read.reader import Reader
from lmdbfolder.read.sharded import ShardedReader

__all__ = ["pack_info", "INVALID"]


def pack_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Summary of a pack from its manifest, without reading any record.

    Returns a JSON-ready dict: path, format and version, count, classes,
    store, encodings, payload bytes, size on disk, source and creation info.
    For a sharded pack it also holds ``num_shards`` and ``shards`` (each
    shard's name, count and size), and ``pack_format_version``.

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
        info.update(format_version=meta["format_version"], pack_id=reader.pack_id, skipped=reader.skipped())
    if meta["format_version"] < 2:
        info["note"] = "format version 1: records are not bound to their index and pack (repack to get format 2)"
    return info


def _summary(path: str, meta: dict[str, Any], size: int) -> dict[str, Any]:
    """The fields a pack's manifest and a sharded pack's index have in common."""
    return {
        "path": path,
        "format": meta["format"],
        "count": meta["count"],
        "num_classes": len(meta["classes"]),
        "classes": meta["classes"],
        "store": meta["store"],
        "encodings": informational(meta, "encodings", {}),
        "payload_bytes": informational(meta, "payload_bytes"),
        "size_on_disk": size,
        "source": informational(meta, "source"),
        "created_by": informational(meta, "created_by"),
        "created_at": informational(meta, "created_at"),
    }


def _sharded_info(path: str) -> dict[str, Any]:
    reader = ShardedReader(path)
    meta = reader.meta
    shards = []
    skipped: list[dict[str, Any]] = []
    size = os.path.getsize(os.path.join(reader.path, SHARD_INDEX_FILE))
    for entry, shard_path in zip(meta["shards"], reader.shards):
        with Reader(shard_path) as shard:
            items = shard.skipped()
        if isinstance(items, list):
            skipped.extend(items)
        shard_size = packdir.dir_size(shard_path)
        size += shard_size
        shards.append({"name": entry["name"], "count": entry["count"], "size_on_disk": shard_size})
    info = _summary(reader.path, meta, size)
    info.update(
        format_version=meta["index_version"],
        pack_format_version=meta["pack_format_version"],
        num_shards=len(shards),
        shards=shards,
        skipped=skipped,
    )
    return info

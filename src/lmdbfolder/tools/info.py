"""``pack_info``: a summary of a pack (single or sharded) from its metadata, no record read."""

from __future__ import annotations

import os
from typing import Any

from lmdbfolder import packdir
from lmdbfolder.format import SHARD_INDEX_FILE
from lmdbfolder.read.reader import Reader
from lmdbfolder.read.sharded import ShardedReader

__all__ = ["pack_info"]


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
    reader = Reader(found.path)
    meta = reader.meta
    info = _summary(reader.path, meta, packdir.dir_size(reader.path))
    info.update(format_version=meta["format_version"], skipped=meta.get("skipped", []))
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
        "encodings": meta.get("encodings", {}),
        "payload_bytes": meta.get("payload_bytes"),
        "size_on_disk": size,
        "source": meta.get("source"),
        "created_by": meta.get("created_by"),
        "created_at": meta.get("created_at"),
    }


def _sharded_info(path: str) -> dict[str, Any]:
    reader = ShardedReader(path)
    meta = reader.meta
    shards = []
    skipped: list[dict[str, Any]] = []
    size = os.path.getsize(os.path.join(reader.path, SHARD_INDEX_FILE))
    for entry, shard_path in zip(meta["shards"], reader.shards):
        skipped.extend(Reader(shard_path).meta.get("skipped", []))
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

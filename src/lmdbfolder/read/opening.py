"""Open a pack of either kind: ``open_pack``."""

from __future__ import annotations

import os
from typing import Union

from lmdbfolder import packdir
from lmdbfolder.errors import OptionError
from lmdbfolder.read.reader import Reader
from lmdbfolder.read.sharded import ShardedReader
from lmdbfolder.read.staging import StagedPack
from lmdbfolder.remote import is_url

__all__ = ["open_pack", "AnyReader"]

#: What ``open_pack`` returns: both offer the same reading API (``PackAPI``).
AnyReader = Union[Reader, ShardedReader]


def open_pack(
    path: str | os.PathLike[str],
    *,
    readahead: bool = True,
    verify_checksums: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit: int | None = None,
) -> AnyReader:
    """Open the pack at ``path``: a ``Reader`` for a single pack, a ``ShardedReader``
    for a sharded one (a directory holding ``index.json``), with the same API.

    ``path`` may be the URL of a sharded pack in object storage
    (``s3://bucket/train``; ``gs://``, ``az://``): its index is fetched now and
    each shard is staged into ``cache_dir`` (required then; the same folder
    for every process of a node) when it is first read, or ahead of that when
    ``ExactDistributedSampler`` drives the reads (``read.staging``).
    ``cache_limit``: bytes of its shards to keep in the cache at most.

    Raises NotAPackError saying what is at ``path`` instead (nothing, an
    unfinished pack, an image folder, ...), RemoteError for a URL that cannot
    be read (naming it and why).

    Example:
        >>> import lmdbfolder
        >>> with lmdbfolder.open_pack("train.lmdb") as r:  # doctest: +SKIP
        ...     print(len(r), r.classes[:3])
    """
    if is_url(path):
        if cache_dir is None:
            raise OptionError(
                f"reading {path} needs cache_dir: a local folder (on fast disk) its shards are staged into",
                "pass cache_dir=..., the same folder for every process of a node",
            )
        staging = StagedPack(str(path), cache_dir, cache_limit=cache_limit)
        return ShardedReader(staging.root, readahead=readahead, verify_checksums=verify_checksums, staging=staging)
    if cache_dir is not None or cache_limit is not None:
        raise OptionError(f"cache_dir and cache_limit are for packs in object storage (a URL), not {path}")
    found = packdir.require_pack(path)
    if found.kind is packdir.Kind.SHARDED:
        return ShardedReader(found.path, readahead=readahead, verify_checksums=verify_checksums)
    return Reader(found.path, readahead=readahead, verify_checksums=verify_checksums)

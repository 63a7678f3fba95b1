"""Open a pack of either kind: ``open_pack``."""

from __future__ import annotations

import os
from typing import Union

from lmdbfolder import packdir
from lmdbfolder.read.reader import Reader
from lmdbfolder.read.sharded import ShardedReader

__all__ = ["open_pack", "AnyReader"]

#: What ``open_pack`` returns: both offer the same reading API (``PackAPI``).
AnyReader = Union[Reader, ShardedReader]


def open_pack(path: str | os.PathLike[str], *, readahead: bool = True, verify_checksums: bool = True) -> AnyReader:
    """Open the pack at ``path``: a ``Reader`` for a single pack, a ``ShardedReader``
    for a sharded one (a directory holding ``index.json``), with the same API.

    Raises NotAPackError saying what is at ``path`` instead (nothing, an
    unfinished pack, an image folder, ...).

    Example:
        >>> import lmdbfolder
        >>> with lmdbfolder.open_pack("train.lmdb") as r:  # doctest: +SKIP
        ...     print(len(r), r.classes[:3])
    """
    found = packdir.require_pack(path)
    if found.kind is packdir.Kind.SHARDED:
        return ShardedReader(found.path, readahead=readahead, verify_checksums=verify_checksums)
    return Reader(found.path, readahead=readahead, verify_checksums=verify_checksums)

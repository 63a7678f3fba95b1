"""Copy a pack (single or sharded) safely: every key read through the checked
reader, compacted.

``copy_pack`` copies with ``packdir.copy_single``: every key and value is read
through ``PageFile`` (a damaged source is a PackError naming the damage,
never a crash, which LMDB's own copy of a damaged file can be), every
record's checksum is checked, and they are appended in key order to a fresh
LMDB (free pages left out, pages in tree order, so the copy is as small and
as sequential as the database allows). It checks that the copy holds the
same count and tables, and publishes it with one rename, so the destination
never holds a half-copied pack. What may be replaced at
the destination, and what the temporary directory is, is ``packdir``'s call.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from typing import Any

from lmdbfolder import packdir
from lmdbfolder.errors import NotAPackError, OutputExistsError, PackError
from lmdbfolder.format import COPYING_SUFFIX, SHARD_INDEX_FILE, encode_shard_index
from lmdbfolder.text import plural

__all__ = ["CopyResult", "copy_pack"]


@dataclass
class CopyResult:
    """What ``copy_pack`` did."""

    src: str
    dst: str
    count: int
    shards: int
    bytes_before: int
    bytes_after: int
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary (``lmdbfolder copy --json``)."""
        out = dict(self.__dict__)
        out["seconds"] = round(self.seconds, 3)
        return out


def copy_pack(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], *, overwrite: bool = False, verify: bool = False
) -> CopyResult:
    """Copy the pack (or sharded pack) ``src`` to the new path ``dst``, compacted.

    Every database is copied key by key through the checked reader
    (``packdir.copy_single``; a damaged source is a PackError); a sharded
    pack's ``index.json`` is copied with each shard's new size. The copy is
    built in ``<dst>.copying`` and renamed to ``dst`` when complete.
    ``dst`` must not exist unless ``overwrite``, and then it must be provably
    an lmdbfolder pack (never a directory holding anything else, never a
    symbolic link); it must not overlap ``src``. ``verify=True`` checks every
    record of the copy (``lmdbfolder.verify``) before it is published.

    Example:
        >>> from lmdbfolder import copy_pack
        >>> copy_pack("/shared/train", "/local/ssd/train")  # doctest: +SKIP
    """
    start = time.perf_counter()
    found = packdir.require_pack(src)
    src_path = found.path
    dst_path = os.path.abspath(os.path.expanduser(os.fspath(dst)))
    if packdir.overlap(src_path, dst_path):
        raise OutputExistsError(
            dst_path,
            f"overlaps the source pack {src_path} (it is the source, inside it, or holds it)",
            "copy to a path outside the source pack",
        )
    if os.path.lexists(dst_path):
        if not overwrite:
            raise OutputExistsError(dst_path)
        packdir.check_replaceable(dst_path)
    tmp = dst_path + COPYING_SUFFIX
    packdir.clear_temp_dir(tmp)  # left by an interrupted copy, if provably ours
    os.makedirs(os.path.dirname(dst_path), exist_ok=True)
    packdir.make_temp_dir(tmp)
    try:
        if found.kind is packdir.Kind.SHARDED:
            count, shards, before, after = _copy_sharded(src_path, tmp)
        else:
            count, before, after = packdir.copy_single(src_path, tmp)
            shards = 1
        if verify:
            from lmdbfolder.tools.verify import verify as verify_pack

            report = verify_pack(tmp, progress=False)
            if not report.ok:
                raise PackError(
                    f"the copy of {src_path} has {plural(len(report.problems), 'problem')}: {report.problems[0]}",
                    "run `lmdbfolder verify` on the source: it is probably damaged",
                )
        packdir.publish(tmp, dst_path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # made by this call, a moment ago
        raise
    return CopyResult(src_path, dst_path, count, shards, before, after, time.perf_counter() - start)


def _copy_sharded(src: str, out: str) -> tuple[int, int, int, int]:
    from lmdbfolder.read.sharded import ShardedReader

    root, index = packdir.load_index(src)
    ShardedReader(root)  # names every missing shard before anything is copied
    before = after = 0
    for entry in index["shards"]:
        shard = os.path.join(src, entry["name"])
        count, b, a = packdir.copy_single(shard, os.path.join(out, entry["name"]))
        if count != entry["count"]:
            raise NotAPackError(shard, f"it holds {count} samples, the index says {entry['count']}")
        entry["bytes"] = a
        before += b
        after += a
    with open(os.path.join(out, SHARD_INDEX_FILE), "wb") as f:
        f.write(encode_shard_index(index))
    return index["count"], len(index["shards"]), before, after

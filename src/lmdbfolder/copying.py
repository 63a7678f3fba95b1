"""Copy a pack (single or sharded) safely: LMDB's consistent copy, compacted.

``cp`` of an LMDB file that something is writing copies pages of different
transactions (a corrupt copy that nothing detects). ``copy_pack`` copies
through a read transaction (``mdb_env_copy2`` with compaction: free pages
are left out and the rest renumbered in tree order, so the copy is as small
and as sequential as the database allows), checks that the copy opens with
the same count and tables, and publishes it with one rename, so the
destination never holds a half-copied pack.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from typing import Any

import lmdb

from lmdbfolder.errors import NotAPackError, OutputExistsError, PackError
from lmdbfolder.files import fsync_path, swap_into_place
from lmdbfolder.format import (
    DATA_FILE,
    LABELS_KEY,
    LOCK_FILE,
    META_KEY,
    PATHS_KEY,
    SHARD_INDEX_FILE,
    decode_shard_index,
    encode_shard_index,
)
from lmdbfolder.reader import _REGISTRY, Reader, is_sharded, resolve_pack_path

__all__ = ["CopyResult", "copy_pack"]

_TMP_SUFFIX = ".copying"
_EXTRA_FILES = ("skipped.txt",)


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

    Every database is copied with LMDB's consistent copy (``compact=True``);
    a sharded pack's ``index.json`` is copied with each shard's new size. The
    copy is built in ``<dst>.copying`` and renamed to ``dst`` when complete.
    ``dst`` must not exist unless ``overwrite`` (and then it must be a pack).
    ``verify=True`` checks every record of the copy (``lmdbfolder.verify``)
    before it is published.

    Example:
        >>> from lmdbfolder.copying import copy_pack
        >>> copy_pack("/shared/train", "/local/ssd/train")  # doctest: +SKIP
    """
    start = time.perf_counter()
    sharded = is_sharded(src)
    src_path = _resolve(src, sharded)
    dst_path = os.path.abspath(os.fspath(dst))
    if dst_path == src_path or dst_path.startswith(src_path + os.sep):
        raise OutputExistsError(dst_path, "is the source pack or inside it", "copy to another path")
    if os.path.lexists(dst_path):
        if not overwrite:
            raise OutputExistsError(dst_path)
        if not (is_sharded(dst_path) or os.path.isfile(os.path.join(dst_path, DATA_FILE))):
            raise OutputExistsError(
                dst_path, "exists and is not an lmdbfolder pack; refusing to replace it", "remove it yourself"
            )
    tmp = dst_path + _TMP_SUFFIX
    if os.path.lexists(tmp):
        shutil.rmtree(tmp)  # left by an interrupted copy: ours by its name
    os.makedirs(os.path.dirname(dst_path), exist_ok=True)
    try:
        if sharded:
            count, shards, before, after = _copy_sharded(src_path, tmp)
        else:
            count, before, after = _copy_one(src_path, tmp)
            shards = 1
        if verify:
            from lmdbfolder.verify import verify as verify_pack

            report = verify_pack(tmp, progress=False)
            if not report.ok:
                raise PackError(
                    f"the copy of {src_path} has {len(report.problems)} problem(s): {report.problems[0]}",
                    "run `lmdbfolder verify` on the source: it is probably damaged",
                )
        fsync_path(tmp)
        swap_into_place(tmp, dst_path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return CopyResult(src_path, dst_path, count, shards, before, after, time.perf_counter() - start)


def _resolve(src: str | os.PathLike[str], sharded: bool) -> str:
    if not sharded:
        return resolve_pack_path(src)
    p = os.path.abspath(os.fspath(src))
    return os.path.dirname(p) if os.path.basename(p) == SHARD_INDEX_FILE else p


def _copy_one(src: str, out: str) -> tuple[int, int, int]:
    """Copy the single pack ``src`` to the new directory ``out``; return count and sizes."""
    with Reader(src) as reader:  # checks the manifest and that data.mdb is whole
        count = len(reader)
        tables = _tables(reader)
    os.mkdir(out)
    env = _REGISTRY.acquire(src, False)
    try:
        env.copy(out, compact=True)
    except lmdb.Error as exc:
        raise PackError(
            f"LMDB could not copy {src} to {out}: {exc}", "check the free space at the destination"
        ) from exc
    finally:
        _REGISTRY.release(src)
    for name in _EXTRA_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(out, name))
    lock = os.path.join(out, LOCK_FILE)
    if os.path.exists(lock):
        os.remove(lock)
    fsync_path(os.path.join(out, DATA_FILE))
    with Reader(out) as copy:
        if len(copy) != count or _tables(copy) != tables:
            raise PackError(f"the copy of {src} differs from it", "run `lmdbfolder verify` on the source")
    return count, os.path.getsize(os.path.join(src, DATA_FILE)), os.path.getsize(os.path.join(out, DATA_FILE))


def _tables(reader: Reader) -> tuple[bytes, ...]:
    txn = reader._txn()
    return tuple(bytes(txn.get(key) or b"") for key in (META_KEY, LABELS_KEY, PATHS_KEY))


def _copy_sharded(src: str, out: str) -> tuple[int, int, int, int]:
    index_file = os.path.join(src, SHARD_INDEX_FILE)
    with open(index_file, "rb") as f:
        index = decode_shard_index(f.read(), where=index_file)
    Reader(src)  # names every missing shard before anything is copied
    os.mkdir(out)
    before = after = 0
    for entry in index["shards"]:
        shard = os.path.join(src, entry["name"])
        count, b, a = _copy_one(shard, os.path.join(out, entry["name"]))
        if count != entry["count"]:
            raise NotAPackError(shard, f"it holds {count} samples, the index says {entry['count']}")
        entry["bytes"] = a
        before += b
        after += a
    with open(os.path.join(out, SHARD_INDEX_FILE), "wb") as f:
        f.write(encode_shard_index(index))
    return index["count"], len(index["shards"]), before, after

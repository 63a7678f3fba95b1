"""Whether a pack is already written, or may be resumed: fingerprints and checkpoints.

Every pack carries a fingerprint of its sources and options
(``pack_fingerprint``): the checkpoint of an unfinished pack stores it, and
so does the manifest of a finished one. ``_existing_pack`` tells whether a
finished pack at ``dst`` is the one a run would write (then nothing is
done); ``_open_partial`` opens ``<dst>.partial`` and resumes its checkpoint
when the fingerprints match. A mismatch is refused with
``describe_change``: in words, what differs.

Names with a leading underscore are shared by the write modules only.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Mapping, Sequence

import lmdb

from lmdbfolder import packdir, packfile
from lmdbfolder.errors import NotAPackError, OutputExistsError, PackError, os_refusal
from lmdbfolder.format import (
    DATA_FILE,
    LOCK_FILE,
    META_KEY,
    PROGRESS_KEY,
    SKIPPED_KEY,
    Manifest,
    decode_meta,
    decode_progress,
    decode_skipped,
    encode_key,
)
from lmdbfolder.write.loop import _Partial
from lmdbfolder.write.options import PackOptions
from lmdbfolder.write.sources import SourceList

__all__ = ["pack_fingerprint", "describe_change"]


def pack_fingerprint(
    sources: SourceList, options: PackOptions, manifest_extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """What identifies a pack of ``sources`` written with ``options``: the
    resume checkpoint and the finished manifest both store it.

    A resumed pack must share it with the run that started it, and a finished
    pack with the same fingerprint is what a rerun of the same command would
    write again (``pack`` then does nothing). It costs a hash of the sample
    list (paths and labels), no file is read.
    """
    h = sources.hash_samples(hashlib.sha256())
    fingerprint = {
        "layout": sources.layout,
        "root": sources.root,
        "list_file": sources.list_file,
        "samples": len(sources),
        "samples_sha256": h.hexdigest(),
        "classes_sha256": hashlib.sha256(json.dumps(sources.classes, ensure_ascii=True).encode()).hexdigest(),
        **sources.filter_fingerprint(),
        **options.fingerprint(),
    }
    if manifest_extra:
        fingerprint["manifest_extra"] = dict(manifest_extra)
    return fingerprint


def _existing_pack(
    dst: str, fingerprint: dict[str, Any], options: PackOptions
) -> tuple[Manifest, list[tuple[str, str]]] | None:
    """(manifest, skipped files) of the finished pack at ``dst`` if it is the one this
    run would write (nothing to do); the skipped files as ``(relative path, reason)``.

    None when ``dst`` does not exist, ``overwrite`` is set, or it is not a
    readable pack (``_prepare_output`` then decides). A pack of other
    sources or options raises OutputExistsError saying what differs.
    """
    if options.overwrite or os.path.islink(dst) or packdir.inspect(dst).kind is not packdir.Kind.PACK:
        return None
    try:
        blob = packfile.read_manifest(dst)
        meta = decode_meta(blob, where=dst)
        skipped_items = packfile.read_skipped(dst) if meta.fingerprint == fingerprint else []
    except NotAPackError:
        return None
    old = meta.fingerprint
    if old != fingerprint:
        what = (
            describe_change(old, fingerprint)
            if old is not None
            else "it records no fingerprint (an older lmdbfolder made it)"
        )
        raise OutputExistsError(
            dst,
            f"already holds a pack of other sources or options: {what}",
            "pass --overwrite to pack it again, or --update to bring it up to date with the source "
            "(only the files that changed are read), or choose another output path",
        )
    return meta, [(str(item.get("path")), str(item.get("reason", ""))) for item in skipped_items]


_FINGERPRINT_WORDS = {
    "layout": "the source layout",
    "root": "the source folder",
    "list_file": "the list file",
    "samples": "the number of source files",
    "samples_sha256": "the list of source files or their labels",
    "classes_sha256": "the class names",
    "extensions": "--extensions",
    "match": "--match",
    "store": "--store",
    "check": "--check",
    "resize": "--max-size/--quality/--resize-side/--format",
    "manifest_extra": "the shard's place in its split",
}


def describe_change(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """In words, how the fingerprint ``new`` (this run) differs from ``old`` (on disk)."""
    changes = []
    for key, words in _FINGERPRINT_WORDS.items():
        if old.get(key) != new.get(key):
            if key.endswith("sha256") or key == "manifest_extra":
                changes.append(f"{words} changed")
            else:
                changes.append(f"{words} was {old.get(key)!r}, now {new.get(key)!r}")
    return "; ".join(changes) or "the options changed"


def _open_env(partial: str, map_size: int) -> lmdb.Environment:
    # DST.partial (or DST.update) kept to resume: what LMDB opens in it by name is ours.
    packdir.check_own_files(partial, (DATA_FILE, LOCK_FILE), doing="a pack")
    try:
        packdir.reserve_lock_file(partial)
    except OSError as exc:
        raise PackError(*os_refusal(exc, "cannot write", partial)) from None
    try:
        return lmdb.open(
            os.fsencode(partial),  # bytes: LMDB takes a str as UTF-8, and a name need not be
            map_size=map_size,  # sizing.plan's, which holds room on top of the estimate
            subdir=True,
            readahead=False,
            meminit=False,
            max_dbs=0,
            # Every commit is durable, so that a resume can trust it; metasync
            # off keeps the last commit's meta page unsynced, which a crash can
            # only roll back (to the commit before), never corrupt.
            sync=True,
            metasync=False,
            # Never writemap: with it, a full disk kills the process (SIGBUS)
            # instead of failing the commit. (Measured, it was also slower here.)
            writemap=False,
        )
    except lmdb.Error as exc:
        if _refused_by_disk(exc):  # a new data.mdb's first pages did not fit
            raise PackError(
                f"cannot write {partial}: {exc}",
                "free some space (or choose another disk), then run the same command again",
            ) from None
        raise OutputExistsError(
            partial, f"holds something LMDB cannot open ({exc})", "remove it, or pass --restart to start over"
        ) from None


def _refused_by_disk(exc: lmdb.Error) -> bool:
    text = str(exc)
    return any(w in text for w in ("No space left", "Disk quota", "File too large", "Read-only file system"))


def _open_partial(partial: str, fingerprint: dict[str, Any], map_size: int, relpaths: Sequence[str]) -> _Partial:
    """Open ``<dst>.partial``; resume its checkpoint if it has one that matches."""
    env = _open_env(partial, map_size)
    try:
        if env.info()["map_size"] < map_size:
            env.set_mapsize(map_size)
        with env.begin() as txn:
            blob = txn.get(PROGRESS_KEY)
            has_meta = txn.get(META_KEY) is not None
            has_records = txn.get(encode_key(0)) is not None
    except BaseException:
        env.close()
        raise
    if blob is None:
        if has_meta:
            return _finished_partial(partial, env, fingerprint, relpaths)
        if has_records:
            env.close()
            raise OutputExistsError(
                partial, "holds records but no checkpoint to resume from", "pass --restart to start over"
            )
        return _Partial(partial, env, fingerprint, {})
    progress = decode_progress(blob, where=partial)
    if "pack_id" not in progress and progress.get("next_index", 0) > 0:
        env.close()
        raise OutputExistsError(
            partial,
            "holds an unfinished pack started by an older lmdbfolder (format 1); this one writes format 2",
            "pass --restart to start over, or finish it with the lmdbfolder version that started it",
        )
    if progress.get("fingerprint") != fingerprint:
        env.close()
        raise OutputExistsError(
            partial,
            "holds an unfinished pack started with different sources or options: "
            + describe_change(progress.get("fingerprint") or {}, fingerprint),
            "rerun with the original sources and options to resume it, or pass --restart to start over",
        )
    return _Partial(partial, env, fingerprint, progress)


def _finished_partial(
    partial: str, env: lmdb.Environment, fingerprint: dict[str, Any], relpaths: Sequence[str]
) -> _Partial:
    """A partial pack whose last transaction (the manifest) committed, but which
    was not published (for example the disk filled up while compacting it)."""
    with env.begin() as txn:
        meta = decode_meta(txn.get(META_KEY), where=partial)
        skipped_blob = txn.get(SKIPPED_KEY)
    if meta.fingerprint != fingerprint:
        env.close()
        raise OutputExistsError(
            partial,
            "holds a finished but unpublished pack of different sources or options: "
            + describe_change(meta.fingerprint or {}, fingerprint),
            "pass --restart to start over",
        )
    # Same sources (the fingerprint matched): find the skipped ones' positions
    # without a dict of every path.
    skipped = meta.skipped_items if skipped_blob is None else decode_skipped(skipped_blob, where=partial)
    wanted = {item["path"] for item in skipped}
    position = {p: i for i, p in enumerate(relpaths) if p in wanted} if wanted else {}
    progress = {
        "next_source": len(relpaths),
        "next_index": meta.count,
        "skipped": [[position[item["path"]], item.get("reason", "")] for item in skipped],
        "encodings": meta.encodings or {},
        "payload_bytes": meta.payload_bytes or 0,
        "grew": True,  # unknown: it may have (informational only)
        "finished": True,
        "pack_id": meta.pack_id,
    }
    return _Partial(partial, env, fingerprint, progress)

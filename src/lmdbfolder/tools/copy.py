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

Either side may be a URL (``s3://bucket/train``; ``lmdbfolder.remote``):

* **Upload** (local -> URL): the files are uploaded as they are (a remote
  pack has the local layout), each read first through the checked reader
  (``packdir.check_single``: a damaged pack is refused, never blessed with
  a digest), shards several at once, ``index.json`` last, so a remote pack
  without its index is an unfinished upload (``overwrite`` deletes the old
  index first). The uploaded
  index adds, per shard, the SHA-256 of its ``data.mdb`` (``data_sha256``)
  and the classes it holds (``class_counts``), for downloads and staging.
* **Download** (URL -> local): shards several at once, each in ranged parts
  (``remote.download``), built in ``<dst>.copying``, which a rerun resumes
  (only the missing parts are fetched). Each shard is checked against the
  index's ``data_sha256`` (or, for a pack uploaded without it, verified
  record by record) and its manifest and tables digests before it is
  published inside ``<dst>.copying``; the pack is published when every shard
  has landed. The bytes are the remote ones (no compaction), so a pack
  round-trips byte for byte.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from lmdbfolder import packdir
from lmdbfolder.errors import (
    FormatVersionError,
    NotAPackError,
    OptionError,
    OutputExistsError,
    PackError,
    RemoteError,
)
from lmdbfolder.format import (
    COPYING_SUFFIX,
    DATA_FILE,
    MAX_INDEX_FILE_BYTES,
    SHARD_INDEX_FILE,
    SKIPPED_REPORT,
    ShardEntry,
    ShardIndex,
)
from lmdbfolder.pagefile import MDB_MAGIC, PAGEHDRSZ
from lmdbfolder.progress import Progress
from lmdbfolder.remote import DEFAULT_JOBS, DEFAULT_PART_SIZE, Limits, Remote, download, file_sha256, is_url
from lmdbfolder.text import plural

# Shards copied (or uploaded) at once, at most; a copy's `jobs` ranged requests are shared among them.
SHARDS_AT_ONCE = 8

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
    #: Bytes sent or received over the network by this run (0 for a local copy);
    #: a resumed download counts only what it fetched.
    transferred: int = 0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary (``lmdbfolder copy --json``)."""
        out = dict(self.__dict__)
        out["seconds"] = round(self.seconds, 3)
        return out


def copy_pack(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    verify: bool = False,
    jobs: int = DEFAULT_JOBS,
    part_size: int = DEFAULT_PART_SIZE,
    progress: bool | None = False,
    limits: Limits | None = None,
) -> CopyResult:
    """Copy the pack (or sharded pack) ``src`` to the new path ``dst``, compacted.

    Either may be a URL of object storage (``s3://bucket/train``): then the
    files travel as they are (see the module docs): an upload writes the
    index last, with each shard's SHA-256; a download fetches shards in
    parallel, in ranged parts of ``part_size`` bytes, ``jobs`` requests in
    flight, resumes after an interruption (a rerun fetches only what is
    missing) and checks each shard against the index before it is
    published. ``progress``: a bar of bytes for transfers (None: on a
    terminal). ``limits``: how slow a download's responses may be (``remote.Limits``:
    a deadline and a minimum rate; by default from the environment).

    Every database is copied key by key through the checked reader
    (``packdir.copy_single``; a damaged source is a PackError); a sharded
    pack's ``index.json`` is copied with each shard's new size. The copy is
    built in ``<dst>.copying`` and renamed to ``dst`` when complete.
    ``dst`` must not exist unless ``overwrite``, and then it must be provably
    an lmdbfolder pack (never a directory holding anything else, never a
    symbolic link; at a URL, never an ``index.json`` that is not a pack's index or a
    ``data.mdb`` that is not an LMDB database); it must not overlap ``src``. ``verify=True`` checks every
    record of the copy (``lmdbfolder.verify``) before it is published.

    Example:
        >>> from lmdbfolder import copy_pack
        >>> copy_pack("/shared/train", "/local/ssd/train")  # doctest: +SKIP
    """
    start = time.perf_counter()
    if jobs < 1 or part_size < 1:
        raise OptionError(f"jobs and part_size must be at least 1, got {jobs} and {part_size}")
    if is_url(src) and is_url(dst):
        raise OptionError(
            f"cannot copy from one URL to another ({src} -> {dst})",
            "copy to local disk first, then upload the local copy",
        )
    if is_url(src):
        return _download(str(src), dst, overwrite, verify, jobs, part_size, progress, start, limits or Limits.current())
    if is_url(dst):
        return _upload(src, str(dst), overwrite, verify, jobs, progress, start)
    return _copy_local(src, dst, overwrite, verify, start)


def _copy_local(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], overwrite: bool, verify: bool, start: float
) -> CopyResult:
    """``copy_pack`` from local disk to local disk: built in ``<dst>.copying``, then published."""
    found = packdir.require_pack(src)
    src_path = found.path
    dst_path = _prepare_copy_dst(src_path, dst, overwrite)
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
            _verified_or_raise(tmp, f"the copy of {src_path}")
        packdir.publish(tmp, dst_path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # made by this call, a moment ago
        raise
    return CopyResult(src_path, dst_path, count, shards, before, after, time.perf_counter() - start)


def _prepare_copy_dst(src_path: str, dst: str | os.PathLike[str], overwrite: bool) -> str:
    """The absolute ``dst`` of a local copy: not overlapping the source, and free (or, with
    ``overwrite``, provably a pack)."""
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
    return dst_path


def _copy_sharded(src: str, out: str) -> tuple[int, int, int, int]:
    from lmdbfolder.read.sharded import ShardedReader

    root, index = packdir.load_index(src)
    ShardedReader(root)  # names every missing shard before anything is copied
    before = after = 0
    copied: list[ShardEntry] = []
    for entry in index.shards:
        shard = os.path.join(src, entry.name)
        count, b, a = packdir.copy_single(shard, os.path.join(out, entry.name))
        if count != entry.count:
            raise NotAPackError(shard, f"it holds {count} samples, the index says {entry.count}")
        copied.append(entry.replaced(data_bytes=a))
        before += b
        after += a
    with open(os.path.join(out, SHARD_INDEX_FILE), "wb") as f:
        f.write(index.with_shards(copied).to_json())
    return index.count, len(index.shards), before, after


# -- object storage ----------------------------------------------------------------
def _verified_or_raise(path: str, what: str) -> None:
    from lmdbfolder.tools.verify import verify as verify_pack

    report = verify_pack(path, progress=False)
    if not report.ok:
        raise PackError(
            f"{what} has {plural(len(report.problems), 'problem')}: {report.problems[0]}",
            "run `lmdbfolder verify` on the source: it is probably damaged",
        )


def _prepare_local_dst(dst: str | os.PathLike[str], overwrite: bool) -> str:
    dst_path = os.path.abspath(os.path.expanduser(os.fspath(dst)))
    if os.path.lexists(dst_path):
        if not overwrite:
            raise OutputExistsError(dst_path)
        packdir.check_replaceable(dst_path)
    os.makedirs(os.path.dirname(dst_path), exist_ok=True)
    return dst_path


@dataclass
class _Fetch:
    """One download of a copy: its source, the folder it is built in, the transfer
    settings, the bytes fetched so far (with their progress bar), and the event that
    stops the other shards' next parts after a failure."""

    remote: Remote
    src: str
    tmp: str
    jobs: int
    part_size: int
    bar: Progress
    limits: Limits
    fetched: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    abort: threading.Event = field(default_factory=threading.Event)

    def count(self, n: int) -> None:
        """``n`` more bytes fetched (called from every download thread)."""
        with self.lock:
            self.fetched += n
            self.bar.update(n, n)


def _download(
    src: str,
    dst: str | os.PathLike[str],
    overwrite: bool,
    verify: bool,
    jobs: int,
    part_size: int,
    progress: bool | None,
    start: float,
    limits: Limits,
) -> CopyResult:
    """``copy_pack`` from a URL: built (or resumed) in ``<dst>.copying``, then published."""
    from lmdbfolder.read.staging import fetch_index

    remote = Remote(src)
    dst_path = _prepare_local_dst(dst, overwrite)
    tmp = dst_path + COPYING_SUFFIX
    try:
        blob, index = fetch_index(remote)
    except RemoteError as exc:
        if exc.kind != "single":
            raise
        blob, index = b"", None
    _resume_or_start(tmp, blob, index, src)
    entries: list[ShardEntry] = [] if index is None else list(index.shards)
    total = sum(e.data_bytes or 0 for e in entries) if index else remote.child(DATA_FILE).info().size
    bar = Progress(total, f"copy {remote.name}", enabled=progress, unit="B")
    job = _Fetch(remote, src, tmp, jobs, part_size, bar, limits)
    try:
        if index is None:
            count_samples, shards = _download_single(job), 1
        else:
            _download_shards(job, entries)
            _check_against_index(job, index)
            count_samples, shards = index.count, len(entries)
        if verify:
            _verified_or_raise(tmp, f"the copy of {src}")
        packdir.publish(tmp, dst_path)
    finally:
        job.bar.close()
    size = packdir.pack_size(dst_path)
    return CopyResult(src, dst_path, count_samples, shards, size, size, time.perf_counter() - start, job.fetched)


def _resume_or_start(tmp: str, blob: bytes, index: ShardIndex | None, src: str) -> None:
    """Keep a ``<dst>.copying`` of this very source (``blob``, its index) to resume it; clear
    anything else of ours there and start it anew (with the source's index first)."""
    from lmdbfolder.read.staging import disk_error

    resumable = os.path.isdir(tmp) and packdir.why_not_replaceable(tmp) is None
    if resumable and index is not None:
        try:
            with open(os.path.join(tmp, SHARD_INDEX_FILE), "rb") as f:
                resumable = f.read() == blob
        except OSError:
            resumable = False
    if resumable:
        return
    packdir.clear_temp_dir(tmp)
    try:
        packdir.make_temp_dir(tmp)
        if index is not None:
            # The source's index, first: it says which source a later run resumes.
            packdir.write_atomically(tmp, SHARD_INDEX_FILE, blob, f".{SHARD_INDEX_FILE}.tmp")
    except OSError as exc:
        raise disk_error(exc, src, tmp) from None


def _download_single(job: _Fetch) -> int:
    """The single pack at the URL into ``job.tmp``, every record checked (there is no digest
    to check it by); its sample count."""
    from lmdbfolder.read.staging import disk_error

    data = job.remote.child(DATA_FILE)
    try:
        download(
            data,
            os.path.join(job.tmp, DATA_FILE),
            jobs=job.jobs,
            part_size=job.part_size,
            on_bytes=job.count,
            limits=job.limits,
        )
    except OSError as exc:
        raise disk_error(exc, data.url, job.tmp) from None
    _fetch_report(job.remote, job.tmp)
    _verified_or_raise(job.tmp, f"the copy of {job.src}")  # no digest to check it by: every record
    return int(decode_meta_count(job.tmp))


def _download_shards(job: _Fetch, entries: list[ShardEntry]) -> None:
    """The shards of the index ``entries`` not in ``job.tmp`` yet, several at a time."""
    from lmdbfolder.read.staging import fetch_shard

    todo = [e for e in entries if not os.path.isdir(os.path.join(job.tmp, e.name))]
    if not todo:
        return
    parallel = max(1, min(len(todo), SHARDS_AT_ONCE, job.jobs))
    per_shard = max(1, job.jobs // parallel)
    # One listing for every shard's size and tag, instead of a HEAD request each.
    listed = job.remote.infos()

    def one(entry: ShardEntry) -> None:
        info = listed.get(f"{entry.name}/{DATA_FILE}")
        fetch_shard(
            job.remote,
            entry,
            job.tmp,
            part_size=job.part_size,
            jobs=per_shard,
            on_bytes=job.count,
            abort=job.abort,
            info=info,
            limits=job.limits,
        )
        if entry.skipped != 0:  # the index says whether there is a report to fetch
            _fetch_report(job.remote.child(entry.name), os.path.join(job.tmp, entry.name))
        if entry.data_sha256 is None:
            # Uploaded without a digest (by hand): check every record instead.
            _verified_or_raise(os.path.join(job.tmp, entry.name), f"shard {entry.name} of {job.src}")

    _run_all(one, todo, parallel, job.abort)


def _check_against_index(job: _Fetch, index: ShardIndex) -> None:
    """Before the copy is published: every shard against its index entry, as ``verify``
    checks it (tables, manifest, pack_id, count, classes, place). A shard's digest says
    its bytes are the uploaded ones, not that the index describes them: an index without
    ``data_sha256`` and with a wrong ``pack_id`` was published, and failed ``verify``."""
    from lmdbfolder.tools.verify import against_index

    url = job.remote.child(SHARD_INDEX_FILE).url
    for k, entry in enumerate(index.shards):
        path = os.path.join(job.tmp, entry.name)
        problems = against_index(path, k, entry, index)
        if problems:
            shutil.rmtree(path, ignore_errors=True)  # fetched afresh by a rerun
            raise RemoteError(
                url,
                "the index does not describe the pack's shards: "
                + "; ".join(p.message for p in problems[:3])
                + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
                + "; nothing was published",
                "the pack in storage is inconsistent: upload it again (`lmdbfolder copy PACK URL`)",
                kind="digest",
            )


def _run_all(fn: Any, items: list[Any], workers: int, abort: threading.Event) -> None:
    """``fn(item)`` for every item, ``workers`` at a time; the first error (not a
    consequence of another: ``_Aborted``) is raised once the running calls end,
    and no call starts after it."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers)
    futures = [pool.submit(fn, item) for item in items]
    first: BaseException | None = None
    try:
        for future in concurrent.futures.as_completed(futures):
            if future.cancelled():
                continue
            exc = future.exception()
            if exc is not None:
                # A full disk stops no other shard that already has its room (a rerun keeps
                # them); any other failure (the server gone, credentials) stops them all.
                if not (isinstance(exc, RemoteError) and exc.kind == "disk"):
                    abort.set()
                for pending in futures:
                    pending.cancel()
                if first is None or type(first).__name__ == "_Aborted":
                    first = exc
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    if first is not None:
        raise first


def decode_meta_count(path: str) -> int:
    """The sample count of the single pack at ``path`` (its manifest)."""
    from lmdbfolder import packfile
    from lmdbfolder.format import decode_meta

    return int(decode_meta(packfile.read_tables(path)[0], where=path).count)


#: How much of a remote skipped.txt is held in memory at a time.
_REPORT_CHUNK = 8 << 20


def _fetch_report(remote: Remote, local_dir: str) -> None:
    # skipped.txt travels with the pack (absent when nothing was skipped). Usually small, but
    # the object at the URL is anyone's: it goes to the file in bounded pieces, never whole
    # into memory.
    report = remote.child(SKIPPED_REPORT)
    if os.path.isfile(os.path.join(local_dir, SKIPPED_REPORT)) or not report.exists():
        return
    size = report.info().size
    pieces = (report.read(start, min(size, start + _REPORT_CHUNK)) for start in range(0, size, _REPORT_CHUNK))
    packdir.write_atomically(local_dir, SKIPPED_REPORT, pieces, f".{SKIPPED_REPORT}.tmp")


def _check_remote_replaceable(remote: Remote) -> None:
    """OutputExistsError unless what ``--overwrite`` would replace at ``remote`` is a
    pack: an ``index.json`` that reads as a sharded pack's index, a ``data.mdb`` that
    starts with an LMDB meta page. The objects at a URL may be anyone's."""
    index = remote.child(SHARD_INDEX_FILE)
    if index.exists():
        try:
            ShardIndex.from_json(index.read_at_most(MAX_INDEX_FILE_BYTES + 1), where=index.url)
        except FormatVersionError:
            pass  # a pack of another format version: a pack all the same
        except NotAPackError as exc:
            raise OutputExistsError(
                index.url,
                f"is not the index of an lmdbfolder pack ({exc.message}); refusing to replace it",
                "remove it yourself, or choose another URL",
            ) from None
    data = remote.child(DATA_FILE)
    if data.exists():
        head = data.read_at_most(PAGEHDRSZ + 4)
        if len(head) < PAGEHDRSZ + 4 or struct.unpack_from("<I", head, PAGEHDRSZ)[0] != MDB_MAGIC:
            raise OutputExistsError(
                data.url,
                "is not an LMDB database (no LMDB meta page at its start); refusing to replace it",
                "remove it yourself, or choose another URL",
            )


def _upload(
    src: str | os.PathLike[str],
    dst: str,
    overwrite: bool,
    verify: bool,
    jobs: int,
    progress: bool | None,
    start: float,
) -> CopyResult:
    """``copy_pack`` to a URL: the source checked whole first, then its files; a sharded
    pack's index last, with each shard's digest."""
    found = packdir.require_pack(src)
    remote = Remote(dst)
    for name in (SHARD_INDEX_FILE, DATA_FILE):
        if remote.child(name).exists() and not overwrite:
            raise OutputExistsError(
                dst, f"already holds a pack ({name})", "choose another URL, or pass --overwrite to replace it"
            )
    if verify:
        _verified_or_raise(found.path, f"the source {found.path}")
    index = _checked_source(found)
    if overwrite:
        _clear_remote(remote, found.kind is packdir.Kind.SHARDED)
    size = packdir.pack_size(found.path)
    sender = _Send(overwrite, Progress(size, f"copy {os.path.basename(found.path)}", enabled=progress, unit="B"))
    try:
        if found.kind is packdir.Kind.PACK:
            count, shards = _upload_single(found.path, remote, sender), 1
        else:
            if index is None:  # read by _checked_source for a sharded pack: tells the type checker
                raise NotAPackError(found.path, f"its {SHARD_INDEX_FILE} was not read")
            _upload_shards(found.path, index, remote, sender, jobs)
            count, shards = index.count, len(index.shards)
    finally:
        sender.bar.close()
    return CopyResult(found.path, remote.url, count, shards, size, size, time.perf_counter() - start, sender.sent)


def _checked_source(found: Any) -> ShardIndex | None:
    """Every page and record of the pack to upload checked, as a local copy does (the digests
    would vouch for damage), before anything at the URL is replaced: a damaged source loses
    nothing there. Its index (None for a single pack)."""
    from lmdbfolder.read.opening import open_pack

    if found.kind is packdir.Kind.PACK:
        packdir.check_single(found.path)
        return None
    with open(os.path.join(found.path, SHARD_INDEX_FILE), "rb") as f:
        index = ShardIndex.from_json(f.read(), where=os.path.join(found.path, SHARD_INDEX_FILE))
    open_pack(found.path).close()  # names every missing shard
    for name in index.names:
        packdir.check_single(os.path.join(found.path, name))
    return index


def _clear_remote(remote: Remote, sharded: bool) -> None:
    """Before ``--overwrite`` uploads: what is at ``remote`` is a pack, and its index is removed."""
    _check_remote_replaceable(remote)
    # The old pack's index first: until the new one lands this is an unfinished upload, never
    # the old index naming shards half replaced (or, under a single pack, the old pack itself).
    remote.child(SHARD_INDEX_FILE).remove()
    if sharded:
        remote.child(DATA_FILE).remove()  # an old single pack's, which would be read instead


@dataclass
class _Send:
    """The uploads of one copy: whether it replaces a pack, the bytes sent so far and their bar."""

    overwrite: bool
    bar: Progress
    sent: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def put(self, local_dir: str, target: Remote) -> str:
        """Upload the pack (or shard) in ``local_dir`` to ``target``: its data file and its
        skipped-files report; the data file's SHA-256."""
        data = os.path.join(local_dir, DATA_FILE)
        digest = file_sha256(data)
        target.child(DATA_FILE).upload(data)
        report = os.path.join(local_dir, SKIPPED_REPORT)
        if os.path.isfile(report):
            target.child(SKIPPED_REPORT).upload(report)
        elif self.overwrite:
            target.child(SKIPPED_REPORT).remove()  # the replaced pack's, which a download would fetch
        with self.lock:
            n = os.path.getsize(data)
            self.sent += n
            self.bar.update(n, n)
        return digest


def _upload_single(path: str, remote: Remote, sender: _Send) -> int:
    """The single pack at ``path`` to ``remote``; its sample count."""
    from lmdbfolder.read.opening import open_pack

    with open_pack(path) as reader:
        count = len(reader)
    sender.put(path, remote)
    return count


def _upload_shards(path: str, index: ShardIndex, remote: Remote, sender: _Send, jobs: int) -> None:
    """The shards of the sharded pack at ``path`` to ``remote``, several at a time, then its
    ``index`` with each shard's class counts, size and digest."""
    from lmdbfolder.read.opening import open_pack

    reader = open_pack(path)
    entries = list(index.shards)

    def one(k: int) -> None:
        entry = entries[k]
        shard = reader.shard(k)  # type: ignore[union-attr]  # checked against the index here
        counts = shard.class_counts()
        entries[k] = entry.replaced(
            class_counts=tuple((int(c), int(n)) for c, n in enumerate(counts.tolist()) if n),
            data_bytes=os.path.getsize(os.path.join(shard.path, DATA_FILE)),
            data_sha256=sender.put(shard.path, remote.child(entry.name)),
        )

    _run_all(one, list(range(len(entries))), max(1, min(len(entries), SHARDS_AT_ONCE, jobs)), threading.Event())
    reader.close()
    # Last: a remote pack without its index is an unfinished upload.
    remote.child(SHARD_INDEX_FILE).write(index.with_shards(entries).to_json())

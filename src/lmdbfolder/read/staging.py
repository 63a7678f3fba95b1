"""Staging a sharded pack from object storage onto local disk, shard by shard: ``StagedPack``.

LMDB needs a local file to map, so a pack in object storage is read by
staging: its ``index.json`` is fetched once, and each shard is copied whole
into a local cache folder when it is first needed (or ahead of need, in the
order the sampler will read them), verified, and only then published under
its own name, where ``ShardedReader`` opens it as it would any local shard.

The cache folder of a pack is ``<cache_dir>/<name>-<key>``, ``key`` a hash of
the URL and the index's bytes (a pack uploaded again under the same URL gets
a new folder; when it is opened, the old folder's shards that no live rank
on the node still needs are evicted). It holds
``index.json``, the shards that have landed, and for each shard a lock file
``<shard>.lock``:

* **One download per shard per node.** Every process that needs a shard
  (DataLoader workers, the prefetch thread of each rank, any rank on the
  node) takes the shard's lock exclusively to fetch it; the others wait on
  the lock and then find it published. ``flock`` locks go with the process,
  so a killed download frees its lock, and its ``<shard>.copying`` folder is
  resumed by the next process (``remote.download``: only the missing parts).
* **Nothing half-copied is opened.** A shard is downloaded into
  ``<shard>.copying`` (marked as ours), its SHA-256 compared with the
  index's ``data_sha256`` (written by ``lmdbfolder copy PACK URL``), its
  manifest and tables with the index's digests, then renamed into place.
* **A mapped shard is never evicted.** A reader takes the shard's lock
  shared while it opens and maps it, and before letting go of that lock
  keeps a shared lock of its own (``ShardHold``, a duplicate of the
  descriptor) for as long as it maps the shard (``open_held``; a
  ``ShardedReader`` maps 4 at most per process). An evicted file that a
  process still mapped would keep its disk space, unseen by the cache: so
  what the cache folder holds is what its shards use on disk.
* **A cache limit** (``cache_limit`` bytes of this pack's shards) is kept by
  evicting shards, least recently used first, that no rank on the node still
  needs this epoch; then, if that is not enough, the shards needed last
  (Belady's rule), never those in use or next. Each rank following a sampler
  lists what it still needs, in order, in ``.needs-<pid>-<n>`` (held with a
  shared lock while the rank lives, so a killed rank's list is recognised
  and ignored). Readers let go of what the limit needs (``let_go``): before
  opening a shard a reader closes those it maps that no live rank needs any
  more and, when the cache is above its limit, every one an eviction may
  take, then evicts what the limit asks for. Shards in use (needed now or
  next by a rank, or mapped by a reader) are never deleted, so the limit can
  be exceeded by what is in use at once: a warning says so, naming the
  mapped shards and how many processes map them; a full disk's error says
  how much of the cache readers map, and what to lower.
* **Nobody waits on a reader.** Evictions only try a shard's lock
  (``LOCK_NB``); a download takes it exclusively only while the shard is
  missing, when no reader can hold it; and a reader's hold is the duplicate
  of a lock already held, so taking it never waits. The prefetch thread of a
  rank therefore never waits for that rank's own readers (two descriptors'
  flock locks conflict even within one process).
* **Ahead of need.** ``follow(schedule)`` (called by
  ``ExactDistributedSampler`` at the start of each epoch's iteration)
  starts a thread in the rank's main process that fetches the shards in the
  order this rank will read them, ``ahead`` shards beyond the one being read.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import json
import os
import re
import shutil
import stat
import threading
import warnings
from typing import Any, Callable, Iterator, Sequence, TypeVar

from lmdbfolder import packdir, packfile
from lmdbfolder.errors import NotAPackError, OutputExistsError, RemoteError
from lmdbfolder.format import (
    COPYING_SUFFIX,
    DATA_FILE,
    MAX_INDEX_FILE_BYTES,
    NEEDS_PREFIX,
    OLD_SUFFIX,
    ROOM_LOCK,
    SHARD_INDEX_FILE,
    WRITER_LOCK_SUFFIX,
    ShardEntry,
    ShardIndex,
    shard_matches,
)
from lmdbfolder.pagefile import NotRegularFileError, read_regular
from lmdbfolder.remote import DEFAULT_JOBS, DEFAULT_PART_SIZE, Limits, ObjectInfo, Remote, download

__all__ = ["StagedPack", "ShardHold", "fetch_shard", "fetch_index"]

#: Shards of a staged pack one process keeps mapped at most (``ShardedReader``: the least
#: recently opened is closed, and its hold released, when it opens another).
MAPPED_PER_PROCESS = 4

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def fetch_index(remote: Remote) -> tuple[bytes, ShardIndex]:
    """(bytes, parsed) of the ``index.json`` of the sharded pack at ``remote``.

    A URL holding a single pack (``data.mdb``), or nothing, is a RemoteError
    saying so.
    """
    index = remote.child(SHARD_INDEX_FILE)
    try:
        # Bounded, as a local index.json is: the object at the URL may be anyone's, and huge.
        # One byte more than allowed, so that decoding refuses an index that is too long.
        blob = index.read_at_most(MAX_INDEX_FILE_BYTES + 1)
    except RemoteError as exc:
        if exc.kind == "missing" and remote.child(DATA_FILE).exists():
            raise RemoteError(
                remote.url,
                "it holds a single pack (data.mdb), not a sharded one; staging reads sharded packs",
                f"copy it to local disk first (`lmdbfolder copy {remote.url} DST`), or pack with --shards N",
                kind="single",
            ) from None
        if exc.kind == "missing":
            raise RemoteError(
                remote.url,
                f"no pack there (no {SHARD_INDEX_FILE} or {DATA_FILE}): {exc.message}",
                exc.hint,
                kind="missing",
            ) from None
        raise
    return blob, ShardIndex.from_json(blob, where=index.url)


def fetch_shard(
    remote: Remote,
    entry: ShardEntry,
    directory: str,
    *,
    part_size: int = DEFAULT_PART_SIZE,
    jobs: int = DEFAULT_JOBS,
    on_bytes: Any = None,
    abort: threading.Event | None = None,
    info: ObjectInfo | None = None,
    limits: Limits | None = None,
    when_full: Callable[[], str] | None = None,
) -> int:
    """Download the shard ``entry`` of the pack at ``remote`` and publish it as
    ``directory/<name>``; return the bytes fetched now. ``info``: the shard's
    ``data.mdb`` as a listing of the pack described it (else it is looked up).

    The shard is built in ``<name>.copying`` (kept across runs: a rerun
    fetches only the missing parts), checked against the entry's
    ``data_sha256`` (when the index has it), ``bytes``, and its manifest and
    tables digests, then renamed into place. A shard whose check fails is
    removed and reported (RemoteError kind "digest"). The caller holds the
    shard's lock. ``limits``: how slow the server may be (``remote.Limits``; by
    default from the environment). ``when_full``: the hint of a full disk (by
    default: free space there).
    """
    name = entry.name
    final = os.path.join(directory, name)
    tmp = final + COPYING_SUFFIX
    src = remote.child(name, DATA_FILE)
    if not (os.path.isdir(tmp) and packdir.why_not_replaceable(tmp) is None):
        try:
            packdir.clear_temp_dir(tmp)
            packdir.make_temp_dir(tmp)
        except OSError as exc:  # a cache folder this process may not write, a full disk
            raise disk_error(exc, src.url, directory, when_full) from None
        except OutputExistsError as exc:  # not ours (a link, a FIFO planted in it): never written through
            raise RemoteError(src.url, f"cannot stage it: {exc.message}", f"remove {tmp}", kind="disk") from None
    info = info or src.info()
    expected = entry.data_bytes
    if expected is not None and expected != info.size:
        raise RemoteError(
            src.url,
            f"it holds {info.size:,} bytes, the index says {expected:,}; nothing was kept",
            "the shard was replaced in storage without its index: upload the pack again",
            kind="digest",
        )
    digest = entry.data_sha256
    try:
        fetched, _ = download(
            src,
            os.path.join(tmp, DATA_FILE),
            info=info,
            sha256=digest,
            part_size=part_size,
            jobs=jobs,
            on_bytes=on_bytes,
            abort=abort,
            limits=limits,
        )
    except OSError as exc:
        raise disk_error(exc, src.url, tmp, when_full) from None
    try:
        tables = packfile.read_tables(tmp)
        ok = shard_matches(entry, *tables)
    except NotAPackError as exc:
        ok, why = False, exc.message
    else:
        why = "its manifest or tables do not match the index's digests"
    if not ok:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RemoteError(
            src.url,
            f"{why}; nothing was kept",
            "the shard in storage is damaged or from another pack: upload the pack again",
            kind="digest",
        )
    packdir.publish(tmp, final)
    return fetched


def disk_error(exc: OSError, url: str, where: str, when_full: Callable[[], str] | None = None) -> RemoteError:
    """A local OSError while staging (full disk, permission) as a RemoteError naming both;
    ``when_full()``: the hint for a full disk (a staging cache says what it holds)."""
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    if isinstance(exc, NotRegularFileError):  # a link or FIFO planted in the cache folder
        return RemoteError(
            url,
            f"cannot store it in {where}: {exc.filename}: {exc.strerror}",
            f"remove {exc.filename} (lmdbfolder makes it again), then run the same command again",
            kind="disk",
        )
    if not full:
        hint = "check the permissions of the destination folder"
    elif when_full is not None:
        hint = when_full()
    else:
        hint = "free space there (or use another disk); run the same command again to resume"
    return RemoteError(
        url,
        f"cannot store it in {where}: {exc.strerror or exc}" + (" (the disk is full)" if full else ""),
        hint,
        kind="disk",
    )


#: The descriptors of the cache locks this process holds now, and who opened them; and
#: the cache folders of this process's staged packs.
_HELD: dict[int, int] = {}
_ROOTS: set[str] = set()


#: The refusals of a cache folder this process may only read.
_READ_ONLY = (errno.EACCES, errno.EPERM, errno.EROFS)


@contextlib.contextmanager
def _flock(path: str, mode: int, *, create: bool = True) -> Iterator[int | None]:
    """Hold a flock on ``path`` (``mode``: ``fcntl.LOCK_SH`` or ``LOCK_EX``, with ``LOCK_NB``
    to raise BlockingIOError instead of waiting; ``create=False``: FileNotFoundError if it
    is not there); yields the descriptor. A forked child does not keep it
    (``_drop_inherited_locks``).

    In a cache folder this process may only read (staged beforehand, then shared or
    mounted read-only) an existing lock file is locked through a read-only descriptor
    (flock does not care); a shared lock whose file is not there and cannot be made
    yields None: nothing is held, and nothing in that folder is downloaded or evicted
    by this process."""
    flags = os.O_RDWR | os.O_CREAT if create else os.O_RDONLY
    try:
        fd = _open_own(path, flags)
    except OSError as exc:
        if not create or exc.errno not in _READ_ONLY:
            raise
        try:
            fd = _open_own(path, os.O_RDONLY)
        except FileNotFoundError:
            if mode & fcntl.LOCK_EX:
                raise exc from None
            yield None
            return
    _HELD[fd] = os.getpid()
    try:
        fcntl.flock(fd, mode)
        yield fd
    finally:
        if _HELD.pop(fd, None) == os.getpid():
            os.close(fd)  # closing drops the lock


def _open_own(path: str, flags: int) -> int:
    """A descriptor of ``path``, a regular file of the cache folder (``flags``: how to open
    it). A cache folder is often shared by every user of a node: a link or a FIFO planted
    under a name lmdbfolder uses is never followed nor waited on, but refused
    (``NotRegularFileError``, naming the path and saying to remove it)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegularFileError(errno.ELOOP, _planted("a symbolic link"), path) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            what = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "a special file"
            raise NotRegularFileError(errno.EINVAL, _planted(what), path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _planted(what: str) -> str:
    return f"it is {what}, which lmdbfolder never makes in a cache folder: remove it"


def _drop_inherited_locks() -> None:
    # A flock belongs to the open file, which a forked child shares: a DataLoader worker
    # forked while the prefetch thread downloads a shard would hold that shard's lock for
    # as long as it lives, and every reader of the shard would wait for it. The thread
    # that held it does not exist in the child, so nothing else would ever close it.
    # Every descriptor of a lock file in a cache folder goes, registered or not: a thread
    # between opening one and registering it, or locking it after the fork, would leave
    # an unregistered copy holding the lock.
    fds = set(_HELD)
    _HELD.clear()
    if _ROOTS:
        try:
            names = os.listdir("/proc/self/fd")
        except OSError:
            names = []  # no /proc: the registered ones
        for name in names:
            try:
                target = os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                continue
            if target.endswith(WRITER_LOCK_SUFFIX) and os.path.dirname(target) in _ROOTS:
                fds.add(int(name))
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


os.register_at_fork(after_in_child=_drop_inherited_locks)


class ShardHold:
    """A reader's hold on a staged shard it maps (``StagedPack.open_held``): a shared lock
    on the shard's lock file, through a descriptor of its own, so that no process evicts
    the shard while it is mapped (an evicted file that a process still maps keeps its
    disk space, unseen by the cache's accounting). ``release()`` once the map is closed.

    A forked child does not keep it (``_drop_inherited_locks`` closes its copy; the
    parent's hold stands), and never closes the parent's descriptor number.
    """

    __slots__ = ("fd", "pid")

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd
        self.pid = os.getpid()
        _HELD[fd] = self.pid

    def release(self) -> None:
        """Drop the lock (the shard may be evicted from now on); releasing twice does nothing."""
        fd, self.fd = self.fd, None
        # In a forked child the number may name another file by now: only the holder closes it.
        if fd is not None and self.pid == os.getpid() and _HELD.get(fd) == self.pid:
            del _HELD[fd]
            os.close(fd)

    def __del__(self) -> None:
        # A reader dropped without close(): its shard must not stay unevictable.
        with contextlib.suppress(Exception):
            self.release()


_T = TypeVar("_T")


class StagedPack:
    """A sharded pack in object storage, staged shard by shard into ``cache_dir``.

    Args:
        url: the pack's folder (``s3://bucket/train``; it holds ``index.json``).
        cache_dir: a local folder on fast disk, the same for every process of
            a node (DataLoader workers and ranks share it).
        cache_limit: bytes of this pack's shards to keep at most (None: no
            limit). Shards no rank needs any more are evicted first; shards in
            use (needed now or next by a rank, or mapped by a reader, which
            ``open_held`` holds) never are, so the cache exceeds the limit by
            what is in use at once when the limit is below it (about
            ``shards_at_once + ahead + 2`` shards; a warning says which are
            mapped). Readers let go of what the limit needs when they open
            another shard (``let_go``). Everything the cache's shards use on
            disk is in its folder: nothing evicted stays mapped.
        ahead: shards to fetch beyond the one being read, when following a
            sampler (``follow``).
        part_size, jobs: the ranged requests of each shard's download.

    Pickles without its thread and client (workers stage through the same cache).
    """

    def __init__(
        self,
        url: str,
        cache_dir: str | os.PathLike[str],
        *,
        cache_limit: int | None = None,
        ahead: int = 1,
        part_size: int = DEFAULT_PART_SIZE,
        jobs: int = DEFAULT_JOBS,
    ) -> None:
        if cache_limit is not None and cache_limit < 1:
            raise ValueError(f"cache_limit must be a positive number of bytes, got {cache_limit}")
        if ahead < 0:
            raise ValueError(f"ahead must be 0 or more, got {ahead}")
        self.remote = Remote(url)
        self.url = self.remote.url
        blob, self.index = fetch_index(self.remote)
        #: What the pack's index.json held when it was opened (``_replaced``).
        self.index_sha256 = hashlib.sha256(blob).hexdigest()
        key = _folder_key(self.url, blob)
        cache = os.path.abspath(os.path.expanduser(os.fspath(cache_dir)))
        prefix = _SAFE.sub("_", self.remote.name)[:64]
        self.root = os.path.join(cache, f"{prefix}-{key}")
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise disk_error(exc, self.url, self.root) from None
        what = packdir.not_ours(self.root, dirs=True)
        if what is not None:  # a link planted under this pack's name: its shards would land elsewhere
            raise RemoteError(
                self.url,
                f"cannot stage it in {self.root}: it is {what}, not a folder lmdbfolder made",
                f"remove {self.root} (it is made again), then open the pack again",
                kind="disk",
            )
        try:
            index_file = os.path.join(self.root, SHARD_INDEX_FILE)
            if not os.path.isfile(index_file):
                tmp = f"{index_file}.{os.getpid()}.tmp"
                with open(tmp, "wb") as f:
                    f.write(blob)
                os.replace(tmp, index_file)  # every rank writes the same bytes
        except OSError as exc:
            raise disk_error(exc, self.url, self.root) from None
        self.cache_limit = cache_limit
        self.ahead = ahead
        self.part_size = part_size
        self.jobs = jobs
        self.names: list[str] = self.index.names
        self._reset()
        self._evict_replaced(cache, prefix)

    def _evict_replaced(self, cache: str, prefix: str) -> None:
        """Evict the staged shards of this URL's earlier uploads (each got a folder of its
        own) that no live rank on this node still needs. A folder is this URL's only when
        its name is the hash of this URL and the index.json it holds."""
        try:
            names = os.listdir(cache)
        except OSError:
            return
        for name in names:
            folder = os.path.join(cache, name)
            if not name.startswith(f"{prefix}-") or folder == self.root:
                continue
            try:
                blob = read_regular(os.path.join(folder, SHARD_INDEX_FILE), MAX_INDEX_FILE_BYTES)
                index = ShardIndex.from_json(blob, where=folder)
            except (OSError, NotAPackError):
                continue
            if name != f"{prefix}-{_folder_key(self.url, blob)}":
                continue
            old = StagedPack.__new__(StagedPack)
            old.__dict__.update(self.__getstate__())
            old.root, old.index, old.names = folder, index, index.names
            old._reset()
            try:
                needed = old.needed()
                for k in old.staged():
                    if k not in needed:
                        old.evict(k)
            except OSError:
                continue  # a folder this process may not change: it stays as it is

    def _reset(self) -> None:
        _ROOTS.add(self.root)
        self._follower: _Follower | None = None
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_follower", "_lock", "_pid"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def __repr__(self) -> str:
        return f"StagedPack({self.url!r}, cache={self.root!r}, shards={len(self.names)})"

    # -- shards ----------------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        """Number of shards."""
        return len(self.names)

    def path(self, k: int) -> str:
        """Where shard ``k`` is (or will be) in the cache."""
        return os.path.join(self.root, self.names[k])

    def _lock_file(self, k: int) -> str:
        return self.path(k) + WRITER_LOCK_SUFFIX

    def staged(self) -> list[int]:
        """The shards in the cache now."""
        return [k for k in range(len(self.names)) if os.path.isdir(self.path(k))]

    def ensure(self, k: int) -> str:
        """Shard ``k``'s local path, downloading it first if it is not in the cache
        (under its lock: one download per node, whoever asks)."""
        path = self.path(k)
        if os.path.isdir(path):
            return path
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(_flock(self._lock_file(k), fcntl.LOCK_EX))
            except OSError as exc:  # a cache folder this process may not write
                raise disk_error(exc, self.remote.child(self.names[k]).url, self.root) from None
            if os.path.isdir(path):
                return path
            entry = self.index.shards[k]
            self._make_room(entry.data_bytes or 0, keep=k)
            try:
                fetch_shard(
                    self.remote, entry, self.root, part_size=self.part_size, jobs=self.jobs, when_full=self._full_hint
                )
            except RemoteError as exc:
                if exc.kind == "digest" and self._replaced():
                    raise RemoteError(
                        self.url,
                        f"the pack was replaced in storage since it was opened here (its {SHARD_INDEX_FILE} "
                        f"changed), so {self.names[k]} is not the shard this reader's index names; nothing was kept",
                        "open the pack again (restart the run) to read the new one: it is staged afresh",
                        kind="digest",
                    ) from None
                raise
        return path

    def _replaced(self) -> bool:
        """Whether the pack's index.json in storage is no longer the one this reader opened."""
        try:
            blob, _ = fetch_index(self.remote)
        except RemoteError as exc:
            return exc.kind == "missing"  # gone; not a failed request
        except NotAPackError:
            return True  # no longer an index this reader could open
        return hashlib.sha256(blob).hexdigest() != self.index_sha256

    @contextlib.contextmanager
    def reading(self, k: int) -> Iterator[str]:
        """Shard ``k``'s local path, held so that it is not evicted until the block ends
        (open it inside the block; a reader that keeps it mapped uses ``open_held``)."""
        with self._shared(k) as (path, _):
            yield path

    def open_held(self, k: int, open_: Callable[[str], _T]) -> tuple[_T, ShardHold | None]:
        """``open_(path)`` of shard ``k`` (fetched first if it is not in the cache), and a
        hold that keeps the shard from eviction until it is released: call
        ``hold.release()`` once what ``open_`` mapped is closed. The hold is taken before
        the shard's short lock is let go, so it is never evicted in between. None: a
        cache folder this process may only read (nothing is evicted there by it)."""
        with self._shared(k) as (path, fd):
            # The same open file as the short lock (a dup, never a second flock call):
            # taking it cannot wait, and it outlives the short lock's descriptor.
            hold = None if fd is None else ShardHold(os.dup(fd))
            try:
                return open_(path), hold
            except BaseException:
                if hold is not None:
                    hold.release()
                raise

    @contextlib.contextmanager
    def _shared(self, k: int) -> Iterator[tuple[str, int | None]]:
        """(path, descriptor of the shared lock) of shard ``k``, in the cache for the block.

        Waits for no lock this process may hold itself: a shared lock waits only for a
        download or an eviction of shard ``k`` (never held for long), and ``ensure``'s
        exclusive lock is asked only while the shard is missing, when no reader holds
        it (a held shard is never evicted)."""
        while True:
            with _flock(self._lock_file(k), fcntl.LOCK_SH) as fd:
                path = self.path(k)
                if os.path.isdir(path):
                    with contextlib.suppress(OSError):
                        os.utime(path)  # least recently used goes first
                    yield path, fd
                    return
            self.ensure(k)

    # -- the cache limit ---------------------------------------------------------------
    def cached_bytes(self) -> int:
        """Bytes of the shards in the cache now."""
        return sum(_size(self.path(k)) for k in self.staged())

    def needed(self) -> set[int]:
        """Shards some live rank on this node still needs this epoch (``follow``)."""
        return set(self.needed_soonest())

    def needed_soonest(self) -> dict[int, int]:
        """Shard -> how soon a live rank on this node needs it (0: in use now, 1: next, ...;
        the smallest over the ranks' lists)."""
        with self._deciding():
            return self._needed_soonest()

    @contextlib.contextmanager
    def _deciding(self) -> Iterator[None]:
        """Held while a process decides what to evict and while a rank rewrites its list
        of needs, so that a decision never reads a list half written (an empty list once
        read as "keep everything" and let the cache grow past its limit)."""
        with _flock(os.path.join(self.root, ROOM_LOCK), fcntl.LOCK_EX):
            yield

    def _needed_soonest(self) -> dict[int, int]:
        needed: dict[int, int] = {}
        try:
            names = os.listdir(self.root)
        except OSError:
            return needed
        for name in names:
            if not name.startswith(NEEDS_PREFIX):
                continue
            path = os.path.join(self.root, name)
            try:
                with _flock(path, fcntl.LOCK_EX | fcntl.LOCK_NB, create=False):
                    os.remove(path)  # nobody holds it: its rank is gone
                continue
            except FileNotFoundError:
                continue  # its rank has just stopped following
            except BlockingIOError:
                pass  # its rank lives (it writes and removes its list only under ROOM_LOCK, held here)
            except NotRegularFileError:
                continue  # not a list a rank wrote (a link, a FIFO): never followed, never waited on
            try:
                fd = _open_own(path, os.O_RDONLY)
            except OSError:
                continue
            with open(fd, "rb") as f:
                raw = f.read(1 << 20)
            try:
                for soon, k in enumerate(json.loads(raw)):
                    needed[int(k)] = min(soon, needed.get(int(k), soon))
            except (ValueError, TypeError):
                return dict.fromkeys(range(len(self.names)), 0)  # not a list we wrote: keep everything
        return needed

    def _make_room(self, incoming: int, *, keep: int) -> None:
        """Evict shards so that the cache, with shard ``keep`` (``incoming`` bytes, about to
        be downloaded; the caller holds its lock) and every other download in flight, fits
        ``cache_limit``; warn when it cannot (what is in use exceeds the limit).

        One process decides at a time (``ROOM_LOCK``), and a download in flight counts
        at its full size: two downloads that start together (the prefetch thread's and a
        worker's) would otherwise each see room for one more shard, and take it twice.
        """
        if self.cache_limit is None:
            return
        with self._deciding():
            over = self._fit(incoming, keep)
        if over is not None:
            warnings.warn(over, RuntimeWarning, stacklevel=3)

    def _fit(self, incoming: int, keep: int | None) -> str | None:
        """``_make_room``'s evictions, under ``ROOM_LOCK`` (held by the caller); the warning
        to give when the cache stays above its limit, else None. ``keep=None``: nothing
        is about to be downloaded (``let_go``)."""
        if self.cache_limit is None:
            return None
        staged = [k for k in self.staged() if k != keep]
        skip = set(staged) if keep is None else {keep, *staged}
        total = sum(_size(self.path(k)) for k in staged) + incoming + self._in_flight(skip)
        if total <= self.cache_limit:
            return None
        # First what no rank needs any more (least recently used first); then, if that
        # is not enough, what is needed last (never the shards in use or next). A shard
        # a reader maps is never evicted: its disk space would stay in use, unseen here.
        soonest = self._needed_soonest()
        unneeded = sorted((k for k in staged if k not in soonest), key=lambda k: _mtime(self.path(k)))
        protected = 2 + self.ahead
        later = sorted((k for k in staged if soonest.get(k, 0) > protected), key=lambda k: -soonest[k])
        held: dict[int, int] = {}
        for k in unneeded + later:
            if total <= self.cache_limit:
                return None
            size = _size(self.path(k))
            outcome = self._evict(k)
            if outcome == "evicted":
                total -= size
            elif outcome == "held":
                held[k] = size
        if total <= self.cache_limit:
            return None
        text = f"the staging cache of {self.url} holds {total:,} bytes, above cache_limit={self.cache_limit:,}: "
        if not held:
            return text + "every shard in it is in use (raise cache_limit to hold shards_at_once + ahead + 2 shards)"
        readers = _lock_holders([self._lock_file(k) for k in held])
        if readers == {os.getpid()} and total - sum(held.values()) <= self.cache_limit:
            # Mapped by a reader of this process only (its prefetch thread is ahead of it): that
            # reader lets go of them when it opens its next shard, and evicts them then (let_go).
            return None
        who = f"{len(readers)} reader process{'es' if len(readers) != 1 else ''}" if readers else "readers"
        return text + (
            f"{_shards(self.names, list(held))} ({sum(held.values()):,} bytes), which no rank needs now or next, "
            f"{'is' if len(held) == 1 else 'are'} still mapped by {who}, and the rest is in use or next; a mapped "
            "shard is never evicted, and a reader lets go of it when it opens another (raise cache_limit to hold "
            "shards_at_once + ahead + 2 shards, or lower num_workers: each DataLoader worker maps the shards it "
            f"reads, up to {MAPPED_PER_PROCESS})"
        )

    def let_go(
        self, mapped: Sequence[int], opening: int, close: Callable[[int], None], excess: Sequence[int] = ()
    ) -> None:
        """Before a reader of this process opens shard ``opening``: ``close(k)`` (its map,
        then its hold) the shards of ``excess`` and those of ``mapped`` (what it maps,
        oldest first) an eviction should be able to take, then evict what
        ``cache_limit`` asks for now; all under ``ROOM_LOCK``, so no decision sees a
        shard let go but not yet evicted.

        What a reader lets go of: the shards no live rank needs any more (when ranks
        follow a sampler), and, when the cache with ``opening`` is above
        ``cache_limit``, every one an eviction may take. Without a ``cache_limit``
        only ``excess``: nothing is evicted, and reopening a shard costs its tables'
        checks.
        """
        go = [k for k in excess if k != opening]
        others = [k for k in mapped if k != opening and k not in go]
        if self.cache_limit is None or not (go or others):
            for k in go:
                close(k)
            return
        try:
            with self._deciding():
                soonest = self._needed_soonest()
                staged = self.staged()
                total = sum(_size(self.path(k)) for k in staged)
                if opening not in staged:
                    total += self.index.shards[opening].data_bytes or 0
                over = total > self.cache_limit
                protected = 2 + self.ahead
                go += [
                    k
                    for k in others
                    if (k not in soonest and (over or bool(soonest))) or (over and soonest.get(k, 0) > protected)
                ]
                for k in go:
                    close(k)
                if go:
                    self._fit(0, None)  # no warning here: a download that finds no room gives it
                return
        except OSError:
            pass  # a cache folder this process may only read: it evicts nothing
        for k in go:
            close(k)

    def _full_hint(self) -> str:
        """What to do when the cache's disk is full, with what the cache holds there (the hint
        of a staging download's "the disk is full")."""
        try:
            staged = self.staged()
            cached = sum(_size(self.path(k)) for k in staged)
            mapped = [k for k in staged if self._probe(k) == "held"]
            free = f"{shutil.disk_usage(self.root).free:,}"
        except OSError:
            staged, cached, mapped, free = [], 0, [], "few"
        largest = max((e.data_bytes or 0 for e in self.index.shards), default=0)
        text = (
            f"the disk holding {self.root} has {free} bytes free; this pack's cache holds {cached:,} bytes "
            f"({len(staged)} shard{'s' if len(staged) != 1 else ''}), {sum(_size(self.path(k)) for k in mapped):,} "
            f"of them in {len(mapped)} shard{'s' if len(mapped) != 1 else ''} that readers map now (never evicted "
            "while mapped); "
        )
        if self.cache_limit is None:
            text += (
                "pass a cache_limit the disk can hold (shards are up to "
                f"{largest:,} bytes; it needs shards_at_once + ahead + 2 of them), or free space there"
            )
        else:
            text += (
                f"free space there, or pass a cache_limit below what the disk can hold (now {self.cache_limit:,}; "
                f"shards are up to {largest:,} bytes), or a smaller shards_at_once, so that fewer shards are in use "
                "at once"
            )
        return text + "; run the same command again to resume"

    def _in_flight(self, skip: set[int]) -> int:
        """Bytes of the shards not in ``skip`` (the one about to be fetched, the staged ones)
        being downloaded now: their lock held exclusively (``ensure`` holds it from before
        making room until the shard is published)."""
        total = 0
        for k in range(len(self.names)):
            if k in skip:
                continue
            try:
                with _flock(self._lock_file(k), fcntl.LOCK_SH | fcntl.LOCK_NB, create=False):
                    pass
            except FileNotFoundError:
                continue  # nobody ever asked for it
            except BlockingIOError:
                total += self.index.shards[k].data_bytes or 0
        return total

    def evict(self, k: int) -> bool:
        """Remove shard ``k`` from the cache unless a process holds it (False then): one
        downloading, opening or mapping it (``open_held``), or evicting it."""
        return self._evict(k) == "evicted"

    def _evict(self, k: int) -> str:
        """``evict``, saying why not: "evicted", "held" (a process holds its lock: mostly a
        reader mapping it), or "gone" (not in the cache)."""
        try:
            with _flock(self._lock_file(k), fcntl.LOCK_EX | fcntl.LOCK_NB):
                path = self.path(k)
                if not os.path.isdir(path):
                    return "gone"
                old = f"{path}{OLD_SUFFIX}{os.getpid()}"
                os.rename(path, old)
                shutil.rmtree(old, ignore_errors=True)
                return "evicted"
        except BlockingIOError:
            return "held"

    def _probe(self, k: int) -> str:
        """Whether a process holds shard ``k``'s lock now ("held") or not ("free"); changes nothing."""
        try:
            with _flock(self._lock_file(k), fcntl.LOCK_EX | fcntl.LOCK_NB, create=False):
                return "free"
        except FileNotFoundError:
            return "free"
        except BlockingIOError:
            return "held"

    # -- ahead of need -----------------------------------------------------------------
    def follow(self, schedule: Sequence[tuple[int, int]], linger: int = 0) -> _Follower:
        """Fetch shards in the order of ``schedule`` from now on (this process's rank).

        ``schedule``: ``(shard, position of its last use)`` for the shards this
        rank will read, in the order of their first use; positions count the
        samples the rank's sampler has handed out. The returned follower's
        ``advance(position)`` moves on; a shard stays "needed" until the
        sampler is ``linger`` samples past its last use (the DataLoader's
        workers are still reading what the sampler already handed out).
        Replaces the previous epoch's follower.
        """
        with self._lock:
            if self._follower is not None:
                self._follower.stop()
            self._follower = _Follower(self, list(schedule), linger)
            return self._follower


_FOLLOWERS = itertools.count()


class _Follower:
    """The prefetch thread of one rank: fetches its shards in order, ``ahead`` at a time."""

    def __init__(self, pack: StagedPack, schedule: list[tuple[int, int]], linger: int) -> None:
        self.pack = pack
        self.schedule = schedule
        self.linger = linger
        self.position = 0
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._stopped = False
        # Its own name: two datasets over one pack in one process each have a follower.
        self._needs = os.path.join(pack.root, f"{NEEDS_PREFIX}{os.getpid()}-{next(_FOLLOWERS)}")
        self._needs_fd: int | None = None
        try:
            with pack._deciding():  # created, held and written before any decision sees it
                self._needs_fd = _open_own(self._needs, os.O_RDWR | os.O_CREAT)
                fcntl.flock(self._needs_fd, fcntl.LOCK_SH)
                self._put_needs()
        except NotRegularFileError as exc:
            raise RemoteError(
                pack.url,
                f"cannot keep this rank's list of needs in {self._needs}: {exc.strerror}",
                f"remove {self._needs}, then run the same command again",
                kind="disk",
            ) from None
        except OSError as exc:
            if exc.errno not in _READ_ONLY:
                raise
            # A cache folder this process may only read: it downloads nothing, so it has no
            # list of needs to keep (a shard it lacks is a clear error when it is read).
            if self._needs_fd is not None:
                os.close(self._needs_fd)
                self._needs_fd = None
        self._thread = threading.Thread(target=self._run, name="lmdbfolder-staging", daemon=True)
        self._thread.start()

    def _current(self) -> int:
        """Index in ``schedule`` of the first shard whose last use is still ahead."""
        for j, (_, last) in enumerate(self.schedule):
            if last >= self.position:
                return j
        return len(self.schedule)

    def _write_needs(self) -> None:
        if self._needs_fd is None:
            return
        with self.pack._deciding():
            self._put_needs()

    def _put_needs(self) -> None:
        # In the order of need: the shards still being read (lingering) first.
        needs = [k for k, last in self.schedule if last + self.linger >= self.position]
        if self._needs_fd is None:
            return
        os.ftruncate(self._needs_fd, 0)
        os.pwrite(self._needs_fd, json.dumps(needs).encode(), 0)

    def advance(self, position: int) -> None:
        """The rank's sampler has handed out ``position`` samples of the epoch."""
        with self._cond:
            self.position = position
            if not self._stopped:
                self._write_needs()
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            for j, (k, _) in enumerate(self.schedule):
                with self._cond:
                    while not self._stopped and j > self._current() + self.pack.ahead:
                        self._cond.wait()
                    if self._stopped:
                        return
                self.pack.ensure(k)
        except BaseException as exc:  # a worker that needs the shard reports it; keep it for the record
            self.error = exc

    def stop(self) -> None:
        """Stop fetching and drop this rank's needs (the thread ends after its current shard)."""
        with self._cond:
            if self._stopped:
                return  # its descriptor's number may belong to another file by now: never close it twice
            self._stopped = True
            self._cond.notify_all()
        if self._needs_fd is None:
            return
        with contextlib.suppress(OSError), self.pack._deciding():
            os.remove(self._needs)
        with contextlib.suppress(OSError):
            os.close(self._needs_fd)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the thread (tests; the thread is a daemon)."""
        self._thread.join(timeout)


def _folder_key(url: str, index_blob: bytes) -> str:
    """The part of a cache folder's name that says which URL and index it stages."""
    return hashlib.sha256(url.encode() + b"\n" + index_blob).hexdigest()[:16]


def _size(path: str) -> int:
    try:
        return os.path.getsize(os.path.join(path, DATA_FILE))
    except OSError:
        return 0


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def _shards(names: Sequence[str], ks: Sequence[int]) -> str:
    """A few shards by name, for a message."""
    shown = ", ".join(names[k] for k in ks[:4]) + (f" and {len(ks) - 4} more" if len(ks) > 4 else "")
    return f"shard{'s' if len(ks) != 1 else ''} {shown}"


def _lock_holders(paths: Sequence[str]) -> set[int]:
    """The processes holding a flock on any of ``paths`` (from ``/proc/locks``; empty where
    it cannot be read). For a message only."""
    keys = set()
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue
        keys.add(f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}")
    pids: set[int] = set()
    try:
        with open("/proc/locks", "rb") as f:
            lines = f.read(1 << 24).decode("ascii", "replace").splitlines()
    except OSError:
        return pids
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  READ  1234 fe:00:5678 0 EOF" (a waiter's line has "->" after "1:")
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] in keys and fields[4].isdigit():
            pids.add(int(fields[4]))
    return pids

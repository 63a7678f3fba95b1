"""Object storage: what a URL is, the client, and resumable ranged downloads.

This module is the one owner of "this path is a URL" (``is_url``) and of
every request lmdbfolder makes to object storage (``Remote``). A remote pack
has exactly the layout of a local one (``s3://bucket/train/index.json``,
``s3://bucket/train/train-00000-of-00004.lmdb/data.mdb``, ...), so a pack
uploaded by hand (``aws s3 cp --recursive``) is a remote pack too.

The client is fsspec (``s3fs`` for ``s3://``; ``gcsfs`` for ``gs://`` and
``adlfs`` for ``az://`` through the same calls). Credentials, endpoint and
region come from the client's own standard configuration and nothing of
ours: for S3 botocore's chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
``AWS_PROFILE``, ``~/.aws/config`` and ``~/.aws/credentials``,
``AWS_ENDPOINT_URL``, instance roles). The libraries are imported when a URL
is first used; a missing one is a ``MissingDependencyError`` naming the extra.

``download`` fetches one object into a local file in ranged parts, several
at once, and is resumable after ``kill -9``: a journal beside the file
(``<file>.parts``, ``format.PARTS_SUFFIX``) lists the parts whose bytes were
written (a killed process loses nothing it wrote; after a power loss a listed
part may be lost, which the digest check of the whole file catches), and a
rerun fetches only the parts it does not list. The SHA-256 of the file is computed as the
parts land, in order, and compared with the expected digest before the
caller publishes anything.

Every failure is a ``RemoteError`` naming the URL: wrong or missing
credentials, a missing bucket or key, a server that stops answering, bytes
that do not match their digest, a server that ignores the ``Range`` of a
request. Every read has a deadline and a minimum rate (``Limits``): a server
that sends nothing for ``stall`` seconds, or less than ``min_rate`` bytes a
second over ``window`` seconds, ends the read with a RemoteError instead of
holding it forever (a server dribbling a byte every two seconds once hung
``copy`` with no message).
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable

from lmdbfolder.errors import LmdbFolderError, MissingDependencyError, OptionError, RemoteError
from lmdbfolder.format import PARTS_SUFFIX

__all__ = [
    "SCHEMES",
    "DEFAULT_PART_SIZE",
    "Limits",
    "DEFAULT_JOBS",
    "is_url",
    "Remote",
    "ObjectInfo",
    "download",
    "file_sha256",
    "parts_done",
]

#: URL scheme -> (fsspec protocol, the lmdbfolder extra that installs its library, the library).
SCHEMES: dict[str, tuple[str, str, str]] = {
    "s3": ("s3", "s3", "s3fs"),
    "gs": ("gcs", "gcs", "gcsfs"),
    "gcs": ("gcs", "gcs", "gcsfs"),
    "az": ("az", "azure", "adlfs"),
    "abfs": ("abfs", "azure", "adlfs"),
}
#: Bytes per ranged request: large enough that a request's latency is small
#: beside its transfer, small enough that a killed copy loses little.
DEFAULT_PART_SIZE = 16 << 20
#: Ranged requests in flight at once (per object being downloaded).
DEFAULT_JOBS = 8

#: The environment variables that set ``Limits`` for every remote read of a process
#: (and of the DataLoader workers it starts): staging reads take them from there.
STALL_ENV = "LMDBFOLDER_REMOTE_STALL"
MIN_RATE_ENV = "LMDBFOLDER_REMOTE_MIN_RATE"
WINDOW_ENV = "LMDBFOLDER_REMOTE_WINDOW"


@dataclass(frozen=True)
class Limits:
    """How slow a remote read may be before it is given up (a RemoteError naming the URL).

    ``stall``: seconds without a byte; ``min_rate``: bytes a second, at least, once a
    response has taken ``window`` seconds. The defaults (60 s, 16 KiB/s, 60 s) pass any
    network a pack can be read over; set them with ``copy_pack(limits=...)``, ``lmdbfolder
    copy --stall-timeout/--min-rate``, or for every read of a process (staging too) with
    the environment variables ``LMDBFOLDER_REMOTE_STALL``, ``LMDBFOLDER_REMOTE_MIN_RATE``
    and ``LMDBFOLDER_REMOTE_WINDOW``.
    """

    stall: float = 60.0
    min_rate: float = 16 * 1024.0
    window: float = 60.0

    def __post_init__(self) -> None:
        for name in ("stall", "min_rate", "window"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
                raise OptionError(f"the remote read limit {name} must be a positive number, got {value!r}")

    @classmethod
    def current(cls) -> Limits:
        """The limits the environment sets (the defaults where it sets none)."""
        values: dict[str, float] = {}
        for name, var in (("stall", STALL_ENV), ("min_rate", MIN_RATE_ENV), ("window", WINDOW_ENV)):
            text = os.environ.get(var)
            if text:
                try:
                    values[name] = float(text)
                except ValueError:
                    raise OptionError(
                        f"{var}={text!r} is not a number", "set it to a number of seconds or bytes/s"
                    ) from None
        try:
            return cls(**values)
        except OptionError as exc:
            raise OptionError(f"{exc.message} (set by {STALL_ENV}, {MIN_RATE_ENV} or {WINDOW_ENV})") from None

    def deadline(self, nbytes: int) -> float:
        """Seconds a response of ``nbytes`` may take in all."""
        return self.stall + max(self.window, nbytes / self.min_rate)

    def too_slow(self, url: str, got: int, seconds: float) -> RemoteError | None:
        """The error for a response that brought ``got`` bytes in ``seconds``, if that is too slow."""
        if seconds < self.window or got >= self.min_rate * seconds:
            return None
        return RemoteError(
            url,
            f"reading: the server sent {got:,} bytes in {seconds:.0f} s, less than the minimum rate of "
            f"{self.min_rate:,.0f} bytes/s{_endpoint()}",
            _SLOW_HINT,
            kind="connection",
        )

    def stalled(self, url: str, got: int) -> RemoteError:
        """The error for a response that sent nothing for ``stall`` seconds after ``got`` bytes."""
        return RemoteError(
            url,
            f"reading: the server sent nothing for {self.stall:.0f} s (after {got:,} bytes of the response)"
            f"{_endpoint()}",
            _SLOW_HINT,
            kind="connection",
        )


_SLOW_HINT = (
    "check the network and the storage server; run the same command again to resume "
    f"(the limits: {STALL_ENV}, {MIN_RATE_ENV}, {WINDOW_ENV}, or `lmdbfolder copy --stall-timeout/--min-rate`)"
)

_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://(.+)$")
#: What a message quotes of a server's or a library's own words, at most.
_QUOTE = 300


def is_url(path: Any) -> bool:
    """Whether ``path`` is an object-storage URL (``s3://...``, ``gs://...``, ``az://...``).

    Any ``scheme://`` string counts, so an unsupported scheme reaches
    ``Remote`` and gets an error naming the supported ones instead of being
    taken for a local path.
    """
    return isinstance(path, str) and _URL.match(path) is not None


def _quote(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= _QUOTE else text[: _QUOTE - 3] + "..."


def _endpoint() -> str:
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return f" (endpoint {endpoint})" if endpoint else ""


def translate(exc: BaseException, url: str, action: str) -> RemoteError:
    """The ``RemoteError`` for a client exception ``exc`` raised while doing ``action`` on ``url``."""
    if isinstance(exc, RemoteError):
        return exc
    names = {cls.__name__ for cls in type(exc).__mro__}
    if "NoSuchBucket" in names or "bucket does not exist" in str(exc).lower():
        return RemoteError(
            url,
            f"{action}: the bucket does not exist ({_quote(exc)})",
            "check the bucket's name in the URL (and AWS_ENDPOINT_URL / the region, for another store)",
            kind="bucket",
        )
    if isinstance(exc, FileNotFoundError) or "NoSuchKey" in names:
        return RemoteError(
            url,
            f"{action}: no such object ({_quote(exc)})",
            "check the URL (bucket and prefix); a pack's URL names the folder that holds index.json or data.mdb",
            kind="missing",
        )
    if "NoCredentialsError" in names or "PartialCredentialsError" in names:
        return RemoteError(
            url,
            f"{action}: no credentials found ({_quote(exc)})",
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE with ~/.aws/credentials "
            "(the client's standard configuration; lmdbfolder has none of its own)",
            kind="credentials",
        )
    if isinstance(exc, PermissionError) or "ClientError" in names and "403" in str(exc):
        return RemoteError(
            url,
            f"{action}: access denied ({_quote(exc)})",
            "check the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE) and that they "
            "may read (or write) this bucket",
            kind="credentials",
        )
    connection = {"EndpointConnectionError", "ConnectionError", "ClientConnectorError", "ServerDisconnectedError"}
    if names & connection or isinstance(exc, (ConnectionError, TimeoutError)):
        return RemoteError(
            url,
            f"{action}: the storage server did not answer{_endpoint()} ({_quote(exc)})",
            "check the network and AWS_ENDPOINT_URL; run the same command again to resume",
            kind="connection",
        )
    return RemoteError(
        url,
        f"{action} failed{_endpoint()}: {_quote(exc)}",
        "run the same command again to resume; if it persists, check the URL and the credentials",
        kind="other",
    )


# -- the client ------------------------------------------------------------------
_CLIENTS: dict[tuple[Any, ...], Any] = {}
_CLIENTS_LOCK = threading.Lock()
#: The environment a client is made from: a test (or a user) that changes it gets a new client.
_ENV_PREFIXES = ("AWS_", "GOOGLE_", "AZURE_", "FSSPEC_")


def _client(scheme: str, url: str) -> Any:
    if scheme not in SCHEMES:
        raise RemoteError(
            url,
            f"the scheme {scheme}:// is not supported",
            "use s3:// (S3 and compatible stores), gs:// or az://",
            kind="other",
        )
    protocol, extra, library = SCHEMES[scheme]
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)))
    key = (os.getpid(), protocol, env)
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is not None:
            return client
        try:
            import fsspec

            # The client library itself (s3fs, ...): fsspec imports it lazily
            # too, and would name it in a message of its own.
            __import__(library)
        except ImportError as exc:
            raise MissingDependencyError(f"reading {scheme}:// URLs", extra, f"fsspec and {library}") from exc
        try:
            # skip_instance_cache: fsspec's own cache ignores the environment
            # (credentials changed in between would be ignored).
            client = fsspec.filesystem(protocol, skip_instance_cache=True)
        except Exception as exc:
            raise translate(exc, url, "creating the storage client") from exc
        if len(_CLIENTS) > 16:
            _CLIENTS.clear()
        _CLIENTS[key] = client
        return client


@dataclass(frozen=True)
class ObjectInfo:
    """What storage says about one object: its size and version tag (ETag or generation)."""

    size: int
    tag: str

    @classmethod
    def from_entry(cls, raw: dict[str, Any]) -> ObjectInfo:
        """From an fsspec ``info``/``find(detail=True)`` entry (each store names the tag its own way)."""
        tag = raw.get("ETag") or raw.get("etag") or raw.get("generation") or raw.get("mtime") or ""
        return cls(int(raw["size"]), str(tag))


class Remote:
    """An object or folder in object storage, named by its URL.

    ``Remote("s3://bucket/train").child(SHARD_INDEX_FILE).read()``. Every
    method raises ``RemoteError`` naming the URL. Pickles as its URL (the
    client is made again in each process).
    """

    def __init__(self, url: str) -> None:
        match = _URL.match(url) if isinstance(url, str) else None
        if match is None:
            raise RemoteError(str(url), "not a URL", "pass scheme://bucket/path, e.g. s3://bucket/train", kind="other")
        self.scheme = match.group(1).lower()
        self.path = match.group(2).rstrip("/")
        self.url = f"{self.scheme}://{self.path}"
        if self.scheme not in SCHEMES:
            _client(self.scheme, self.url)  # raises the error naming the supported schemes

    def __repr__(self) -> str:
        return f"Remote({self.url!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Remote, (self.url,))

    @property
    def fs(self) -> Any:
        """The fsspec file system of this URL's scheme (one per process and environment)."""
        return _client(self.scheme, self.url)

    @property
    def name(self) -> str:
        """The last part of the path (``train`` of ``s3://bucket/data/train``)."""
        return self.path.rsplit("/", 1)[-1]

    def child(self, *names: str) -> Remote:
        """The URL of ``names`` inside this folder."""
        return Remote("/".join([self.url, *names]))

    def _call(self, action: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except LmdbFolderError:  # ours already (a missing client library, a short read)
            raise
        except Exception as exc:
            raise translate(exc, self.url, action) from None

    def info(self) -> ObjectInfo:
        """Size and version tag of this object (RemoteError kind "missing" if there is none)."""
        raw = self._call("looking up the object", lambda: self.fs.info(self.path))
        if raw.get("type") == "directory":
            raise RemoteError(self.url, "it is a folder, not an object", kind="missing")
        return ObjectInfo.from_entry(raw)

    def infos(self) -> dict[str, ObjectInfo]:
        """Size and version tag of every object under this folder, by path relative to
        it, from one listing (a request per 1,000 objects instead of one per object)."""
        raw = self._call("listing the folder", lambda: self.fs.find(self.path, detail=True))
        found: dict[str, ObjectInfo] = {}
        for path, entry in raw.items():
            if entry.get("type") == "directory" or not str(path).startswith(self.path + "/"):
                continue
            found[str(path)[len(self.path) + 1 :]] = ObjectInfo.from_entry(entry)
        return found

    def exists(self) -> bool:
        """Whether this object exists (a missing bucket is an error, not False)."""
        try:
            self.info()
        except RemoteError as exc:
            if exc.kind == "missing":
                return False
            raise
        return True

    def read(self, start: int | None = None, end: int | None = None, *, limits: Limits | None = None) -> bytes:
        """The object's bytes ``[start, end)`` (all of them by default), within ``limits``
        (``Limits.current()`` by default): a deadline for the whole response."""
        limits = limits or Limits.current()
        nbytes = end - (start or 0) if end is not None else 0
        fs = self.fs
        if getattr(fs, "async_impl", False) and getattr(fs, "loop", None) is not None and hasattr(fs, "_cat_file"):
            from fsspec.asyn import sync
            from fsspec.exceptions import FSTimeoutError

            def bounded() -> Any:
                try:
                    return sync(fs.loop, fs._cat_file, self.path, start=start, end=end, timeout=limits.deadline(nbytes))
                except FSTimeoutError:
                    raise RemoteError(
                        self.url,
                        f"reading: no complete response within {limits.deadline(nbytes):.0f} s "
                        f"({nbytes:,} bytes at the minimum rate of {limits.min_rate:,.0f} bytes/s){_endpoint()}",
                        _SLOW_HINT,
                        kind="connection",
                    ) from None

            data = self._call("reading", bounded)
        else:  # a client without an event loop: its own timeouts
            data = self._call("reading", lambda: fs.cat_file(self.path, start=start, end=end))
        if start is not None and end is not None and len(data) != end - start:
            raise _short_read(self.url, start, end, len(data))
        return bytes(data)

    def read_at_most(self, limit: int) -> bytes:
        """The object's first ``limit`` bytes, or all of it if it is shorter."""
        size = self.info().size  # a range of an empty object is refused (416): ask its size first
        return self.read(0, min(size, limit)) if size else b""

    def streams(self) -> bool:
        """Whether ranged reads of this object can be streamed into a file
        (``s3://``: the client's own event loop and ``get_object`` calls)."""
        if self.scheme != "s3":
            return False
        fs = self.fs
        return hasattr(fs, "_call_s3") and hasattr(fs, "split_path") and getattr(fs, "loop", None) is not None

    def write(self, data: bytes) -> None:
        """Store ``data`` as this object (replacing it)."""
        self._call("writing", lambda: self.fs.pipe_file(self.path, data))

    def upload(self, local: str) -> None:
        """Store the local file ``local`` as this object (the client uploads large files in parts)."""
        self._call("uploading", lambda: self.fs.put_file(local, self.path))

    def remove(self) -> None:
        """Delete this object, if there is one."""
        if self.exists():
            self._call("deleting", lambda: self.fs.rm_file(self.path))


# -- resumable ranged downloads ------------------------------------------------------
def parts_done(journal: str, header: dict[str, Any]) -> set[int]:
    """The parts ``journal`` lists as on disk, if it was written for ``header`` (same
    object, size, tag and part size); else the empty set."""
    try:
        with open(journal, encoding="ascii") as f:
            lines = f.read().split("\n")
    except (OSError, UnicodeDecodeError):
        return set()
    try:
        if json.loads(lines[0]) != header:
            return set()
    except ValueError:
        return set()
    done = set()
    # The last line may be torn (killed while writing it); only whole lines count.
    for line in lines[1:-1]:
        if line.isdigit():
            done.add(int(line))
    return done


def file_sha256(path: str, *, chunk: int = 8 << 20) -> str:
    """SHA-256 of a local file, hex."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while True:
            block = f.read(chunk)
            if not block:
                return h.hexdigest()
            h.update(block)


def download(
    remote: Remote,
    dest: str,
    *,
    info: ObjectInfo | None = None,
    sha256: str | None = None,
    part_size: int = DEFAULT_PART_SIZE,
    jobs: int = DEFAULT_JOBS,
    on_bytes: Callable[[int], None] | None = None,
    abort: threading.Event | None = None,
    limits: Limits | None = None,
) -> tuple[int, str]:
    """Fetch ``remote`` into the local file ``dest``; return (bytes fetched now, SHA-256 hex).

    The object is fetched in ranged parts of ``part_size`` bytes, ``jobs`` at
    a time, each written in place into ``dest`` (preallocated to the object's
    size) before ``dest + PARTS_SUFFIX`` records it; the file is flushed to
    disk once, at the end. A rerun
    fetches only the parts not recorded (if the object changed, by size or
    tag, it starts over). The SHA-256 is computed in order as parts land
    (the parts a rerun kept are read back from ``dest``); if ``sha256`` is
    given and differs, ``dest`` and its journal are removed and RemoteError
    (kind "digest") is raised, so a rerun fetches it afresh. On success the
    journal is removed: ``dest`` is complete. ``abort``, once set (by the
    caller, when another download of the same copy failed), stops the parts
    not started yet. ``limits``: how slow a part's response may be (``Limits``;
    ``Limits.current()`` by default). A server that ignores a part's ``Range`` is a
    RemoteError before any of its bytes is written.
    """
    if part_size < 1 or jobs < 1:
        raise ValueError("part_size and jobs must be positive")
    limits = limits or Limits.current()
    info = info or remote.info()
    journal = dest + PARTS_SUFFIX
    header = {"url": remote.url, "size": info.size, "tag": info.tag, "part_size": part_size}
    nparts = max(1, -(-info.size // part_size))
    done = parts_done(journal, header) if os.path.exists(dest) else set()
    fd = os.open(dest, os.O_RDWR | os.O_CREAT, 0o644)
    fetched = 0
    try:
        _prepare_file(fd, dest, info.size, journal if not done else None, header)
        hasher = _OrderedHash(fd, info.size, part_size, hold=jobs * part_size)
        todo = [k for k in range(nparts) if k not in done]
        for k in sorted(done):
            hasher.landed(k)
        with open(journal, "a", encoding="ascii") as log:
            target = _Landing(remote, dest, fd, info.size, part_size, jobs, log, hasher, on_bytes, abort, limits)
            if todo:
                fetched = _stream_parts(target, todo) if remote.streams() else _fetch_parts(target, todo)
        digest = hasher.hexdigest()
        os.fdatasync(fd)  # durable before the caller publishes it
    finally:
        os.close(fd)
    if sha256 is not None and digest != sha256:
        _refuse_digest(remote, digest, sha256, (dest, journal))
    os.remove(journal)
    return fetched, digest


def _prepare_file(fd: int, dest: str, size: int, new_journal: str | None, header: dict[str, Any]) -> None:
    """The download's file at ``size`` bytes (allocated); with ``new_journal`` (no part is
    kept from an earlier run), emptied first and its journal started with ``header``."""
    if new_journal is not None:
        os.ftruncate(fd, 0)
        with open(new_journal, "w", encoding="ascii") as f:
            f.write(json.dumps(header, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
    if os.fstat(fd).st_size != size:
        _allocate(fd, size, dest)


def _refuse_digest(remote: Remote, digest: str, sha256: str, paths: tuple[str, ...]) -> None:
    """Remove the downloaded file and its journal (``paths``), and raise RemoteError (kind "digest")."""
    for path in paths:
        if os.path.exists(path):
            os.remove(path)
    raise RemoteError(
        remote.url,
        f"its bytes do not match the index's digest (SHA-256 {digest[:16]}..., the index says {sha256[:16]}...); "
        "nothing was kept",
        "the object was changed or damaged in storage: upload the pack again (`lmdbfolder copy PACK URL`)",
        kind="digest",
    )


@dataclass
class _Landing:
    """Where the parts of one download land: the object, the local file (path and
    descriptor) and its size, the part size, the parts fetched at a time, the open
    journal, the hash of the parts in order, and the caller's hooks (``download``)."""

    remote: Remote
    dest: str
    fd: int
    size: int
    part_size: int
    jobs: int
    log: Any
    hasher: _OrderedHash
    on_bytes: Callable[[int], None] | None
    abort: threading.Event | None
    limits: Limits = Limits()

    def bounds(self, k: int) -> tuple[int, int]:
        """Bytes ``[start, end)`` of part ``k``."""
        start = k * self.part_size
        return start, min(self.size, start + self.part_size)

    def check_abort(self) -> None:
        """``_Aborted`` once another download of the same copy failed."""
        if self.abort is not None and self.abort.is_set():
            raise _Aborted

    def journal(self, k: int) -> None:
        """List part ``k`` in the journal: it is in the file.

        The part is in the page cache: it survives a killed process. After a power
        loss the journal may list a part the disk lost; the digest (or the record
        checksums) of the finished file catch that."""
        self.log.write(f"{k}\n")
        self.log.flush()


def _fetch_parts(target: _Landing, todo: list[int]) -> int:
    """Fetch the parts ``todo`` whole, ``jobs`` at a time in threads (a client that does not
    stream), each written into the file, journalled and hashed; return the bytes fetched."""

    def fetch(k: int) -> bytes:
        target.check_abort()
        start, end = target.bounds(k)
        data = target.remote.read(start, end, limits=target.limits) if end > start else b""
        _write_all(target.fd, data, start, target.dest)
        return data

    fetched = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(target.jobs, len(todo))) as pool:
        futures = {pool.submit(fetch, k): k for k in todo}
        try:
            for future in concurrent.futures.as_completed(futures):
                data = future.result()
                n, k = len(data), futures[future]
                target.journal(k)
                fetched += n
                if target.on_bytes is not None:
                    target.on_bytes(n)
                target.hasher.landed(k, data)
                del data
        except BaseException:
            if target.abort is not None:
                target.abort.set()
            for pending in futures:
                pending.cancel()
            raise
    return fetched


def _short_read(url: str, start: int, end: int, got: int) -> RemoteError:
    return RemoteError(
        url,
        f"asked for bytes {start}..{end - 1}, got {got} bytes (the object changed or was cut short)",
        "run the same command again",
        kind="other",
    )


class _Aborted(Exception):
    """A part not fetched because another download of the same copy failed (that error is reported)."""


class _Local(Exception):
    """An OSError of the local file, carried through the event loop (not the server's)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class _OrderedHash:
    """SHA-256 of a file whose parts land out of order: the contiguous prefix is
    hashed as it grows. Bytes are hashed from memory when they are the prefix's
    next ones as they arrive: a streamed chunk of the part being hashed, a whole
    part fetched now (or held until its turn, up to ``hold`` bytes). Everything
    else (parts kept from an earlier run, chunks of parts not yet at the front)
    is read back from the file, into one reused buffer. Reading every part back
    into fresh buffers cost about as much CPU as the hash itself."""

    def __init__(self, fd: int, size: int, part_size: int, hold: int = 0) -> None:
        self.fd, self.size, self.part_size, self.hold = fd, size, part_size, hold
        self.h = hashlib.sha256()
        self.landed_parts: set[int] = set()
        self.held: dict[int, bytes] = {}
        self.held_bytes = 0
        self.next = 0
        self.fed = 0  # bytes of part ``next`` hashed so far
        self.written: dict[int, int] = {}  # streamed parts: bytes on file, from the part's start
        self.buffer: bytearray | None = None

    def chunk(self, k: int, offset: int, data: bytes | None, n: int) -> None:
        """Bytes ``[offset, offset + n)`` of part ``k`` are on file (``data``: those bytes,
        or None); the chunks of one part are reported in order."""
        self.written[k] = offset + n
        if k != self.next:
            return
        if offset > self.fed:
            self._read_back(k, self.fed, offset)
        if data is not None and offset == self.fed:
            self.h.update(data)
        else:
            self._read_back(k, max(offset, self.fed), offset + n)
        self.fed = offset + n

    def landed(self, k: int, data: bytes | None = None) -> None:
        """Part ``k`` is on file whole (``data``: its bytes, fetched now, or None)."""
        self.landed_parts.add(k)
        if data is not None and k != self.next and self.held_bytes + len(data) <= self.hold:
            self.held[k] = data
            self.held_bytes += len(data)
        if data is not None and k == self.next and self.fed == 0:
            self.h.update(data)
            self._advance()
        while self.next in self.landed_parts:
            block = self.held.pop(self.next, None)
            if block is not None:
                self.held_bytes -= len(block)
                self.h.update(block)
            else:
                start, end = self._bounds(self.next)
                self._read_back(self.next, self.fed, end - start)
            self._advance()

    def _bounds(self, k: int) -> tuple[int, int]:
        start = k * self.part_size
        return start, min(self.size, start + self.part_size)

    def _advance(self) -> None:
        self.landed_parts.discard(self.next)
        self.written.pop(self.next, None)
        self.next += 1
        self.fed = 0
        ahead = self.written.get(self.next, 0)  # a streamed part already under way
        if ahead:
            self._read_back(self.next, 0, ahead)
            self.fed = ahead

    def _read_back(self, k: int, begin: int, end: int) -> None:
        """Hash bytes ``[begin, end)`` of part ``k`` from the file."""
        if end <= begin:
            return
        if self.buffer is None:
            self.buffer = bytearray(min(8 << 20, max(1, self.part_size)))
        view = memoryview(self.buffer)
        pos, stop = k * self.part_size + begin, k * self.part_size + end
        while pos < stop:
            n = os.preadv(self.fd, [view[: min(len(view), stop - pos)]], pos)
            if n <= 0:
                raise OSError(f"the file being downloaded shrank at byte {pos}")
            self.h.update(view[:n])
            pos += n

    def hexdigest(self) -> str:
        return self.h.hexdigest()


# Bytes of streamed chunks waiting for the hash thread, at most: past it, chunks are
# reported without their bytes and read back from the file when their turn comes.
_HASH_BACKLOG = 4 << 20
_CHUNK = 1 << 20


class _HashFeed:
    """The streamed chunks on their way to the hash, in a thread of its own (in order, see
    ``_OrderedHash``): at most ``_HASH_BACKLOG`` bytes wait with their data; past it, a
    chunk is sent without its bytes, read back from the file when its turn comes."""

    def __init__(self, hasher: _OrderedHash) -> None:
        import queue

        self.hasher = hasher
        self.events: queue.Queue[tuple[int, int, bytes | None, int] | None] = queue.Queue()
        self.backlog = 0
        self.lock = threading.Lock()
        self.error: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, name="lmdbfolder-hash", daemon=True)
        self.thread.start()

    def chunk(self, k: int, offset: int, chunk: bytes) -> None:
        """The bytes at ``offset`` of part ``k`` are in the file."""
        with self.lock:
            keep = self.backlog + len(chunk) <= _HASH_BACKLOG
            if keep:
                self.backlog += len(chunk)
        self.events.put((k, offset, chunk if keep else None, len(chunk)))

    def landed(self, k: int) -> None:
        """Part ``k`` is whole in the file."""
        self.events.put((k, -1, None, 0))

    def close(self) -> None:
        """Hash what was sent and stop the thread."""
        self.events.put(None)
        self.thread.join()

    def _run(self) -> None:
        while True:
            event = self.events.get()
            if event is None:
                return
            if self.error:
                continue  # drain: the download is failing anyway
            k, offset, data, n = event
            try:
                if offset < 0:
                    self.hasher.landed(k)
                else:
                    self.hasher.chunk(k, offset, data, n)
            except BaseException as exc:  # reported by the downloading thread
                self.error.append(exc)
            if data is not None:
                with self.lock:
                    self.backlog -= n


def _stream_parts(target: _Landing, todo: list[int]) -> int:
    """Fetch the parts ``todo`` with ``jobs`` ranged GETs at a time on the client's own
    event loop, each response written into the file chunk by chunk as it arrives (no
    part-sized buffer), listed in the journal when whole; the chunks are hashed in a
    thread of their own (``_HashFeed``). Returns the bytes fetched. The first failure
    cancels the other requests and is raised as a RemoteError naming the URL."""
    import asyncio

    from fsspec.asyn import sync

    fs = target.remote.fs
    feed = _HashFeed(target.hasher)
    fetched = [0]

    async def part(k: int, gate: asyncio.Semaphore) -> None:
        async with gate:
            target.check_abort()
            n = await _stream_part(target, feed, k)
            fetched[0] += n  # after the await: `fetched[0] += await ...` reads the total before it

    async def run_all() -> None:
        gate = asyncio.Semaphore(max(1, target.jobs))
        tasks = [asyncio.ensure_future(part(k, gate)) for k in todo]
        _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        failures = [t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
        first = next((e for e in failures if not isinstance(e, _Aborted)), failures[0] if failures else None)
        if first is not None:
            raise first

    try:
        try:
            sync(fs.loop, run_all)
        except _Local as exc:
            raise exc.error from None  # the local file (a full disk): the caller names it
        except (LmdbFolderError, _Aborted):
            raise
        except Exception as exc:  # the client's or the server's (s3fs's OSErrors too)
            raise translate(exc, target.remote.url, "reading") from None
    except BaseException:
        if target.abort is not None:
            target.abort.set()  # the other objects of the same copy stop their next parts
        raise
    finally:
        feed.close()
    if feed.error:
        raise feed.error[0]
    return fetched[0]


async def _stream_part(target: _Landing, feed: _HashFeed, k: int) -> int:
    """One ranged GET: part ``k`` written into the file chunk by chunk, each chunk sent to
    ``feed``, then journalled; its bytes. A short response is a RemoteError; an OSError
    of the local file comes out as ``_Local``."""
    import asyncio

    fs = target.remote.fs
    url, limits = target.remote.url, target.limits
    bucket, key, _ = fs.split_path(target.remote.path)
    start, end = target.bounds(k)
    pos = start
    if end > start:
        clock = asyncio.get_running_loop().time
        began = clock()
        try:
            resp = await asyncio.wait_for(
                fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}"), limits.stall
            )
        except asyncio.TimeoutError:
            raise limits.stalled(url, 0) from None
        body = resp["Body"]
        try:
            _check_range(url, resp, start, end, target.size)
            while pos < end:
                try:
                    chunk = await asyncio.wait_for(body.read(min(_CHUNK, end - pos)), limits.stall)
                except asyncio.TimeoutError:
                    raise limits.stalled(url, pos - start) from None
                slow = limits.too_slow(url, pos - start + len(chunk), clock() - began)
                if slow is not None:
                    raise slow
                if not chunk:
                    break
                try:
                    _write_all(target.fd, chunk, pos, target.dest)
                except OSError as exc:
                    raise _Local(exc) from None
                feed.chunk(k, pos - start, chunk)
                pos += len(chunk)
        finally:
            body.close()
    if pos != end:
        raise _short_read(target.remote.url, start, end, pos - start)
    _start_writeback(target.fd, start, end - start)
    try:
        target.journal(k)
    except OSError as exc:
        raise _Local(exc) from None
    feed.landed(k)
    if target.on_bytes is not None:
        target.on_bytes(end - start)
    return end - start


def _check_range(url: str, resp: dict[str, Any], start: int, end: int, size: int) -> None:
    """RemoteError unless the response to a request of bytes ``[start, end)`` of an object of
    ``size`` bytes is those bytes (``Content-Range``, or the whole object when that is what
    was asked). A server that ignores ``Range`` sends the object from its first byte: written
    at the part's place, its bytes once made every part a copy of the first one."""
    expected = f"bytes {start}-{end - 1}/{size}"
    got = resp.get("ContentRange")
    length = resp.get("ContentLength")
    whole = start == 0 and end == size and got is None and length == size
    if got == expected and length in (None, end - start) or whole:
        return
    raise RemoteError(
        url,
        f"the server did not answer the ranged request for bytes {start}..{end - 1} with them "
        f"(Content-Range {got!r}, {length!r} bytes): it ignores the Range header; nothing of it was kept",
        "use a storage server (or proxy) that serves ranged GETs (every S3-compatible one does), "
        "then run the same command again",
        kind="other",
    )


@functools.cache
def _sync_file_range() -> Any:
    """libc's ``sync_file_range`` (Linux), or None: looked up once per process."""
    if not hasattr(os, "sched_getaffinity"):  # not Linux
        return None
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``length`` bytes at ``offset`` to disk, without
    waiting (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so the fdatasync
    before publishing finds the early parts on disk already. Elsewhere: nothing."""
    call = _sync_file_range()
    if call is not None and length > 0:
        call(fd, offset, length, 2)  # SYNC_FILE_RANGE_WRITE; a failure only means no head start


def _allocate(fd: int, size: int, dest: str) -> None:
    # Reserve the blocks now, so a full disk is an error before the download
    # rather than a short write in the middle (posix_fallocate is not lazy).
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot make room for {size:,} bytes ({exc.strerror})", dest) from None
    os.ftruncate(fd, size)


def _write_all(fd: int, data: bytes, offset: int, dest: str) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n

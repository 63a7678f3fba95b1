"""Pack a source (ImageFolder tree, flat folder or list file) into an LMDB.

The whole sample list is built first (``sources.scan``), then the files are
read in that order and appended under integer keys by a single writer, in
batched transactions. The pack is built in ``<dst>.partial`` and renamed to
``<dst>`` only when its manifest is written and everything is on disk, so a
directory named ``<dst>`` is always a complete dataset.
"""

from __future__ import annotations

import datetime as _dt
import errno
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

import lmdb

from lmdbfolder._version import __version__
from lmdbfolder.codecs import raw_rgb, sniff
from lmdbfolder.errors import OutputExistsError, PackError, SourceError
from lmdbfolder.format import (
    DATA_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    LABELS_KEY,
    LOCK_FILE,
    META_KEY,
    PARTIAL_SUFFIX,
    PATHS_KEY,
    encode_key,
    encode_labels,
    encode_meta,
    encode_paths,
    encode_record,
)
from lmdbfolder.progress import Progress
from lmdbfolder.sources import SourceList, scan

__all__ = ["PackResult", "pack", "pack_sources", "DEFAULT_COMMIT_EVERY", "DEFAULT_COMMIT_BYTES"]

DEFAULT_COMMIT_EVERY = 2000
#: A batch is also committed once it holds this many bytes, which bounds the
#: writer's memory for large images (the batch is kept until it commits so it
#: can be replayed after the map grows).
DEFAULT_COMMIT_BYTES = 256 << 20
STORES = ("encoded", "raw")
_MIN_MAP = 64 << 20
_STAT_SAMPLE = 5000


@dataclass
class PackResult:
    """Summary of a finished pack."""

    path: str
    count: int
    input_bytes: int
    payload_bytes: int
    seconds: float
    store: str
    encodings: dict[str, int] = field(default_factory=dict)

    @property
    def images_per_second(self) -> float:
        """Samples written per second of wall time."""
        return self.count / self.seconds if self.seconds > 0 else 0.0

    @property
    def mb_per_second(self) -> float:
        """Source megabytes (10**6) read per second of wall time."""
        return self.input_bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary (used by ``lmdbfolder pack --json``)."""
        return {
            "path": self.path,
            "count": self.count,
            "input_bytes": self.input_bytes,
            "payload_bytes": self.payload_bytes,
            "seconds": round(self.seconds, 3),
            "images_per_second": round(self.images_per_second, 1),
            "mb_per_second": round(self.mb_per_second, 1),
            "store": self.store,
            "encodings": self.encodings,
        }


def pack(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    layout: str = "imagefolder",
    list_file: str | os.PathLike[str] | None = None,
    store: str = "encoded",
    commit_every: int = DEFAULT_COMMIT_EVERY,
    commit_bytes: int = DEFAULT_COMMIT_BYTES,
    overwrite: bool = False,
    allow_empty: bool = False,
    progress: bool | None = None,
) -> PackResult:
    """Pack the images under ``src`` into a new LMDB pack at ``dst``.

    Args:
        src: the source folder (for ``layout="list"``, the folder that the
            list file's relative paths start from).
        dst: the pack directory to create. It must not exist unless
            ``overwrite=True`` (and then it must be an lmdbfolder pack).
        layout: ``"imagefolder"`` (``src/<class>/**/<image>``, torchvision's
            rules), ``"flat"`` (all images, unlabelled) or ``"list"``.
        list_file: a ``relative/path label`` file; implies ``layout="list"``.
        store: ``"encoded"`` keeps each file's bytes unchanged; ``"raw"``
            stores decoded RGB pixels (no decode at training time, larger).
        commit_every: samples per write transaction.
        commit_bytes: bytes per write transaction (whichever limit comes first).
        overwrite: replace an existing pack at ``dst``.
        allow_empty: keep ImageFolder class folders that hold no image.
        progress: draw a progress bar (``None``: only on a terminal).

    Returns:
        A PackResult with the count, bytes and time.

    Example:
        >>> from lmdbfolder import pack
        >>> result = pack("imagenet/train", "train.lmdb")  # doctest: +SKIP
        >>> result.count  # doctest: +SKIP
        1281167
    """
    sources = scan(
        os.fspath(src),
        layout=layout,
        list_file=None if list_file is None else os.fspath(list_file),
        allow_empty=allow_empty,
    )
    return pack_sources(
        sources,
        dst,
        store=store,
        commit_every=commit_every,
        commit_bytes=commit_bytes,
        overwrite=overwrite,
        progress=progress,
    )


def pack_sources(
    sources: SourceList,
    dst: str | os.PathLike[str],
    *,
    store: str = "encoded",
    commit_every: int = DEFAULT_COMMIT_EVERY,
    commit_bytes: int = DEFAULT_COMMIT_BYTES,
    overwrite: bool = False,
    progress: bool | None = None,
) -> PackResult:
    """Pack an already built sample list (see ``sources.scan``) into ``dst``."""
    if store not in STORES:
        raise ValueError(f"store must be one of {STORES}, got {store!r}")
    if commit_every < 1 or commit_bytes < 1:
        raise ValueError("commit_every and commit_bytes must be positive")
    dst = os.path.abspath(os.fspath(dst))
    partial = _prepare_output(dst, overwrite=overwrite)
    start = time.perf_counter()
    writer = _BatchWriter(partial, _initial_map_size(sources, store), commit_every, commit_bytes)
    encodings: dict[str, int] = {}
    input_bytes = payload_bytes = 0
    try:
        with Progress(len(sources), "pack", enabled=progress) as bar:
            for i, relpath in enumerate(sources.relpaths):
                data = _read_source(sources.abspath(i))
                value, encoding = _make_record(data, sources.labels[i], store)
                writer.add(encode_key(i), value)
                encodings[encoding] = encodings.get(encoding, 0) + 1
                input_bytes += len(data)
                payload_bytes += len(value)
                bar.update(1, len(data))
            meta = _manifest(sources, store, encodings, payload_bytes, commit_every, commit_bytes)
            writer.finish(
                {
                    LABELS_KEY: encode_labels(sources.labels),
                    PATHS_KEY: encode_paths(sources.relpaths),
                    META_KEY: encode_meta(meta),
                }
            )
    except BaseException:
        writer.abort()
        raise
    _publish(partial, dst)
    return PackResult(
        dst, len(sources), input_bytes, payload_bytes, time.perf_counter() - start, store, encodings
    )


def _read_source(path: str) -> bytes:
    try:
        # buffering=0: one fstat and one read straight into the result bytes.
        with open(path, "rb", buffering=0) as f:
            return f.readall()
    except OSError as exc:
        raise SourceError(path, f"cannot read it ({exc.strerror or exc})", "fix or remove the file, then rerun") from None


def _make_record(data: bytes, label: int, store: str) -> tuple[bytes, str]:
    info = sniff(data)
    if store == "raw":
        try:
            pixels, width, height = raw_rgb(data)
        except Exception as exc:  # Pillow raises many types for bad input
            raise PackError(f"cannot decode an image for --store raw: {exc}") from exc
        return encode_record(pixels, label=label, encoding="raw", width=width, height=height, channels=3), "raw"
    return (
        encode_record(
            data,
            label=label,
            encoding=info.encoding,
            width=info.width,
            height=info.height,
            channels=info.channels,
        ),
        info.encoding,
    )


def _manifest(
    sources: SourceList,
    store: str,
    encodings: dict[str, int],
    payload_bytes: int,
    commit_every: int,
    commit_bytes: int,
) -> dict[str, Any]:
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "count": len(sources),
        "classes": sources.classes,
        "class_to_idx": sources.class_to_idx,
        "store": store,
        "encodings": dict(sorted(encodings.items())),
        "payload_bytes": payload_bytes,
        "checksum": "crc32",
        "source": sources.describe(),
        "created_by": f"lmdbfolder {__version__}",
        "created_at": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "params": {"store": store, "commit_every": commit_every, "commit_bytes": commit_bytes},
    }


def _initial_map_size(sources: SourceList, store: str) -> int:
    """About 1.5x the input bytes plus headroom; the writer grows it when needed.

    Large sources are sized from an evenly spaced sample of file sizes so that
    planning does not stat a million files.
    """
    n = len(sources)
    step = max(1, n // _STAT_SAMPLE)
    sizes = []
    for i in range(0, n, step):
        try:
            sizes.append(os.stat(sources.abspath(i)).st_size)
        except OSError:
            continue
    mean = sum(sizes) / len(sizes) if sizes else 0
    estimate = mean * n
    if store == "raw":
        estimate *= 8  # decoded pixels are several times larger than JPEGs
    return int(max(_MIN_MAP, estimate * 1.5 + _MIN_MAP))


def _prepare_output(dst: str, *, overwrite: bool) -> str:
    """Check the output path and return an empty ``<dst>.partial`` to build in."""
    if os.path.lexists(dst):
        if not overwrite:
            raise OutputExistsError(dst)
        if not _is_replaceable(dst):
            raise OutputExistsError(
                dst,
                "exists and is not an lmdbfolder pack; refusing to replace it",
                "remove it yourself or choose another output path",
            )
    partial = dst + PARTIAL_SUFFIX
    if os.path.lexists(partial):
        if not overwrite:
            raise OutputExistsError(
                partial,
                "holds an unfinished pack from an earlier run",
                "pass --overwrite to start over, or remove it",
            )
        shutil.rmtree(partial)
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    os.mkdir(partial)
    return partial


def _is_replaceable(path: str) -> bool:
    if not os.path.isdir(path) or os.path.islink(path):
        return False
    names = set(os.listdir(path))
    return not names or (DATA_FILE in names and names <= {DATA_FILE, LOCK_FILE})


def _publish(partial: str, dst: str) -> None:
    """Make the finished pack visible at ``dst`` in one rename, after it is on disk."""
    lock = os.path.join(partial, LOCK_FILE)
    if os.path.exists(lock):
        os.remove(lock)  # readers open with lock=False; a stale lock file is just clutter
    _fsync_path(os.path.join(partial, DATA_FILE))
    _fsync_path(partial)
    old = None
    if os.path.lexists(dst):
        old = f"{dst}.old-{os.getpid()}"
        os.rename(dst, old)
    os.rename(partial, dst)
    _fsync_path(os.path.dirname(dst))
    if old is not None:
        shutil.rmtree(old)


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _BatchWriter:
    """Appends records in batched transactions; grows the map instead of failing.

    The batch stays in memory until its transaction commits, so when LMDB
    reports MDB_MAP_FULL the transaction is aborted, the map doubled and the
    same batch replayed: the user never sees MapFullError.
    """

    def __init__(self, path: str, map_size: int, commit_every: int, commit_bytes: int) -> None:
        self.path = path
        self.commit_every = commit_every
        self.commit_bytes = commit_bytes
        self.batch: list[tuple[bytes, bytes]] = []
        self.batch_bytes = 0
        self.env = lmdb.open(
            path,
            map_size=map_size,
            subdir=True,
            readahead=False,
            meminit=False,
            max_dbs=0,
            # Every commit is durable (fdatasync): a later resume may trust it.
            sync=True,
            metasync=True,
            writemap=False,
        )

    def add(self, key: bytes, value: bytes) -> None:
        self.batch.append((key, value))
        self.batch_bytes += len(value)
        if len(self.batch) >= self.commit_every or self.batch_bytes >= self.commit_bytes:
            self.commit()

    def commit(self, extra: dict[bytes, bytes] | None = None) -> None:
        while True:
            txn = self.env.begin(write=True)
            try:
                if self.batch:
                    with txn.cursor() as cursor:
                        _consumed, added = cursor.putmulti(self.batch, append=True)
                    if added != len(self.batch):
                        raise PackError(
                            f"{self.path}: only {added} of {len(self.batch)} records were added (duplicate keys)",
                            "start over with --overwrite",
                        )
                for key, value in (extra or {}).items():
                    txn.put(key, value)
                txn.commit()
                break
            except lmdb.MapFullError:
                txn.abort()
                self.env.set_mapsize(self.env.info()["map_size"] * 2)
            except lmdb.Error as exc:
                txn.abort()
                raise _disk_error(self.path, exc) from exc
            except BaseException:
                txn.abort()
                raise
        self.batch = []
        self.batch_bytes = 0

    def finish(self, extra: dict[bytes, bytes]) -> None:
        """Commit the last batch together with the manifest, then flush to disk."""
        self.commit(extra)
        self.env.sync(True)
        self.env.close()

    def abort(self) -> None:
        """Drop the open batch and close; what was committed stays on disk."""
        self.batch = []
        try:
            self.env.close()
        except lmdb.Error:
            pass


def _disk_error(path: str, exc: lmdb.Error) -> PackError:
    text = str(exc)
    if "No space left" in text or getattr(exc, "errno", None) == errno.ENOSPC:
        return PackError(
            f"the disk holding {path} is full ({text})",
            "free some space (or pack to another disk) and run the same command again",
        )
    return PackError(f"LMDB failed while writing {path}: {text}")

"""The page cache: measure what is resident, evict it (for cold benchmarks), warm it.

Everything here works without root: eviction is ``os.sync()`` followed by
``posix_fadvise(POSIX_FADV_DONTNEED)`` on each file, which drops the file's
clean, unmapped pages (a page that some process has mapped, or that is
dirty, stays). ``resident_fraction`` asks the kernel with ``mincore`` which
pages of a file are in memory, so callers can check that eviction worked.
Where the system lacks these calls (macOS has no ``posix_fadvise``) the
functions say so instead of pretending.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from lmdbfolder import packdir
from lmdbfolder.errors import NotAPackError
from lmdbfolder.format import DATA_FILE
from lmdbfolder.pagefile import open_regular
from lmdbfolder.progress import Progress

__all__ = ["EvictReport", "WarmReport", "can_evict", "evict", "resident_fraction", "warm"]

_CHUNK = 8 << 20


def can_evict() -> bool:
    """Whether this system can drop a file's pages from the page cache without root."""
    return hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_DONTNEED")


@dataclass(frozen=True)
class EvictReport:
    """What ``evict`` did: files advised, files that failed, and how much stayed resident."""

    files: int
    failed: int
    supported: bool
    resident_after: float | None

    def describe(self) -> str:
        """One line for reports."""
        if not self.supported:
            return "page cache NOT evicted: posix_fadvise is not available here (cold numbers are warm)"
        left = "" if self.resident_after is None else f", {self.resident_after:.0%} of the sampled pages still resident"
        if self.resident_after is not None and self.resident_after > 0.1:
            left += " (pages that an open reader has mapped cannot be evicted: cold numbers are partly warm)"
        failed = f", {self.failed} could not be opened" if self.failed else ""
        return f"page cache evicted: sync + posix_fadvise(DONTNEED) on {self.files:,} files{failed}{left}"


def evict(paths: Sequence[str], *, check_sample: int = 200, always_check: Sequence[str] = ()) -> EvictReport:
    """Drop ``paths`` from the page cache (``sync`` then ``DONTNEED`` per file).

    Pages that a live process has mapped (an open LMDB environment) cannot be
    dropped: close readers first. ``resident_after`` is the larger of the mean
    resident fraction of up to ``check_sample`` evenly spaced files and the
    resident fraction of each file in ``always_check`` (None when ``mincore``
    is unavailable).
    """
    if not can_evict():
        return EvictReport(len(paths), 0, False, None)
    os.sync()
    failed = 0
    for path in paths:
        try:
            fd = open_regular(path)  # never blocks on a FIFO
        except OSError:
            failed += 1
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            failed += 1
        finally:
            os.close(fd)
    step = max(1, len(paths) // max(1, check_sample))
    sampled = [f for f in (resident_fraction(p) for p in paths[::step]) if f is not None]
    checked = [f for f in (resident_fraction(p) for p in always_check) if f is not None]
    worst = [sum(sampled) / len(sampled)] if sampled else []
    worst += checked
    return EvictReport(len(paths), failed, True, max(worst) if worst else None)


def _libc() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.mincore.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


def resident_fraction(path: str) -> float | None:
    """Fraction (0..1) of ``path``'s pages in the page cache, by ``mincore``; None if unknown."""
    if _LIBC is None:
        return None
    try:
        size = os.path.getsize(path)
        if size == 0:
            return 1.0
        # Only a regular file: opening a FIFO waits for a writer.
        with open(open_regular(path), "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mm:
            view = np.frombuffer(mm, np.uint8)
            page = mmap.PAGESIZE
            vec = np.zeros((size + page - 1) // page, np.uint8)
            rc = _LIBC.mincore(ctypes.c_void_p(view.ctypes.data), size, vec.ctypes.data)
            del view
        if rc != 0:
            return None
        return float(np.count_nonzero(vec & 1)) / len(vec)
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class WarmReport:
    """What ``warm`` did."""

    path: str
    nbytes: int
    seconds: float
    resident_before: float | None
    resident_after: float | None
    mem_available: int | None

    @property
    def mb_per_second(self) -> float:
        """Read rate in MB (10**6 bytes) per second."""
        return self.nbytes / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary."""
        return dict(self.__dict__, mb_per_second=round(self.mb_per_second, 1))


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def warm(pack: str | os.PathLike[str], *, progress: bool | None = None) -> WarmReport:
    """Read a pack's ``data.mdb`` (every shard's, for a sharded pack) once, front to
    back, so it is in the page cache.

    Sequential 8 MiB reads (with ``POSIX_FADV_SEQUENTIAL`` where available)
    are the fastest way to load the file; afterwards every DataLoader worker
    on the machine reads from memory. Pages the kernel needs for something
    else are dropped again, so warming a pack larger than the free memory
    only keeps its tail. ``resident_before``/``after`` are byte-weighted over
    the files.
    """
    found = packdir.require_pack(pack)
    files = packdir.data_files(found.path)
    fds = _open_data_files(found, files)
    try:
        sizes = [os.fstat(fd).st_size for fd in fds]
        before = _weighted([resident_fraction(f) for f in files], sizes)
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        done = 0
        start = time.perf_counter()
        with Progress(sum(sizes), "warm", enabled=progress, unit="B") as bar:
            for fd in fds:
                with open(fd, "rb", buffering=0, closefd=False) as f:
                    if hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    while True:
                        n = f.readinto(view)
                        if not n:
                            break
                        done += n
                        bar.update(n, n)
        seconds = time.perf_counter() - start
    finally:
        for fd in fds:
            os.close(fd)
    after = _weighted([resident_fraction(f) for f in files], sizes)
    return WarmReport(found.path, done, seconds, before, after, _mem_available())


def _open_data_files(found: packdir.Found, files: list[str]) -> list[int]:
    """A descriptor of each ``data.mdb`` (every shard's), all opened before any is read;
    NotAPackError naming the missing shards, or the shard whose data.mdb is no
    regular file (a FIFO would block the read for ever)."""
    sharded = found.kind is packdir.Kind.SHARDED
    missing = [os.path.basename(os.path.dirname(f)) for f in files if sharded and not os.path.isdir(os.path.dirname(f))]
    if missing:
        raise packdir.missing_shards(found.path, missing, len(files))
    fds: list[int] = []
    try:
        for path in files:
            where = os.path.dirname(path)
            try:
                fds.append(open_regular(path))
            except FileNotFoundError:
                raise NotAPackError(
                    where,
                    f"its {DATA_FILE} is missing",
                    "copy the shard again from a good copy of the pack (or repack it)"
                    if sharded
                    else "copy the pack again from a good copy (or repack it)",
                ) from None
            except OSError as exc:
                raise NotAPackError(where, f"cannot read {DATA_FILE} ({exc.strerror})") from None
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def _weighted(fractions: list[float | None], sizes: list[int]) -> float | None:
    if any(f is None for f in fractions) or not sizes:
        return None
    total = sum(sizes)
    if total == 0:
        return 1.0
    return sum(f * n for f, n in zip(fractions, sizes) if f is not None) / total

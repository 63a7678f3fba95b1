"""Durable file-system steps shared by everything that publishes a pack.

A pack (or a copy of one) is built under a temporary name, flushed to disk,
and made visible with one rename; these helpers are those steps.
"""

from __future__ import annotations

import os
import shutil

__all__ = ["fsync_path", "swap_into_place", "dir_size"]


def fsync_path(path: str) -> None:
    """fsync a file or a directory (a directory's fsync makes renames in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def swap_into_place(tmp: str, dst: str) -> None:
    """Rename the finished directory ``tmp`` to ``dst``, replacing what is there.

    An existing ``dst`` is moved aside first and removed only after the new
    one is in place, so ``dst`` names either the old or the new complete
    directory at every moment but the instant between the two renames.
    """
    old = None
    if os.path.lexists(dst):
        old = f"{dst}.old-{os.getpid()}"
        os.rename(dst, old)
    os.rename(tmp, dst)
    fsync_path(os.path.dirname(os.path.abspath(dst)))
    if old is not None:
        shutil.rmtree(old)


def dir_size(path: str) -> int:
    """Bytes of the regular files directly in ``path`` (a pack: data.mdb and friends)."""
    total = 0
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.is_file():
                total += entry.stat().st_size
    return total

"""One ``pack`` at a time per destination: the writer lock ``<dst>.lock``.

Two runs of ``lmdbfolder pack`` on the same DST would resume the same
``DST.partial`` and write it together (and ``--restart`` in one would delete
the other's work). The writer therefore holds an exclusive ``flock`` on
``<dst>.lock`` (format.WRITER_LOCK_SUFFIX) from before it looks at DST until
the pack is published or the run ends; the file holds the holder's process
id, so the second run can say who holds it.

The lock is advisory and local to one machine's kernel (``flock``); on a
network file system two machines are not kept apart (do not write LMDB
there anyway; see ``pack --staging``). It is released when the run ends, and
by the kernel when the process dies, so a killed run never blocks the next
one. The file is removed on release; a run that opened it just before that
notices (the path then names another file) and tries again.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import stat
from typing import Iterator

from lmdbfolder.errors import OutputExistsError, PackError, os_refusal
from lmdbfolder.format import WRITER_LOCK_SUFFIX

__all__ = ["writer_lock", "lock_path"]

try:
    import fcntl
except ImportError:  # Windows: no flock; packs are not locked there
    fcntl = None  # type: ignore[assignment]


def lock_path(dst: str) -> str:
    """The lock file of the pack being written at ``dst``."""
    return os.path.abspath(dst) + WRITER_LOCK_SUFFIX


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
        info = json.loads(text)
        return f"pid {int(info['pid'])} on {str(info.get('host', '?'))[:64]}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process whose id it did not record"


def _planted(path: str, what: str) -> OutputExistsError:
    return OutputExistsError(
        path,
        f"is {what}, not a writer lock lmdbfolder made; it is never followed or written",
        f"remove {path}, then run the same command again",
    )


@contextlib.contextmanager
def writer_lock(dst: str) -> Iterator[None]:
    """Hold the writer lock of ``dst`` for the ``with`` block.

    Raises OutputExistsError (naming the holder's process id) when another
    lmdbfolder pack holds it; its hint says to wait, never to start over
    (``--restart`` would delete the other run's work).
    """
    if fcntl is None:
        yield
        return
    path = lock_path(dst)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    except OSError as exc:
        raise PackError(*os_refusal(exc, "cannot make the folder of", dst)) from None
    while True:
        # Never through a link, never waiting on a FIFO: a file planted under this name is refused.
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(path, flags | getattr(os, "O_NONBLOCK", 0), 0o644)
        except OSError as exc:  # a read-only folder, a full disk: before anything else is written
            if exc.errno == errno.ELOOP:
                raise _planted(path, "a symbolic link") from None
            raise PackError(*os_refusal(exc, "cannot create the writer lock")) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise _planted(path, "a FIFO or another special file")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise OutputExistsError(
                dst,
                f"is being written by another lmdbfolder pack ({holder}; it holds {path})",
                "wait for that pack to finish (or stop it), then run this command again",
            ) from None
        except BaseException:
            os.close(fd)
            raise
        # The holder before us may have removed the file after we opened it:
        # then our lock is on a file nobody else will look at. Start over.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)
        except OSError as exc:  # 0 bytes free: the first write of the whole pack fails here
            raise PackError(*os_refusal(exc, "cannot write the writer lock", path)) from None
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)  # while still locked: nobody can be between open and flock on it
        os.close(fd)

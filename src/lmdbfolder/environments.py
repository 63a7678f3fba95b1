"""The read-only LMDB environments this process has open: one per pack directory.

Every finished pack is opened through this module, by readers and by the
tools alike, because of two rules of py-lmdb and LMDB (docs/design.md,
"Opening an environment"):

* py-lmdb refuses to open a path that is already open in the same process,
  so environments are shared, one per directory, reference-counted.
* An environment must not be used across ``fork()``. When the registry sees
  a new PID it closes the handles it inherited (closing in the child unmaps
  only the child's copy; the parent's stay valid) and opens its own.

Environments are opened ``readonly=True, lock=False``: a finished pack never
changes, so no reader table is needed (no ``MDB_READERS_FULL``, no stale
slots of killed workers, read-only directories work). Before an environment
is handed out, ``data.mdb`` is checked to be as long as its meta pages say:
touching a page past the end of a truncated file kills the process (SIGBUS).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

import lmdb

from lmdbfolder.errors import NotAPackError
from lmdbfolder.format import DATA_FILE, LABELS_KEY, META_KEY, PATHS_KEY

__all__ = ["acquire", "release", "opened", "read_tables", "read_manifest"]


class _Registry:
    """The environments this process has open, one per pack directory."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._envs: dict[str, lmdb.Environment] = {}
        self._users: dict[str, int] = {}

    def _forget_inherited(self) -> None:
        # Runs in a forked child: the handles belong to the parent. Closing them
        # here unmaps the child's copy only; the parent's stay valid.
        for env in self._envs.values():
            try:
                env.close()
            except lmdb.Error:
                pass
        self._envs.clear()
        self._users.clear()
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def acquire(self, path: str, readahead: bool) -> lmdb.Environment:
        if os.getpid() != self._pid:
            self._forget_inherited()
        with self._lock:
            env = self._envs.get(path)
            if env is None:
                env = _open(path, readahead)
                self._envs[path] = env
                self._users[path] = 0
            self._users[path] += 1
            return env

    def release(self, path: str) -> None:
        if os.getpid() != self._pid:
            self._forget_inherited()
            return
        with self._lock:
            if path not in self._users:
                return
            self._users[path] -= 1
            if self._users[path] <= 0:
                env = self._envs.pop(path)
                del self._users[path]
                env.close()


_REGISTRY = _Registry()


def acquire(path: str, readahead: bool = True) -> lmdb.Environment:
    """The read-only environment of the pack directory ``path`` (absolute), opened
    on first use in this process; pair every call with ``release(path)``.

    Raises NotAPackError if ``data.mdb`` is not an LMDB or is truncated.
    ``readahead`` applies when this call opens the environment.
    """
    return _REGISTRY.acquire(path, readahead)


def release(path: str) -> None:
    """Give back one ``acquire``; the environment closes when nobody holds it."""
    _REGISTRY.release(path)


@contextlib.contextmanager
def opened(path: str, readahead: bool = False) -> Iterator[lmdb.Environment]:
    """``acquire``/``release`` as a context manager, for short looks into a pack."""
    env = acquire(path, readahead)
    try:
        yield env
    finally:
        release(path)


def read_manifest(path: str) -> bytes | None:
    """The stored manifest (``__meta__``) of the pack at ``path``, or None if it has none."""
    with opened(path) as env, env.begin() as txn:
        blob = txn.get(META_KEY)
    return None if blob is None else bytes(blob)


def read_tables(path: str) -> tuple[bytes, bytes, bytes]:
    """The manifest, label table and path table of the pack at ``path``, as stored.

    Raises NotAPackError naming the missing one.
    """
    with opened(path) as env, env.begin() as txn:
        blobs = []
        for key in (META_KEY, LABELS_KEY, PATHS_KEY):
            blob = txn.get(key)
            if blob is None:
                raise NotAPackError(path, f"its {key.decode()} table is missing")
            blobs.append(bytes(blob))
    return blobs[0], blobs[1], blobs[2]


def _open(path: str, readahead: bool) -> lmdb.Environment:
    try:
        env = lmdb.open(
            path,
            subdir=True,
            readonly=True,
            lock=False,
            create=False,
            readahead=readahead,
            meminit=False,
            max_spare_txns=0,
        )
    except lmdb.InvalidError:
        raise NotAPackError(path, f"{DATA_FILE} is not an LMDB file") from None
    except lmdb.Error as exc:
        raise NotAPackError(path, f"LMDB cannot open it: {exc}") from None
    try:
        _check_not_truncated(path, env)
    except BaseException:
        env.close()
        raise
    return env


def _check_not_truncated(path: str, env: lmdb.Environment) -> None:
    # A data.mdb cut short (an interrupted copy or download) still opens, but
    # touching a page past its end kills the process with SIGBUS. The meta
    # pages at the front say how many pages the database uses: check first.
    needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    size = os.path.getsize(os.path.join(path, DATA_FILE))
    if size < needed:
        raise NotAPackError(
            path,
            f"{DATA_FILE} is truncated: it holds {size:,} bytes but the database needs {needed:,}",
            "the file was cut short (an interrupted copy?): copy it again with `lmdbfolder copy`, or repack it",
        )

"""A file holding one sample's stored bytes, for loaders that want a path (``LMDBFolder(loader=...)``).

ImageFolder calls its ``loader`` with a path. Loaders open it in every way
there is: ``open(path, "rb")`` (torchvision's ``pil_loader``, and the many
copies of it), ``Image.open``, ``cv2.imread``, ``torchvision.io.decode_image``
and ``read_image`` (which need a ``str``), ``accimage.Image``, ``np.load``.
A file-like object would work for only some of them, so a loader gets a real
path: ``StoredFile``, a ``str`` naming a file that holds exactly the bytes
that were packed, with the original path in ``.source``.

What a loader returns may keep using that path after the sample is made:
``Image.open`` is lazy and keeps it as ``.filename``, and writers that copy an
image's bytes (LitData's ``optimize``, MosaicML's ``MDSWriter``, Hugging Face
``datasets``) read ``.filename`` again later, as they would read the original
file of an ImageFolder sample. So the file is *lent* (``lend``): it lives as
long as the caller's block, the ``StoredFile`` itself and every object handed
to ``Lease.hold`` (the loader's result, what the transform made of it), and is
removed when the last of them is garbage-collected. A lent ``StoredFile``
pickles with the file's bytes: a lazy image made in a DataLoader worker
(Pillow pickles its ``.filename``) names a file of the main process there.

Its name is ``<n><ext>``: ``n`` counts up and is never reused in the process
(a name never comes to mean another sample), and ``ext`` is the original
file's extension, so loaders that branch on it (``.png`` vs ``.jpg``) take the
same branch as for the original.

The files live in one private folder per process (``folder()``, mode 0700),
made on first use under ``/dev/shm`` when it is a memory file system with
room to spare (nothing touches a disk), else under the temporary directory
(``tempfile.gettempdir()``); nothing is written anywhere else. The folder is
removed when the process exits (also a DataLoader worker, fork or spawn). A
process that was killed cannot remove its folder: the next process to make
one removes the folders whose owner is gone (each owner holds a lock on its
``.owner`` file while it lives).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import re
import shutil
import stat
import tempfile
import threading
import weakref
from typing import Any, Iterator

try:
    import fcntl
except ImportError:  # not on Windows: stale folders of killed processes are then left
    fcntl = None  # type: ignore[assignment]

__all__ = ["StoredFile", "Lease", "lend", "stored_file", "folder"]

_PREFIX = "lmdbfolder-files-"
_OWNER = ".owner"
#: An extension kept in the name: a dot and a few letters, digits, "_", "+" or "-".
_EXTENSION = re.compile(r"\.[A-Za-z0-9_+-]{1,15}")
#: /dev/shm is used when it has at least this much free (containers often give it 64 MiB).
_SHM_MIN_FREE = 1 << 30


class StoredFile(str):
    """The path given to a custom loader: a file holding the stored bytes of record
    ``pack_index``, packed from ``source`` (the path ``samples`` shows for it).

    One made by ``lend`` keeps its file while it lives (so does whatever keeps
    it: a lazy image's ``.filename``), and pickles with the file's bytes: where
    it is unpickled (the main process, for a sample made in a DataLoader worker)
    it names a file of that process holding them, kept while it lives there.
    """

    source: str
    pack_index: int

    def __new__(cls, path: str, source: str, pack_index: int) -> StoredFile:
        obj = super().__new__(cls, path)
        obj.source = source
        obj.pack_index = pack_index
        return obj

    def __getnewargs__(self) -> tuple[str, str, int]:  # type: ignore[override]
        return (str(self), self.source, self.pack_index)

    def __reduce__(self) -> tuple[Any, ...]:
        if self.__dict__.get("_token") is not None:
            try:
                with open(self, "rb") as f:
                    return (_adopt, (f.read(), self.source, self.pack_index))
            except OSError:
                pass  # then as a plain name
        return (StoredFile, self.__getnewargs__())

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return self.__reduce__()


def _adopt(payload: bytes, source: str, index: int) -> StoredFile:
    """A pickled lent ``StoredFile``, unpickled: a file of this process with its bytes."""
    return _lend_file(payload, source, index)[0]


class _Folder:
    """This process's folder of lent files (made by ``_folder``, removed at exit)."""

    def __init__(self, path: str, owner_fd: int | None) -> None:
        self.pid = os.getpid()
        self.path = path
        self.owner_fd = owner_fd
        self.names = itertools.count()

    def remove(self) -> None:
        # At exit: what is still lent goes too (the objects holding it die with the process).
        if os.getpid() != self.pid:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        if self.owner_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.owner_fd)
            self.owner_fd = None


_lock = threading.Lock()
_current: _Folder | None = None


def _after_fork() -> None:
    # The child makes its own folder on first use; the parent's stays the parent's.
    # Its copy of the parent's lock descriptor is closed (the lock stays the parent's).
    global _lock, _current
    _lock = threading.Lock()
    if _current is not None and _current.owner_fd is not None:
        with contextlib.suppress(OSError):
            os.close(_current.owner_fd)
    _current = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def _base() -> str:
    # Memory when there is room: a lent file is usually gone within the sample.
    shm = "/dev/shm"
    try:
        st = os.statvfs(shm)
        if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) and st.f_bavail * st.f_frsize >= _SHM_MIN_FREE:
            return shm
    except (OSError, AttributeError):
        pass
    return tempfile.gettempdir()


def _sweep(base: str) -> None:
    """Remove the folders of lmdbfolder processes that are gone (killed before their exit hook)."""
    if fcntl is None:
        return
    try:
        names = [n for n in os.listdir(base) if n.startswith(_PREFIX)]
    except OSError:
        return
    for name in names:
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue  # not a folder this user made (a link, another user's)
            fd = os.open(os.path.join(path, _OWNER), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its owner lives
        finally:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)


def _make_folder() -> _Folder:
    base = _base()
    _sweep(base)
    path = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=base)
    owner_fd = None
    if fcntl is not None:
        # Locked before it gets its name: a sweeper never finds an unlocked owner of a live folder.
        unnamed = os.path.join(path, _OWNER + ".new")
        owner_fd = os.open(unnamed, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(owner_fd, fcntl.LOCK_EX)
        os.rename(unnamed, os.path.join(path, _OWNER))
    made = _Folder(path, owner_fd)
    atexit.register(made.remove)
    try:
        # A forked multiprocessing child (a DataLoader worker) leaves with os._exit,
        # past atexit: its exit runs multiprocessing's finalizers instead.
        from multiprocessing import util

        util.Finalize(None, made.remove, exitpriority=0)
    except ImportError:  # pragma: no cover - multiprocessing is stdlib
        pass
    return made


def _folder() -> _Folder:
    global _current
    with _lock:
        if _current is None or _current.pid != os.getpid():
            _current = _make_folder()
        return _current


def _forget(place: _Folder) -> None:
    global _current
    with _lock:
        if _current is place:
            _current = None


def folder() -> str:
    """This process's private folder of lent files (made on first call)."""
    return _folder().path


def _extension(source: str) -> str:
    ext = os.path.splitext(source)[1]
    return ext if _EXTENSION.fullmatch(ext) else ""


def _write_all(fd: int, payload: Any) -> None:
    view = memoryview(payload).cast("B")
    while view:
        written = os.write(fd, view)
        view = view[written:]


class _Count:
    """How many holds a lent file has; the last one dropped removes it."""

    __slots__ = ("name", "pid", "holds", "lock", "__weakref__")

    def __init__(self, name: str) -> None:
        self.name = name
        self.pid = os.getpid()
        self.holds = 0
        self.lock = threading.RLock()  # a finalizer may run inside hold(), in the same thread

    def add(self) -> None:
        with self.lock:
            self.holds += 1

    def drop(self) -> None:
        with self.lock:
            self.holds -= 1
            last = self.holds == 0
        # A forked child's copies of the parent's objects do not own the parent's files.
        if last and os.getpid() == self.pid:
            with contextlib.suppress(OSError):
                os.unlink(self.name)


class _Token:
    """The hold of a ``StoredFile`` on its file (dropped when the path is collected)."""

    __slots__ = ("count",)

    def __init__(self, count: _Count) -> None:
        count.add()
        self.count = count

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # also at interpreter shutdown
            self.count.drop()


class Lease:
    """A lent file (``lend``): ``path`` (a ``StoredFile``) names a file holding the
    sample's bytes while the block runs, while ``path`` itself lives, and while
    every object given to ``hold`` lives."""

    __slots__ = ("_path", "_count")

    def __init__(self, path: StoredFile, count: _Count) -> None:
        self._path: StoredFile | None = path
        self._count = count

    @property
    def path(self) -> StoredFile:
        """The file's path, for the loader (inside the block)."""
        if self._path is None:
            raise RuntimeError("Lease.path is for use inside its block; keep the path itself to keep the file")
        return self._path

    def hold(self, obj: Any) -> None:
        """Keep the file while ``obj`` lives: ``obj`` itself, or for a tuple, list or
        dict that cannot be watched, each item in it (one level). An object that
        can be watched in neither way (bytes, numbers) holds nothing: it cannot
        read the file later."""
        watched = _watchable(obj)
        if watched is None:
            items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
            targets = [w for w in map(_watchable, items) if w is not None]
        else:
            targets = [watched]
        for target in targets:
            self._count.add()
            weakref.finalize(target, self._count.drop).atexit = False  # the folder goes at exit anyway

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self._path = None  # the block's hold: what still holds the path keeps the file


def _watchable(obj: Any) -> Any:
    try:
        weakref.ref(obj)
    except TypeError:
        return None
    return obj


def lend(payload: Any, source: str, index: int) -> Lease:
    """A ``Lease`` on a new file holding ``payload`` (the bytes of record ``index``,
    packed from ``source``), named ``<n><ext of source>`` in ``folder()``.

    Use it as a block; inside, give ``Lease.hold`` whatever may read the file
    later (the loader's result, the transformed sample)::

        with lend(rec.payload, source, rec.index) as lease:
            sample = loader(lease.path)
            lease.hold(sample)
    """
    path, count = _lend_file(payload, source, index)
    return Lease(path, count)


def _lend_file(payload: Any, source: str, index: int, *, retry: bool = True) -> tuple[StoredFile, _Count]:
    place = _folder()
    name = os.path.join(place.path, f"{next(place.names)}{_extension(source)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(name, flags, 0o600)
    except FileNotFoundError:
        if not retry:
            raise
        # The folder was removed under us (a cleaner of the temporary directory): make another.
        _forget(place)
        return _lend_file(payload, source, index, retry=False)
    try:
        _write_all(fd, payload)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise
    os.close(fd)
    count = _Count(name)
    path = StoredFile(name, source, index)
    path._token = _Token(count)  # type: ignore[attr-defined]
    return path, count


@contextlib.contextmanager
def stored_file(payload: Any, source: str, index: int) -> Iterator[StoredFile]:
    """A ``StoredFile`` holding ``payload`` while the block runs (a ``lend`` that
    nothing else holds)."""
    with lend(payload, source, index) as lease:
        yield lease.path

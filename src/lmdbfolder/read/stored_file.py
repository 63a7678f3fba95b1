"""A file holding one sample's stored bytes, for loaders that want a path (``LMDBFolder(loader=...)``).

ImageFolder calls its ``loader`` with a path. Loaders open it in every way
there is: ``open(path, "rb")`` (torchvision's ``pil_loader``, and the many
copies of it), ``Image.open``, ``cv2.imread``, ``torchvision.io.decode_image``
and ``read_image`` (which need a ``str``), ``accimage.Image``, ``np.load``.
A file-like object would work for only some of them, so a loader gets a real
path: ``StoredFile``, a ``str`` naming a file that holds exactly the bytes
that were packed, with the original path in ``.source``.

On Linux the file lives only in memory (``memfd_create``; the path is
``/proc/self/fd/N``): nothing touches a disk and nothing is left behind, even
when the process is killed. Elsewhere it is a temporary file, removed again
when ``stored_file`` exits. Either way the name is not the original's:
a loader that looks at the name (its extension, its folder) should use
``path.source``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any, Iterator

__all__ = ["StoredFile", "stored_file"]


class StoredFile(str):
    """The path given to a custom loader: a file holding the stored bytes of record
    ``pack_index``, packed from ``source`` (the path ``samples`` shows for it)."""

    source: str
    pack_index: int

    def __new__(cls, path: str, source: str, pack_index: int) -> StoredFile:
        obj = super().__new__(cls, path)
        obj.source = source
        obj.pack_index = pack_index
        return obj

    def __getnewargs__(self) -> tuple[str, str, int]:  # type: ignore[override]
        return (str(self), self.source, self.pack_index)


def _memfd_available() -> bool:
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


_MEMFD = _memfd_available()


def _write_all(fd: int, payload: Any) -> None:
    view = memoryview(payload).cast("B")
    while view:
        written = os.write(fd, view)
        view = view[written:]


@contextlib.contextmanager
def stored_file(payload: Any, source: str, index: int) -> Iterator[StoredFile]:
    """A ``StoredFile`` holding ``payload`` while the block runs.

    The file stays valid until the block ends; what a loader opened from it
    (Pillow opens lazily) keeps working after that, since it holds its own
    descriptor.
    """
    if _MEMFD:
        fd = os.memfd_create(f"lmdbfolder-{index}", os.MFD_CLOEXEC)
        try:
            _write_all(fd, payload)
            yield StoredFile(f"/proc/self/fd/{fd}", source, index)
        finally:
            os.close(fd)
        return
    suffix = os.path.splitext(source)[1][:16]
    fd, name = tempfile.mkstemp(prefix="lmdbfolder-", suffix=suffix)
    try:
        try:
            _write_all(fd, payload)
        finally:
            os.close(fd)
        yield StoredFile(name, source, index)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(name)

"""Turn one source file into one record value, or into a reason to skip it.

This runs in the writer's reader processes or threads (see
``write.processes`` and ``write.threads``), so it is a pure function of its inputs, never raises for bad
input (bad input becomes a ``Skipped``), and leaves most of the time to
GIL-free work (``read``, the CRC-32, Pillow's decoders). A file is read
straight into the buffer that becomes its LMDB value (a slot of a reader
process's shared memory, or a new bytearray), behind room for the record
header, so the payload is not copied on its way to the database.

Checks (``check=``):

* ``"header"`` (default): the header is read as Pillow's open reads it
  (format, size), and the pixel count must be within Pillow's
  ``Image.MAX_IMAGE_PIXELS`` (decompression-bomb limit). No pixels decoded.
  JPEGs and PNGs whose header ``encodings.clean_header`` vouches for (every
  segment well formed and of a kind Pillow accepts without parsing it) are
  accepted without calling Pillow (~3 us instead of ~40 us a file); every
  other file, and every file that might be refused, goes to Pillow, so what
  is skipped, and why, is Pillow's call.
  JPEGs and PNGs must also end with their end marker (``encodings.truncation``:
  a look at the file's last bytes), which catches files cut short.
* ``"decode"``: the image is fully decoded once (catches corrupt data too).
* ``"none"``: trust the input; only unreadable and zero-byte files are skipped.
"""

from __future__ import annotations

import errno
import io
import os
from dataclasses import dataclass
from typing import Callable

from PIL import Image, UnidentifiedImageError

from lmdbfolder.encodings import OTHER, RAW, clean_header, encoding_of, sniff, truncation, vouch_jpeg
from lmdbfolder.format import RECORD_HEADER, UNKNOWN_MTIME, encode_header_into, encode_record
from lmdbfolder.pagefile import NotRegularFileError, open_regular
from lmdbfolder.write.options import Resize

__all__ = ["Loaded", "Skipped", "load_sample", "load_bytes", "read_into_record"]

_HEAD = RECORD_HEADER.size
# Pillow reads only the headers when it opens an image; most fit in the first
# 64 KB, so only that much is handed to it (files with bigger EXIF/ICC blocks
# are retried with the whole file).
_HEADER_PREFIX = 64 << 10


@dataclass(frozen=True)
class Loaded:
    """A record ready to be stored. ``source_bytes`` and ``mtime_ns`` are the source
    file's size and modification time when it was opened (``fstat`` of the
    descriptor it was read from; ``UNKNOWN_MTIME`` when not read from a file):
    what ``pack --update`` compares later."""

    value: bytearray | bytes | memoryview
    encoding: str
    source_bytes: int
    mtime_ns: int = UNKNOWN_MTIME


@dataclass(frozen=True)
class Skipped:
    """A source file that was not stored, and why; its size and modification time
    when it was opened (``UNKNOWN_MTIME`` and 0 when it could not be)."""

    reason: str
    size: int = 0
    mtime_ns: int = UNKNOWN_MTIME


def _read_error(exc: OSError, path: str) -> str:
    if exc.errno == errno.ENOENT:
        if os.path.islink(path):
            return "broken symbolic link (its target does not exist)"
        return "file not found (it vanished, or the listed path is wrong)"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if exc.errno == errno.EISDIR:
        return "is a directory, not a file"
    if isinstance(exc, NotRegularFileError):
        return f"not read: {exc.strerror}"
    return f"cannot read it: {exc.strerror or exc}"


#: Supplies the buffer a record is read into: ``alloc(n)`` returns ``n``
#: writable bytes (a slot of the writer's shared memory), or None for a new
#: bytearray.
Alloc = Callable[[int], "memoryview | None"]


def read_into_record(path: str, alloc: Alloc | None = None) -> bytearray | memoryview:
    """The file's bytes at offset 32 of a buffer (room for the record header).

    The buffer comes from ``alloc`` when given (and it returns one), else it
    is a view of a new bytearray. A file that grows while it is read is
    returned whole, in a new bytearray; one that shrinks, as a shorter view. Raises OSError
    like ``open``/``read`` (IsADirectoryError for a directory, ``NotRegularFileError``
    for a FIFO, socket or device: ``open_regular``).
    """
    return _read_file(path, alloc)[0]


def _read_file(path: str, alloc: Alloc | None = None) -> tuple[bytearray | memoryview, os.stat_result]:
    """``read_into_record``, and the ``fstat`` of the file as it was opened."""
    # os-level calls: four system calls per file (open, fstat, readv, close)
    # where io.open made about ten, and each one is a GIL hand-off in threads.
    fd = open_regular(path)  # a FIFO named *.jpg must not block the pack, nor a device fill it
    try:
        st = os.fstat(fd)
        size = st.st_size
        buf = alloc(_HEAD + size) if alloc is not None else None
        if buf is None:
            buf = memoryview(bytearray(_HEAD + size))
        # One byte more than fstat promised: a short read is the end of the file
        # and a full one means it grew.
        probe = bytearray(1)
        got = os.readv(fd, [buf[_HEAD:], probe])
        while got < size:  # a short read before the end (some network file systems)
            n = os.readv(fd, [buf[_HEAD + got :], probe])
            if not n:  # the file shrank while we read it
                return buf[: _HEAD + got], st
            got += n
        if got > size:  # the file grew: keep what is there now
            grown = bytearray(buf)
            grown += probe
            while chunk := os.read(fd, 1 << 20):
                grown += chunk
            return grown, st
        return buf, st
    finally:
        os.close(fd)


def _open_checked(
    buf: bytearray | memoryview, max_pixels: int | None, *, header_only: bool, encoding: str = OTHER.name
) -> Image.Image | Skipped:
    """Open the image in ``buf`` with Pillow and apply the header checks.

    ``header_only``: hand Pillow only the first 64 KB when that holds the
    headers (the image will not be decoded). ``encoding`` is what ``sniff``
    found: Pillow tries that format first.
    """
    try:
        img = _open_image(buf, encoding) if header_only else Image.open(io.BytesIO(bytes(memoryview(buf)[_HEAD:])))
    except Image.DecompressionBombError as exc:
        return Skipped(f"decompression bomb: {exc}")
    except UnidentifiedImageError:
        return Skipped("not an image Pillow can identify (wrong content for its extension?)")
    except Exception as exc:  # Pillow raises many exception types for bad headers
        return Skipped(f"unreadable image header: {type(exc).__name__}: {exc}")
    width, height = img.size
    problem = None
    if width <= 0 or height <= 0:
        problem = f"image header says {width}x{height} pixels"
    elif max_pixels is not None and width * height > max_pixels:
        problem = (
            f"{width}x{height} = {width * height:,} pixels is over the decompression-bomb limit of "
            f"{max_pixels:,} (PIL.Image.MAX_IMAGE_PIXELS)"
        )
    if problem is not None:
        img.close()
        return Skipped(problem)
    return img


def _open_image(buf: bytearray | memoryview, encoding: str) -> Image.Image:
    end = min(len(buf), _HEAD + _HEADER_PREFIX)
    head = bytes(memoryview(buf)[_HEAD:end])
    formats = encoding_of(encoding).pillow_formats
    if formats:
        # Only the plugin that would have been chosen anyway (no other one
        # accepts these magic bytes): skips the others' checks. Any failure
        # takes the ordinary path below, so errors read exactly as before.
        try:
            return Image.open(io.BytesIO(head), formats=formats)
        except Exception:
            pass
    try:
        return Image.open(io.BytesIO(head))
    except Exception:
        if end == len(buf):
            raise
    return Image.open(io.BytesIO(bytes(memoryview(buf)[_HEAD:])))


def load_sample(
    path: str,
    label: int,
    *,
    store: str,
    check: str,
    max_pixels: int | None,
    resize: Resize | None = None,
    alloc: Alloc | None = None,
) -> Loaded | Skipped:
    """Read ``path`` and build its record, applying ``check`` (and ``resize``).

    ``max_pixels`` is the decompression-bomb limit (None: no limit). The file
    is read into a buffer from ``alloc`` (see ``read_into_record``); records
    that are built anew (``store="raw"``, resized images) are not. The
    result carries the file's size and modification time as it was opened.
    """
    try:
        buf, st = _read_file(path, alloc)
    except OSError as exc:
        return Skipped(_read_error(exc, path))
    result = _load(buf, label, store, check, max_pixels, resize)
    if isinstance(result, Skipped):
        return Skipped(result.reason, st.st_size, st.st_mtime_ns)
    return Loaded(result.value, result.encoding, result.source_bytes, st.st_mtime_ns)


def load_bytes(
    data: bytes | bytearray | memoryview, label: int, *, check: str, max_pixels: int | None
) -> Loaded | Skipped:
    """``load_sample`` for an encoded image that is not a file (a value of another
    LMDB, for ``import``): the same ``check`` (a value that is not an image, or is
    cut short, is a Skipped with the reason ``pack`` gives), stored as it is."""
    buf = bytearray(_HEAD + len(data))
    buf[_HEAD:] = data
    return _load(buf, label, "encoded", check, max_pixels, None)


def _load(
    buf: bytearray | memoryview, label: int, store: str, check: str, max_pixels: int | None, resize: Resize | None
) -> Loaded | Skipped:
    """``load_sample`` of a file already read into ``buf`` (behind room for the header)."""
    size = len(buf) - _HEAD
    if size == 0:
        return Skipped("empty file (0 bytes)")
    data = memoryview(buf)[_HEAD:]
    # The default check on an ordinary JPEG: one walk of its header gives the
    # shape, the verdict and where the scan data starts (vouch_jpeg).
    header_check = check == "header" and store == "encoded"
    walked = vouch_jpeg(data) if header_check else None
    if walked is not None:
        info, data_start = walked
    else:
        info, data_start = sniff(data), None
    if check != "none":
        cut = truncation(data, info.encoding, data_start=data_start)
        if cut is not None:
            return Skipped(f"truncated: {cut}")
    if resize is not None:
        resized = _load_resized(buf, label, store, resize, max_pixels)
        if resized is not None:
            return resized
    vouched = (
        header_check
        and (max_pixels is None or info.width * info.height <= max_pixels)
        # For an ordinary JPEG the walk above was clean_header already (a JPEG it
        # did not vouch for, clean_header does not either).
        and (walked is not None or clean_header(data, info))
    )
    if (check == "none" or vouched) and store == "encoded":
        # Not checked, or a JPEG/PNG header our parser vouches for: Pillow's
        # open (tens of microseconds a file) would accept it and read the same size.
        encode_header_into(
            buf, label=label, encoding=info.encoding, width=info.width, height=info.height, channels=info.channels
        )
        return Loaded(buf, info.encoding, size)
    img = _open_checked(buf, max_pixels, header_only=header_check, encoding=info.encoding)
    if isinstance(img, Skipped):
        return img
    with img:
        width, height = img.size
        bands = len(img.getbands())
        try:
            if store == "raw":
                pixels = RAW.encode(img.convert("RGB"))
            elif check == "decode":
                img.load()
        except Exception as exc:  # truncated or corrupt data; Pillow raises OSError, SyntaxError, ...
            return Skipped(f"cannot be decoded: {type(exc).__name__}: {exc}")
    if store == "raw":
        value = encode_record(pixels, label=label, encoding=RAW.name, width=width, height=height, channels=3)
        return Loaded(value, RAW.name, size)
    channels = info.channels if info.recognised else bands
    encode_header_into(buf, label=label, encoding=info.encoding, width=width, height=height, channels=channels)
    return Loaded(buf, info.encoding, size)


def _load_resized(
    buf: bytearray | memoryview, label: int, store: str, resize: Resize, max_pixels: int | None
) -> Loaded | Skipped | None:
    """The resized record, a Skipped, or None when the image keeps its bytes."""
    size = len(buf) - _HEAD
    img = _open_checked(buf, max_pixels, header_only=False)
    if isinstance(img, Skipped):
        return img
    with img:
        width, height = img.size
        target = resize.target(width, height)
        if target is None and store == "encoded":
            return None
        try:
            if target is not None and img.format == "JPEG":
                img.draft("RGB", target)  # DCT-scale while decoding, never below the target
            rgb = img.convert("RGB")
            if target is not None and rgb.size != target:
                rgb = rgb.resize(target, Image.Resampling.BILINEAR)
        except Exception as exc:  # truncated or corrupt data
            return Skipped(f"cannot be decoded: {type(exc).__name__}: {exc}")
    width, height = rgb.size
    target_encoding = RAW if store == "raw" else encoding_of(resize.format)
    payload = target_encoding.encode(rgb, resize.quality)
    value = encode_record(payload, label=label, encoding=target_encoding.name, width=width, height=height, channels=3)
    return Loaded(value, target_encoding.name, size)

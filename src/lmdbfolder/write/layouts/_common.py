"""What every layout scanner shares: names read from files checked to stay inside the source,
directory listings, bounded text files, and the picklable reader of a sample's payloads."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import re
import stat
from typing import Sequence

from lmdbfolder.errors import SourceError, SourceNotFoundError, os_hint
from lmdbfolder.format import NO_LABEL
from lmdbfolder.format.fields import encode_json
from lmdbfolder.format.manifest import FieldSpec
from lmdbfolder.pagefile import read_regular
from lmdbfolder.write.fields import FieldSamples, SampleError

__all__ = [
    "MAX_FIELD_FILE_BYTES",
    "MAX_TEXT_FILE_BYTES",
    "unsafe_name",
    "list_files",
    "read_text",
    "require_dir",
    "resolve_name",
    "FileReader",
    "file_samples",
    "check_pair_scale",
    "json_payload",
    "posix",
]

#: A source file larger than this is not packed (a record of several fields stays under 4 GiB).
MAX_FIELD_FILE_BYTES = 1 << 30
#: A split file, CSV or JSON Lines table larger than this is refused before it is read.
MAX_TEXT_FILE_BYTES = 1 << 30


def posix(relpath: str) -> str:
    """``relpath`` with ``/`` separators (the form stored in a pack)."""
    return relpath.replace(os.sep, "/") if os.sep != "/" else relpath


def unsafe_name(name: object) -> str | None:
    """Why ``name`` (a file name read from a split file, a JSON or a CSV) cannot be a path inside
    the source folder, or None when it can: it must be a non-empty relative path without ``..``
    (a hostile annotation file must not make the pack read ``/etc/passwd`` or ``../../secret``)."""
    if not isinstance(name, str):
        return f"the file name is a {type(name).__name__}, not a string"
    if not name or not name.strip():
        return "the file name is empty"
    if "\x00" in name:
        return "the file name holds a NUL character"
    if name.startswith(("/", "\\")) or os.path.isabs(name) or re.match(r"[A-Za-z]:", name):
        return "the file name is an absolute path; only paths inside the source folder are packed"
    parts = name.replace("\\", "/").split("/")
    if ".." in parts:
        return "the file name goes up a folder (..); only paths inside the source folder are packed"
    return None


def resolve_name(root: str, name: str) -> str:
    """The '/'-separated path, relative to ``root``, of a file name read from a JSON or a table
    (checked by ``unsafe_name`` first): the name as it is when such a file exists, else with its
    backslashes read as folder separators (a file written on Windows)."""
    if "\\" in name and not os.path.isfile(os.path.join(root, name)):
        return name.replace("\\", "/")
    return name


def require_dir(path: str, what: str, hint: str) -> None:
    """SourceNotFoundError naming ``path`` (``what`` it should be) unless it is a folder."""
    if not os.path.isdir(path):
        raise SourceNotFoundError(path, f"no {what} here", hint)


def list_files(folder: str) -> dict[str, int]:
    """The regular files directly in ``folder`` (symlinks followed): name -> size, in
    ``os.scandir`` order (the order ``os.listdir`` gives on the same folder)."""
    found: dict[str, int] = {}
    try:
        with os.scandir(folder) as it:
            for entry in it:
                try:
                    st = entry.stat()  # follows symlinks, as os.path.isfile does
                except OSError:
                    continue  # a dangling symlink: not a file
                if stat.S_ISREG(st.st_mode):
                    found[entry.name] = st.st_size
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise SourceError(folder, f"cannot list the folder ({exc.strerror})", os_hint(exc)) from None
    return found


def walk_files(folder: str) -> dict[str, int]:
    """Every regular file under ``folder`` (recursively, symlinks followed as ImageFolder does,
    each folder once): '/'-separated path relative to ``folder`` -> size, sorted by path."""
    found: dict[str, int] = {}
    seen: set[tuple[int, int]] = set()

    def walk(here: str, prefix: str) -> None:
        try:
            st = os.stat(here)
        except OSError:
            return
        if (st.st_dev, st.st_ino) in seen:  # a symlink loop
            return
        seen.add((st.st_dev, st.st_ino))
        try:
            with os.scandir(here) as it:
                entries = list(it)
        except OSError as exc:
            raise SourceError(here, f"cannot list the folder ({exc.strerror})", os_hint(exc)) from None
        for entry in entries:
            try:
                est = entry.stat()
            except OSError:
                continue
            if stat.S_ISDIR(est.st_mode):
                walk(entry.path, prefix + entry.name + "/")
            elif stat.S_ISREG(est.st_mode):
                found[prefix + entry.name] = est.st_size

    if os.path.isdir(folder):
        walk(folder, "")
    return dict(sorted(found.items()))


def read_text(path: str, what: str, limit: int = MAX_TEXT_FILE_BYTES) -> str:
    """The UTF-8 text of the regular file ``path`` (a byte-order mark dropped), at most ``limit``
    bytes; SourceError naming it (``what`` it is) when it cannot be read or is not UTF-8."""
    try:
        data = read_regular(path, limit)
    except FileNotFoundError:
        raise SourceNotFoundError(path, f"no {what} here", "check the path (and the split name)") from None
    except OSError as exc:
        if exc.errno == errno.EFBIG:
            raise SourceError(path, f"the {what} is too large: {exc.strerror}") from None
        raise SourceError(path, f"cannot read the {what} ({exc.strerror or exc})", os_hint(exc)) from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise SourceError(
            path, f"the {what} is not UTF-8 text (byte {exc.start:,})", "save it as UTF-8 and try again"
        ) from None


def json_payload(value: object, where: str) -> bytes | str:
    """The ``json`` field payload of ``value``, or why it cannot be one (too large, not JSON)."""
    try:
        return encode_json(value, where)
    except ValueError as exc:
        return str(exc)


@dataclasses.dataclass
class FileReader:
    """``FieldSamples.read`` of a layout: sample ``i``'s payloads in field order. A field with a
    file (``field_paths[i][k]`` not empty) is that file's bytes (relative to ``root``); the other
    fields are taken from ``values[i]`` in order (encoded JSON). With ``scale``, the first two
    fields are an LQ image and its GT, whose size must be ``scale`` times the LQ's.

    A dataclass, not a closure: it pickles, so reader processes started with spawn get it too."""

    root: str
    field_paths: list[tuple[str, ...]]
    values: list[tuple[bytes, ...]] | None = None
    scale: int | None = None

    def __call__(self, i: int) -> list[bytes]:
        paths = self.field_paths[i]
        files = [p for p in paths if p]
        extra = iter(self.values[i] if self.values is not None else ())
        out: list[bytes] = []
        for rel in paths:
            if not rel:
                out.append(next(extra))
                continue
            full = os.path.join(self.root, rel)
            try:
                out.append(read_regular(full, MAX_FIELD_FILE_BYTES))
            except OSError as exc:
                if exc.errno == errno.EFBIG:
                    raise SampleError(f"{rel} is too large to pack: {exc.strerror}", files) from None
                raise SampleError(f"cannot read {rel} ({exc.strerror or exc})", files) from None
        if self.scale is not None:
            check_pair_scale(out[0], out[1], self.scale, files)
        return out

    def stamp(self, i: int) -> tuple[int, int]:
        """``FieldSamples.stamp``: sample ``i``'s bytes, and a digest of each field's file (its path,
        size and modification time) or value; OSError when a file cannot be ``stat``-ed."""
        h = hashlib.blake2b(digest_size=8)
        size = 0
        extra = iter(self.values[i] if self.values is not None else ())
        for rel in self.field_paths[i]:
            if rel:
                st = os.stat(os.path.join(self.root, rel))
                size += st.st_size
                h.update(b"f%d %d %s\0" % (st.st_size, st.st_mtime_ns, os.fsencode(rel)))
            else:
                value = next(extra)
                size += len(value)
                h.update(b"v%d\0" % len(value))
                h.update(value)
        # Non-negative: never UNKNOWN_MTIME (-1), which an update reads as "not recorded".
        return size, int.from_bytes(h.digest(), "little") >> 1


def check_pair_scale(lq: bytes, gt: bytes, scale: int, paths: Sequence[str]) -> None:
    """SampleError unless the GT image is exactly ``scale`` times the LQ image in both dimensions
    (BasicSR's ``paired_random_crop`` refuses other pairs at training time: here they are listed)."""
    import io

    from PIL import Image, UnidentifiedImageError

    sizes = []
    for data, rel in zip((lq, gt), paths):
        try:
            with Image.open(io.BytesIO(data)) as im:
                sizes.append(im.size)
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
            raise SampleError(f"{rel} is not an image Pillow can open ({exc})", paths) from None
    (lw, lh), (gw, gh) = sizes
    if (gw, gh) != (lw * scale, lh * scale):
        raise SampleError(
            f"the GT is {gw}x{gh} but the LQ is {lw}x{lh}: at scale {scale} the GT must be "
            f"{lw * scale}x{lh * scale} (crop or resize one of them, or pass the right --scale)",
            paths,
        )


def file_samples(
    layout: str,
    root: str,
    fields: tuple[FieldSpec, ...],
    field_paths: list[tuple[str, ...]],
    skipped: list[tuple[str, str]],
    info: dict[str, object],
    total: int,
    values: list[tuple[bytes, ...]] | None = None,
    scale: int | None = None,
) -> FieldSamples:
    """The ``FieldSamples`` of a layout's listing: unlabelled samples whose fields are files
    under ``root`` (``field_paths``) and ``values``, read by a ``FileReader`` (which also
    stamps them for ``pack --update``); ``total``: the bytes listed (sizes the map)."""
    root = os.path.abspath(root)
    reader = FileReader(root, field_paths, values, scale)
    return FieldSamples(
        layout=layout,
        root=root,
        fields=fields,
        relpaths=[p[0] for p in field_paths],
        field_paths=field_paths,
        labels=[NO_LABEL] * len(field_paths),
        classes=[],
        read=reader,
        stamp=reader.stamp,
        skipped=skipped,
        layout_info=info,
        mean_size=total / len(field_paths) if field_paths else 0.0,
    )

"""The pack directory on disk: what a path holds, what may be replaced, and publishing.

This module is the one owner of three questions that every command asks:

* **What is this path?** ``inspect`` answers with a ``Kind``: a pack, a
  sharded pack, an unfinished pack (``DST.partial``), an unfinished sharded
  pack (shards but no ``index.json``), a file, some other directory, or
  nothing. ``require_pack`` turns the answer into the path of a finished pack
  or a ``NotAPackError`` whose hint fits what was found.
* **May this directory be replaced?** ``why_not_replaceable`` says no unless
  the directory is provably ours: a pack (its ``data.mdb`` holds an
  lmdbfolder manifest or checkpoint, and nothing else lmdbfolder does not
  write sits beside it), a sharded pack made only of such shards, or a
  temporary directory we created (it holds ``TEMP_MARKER``). A symbolic link
  is never followed: a mistyped DST must not delete what it points to.
* **How does a finished directory become visible?** ``publish``: flushed to
  disk, then renamed into place in one step (an existing pack is moved aside
  first and removed only after the new one is in place).

Every name it reasons about comes from ``lmdbfolder.format``.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import json
import os
import re
import shlex
import shutil
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import lmdb

from lmdbfolder import packfile
from lmdbfolder.errors import (
    CorruptRecordError,
    NotAPackError,
    OutputExistsError,
    PackError,
    PackNotFoundError,
    os_hint,
)
from lmdbfolder.format import (
    COMPACT_DIR,
    COPYING_SUFFIX,
    DATA_FILE,
    FORMAT_NAME,
    KEY,
    LOCK_FILE,
    MAX_INDEX_FILE_BYTES,
    META_KEY,
    OLD_SUFFIX,
    PARTIAL_SUFFIX,
    PARTS_SUFFIX,
    PROGRESS_KEY,
    RETAINED_FILE,
    SHARD_INDEX_FILE,
    SHARD_INDEX_TMP,
    SKIPPED_REPORT,
    SYNC_PROBE,
    TEMP_MARKER,
    UPDATE_SUFFIX,
    WRITER_LOCK_SUFFIX,
    Manifest,
    ShardIndex,
    decode_meta,
    decode_record,
    loads_json,
    parse_shard_name,
)
from lmdbfolder.pagefile import PageDamage, PageFile, read_regular

__all__ = [
    "Kind",
    "Found",
    "inspect",
    "require_pack",
    "load_index",
    "data_files",
    "pack_size",
    "dir_size",
    "shard_entries",
    "missing_shards",
    "overlap",
    "why_not_replaceable",
    "check_replaceable",
    "not_ours",
    "check_own_files",
    "remove",
    "make_temp_dir",
    "clear_temp_dir",
    "publish",
    "copy_single",
    "write_atomically",
    "fsync_path",
]


class Kind(enum.Enum):
    """What a path holds, as far as lmdbfolder is concerned."""

    MISSING = "nothing"
    PACK = "a pack"
    SHARDED = "a sharded pack"
    UNFINISHED = "an unfinished pack"
    UNFINISHED_SHARDED = "an unfinished sharded pack"
    FILE = "a file"
    OTHER = "a directory that is not a pack"


@dataclass(frozen=True)
class Found:
    """The answer of ``inspect``: the absolute ``path`` (the pack directory when a
    ``data.mdb`` or ``index.json`` inside it was named) and its ``kind``."""

    path: str
    kind: Kind

    @property
    def is_pack(self) -> bool:
        """A finished pack, single or sharded."""
        return self.kind in (Kind.PACK, Kind.SHARDED)


#: Files lmdbfolder writes into a single pack (or leaves in an unfinished one, or in a
#: shard being downloaded: ``data.mdb.parts``, the download's journal).
_PACK_FILES = frozenset(
    {
        DATA_FILE,
        LOCK_FILE,
        SKIPPED_REPORT,
        SYNC_PROBE,
        COMPACT_DIR,
        TEMP_MARKER,
        DATA_FILE + PARTS_SUFFIX,
        RETAINED_FILE,
    }
)
#: Suffixes of directories on their way: being packed, copied in, updated (the
#: files an update reads), or replaced.
_TRANSIENT = re.compile(
    r"("
    + "|".join(re.escape(suffix) for suffix in (PARTIAL_SUFFIX, COPYING_SUFFIX, UPDATE_SUFFIX))
    + "|"
    + re.escape(OLD_SUFFIX)
    + r"[0-9]+)$"
)


def _absolute(path: str | os.PathLike[str]) -> str:
    return os.path.abspath(os.path.expanduser(os.fspath(path)))


def inspect(path: str | os.PathLike[str]) -> Found:
    """Say what ``path`` is (``Kind``) without opening any database.

    ``path`` may also name the ``data.mdb`` or ``index.json`` of a pack. A
    missing path whose ``<path>.partial`` exists is an unfinished pack.
    """
    p = _absolute(path)
    base = os.path.basename(p)
    if base in (DATA_FILE, SHARD_INDEX_FILE) and os.path.isfile(p):
        p = os.path.dirname(p)
    if not os.path.exists(p):
        partial = p + PARTIAL_SUFFIX
        return Found(p, Kind.UNFINISHED if os.path.isdir(partial) else Kind.MISSING)
    if not os.path.isdir(p):
        return Found(p, Kind.FILE)
    if p.endswith(PARTIAL_SUFFIX):
        return Found(p, Kind.UNFINISHED)
    try:
        names = os.listdir(p)
    except OSError:
        return Found(p, Kind.OTHER)
    if DATA_FILE in names:
        return Found(p, Kind.PACK)
    if SHARD_INDEX_FILE in names:
        return Found(p, Kind.SHARDED)
    if shard_entries(p):
        return Found(p, Kind.UNFINISHED_SHARDED)
    return Found(p, Kind.OTHER)


def require_pack(path: str | os.PathLike[str]) -> Found:
    """The finished pack (single or sharded) at ``path``, or NotAPackError saying what is there instead."""
    found = inspect(path)
    if found.is_pack:
        return found
    p = found.path
    if found.kind is Kind.MISSING:
        # Also a FileNotFoundError: what ImageFolder raises for a root it cannot use.
        raise PackNotFoundError(
            p, "no such file or directory", "check the path (it should be the DST of `lmdbfolder pack`)"
        )
    if found.kind is Kind.FILE:
        raise NotAPackError(p, f"it is a file, expected a pack directory holding {DATA_FILE}")
    if found.kind is Kind.UNFINISHED:
        raise NotAPackError(
            p,
            "it is an unfinished pack (the writer stopped before the end)",
            "run the same `lmdbfolder pack` command again to finish it",
        )
    if found.kind is Kind.UNFINISHED_SHARDED:
        entries = shard_entries(p)
        unfinished = sorted(n for n, (_, _, _, done) in entries.items() if not done)
        totals = {total for _, _, total, _ in entries.values()}
        finished = sum(1 for _, _, _, done in entries.values() if done)
        if unfinished or len(totals) != 1 or finished < max(totals):
            hint = (
                "rerun the same `lmdbfolder pack ... --shards N` command to finish the missing or unfinished shards"
                + (f" ({', '.join(unfinished[:3])}{', ...' if len(unfinished) > 3 else ''})" if unfinished else "")
            )
        else:
            hint = f"every shard is finished: run `lmdbfolder index {p}` to write the index"
        raise NotAPackError(p, f"it holds shards but no {SHARD_INDEX_FILE} (an unfinished sharded pack)", hint)
    try:
        os.listdir(p)
    except OSError as exc:  # not "holds no data.mdb": it may well hold one
        raise NotAPackError(p, f"cannot list the directory ({exc.strerror})", os_hint(exc)) from None
    raise PackNotFoundError(p, f"the directory holds no {DATA_FILE} and no {SHARD_INDEX_FILE}", _hint_for_directory(p))


def _hint_for_directory(path: str) -> str | None:
    # An image folder given where a pack is expected is the most likely mistake.
    image_ext = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
    command = f"lmdbfolder pack {shlex.quote(path)} {shlex.quote(path.rstrip(os.sep) + '.lmdb')}"
    try:
        with os.scandir(path) as entries:
            for n, entry in enumerate(entries):
                if n > 200:
                    break
                if entry.is_file() and entry.name.lower().endswith(image_ext):
                    return f"this is a folder of images, not a pack: pack it first with `{command} --flat`"
                if entry.is_dir():
                    with os.scandir(entry.path) as inner:
                        if any(e.name.lower().endswith(image_ext) for _, e in zip(range(50), inner)):
                            return (
                                "this is an image folder (class folders of images), not a pack: "
                                f"pack it first with `{command}` and pass the pack"
                            )
    except OSError:
        return None
    return None


def load_index(path: str | os.PathLike[str]) -> tuple[str, ShardIndex]:
    """(pack directory, parsed ``index.json``) of a sharded pack; NotAPackError naming what is wrong."""
    p = _absolute(path)
    if os.path.basename(p) == SHARD_INDEX_FILE:
        p = os.path.dirname(p)
    index_file = os.path.join(p, SHARD_INDEX_FILE)
    try:
        # Only a regular file (a FIFO would block), and not beyond what ShardIndex.from_json accepts.
        blob = read_regular(index_file, MAX_INDEX_FILE_BYTES)
    except OSError as exc:
        raise NotAPackError(p, f"cannot read {SHARD_INDEX_FILE} ({exc.strerror})", os_hint(exc)) from None
    return p, ShardIndex.from_json(blob, where=index_file)


def data_files(path: str | os.PathLike[str]) -> list[str]:
    """The ``data.mdb`` of a pack, or of every shard of a sharded pack, in order."""
    found = require_pack(path)
    if found.kind is Kind.PACK:
        return [os.path.join(found.path, DATA_FILE)]
    root, index = load_index(found.path)
    return [os.path.join(root, name, DATA_FILE) for name in index.names]


def pack_size(path: str | os.PathLike[str]) -> int:
    """Bytes on disk of a pack (its files), or of a sharded pack (index and every shard)."""
    found = require_pack(path)
    if found.kind is Kind.PACK:
        return dir_size(found.path)
    root, index = load_index(found.path)
    size = os.path.getsize(os.path.join(root, SHARD_INDEX_FILE))
    return size + sum(dir_size(os.path.join(root, name)) for name in index.names)


def dir_size(path: str) -> int:
    """Bytes of the regular files directly in ``path`` (a pack: data.mdb and friends)."""
    total = 0
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    return total


def shard_entries(path: str) -> dict[str, tuple[str, int, int, bool]]:
    """Entries of ``path`` that are shard directories: name -> (prefix, index, num_shards, finished).

    A name with a transient suffix (``.partial``, ``.copying``, ``.old-N``) is
    an unfinished shard.
    """
    found = {}
    try:
        names = os.listdir(path)
    except OSError:
        return {}
    for name in names:
        base = _TRANSIENT.sub("", name)
        parsed = parse_shard_name(base)
        full = os.path.join(path, name)
        if parsed is not None and os.path.isdir(full) and not os.path.islink(full):
            found[name] = (*parsed, base == name)
    return found


def overlap(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether ``a`` and ``b`` are the same directory or one lies inside the other (links resolved)."""
    ra, rb = os.path.realpath(_absolute(a)), os.path.realpath(_absolute(b))
    return ra == rb or ra.startswith(rb + os.sep) or rb.startswith(ra + os.sep)


# -- may it be replaced? ------------------------------------------------------------
def why_not_replaceable(path: str | os.PathLike[str]) -> str | None:
    """None if ``path`` is provably ours to delete, else what was found there.

    Ours: an empty directory; a pack or unfinished pack (only files lmdbfolder
    writes, and a ``data.mdb`` holding an lmdbfolder manifest or checkpoint,
    or nothing at all); a sharded pack (only shards that are ours, and the
    index); a temporary directory holding ``TEMP_MARKER``. Never a symbolic
    link, never a file.
    """
    p = _absolute(path)
    if os.path.islink(p):
        return f"it is a symbolic link (to {os.readlink(p)}), and lmdbfolder never replaces through a link"
    if not os.path.exists(p):
        return None
    if not os.path.isdir(p):
        return "it is a file, not a pack directory"
    names = set(os.listdir(p))
    if not names:
        return None
    # Nothing lmdbfolder writes is a link, a FIFO or a device: a directory holding one
    # was planted, and writing into it would follow or block on what was planted.
    odd = [f"{name} ({what})" for name in sorted(names) if (what := not_ours(os.path.join(p, name), dirs=True))]
    if odd:
        return f"it holds {', '.join(odd[:3])}{' ...' if len(odd) > 3 else ''}, which lmdbfolder never makes"
    shards = shard_entries(p)
    names -= _writer_locks(p, names)
    if TEMP_MARKER in names:
        # A temporary directory we made (a copy being built): whatever it
        # holds was written by us, as long as it holds only what we write.
        foreign = sorted(names - _PACK_FILES - set(shards) - {SHARD_INDEX_FILE, SHARD_INDEX_TMP})
        return f"it holds {_listing(p, foreign)}, which lmdbfolder does not write" if foreign else None
    if DATA_FILE in names:
        return _single_problem(p, names)
    if shards or SHARD_INDEX_FILE in names:
        foreign = sorted(names - set(shards) - {SHARD_INDEX_FILE, SHARD_INDEX_TMP, TEMP_MARKER})
        if foreign:
            return f"it holds {_listing(p, foreign)} besides the shards, which lmdbfolder does not write"
        for name in sorted(shards):
            why = why_not_replaceable(os.path.join(p, name))
            if why is not None:
                return f"its shard {name} is not provably a pack: {why}"
        return None
    return f"it holds {_listing(p, sorted(names))} and no {DATA_FILE}"


def _writer_locks(path: str, names: set[str]) -> set[str]:
    """The writer lock files (``<shard>.lock``, see format.WRITER_LOCK_SUFFIX) among ``names``: ours."""
    found = set()
    for name in names:
        if name.endswith(WRITER_LOCK_SUFFIX) and parse_shard_name(name[: -len(WRITER_LOCK_SUFFIX)]) is not None:
            full = os.path.join(path, name)
            if os.path.isfile(full) and not os.path.islink(full):
                found.add(name)
    return found


def _single_problem(path: str, names: set[str]) -> str | None:
    foreign = sorted(names - _PACK_FILES)
    if foreign:
        return f"it holds {_listing(path, foreign)} besides {DATA_FILE}, which lmdbfolder does not write"
    data = os.path.join(path, DATA_FILE)
    if os.path.islink(data) or not os.path.isfile(data):
        return f"its {DATA_FILE} is not a regular file"
    try:
        pf = packfile.open_data(path, readahead=False)
    except NotAPackError as exc:
        return f"its {DATA_FILE} cannot be opened ({exc.message})"
    try:
        meta = packfile.read_value(pf, META_KEY, path)
        progress = packfile.read_value(pf, PROGRESS_KEY, path)
        ours_meta = meta is not None and _json_field(meta, "format") == FORMAT_NAME
        ours_progress = progress is not None and _json_field(progress, "fingerprint") is not None
        empty = pf.entries == 0
    except NotAPackError as exc:
        return f"its {DATA_FILE} cannot be read ({exc.message})"
    finally:
        pf.close()
    if ours_meta or ours_progress:
        return None
    if empty:
        return None
    return f"its {DATA_FILE} is an LMDB that lmdbfolder did not write (no lmdbfolder manifest or checkpoint)"


#: A manifest or checkpoint longer than this is not looked into (not provably ours).
_PEEK = 64 << 20


def _json_field(blob: bytes | memoryview, name: str) -> Any:
    try:
        obj = loads_json(blob, where="", what="", max_bytes=_PEEK)
    except NotAPackError:
        return None
    return obj.get(name) if isinstance(obj, dict) else None


def _listing(root: str, names: list[str], shown: int = 5) -> str:
    shown_names = [n + ("/" if os.path.isdir(os.path.join(root, n)) else "") for n in names[:shown]]
    return ", ".join(shown_names) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def not_ours(path: str, *, dirs: bool = False) -> str | None:
    """What ``path`` is when it is not something lmdbfolder makes there (None: missing, a
    regular file, or with ``dirs`` a real directory): "a symbolic link (to ...)", "a FIFO",
    ... Never follows a link nor opens the path (a FIFO's open would wait)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    mode = st.st_mode
    if stat.S_ISREG(mode) or (dirs and stat.S_ISDIR(mode)):
        return None
    if stat.S_ISLNK(mode):
        try:
            return f"a symbolic link to {os.readlink(path)}"
        except OSError:
            return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"


def check_own_files(folder: str, names: Iterable[str], *, doing: str, folders: Iterable[str] = ()) -> None:
    """OutputExistsError unless ``folder`` is a directory (not a link) whose entries ``names``
    are regular files or missing (and ``folders``, real directories or missing): what an
    update writes or opens there is then what lmdbfolder made, never a link or a FIFO
    someone planted (``doing``: what would have used it, for the message)."""
    what = not_ours(folder, dirs=True)
    if what is None and os.path.lexists(folder) and not os.path.isdir(folder):
        what = "a file"
    if what is not None:
        raise OutputExistsError(
            folder,
            f"is {what}, not a folder lmdbfolder made; {doing} never writes through it",
            f"remove {folder} (or pass the folder it stands for), then run the same command again",
        )
    for name, is_dir in [*((n, False) for n in names), *((n, True) for n in folders)]:
        path = os.path.join(folder, name)
        what = not_ours(path, dirs=is_dir)
        if what is not None:
            raise OutputExistsError(
                path,
                f"is {what}, not a file lmdbfolder wrote; {doing} never follows or opens it",
                f"remove {path} (lmdbfolder makes it again when it needs it), then run the same command again",
            )


def check_replaceable(path: str | os.PathLike[str], *, hint: str | None = None) -> None:
    """Raise OutputExistsError unless ``path`` is provably ours (see ``why_not_replaceable``)."""
    why = why_not_replaceable(path)
    if why is not None:
        raise OutputExistsError(
            _absolute(path),
            f"exists and is not provably an lmdbfolder pack ({why}); refusing to replace it",
            hint or "remove it yourself, or choose another output path",
        )


def remove(path: str | os.PathLike[str]) -> None:
    """Delete ``path`` after ``check_replaceable``; a missing path is fine."""
    check_replaceable(path)
    p = _absolute(path)
    if os.path.isdir(p):
        shutil.rmtree(p)


def make_temp_dir(path: str) -> None:
    """Create the temporary directory ``path`` (it must not exist) and mark it as ours."""
    os.mkdir(path)
    with open(os.path.join(path, TEMP_MARKER), "w", encoding="ascii") as f:
        f.write(json.dumps({"made_by": FORMAT_NAME, "pid": os.getpid()}) + "\n")


def clear_temp_dir(path: str) -> None:
    """Remove a temporary directory left by an interrupted run, if it is provably ours."""
    if not os.path.lexists(path):
        return
    check_replaceable(path, hint="it was not left by lmdbfolder: remove it yourself, or choose another output path")
    remove(path)


#: Bytes of ``lock.mdb`` reserved on disk before LMDB maps it: LMDB sizes it for its
#: readers (8 KB for py-lmdb's default 126) and writes it through a shared map, so on a disk without those bytes
#: the first write into the map was a SIGBUS, not an error. Reserved first, a full
#: disk is ENOSPC from ``posix_fallocate``.
LOCK_RESERVE = 16 << 10


def reserve_lock_file(folder: str) -> None:
    """Make ``folder/lock.mdb`` at least ``LOCK_RESERVE`` bytes, allocated on disk (not
    sparse), before ``lmdb.open`` maps it; OSError (ENOSPC, ...) when the disk cannot."""
    # Never through a link, never waiting on a FIFO (ELOOP, or a FIFO's ENXIO/EINVAL below).
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(os.path.join(folder, LOCK_FILE), flags | getattr(os, "O_NONBLOCK", 0), 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "it is not a regular file", os.path.join(folder, LOCK_FILE))
    try:
        if hasattr(os, "posix_fallocate"):
            try:
                os.posix_fallocate(fd, 0, LOCK_RESERVE)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system that cannot: LMDB's way
                    raise
    finally:
        os.close(fd)


# -- publishing ------------------------------------------------------------------
def fsync_path(path: str) -> None:
    """fsync a file or a directory (a directory's fsync makes renames in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: str, dst: str) -> None:
    """Make the finished directory ``tmp`` visible as ``dst``, replacing a pack of ours there.

    ``tmp`` is flushed to disk first. An existing ``dst`` (checked again here:
    it must be provably ours) is moved aside and removed only after the new
    one is in place, so ``dst`` names either the old or the new complete
    directory at every moment but the instant between the two renames.
    """
    marker = os.path.join(tmp, TEMP_MARKER)
    if os.path.exists(marker):
        os.remove(marker)
    fsync_path(tmp)
    old = None
    if os.path.lexists(dst):
        check_replaceable(dst)
        old = f"{dst}{OLD_SUFFIX}{os.getpid()}"
        os.rename(dst, old)
    try:
        os.rename(tmp, dst)
    except BaseException:
        if old is not None:
            os.rename(old, dst)
        raise
    fsync_path(os.path.dirname(os.path.abspath(dst)))
    if old is not None:
        shutil.rmtree(old)


def copy_single(src: str, out: str) -> tuple[int, int, int]:
    """Copy the finished single pack ``src`` into the directory ``out`` (created if
    missing), compacted, and check that the copy holds the same manifest and
    tables. Returns (count, bytes of the source's data.mdb, bytes of the copy's).

    Every key and value is read through ``PageFile`` (every page checked: a
    damaged source is a PackError naming the damage, never a crash of the
    process, which LMDB's own copy of a damaged file can be), every record's
    CRC-32 is checked (so damage is never copied on silently), and they are
    appended in key order to a fresh LMDB: no free pages, pages in tree
    order, as LMDB's compacting copy would give.
    """
    tables = packfile.read_tables(src)  # also checks that data.mdb is whole, and __check__
    meta = decode_meta(tables[0], where=src)
    count = meta.count
    os.makedirs(out, exist_ok=True)
    _read_checked(src, meta, lambda pf, rules: _copy_items(pf, src, out, rules))
    report = os.path.join(src, SKIPPED_REPORT)
    if os.path.isfile(report):
        shutil.copy2(report, os.path.join(out, SKIPPED_REPORT))
    lock = os.path.join(out, LOCK_FILE)
    if os.path.exists(lock):
        os.remove(lock)
    fsync_path(os.path.join(out, DATA_FILE))
    if packfile.read_tables(out) != tables:
        raise PackError(f"the copy of {src} in {out} differs from it", "run `lmdbfolder verify` on the source")
    return count, os.path.getsize(os.path.join(src, DATA_FILE)), os.path.getsize(os.path.join(out, DATA_FILE))


def check_single(src: str) -> int:
    """Read every page and record of the finished single pack ``src`` as
    ``copy_single`` does (a damaged pack is the same PackError), writing
    nothing; for copies that send the file as it is (an upload), so damage is
    never sent on with a digest that vouches for it. Returns the count."""
    meta = decode_meta(packfile.read_tables(src)[0], where=src)

    def walk(pf: PageFile, rules: _RecordRules) -> None:
        for key, value in pf.items():
            _check_item(key, value, rules)

    _read_checked(src, meta, walk)
    return meta.count


@dataclasses.dataclass(frozen=True)
class _RecordRules:
    """What every record of a pack is checked against while it is copied: the CRC's binding,
    and (format 4) the number of fields each record holds."""

    binding: bytes | None
    fields: int | None


def _read_checked(src: str, meta: Manifest, body: Callable[[PageFile, _RecordRules], None]) -> None:
    """``body(pf, rules)`` over the checked reader of ``src``; damage is a PackError."""
    pf = packfile.open_data(src, readahead=True)
    specs = meta.field_specs
    try:
        try:
            body(pf, _RecordRules(meta.binding, len(specs) if specs is not None else None))
        finally:
            # Two `pack --update` commits during the copy may have reused pages it read.
            if pf.committed_txnid() > pf.txnid + 1:
                raise PackError(f"{src} was updated while it was copied", "copy it again when no update runs")
    except CorruptRecordError as exc:
        raise PackError(
            f"{src} is damaged, so it cannot be copied: record {exc.index} is corrupt ({exc.why})",
            "run `lmdbfolder verify` on it to see what is damaged; copy it from a good copy, or repack it",
        ) from None
    except PageDamage as exc:
        raise PackError(
            f"{src} is damaged, so it cannot be copied: {exc.why}",
            "run `lmdbfolder verify` on it to see what is damaged; copy it from a good copy, or repack it",
        ) from None
    finally:
        pf.close()


def _check_item(key: bytes, value: memoryview, rules: _RecordRules) -> None:
    if key[:1] == b"\x00" and len(key) == KEY.size:
        decode_record(value, index=KEY.unpack(key)[0], verify=True, binding=rules.binding, fields=rules.fields)


#: Bytes appended per write transaction by ``copy_single``.
_COPY_BATCH = 64 << 20


def _copy_items(pf: PageFile, src: str, out: str, rules: _RecordRules) -> None:
    """Append every key and value of ``pf`` in key order to a new LMDB in ``out``,
    each record checked (CorruptRecordError) as a reader would check it."""
    map_size = pf.size + pf.size // 4 + (64 << 20)
    try:
        reserve_lock_file(out)  # a full disk: ENOSPC here, not SIGBUS inside lmdb.open
        env = lmdb.open(
            os.fsencode(out), map_size=map_size, subdir=True, readahead=False, meminit=False, sync=False, max_dbs=0
        )
    except lmdb.Error as exc:
        raise PackError(f"cannot create the copy of {src} in {out}: {exc}", "check the destination") from None
    try:
        batch: list[tuple[bytes, memoryview]] = []
        size = 0
        for key, value in pf.items():
            _check_item(key, value, rules)
            batch.append((key, value))
            size += len(value)
            if size >= _COPY_BATCH:
                _append(env, batch, src, out)
                batch, size = [], 0
        _append(env, batch, src, out)
        env.sync(True)
    except lmdb.Error as exc:
        raise PackError(
            f"LMDB could not write the copy of {src} in {out}: {exc}", "check the free space at the destination"
        ) from exc
    finally:
        env.close()


def _append(env: lmdb.Environment, batch: list[tuple[bytes, memoryview]], src: str, out: str) -> None:
    while batch:
        txn = env.begin(write=True)
        try:
            with txn.cursor() as cursor:
                _consumed, added = cursor.putmulti(batch, append=True)
            if added != len(batch):
                raise PackError(f"{src} holds keys out of order or twice; it cannot be copied", "repack it")
            txn.commit()
            return
        except lmdb.MapFullError:
            txn.abort()
            env.set_mapsize(env.info()["map_size"] * 2)
        except BaseException:
            txn.abort()
            raise


def write_atomically(directory: str, name: str, data: bytes | Iterable[bytes], tmp_name: str) -> None:
    """Write ``directory/name`` through ``directory/tmp_name`` and a rename, durably.
    ``data``: the bytes, or pieces of them written in turn (never all in memory at once)."""
    tmp = os.path.join(directory, tmp_name)
    if os.path.lexists(tmp):
        os.remove(tmp)  # a killed run's (a link planted there is removed, never followed)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with open(fd, "wb") as f:
        for piece in (data,) if isinstance(data, bytes) else data:
            f.write(piece)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, name))
    fsync_path(directory)


def missing_shards(path: str, missing: list[str], total: int) -> NotAPackError:
    """The error for a sharded pack at ``path`` whose shard folders ``missing`` (of
    ``total``) are not there: it names them (the first ten) and says what to do."""
    return NotAPackError(
        path,
        f"{len(missing)} of {total} shards {'is' if len(missing) == 1 else 'are'} missing: "
        f"{', '.join(missing[:10])}" + (" ..." if len(missing) > 10 else ""),
        "copy the missing shard directories next to index.json (or repack them with "
        "`lmdbfolder pack ... --shard-index I`)",
    )

"""The output directory of a pack: from a checked path to the published pack.

``check_outside_source`` refuses a pack inside its own source;
``_prepare_output`` makes ``<dst>.partial`` (new, or kept to resume) and
refuses to replace anything that is not provably a pack; ``_check_free_space``
refuses to start on a disk too small for the plan (``sizing.Plan``); when the
last transaction has committed, ``_compact_if_needed`` drops free pages,
``_write_skipped_report`` writes ``skipped.txt`` and ``_publish`` flushes the
pack and renames it to ``<dst>`` in one step.

Names with a leading underscore are shared by the write modules only.
"""

from __future__ import annotations

import os
import shutil

import lmdb

from lmdbfolder import packdir
from lmdbfolder.errors import OptionError, OutputExistsError, PackError
from lmdbfolder.format import COMPACT_DIR, DATA_FILE, LOCK_FILE, PARTIAL_SUFFIX, SKIPPED_REPORT, UPDATE_SUFFIX
from lmdbfolder.text import disk_size, escape_field, plural
from lmdbfolder.write import sizing
from lmdbfolder.write.sources import SourceList

__all__ = ["check_outside_source"]

#: Free pages (a fraction of the file) from which a finished pack is compacted.
_COMPACT_FREE_FRACTION = 0.01


def check_outside_source(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Refuse (OptionError) a pack directory ``dst`` inside the source folder ``src``, or around it.

    A pack written into its own source becomes part of it (``DST.partial``
    while it is written, then ``DST``): the next scan would see it, and an
    ImageFolder tree would gain a class folder without images. For a list
    file, ``src`` is the folder its paths start from.
    """
    root = os.path.abspath(os.path.expanduser(os.fspath(src)))
    out = os.path.abspath(os.path.expanduser(os.fspath(dst)))
    if not os.path.isdir(root):
        return  # the scan reports a missing source
    for path in (out, out + PARTIAL_SUFFIX, out + UPDATE_SUFFIX):
        if packdir.overlap(path, root):
            inside = os.path.realpath(path) != os.path.realpath(root) and os.path.realpath(root).startswith(
                os.path.realpath(path) + os.sep
            )
            if os.path.realpath(path) == os.path.realpath(root):
                where = "it is the source folder"
            elif inside:
                where = f"the source folder {root} is inside it"
            else:
                where = f"it is inside the source folder {root}"
            suggestion = os.path.join(os.path.dirname(root.rstrip(os.sep)) or os.sep, os.path.basename(out))
            raise OptionError(
                f"cannot pack into {path}: {where}, so the pack would become part of the source it packs",
                f"choose an output path outside {root}"
                + (f", for example {suggestion}" if not packdir.overlap(suggestion, root) else ""),
            )


def _prepare_output(dst: str, *, overwrite: bool, restart: bool) -> str:
    """Check the output path; return ``<dst>.partial`` (existing, to resume, or new).

    Whether ``dst`` and ``<dst>.partial`` may be replaced is ``packdir``'s
    call: only a directory that is provably an lmdbfolder pack (or our own
    unfinished one) ever is.
    """
    if os.path.islink(dst):
        raise _linked_output(dst)
    if os.path.lexists(dst):
        if not overwrite:
            raise OutputExistsError(dst)
        packdir.check_replaceable(dst)
    partial = dst + PARTIAL_SUFFIX
    if os.path.lexists(partial) and (overwrite or restart):
        packdir.remove(partial)
    if os.path.islink(partial):
        raise OutputExistsError(partial, "is a symbolic link", "remove it or choose another output path")
    if not os.path.lexists(partial):
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.mkdir(partial)
    elif not os.path.isdir(partial):
        raise OutputExistsError(
            partial, "is in the way (it is not a directory)", "remove it or choose another output path"
        )
    return partial


def _linked_output(dst: str) -> OutputExistsError:
    """The refusal of a ``dst`` that is a symbolic link (with or without --overwrite or
    --update: a pack is never written, updated or replaced through a link), saying what works."""
    target = os.readlink(dst)
    real = os.path.realpath(dst)
    hint = (
        f"pass the folder it points to, {real}, as DST (the same command then writes, updates or "
        "replaces the pack there), or remove the link"
        if os.path.isdir(real)
        else "remove the link (what it points to does not exist), or choose another output path"
    )
    return OutputExistsError(
        dst,
        f"is a symbolic link (to {target}); lmdbfolder never writes, updates or replaces a pack through a link",
        hint,
    )


def _check_free_space(partial: str, plan: sizing.Plan, done: int) -> None:
    """Refuse to start when the disk holding ``partial`` has less room than what is
    left to write once ``done`` sources are (the upper bound of ``plan.remaining``)."""
    free = shutil.disk_usage(partial).free
    need = plan.remaining(done).upper + (1 << 20)  # and skipped.txt, the sync probe, lock.mdb
    if need > free:
        raise PackError(
            f"the pack needs about {disk_size(need)} but only {disk_size(free)} are free on the disk holding {partial}",
            "free some space or pack to another disk (pass --no-space-check to try anyway)",
        )


def _free_fraction(env: lmdb.Environment) -> float:
    stat = env.stat()
    used = stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"] + 2  # 2 meta pages
    total = env.info()["last_pgno"] + 1
    return max(0.0, (total - used) / total)


def _compact_if_needed(partial: str, *, force: bool = False, free_fraction: float | None = None) -> bool:
    """Rewrite data.mdb without free pages (LMDB's consistent copy with
    compaction) when they are at least ``free_fraction`` of it (default 1%), or when
    ``force``. The copy replaces the file by a rename: a process that has the
    old file mapped keeps reading it (``pack --update`` compacts a published
    pack this way)."""
    env = lmdb.open(os.fsencode(partial), readonly=True, lock=False, subdir=True)
    try:
        limit = _COMPACT_FREE_FRACTION if free_fraction is None else free_fraction
        if not force and _free_fraction(env) < limit:
            return False
        tmp = os.path.join(partial, COMPACT_DIR)
        shutil.rmtree(tmp, ignore_errors=True)
        os.mkdir(tmp)
        try:
            # bytes (py-lmdb takes them; its stubs say str): a str is encoded as UTF-8.
            env.copy(os.fsencode(tmp), compact=True)  # type: ignore[arg-type]
        except lmdb.Error:
            # No room for the compacted copy (it needs as much space as the
            # pack): publish the pack as it is; it is complete, just not dense.
            shutil.rmtree(tmp, ignore_errors=True)
            return False
    finally:
        env.close()
    packdir.fsync_path(os.path.join(tmp, DATA_FILE))
    os.replace(os.path.join(tmp, DATA_FILE), os.path.join(partial, DATA_FILE))
    os.rmdir(tmp)
    return True


def _write_skipped_report(partial: str, sources: SourceList, skipped: list[tuple[int, str]]) -> None:
    path = os.path.join(partial, SKIPPED_REPORT)
    if not skipped:
        if os.path.exists(path):
            os.remove(path)
        return
    with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write(
            f"# {plural(len(skipped), 'source file')} not packed (path<TAB>reason), relative to {sources.root}\n"
            "# a backslash, tab, newline or carriage return in a path or reason is written as \\\\, \\t, \\n, \\r\n"
        )
        for s, reason in skipped:
            f.write(f"{escape_field(sources.relpaths[s])}\t{escape_field(reason)}\n")


def _publish(partial: str, dst: str) -> None:
    """Make the finished pack visible at ``dst`` in one rename, after it is on disk."""
    lock = os.path.join(partial, LOCK_FILE)
    if os.path.exists(lock):
        os.remove(lock)  # readers open with lock=False; a stale lock file is just clutter
    packdir.fsync_path(os.path.join(partial, DATA_FILE))
    packdir.publish(partial, dst)

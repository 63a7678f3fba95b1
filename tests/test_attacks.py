"""``pack --update`` never follows or opens what it did not make, and its refusals say what works.

Issue 34, item 6 and its messages: a link or a FIFO planted in the pack folder (``lock.mdb``),
in ``DST.update`` (its ``data.mdb``, ``lock.mdb``, or the folder itself a link to another
folder) is refused before anything is written, naming the path and saying to remove it;
nothing outside the pack changes and nothing hangs. On the single and the sharded pack,
through the command line and the Python API. The refusals of a read-only ``data.mdb``, a
linked DST, an imported pack and a class folder that is a looping link say what works.
(The staging cache's side of item 6 is in tests/test_staging.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import as_unprivileged, image_bytes, make_small_tree, write
from conftest import reader_view as contents
from lmdbfolder import pack, pack_sharded, verify
from lmdbfolder.cli.common import EXIT_CODES
from lmdbfolder.errors import OutputExistsError, PackError, SourceError
from lmdbfolder.write import update as update_module
from lmdbfolder.write.update import staging_path

SRC = Path(__file__).resolve().parent.parent / "src"


def _cli(*argv: str, unprivileged: bool = False) -> subprocess.CompletedProcess[str]:
    """``lmdbfolder ARGV`` in a child (a hang would be a timeout, not a stuck test run)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "lmdbfolder", *argv]
    return subprocess.run(
        as_unprivileged(cmd) if unprivileged else cmd, capture_output=True, text=True, timeout=120, env=env
    )


def _new_image(path: Path, seed: int) -> None:
    import numpy as np

    data, _ = image_bytes("rgb_jpeg", np.random.default_rng(seed), w=23, h=17)
    write(path, data)


def _made(tmp_path: Path, sharded: bool) -> tuple[Path, Path, list[Path]]:
    """(source, pack, its pack folders: the pack's, or every shard's), one new file in the source."""
    src = make_small_tree(tmp_path / "src", classes=2, per_class=3)
    dst = tmp_path / "p"
    if sharded:
        pack_sharded(src, dst, shards=2, progress=False)
        folders = sorted(p for p in dst.iterdir() if p.is_dir())
    else:
        pack(src, dst, progress=False)
        folders = [dst]
    _new_image(src / "class0" / "new.jpg", 7)
    return src, dst, folders


def _update_cli(src: Path, dst: Path, sharded: bool, **kwargs: bool) -> subprocess.CompletedProcess[str]:
    return _cli("pack", str(src), str(dst), "--update", *(["--shards", "2"] if sharded else []), **kwargs)


def _update_api(src: Path, dst: Path, sharded: bool) -> None:
    if sharded:
        pack_sharded(src, dst, shards=2, update=True, progress=False)
    else:
        pack(src, dst, update=True, progress=False)


def _snapshot(folders: list[Path]) -> list[bytes]:
    return [(f / "data.mdb").read_bytes() for f in folders]


def _staged_then_stopped(src: Path, dst: Path, sharded: bool, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An update stopped before its transaction: ``<folder>.update`` of the first pack
    folder holds the staged files (what a kill leaves); returns that staging folder."""

    def stop(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(update_module, "_commit", stop)
        with pytest.raises(KeyboardInterrupt):
            _update_api(src, dst, sharded)
    folder = sorted(p for p in dst.iterdir() if p.is_dir())[0] if sharded else dst
    staging = Path(staging_path(str(folder)))
    assert (staging / "data.mdb").is_file()
    return staging


def _refused(proc: subprocess.CompletedProcess[str], path: Path, code: str = "output exists") -> None:
    assert proc.returncode == EXIT_CODES[code], (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and str(path) in proc.stderr and "remove" in proc.stderr, proc.stderr


# -- the pack folder ------------------------------------------------------------------------
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("planted", ["link", "FIFO"])
def test_a_planted_lock_file_in_the_pack_is_refused_and_nothing_outside_changes(
    tmp_path: Path, sharded: bool, planted: str
) -> None:
    """A link as ``DST/lock.mdb`` made the update write 16 KB into the file it named (exit 0)."""
    src, dst, folders = _made(tmp_path, sharded)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    lock = folders[-1] / "lock.mdb"  # the last shard: every shard is checked before any changes
    if planted == "link":
        os.symlink(victim, lock)
    else:
        os.mkfifo(lock)
    before = _snapshot(folders)
    _refused(_update_cli(src, dst, sharded), lock)
    with pytest.raises(OutputExistsError, match="remove"):
        _update_api(src, dst, sharded)
    assert victim.read_bytes() == b"precious" and _snapshot(folders) == before
    lock.unlink()
    _update_api(src, dst, sharded)  # what the message says works
    assert contents(dst) == contents(_fresh(src, tmp_path))


def _fresh(src: Path, tmp_path: Path) -> Path:
    out = tmp_path / "fresh"
    if not out.exists():
        pack(src, out, progress=False)
    return out


def test_a_planted_compaction_folder_is_refused_before_the_update_writes(tmp_path: Path) -> None:
    """An update that frees half the file compacts it through ``DST/compact.tmp``: a link
    planted there had LMDB's copy written where it led (and the update failed after its commit)."""
    from lmdbfolder.format import COMPACT_DIR

    src = make_small_tree(tmp_path / "src", classes=2, per_class=12)
    dst = tmp_path / "p"
    pack(src, dst, progress=False)
    folders = [dst]
    for path in src.glob("*/img*.jpg"):
        if path.name != "img0.jpg":
            path.unlink()  # most of the pack goes: the next update that changes it compacts it
    assert not pack(src, dst, update=True, progress=False).compacted
    keep = next(src.glob("*/img0.jpg"))
    keep.write_bytes(next(src.glob("*/img0.jpg")).read_bytes() + b"\0")  # a change: this update compacts
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, dst / COMPACT_DIR)
    before = _snapshot(folders)
    _refused(_update_cli(src, dst, False), dst / COMPACT_DIR)
    assert os.listdir(outside) == [] and _snapshot(folders) == before
    (dst / COMPACT_DIR).unlink()
    assert pack(src, dst, update=True, progress=False).compacted  # what the message says works
    assert contents(dst) == contents(_fresh(src, tmp_path))


def test_a_planted_lock_file_in_an_unfinished_pack_is_refused(tmp_path: Path) -> None:
    """``DST.partial`` is kept to resume: a link planted there as ``lock.mdb`` was written through."""
    src = make_small_tree(tmp_path / "src", classes=2, per_class=2)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    partial = tmp_path / "p.partial"
    partial.mkdir()
    os.symlink(victim, partial / "lock.mdb")
    _refused(_cli("pack", str(src), str(tmp_path / "p")), partial / "lock.mdb")
    assert victim.read_bytes() == b"precious"


@pytest.mark.parametrize("planted", ["link", "FIFO"])
def test_a_planted_writer_lock_is_refused(tmp_path: Path, planted: str) -> None:
    """``DST.lock`` (the writer lock beside DST): a link planted there had the writer's pid
    written into the file it named."""
    src, dst, folders = _made(tmp_path, False)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    lock = tmp_path / "p.lock"
    if planted == "link":
        os.symlink(victim, lock)
    else:
        os.mkfifo(lock)
    before = _snapshot(folders)
    _refused(_update_cli(src, dst, False), lock)
    assert victim.read_bytes() == b"precious" and _snapshot(folders) == before


def test_a_planted_temporary_index_is_never_written_through(tmp_path: Path) -> None:
    """A sharded update writes ``index.json`` through ``index.json.tmp``: a link planted
    there had the index written into the file it named."""
    from lmdbfolder.format import SHARD_INDEX_TMP

    src, dst, _ = _made(tmp_path, True)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.symlink(victim, dst / SHARD_INDEX_TMP)
    proc = _update_cli(src, dst, True)
    assert proc.returncode == 0, proc.stderr
    assert victim.read_bytes() == b"precious" and not os.path.lexists(dst / SHARD_INDEX_TMP)
    assert contents(dst) == contents(_fresh(src, tmp_path))


# -- the staging folder ---------------------------------------------------------------------
_PLANTS = ["lock.mdb link beside staged files", "data.mdb and lock.mdb links", "data.mdb FIFO", "folder link"]


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("planted", _PLANTS)
def test_what_is_planted_in_the_staging_folder_is_never_followed_or_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sharded: bool, planted: str
) -> None:
    """``lock.mdb`` and ``data.mdb`` links in a planted ``DST.update`` made the update write
    through them; ``DST.update`` a link to another folder had that folder's ``skipped.txt``
    taken (an update with nothing to read writes its report there); a FIFO as its
    ``data.mdb`` would block. Each is refused before anything is written."""
    src, dst, folders = _made(tmp_path, sharded)
    write(src / "class1" / "broken.jpg", b"\xff\xd8 not a JPEG")  # a report to write
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"precious")
    (outside / "skipped.txt").write_text("someone else's report\n")
    if planted == "lock.mdb link beside staged files":
        staging = _staged_then_stopped(src, dst, sharded, monkeypatch)
        (staging / "lock.mdb").unlink(missing_ok=True)
        os.symlink(outside / "victim", staging / "lock.mdb")
    else:
        staging = Path(staging_path(str(folders[-1])))  # the last shard: checked before the first changes
        if planted == "folder link":
            _update_api(src, dst, sharded)  # the broken file is skipped by the pack now
            (src / "class0" / "img0.jpg").unlink()  # nothing to read: only the report goes through it
            os.symlink(outside, staging)
        else:
            staging.mkdir()
            if planted == "data.mdb FIFO":
                os.mkfifo(staging / "data.mdb")
            else:
                os.symlink(outside / "victim", staging / "data.mdb")
                os.symlink(outside / "victim", staging / "lock.mdb")
    before = _snapshot(folders)
    _refused(_update_cli(src, dst, sharded), staging)
    with pytest.raises(OutputExistsError, match="remove"):
        _update_api(src, dst, sharded)
    assert (outside / "victim").read_bytes() == b"precious"
    assert (outside / "skipped.txt").read_text() == "someone else's report\n"
    assert sorted(os.listdir(outside)) == ["skipped.txt", "victim"]
    assert _snapshot(folders) == before
    assert verify(dst, progress=False).ok


# -- messages ---------------------------------------------------------------------------
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_a_read_only_data_file_says_how_to_make_it_writable_and_leaves_nothing(tmp_path: Path, sharded: bool) -> None:
    """An immutable (here: read-only) ``data.mdb`` got the hint to run ``verify`` (it is
    fine) and left a ``lock.mdb`` behind in the published pack."""
    src, dst, folders = _made(tmp_path, sharded)
    data = folders[0] / "data.mdb"
    data.chmod(0o444)
    try:
        proc = _update_cli(src, dst, sharded, unprivileged=True)
    finally:
        data.chmod(0o644)
    assert proc.returncode == EXIT_CODES["pack failed"], proc.stderr
    assert str(data) in proc.stderr and "chmod u+w" in proc.stderr and "chattr -i" in proc.stderr, proc.stderr
    assert "verify" not in proc.stderr, proc.stderr
    assert all(sorted(os.listdir(f)) == ["data.mdb"] for f in folders)
    _update_api(src, dst, sharded)  # once writable, the same command finishes
    assert contents(dst) == contents(_fresh(src, tmp_path))


def test_a_data_file_replaced_during_the_update_is_not_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The update writes the ``data.mdb`` it read (by file identity), never one put in its place."""
    src, dst, _ = _made(tmp_path, False)
    elsewhere = tmp_path / "elsewhere"
    pack(src, elsewhere, progress=False)
    original = update_module._check_writable

    def swapped(old: object, data: str) -> None:
        os.replace(data, str(tmp_path / "moved.mdb"))
        os.symlink(elsewhere / "data.mdb", data)
        original(old, data)  # type: ignore[arg-type]

    monkeypatch.setattr(update_module, "_check_writable", swapped)
    before = (elsewhere / "data.mdb").read_bytes()
    with pytest.raises(PackError, match="was replaced while the update ran"):
        pack(src, dst, update=True, progress=False)
    assert (elsewhere / "data.mdb").read_bytes() == before


@pytest.mark.parametrize("flags", [[], ["--overwrite"], ["--update"]])
def test_a_linked_destination_names_what_works(tmp_path: Path, flags: list[str]) -> None:
    """A linked DST was refused with "pass --overwrite", which refused it too."""
    src = make_small_tree(tmp_path / "src", classes=2, per_class=2)
    real = tmp_path / "real"
    pack(src, real, progress=False)
    link = tmp_path / "link"
    os.symlink(real, link)
    proc = _cli("pack", str(src), str(link), *flags)
    assert proc.returncode == EXIT_CODES["output exists"], proc.stderr
    assert "symbolic link" in proc.stderr and f"pass the folder it points to, {real}" in proc.stderr, proc.stderr
    assert "pass --overwrite" not in proc.stderr
    with pytest.raises(OutputExistsError, match="symbolic link"):
        pack(src, link, progress=False, update="--update" in flags, overwrite="--overwrite" in flags)
    assert _cli("pack", str(src), str(real), *flags).returncode == 0  # what it says works


def test_a_class_folder_that_is_a_looping_link_is_named(tmp_path: Path) -> None:
    """A class folder that is a link to itself was reported as the source root."""
    src = make_small_tree(tmp_path / "src", classes=2, per_class=2)
    os.symlink("loop", src / "loop")
    proc = _cli("pack", str(src), str(tmp_path / "p"))
    assert proc.returncode == EXIT_CODES["source error"], proc.stderr
    assert f"{src / 'loop'}: is a symbolic link that loops" in proc.stderr, proc.stderr
    with pytest.raises(SourceError, match="loops") as caught:
        pack(src, tmp_path / "p", progress=False)
    assert str(src / "loop") in str(caught.value)

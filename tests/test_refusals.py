"""The operating system saying no (issue 22): a full disk, permissions, a read-only
file system. Each ends in one message naming the path and its documented exit
code, never a signal or a traceback, and nothing is lost in silence.

Real refusals: permissions are applied with ``setpriv`` when the tests run as
root (``conftest.as_unprivileged``), a full disk is a tiny tmpfs and a
read-only file system a read-only bind mount, each in a private mount
namespace (``unshare -m``, root only).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import as_unprivileged, make_small_tree
from lmdbfolder.cli import EXIT_CODES
from lmdbfolder.errors import SourceError
from lmdbfolder.write.sources import scan
from lmdbfolder.write.writer import pack

SRC = Path(__file__).resolve().parent.parent / "src"
needs_mounts = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare"), reason="mounting a tiny file system needs root"
)


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))


def _lmdbfolder(*argv: str) -> subprocess.CompletedProcess[str]:
    cmd = as_unprivileged([sys.executable, "-m", "lmdbfolder", *argv])
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env())


def _in_own_mounts(script: str, *args: Path) -> subprocess.CompletedProcess[str]:
    """``sh -c script sh ARGS...`` in a private mount namespace (its mounts vanish with it)."""
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )


def _clear(proc: subprocess.CompletedProcess[str], code: str, *words: str) -> None:
    assert proc.returncode == EXIT_CODES[code], (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and all(w in proc.stderr for w in words), proc.stderr


@needs_mounts
@pytest.mark.parametrize("free_kb", [8, 4, 0])
def test_a_disk_without_room_for_the_lock_files_is_a_clear_error(tmp_path: Path, free_kb: int) -> None:
    # With < 8 KB free, pack died with SIGBUS (rc 135) inside lmdb.open (LMDB writes
    # its lock file through a shared map); with 0 bytes free, an OSError traceback.
    src = make_small_tree(tmp_path / "src")
    disk = tmp_path / "disk"
    disk.mkdir()
    script = (
        'mount -t tmpfs -o size=64k tmpfs "$1" && '
        f'dd if=/dev/zero of="$1/fill" bs=1k count={64 - free_kb} 2>/dev/null; '
        f'"{sys.executable}" -m lmdbfolder pack "$2" "$1/out" --no-progress --no-space-check'
    )
    proc = _in_own_mounts(script, disk, src)
    _clear(proc, "pack failed", "No space left on device", "/out", "free some space")


@needs_mounts
def test_a_read_only_file_system_is_a_clear_error(tmp_path: Path) -> None:
    src = make_small_tree(tmp_path / "src")
    ro = tmp_path / "ro"
    ro.mkdir()
    script = (
        'mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" && '
        f'"{sys.executable}" -m lmdbfolder pack "$2" "$1/out" --no-progress'
    )
    proc = _in_own_mounts(script, ro, src)
    _clear(proc, "pack failed", "Read-only file system", str(ro / "out"), "mounted read-only")


@pytest.fixture
def locked(tmp_path: Path) -> Path:
    """A folder nobody may write (restored for the clean-up)."""
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o555)
    yield folder
    folder.chmod(0o755)


def test_a_destination_in_a_read_only_folder(tmp_path: Path, locked: Path) -> None:
    # A PermissionError traceback, rc 1 (which means "verify found problems").
    src = make_small_tree(tmp_path / "src")
    _clear(_lmdbfolder("pack", str(src), str(locked / "out"), "--no-progress"), "pack failed", str(locked / "out"))
    pack(src, tmp_path / "p", progress=False)
    _clear(_lmdbfolder("copy", str(tmp_path / "p"), str(locked / "copy")), "pack failed", "Permission denied")
    _clear(
        _lmdbfolder("export", str(tmp_path / "p"), str(locked / "files"), "--no-progress"),
        "pack failed",
        "Permission denied",
        str(locked / "files"),
    )
    _clear(_lmdbfolder("show", str(tmp_path / "p"), "-o", str(locked / "s.png")), "other error", "Permission denied")
    assert os.listdir(locked) == []


def test_an_unreadable_source_root(tmp_path: Path) -> None:
    src = make_small_tree(tmp_path / "src")
    src.chmod(0)
    try:
        for layout in ([], ["--flat"]):
            proc = _lmdbfolder("pack", str(src), str(tmp_path / "out"), "--no-progress", *layout)
            _clear(proc, "source error", str(src), "Permission denied")
    finally:
        src.chmod(0o755)


@pytest.mark.parametrize("sharded", [False, True])
def test_an_unreadable_data_file_says_to_check_permissions(tmp_path: Path, sharded: bool) -> None:
    # The hint said to pass the directory `lmdbfolder pack` wrote, which it is.
    from lmdbfolder.write.shards import pack_sharded

    src = make_small_tree(tmp_path / "src")
    out = tmp_path / "p"
    if sharded:
        pack_sharded(src, out, shards=2, progress=False)
        data = sorted(out.glob("*.lmdb"))[1] / "data.mdb"
    else:
        pack(src, out, progress=False)
        data = out / "data.mdb"
    data.chmod(0)
    try:
        for argv in (["info", str(out)], ["show", str(out), "-o", str(tmp_path / "s.png")]):
            _clear(_lmdbfolder(*argv), "not a pack", str(data.parent), "Permission denied", "check its permissions")
        proc = _lmdbfolder("verify", str(out), "--against", str(src))
        if sharded:  # the other shard is still checked; the unreadable one is a problem
            _clear(proc, "problems found", "Permission denied", "check its permissions")
        else:
            _clear(proc, "not a pack", str(data.parent), "Permission denied", "check its permissions")
    finally:
        data.chmod(0o644)
    # What leads to it: the pack folder (it does hold a data.mdb), and index.json.
    locked = out / "index.json" if sharded else out
    locked.chmod(0)
    try:
        _clear(_lmdbfolder("verify", str(out)), "not a pack", str(out), "Permission denied", "check its permissions")
    finally:
        locked.chmod(0o755)


@pytest.mark.parametrize("flags", [[], ["--allow-empty"], ["--flat"]])
def test_an_unreadable_class_folder_is_never_packed_as_empty(tmp_path: Path, flags: list[str]) -> None:
    # "found no image for the classes class1", and with --allow-empty a pack with the
    # whole class missing and exit 0.
    src = make_small_tree(tmp_path / "src")
    (src / "class1").chmod(0)
    try:
        proc = _lmdbfolder("pack", str(src), str(tmp_path / "out"), "--no-progress", *flags)
        _clear(proc, "source error", str(src / "class1"), "cannot list this folder", "would be left out")
        assert not (tmp_path / "out").exists()
    finally:
        (src / "class1").chmod(0o755)


def test_the_scan_itself_refuses_a_folder_it_cannot_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The same rule in the Python API, for every layout that walks folders.
    src = make_small_tree(tmp_path / "src")
    real_scandir = os.scandir

    def refusing(path: object = ".") -> object:
        if str(path).endswith("class2"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "scandir", refusing)
    for layout in ("imagefolder", "flat"):
        with pytest.raises(SourceError, match="class2: cannot list this folder"):
            scan(str(src), layout=layout, allow_empty=True)


@needs_mounts
@pytest.mark.parametrize("free_kb", [4, 0])
def test_an_update_on_a_disk_without_room_for_the_lock_file_is_a_clear_error(tmp_path: Path, free_kb: int) -> None:
    # `pack --update` opened the published pack with LMDB, which writes lock.mdb through a
    # shared map: on a full disk the update died with SIGBUS (rc 135).
    src = make_small_tree(tmp_path / "src")
    disk = tmp_path / "disk"
    disk.mkdir()
    script = (
        'mount -t tmpfs -o size=256k tmpfs "$1" && '
        f'"{sys.executable}" -m lmdbfolder pack "$2" "$1/out" --no-progress --no-space-check && '
        f'free=$(df -k --output=avail "$1" | tail -1) && '
        f'dd if=/dev/zero of="$1/fill" bs=1k count=$((free - {free_kb})) 2>/dev/null; '
        'rm "$2/class1/img0.jpg" && '  # the update only drops a record: nothing to stage
        f'"{sys.executable}" -m lmdbfolder pack "$2" "$1/out" --update --no-progress --no-space-check; rc=$?; '
        f'"{sys.executable}" -m lmdbfolder verify "$1/out" --no-progress >&2 && exit $rc'
    )
    proc = _in_own_mounts(script, disk, src)
    _clear(proc, "pack failed", "No space left on device", "/out", "free some space")
    assert "12 of 12 records checked" in proc.stderr and ": OK" in proc.stderr  # the old version, intact

"""Conversion that survives the real world: resume, odd inputs, full disks, read-only packs."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import lmdb
import pytest
from PIL import Image

import lmdbfolder.write.loop as loop_mod
import lmdbfolder.write.output as output_mod
from conftest import as_unprivileged, image_bytes, make_small_tree, pack_contents, write
from lmdbfolder.cli import EXIT_CODES, main
from lmdbfolder.errors import OutputExistsError, PackError, SourceError
from lmdbfolder.format import PROGRESS_KEY
from lmdbfolder.read.reader import Reader
from lmdbfolder.tools.verify import verify
from lmdbfolder.write.sources import scan
from lmdbfolder.write.writer import pack, pack_sources


class Interrupt(Exception):
    pass


def test_resume_after_interruptions_equals_uninterrupted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_small_tree(tmp_path / "src", classes=3, per_class=10)
    pack(src, tmp_path / "ref", commit_every=4, progress=False)
    reference = pack_contents(tmp_path / "ref")

    calls = {"n": 0}
    original = loop_mod.load_sample

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] % 9 == 0:
            raise Interrupt("simulated crash")
        return original(*args, **kwargs)

    monkeypatch.setattr(loop_mod, "load_sample", flaky)
    out = tmp_path / "out"
    attempts = 0
    while True:
        attempts += 1
        try:
            result = pack(src, out, commit_every=4, workers=1, progress=False)
            break
        except Interrupt:
            assert not out.exists()
            assert (tmp_path / "out.partial").is_dir()
    assert attempts > 3
    assert result.resumed_from > 0  # (compacted only if free pages are >1%: tests/test_scale.py)
    assert pack_contents(out) == reference
    assert verify(out, progress=False).ok


def test_resume_refuses_changed_sources_and_restart_starts_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_small_tree(tmp_path / "src", classes=2, per_class=6)

    def stop_after_first_commit(self, extra=None):
        original_commit(self, extra)
        raise Interrupt

    original_commit = loop_mod._Run._commit
    monkeypatch.setattr(loop_mod._Run, "_commit", stop_after_first_commit)
    with pytest.raises(Interrupt):
        pack(src, tmp_path / "out", commit_every=3, progress=False)
    monkeypatch.setattr(loop_mod._Run, "_commit", original_commit)

    data, _ = image_bytes("rgb_jpeg", __import__("numpy").random.default_rng(9))
    write(src / "class1" / "new.jpg", data)
    with pytest.raises(OutputExistsError) as info:
        pack(src, tmp_path / "out", commit_every=3, progress=False)
    message = str(info.value)
    assert "the number of source files was 12, now 13" in message
    assert "restart=True" in message and "--restart" not in message
    with pytest.raises(OutputExistsError, match="store was 'encoded', now 'raw'"):
        (src / "class1" / "new.jpg").unlink()
        pack(src, tmp_path / "out", store="raw", progress=False)
    result = pack(src, tmp_path / "out", store="raw", restart=True, progress=False)
    assert result.resumed_from == 0 and result.count == 12


def test_checkpoint_is_in_the_same_transaction_as_its_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_small_tree(tmp_path / "src", classes=2, per_class=5)
    seen = []
    original = loop_mod._Partial.commit

    def spy(self, batch, extra):
        seen.append((len(batch), PROGRESS_KEY in extra))
        return original(self, batch, extra)

    monkeypatch.setattr(loop_mod._Partial, "commit", spy)
    pack(src, tmp_path / "out", commit_every=3, progress=False)
    assert seen == [(3, True), (3, True), (3, True), (1, True)]  # the last one deletes it
    env = lmdb.open(str(tmp_path / "out"), readonly=True, lock=False)
    with env.begin() as txn:
        assert txn.get(PROGRESS_KEY) is None  # a finished pack carries no checkpoint
    env.close()


def make_bad_tree(root: Path) -> dict[str, str]:
    """A tree with every kind of bad input; returns relpath -> expected reason fragment."""
    make_small_tree(root, classes=2, per_class=3)
    import numpy as np

    rng = np.random.default_rng(5)
    bad = {}
    write(root / "class0" / "zero.jpg", b"")
    bad["class0/zero.jpg"] = "empty file"
    write(root / "class0" / "text.png", b"this is a text file, not a PNG\n" * 10)
    bad["class0/text.png"] = "not an image Pillow can identify"
    data, _ = image_bytes("rgb_jpeg", rng, w=200, h=150)
    write(root / "class1" / "truncated.jpg", data[: len(data) * 2 // 3])  # header intact
    bad["class1/truncated.jpg"] = "truncated: the JPEG has no end-of-image marker"
    Image.new("1", (16000, 16000)).save(root / "class1" / "bomb_huge.png")  # > 2x the limit
    bad["class1/bomb_huge.png"] = "decompression bomb"
    Image.new("1", (10000, 10000)).save(root / "class1" / "bomb_big.png")  # between 1x and 2x
    bad["class1/bomb_big.png"] = "decompression-bomb limit"
    os.symlink(root / "nowhere.jpg", root / "class1" / "dangling.jpg")
    bad["class1/dangling.jpg"] = "broken symbolic link"
    data, _ = image_bytes("rgb_jpeg", rng)
    write(root / "class1" / "vanishing.jpg", data)
    bad["class1/vanishing.jpg"] = "file not found"
    (root / "class1" / "adir.jpg").mkdir()  # a directory with an image name: os.walk lists it as a dir
    return bad


def test_bad_inputs_are_skipped_and_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    bad = make_bad_tree(src)
    sources = scan(str(src))
    (src / "class1" / "vanishing.jpg").unlink()  # vanishes after the listing, before it is read
    result = pack_sources(sources, tmp_path / "out", progress=False)
    skipped = dict(result.skipped)
    assert set(skipped) == set(bad)
    for path, fragment in bad.items():
        assert fragment in skipped[path], (path, skipped[path])
    good = [p for p in sources.relpaths if p not in bad]
    with Reader(tmp_path / "out") as r:
        assert r.paths() == good
        assert r.classes == ["class0", "class1"]
        assert list(r.labels) == [sources.labels[sources.relpaths.index(p)] for p in good]
        assert [s["path"] for s in r.skipped()] == [p for p in sources.relpaths if p in bad]
    report = (tmp_path / "out" / "skipped.txt").read_text()
    assert all(p in report for p in bad)
    assert main(["info", str(tmp_path / "out")]) == 0
    assert "class1/dangling.jpg: broken symbolic link" in capsys.readouterr().out
    # the truncated JPEG no longer passes the header check (no end marker), so what got in decodes
    assert verify(tmp_path / "out", decode=True, progress=False).ok
    # a JPEG damaged inside, with its end marker intact, passes the header check; --check decode skips it
    data = (src / "class0" / "img0.jpg").read_bytes()
    middle = len(data) // 2
    (src / "class0" / "img0.jpg").write_bytes(data[: middle - 100] + data[middle:])
    decoded = pack(src, tmp_path / "decoded", check="decode", progress=False)
    assert "cannot be decoded" in dict(decoded.skipped)["class0/img0.jpg"]
    assert "truncated" in dict(decoded.skipped)["class1/truncated.jpg"]


def test_permission_denied_is_skipped(tmp_path: Path) -> None:
    src = make_small_tree(tmp_path / "src", classes=1, per_class=3)
    (src / "class0" / "img1.jpg").chmod(0)
    cmd = [sys.executable, "-m", "lmdbfolder", "pack", str(src), str(tmp_path / "out"), "--json"]
    proc = subprocess.run(as_unprivileged(cmd), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["skipped"] == [{"path": "class0/img1.jpg", "reason": "permission denied"}]


def test_strict_stops_at_the_first_bad_file_and_resumes(tmp_path: Path) -> None:
    src = make_small_tree(tmp_path / "src", classes=2, per_class=4)
    write(src / "class1" / "broken.png", b"\x89PNG\r\n\x1a\n garbage")
    with pytest.raises(SourceError) as info:
        pack(src, tmp_path / "out", strict=True, commit_every=2, progress=False)
    assert "broken.png" in str(info.value) and "unreadable image header" in str(info.value)
    assert "resume" in info.value.hint
    # fix the file, rerun the same command: it resumes where it stopped
    data, _ = image_bytes("palette_png", __import__("numpy").random.default_rng(1))
    (src / "class1" / "broken.png").write_bytes(data)
    result = pack(src, tmp_path / "out", strict=True, commit_every=2, progress=False)
    assert result.count == 9 and result.resumed_from == 4 and not result.skipped


def test_refuses_when_the_disk_is_too_small(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_small_tree(tmp_path / "src")
    monkeypatch.setattr(output_mod.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 100, 100))
    with pytest.raises(PackError, match=r"needs about [\d.]+ MB but only 0.0 MB are free") as info:
        pack(src, tmp_path / "out", progress=False)
    assert "--no-space-check" in info.value.hint
    assert pack(src, tmp_path / "out", space_check=False, progress=False).count == 12


def test_an_update_refused_for_room_says_how_much_in_megabytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lmdbfolder.write.update as update_mod

    src = make_small_tree(tmp_path / "src")
    pack(src, tmp_path / "out", progress=False)
    write(src / "class0" / "added.jpg", image_bytes("rgb_jpeg", __import__("numpy").random.default_rng(2))[0])
    # 300 kB free: a small disk's room in GB read "0.00 GB" whatever it held
    monkeypatch.setattr(update_mod.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 300_000))
    with pytest.raises(PackError, match=r"the update needs about [\d.]+ MB but only 0\.3 MB are free") as info:
        pack(src, tmp_path / "out", update=True, progress=False)
    assert "--no-space-check" in info.value.hint


def _pack_with_file_size_limit(src: Path, out: Path, limit: int) -> subprocess.CompletedProcess:
    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.run(
        [sys.executable, "-m", "lmdbfolder", "pack", str(src), str(out), "--commit-every", "5", "--no-progress"],
        capture_output=True,
        text=True,
        preexec_fn=limit_file_size,
        timeout=120,
    )


def test_disk_full_stops_cleanly_and_resumes(tmp_path: Path) -> None:
    src = make_small_tree(tmp_path / "src", classes=2, per_class=5)
    big = Image.effect_noise((256, 256), 90).convert("RGB")
    for k in range(10):
        big.rotate(k * 30).save(src / "class1" / f"big{k}.png")  # ~200 KB each
    proc = _pack_with_file_size_limit(src, tmp_path / "out", 600_000)
    assert proc.returncode == EXIT_CODES["pack failed"], proc.stderr
    assert "cannot write" in proc.stderr and "resumes where it stopped" in proc.stderr
    assert not (tmp_path / "out").exists() and (tmp_path / "out.partial").is_dir()
    result = pack(src, tmp_path / "out", commit_every=5, progress=False)
    assert result.resumed_from > 0 and result.count == 20
    pack(src, tmp_path / "ref", commit_every=5, progress=False)
    assert pack_contents(tmp_path / "out") == pack_contents(tmp_path / "ref")


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="mounting a tiny file system needs root")
def test_real_full_disk(tmp_path: Path) -> None:
    """A 1 MB tmpfs really fills up (ENOSPC); the pack stops with the message and resumes elsewhere."""
    src = make_small_tree(tmp_path / "src", classes=2, per_class=5)
    big = Image.effect_noise((256, 256), 90).convert("RGB")
    for k in range(12):
        big.rotate(k * 30).save(src / "class1" / f"big{k}.png")
    disk = tmp_path / "disk"
    disk.mkdir()
    script = (
        f'mount -t tmpfs -o size=1m tmpfs "$1" && "{sys.executable}" -m lmdbfolder pack "$2" "$1/out" '
        '--commit-every 4 --no-progress --no-space-check; rc=$?; cp -a "$1/out.partial" "$3"; exit $rc'
    )
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", str(disk), str(src), str(tmp_path / "out.partial")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == EXIT_CODES["pack failed"], proc.stderr
    assert "the disk is full" in proc.stderr or "a write failed" in proc.stderr, proc.stderr
    assert " MB free)" in proc.stderr, proc.stderr  # the room of a 1 MB disk, not "0.00 GB"
    # the partial pack (copied off the full disk) resumes and completes
    result = pack(src, tmp_path / "out", commit_every=4, space_check=False, progress=False)
    assert result.resumed_from > 0 and result.count == 22
    assert verify(tmp_path / "out", progress=False).ok


READ_ALL = textwrap.dedent(
    """
    import sys
    from lmdbfolder.read.reader import Reader
    from lmdbfolder.tools.verify import verify
    r = Reader(sys.argv[1])
    n = sum(len(r.read_bytes(i)) for i in range(len(r)))
    assert verify(sys.argv[1], progress=False).ok
    print(len(r), n)
    """
)


def test_read_only_pack_directory(small_pack: Path) -> None:
    before = sorted(os.listdir(small_pack))
    for p in (small_pack / "data.mdb", small_pack):
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        proc = subprocess.run(
            as_unprivileged([sys.executable, "-c", READ_ALL, str(small_pack)]),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split()[0] == "12"
        assert sorted(os.listdir(small_pack)) == before  # nothing (no lock file) was created
        if os.geteuid() == 0 and shutil.which("unshare"):
            # and on a read-only file system (a read-only bind mount in a private mount namespace)
            script = f'mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" && exec "{sys.executable}" -c "$2" "$1"'
            cmd = ["unshare", "-m", "sh", "-c", script, "sh", str(small_pack), READ_ALL]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, proc.stderr
    finally:
        small_pack.chmod(0o755)
        (small_pack / "data.mdb").chmod(0o644)


def test_cli_resume_message_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = make_small_tree(tmp_path / "src")
    write(src / "class0" / "empty.jpg", b"")
    assert main(["pack", str(src), str(tmp_path / "out"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["skipped"] == [{"path": "class0/empty.jpg", "reason": "empty file (0 bytes)"}]
    assert main(["pack", str(src), str(tmp_path / "o2"), "--strict"]) == EXIT_CODES["source error"]
    err = capsys.readouterr().err
    assert "empty.jpg: empty file (0 bytes)" in err and "resume" in err


def test_finished_but_unpublished_pack_is_published_on_rerun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_small_tree(tmp_path / "src")
    pack(src, tmp_path / "ref", progress=False)

    def crash(partial: str, dst: str) -> None:
        raise Interrupt("crashed between the last commit and the rename")

    original = output_mod._publish
    monkeypatch.setattr(output_mod, "_publish", crash)
    with pytest.raises(Interrupt):
        pack(src, tmp_path / "out", progress=False)
    monkeypatch.setattr(output_mod, "_publish", original)
    assert not (tmp_path / "out").exists()
    result = pack(src, tmp_path / "out", progress=False)
    assert result.count == 12
    assert pack_contents(tmp_path / "out") == pack_contents(tmp_path / "ref")
    # ... but not when the sources changed meanwhile
    monkeypatch.setattr(output_mod, "_publish", crash)
    with pytest.raises(Interrupt):
        pack(src, tmp_path / "again", progress=False)
    monkeypatch.setattr(output_mod, "_publish", original)
    (src / "class2" / "img3.jpg").unlink()
    with pytest.raises(OutputExistsError, match="finished but unpublished pack of different sources"):
        pack(src, tmp_path / "again", progress=False)


def test_no_room_to_compact_publishes_the_pack_as_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_small_tree(tmp_path / "src")

    class NoRoomEnv:
        def __init__(self, env):
            self.env = env

        def copy(self, *args, **kwargs):
            raise lmdb.DiskError("mdb_env_copy3: No space left on device")

        def __getattr__(self, name):
            return getattr(self.env, name)

    real_open = lmdb.open
    monkeypatch.setattr(
        output_mod.lmdb,
        "open",
        lambda path, **kw: NoRoomEnv(real_open(path, **kw)) if kw.get("readonly") else real_open(path, **kw),
    )
    monkeypatch.setattr(output_mod, "_COMPACT_FREE_FRACTION", 0.0)
    result = pack(src, tmp_path / "out", progress=False)
    assert not result.compacted
    assert verify(tmp_path / "out", progress=False).ok

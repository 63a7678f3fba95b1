"""``pack --update``: a pack brought up to date with its changed source, in place.

Every check compares with real oracles: torchvision's ImageFolder on the
changed tree (classes, class_to_idx, samples, targets, pixels of every
sample) and a fresh pack of it. Interruptions are real ``SIGKILL``s of a
child process at counted points (after the K-th file read, before and after
the transaction), never sleeps; readers are real DataLoader workers.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest
from PIL import Image

from conftest import assert_imagefolder, forge_meta, forge_table, image_bytes, make_small_tree, new_image, tree, write
from conftest import reader_view as contents
from lmdbfolder import (
    NotAPackError,
    OptionError,
    PackChangedError,
    Reader,
    Resize,
    SourceError,
    copy_pack,
    pack,
    pack_sharded,
    verify,
)
from lmdbfolder.cli import main
from lmdbfolder.cli.common import EXIT_CODES
from lmdbfolder.format import CHECK_KEY, ORDER_KEY, STATS_KEY, TABLE_KEYS, UNKNOWN_MTIME, encode_check, encode_order
from lmdbfolder.write import records
from lmdbfolder.write.update import staging_path

SRC_DIR = Path(__file__).resolve().parents[1] / "src"


# -- helpers -------------------------------------------------------------------------
def small_change(src: Path) -> None:
    """A class before every other (every label shifts), a file added and one rewritten."""
    new_image(src / "aardvark" / "a0.jpg", 200, w=60, h=40)
    new_image(src / "dog" / "img00b.jpg", 201, w=60, h=40)
    new_image(src / "cat" / "img01.jpg", 202, w=64, h=40)


def change_tree(src: Path) -> dict[str, Any]:
    """Add files and a class sorting before the others, remove files and a class, rewrite files."""
    new_image(src / "aardvark" / "a0.jpg", 100)  # a new class before every other: every label shifts
    new_image(src / "aardvark" / "a1.png", 101, kind="rgba_png")
    new_image(src / "dog" / "img99.jpg", 102)  # added at the end of a class
    new_image(src / "dog" / "img00b.jpg", 103)  # added in the middle
    os.remove(src / "cat" / "img03.jpg")
    for name in os.listdir(src / "emu"):  # a class removed
        os.remove(src / "emu" / name)
    os.rmdir(src / "emu")
    new_image(src / "cat" / "img01.jpg", 104, w=30)  # rewritten in place, another size
    before = (src / "dog" / "img02.jpg").stat()
    new_image(src / "dog" / "img02.jpg", 105, w=18, h=13)  # rewritten, maybe the same size
    os.utime(src / "dog" / "img02.jpg", ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000))
    return {"added": 4, "removed": 7, "changed": 2, "classes_added": ["aardvark"], "classes_removed": ["emu"]}


def fresh(src: Path, tmp_path: Path, **options: Any) -> Path:
    out = tmp_path / f"fresh-{len(list(tmp_path.iterdir()))}"
    pack(src, out, progress=False, **options)
    return out


class CountReads:
    """Counts the source files read in this process (``workers=1`` reads here)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.paths: list[str] = []
        original = records._read_file

        def counting(path: str, alloc: Any = None) -> Any:
            self.paths.append(os.path.basename(path))
            return original(path, alloc)

        monkeypatch.setattr(records, "_read_file", counting)


# -- the result is a fresh pack of the changed tree ---------------------------------------
def test_update_equals_a_fresh_pack_of_the_changed_tree(tmp_path: Path) -> None:
    src = tree(tmp_path / "src")
    dst = tmp_path / "p"
    first = pack(src, dst, progress=False)
    old_id = Reader(dst).pack_id
    expected = change_tree(src)
    result = pack(src, dst, update=True, progress=False)
    assert not result.already_packed and result.changes is not None
    got = result.changes.as_dict()
    assert {k: got[k] for k in expected} == expected
    assert result.count == first.count + 4 - 7
    assert_imagefolder(src, dst)
    assert contents(dst) == contents(fresh(src, tmp_path))
    report = verify(dst, decode=True, progress=False)
    assert report.ok, report.problems
    with Reader(dst) as r:
        assert r.format_version == 3 and r.pack_id != old_id
        assert r.meta["record_classes"] == ["cat", "dog", "emu", "aardvark"]  # the headers' class names
        history = r.history()
    assert [h["event"] for h in history] == ["pack", "update"]
    assert {k: history[1][k] for k in expected} == expected
    # A second update: nothing changed.
    again = pack(src, dst, update=True, progress=False)
    assert again.already_packed and again.changes is None


def test_update_of_an_unchanged_tree_reads_and_writes_nothing(
    small_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = tmp_path / "p"
    pack(small_tree, dst, progress=False)
    data = dst / "data.mdb"
    before = (data.stat().st_mtime_ns, data.stat().st_size, data.read_bytes())
    reads = CountReads(monkeypatch)
    result = pack(small_tree, dst, update=True, workers=1, progress=False)
    assert result.already_packed and result.input_bytes == 0 and reads.paths == []
    assert (data.stat().st_mtime_ns, data.stat().st_size, data.read_bytes()) == before
    assert not os.path.exists(staging_path(str(dst)))


def test_update_reads_only_the_changed_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tree(tmp_path / "src", per_class=8)
    dst = tmp_path / "p"
    pack(src, dst, progress=False)
    new_image(src / "cat" / "img03.jpg", 7, w=40)
    new_image(src / "dog" / "new.jpg", 8)
    os.remove(src / "emu" / "img05.jpg")
    reads = CountReads(monkeypatch)
    looked_up: list[int] = []
    from lmdbfolder.write import update as update_module

    original = update_module._OldPack.value

    def value(self: Any, key: int) -> Any:
        looked_up.append(key)
        return original(self, key)

    monkeypatch.setattr(update_module._OldPack, "value", value)
    result = pack(src, dst, update=True, workers=1, progress=False)
    assert sorted(reads.paths) == ["img03.jpg", "new.jpg"]
    assert result.changes is not None and result.changes.read == 2
    # Of the pack, only the records of the files that changed or went (compared with
    # the file read again; their size and encoding leave the totals).
    assert sorted(set(looked_up)) == [3, 8 * 2 + 5]
    assert_imagefolder(src, dst)


def test_content_check_finds_a_file_rewritten_with_its_old_size_and_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tree(tmp_path / "src")
    dst = tmp_path / "p"
    pack(src, dst, progress=False)
    target = src / "dog" / "img01.jpg"
    st = target.stat()
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x55  # same size; the JPEG still decodes
    target.write_bytes(bytes(data))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert pack(src, dst, update=True, progress=False).already_packed  # size and time: nothing to see
    reads = CountReads(monkeypatch)
    result = pack(src, dst, update=True, check="content", workers=1, progress=False)
    assert result.changes is not None
    assert (result.changes.changed, result.changes.unchanged, result.changes.read) == (1, 17, 18)
    assert len(reads.paths) == 18
    assert_imagefolder(src, dst)
    with Reader(dst) as r:
        assert r.meta["params"]["check"] == "header"  # the pack's own check, kept


def test_a_pack_without_recorded_file_times_is_compared_by_content(tmp_path: Path) -> None:
    """Packs made before file times were recorded: the first update reads every file
    and keeps the records whose bytes did not change."""
    src = tree(tmp_path / "src")
    dst = tmp_path / "p"
    pack(src, dst, progress=False)
    env = lmdb.open(str(dst), map_size=1 << 30)
    with env.begin(write=True) as txn:
        txn.delete(STATS_KEY)
        tables = {key: txn.get(key) for key in TABLE_KEYS if txn.get(key) is not None}
        txn.put(CHECK_KEY, encode_check(tables))
    env.close()
    assert verify(dst, progress=False).ok
    new_image(src / "cat" / "new.jpg", 9)
    result = pack(src, dst, update=True, progress=False)
    assert result.changes is not None
    assert (result.changes.added, result.changes.unchanged, result.changes.read) == (1, 18, 19)
    assert_imagefolder(src, dst)
    assert pack(src, dst, update=True, progress=False).already_packed  # times recorded now


def test_list_file_relabel_rewrites_the_record_without_reading_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_small_tree(tmp_path / "src")
    listing = tmp_path / "list.txt"
    names = sorted(str(p.relative_to(src)) for p in src.rglob("*.jpg"))
    listing.write_text("".join(f"{n} {k % 3}\n" for k, n in enumerate(names)))
    dst = tmp_path / "p"
    pack(src, dst, list_file=listing, progress=False)
    lines = listing.read_text().splitlines()
    lines[4] = lines[4].rsplit(" ", 1)[0] + " 7"  # a label fixed: class "7" is new
    del lines[0]
    listing.write_text("\n".join(lines) + "\n")
    reads = CountReads(monkeypatch)
    result = pack(src, dst, list_file=listing, update=True, workers=1, progress=False)
    assert reads.paths == []
    assert result.changes is not None
    assert (result.changes.relabelled, result.changes.removed) == (1, 1)
    assert contents(dst) == contents(fresh(src, tmp_path, list_file=listing))
    assert verify(dst, progress=False).ok


def test_a_file_touched_and_relabelled_gets_its_new_label(tmp_path: Path) -> None:
    """Read again (its time changed) with the same bytes but another class: a new record."""
    src = make_small_tree(tmp_path / "src")
    listing = tmp_path / "list.txt"
    names = sorted(str(p.relative_to(src)) for p in src.rglob("*.jpg"))
    listing.write_text("".join(f"{n} {k % 3}\n" for k, n in enumerate(names)))
    dst = tmp_path / "p"
    pack(src, dst, list_file=listing, progress=False)
    lines = listing.read_text().splitlines()
    lines[4] = lines[4].rsplit(" ", 1)[0] + " 0"
    listing.write_text("\n".join(lines) + "\n")
    touched = src / names[4]
    st = touched.stat()
    os.utime(touched, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    result = pack(src, dst, list_file=listing, update=True, progress=False)
    assert result.changes is not None and (result.changes.read, result.changes.changed) == (1, 1)
    assert contents(dst) == contents(fresh(src, tmp_path, list_file=listing))
    assert verify(dst, progress=False).ok


def test_flat_folder_update(tmp_path: Path) -> None:
    src = tmp_path / "flat"
    for k in range(6):
        new_image(src / f"{k}.jpg", k)
    dst = tmp_path / "p"
    pack(src, dst, layout="flat", progress=False)
    new_image(src / "2b.jpg", 50)
    os.remove(src / "4.jpg")
    pack(src, dst, layout="flat", update=True, progress=False)
    assert contents(dst) == contents(fresh(src, tmp_path, layout="flat"))


def test_skipped_files_follow_the_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tree(tmp_path / "src")
    write(src / "cat" / "zero.jpg", b"")
    dst = tmp_path / "p"
    pack(src, dst, progress=False)
    reads = CountReads(monkeypatch)
    write(src / "dog" / "bad.jpg", b"not a jpeg")
    result = pack(src, dst, update=True, workers=1, progress=False)
    assert reads.paths == ["bad.jpg"]  # the old bad file is skipped again without reading it
    assert sorted(p for p, _ in result.skipped) == ["cat/zero.jpg", "dog/bad.jpg"]
    new_image(src / "cat" / "zero.jpg", 3)  # fixed
    result = pack(src, dst, update=True, progress=False)
    assert result.changes is not None and result.changes.added == 1
    assert [p for p, _ in result.skipped] == ["dog/bad.jpg"]
    expect = fresh(src, tmp_path)
    assert contents(dst) == contents(expect)
    assert (dst / "skipped.txt").read_text().splitlines()[2:] == (expect / "skipped.txt").read_text().splitlines()[2:]


def test_options_that_change_every_record_need_overwrite(small_tree: Path, tmp_path: Path) -> None:
    dst = tmp_path / "p"
    pack(small_tree, dst, progress=False)
    with pytest.raises(OptionError, match='packed with store="encoded"') as info:
        pack(small_tree, dst, update=True, store="raw", progress=False)
    assert "overwrite=True" in str(info.value)
    with pytest.raises(OptionError, match=r"not resize=Resize\(8, 90"):
        pack(small_tree, dst, update=True, resize=Resize(8), progress=False)
    with pytest.raises(OptionError, match="pass one of them"):
        pack(small_tree, dst, update=True, overwrite=True, progress=False)
    with pytest.raises(OptionError, match="it needs update=True"):
        pack(small_tree, dst, check="content", progress=False)
    # The CLI takes the pack's own options for those it is not given.
    raw = tmp_path / "raw"
    assert main(["pack", str(small_tree), str(raw), "--store", "raw", "--no-progress"]) == 0
    new_image(small_tree / "class0" / "extra.jpg", 1)
    assert main(["pack", str(small_tree), str(raw), "--update", "--no-progress"]) == 0
    assert contents(raw) == contents(fresh(small_tree, tmp_path, store="raw"))
    assert main(["pack", str(small_tree), str(raw), "--update", "--store", "encoded"]) == EXIT_CODES["usage"]


def test_update_of_a_missing_pack_packs_it(small_tree: Path, tmp_path: Path) -> None:
    result = pack(small_tree, tmp_path / "p", update=True, progress=False)
    assert result.changes is None and not result.already_packed and result.count == 12


def test_an_update_that_would_leave_no_image_says_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tree(tmp_path / "src", classes=("cat", "dog"), per_class=1)
    pack(src, tmp_path / "p", progress=False)
    before = contents(tmp_path / "p")
    for image in src.rglob("*.jpg"):
        image.unlink()
    argv = ["pack", str(src), str(tmp_path / "p"), "--update", "--allow-empty", "--no-progress"]
    assert main(argv) == EXIT_CODES["source error"]
    err = capsys.readouterr().err
    assert str(src) in err and "holds no image" in err and "hint:" in err
    assert contents(tmp_path / "p") == before


# -- interrupted updates --------------------------------------------------------------------
_CHILD = """
import os, signal, sys
sys.path.insert(0, {src!r})
import lmdbfolder.write.update as update
from lmdbfolder import pack_sources, scan

point, k = sys.argv[1], int(sys.argv[2])

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

def on_progress(done, total):
    if point == "read" and done == k:
        die()

if point == "before_commit":
    update._commit = die
elif point == "after_commit":
    commit = update._commit
    def after(*args, **kwargs):
        commit(*args, **kwargs)
        die()
    update._commit = after
elif point == "after_report":
    report = update._write_report
    def after_report(*args, **kwargs):
        report(*args, **kwargs)
        die()
    update._write_report = after_report
pack_sources(scan({tree!r}), {dst!r}, update=True, workers=int(sys.argv[3]), commit_every=2,
             on_progress=on_progress, progress=False)
print("finished")
"""


def _updated_sharded_pack(tmp_path: Path) -> tuple[Path, Path, list[Path]]:
    """A two-shard pack of cats and dogs, updated once with a file of each shard rewritten
    (so both shards are format 3): (src, the pack, its shard folders)."""
    src = tree(tmp_path / "src", classes=("cat", "dog"))
    dst = tmp_path / "sh"
    pack_sharded(src, dst, shards=2, progress=False)
    new_image(src / "cat" / "img00.jpg", 200, w=25)
    new_image(src / "dog" / "img05.jpg", 201, w=26)
    pack_sharded(src, dst, shards=2, update=True, progress=False)
    return src, dst, sorted(p for p in dst.iterdir() if p.is_dir())


def _run_child(src: Path, dst: Path, point: str, k: int, workers: int = 1) -> subprocess.CompletedProcess[str]:
    code = _CHILD.format(src=str(SRC_DIR), tree=str(src), dst=str(dst))
    return subprocess.run(
        [sys.executable, "-c", code, point, str(k), str(workers)], capture_output=True, text=True, timeout=120
    )


def test_kill_at_any_point_leaves_the_old_or_the_new_version(tmp_path: Path) -> None:
    src = tree(tmp_path / "src", per_class=5)
    dst = tmp_path / "p"
    pack(src, dst, progress=False)
    old = contents(dst)
    old_id = Reader(dst).pack_id
    saved = tmp_path / "saved"
    os.makedirs(saved)
    (saved / "data.mdb").write_bytes((dst / "data.mdb").read_bytes())
    change_tree(src)
    expected = contents(fresh(src, tmp_path))
    to_read = 4  # the changed and new files
    points = [("read", k) for k in range(1, to_read + 1)] + [("before_commit", 0), ("after_commit", 0)]
    points += [("after_report", 0), ("read", 2)]
    for n, (point, k) in enumerate(points):
        (dst / "data.mdb").write_bytes((saved / "data.mdb").read_bytes())  # the old version again
        for leftover in (dst / "skipped.txt", dst / "lock.mdb"):
            leftover.unlink(missing_ok=True)
        done = _run_child(src, dst, point, k, workers=2 if n % 2 else 1)
        assert done.returncode == -signal.SIGKILL, (point, k, done.stderr[-2000:])
        report = verify(dst, progress=False)
        assert report.ok, (point, k, report.problems)
        committed = point in ("after_commit", "after_report")
        assert (Reader(dst).pack_id == old_id) is not committed, (point, k)
        assert contents(dst) == (expected if committed else old), (point, k)
        if point == "read" and k == 2 and n == len(points) - 1:
            new_image(src / "dog" / "late.jpg", 77)  # the source changes before the rerun
            expected = contents(fresh(src, tmp_path))
        again = pack(src, dst, update=True, progress=False)
        assert again.already_packed is committed, (point, k)
        assert contents(dst) == expected, (point, k)
        assert verify(dst, progress=False).ok
        assert not os.path.exists(staging_path(str(dst)))


def test_an_interrupted_update_resumes_its_staged_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tree(tmp_path / "src", per_class=5)
    dst = tmp_path / "p"
    pack(src, dst, progress=False)
    for k in range(6):
        new_image(src / "dog" / f"new{k}.jpg", 30 + k)
    done = _run_child(src, dst, "read", 4)
    assert done.returncode == -signal.SIGKILL
    reads = CountReads(monkeypatch)
    result = pack(src, dst, update=True, workers=1, commit_every=2, progress=False)
    assert result.resumed_from == 4 and reads.paths == ["new4.jpg", "new5.jpg"]
    assert_imagefolder(src, dst)


# -- readers during and after an update -------------------------------------------------
def _pixels_digest(img: Image.Image) -> str:
    return hashlib.sha256(img.tobytes()).hexdigest()


def _digests(path: Path) -> list[tuple[str, int]]:
    with Reader(path) as r:
        return [(_pixels_digest(r.image(i)), r.labels[i]) for i in range(len(r))]


def test_dataloader_workers_never_mix_versions(tmp_path: Path) -> None:
    from torch.utils.data import DataLoader

    from lmdbfolder.torch import LMDBFolder

    src = tree(tmp_path / "src", per_class=8, scale=4)
    dst = tmp_path / "p"
    pack(src, dst, progress=False)
    old = _digests(dst)
    ds = LMDBFolder(str(dst), transform=_pixels_digest)
    loader = DataLoader(ds, batch_size=3, num_workers=2, collate_fn=list)
    seen: list[tuple[str, int]] = []
    for b, batch in enumerate(loader):
        seen += batch
        if b == 1:  # both workers are reading: change the pack under them
            small_change(src)
            result = pack(src, dst, update=True, progress=False)
            assert result.changes is not None and not result.compacted
    assert seen == old  # the epoch read the version it started with, every sample
    new = _digests(dst)
    assert new != old
    # The next epoch's new workers still read the version this dataset opened.
    assert [s for batch in loader for s in batch] == old
    # A new dataset reads the new version.
    renewed = DataLoader(LMDBFolder(str(dst), transform=_pixels_digest), num_workers=2, collate_fn=list)
    assert [s for batch in renewed for s in batch] == new
    # Updated a second time: the old dataset is told, at a batch, never served a mix.
    new_image(src / "cat" / "another.jpg", 61)
    pack(src, dst, update=True, progress=False)
    with pytest.raises(Exception, match="replaced since this dataset was opened"):
        list(loader)
    # Workers that keep their map (persistent) read the version they opened through
    # one update; after a second one they say so at the next batch.
    current = _digests(dst)
    persistent = DataLoader(
        LMDBFolder(str(dst), transform=_pixels_digest),
        batch_size=4,
        num_workers=2,
        collate_fn=list,
        persistent_workers=True,
    )
    assert [s for batch in persistent for s in batch] == current
    new_image(src / "cat" / "one-more.jpg", 62)
    pack(src, dst, update=True, progress=False)
    assert [s for batch in persistent for s in batch] == current
    new_image(src / "cat" / "and-another.jpg", 63)
    pack(src, dst, update=True, progress=False)
    with pytest.raises(Exception, match="updated in place more than once"):
        list(persistent)


def _read_all(reader: Reader) -> list[str]:
    return [hashlib.sha256(bytes(rec.payload)).hexdigest() for rec in reader]


def test_a_process_started_after_one_update_reads_the_version_its_parent_opened(tmp_path: Path) -> None:
    src = tree(tmp_path / "src", scale=4)
    dst = tmp_path / "p"
    pack(src, dst, progress=False)
    reader = Reader(dst)  # opened: tables read, no map kept
    old = _read_all(Reader(dst))
    small_change(src)
    assert not pack(src, dst, update=True, progress=False).compacted
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_read_all, (reader,)) == old
    assert _read_all(reader) == old and len(reader) == len(old)
    new_image(src / "cat" / "x.jpg", 5)
    pack(src, dst, update=True, progress=False)
    with pytest.raises(PackChangedError, match="updated in place more than once"):
        reader.get(0)  # mapped here: two transactions since the version it reads
    with (
        multiprocessing.get_context("spawn").Pool(1) as pool,
        pytest.raises(PackChangedError, match="replaced since this dataset was opened"),
    ):
        pool.apply(_read_all, (reader,))


# -- format 3 on the inside ------------------------------------------------------------
def _forge_order_twice(dst: Path) -> None:
    env = lmdb.open(str(dst), map_size=1 << 30, lock=False)
    with env.begin() as txn:
        order = np.frombuffer(txn.get(ORDER_KEY), dtype="<u8").copy()
    env.close()
    order[1] = order[0]  # two samples, one record
    forge_table(dst, ORDER_KEY, encode_order(order))


_FORGERIES: dict[str, tuple[Any, str]] = {
    # An update deletes the record of a sample that is gone: the one the other sample still names.
    "order names a key twice": (_forge_order_twice, r"__order__ names 1 record key\(s\) twice"),
    # An update writes its new records from next_record on: over kept ones.
    "next_record in use": (lambda dst: forge_meta(dst, next_record=0), "not below next_record=0"),
    # Every kept record would serve another class than its target.
    "record_classes permuted": (
        lambda dst: forge_meta(dst, record_classes=["dog", "cat", "emu", "aardvark"]),
        "through record_classes",
    ),
}


@pytest.mark.parametrize("forgery", sorted(_FORGERIES))
def test_an_update_refuses_forged_tables_before_writing(tmp_path: Path, forgery: str) -> None:
    """Issue 34, 1: tables with valid checksums that break the format's rules; the update
    checks every table it reads against them and refuses before it writes anything."""
    src = tree(tmp_path / "src")
    dst = tmp_path / "p"
    pack(src, dst, progress=False)
    change_tree(src)
    pack(src, dst, update=True, progress=False)
    with Reader(dst) as r:
        assert r.meta["record_classes"] == ["cat", "dog", "emu", "aardvark"]  # what the forgery permutes
    forge, why = _FORGERIES[forgery]
    forge(dst)
    before = (dst / "data.mdb").read_bytes()
    new_image(src / "dog" / "img77.jpg", 300)
    os.remove(src / "cat" / "img00.jpg")
    with pytest.raises(NotAPackError, match=why):
        pack(src, dst, update=True, progress=False)
    assert (dst / "data.mdb").read_bytes() == before and not os.path.exists(staging_path(str(dst)))
    assert not verify(dst, progress=False).ok  # verify says so too, by the same rules


def _forge_order_swap(dst: Path, i: int, j: int) -> None:
    """Samples ``i`` and ``j`` swap records (``__order__`` entries), every checksum valid."""
    env = lmdb.open(str(dst), map_size=1 << 30, lock=False, readonly=True)
    with env.begin() as txn:
        order = np.frombuffer(txn.get(ORDER_KEY), dtype="<u8").copy()
    env.close()
    order[[i, j]] = order[[j, i]]
    forge_table(dst, ORDER_KEY, encode_order(order))


def _sample_paths(dst: Path) -> list[str]:
    with Reader(dst) as r:
        return r.paths()


@pytest.mark.parametrize("how", ["python", "cli"])
@pytest.mark.parametrize("swap", ["one class, other sizes", "two classes"])
def test_an_update_refuses_swapped_records_before_writing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], swap: str, how: str
) -> None:
    """Issue 34, 1: two ``__order__`` entries swapped (valid checksums). The update keeps
    both records unread (their files did not change), so it once served each sample the
    other's image; it checks every record it keeps as ``verify`` does (the header label
    against the label table, the payload's length against ``__stats__``) and refuses,
    naming the sample, before it writes anything."""
    src = tree(tmp_path / "src")
    dst = tmp_path / "p"
    pack(src, dst, progress=False)
    new_image(src / "dog" / "img77.jpg", 300)
    pack(src, dst, update=True, progress=False)  # format 3: records found through __order__
    paths = _sample_paths(dst)
    i, j = (1, 4) if swap == "one class, other sizes" else (2, 9)  # cat/img01, cat/img04 | cat/img02, dog/img03
    _forge_order_swap(dst, i, j)
    report = verify(dst, progress=False)
    kind = "size" if swap == "one class, other sizes" else "label"
    assert {(p.kind, p.index) for p in report.problems} == {(kind, i), (kind, j)}, report.problems  # the same rules
    before = (dst / "data.mdb").read_bytes()
    new_image(src / "emu" / "img88.jpg", 301)  # the update has work to do
    why = f"the record of sample {i} \\({paths[i]}, record key \\d+\\) (holds|is labelled)"
    if how == "python":
        with pytest.raises(NotAPackError, match=why) as caught:
            pack(src, dst, update=True, progress=False)
        assert "2 sample(s) differ" in caught.value.message and "--overwrite" in (caught.value.hint or "")
    else:
        assert main(["pack", str(src), str(dst), "--update", "--no-progress"]) == EXIT_CODES["not a pack"]
        err = capsys.readouterr().err
        assert re.search(why, err) and "lmdbfolder verify" in err and "--overwrite" in err, err
    assert (dst / "data.mdb").read_bytes() == before and not os.path.exists(staging_path(str(dst)))


@pytest.mark.parametrize("how", ["python", "cli"])
def test_a_sharded_update_refuses_swapped_records_before_changing_any_shard(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str
) -> None:
    """Issue 34, 1, on the sharded pack: records swapped in its last shard are refused
    before the update writes a byte of any shard."""
    src, dst, shard_dirs = _updated_sharded_pack(tmp_path)
    _forge_order_swap(shard_dirs[1], 0, 2)  # two dogs of other sizes
    assert not verify(dst, progress=False).ok
    before = [(p / "data.mdb").read_bytes() for p in shard_dirs]
    index_before = (dst / "index.json").read_bytes()
    new_image(src / "cat" / "img01.jpg", 202, w=27)  # changes for the first shard too
    new_image(src / "dog" / "img04.jpg", 203, w=28)
    why = r"the record of sample 0 \(dog/img00\.jpg, record key \d+\) holds"
    if how == "python":
        with pytest.raises(NotAPackError, match=why):
            pack_sharded(src, dst, shards=2, update=True, progress=False)
    else:
        assert main(["pack", str(src), str(dst), "--update", "--no-progress"]) == EXIT_CODES["not a pack"]
        err = capsys.readouterr().err
        assert re.search(why, err) and str(shard_dirs[1]) in err, err
    assert [(p / "data.mdb").read_bytes() for p in shard_dirs] == before
    assert (dst / "index.json").read_bytes() == index_before


def test_verify_finds_what_is_wrong_in_an_updated_pack(tmp_path: Path) -> None:
    src = tree(tmp_path / "src")
    dst = tmp_path / "p"
    pack(src, dst, progress=False)
    change_tree(src)
    pack(src, dst, update=True, progress=False)
    env = lmdb.open(str(dst), map_size=1 << 30)
    with env.begin(write=True) as txn:
        order = np.frombuffer(txn.get(ORDER_KEY), dtype="<u8").copy()
        order[1] = order[0]  # two samples, one record (checksums made to match: a forged pack)
        txn.put(ORDER_KEY, encode_order(order))
        tables = {key: txn.get(key) for key in TABLE_KEYS if txn.get(key) is not None}
        txn.put(CHECK_KEY, encode_check(tables))
    env.close()
    problems = verify(dst, progress=False).problems
    # A key twice; sample 1 served sample 0's record (another file's size: ``__stats__``); a record no sample names.
    assert [p.kind for p in problems] == ["order", "size", "extra"], problems
    assert problems[1].index == 1


def test_updated_packs_copy_verify_against_their_source_and_refuse_damage(tmp_path: Path) -> None:
    src = tree(tmp_path / "src")
    dst = tmp_path / "p"
    pack(src, dst, progress=False)
    change_tree(src)
    pack(src, dst, update=True, progress=False)
    copied = tmp_path / "copy"
    copy_pack(dst, copied)
    assert contents(copied) == contents(dst) and verify(copied, progress=False).ok
    report = verify(dst, against=src, decode=True, progress=False)
    assert report.ok, report.problems
    # A flipped bit in the record order: refused on open, named by verify.
    data = dst / "data.mdb"
    blob = bytearray(data.read_bytes())
    with Reader(dst) as r:
        order = r._file().get(ORDER_KEY)
        assert order is not None
        at = blob.find(bytes(order))
    blob[at + 8] ^= 0x01
    data.write_bytes(bytes(blob))
    with pytest.raises(NotAPackError, match="__order__ table is damaged"):
        Reader(dst).get(0)
    assert any("__order__" in p.message for p in verify(dst, progress=False).problems)


def test_fresh_packs_record_file_times_and_history(small_tree: Path, tmp_path: Path) -> None:
    dst = tmp_path / "p"
    pack(small_tree, dst, progress=False)
    with Reader(dst) as r:
        assert r.format_version == 2  # a fresh pack is still format 2: older readers open it
        assert r.history()[0]["event"] == "pack" and r.history()[0]["count"] == 12
    from lmdbfolder import packfile

    pf = packfile.open_data(str(dst))
    stats = packfile.load_tables(pf, str(dst)).stats(packfile.PackSource(pf, str(dst)))
    assert stats is not None and int(stats["mtime_ns"][0]) == (small_tree / "class0" / "img0.jpg").stat().st_mtime_ns
    assert int(stats["size"][5]) == (small_tree / "class1" / "img1.jpg").stat().st_size
    assert UNKNOWN_MTIME not in stats["mtime_ns"]
    pf.close()


def test_records_of_a_resumed_pack_are_compared_by_content_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files read before an interruption may have changed while the pack was stopped:
    their time is not recorded, and the first update compares their bytes."""
    src = tree(tmp_path / "src")
    write(src / "dog" / "img02.jpg", b"broken")
    dst = tmp_path / "p"
    with pytest.raises(SourceError):
        pack(src, dst, strict=True, workers=1, commit_every=2, progress=False)
    new_image(src / "dog" / "img02.jpg", 11)  # fixed: the rerun resumes after the first files
    assert pack(src, dst, strict=True, workers=1, commit_every=2, progress=False).resumed_from > 0
    from lmdbfolder import packfile

    pf = packfile.open_data(str(dst))
    mtimes = packfile.load_tables(pf, str(dst)).stats(packfile.PackSource(pf, str(dst)))["mtime_ns"].tolist()
    pf.close()
    unknown = mtimes.count(UNKNOWN_MTIME)
    assert 0 < unknown < len(mtimes) and mtimes[:unknown] == [UNKNOWN_MTIME] * unknown
    reads = CountReads(monkeypatch)
    result = pack(src, dst, update=True, workers=1, progress=False)
    assert result.changes is not None and result.changes.unchanged == unknown == len(reads.paths)
    assert pack(src, dst, update=True, progress=False).already_packed  # known now
    assert_imagefolder(src, dst)


def test_info_shows_the_history(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tree(tmp_path / "src")
    dst = tmp_path / "p"
    assert main(["pack", str(src), str(dst), "--no-progress"]) == 0
    change_tree(src)
    assert main(["pack", str(src), str(dst), "--update", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "+4 / -7 / ~2; +1 class (aardvark); -1 class (emu)" in out
    assert main(["info", str(dst), "--sizes", "0"]) == 0
    out = capsys.readouterr().out
    assert "packed: 18 samples" in out and "updated: +4 / -7 / ~2" in out
    assert main(["info", str(dst), "--json", "--sizes", "0"]) == 0
    history = json.loads(capsys.readouterr().out)["history"]
    assert [h["event"] for h in history] == ["pack", "update"]
    assert main(["pack", str(src), str(dst), "--update", "--no-progress"]) == 0
    assert "up to date" in capsys.readouterr().out


# -- sharded packs ---------------------------------------------------------------------
def test_sharded_update_rewrites_only_the_changed_shards(tmp_path: Path) -> None:
    src = tree(tmp_path / "src", classes=("a", "b", "c", "d"), per_class=4)
    dst = tmp_path / "sh"
    pack_sharded(src, dst, shards=4, progress=False)
    before = {e["name"]: e["pack_id"] for e in json.loads((dst / "index.json").read_text())["shards"]}
    new_image(src / "b" / "img01b.jpg", 70)  # shard 1
    os.remove(src / "c" / "img02.jpg")  # shard 2
    result = pack_sharded(src, dst, update=True, progress=False)
    assert result.changes is not None and (result.changes.added, result.changes.removed) == (1, 1)
    assert [s.kept for s in result.shards] == [True, False, False, True]
    index = json.loads((dst / "index.json").read_text())
    after = {e["name"]: e["pack_id"] for e in index["shards"]}
    assert [before[n] == after[n] for n in sorted(before)] == [True, False, False, True]
    assert [h["event"] for h in index["history"]] == ["pack", "update"]
    assert_imagefolder(src, dst)
    assert verify(dst, progress=False).ok
    new_image(src / "0first" / "x.jpg", 71)  # a class before every other: every shard's labels shift
    assert main(["pack", str(src), str(dst), "--update", "--no-progress"]) == 0
    assert_imagefolder(src, dst)
    assert verify(dst, progress=False).ok
    assert pack_sharded(src, dst, update=True, progress=False).already_packed


def test_sharded_update_names_the_missing_shards(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tree(tmp_path / "src", classes=("a", "b", "c"), per_class=2)
    dst = tmp_path / "sh"
    pack_sharded(src, dst, shards=3, progress=False)
    names = [e["name"] for e in json.loads((dst / "index.json").read_text())["shards"]]
    os.rename(dst / names[1], tmp_path / "elsewhere")
    new_image(src / "a" / "img00b.jpg", 70)
    before = contents(dst / names[0])
    assert main(["pack", str(src), str(dst), "--update", "--no-progress"]) == EXIT_CODES["not a pack"]
    err = capsys.readouterr().err
    assert f"1 of 3 shards is missing: {names[1]}" in err and "copy the missing shard" in err
    assert contents(dst / names[0]) == before and sorted(os.listdir(dst)) == sorted([names[0], names[2], "index.json"])


def test_sharded_update_killed_before_the_index_reads_as_the_old_version(tmp_path: Path) -> None:
    src = tree(tmp_path / "src", classes=("a", "b", "c"), per_class=4)
    dst = tmp_path / "sh"
    pack_sharded(src, dst, shards=3, progress=False)
    old = contents(dst)
    new_image(src / "a" / "new.jpg", 80)
    new_image(src / "c" / "new.jpg", 81)
    code = f"""
import os, signal, sys
sys.path.insert(0, {str(SRC_DIR)!r})
import lmdbfolder.write.shards as shards
shards.write_index = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
shards.pack_sharded({str(src)!r}, {str(dst)!r}, update=True, progress=False)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    # Every shard is updated, the index is the old one: the old version, whole and checked.
    assert contents(dst) == old
    report = verify(dst, progress=False)
    assert report.ok, report.problems
    pack_sharded(src, dst, update=True, progress=False)
    assert_imagefolder(src, dst)


def test_a_sharded_update_refuses_a_forged_shard_before_changing_any(tmp_path: Path) -> None:
    """Issue 34, 1, on the sharded pack: the forged tables of its last shard are refused
    before the update writes a byte of any shard (it once updated the shards before it)."""
    src, dst, shard_dirs = _updated_sharded_pack(tmp_path)
    for shard in shard_dirs:
        with Reader(shard) as r:
            assert r.meta.format_version == 3
    forge_meta(shard_dirs[1], next_record=0)  # valid checksums: only the rules can tell
    before = [(p / "data.mdb").read_bytes() for p in shard_dirs]
    index_before = (dst / "index.json").read_bytes()
    new_image(src / "cat" / "img01.jpg", 202, w=27)  # changes for the first shard too
    new_image(src / "dog" / "img04.jpg", 203, w=28)
    with pytest.raises(NotAPackError, match="not below next_record=0"):
        pack_sharded(src, dst, shards=2, update=True, progress=False)
    assert [(p / "data.mdb").read_bytes() for p in shard_dirs] == before
    assert (dst / "index.json").read_bytes() == index_before


# -- staged work is bound to its file and to a checksum (issue 34, items 2 and 3) ------------
def _stage_and_die(src: Path, dst: Path, k: int = 4) -> None:
    """An update killed after staging ``k`` of the files it reads (committed two at a time)."""
    done = _run_child(src, dst, "read", k)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert os.path.isdir(staging_path(str(dst)))


def _rewrite(path: Path, how: str) -> None:
    """Another image at ``path``: of another size, or of the same size (padded: JPEG ignores
    what follows its end) with a later mtime."""
    st = path.stat()
    if how == "content":
        new_image(path, 99, w=40, h=30)
        return
    data, _ = image_bytes("rgb_jpeg", np.random.default_rng(98), w=8, h=8)
    assert len(data) < st.st_size
    path.write_bytes(data + b"\0" * (st.st_size - len(data)))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert path.stat().st_size == st.st_size


def _damage_staged(staging: Path, how: str, j: int = 1) -> None:
    """Staged file ``j`` of an interrupted update changed in ``<dst>.update`` as a disk or
    someone with access to it could: a byte flipped, another file's value, cut short."""
    from lmdbfolder.format import encode_key

    env = lmdb.open(str(staging), subdir=True, max_dbs=0)
    try:
        with env.begin(write=True) as txn:
            value = bytearray(txn.get(encode_key(j)))
            if how == "flipped":
                value[-20] ^= 0x55
            elif how == "swapped":
                value = bytearray(txn.get(encode_key(j - 1)))
            else:
                value = value[: len(value) // 2]
            txn.put(encode_key(j), bytes(value))
    finally:
        env.close()


@pytest.mark.parametrize("how", ["content", "same size, later mtime"])
def test_a_file_changed_after_it_was_staged_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Issue 34, 2: killed after staging a file, the file changed, the rerun published the
    staged copy (the checkpoint covered paths, not sizes and times)."""
    src = tree(tmp_path / "src", per_class=5)
    dst = tmp_path / "p"
    pack(src, dst, progress=False)
    for k in range(6):
        new_image(src / "dog" / f"new{k}.jpg", 30 + k)
    _stage_and_die(src, dst)  # new0 .. new3 staged
    _rewrite(src / "dog" / "new1.jpg", "content" if how == "content" else "same")
    reads = CountReads(monkeypatch)
    result = pack(src, dst, update=True, workers=1, commit_every=2, progress=False)
    read = sorted(reads.paths)  # before the fresh pack below reads every file (in this process, with threads)
    assert contents(dst) == contents(fresh(src, tmp_path))  # before: new1's old bytes
    assert verify(dst, progress=False).ok
    assert result.resumed_from == 4 and read == ["new1.jpg", "new4.jpg", "new5.jpg"]
    assert pack(src, dst, update=True, progress=False).already_packed  # its size and time are the pack's


@pytest.mark.parametrize("how", ["flipped", "swapped", "cut short"])
def test_a_staged_file_damaged_before_the_rerun_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Issue 34, 3: a staged record altered or damaged before the rerun was published with a
    fresh checksum over the bad bytes (``verify`` failed from then on)."""
    src = tree(tmp_path / "src", per_class=5)
    dst = tmp_path / "p"
    pack(src, dst, progress=False)
    for k in range(6):
        new_image(src / "dog" / f"new{k}.jpg", 30 + k)
    _stage_and_die(src, dst)
    _damage_staged(Path(staging_path(str(dst))), how)
    reads = CountReads(monkeypatch)
    pack(src, dst, update=True, workers=1, commit_every=2, progress=False)
    read = sorted(reads.paths)  # before the fresh pack below reads every file (in this process, with threads)
    assert contents(dst) == contents(fresh(src, tmp_path))
    report = verify(dst, progress=False)
    assert report.ok, report.problems
    assert read == ["new1.jpg", "new4.jpg", "new5.jpg"]


@pytest.mark.parametrize("how", ["changed", "damaged"])
def test_a_sharded_update_never_publishes_a_stale_or_damaged_staged_file(tmp_path: Path, how: str) -> None:
    """Issue 34, 2 and 3 on the sharded pack: each shard's update stages in its own
    ``<shard>.update``, by the same rules."""
    src = tree(tmp_path / "src", classes=("cat", "dog"))
    dst = tmp_path / "sh"
    pack_sharded(src, dst, shards=2, progress=False)
    for k in range(3):
        new_image(src / "cat" / f"new{k}.jpg", 40 + k)
        new_image(src / "dog" / f"new{k}.jpg", 50 + k)
    code = f"""
import os, signal, sys
sys.path.insert(0, {str(SRC_DIR)!r})
import lmdbfolder.write.update as update
update._commit = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
from lmdbfolder import pack_sharded
pack_sharded({str(src)!r}, {str(dst)!r}, shards=2, update=True, progress=False, workers=1)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    first = sorted(p for p in dst.iterdir() if p.is_dir())[0]
    staging = Path(staging_path(str(first)))
    assert staging.is_dir()  # the first shard's files, all staged, killed before its commit
    if how == "changed":
        _rewrite(src / "cat" / "new1.jpg", "content")
    else:
        _damage_staged(staging, "flipped")
    pack_sharded(src, dst, shards=2, update=True, progress=False)
    assert_imagefolder(src, dst)
    report = verify(dst, progress=False)
    assert report.ok, report.problems

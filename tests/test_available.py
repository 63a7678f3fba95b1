"""Issue 34, 7: compaction and sharded updates keep the promise that a reader sees the old
or the new version of a pack, never an error or nothing.

Readers are real DataLoader workers (a new epoch starts new ones, which open the pack
again); interruptions are real ``SIGKILL``s of a child process at a chosen call.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from conftest import assert_imagefolder, new_image, tree
from conftest import reader_view as contents
from lmdbfolder import pack, pack_sharded, verify
from lmdbfolder.format import RETAINED_FILE

SRC_DIR = Path(__file__).resolve().parents[1] / "src"


def _digest(img: Image.Image) -> str:
    return hashlib.sha256(img.tobytes()).hexdigest()


def _remove_most(src: Path, keep: int = 1) -> None:
    """Remove every file of the tree but ``keep`` per class: most of the pack's pages go free."""
    for cls in sorted(os.listdir(src)):
        for name in sorted(os.listdir(src / cls))[keep:]:
            os.remove(src / cls / name)


def test_an_update_that_frees_most_of_the_pack_keeps_the_old_version_readable(tmp_path: Path) -> None:
    """It compacted the file right after the update: the next epoch of a dataset opened
    before it raised PackChangedError ("updated more than once") after one update."""
    from torch.utils.data import DataLoader

    from lmdbfolder.torch import LMDBFolder

    src = tree(tmp_path / "src", classes=("a", "b"), per_class=10, scale=4)
    dst = tmp_path / "p"
    pack(src, dst, progress=False)
    loader = DataLoader(LMDBFolder(str(dst), transform=_digest), batch_size=4, num_workers=1, collate_fn=list)
    old = [s for batch in loader for s in batch]
    _remove_most(src)
    first = pack(src, dst, update=True, progress=False)
    assert first.changes is not None and first.changes.removed == 18
    assert [s for batch in loader for s in batch] == old  # the next epoch: the version it opened
    assert_imagefolder(src, dst)
    renewed = DataLoader(LMDBFolder(str(dst), transform=_digest), batch_size=4, num_workers=1, collate_fn=list)
    new = [s for batch in renewed for s in batch]
    assert len(new) == 2
    # The next update gives the free pages back (the version before the last one ends
    # with it anyway): the dataset opened after the first update still reads its version.
    new_image(src / "a" / "late.jpg", 90)
    second = pack(src, dst, update=True, progress=False)
    assert second.compacted
    assert [s for batch in renewed for s in batch] == new
    with pytest.raises(Exception, match="replaced since this dataset was opened"):
        list(loader)  # two updates since it was opened: told, never served a mix
    assert verify(dst, progress=False).ok
    assert_imagefolder(src, dst)


_KILL_AT_INDEX = """
import os, signal, sys
sys.path.insert(0, {src_dir!r})
import lmdbfolder.write.shards as shards
shards.write_index = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
shards.pack_sharded({src!r}, {dst!r}, update=True, progress=False)
"""


def _killed_before_index(src: Path, dst: Path) -> None:
    code = _KILL_AT_INDEX.format(src_dir=str(SRC_DIR), src=str(src), dst=str(dst))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]


def _shard_names(dst: Path) -> list[str]:
    return sorted(p.name for p in dst.iterdir() if p.is_dir())


def test_a_sharded_update_killed_after_compacting_a_shard_reads_as_the_old_version(tmp_path: Path) -> None:
    """It compacted a shard at the end of its update: killed before the new index.json,
    the pack named a version no shard file held any more, and nothing opened it."""
    src = tree(tmp_path / "src", classes=("a", "b", "c", "d"), per_class=8, scale=4)
    dst = tmp_path / "sh"
    pack_sharded(src, dst, shards=2, progress=False)
    old = contents(dst)
    for cls in ("a", "b"):  # most of shard 0 goes
        for name in sorted(os.listdir(src / cls))[1:]:
            os.remove(src / cls / name)
    _killed_before_index(src, dst)
    assert contents(dst) == old
    report = verify(dst, progress=False)
    assert report.ok, report.problems
    pack_sharded(src, dst, update=True, progress=False)
    after = contents(dst)
    assert_imagefolder(src, dst)
    # The next update compacts shard 0 first (half of it is free pages), then changes it:
    # killed before its index, the pack still reads as the version the index names.
    new_image(src / "a" / "late.jpg", 91)
    _killed_before_index(src, dst)
    assert contents(dst) == after
    assert verify(dst, progress=False).ok
    pack_sharded(src, dst, update=True, progress=False)
    assert_imagefolder(src, dst)


def test_interrupted_sharded_updates_with_source_changes_between_them_read_as_the_old_version(
    tmp_path: Path,
) -> None:
    """Two runs killed before the index, the source changed between them: the second run's
    transaction ended the version the index names (the first run's was the other one LMDB
    keeps), and the pack opened no more. Three runs, and a reader opened before them all."""
    from lmdbfolder import open_pack

    src = tree(tmp_path / "src", classes=("a", "b", "c"), per_class=4)
    dst = tmp_path / "sh"
    pack_sharded(src, dst, shards=3, progress=False)
    old = contents(dst)
    opened = open_pack(dst)  # tables read; each shard is mapped at first read
    for k in range(3):
        new_image(src / "a" / f"new{k}.jpg", 80 + k)  # shard 0 changes in every run
        new_image(src / "c" / "img00.jpg", 84 + k, w=30 + k)  # and shard 2
        _killed_before_index(src, dst)
        assert contents(dst) == old, k
        report = verify(dst, progress=False)
        assert report.ok, (k, report.problems)
    assert [bytes(rec.payload) for rec in opened] == [rec[4] for rec in old["records"]]
    shard0 = dst / _shard_names(dst)[0]
    assert (shard0 / RETAINED_FILE).exists()  # the indexed version, kept until the new index
    pack_sharded(src, dst, update=True, progress=False)
    assert_imagefolder(src, dst)
    assert verify(dst, progress=False).ok
    assert not any((dst / name / RETAINED_FILE).exists() for name in _shard_names(dst))
    # The reader opened before them all mapped the version it opened: it reads it still.
    assert bytes(opened.get(0).payload) == old["records"][0][4]
    opened.close()


# -- issue 34, 10: a huge history table ------------------------------------------------
_CAPPED = """
import resource, sys
sys.path.insert(0, {src_dir!r})
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from lmdbfolder.cli import main
code = main(sys.argv[1:])
print("exit", code)
"""


def _capped(*argv: str) -> subprocess.CompletedProcess[str]:
    code = _CAPPED.format(src_dir=str(SRC_DIR))
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300)


def test_info_verify_and_update_of_a_pack_with_a_150_mb_history_fit_in_3_gb(tmp_path: Path) -> None:
    """A 150 MB ``__history__`` (valid checksums; one entry a list of 40 million short strings) made
    ``info`` use 4.4 GB: under a 3 GB address-space cap, info, verify and update died with
    MemoryError. Only the entries kept are parsed (the first and the last, within a budget);
    a ``truncated`` entry counts the others."""
    from conftest import forge_table
    from lmdbfolder import Reader
    from lmdbfolder.format import HISTORY_KEY

    src = tree(tmp_path / "src", classes=("a", "b"), per_class=3)
    dst = tmp_path / "p"
    pack(src, dst, progress=False)
    with Reader(dst) as r:
        first = r.history()[0]
    junk = b'{"event":"update","at":"2026-01-01T00:00:00Z","count":6,"junk":[' + b'"ab",' * (38 << 20) + b"0]}"
    last = b'{"event":"update","at":"2026-01-02T00:00:00Z","count":6,"added":1}'
    forge_table(dst, HISTORY_KEY, b"[" + json.dumps(first).encode() + b"," + junk + b"," + last + b"]")
    del junk
    assert (dst / "data.mdb").stat().st_size > 150 << 20
    shown = _capped("info", str(dst))
    assert shown.returncode == 0 and "exit 0" in shown.stdout, shown.stderr[-2000:]
    assert "1 earlier events not kept" in shown.stdout
    checked = _capped("verify", str(dst), "--no-progress")
    assert checked.returncode == 0 and "exit 0" in checked.stdout, checked.stderr[-2000:]
    new_image(src / "a" / "late.jpg", 92)
    updated = _capped("pack", str(src), str(dst), "--update", "--no-progress")
    assert updated.returncode == 0 and "exit 0" in updated.stdout, updated.stderr[-2000:]
    with Reader(dst) as r:
        events = [e["event"] for e in r.history()]
    assert events == ["pack", "truncated", "update", "update"]
    assert verify(dst, progress=False).ok
    assert_imagefolder(src, dst)

"""The pack directory: what a path is, what may be replaced, and every command on sharded packs.

Each test here is a bug found when the project was tried as a user and an
adversarial tester would (issue 9): commands that deleted what was not
theirs, and commands that did not work on sharded packs.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path

import lmdb
import pytest

from conftest import make_small_tree, write
from lmdbfolder import copy_pack, pack, pack_sharded, verify
from lmdbfolder.cli import EXIT_CODES, main
from lmdbfolder.errors import NotAPackError, OutputExistsError
from lmdbfolder.packdir import Kind, inspect, require_pack, why_not_replaceable


def _tree_snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def precious(tmp_path: Path) -> Path:
    """A user's folder that happens to hold a file named data.mdb (and index.json)."""
    root = tmp_path / "precious"
    write(root / "data.mdb", b"not a database of ours")
    write(root / "thesis.tex", b"do not delete")
    write(root / "photos" / "cat.jpg", b"\xff\xd8 a cat")
    return root


@pytest.fixture
def sharded(small_tree: Path, tmp_path: Path) -> Path:
    pack_sharded(small_tree, tmp_path / "sh", shards=2, progress=False)
    return tmp_path / "sh"


def test_copy_overwrite_never_deletes_a_folder_that_is_not_a_pack(
    small_pack: Path, precious: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _tree_snapshot(precious)
    assert main(["copy", str(small_pack), str(precious), "--overwrite"]) == EXIT_CODES["output exists"]
    err = capsys.readouterr().err
    assert "not provably an lmdbfolder pack" in err and "thesis.tex" in err
    assert _tree_snapshot(precious) == before
    # pack --overwrite says the same, through the same owner
    assert main(["pack", "--no-progress", str(small_pack.parent / "small"), str(precious), "--overwrite"]) == 4
    assert "thesis.tex" in capsys.readouterr().err
    assert _tree_snapshot(precious) == before
    # ... also when the folder holds index.json instead of data.mdb
    (precious / "data.mdb").rename(precious / "index.json")
    before = _tree_snapshot(precious)
    assert main(["copy", str(small_pack), str(precious), "--overwrite"]) == EXIT_CODES["output exists"]
    assert _tree_snapshot(precious) == before


def test_overwrite_refuses_another_programs_lmdb(small_tree: Path, small_pack: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.lmdb"
    env = lmdb.open(str(other), map_size=1 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"user-key", b"user data")
    env.close()
    assert "did not write" in (why_not_replaceable(other) or "")
    with pytest.raises(OutputExistsError, match="did not write"):
        pack(small_tree, other, overwrite=True, progress=False)
    with pytest.raises(OutputExistsError, match="did not write"):
        copy_pack(small_pack, other, overwrite=True)
    env = lmdb.open(str(other), readonly=True, lock=False)
    with env.begin() as txn:
        assert txn.get(b"user-key") == b"user data"
    env.close()
    # our own pack is replaced fine, by pack and by copy
    pack(small_tree, tmp_path / "ours", progress=False)
    assert why_not_replaceable(tmp_path / "ours") is None
    copy_pack(small_pack, tmp_path / "ours", overwrite=True)
    pack(small_tree, tmp_path / "ours", overwrite=True, progress=False)


def test_copy_of_a_shard_onto_its_sharded_parent_is_refused(sharded: Path) -> None:
    shard = next(p for p in sharded.iterdir() if p.is_dir())
    before = _tree_snapshot(sharded)
    with pytest.raises(OutputExistsError, match="overlaps the source"):
        copy_pack(shard, sharded, overwrite=True)
    with pytest.raises(OutputExistsError, match="overlaps the source"):
        copy_pack(sharded, shard, overwrite=True)
    with pytest.raises(OutputExistsError, match="overlaps the source"):
        copy_pack(sharded, sharded, overwrite=True)
    assert _tree_snapshot(sharded) == before


def test_copy_onto_a_symlink_is_refused_and_leaves_nothing_behind(small_pack: Path, tmp_path: Path) -> None:
    target = tmp_path / "target"
    pack(tmp_path / "small", target, progress=False)
    link = tmp_path / "link"
    link.symlink_to(target)
    before = _tree_snapshot(target)
    with pytest.raises(OutputExistsError, match="symbolic link"):
        copy_pack(small_pack, link, overwrite=True)
    assert link.is_symlink() and _tree_snapshot(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "small", "small.lmdb", "target"]
    with pytest.raises(OutputExistsError, match="symbolic link"):
        pack(tmp_path / "small", link, overwrite=True, progress=False)
    assert _tree_snapshot(target) == before


def test_copy_keeps_a_dot_copying_that_is_not_ours(small_pack: Path, tmp_path: Path) -> None:
    stranger = tmp_path / "dst.copying"
    write(stranger / "notes.txt", b"someone else's")
    with pytest.raises(OutputExistsError, match="not left by lmdbfolder"):
        copy_pack(small_pack, tmp_path / "dst")
    assert (stranger / "notes.txt").read_bytes() == b"someone else's"
    assert not (tmp_path / "dst").exists()
    # one left by an interrupted copy of ours is cleaned up and the copy goes on
    os.remove(stranger / "notes.txt")
    os.rmdir(stranger)
    from lmdbfolder.packdir import make_temp_dir

    make_temp_dir(str(stranger))
    write(stranger / "data.mdb", b"half a copy")
    assert copy_pack(small_pack, tmp_path / "dst").count == 12
    assert not stranger.exists()


def test_a_pack_and_a_copy_at_a_path_that_is_not_utf8(small_tree: Path, small_pack: Path, tmp_path: Path) -> None:
    # A file name of bytes that are not UTF-8 (os.fsdecode gives lone surrogates): LMDB
    # took the path as UTF-8 text, and copy, pack and update there ended in a UnicodeEncodeError.
    copied = tmp_path / os.fsdecode(b"copy-\xff")
    assert copy_pack(small_pack, copied).count == 12
    packed = tmp_path / os.fsdecode(b"pack-\xfe")
    assert pack(small_tree, packed, progress=False).count == 12
    write(small_tree / "class0" / "extra.jpg", (small_tree / "class1" / "img0.jpg").read_bytes())
    assert pack(small_tree, packed, update=True, progress=False).count == 13
    for path in (copied, packed):
        assert verify(path, progress=False).ok


def test_commands_print_a_path_that_is_not_utf8(
    small_pack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Under a UTF-8 locale stdout is strict: a name with a lone surrogate raised
    # UnicodeEncodeError in the summary line, after the work was done.
    copied = tmp_path / os.fsdecode(b"copy-\xff")
    assert main(["copy", str(small_pack), str(copied), "--no-progress"]) == 0
    assert main(["export", str(copied), str(tmp_path / os.fsdecode(b"files-\xfe")), "--no-progress"]) == 0
    assert main(["show", str(copied), "-o", str(tmp_path / os.fsdecode(b"sheet-\xfd.png"))]) == 0
    out = capsys.readouterr().out
    assert "copy-\\udcff" in out and "files-\\udcfe" in out and "sheet-\\udcfd.png" in out
    assert sorted(os.listdir(os.fsencode(tmp_path))) == [
        b"copy-\xff",
        b"files-\xfe",
        b"sheet-\xfd.png",
        b"small",
        b"small.lmdb",
    ]


def test_a_destination_below_a_file_is_named_with_what_to_do(
    small_pack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # makedirs says 'File exists' (EEXIST) when a folder on the way is a file: the hint
    # was 'check that the disk is present and healthy'.
    file = write(tmp_path / "notes.txt", b"mine")
    for argv, code in (
        (["copy", str(small_pack), str(file / "copy")], EXIT_CODES["pack failed"]),
        (["show", str(small_pack), "-o", str(file / "sheet.png")], EXIT_CODES["other error"]),
    ):
        assert main(argv) == code
        err = capsys.readouterr().err
        assert str(file) in err and "a file is already there" in err and "healthy" not in err
    assert file.read_bytes() == b"mine"


def test_every_command_works_on_a_sharded_pack(
    small_tree: Path, sharded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["warm", str(sharded), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    size = sum(os.path.getsize(p / "data.mdb") for p in sharded.iterdir() if p.is_dir())
    assert report["nbytes"] == size and report["path"] == str(sharded)
    assert main(["info", str(sharded), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_shards"] == 2
    assert main(["verify", str(sharded)]) == 0
    assert ": OK" in capsys.readouterr().out
    assert main(["copy", str(sharded), str(tmp_path / "copy"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["shards"] == 2
    argv = ["bench", str(small_tree), str(sharded), "--workers", "0", "--limit", "8", "--repeat", "1"]
    assert main([*argv, "--warm-only", "--no-chart", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["pack"]["path"] == str(sharded) and result["measurements"]
    # and the index command on a sharded pack whose index was lost
    os.remove(sharded / "index.json")
    assert main(["warm", str(sharded)]) == EXIT_CODES["not a pack"]
    assert "run `lmdbfolder index" in capsys.readouterr().err
    assert main(["index", str(sharded)]) == 0
    assert main(["warm", str(sharded), "--no-progress"]) == 0


def test_hints_say_what_the_path_is(small_tree: Path, tmp_path: Path) -> None:
    assert inspect(tmp_path / "nothing").kind is Kind.MISSING
    assert inspect(small_tree).kind is Kind.OTHER
    with pytest.raises(NotAPackError, match="pack it first with `lmdbfolder pack"):
        require_pack(small_tree)
    pack_sharded(small_tree, tmp_path / "half", shards=3, shard_index=1, progress=False)
    assert inspect(tmp_path / "half").kind is Kind.UNFINISHED_SHARDED
    with pytest.raises(NotAPackError, match="rerun the same `lmdbfolder pack"):
        require_pack(tmp_path / "half")


def _size(img: object) -> object:
    return img.size  # type: ignore[attr-defined]


def _as_list(batch: list[object]) -> list[object]:
    return batch


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_batched_dataloader_reads_a_sharded_pack(small_tree: Path, tmp_path: Path, context: str) -> None:
    from torch.utils.data import DataLoader

    from lmdbfolder.torch import LMDBFolder

    make_small_tree(tmp_path / "t", classes=3, per_class=7)
    pack_sharded(tmp_path / "t", tmp_path / "sh", shards=3, progress=False)
    ds = LMDBFolder(tmp_path / "sh", transform=_size)
    expected = Counter((ds[i][0], ds.targets[i]) for i in range(len(ds)))
    loader = DataLoader(
        ds,
        batch_size=4,
        shuffle=True,
        num_workers=2,
        multiprocessing_context=context,
        collate_fn=_as_list,
    )
    for _ in range(2):
        seen = Counter((size, int(t)) for batch in loader for size, t in batch)
        assert seen == expected and sum(seen.values()) == len(ds) == 21


def test_sharded_get_many_keeps_the_order_asked(sharded: Path) -> None:
    from lmdbfolder import open_pack

    with open_pack(sharded) as r:
        order = [11, 0, 6, 5, 3, 10, 0]
        assert [rec.index for rec in r.get_many(order)] == order
        assert [bytes(rec.payload) for rec in r.get_many(order)] == [r.read_bytes(i) for i in order]


def test_names_on_disk_live_only_in_format() -> None:
    import lmdbfolder

    names = ['".partial"', '".copying"', '".old-"', '"skipped.txt"', '".sync-probe"', '"compact.tmp"']
    names += ['".index.json.tmp"', '"data.mdb"', '"lock.mdb"', '"index.json"', '".lmdbfolder-temp"']
    names += ['".parts"', '".needs-"']
    root = Path(lmdbfolder.__file__).parent
    for path in root.rglob("*.py"):
        if path.relative_to(root).parts == ("format", "names.py"):
            continue
        text = path.read_text()
        for name in names:
            assert not re.search(re.escape(name), text), f"{path} spells {name}; use the constant in format/names.py"

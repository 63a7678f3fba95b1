"""Sharded packs: the split, the index, reading through Reader/LMDBFolder, Slurm-style
packing one shard at a time, resume and bad files, damaged sets, copy."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import warnings
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import forge_meta, make_small_tree, write
from lmdbfolder import ShardedReader, open_pack, pack, pack_info, pack_sources, verify
from lmdbfolder.cli import EXIT_CODES, main
from lmdbfolder.errors import NotAPackError, OptionError, OutputExistsError, SkippedFilesWarning, SourceError
from lmdbfolder.format import SHARD_INDEX_FILE, parse_shard_name, shard_name
from lmdbfolder.read.reader import Reader
from lmdbfolder.tools.copy import copy_pack
from lmdbfolder.write.shards import (
    choose_num_shards,
    pack_shard,
    pack_sharded,
    parse_size,
    plan_split,
    shard_field,
    shard_sources,
    write_index,
)
from lmdbfolder.write.sources import scan


@given(st.integers(1, 10_000), st.integers(1, 300))
def test_split_is_contiguous_balanced_and_complete(total: int, shards: int) -> None:
    if shards > total:
        with pytest.raises(ValueError):
            plan_split(total, shards)
        return
    ranges = plan_split(total, shards)
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_shard_names_and_sizes() -> None:
    assert shard_name("train", 3, 8) == "train-00003-of-00008.lmdb"
    assert shard_name("val", 5, 123456) == "val-000005-of-123456.lmdb"
    assert parse_shard_name("train-00003-of-00008.lmdb") == ("train", 3, 8)
    assert parse_shard_name("my-set-00000-of-00001.lmdb") == ("my-set", 0, 1)
    for bad in ("train-00008-of-00008.lmdb", "train-3-of-8.lmdb", "x-00001-of-00002", "a/b-00001-of-00002.lmdb"):
        assert parse_shard_name(bad) is None, bad
    with pytest.raises(ValueError):
        shard_name("../x", 0, 1)
    assert parse_size("4GB") == 4 * 10**9 and parse_size("2GiB") == 2 << 30 and parse_size("500M") == 500 * 10**6
    assert parse_size("1234") == 1234 and parse_size(" 1.5 kb ") == 1500
    for bad in ("", "4 XB", "-1", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_shard_size_chooses_the_count(small_tree: Path) -> None:
    sources = scan(str(small_tree))
    total = sum(os.path.getsize(sources.abspath(i)) for i in range(len(sources)))
    assert choose_num_shards(sources, shard_size=10**12) == 1
    assert choose_num_shards(sources, shard_size=total // 3) in (3, 4)
    with pytest.raises(SourceError, match="into 13 shards"):
        choose_num_shards(sources, shards=13)


def _same_as_single(single: Path, sharded: Path) -> None:
    from lmdbfolder.torch import LMDBFolder

    a, b = LMDBFolder(single), LMDBFolder(sharded)
    assert len(a) == len(b)
    assert (a.classes, a.class_to_idx, a.targets, a.samples) == (b.classes, b.class_to_idx, b.targets, b.samples)
    for i in range(len(a)):
        (ia, ta), (ib, tb) = a[i], b[i]
        assert ta == tb and ia.size == ib.size and ia.tobytes() == ib.tobytes(), i
        ra, rb = a.reader.get(i), b.reader.get(i)
        assert bytes(ra.payload) == bytes(rb.payload) and (ra.encoding, ra.label) == (rb.encoding, rb.label)
        assert rb.index == i
    a.reader.close()
    b.reader.close()


@pytest.mark.parametrize("store", ["encoded", "raw"])
def test_sharded_equals_single_pack_sample_for_sample(odd_tree: Path, tmp_path: Path, store: str) -> None:
    pack(odd_tree, tmp_path / "single", store=store, progress=False)
    result = pack_sharded(odd_tree, tmp_path / "sharded", shards=4, store=store, progress=False)
    assert [s.name for s in result.shards] == [shard_name("train", i, 4) for i in range(4)]
    assert result.count == len(open_pack(tmp_path / "single"))
    for shard in result.shards:  # every shard is an ordinary pack by itself
        assert verify(shard.path).ok
    _same_as_single(tmp_path / "single", tmp_path / "sharded")
    reader = open_pack(tmp_path / "sharded")
    assert isinstance(reader, ShardedReader) and reader.num_shards == 4
    assert reader.shard_offsets[0] == 0 and reader.shard_offsets[-1] == len(reader)
    assert reader.locate(reader.shard_offsets[2]) == (2, 0)
    assert reader.get(-1).index == len(reader) - 1
    assert reader.index_of(reader.path_of(5)) == 5
    clone = pickle.loads(pickle.dumps(reader))
    assert bytes(clone.get(7).payload) == bytes(reader.get(7).payload)
    with pytest.raises(IndexError):
        reader.get(len(reader))


def test_skipped_files_shift_counts_and_the_index_follows(tmp_path: Path) -> None:
    tree = make_small_tree(tmp_path / "t", classes=3, per_class=6)
    write(tree / "class0" / "img00_bad.jpg", b"not a jpeg")  # shard 0
    write(tree / "class2" / "img9_bad.jpg", b"")  # last shard
    pack(tree, tmp_path / "single", progress=False)
    result = pack_sharded(tree, tmp_path / "sh", shards=3, progress=False)
    assert [p for p, _ in result.skipped] == ["class0/img00_bad.jpg", "class2/img9_bad.jpg"]
    index = json.loads((tmp_path / "sh" / SHARD_INDEX_FILE).read_text())
    # 20 sources split 6/7/7; one bad file in the first shard and one in the last
    assert [s["sources"] for s in index["shards"]] == [6, 7, 7]
    assert [s["count"] for s in index["shards"]] == [5, 7, 6]
    assert [s["first_index"] for s in index["shards"]] == [0, 5, 12]
    assert index["count"] == 18 and index["skipped"] == 2
    _same_as_single(tmp_path / "single", tmp_path / "sh")


def test_slurm_style_one_shard_per_job_then_index(
    small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dst = tmp_path / "sh"
    base = ["pack", str(small_tree), str(dst), "--shards", "3", "--no-progress"]
    for i in (2, 0):  # jobs finish in any order
        assert main([*base, "--shard-index", str(i)]) == 0
        assert f"lmdbfolder index {dst}" in capsys.readouterr().out
    (dst / (shard_name("train", 1, 3) + ".partial")).mkdir()  # a job still running
    assert main(["index", str(dst)]) == EXIT_CODES["not a pack"]
    err = capsys.readouterr().err
    assert "1 of 3 shards is missing: train-00001-of-00003.lmdb (unfinished)" in err
    with pytest.raises(NotAPackError, match="no train-00001|unfinished sharded pack"):
        open_pack(dst)
    os.rmdir(dst / (shard_name("train", 1, 3) + ".partial"))
    assert main([*base, "--shard-index", "1"]) == 0
    assert main([*base, "--shard-index", "1"]) == 0  # rerun: the finished shard is kept
    assert "already packed" in capsys.readouterr().out
    assert main(["index", str(dst), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["count"] == 12
    pack(small_tree, tmp_path / "single", progress=False)
    _same_as_single(tmp_path / "single", dst)
    # usage errors
    assert main([*base, "--shard-index", "3"]) == EXIT_CODES["usage"]
    assert main(["pack", str(small_tree), str(tmp_path / "x"), "--shard-index", "0"]) == EXIT_CODES["usage"]
    capsys.readouterr()


def test_index_refuses_shards_of_another_scan(small_tree: Path, tmp_path: Path) -> None:
    other = make_small_tree(tmp_path / "other", classes=3, per_class=5, seed=3)
    pack_sharded(small_tree, tmp_path / "a", shards=2, shard_index=0, progress=False)
    pack_sharded(other, tmp_path / "b", shards=2, shard_index=1, progress=False)
    name = shard_name("train", 1, 2)
    shutil.move(tmp_path / "b" / name, tmp_path / "a" / name)
    with pytest.raises(NotAPackError, match="does not belong to this split") as info:
        write_index(tmp_path / "a")
    assert name in str(info.value)


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (["--store", "raw"], "with --store raw, train-00000-of-00002.lmdb with --store encoded"),
        (["--max-size", "8"], "with --max-size 8, train-00000-of-00002.lmdb without --max-size"),
        (["--check", "decode"], "with --check decode, train-00000-of-00002.lmdb with --check header"),
    ],
)
def test_index_refuses_shards_packed_with_other_options(
    small_tree: Path, tmp_path: Path, capsys, options: list[str], said: str
) -> None:
    """Shards of one split packed with different options (one Slurm job started with another
    --max-size) hold different kinds of records: index names the shard and the option."""
    base = ["pack", str(small_tree), str(tmp_path / "a"), "--shards", "2", "--no-progress"]
    assert main([*base, "--shard-index", "0"]) == 0
    assert main([*base, "--shard-index", "1", *options]) == 0
    capsys.readouterr()
    assert main(["index", str(tmp_path / "a")]) == EXIT_CODES["not a pack"]
    err = capsys.readouterr().err
    assert "train-00001-of-00002.lmdb" in err and said in err
    assert not (tmp_path / "a" / SHARD_INDEX_FILE).exists()


def test_index_says_how_many_source_files_the_split_has(small_tree: Path, tmp_path: Path) -> None:
    # Shard 1 claims 5 of the split's 12 source files, where the plan gives it 6:
    # the shards then cover 11, and the error must name the split's 12 files
    # (it once named the shard count, 2, as if it were a number of files).
    sources = scan(small_tree)
    pack_shard(sources, tmp_path / "a", 0, 2, progress=False)
    claim = shard_field(sources, 1, 2)
    claim["sources"] = 5
    part = shard_sources(sources, 6, 11)
    pack_sources(part, tmp_path / "a" / shard_name("train", 1, 2), manifest_extra={"shard": claim}, progress=False)
    with pytest.raises(NotAPackError, match="the shards cover 11 source files, the split has 12") as info:
        write_index(tmp_path / "a")
    assert "--shards 2" in info.value.hint


def test_interrupted_sharded_pack_resumes_and_keeps_finished_shards(tmp_path: Path) -> None:
    tree = make_small_tree(tmp_path / "t", classes=4, per_class=5)
    write(tree / "class2" / "img2_bad.jpg", b"truncated")  # in shard 2 of 4
    with pytest.raises(SourceError, match="img2_bad.jpg"):
        pack_sharded(tree, tmp_path / "sh", shards=4, strict=True, commit_every=1, progress=False)
    names = sorted(os.listdir(tmp_path / "sh"))
    assert names == [shard_name("train", 0, 4), shard_name("train", 1, 4), shard_name("train", 2, 4) + ".partial"]
    result = pack_sharded(tree, tmp_path / "sh", shards=4, commit_every=1, progress=False)  # now skipping
    assert [s.kept for s in result.shards] == [True, True, False, False]
    assert result.shards[2].resumed_from > 0
    assert [p for p, _ in result.skipped] == ["class2/img2_bad.jpg"]
    pack(tree, tmp_path / "single", progress=False)
    _same_as_single(tmp_path / "single", tmp_path / "sh")
    assert pack_sharded(tree, tmp_path / "sh", shards=4, progress=False).already_packed  # nothing to do
    with pytest.raises(OutputExistsError, match="finished sharded pack of other sources or options"):
        pack_sharded(tree, tmp_path / "sh", shards=4, check="decode", progress=False)
    os.remove(tmp_path / "sh" / SHARD_INDEX_FILE)  # as if the last run stopped before the index
    with pytest.raises(OutputExistsError, match="another split"):
        pack_sharded(tree, tmp_path / "sh", shards=2, progress=False)
    assert pack_sharded(tree, tmp_path / "sh", shards=2, restart=True, progress=False).count == 20
    with pytest.raises(OutputExistsError, match="single"):
        pack_sharded(tree, tmp_path / "single", shards=2, progress=False)
    (tmp_path / "junk").mkdir()
    write(tmp_path / "junk" / "notes.txt", b"mine")
    with pytest.raises(OutputExistsError, match="other files"):
        pack_sharded(tree, tmp_path / "junk", shards=2, overwrite=True, progress=False)


def test_missing_truncated_and_replaced_shards_are_named(
    small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pack_sharded(small_tree, tmp_path / "sh", shards=3, commit_every=1, progress=False)
    dst = tmp_path / "sh"
    # replaced by a shard with other content under the same name
    other = make_small_tree(tmp_path / "other", classes=3, per_class=4, seed=9)
    pack_sharded(other, tmp_path / "o", shards=3, progress=False)
    name1 = shard_name("train", 1, 3)
    shutil.rmtree(dst / name1)
    shutil.copytree(tmp_path / "o" / name1, dst / name1)
    reader = open_pack(dst)
    reader.get(0)  # shard 0 is fine and is the only one opened
    with pytest.raises(NotAPackError, match="pack_id differs from the index") as info:
        reader.get(reader.shard_offsets[1])
    assert name1 in str(info.value)
    report = verify(dst)
    assert not report.ok and any(name1 in p.message for p in report.problems)
    assert main(["verify", str(dst), "--no-progress"]) == EXIT_CODES["problems found"]
    capsys.readouterr()
    # truncated
    name2 = shard_name("train", 2, 3)
    data = dst / name2 / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    with pytest.raises(NotAPackError, match="truncated") as info:
        open_pack(dst).get(len(reader) - 1)
    assert name2 in str(info.value)
    assert any(name2 in p.message and "truncated" in p.message for p in verify(dst).problems)
    # missing
    shutil.rmtree(dst / name2)
    with pytest.raises(NotAPackError, match="1 of 3 shards is missing") as info:
        open_pack(dst)
    assert name2 in str(info.value)
    assert main(["info", str(dst)]) == EXIT_CODES["not a pack"]
    assert name2 in capsys.readouterr().err


def test_info_verify_and_copy_of_a_sharded_pack(
    small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["pack", str(small_tree), str(tmp_path / "sh"), "--shards", "2", "--no-progress"]) == 0
    assert "as 2 shards" in capsys.readouterr().out
    info = pack_info(tmp_path / "sh")
    assert (info["count"], info["num_shards"], info["format"]) == (12, 2, "lmdbfolder-shards")
    assert main(["info", str(tmp_path / "sh")]) == 0
    assert "shards:" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "sh"), "--json", "--decode"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["checked"] == 12
    assert main(["copy", str(tmp_path / "sh"), str(tmp_path / "copy"), "--verify"]) == 0
    assert "copied 12 images (2 shards)" in capsys.readouterr().out
    assert verify(tmp_path / "copy").ok
    assert main(["copy", str(tmp_path / "sh"), str(tmp_path / "copy")]) == EXIT_CODES["output exists"]
    capsys.readouterr()
    _same_as_single(tmp_path / "sh", tmp_path / "copy")


def test_copy_single_pack_compacts_and_refuses_damage(small_tree: Path, tmp_path: Path) -> None:
    pack(small_tree, tmp_path / "p", commit_every=1, progress=False)
    result = copy_pack(tmp_path / "p", tmp_path / "c")
    assert result.count == 12 and result.bytes_after <= result.bytes_before
    assert not (tmp_path / "c.copying").exists() and not (tmp_path / "c" / "lock.mdb").exists()
    _same_as_single(tmp_path / "p", tmp_path / "c")
    with pytest.raises(OutputExistsError):
        copy_pack(tmp_path / "p", tmp_path / "c")
    copy_pack(tmp_path / "p", tmp_path / "c", overwrite=True)
    os.truncate(tmp_path / "p" / "data.mdb", (tmp_path / "p" / "data.mdb").stat().st_size // 2)
    with pytest.raises(NotAPackError, match="truncated"):
        copy_pack(tmp_path / "p", tmp_path / "d")
    assert not (tmp_path / "d").exists() and not (tmp_path / "d.copying").exists()


def test_staging_builds_shards_elsewhere(small_tree: Path, tmp_path: Path) -> None:
    result = pack_sharded(small_tree, tmp_path / "sh", shards=2, staging=tmp_path / "local", progress=False)
    assert result.count == 12 and os.listdir(tmp_path / "local") == []
    pack(small_tree, tmp_path / "single", progress=False)
    _same_as_single(tmp_path / "single", tmp_path / "sh")


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_open_shards_lazily(small_tree: Path, tmp_path: Path, context: str) -> None:
    from torch.utils.data import DataLoader
    from torchvision import transforms as T

    from lmdbfolder.torch import LMDBFolder

    pack_sharded(small_tree, tmp_path / "sh", shards=3, progress=False)
    ds = LMDBFolder(tmp_path / "sh", transform=T.PILToTensor())
    expected = Counter((hashlib.sha1(ds[i][0].numpy().tobytes()).hexdigest(), ds.targets[i]) for i in range(len(ds)))
    loader = DataLoader(
        ds, batch_size=None, shuffle=True, num_workers=2, persistent_workers=True, multiprocessing_context=context
    )
    for _ in range(2):
        seen = Counter((hashlib.sha1(x.numpy().tobytes()).hexdigest(), int(t)) for x, t in loader)
        assert seen == expected


@pytest.mark.parametrize(
    ("field", "value"),
    [("sources", "6"), ("sources", [6]), ("first_source", "0"), ("total_sources", [12]), ("index", True)],
)
@pytest.mark.parametrize("which", [0, 1])
def test_index_refuses_a_shard_field_of_the_wrong_type_naming_the_shard(
    small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], which: int, field: str, value: object
) -> None:
    # A forged or damaged `shard` manifest field once crashed `lmdbfolder index`
    # with a TypeError traceback (sources="6" added to an int).
    pack_sharded(small_tree, tmp_path / "sh", shards=2, progress=False)
    os.unlink(tmp_path / "sh" / SHARD_INDEX_FILE)
    shard = tmp_path / "sh" / shard_name("train", which, 2)
    with Reader(shard) as r:
        info = dict(r.meta["shard"])
    info[field] = value
    forge_meta(shard, shard=info)
    assert main(["index", str(tmp_path / "sh")]) == EXIT_CODES["not a pack"]
    err = capsys.readouterr().err
    assert shard.name in err and f"shard.{field}" in err and "Traceback" not in err
    assert not (tmp_path / "sh" / SHARD_INDEX_FILE).exists()


@pytest.mark.parametrize("value", ["shard", [0, 2], 7])
def test_index_says_a_shard_field_that_is_no_object_is_invalid(small_tree: Path, tmp_path: Path, value: object) -> None:
    pack_sharded(small_tree, tmp_path / "sh", shards=2, progress=False)
    os.unlink(tmp_path / "sh" / SHARD_INDEX_FILE)
    shard = tmp_path / "sh" / shard_name("train", 1, 2)
    forge_meta(shard, shard=value)
    with pytest.raises(NotAPackError, match="the `shard` field is not an object") as info:
        write_index(tmp_path / "sh")
    assert shard.name in str(info.value)


@pytest.mark.parametrize("count", [99, 5, 0])
def test_index_refuses_a_shard_whose_tables_do_not_hold_its_count(small_tree: Path, tmp_path: Path, count: int) -> None:
    # The index sums the shards' counts: a manifest that claims more (or fewer)
    # samples than its label and path tables hold was once written into it.
    pack_sharded(small_tree, tmp_path / "sh", shards=2, progress=False)
    os.unlink(tmp_path / "sh" / SHARD_INDEX_FILE)
    shard = tmp_path / "sh" / shard_name("train", 1, 2)
    forge_meta(shard, count=count)
    with pytest.raises(NotAPackError, match=f"its manifest says count={count}, its tables hold 6 samples") as info:
        write_index(tmp_path / "sh")
    assert shard.name in str(info.value)
    assert not (tmp_path / "sh" / SHARD_INDEX_FILE).exists()


def test_a_sharded_update_warns_of_the_files_it_skipped_as_a_single_one_does(small_tree: Path, tmp_path: Path) -> None:
    # pack(update=True) warned (SkippedFilesWarning); pack_sharded(update=True) said nothing.
    pack_sharded(small_tree, tmp_path / "sh", shards=2, progress=False)
    pack(small_tree, tmp_path / "single", progress=False)
    write(small_tree / "class1" / "zz_cut.jpg", b"not an image")
    for run, dst in ((pack, "single"), (pack_sharded, "sh")):
        shards = {"shards": 2} if run is pack_sharded else {}
        with pytest.warns(SkippedFilesWarning, match="1 source file could not be packed .*class1/zz_cut.jpg"):
            result = run(small_tree, tmp_path / dst, update=True, progress=False, **shards)
        assert result.skipped == [("class1/zz_cut.jpg", result.skipped[0][1])]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing changed: nothing new to say
            assert run(small_tree, tmp_path / dst, update=True, progress=False, **shards).already_packed


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("skipped_count", [1]),
        ("skipped_count", "3"),
        ("payload_bytes", "abc"),
        ("encodings", {"jpeg": "x"}),
        ("encodings", ["jpeg"]),
    ],
)
def test_index_refuses_a_shard_whose_manifest_fields_it_sums_have_the_wrong_type(
    small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, value: object
) -> None:
    # write_index sums the shards' skipped_count, payload_bytes and encodings: a list or
    # a string there crashed it with a TypeError traceback (or, "3", was counted).
    pack_sharded(small_tree, tmp_path / "sh", shards=2, progress=False)
    os.unlink(tmp_path / "sh" / SHARD_INDEX_FILE)
    shard = tmp_path / "sh" / shard_name("train", 1, 2)
    forge_meta(shard, **{field: value})
    assert main(["index", str(tmp_path / "sh")]) == EXIT_CODES["not a pack"]
    err = capsys.readouterr().err
    assert shard.name in err and field in err and "Traceback" not in err
    assert not (tmp_path / "sh" / SHARD_INDEX_FILE).exists()


def test_index_does_not_replace_the_index_of_another_split(
    small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Two splits' shards in one DST: `index --prefix val` silently replaced train's
    # index.json with val's (and carried train's history into it).
    other = make_small_tree(tmp_path / "other", classes=2, per_class=3, seed=3)
    for i in (0, 1):
        pack_sharded(small_tree, tmp_path / "sh", shards=2, shard_index=i, progress=False)
        pack_sharded(other, tmp_path / "sh", shards=2, shard_index=i, prefix="val", progress=False)
    assert main(["index", str(tmp_path / "sh"), "--prefix", "train"]) == 0
    before = (tmp_path / "sh" / SHARD_INDEX_FILE).read_bytes()
    capsys.readouterr()
    assert main(["index", str(tmp_path / "sh"), "--prefix", "val"]) == EXIT_CODES["output exists"]
    err = capsys.readouterr().err
    assert "train-*" in err and "val-*" in err and "own folder" in err
    assert (tmp_path / "sh" / SHARD_INDEX_FILE).read_bytes() == before
    assert main(["index", str(tmp_path / "sh"), "--prefix", "train"]) == 0  # its own split: written again


def test_an_index_that_lists_shards_out_of_their_order_is_refused(small_tree: Path, tmp_path: Path) -> None:
    # Swapping two entries of index.json (each still matching its shard's digests) read the
    # samples in another order without a word; each shard records its place in the split.
    result = pack_sharded(small_tree, tmp_path / "s", shards=3, progress=False)
    index_file = tmp_path / "s" / SHARD_INDEX_FILE
    index = json.loads(index_file.read_text())
    first, second = index["shards"][0], index["shards"][1]
    index["shards"][0], index["shards"][1] = second, first
    index_file.write_text(json.dumps(index))  # the totals stay consistent: only the order is forged
    with pytest.raises(NotAPackError, match=r"packed as shard 1 of 3 of its split, the index lists it as shard 0 of 3"):
        ShardedReader(tmp_path / "s").get(0)
    assert main(["verify", str(tmp_path / "s")]) != EXIT_CODES["ok"]
    assert result.count == sum(s["count"] for s in index["shards"])


def test_a_staging_path_that_is_a_file_is_refused_before_packing(small_tree: Path, tmp_path: Path) -> None:
    # Every shard's build failed with the system's "File exists" and a hint about disks.
    (tmp_path / "stage").write_text("a file, not a folder")
    code = main(["pack", str(small_tree), str(tmp_path / "s"), "--shards", "2", "--staging", str(tmp_path / "stage")])
    assert code == EXIT_CODES["usage"] and not (tmp_path / "s").exists()
    with pytest.raises(OptionError, match=r"staging .*stage is not a folder"):
        pack_sharded(small_tree, tmp_path / "s", shards=2, staging=tmp_path / "stage", progress=False)
    assert (tmp_path / "stage").read_text() == "a file, not a folder"


def test_a_forged_place_in_the_split_is_printed_escaped_and_bounded() -> None:
    from lmdbfolder.read.sharded import out_of_place

    said = out_of_place({"shard": {"index": "\x1b[2J" + "9" * 500, "num_shards": 3}}, 0, 3)
    assert said is not None and "\x1b" not in said and len(said) < 120
    assert out_of_place({"shard": {"index": 0, "num_shards": 3}}, 0, 3) is None

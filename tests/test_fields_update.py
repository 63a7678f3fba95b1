"""The rest of packs of several fields (issue 35): ``pack --update`` of such a pack (samples added,
replaced and removed; a sample read again when any of its files changed), ``pack --layout`` with
the shard flags, on small generated trees (the builders of ``test_layouts``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lmdbfolder.errors import OptionError
from lmdbfolder.write.fields import pack_field_samples
from lmdbfolder.write.layouts import scan_layout
from test_layouts import IMAGE_KINDS, _encoded, _put, make_coco, make_pairs, make_voc, stored_fields

pytest.importorskip("torchvision")


def _voc_files(src: Path, names: list[str]) -> list[list[bytes]]:
    voc = src / "VOCdevkit/VOC2012"
    return [
        [(voc / f"JPEGImages/{n}.jpg").read_bytes(), (voc / f"SegmentationClass/{n}.png").read_bytes()] for n in names
    ]


def _touch_later(path: Path) -> None:
    """Give ``path`` another modification time (a copy of the same size may keep the old one)."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 7_000_000_000))


def test_update_of_a_voc_pack_adds_replaces_and_removes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_voc(src, ["a", "b", "c", "d"])
    dst = tmp_path / "voc.lmdb"
    pack_field_samples(scan_layout(src, "voc"), dst, progress=False)
    voc = src / "VOCdevkit/VOC2012"
    # b's mask replaced (same size, other bytes), c gone from the split, e added, d unchanged
    _put(voc / "SegmentationClass/b.png", _encoded("palette", 20, 14, 999))
    _touch_later(voc / "SegmentationClass/b.png")
    _put(voc / "JPEGImages/e.jpg", _encoded("gray", 11, 9, 5))
    _put(voc / "SegmentationClass/e.png", _encoded("palette", 11, 9, 6))
    (voc / "ImageSets/Segmentation/train.txt").write_text("a\nb\nd\ne\n")
    result = pack_field_samples(scan_layout(src, "voc"), dst, update=True, progress=False)
    assert result.changes is not None
    assert (result.changes.added, result.changes.removed, result.changes.changed) == (1, 1, 1)
    assert result.changes.read == 2  # b (its mask changed) and e; a and d stat-ed only
    assert stored_fields(dst) == _voc_files(src, ["a", "b", "d", "e"])
    # the same update again: nothing read, nothing written
    again = pack_field_samples(scan_layout(src, "voc"), dst, update=True, progress=False)
    assert again.already_packed and again.changes is None
    # a fresh pack of the changed tree holds the same samples
    fresh = tmp_path / "fresh.lmdb"
    pack_field_samples(scan_layout(src, "voc"), fresh, progress=False)
    assert stored_fields(fresh) == stored_fields(dst)

    from lmdbfolder.torch import LMDBDataset

    ds = LMDBDataset(str(dst))
    assert len(ds) == 4 and ds[3][1].mode == "P"
    from lmdbfolder.tools.verify import verify

    assert verify(str(dst)).ok


def test_update_a_changed_annotation_reads_only_its_sample(tmp_path: Path) -> None:
    images, ann, data = make_coco(tmp_path)
    dst = tmp_path / "coco.lmdb"
    pack_field_samples(scan_layout(images, "coco", annotations=ann), dst, progress=False)
    data["annotations"][0]["bbox"] = [2.0, 2.0, 3.0, 3.0]  # image 9's first box moves
    ann.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    samples = scan_layout(images, "coco", annotations=ann)
    result = pack_field_samples(samples, dst, update=True, progress=False)
    assert result.changes is not None and (result.changes.changed, result.changes.read) == (1, 1)
    assert stored_fields(dst) == [samples.read(i) for i in range(len(samples.relpaths))]


def test_update_of_table_rows_naming_one_image(tmp_path: Path) -> None:
    for k, name in enumerate(["a.jpg", "b.jpg"]):
        _put(tmp_path / "images" / name, _encoded(IMAGE_KINDS[k], 8, 8, k))
    table = tmp_path / "t.jsonl"
    rows = [{"image": "a.jpg", "c": "one"}, {"image": "a.jpg", "c": "two"}, {"image": "b.jpg", "c": "x"}]
    table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dst = tmp_path / "t.lmdb"
    pack_field_samples(scan_layout(tmp_path / "images", "table", annotations=table), dst, progress=False)
    rows[1]["c"] = "second, changed"
    rows.append({"image": "a.jpg", "c": "three"})
    table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples = scan_layout(tmp_path / "images", "table", annotations=table)
    result = pack_field_samples(samples, dst, update=True, progress=False)
    assert result.changes is not None
    assert (result.changes.added, result.changes.changed, result.changes.removed) == (1, 1, 0)
    assert stored_fields(dst) == [samples.read(i) for i in range(4)]


def test_update_refusals(tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_voc(src, ["a", "b"])
    make_voc(src, ["a"], split="val")
    dst = tmp_path / "voc.lmdb"
    pack_field_samples(scan_layout(src, "voc"), dst, progress=False)
    with pytest.raises(OptionError, match="split train.*split val"):
        pack_field_samples(scan_layout(src, "voc", split="val"), dst, update=True, progress=False)
    make_pairs(tmp_path / "pairs", 2)
    with pytest.raises(OptionError, match="samples of image, mask, the update brings lq, gt"):
        pack_field_samples(scan_layout(tmp_path / "pairs", "pairs", scale=2), dst, update=True, progress=False)
    # a classification update of it says to give the layout
    from lmdbfolder import pack

    with pytest.raises(OptionError, match="--layout voc --update"):
        pack(str(src), str(dst), update=True)
    sharded = tmp_path / "sharded"
    pack_field_samples(scan_layout(src, "voc"), sharded, shards=2, progress=False)
    with pytest.raises(OptionError, match="does not update a sharded pack of several fields"):
        pack_field_samples(scan_layout(src, "voc"), sharded, update=True, progress=False)
    assert stored_fields(dst) == _voc_files(src, ["a", "b"])  # nothing changed


def test_cli_pack_layout_update_and_shards(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lmdbfolder.cli import main
    from lmdbfolder.cli.common import EXIT_CODES
    from lmdbfolder.torch import LMDBDataset

    src = tmp_path / "src"
    make_pairs(src, 2)
    dst = tmp_path / "x2.lmdb"
    base = ["pack", str(src), str(dst), "--layout", "pairs", "--scale", "2", "--no-progress"]
    assert main(base) == 0
    capsys.readouterr()
    _put(src / "GT/new.png", _encoded("rgb_png", 8, 6, 1))
    _put(src / "LQ/new.png", _encoded("rgb_png", 4, 3, 2))
    os.remove(src / "GT/0002.png")
    assert main([*base, "--update"]) == 0
    out = capsys.readouterr().out
    assert "updated" in out and "+1 / -1" in out, out
    assert "LQ/0002.png" in out  # its LQ is left without a GT: listed
    now = scan_layout(src, "pairs", scale=2)
    assert stored_fields(dst) == [now.read(i) for i in range(len(now.relpaths))]  # in BasicSR's order
    assert main([*base, "--update"]) == 0
    assert "nothing changed" in capsys.readouterr().out
    # sharded: --shards and --shard-size, read back as the single pack
    for flag in (["--shards", "2"], ["--shard-size", "1KB"]):
        out_dir = tmp_path / f"sh{flag[0]}"
        assert main(["pack", str(src), str(out_dir), "--layout", "pairs", "--scale", "2", "--no-progress", *flag]) == 0
        assert "shards" in capsys.readouterr().out
        assert (out_dir / "index.json").is_file()
        single, sharded = LMDBDataset(str(dst)), LMDBDataset(str(out_dir))
        assert len(sharded) == len(single)
        for i in range(len(single)):
            assert [im.tobytes() for im in sharded[i]] == [im.tobytes() for im in single[i]]
    assert main([*base[:2], str(tmp_path / "shards"), *base[3:], "--shards", "2", "--update"]) == EXIT_CODES["usage"]
    assert "does not update a sharded pack" in capsys.readouterr().err
    assert main([*base[:2], str(tmp_path / "sh--shards"), *base[3:], "--update"]) == EXIT_CODES["usage"]
    assert "is a sharded pack" in capsys.readouterr().err


# -- export of pairs and tables ----------------------------------------------------------------------
@pytest.mark.parametrize("tmpl", ["{}", "{}x2"])
def test_export_pairs_gives_basicsr_folders(tmp_path: Path, tmpl: str) -> None:
    from lmdbfolder.tools.export import export
    from test_layouts import basicsr_paired_paths_from_folder

    src = make_pairs(tmp_path / "src", 2, gt="HR", lq="LR/X2", tmpl=tmpl)
    samples = scan_layout(src, "pairs", scale=2, gt_dir="HR", lq_dir="LR/X2", filename_tmpl=tmpl)
    pack_field_samples(samples, tmp_path / "p.lmdb", progress=False)
    export(tmp_path / "p.lmdb", tmp_path / "out")
    out = tmp_path / "out"
    # BasicSR pairs the exported folders as it paired the originals: the same names, the same bytes
    theirs = basicsr_paired_paths_from_folder(str(src / "LR/X2"), str(src / "HR"), tmpl)
    ours = basicsr_paired_paths_from_folder(str(out / "LR/X2"), str(out / "HR"), tmpl)
    assert sorted(os.path.relpath(p, out) for pair in ours for p in pair) == sorted(
        os.path.relpath(p, src) for pair in theirs for p in pair
    )
    for lq, gt in theirs:
        assert (out / os.path.relpath(lq, src)).read_bytes() == Path(lq).read_bytes()
        assert (out / os.path.relpath(gt, src)).read_bytes() == Path(gt).read_bytes()
    again = scan_layout(out, "pairs", scale=2, gt_dir="HR", lq_dir="LR/X2", filename_tmpl=tmpl)
    assert [again.read(i) for i in range(len(again.relpaths))] == [
        samples.read(i) for i in range(len(samples.relpaths))
    ]


def test_export_table_gives_the_images_and_json_lines(tmp_path: Path) -> None:
    from lmdbfolder.tools.export import export

    for k, name in enumerate(["a/1.jpg", "b/ünï.jpg"]):
        _put(tmp_path / "images" / name, _encoded(IMAGE_KINDS[k], 8, 8, k))
    table = tmp_path / "meta.csv"
    table.write_text("file_name,id,caption\na/1.jpg,007,one\nb/ünï.jpg,8,two\na/1.jpg,9,again\n", encoding="utf-8")
    samples = scan_layout(tmp_path / "images", "table", annotations=table)
    pack_field_samples(samples, tmp_path / "t.lmdb", progress=False)
    export(tmp_path / "t.lmdb", tmp_path / "out")
    out = tmp_path / "out"
    rows = [json.loads(line) for line in (out / "meta.jsonl").read_text(encoding="utf-8").splitlines()]
    assert rows == [
        {"file_name": "a/1.jpg", "id": "007", "caption": "one"},
        {"file_name": "b/ünï.jpg", "id": "8", "caption": "two"},
        {"file_name": "a/1.jpg", "id": "9", "caption": "again"},
    ]
    for name in ["a/1.jpg", "b/ünï.jpg"]:
        assert (out / "images" / name).read_bytes() == (tmp_path / "images" / name).read_bytes()
    again = scan_layout(out / "images", "table", annotations=out / "meta.jsonl")
    assert [again.read(i) for i in range(3)] == [samples.read(i) for i in range(3)]


# -- verify --against SRC ------------------------------------------------------------------------------
@pytest.mark.parametrize("shards", [None, 2])
def test_verify_against_the_source_compares_every_field(tmp_path: Path, shards: int | None) -> None:
    from lmdbfolder.tools.verify import verify

    src = tmp_path / "src"
    make_voc(src, ["a", "b", "c"])
    dst = tmp_path / "voc.lmdb"
    pack_field_samples(scan_layout(src, "voc"), dst, shards=shards, progress=False)
    report = verify(dst, against=src, progress=False)
    assert report.ok, report.problems
    voc = src / "VOCdevkit/VOC2012"
    _put(voc / "SegmentationClass/b.png", _encoded("palette", 20, 14, 999))
    report = verify(dst, against=src, progress=False)
    assert [(p.index, p.message) for p in report.problems] == [
        (1, "field mask differs from its file SegmentationClass/b.png")
    ]
    (voc / "ImageSets/Segmentation/train.txt").write_text("a\nc\n")
    report = verify(dst, against=src, progress=False)
    assert [(p.index, p.path, p.message) for p in report.problems] == [
        (1, "JPEGImages/b.jpg", "is in the pack but not in the source")
    ]


def test_verify_against_coco_and_pairs_sources(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lmdbfolder.cli import main
    from lmdbfolder.cli.common import EXIT_CODES
    from lmdbfolder.tools.verify import verify

    images, ann, data = make_coco(tmp_path)
    pack_field_samples(scan_layout(images, "coco", annotations=ann), tmp_path / "c.lmdb", progress=False)
    assert verify(tmp_path / "c.lmdb", against=images, progress=False).ok  # the JSON found beside the images
    data["annotations"][0]["bbox"] = [2.0, 2.0, 3.0, 3.0]
    moved = tmp_path / "elsewhere.json"
    moved.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    report = verify(tmp_path / "c.lmdb", against=images, annotations=moved, progress=False)
    assert [p.message for p in report.problems] == ["field annotations differs from the source's value"]
    assert (
        main(["verify", str(tmp_path / "c.lmdb"), "--against", str(images), "--annotations", str(moved)])
        == (EXIT_CODES["problems found"])
    )
    assert "field annotations differs from the source's value" in capsys.readouterr().err
    make_pairs(tmp_path / "p", 2)
    pack_field_samples(scan_layout(tmp_path / "p", "pairs", scale=2), tmp_path / "p.lmdb", progress=False)
    assert verify(tmp_path / "p.lmdb", against=tmp_path / "p", progress=False).ok
    _put(tmp_path / "p/GT/0801.png", _encoded("rgb_png", 14, 10, 77))
    report = verify(tmp_path / "p.lmdb", against=tmp_path / "p", progress=False)
    assert [p.message for p in report.problems] == ["field gt differs from its file GT/0801.png"]


# -- bad input: listed with its files, printed with bounds ----------------------------------------------
def test_cli_lists_bad_samples_with_their_files_escaped_and_bounded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lmdbfolder.cli import main

    src = tmp_path / "src"
    names = ["ok", "wrong\x1b[31msize", *[f"lonely{k:02d}" for k in range(24)]]
    make_voc(src, names, no_mask=tuple(n for n in names if n.startswith("lonely")))
    voc = src / "VOCdevkit/VOC2012"
    _put(voc / "SegmentationClass/wrong\x1b[31msize.png", _encoded("palette", 5, 5, 3))  # not its image's size
    dst = tmp_path / "voc.lmdb"
    assert main(["pack", str(src), str(dst), "--layout", "voc", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "packed 1 sample" in out and "skipped 25 samples" in out
    assert "\x1b" not in out  # a control character in a file name is escaped, never sent to the terminal
    assert "JPEGImages/lonely00.jpg + SegmentationClass/lonely00.png" in out
    assert "mask (SegmentationClass/wrong\\x1b[31msize.png): the mask is 5x5 but the image is 20x14" in out
    assert "... and 5 more" in out  # bounded: 20 shown, every one in skipped.txt
    listed = (dst / "skipped.txt").read_text(encoding="utf-8", errors="surrogateescape")
    assert listed.count("\n") == 25 + 2
    # a COCO annotation naming no image: listed with the file and the entry
    images, ann, _ = make_coco(tmp_path / "coco")
    assert main(["pack", str(images), str(tmp_path / "c.lmdb"), "--layout", "coco", "--annotations", str(ann)]) == 0
    out = capsys.readouterr().out
    assert "instances_train2017.json: annotations[3]: annotation 99 names image 12345, which no images entry has" in out


# -- the exact distributed sampler and seeded replay ---------------------------------------------------
def test_exact_sampler_over_ranks_reads_every_sample_once_with_replayed_transforms(tmp_path: Path) -> None:
    from collections import Counter

    from _fields_ddp_worker import crcs, pipeline
    from conftest import run_ranks
    from lmdbfolder.torch import LMDBDataset

    src = tmp_path / "src"
    make_voc(src, [f"s{k}" for k in range(7)])
    pack = tmp_path / "voc"
    pack_field_samples(scan_layout(src, "voc"), pack, shards=3, progress=False)
    spec = {"pack": str(pack), "out": str(tmp_path / "out.jsonl"), "orders": ["random", "shards"], "epochs": [0, 1]}
    spec["seed"] = 5
    run_ranks(Path(__file__).parent / "_fields_ddp_worker.py", 2, spec, tmp_path / "spec.json", timeout=300)
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [(line["order"], line["epoch"]) for line in lines] == [
        ("random", 0),
        ("random", 1),
        ("shards", 0),
        ("shards", 1),
    ]
    here = LMDBDataset(str(pack), transforms=pipeline(), seed=5)
    for line in lines:
        ranks = line["ranks"]
        assert len(ranks[0]) == len(ranks[1])  # equal parts
        counts = Counter(i for part in ranks for i, _ in part)
        assert set(counts) == set(range(7)) and sum(counts.values()) == 7 + line["padded"]  # each once, plus padding
        here.set_epoch(line["epoch"])
        expected = {i: crcs(here[i]) for i in range(7)}
        # every rank's worker drew the same transform for a sample as this process does
        assert all(c == expected[i] for part in ranks for i, c in part)
    assert lines[0]["ranks"] != lines[1]["ranks"]  # another epoch: another order, other transforms

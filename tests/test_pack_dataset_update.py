"""``pack_dataset(dataset, dst, update=True)`` of datasets of several fields, and packs of
torchvision's datasets updated from the shell: a ``VOCSegmentation``, ``Cityscapes`` or
``CocoDetection`` lists the same samples as ``pack --layout voc|cityscapes|coco`` lists their files
(root, stored paths, layout details, stamps), so either updates the other's pack; any other
dataset of several values is read again and compared record by record; classification datasets
refuse ``update=True``. After each update the pack reads back as the dataset, item for item."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import lmdbfolder
from conftest import assert_same_sample as assert_same
from conftest import make_cityscapes, make_coco, make_small_tree, make_voc, mask_png, photo_jpeg, write
from lmdbfolder.cli import main
from lmdbfolder.errors import OptionError
from lmdbfolder.read.reader import Reader
from lmdbfolder.torch import LMDBDataset
from lmdbfolder.write.dataset_fields import field_samples_of
from lmdbfolder.write.layouts import _common, scan_layout

datasets = pytest.importorskip("torchvision.datasets")


# -- helpers -------------------------------------------------------------------------------------------
def _touch_later(path: Path) -> None:
    """Give ``path`` another modification time (a rewrite within the clock's step may keep the old one)."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 7_000_000_000))


def _rewrite(path: Path, data: bytes) -> None:
    write(path, data)
    _touch_later(path)


def _same_as(dataset: Any, pack: Path) -> None:
    """``LMDBDataset(pack)[i]`` equals ``dataset[i]`` for every ``i`` (PIL images by mode, size,
    palette and pixels), and ``verify`` finds nothing wrong."""
    ours = LMDBDataset(pack)
    assert len(ours) == len(dataset)
    for i in range(len(dataset)):
        assert_same(dataset[i], ours[i])
    report = lmdbfolder.verify(pack, progress=False)
    assert report.ok, report.problems


def _history(pack: Path) -> list[str]:
    if (pack / "index.json").is_file():
        return [h["event"] for h in json.loads((pack / "index.json").read_text())["history"]]
    with Reader(str(pack)) as reader:
        return [h["event"] for h in reader.history()]


class _Reads:
    """Counts the source files the layouts' reader opens (``FileReader``: every file field)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = _common.read_regular

        def counted(path: str, limit: int) -> bytes:
            self.count += 1
            return real(path, limit)

        monkeypatch.setattr(_common, "read_regular", counted)


def _voc(root: Path) -> Any:
    return datasets.VOCSegmentation(str(root), year="2012", image_set="train")


def _change_voc(root: Path) -> None:
    """The second sample's mask replaced (same size, other labels), the third gone from the split,
    a sample added at the end."""
    voc = root / "VOCdevkit" / "VOC2012"
    names = (voc / "ImageSets/Segmentation/train.txt").read_text().split()
    with Image.open(voc / "JPEGImages" / f"{names[1]}.jpg") as im:
        size = im.size
    _rewrite(voc / "SegmentationClass" / f"{names[1]}.png", mask_png("P", size, 99))
    write(voc / "JPEGImages/added_9.jpg", photo_jpeg(19, 13, seed=9))
    write(voc / "SegmentationClass/added_9.png", mask_png("L", (19, 13), 9))
    (voc / "ImageSets/Segmentation/train.txt").write_text(
        "".join(f"{n}\n" for n in [*names[:2], *names[3:], "added_9"])
    )


# -- the same samples as the layouts -------------------------------------------------------------------
def test_torchvisions_datasets_list_as_their_layouts(tmp_path: Path) -> None:
    voc = make_voc(tmp_path / "voc")
    city = make_cityscapes(tmp_path / "cityscapes")
    images, annotations = make_coco(tmp_path / "coco")
    cases = [
        (_voc(voc), scan_layout(voc, "voc")),
        (datasets.Cityscapes(str(city), split="train", target_type="semantic"), scan_layout(city, "cityscapes")),
        (datasets.CocoDetection(str(images), str(annotations)), scan_layout(images, "coco", annotations=annotations)),
    ]
    for dataset, layout in cases:
        ours = field_samples_of(dataset)
        assert ours is not None and ours.stamp is not None
        for name in ("layout", "root", "fields", "relpaths", "field_paths", "labels", "skipped"):
            assert getattr(ours, name) == getattr(layout, name), name
        # COCO: the dataset does not know its annotation file's name; everything else is the same
        assert ours.layout_info == {k: v for k, v in layout.layout_info.items() if k != "annotations"}
        for i in range(len(ours.relpaths)):
            assert ours.stamp(i) == layout.stamp(i)  # type: ignore[misc]
            assert ours.read(i) == layout.read(i)
    assert cases[0][1].layout_info == {"split": "train", "year_folder": "VOC2012"}
    assert cases[1][1].layout_info == {"split": "train", "mode": "fine"}


# -- the defect: a pack of VOCSegmentation, updated from the shell ------------------------------------------
def test_a_pack_of_vocsegmentation_updates_from_the_shell(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make_voc(tmp_path / "voc")
    dst = tmp_path / "voc.lmdb"
    lmdbfolder.pack_dataset(_voc(root), dst, progress=False)
    _change_voc(root)
    capsys.readouterr()
    # it was refused: "packed from the voc layout (split train, year 2012), the update lists the voc
    # layout (split train, year_folder VOC2012): another dataset"
    assert main(["pack", str(root), str(dst), "--layout", "voc", "--update", "--json", "--no-progress"]) == 0
    changes = json.loads(capsys.readouterr().out)["changes"]
    assert (changes["added"], changes["removed"], changes["changed"], changes["read"]) == (1, 1, 1, 2)
    theirs = _voc(root)
    _same_as(theirs, dst)
    assert {LMDBDataset(dst)[i][1].mode for i in range(len(theirs))} == {"P", "L", "I;16"}  # masks as their files
    assert _history(dst) == ["pack", "update"]


# -- pack_dataset(..., update=True) ---------------------------------------------------------------------
@pytest.mark.parametrize("shards", [None, 2])
def test_update_of_a_pack_of_vocsegmentation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shards: int | None
) -> None:
    root = make_voc(tmp_path / "voc")
    dst = tmp_path / "voc.lmdb"
    lmdbfolder.pack_dataset(_voc(root), dst, shards=shards, progress=False)
    reads = _Reads(monkeypatch)
    same = lmdbfolder.pack_dataset(_voc(root), dst, update=True, progress=False)
    assert same.changes is None and reads.count == 0  # nothing changed: every sample stat-ed, none read
    _change_voc(root)
    result = lmdbfolder.pack_dataset(_voc(root), dst, update=True, progress=False)
    assert result.changes is not None
    assert (result.changes.added, result.changes.removed, result.changes.changed) == (1, 1, 1)
    assert result.changes.read == 2 and reads.count == 4  # the changed sample and the new one: 2 files each
    _same_as(_voc(root), dst)
    assert _history(dst) == ["pack", "update"]
    again = lmdbfolder.pack_dataset(_voc(root), dst, update=True, progress=False)
    assert again.changes is None and reads.count == 4 and _history(dst) == ["pack", "update"]


def test_update_of_a_pack_of_cityscapes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make_cityscapes(tmp_path / "cityscapes")
    dst = tmp_path / "cs.lmdb"

    def dataset() -> Any:
        return datasets.Cityscapes(str(root), split="train", target_type="semantic")

    lmdbfolder.pack_dataset(dataset(), dst, progress=False)
    mask = Path(dataset().targets[0][0])
    with Image.open(mask) as m:
        mode, size = m.mode, m.size
    _rewrite(mask, mask_png(mode, size, 77))
    result = lmdbfolder.pack_dataset(dataset(), dst, update=True, progress=False)
    assert result.changes is not None and (result.changes.changed, result.changes.read) == (1, 1)
    _same_as(dataset(), dst)
    assert _history(dst) == ["pack", "update"]
    # the shell's layout lists the same pack: nothing to do
    capsys.readouterr()
    assert main(["pack", str(root), str(dst), "--layout", "cityscapes", "--update", "--no-progress"]) == 0
    assert "nothing changed" in capsys.readouterr().out


def test_update_of_a_pack_of_cocodetection(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    images, annotations = make_coco(tmp_path / "coco")
    dst = tmp_path / "coco.lmdb"
    lmdbfolder.pack_dataset(datasets.CocoDetection(str(images), str(annotations)), dst, progress=False)
    assert "annotations" not in LMDBDataset(dst).layout_info  # the dataset does not know the file's name
    unnamed = lmdbfolder.verify(dst, against=images, progress=False)
    assert not unnamed.ok and "names no annotation file" in str(unnamed.problems)
    assert lmdbfolder.verify(dst, against=images, annotations=annotations, progress=False).ok
    data = json.loads(annotations.read_text())
    data["annotations"][0]["bbox"] = [1.0, 1.0, 2.0, 2.0]  # one box of one image moves
    data["categories"].append({"id": 4, "name": "owl"})
    annotations.write_text(json.dumps(data))
    dataset = datasets.CocoDetection(str(images), str(annotations))
    result = lmdbfolder.pack_dataset(dataset, dst, update=True, progress=False)
    assert result.changes is not None and (result.changes.changed, result.changes.read) == (1, 1)
    assert result.changes.added == result.changes.removed == 0
    _same_as(dataset, dst)
    assert [c["name"] for c in LMDBDataset(dst).categories] == ["cat", "dög", "bird", "owl"]
    assert _history(dst) == ["pack", "update"]
    # from the shell, with its annotation file: the same samples; the pack learns the file's name
    base = ["pack", str(images), str(dst), "--layout", "coco", "--update", "--no-progress"]
    capsys.readouterr()
    assert main([*base, "--annotations", str(annotations)]) == 0
    assert "nothing changed" in capsys.readouterr().out
    assert LMDBDataset(dst).layout_info["annotations"] == annotations.name
    # now that it names its file, another file is another dataset
    other = annotations.with_name("instances_val.json")
    other.write_text(annotations.read_text())
    assert main([*base, "--annotations", str(other)]) != 0
    assert "another dataset" in capsys.readouterr().err
    # a dataset object updates it still (it names no file): the pack describes its last source
    assert lmdbfolder.pack_dataset(dataset, dst, update=True, progress=False).changes is None
    assert "annotations" not in LMDBDataset(dst).layout_info
    _same_as(dataset, dst)


class _Values(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Items of several values (an RGB image, a palette mask, an array, a tensor, a JSON value),
    each made from its seed."""

    def __init__(self, seeds: list[int]) -> None:
        self.seeds = seeds

    def __len__(self) -> int:
        return len(self.seeds)

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        s = self.seeds[i]
        size = (9 + s % 5, 7)
        image = Image.open(io.BytesIO(photo_jpeg(*size, seed=s))).convert("RGB")
        mask = Image.open(io.BytesIO(mask_png("P", size, s)))
        mask.load()
        return image, mask, np.arange(6, dtype="<i4").reshape(2, 3) * s, torch.tensor([s, s + 1.5]), {"seed": s}


@pytest.mark.parametrize("shards", [None, 2])
def test_update_of_a_pack_of_a_dataset_of_several_values(tmp_path: Path, shards: int | None) -> None:
    dst = tmp_path / "values.lmdb"
    lmdbfolder.pack_dataset(_Values([0, 1, 2, 3]), dst, shards=shards, progress=False)
    before = _stored(dst)
    # nothing to compare without reading: every item is read again, every record kept
    same = lmdbfolder.pack_dataset(_Values([0, 1, 2, 3]), dst, update=True, progress=False)
    assert same.changes is not None and (same.changes.read, same.changes.unchanged) == (4, 4)
    assert same.changes.added == same.changes.removed == same.changes.changed == 0
    assert _stored(dst) == before
    # item 1 changed, one added at the end
    result = lmdbfolder.pack_dataset(_Values([0, 7, 2, 3, 4]), dst, update=True, progress=False)
    assert result.changes is not None
    assert (result.changes.added, result.changes.removed, result.changes.changed) == (1, 0, 1)
    _same_as(_Values([0, 7, 2, 3, 4]), dst)
    # item 2 removed: an item is its index, so the ones after it changed and the last is gone
    result = lmdbfolder.pack_dataset(_Values([0, 7, 3, 4]), dst, update=True, progress=False)
    assert result.changes is not None
    assert (result.changes.added, result.changes.removed, result.changes.changed) == (0, 1, 2)
    _same_as(_Values([0, 7, 3, 4]), dst)
    assert _history(dst) == ["pack", "update", "update", "update"]
    with pytest.raises(OptionError, match="another dataset"):  # another dataset class: refused

        class Other(_Values):
            pass

        lmdbfolder.pack_dataset(Other([0]), dst, update=True, progress=False)


def _stored(pack: Path) -> list[bytes]:
    """Every record's bytes (a sharded pack's shards one after the other)."""
    if (pack / "index.json").is_file():
        shards = json.loads((pack / "index.json").read_text())["shards"]
        return [record for entry in shards for record in _stored(pack / entry["name"])]
    with Reader(str(pack)) as reader:
        return [bytes(reader.get(i).payload) for i in range(reader.meta.count)]


# -- classification datasets ------------------------------------------------------------------------------
class _Labelled(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> tuple[Image.Image, int]:
        return Image.new("RGB", (5, 4), (i, 0, 0)), i


def test_classification_datasets_refuse_update(tmp_path: Path) -> None:
    folder = datasets.ImageFolder(str(make_small_tree(tmp_path / "tree", classes=2, per_class=2)))
    for dataset in (folder, _Labelled()):
        dst = tmp_path / f"{type(dataset).__name__}.lmdb"
        lmdbfolder.pack_dataset(dataset, dst, progress=False)
        before = (dst / "data.mdb").read_bytes()
        with pytest.raises(OptionError, match=r"\(image, label\) items.*makes a new pack") as info:
            lmdbfolder.pack_dataset(dataset, dst, update=True, progress=False)
        assert "overwrite=True" in str(info.value.hint) and "update=True" in str(info.value.hint)
        assert (dst / "data.mdb").read_bytes() == before


def test_export_of_a_cityscapes_pack_from_the_shell(tmp_path: Path) -> None:
    # --layout cityscapes records mode "fine" (as pack_dataset now does): export wrote its masks
    # under fine/ as *_fine_labelIds.png, where torchvision's Cityscapes finds none
    from lmdbfolder.tools.export import export

    root = make_cityscapes(tmp_path / "cityscapes")
    dst = tmp_path / "cs.lmdb"
    assert main(["pack", str(root), str(dst), "--layout", "cityscapes", "--no-progress"]) == 0
    export(dst, tmp_path / "out")
    theirs = datasets.Cityscapes(str(tmp_path / "out"), split="train", target_type="semantic")
    ours = LMDBDataset(dst)
    with Reader(str(dst)) as reader:
        at = {path: i for i, path in enumerate(reader.paths())}
    assert len(theirs) == len(ours) == len(at) == 3
    for k, image in enumerate(theirs.images):  # os.listdir's order of the new tree may be another
        assert_same(theirs[k], ours[at[Path(image).relative_to(tmp_path / "out").as_posix()]])


def test_packs_of_torchvisions_datasets_made_before_update_too(tmp_path: Path) -> None:
    # pack_dataset recorded {"split", "year": "2012"} and {"split", "mode": "gtFine"}: the same datasets
    from conftest import forge_meta

    root = make_voc(tmp_path / "voc")
    dst = tmp_path / "voc.lmdb"
    lmdbfolder.pack_dataset(_voc(root), dst, progress=False)
    forge_meta(dst, layout={"name": "voc", "info": {"split": "train", "year": "2012"}})
    _change_voc(root)
    assert main(["pack", str(root), str(dst), "--layout", "voc", "--update", "--no-progress"]) == 0
    assert LMDBDataset(dst).layout_info == {"split": "train", "year_folder": "VOC2012"}
    _same_as(_voc(root), dst)
    city = make_cityscapes(tmp_path / "cityscapes")
    dataset = datasets.Cityscapes(str(city), split="train", target_type="semantic")
    lmdbfolder.pack_dataset(dataset, tmp_path / "cs.lmdb", progress=False)
    forge_meta(tmp_path / "cs.lmdb", layout={"name": "cityscapes", "info": {"split": "train", "mode": "gtFine"}})
    assert lmdbfolder.pack_dataset(dataset, tmp_path / "cs.lmdb", update=True, progress=False).changes is None
    assert LMDBDataset(tmp_path / "cs.lmdb").layout_info == {"split": "train", "mode": "fine"}
    with pytest.raises(OptionError, match="another dataset"):  # another year is another dataset
        forge_meta(dst, layout={"name": "voc", "info": {"split": "train", "year": "2011"}})
        lmdbfolder.pack_dataset(_voc(root), dst, update=True, progress=False)


@pytest.mark.parametrize("shards", [None, 2])
def test_an_update_skips_a_sample_whose_file_the_dataset_lists_but_is_gone(tmp_path: Path, shards: int | None) -> None:
    """VOCSegmentation lists a sample whose mask was deleted (it never looks): the update skips and
    names it. It ended in ``struct.error: argument out of range``: the sample's stamp, unknown (-1),
    went into the staged value's unsigned size."""
    root = make_voc(tmp_path / "voc")
    dst = tmp_path / "voc.lmdb"
    lmdbfolder.pack_dataset(_voc(root), dst, shards=shards, progress=False)
    voc = root / "VOCdevkit" / "VOC2012"
    names = (voc / "ImageSets/Segmentation/train.txt").read_text().split()
    (voc / "SegmentationClass" / f"{names[1]}.png").unlink()
    for _ in range(2):  # and again, with nothing else changed
        result = lmdbfolder.pack_dataset(_voc(root), dst, update=True, progress=False)
        assert [reason for _, reason in result.skipped if f"{names[1]}.png" in reason], result.skipped
        ours = LMDBDataset(dst)
        theirs = _voc(root)
        assert len(ours) == len(theirs) - 1
        kept = [i for i, name in enumerate(names) if name != names[1]]
        for k, i in enumerate(kept):
            assert_same(theirs[i], ours[k])
        assert lmdbfolder.verify(dst, progress=False).ok

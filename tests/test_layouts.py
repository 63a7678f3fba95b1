"""Folders on disk as samples of several fields (``lmdbfolder.write.layouts``): each layout lists
the samples, in the order and with the pairing of its reference dataset class (torchvision's
VOCSegmentation, Cityscapes and CocoDetection; BasicSR's folder pairing), on small generated trees
with odd images (grayscale, CMYK, palette and 16-bit masks, non-ASCII names); a missing partner is
skipped and listed with its file names; no name read from a file leaves the source folder. Then the
rest of such packs: ``pack --update`` (samples added, replaced, removed), the shard flags, export of
pairs and tables, ``verify --against``, the exact distributed sampler over ranks."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from conftest import assert_same_image, assert_same_sample
from lmdbfolder.errors import OptionError, SourceError, SourceNotFoundError
from lmdbfolder.write.fields import FieldSamples, SampleError, pack_field_samples
from lmdbfolder.write.layouts import LAYOUTS, scan_layout

datasets = pytest.importorskip("torchvision.datasets")


# -- generated trees ------------------------------------------------------------------------------
def _encoded(kind: str, w: int, h: int, seed: int) -> bytes:
    """A small image of ``kind``: rgb/gray/cmyk JPEG, palette/16-bit/gray PNG masks, rgb PNG."""
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    if kind == "rgb":
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(out, "JPEG", quality=90)
    elif kind == "gray":
        Image.fromarray(rng.integers(0, 256, (h, w), dtype=np.uint8), "L").save(out, "JPEG")
    elif kind == "cmyk":
        Image.fromarray(rng.integers(0, 256, (h, w, 4), dtype=np.uint8), "CMYK").save(out, "JPEG")
    elif kind == "rgb_png":
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(out, "PNG")
    elif kind == "palette":
        mask = Image.fromarray(rng.integers(0, 21, (h, w), dtype=np.uint8), "P")
        mask.putpalette([v for i in range(256) for v in (i * 7 % 256, i * 13 % 256, i * 29 % 256)])
        mask.save(out, "PNG")
    elif kind == "mask16":
        Image.fromarray(rng.integers(0, 3000, (h, w), dtype=np.uint16)).save(out, "PNG")
    elif kind == "labels":
        Image.fromarray(rng.integers(0, 34, (h, w), dtype=np.uint8), "L").save(out, "PNG")
    else:
        raise ValueError(kind)
    return out.getvalue()


def _put(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


IMAGE_KINDS = ("rgb", "gray", "cmyk")


def make_voc(root: Path, names: list[str], *, split: str = "train", no_mask: tuple[str, ...] = ()) -> Path:
    """``root/VOCdevkit/VOC2012`` with JPEGImages, SegmentationClass (palette PNGs) and the split file."""
    voc = root / "VOCdevkit" / "VOC2012"
    for k, name in enumerate(names):
        _put(voc / "JPEGImages" / f"{name}.jpg", _encoded(IMAGE_KINDS[k % 3], 19 + k, 13 + k, k))
        if name not in no_mask:
            _put(voc / "SegmentationClass" / f"{name}.png", _encoded("palette", 19 + k, 13 + k, 100 + k))
    _put(voc / "ImageSets" / "Segmentation" / f"{split}.txt", "".join(n + "\n" for n in names).encode())
    return root


def _check_read(samples: FieldSamples, i: int) -> list[bytes]:
    """Sample ``i``'s payloads: each file field is its file's bytes."""
    payloads = samples.read(i)
    assert len(payloads) == len(samples.fields)
    for rel, data in zip(samples.field_paths[i], payloads):
        if rel:
            assert data == (Path(samples.root) / rel).read_bytes()
    return payloads


def _pil(data: bytes) -> Image.Image:
    im = Image.open(io.BytesIO(data))
    im.load()
    return im


def test_the_layouts() -> None:
    assert LAYOUTS == ("voc", "ade20k", "cityscapes", "coco", "pairs", "table")


# -- voc --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("given", ["root", "VOCdevkit", "VOC2012"])
def test_voc_pairs_as_vocsegmentation(tmp_path: Path, given: str) -> None:
    names = ["2007_000032", "2008_000001", "été_ünïcode", "a b"]
    make_voc(tmp_path, names)
    src = {"root": tmp_path, "VOCdevkit": tmp_path / "VOCdevkit", "VOC2012": tmp_path / "VOCdevkit" / "VOC2012"}
    samples = scan_layout(src[given], "voc", split="train")
    theirs = datasets.VOCSegmentation(str(tmp_path), image_set="train")
    assert [f.name for f in samples.fields] == ["image", "mask"]
    assert [f.kind for f in samples.fields] == ["image", "mask"]
    assert samples.layout == "voc" and samples.layout_info["split"] == "train"
    root = Path(samples.root)
    assert [str(root / i) for i, _ in samples.field_paths] == theirs.images
    assert [str(root / m) for _, m in samples.field_paths] == theirs.masks
    assert samples.relpaths == [i for i, _ in samples.field_paths]
    assert samples.skipped == []
    for i in range(len(theirs)):
        image, mask = _check_read(samples, i)
        their_image, their_mask = theirs[i]
        assert_same_image(_pil(image).convert("RGB"), their_image)
        assert_same_image(_pil(mask), their_mask)
        assert _pil(mask).mode == "P"  # the palette's indices stay indices


def test_voc_missing_partners_are_listed(tmp_path: Path) -> None:
    make_voc(tmp_path, ["a", "b", "c"], no_mask=("b",))
    voc = tmp_path / "VOCdevkit" / "VOC2012"
    split = voc / "ImageSets" / "Segmentation" / "train.txt"
    split.write_text("a\nb\nc\nnot_there\n\n")
    samples = scan_layout(tmp_path, "voc")
    assert [p[0] for p in samples.field_paths] == ["JPEGImages/a.jpg", "JPEGImages/c.jpg"]
    listed = dict(samples.skipped)
    assert "SegmentationClass/b.png is missing" in listed["JPEGImages/b.jpg + SegmentationClass/b.png"]
    both = listed["JPEGImages/not_there.jpg + SegmentationClass/not_there.png"]
    assert "ImageSets/Segmentation/train.txt:4" in both and "are missing" in both
    assert "empty" in listed["ImageSets/Segmentation/train.txt:5"]
    # torchvision lists every line, and fails on the missing files: ours are its files that exist
    theirs = datasets.VOCSegmentation(str(tmp_path), image_set="train")
    present = [(i, m) for i, m in zip(theirs.images, theirs.masks) if os.path.exists(i) and os.path.exists(m)]
    assert [(str(voc / i), str(voc / m)) for i, m in samples.field_paths] == present


def test_voc_split_names_never_leave_the_source(tmp_path: Path) -> None:
    make_voc(tmp_path, ["a"])
    voc = tmp_path / "VOCdevkit" / "VOC2012"
    _put(tmp_path / "secret.jpg", _encoded("rgb", 8, 8, 0))
    _put(tmp_path / "secret.png", _encoded("palette", 8, 8, 0))
    outside = os.path.relpath(tmp_path / "secret", voc / "JPEGImages")
    (voc / "ImageSets" / "Segmentation" / "train.txt").write_text(f"a\n{outside}\n{tmp_path / 'secret'}\n")
    samples = scan_layout(tmp_path, "voc")
    assert samples.field_paths == [("JPEGImages/a.jpg", "SegmentationClass/a.png")]
    reasons = [why for _, why in samples.skipped]
    assert len(reasons) == 2
    assert "(..)" in reasons[0] and "absolute" in reasons[1]


@pytest.mark.parametrize(
    "name, safe",
    [
        ("a/b.jpg", True),
        ("ünï:1.jpg", True),
        ("..a.jpg", True),
        ("../a.jpg", False),
        ("a/../../b.jpg", False),
        ("a\\..\\b.jpg", False),
        ("/etc/passwd", False),
        ("\\\\server\\share", False),
        ("C:\\x.jpg", False),
        ("", False),
        (" ", False),
        ("a\x00b", False),
        (7, False),
    ],
)
def test_names_read_from_files(name: object, safe: bool) -> None:
    from lmdbfolder.write.layouts import unsafe_name

    assert (unsafe_name(name) is None) == safe


def test_voc_refusals(tmp_path: Path) -> None:
    with pytest.raises(SourceNotFoundError, match="no Pascal VOC tree"):
        scan_layout(tmp_path, "voc")
    make_voc(tmp_path, ["a"])
    with pytest.raises(SourceNotFoundError, match="split file"):
        scan_layout(tmp_path, "voc", split="val")
    with pytest.raises(OptionError, match="plain name"):
        scan_layout(tmp_path, "voc", split="../train")
    with pytest.raises(OptionError, match="does not take --scale"):
        scan_layout(tmp_path, "voc", scale=2)
    with pytest.raises(OptionError, match="layout must be one of"):
        scan_layout(tmp_path, "kitti")


# -- ade20k -----------------------------------------------------------------------------------------
def test_ade20k_pairs_by_name_and_lists_the_lonely(tmp_path: Path) -> None:
    ade = tmp_path / "ADEChallengeData2016"
    names = ["ADE_train_00000002", "ADE_train_00000001", "ünï_3", "cmyk_4"]
    for k, name in enumerate(names):
        _put(ade / "images" / "training" / f"{name}.jpg", _encoded(IMAGE_KINDS[k % 3], 17, 11 + k, k))
        _put(
            ade / "annotations" / "training" / f"{name}.png", _encoded("mask16" if k == 2 else "labels", 17, 11 + k, k)
        )
    _put(ade / "images" / "training" / "no_mask.jpg", _encoded("rgb", 9, 9, 9))
    _put(ade / "annotations" / "training" / "no_image.png", _encoded("labels", 9, 9, 9))
    _put(ade / "images" / "validation" / "ADE_val_1.jpg", _encoded("rgb", 9, 9, 9))
    _put(ade / "annotations" / "validation" / "ADE_val_1.png", _encoded("labels", 9, 9, 9))
    samples = scan_layout(tmp_path, "ade20k")  # the folder holding ADEChallengeData2016 is found too
    expect = sorted(names)
    assert samples.field_paths == [(f"images/training/{n}.jpg", f"annotations/training/{n}.png") for n in expect]
    assert dict(samples.skipped) == {
        "images/training/no_mask.jpg": "an image without its mask (annotations/training/no_mask.png is missing)",
        "annotations/training/no_image.png": "a mask without its image (no images/ file of that name)",
    }
    for i, name in enumerate(expect):
        _image, mask = _check_read(samples, i)
        if name == "ünï_3":
            assert _pil(mask).mode in ("I;16", "I")  # 16 bits a pixel, kept
            assert np.array_equal(
                np.asarray(_pil(mask)), np.asarray(Image.open(ade / "annotations/training/ünï_3.png"))
            )
    val = scan_layout(ade, "ade20k", split="validation")
    assert val.field_paths == [("images/validation/ADE_val_1.jpg", "annotations/validation/ADE_val_1.png")]
    assert val.layout_info == {"split": "validation"}


# -- cityscapes -------------------------------------------------------------------------------------
def make_cityscapes(root: Path) -> Path:
    k = 0
    for split, cities in (("train", ("aachen", "zürich", "bremen")), ("val", ("lindau",))):
        for city in cities:
            for n in range(2):
                stem = f"{city}_{n:06d}_000019"
                _put(root / "leftImg8bit" / split / city / f"{stem}_leftImg8bit.png", _encoded("rgb_png", 16, 8, k))
                _put(root / "gtFine" / split / city / f"{stem}_gtFine_labelIds.png", _encoded("labels", 16, 8, k))
                _put(root / "gtFine" / split / city / f"{stem}_gtFine_color.png", _encoded("rgb_png", 16, 8, k))
                k += 1
    return root


def test_cityscapes_pairs_as_torchvision(tmp_path: Path) -> None:
    make_cityscapes(tmp_path)
    for split in ("train", "val"):
        samples = scan_layout(tmp_path, "cityscapes", split=split)
        theirs = datasets.Cityscapes(str(tmp_path), split=split, mode="fine", target_type="semantic")
        root = Path(samples.root)
        assert [str(root / i) for i, _ in samples.field_paths] == theirs.images
        assert [[str(root / m)] for _, m in samples.field_paths] == theirs.targets
        assert samples.skipped == []
        for i in range(len(theirs)):
            image, mask = _check_read(samples, i)
            their_image, their_mask = theirs[i]
            assert_same_image(_pil(image).convert("RGB"), their_image)
            assert_same_image(_pil(mask), their_mask)


def test_cityscapes_missing_partners_are_listed(tmp_path: Path) -> None:
    make_cityscapes(tmp_path)
    (tmp_path / "gtFine/train/aachen/aachen_000001_000019_gtFine_labelIds.png").unlink()
    (tmp_path / "leftImg8bit/train/bremen/bremen_000000_000019_leftImg8bit.png").unlink()
    samples = scan_layout(tmp_path, "cityscapes")
    listed = dict(samples.skipped)
    assert listed == {
        "leftImg8bit/train/aachen/aachen_000001_000019_leftImg8bit.png": "an image without its mask "
        "(gtFine/train/aachen/aachen_000001_000019_gtFine_labelIds.png is missing)",
        "gtFine/train/bremen/bremen_000000_000019_gtFine_labelIds.png": "a mask without its image "
        "(no leftImg8bit file of that name)",
    }
    theirs = datasets.Cityscapes(str(tmp_path), split="train", mode="fine", target_type="semantic")
    present = [(i, t[0]) for i, t in zip(theirs.images, theirs.targets) if os.path.exists(t[0])]
    assert [(str(tmp_path / i), str(tmp_path / m)) for i, m in samples.field_paths] == present


# -- coco -------------------------------------------------------------------------------------------
def make_coco(root: Path) -> tuple[Path, Path, dict[str, Any]]:
    images = root / "train2017"
    files = ["000000000009.jpg", "sub/000000000025.jpg", "ünï.jpg", "gray.jpg"]
    for k, name in enumerate(files):
        _put(images / name, _encoded(IMAGE_KINDS[k % 3], 20 + k, 15, k))
    data: dict[str, Any] = {
        "info": {"description": "test"},
        "images": [
            {"id": 25, "file_name": "sub/000000000025.jpg", "width": 21, "height": 15},
            {"id": 9, "file_name": "000000000009.jpg", "width": 20, "height": 15},
            {"id": 30, "file_name": "ünï.jpg", "width": 22, "height": 15, "coco_url": "http://x/ü"},
            {"id": 31, "file_name": "gray.jpg", "width": 23, "height": 15},
        ],
        "annotations": [
            {
                "id": 7,
                "image_id": 9,
                "category_id": 1,
                "bbox": [1.5, 2.25, 5.0, 4.0],
                "area": 20.0,
                "iscrowd": 0,
                "segmentation": [[1.5, 2.25, 6.5, 2.25, 6.5, 6.25]],
            },
            {
                "id": 3,
                "image_id": 25,
                "category_id": 2,
                "bbox": [0, 0, 3, 3],
                "area": 9,
                "iscrowd": 1,
                "segmentation": {"counts": [0, 9, 300], "size": [15, 21]},
            },
            {
                "id": 5,
                "image_id": 9,
                "category_id": 2,
                "bbox": [4, 4, 2, 2],
                "area": 4.0,
                "iscrowd": 0,
                "segmentation": [],
                "caption": "ünï",
            },
            {"id": 99, "image_id": 12345, "category_id": 1, "bbox": [0, 0, 1, 1], "area": 1, "iscrowd": 0},
        ],
        "categories": [{"id": 1, "name": "person", "supercategory": "x"}, {"id": 2, "name": "kïte"}],
    }
    ann = root / "instances_train2017.json"
    ann.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return images, ann, data


def test_coco_as_cocodetection(tmp_path: Path) -> None:
    pytest.importorskip("pycocotools")
    images, ann, data = make_coco(tmp_path)
    samples = scan_layout(images, "coco", annotations=ann)
    theirs = datasets.CocoDetection(str(images), str(ann))
    assert [(f.name, f.kind) for f in samples.fields] == [
        ("image", "image"),
        ("image_info", "json"),
        ("annotations", "json"),
    ]
    assert len(samples.relpaths) == len(theirs) == 4
    assert samples.layout_info["categories"] == data["categories"]
    for i, image_id in enumerate(theirs.ids):
        assert samples.field_paths[i] == (theirs.coco.imgs[image_id]["file_name"], "", "")
        image, info, anns = _check_read(samples, i)
        their_image, their_target = theirs[i]
        assert_same_image(_pil(image).convert("RGB"), their_image)
        assert json.loads(info) == theirs.coco.imgs[image_id]
        assert json.loads(anns) == their_target  # the same annotations, in the same order
    assert json.loads(samples.read(0)[2]) == [data["annotations"][0], data["annotations"][2]]  # id 9: ann 7 then 5
    assert samples.skipped == [
        ("instances_train2017.json: annotations[3]", "annotation 99 names image 12345, which no images entry has")
    ]


def test_coco_missing_and_outside_files_are_listed(tmp_path: Path) -> None:
    images, ann, data = make_coco(tmp_path)
    (images / "gray.jpg").unlink()
    _put(tmp_path / "outside.jpg", _encoded("rgb", 8, 8, 0))
    data["images"].append({"id": 40, "file_name": "../outside.jpg"})
    data["images"].append({"id": 41, "file_name": str(tmp_path / "outside.jpg")})
    data["images"].append({"id": 42, "file_name": "sub\\000000000025.jpg"})  # written on Windows
    ann.write_text(json.dumps(data), encoding="utf-8")
    samples = scan_layout(images, "coco", annotations=ann)
    assert [p[0] for p in samples.field_paths] == [
        "000000000009.jpg",
        "sub/000000000025.jpg",
        "ünï.jpg",
        "sub/000000000025.jpg",
    ]
    listed = dict(samples.skipped)
    assert "named by instances_train2017.json: images[3] (id 31)" in listed["gray.jpg"]
    assert "(..)" in listed["instances_train2017.json: images[4] (id 40)"]
    assert "absolute" in listed["instances_train2017.json: images[5] (id 41)"]


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda d: d["annotations"].append(dict(d["annotations"][0])),
            r"annotations\[4\].*repeats the annotation id 7",
        ),
        (lambda d: d["images"].append({"id": 9, "file_name": "x.jpg"}), r"images\[4\].*repeats the image id 9"),
        (lambda d: d["annotations"][1].pop("image_id"), r"annotations\[1\].*has no 'image_id'"),
        (lambda d: d["images"][0].update(id=2.5), r"images\[0\].*has a float 'id'"),
        (lambda d: d.pop("images"), r"has no 'images' list"),
        (lambda d: d["images"].append({"id": "s", "file_name": "x.jpg"}), "mix numbers and strings"),
    ],
)
def test_coco_bad_json_is_an_error_naming_the_entry(tmp_path: Path, change: Any, message: str) -> None:
    images, ann, data = make_coco(tmp_path)
    change(data)
    ann.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(SourceError, match=message) as info:
        scan_layout(images, "coco", annotations=ann)
    assert str(ann) in str(info.value)


def test_coco_unreadable_json(tmp_path: Path) -> None:
    images, ann, _data = make_coco(tmp_path)
    ann.write_text('{"images": [', encoding="utf-8")
    with pytest.raises(SourceError, match="not valid JSON"):
        scan_layout(images, "coco", annotations=ann)
    ann.write_text('{"images": [], "annotations": [{"id": 1, "image_id": 1, "area": NaN}]}', encoding="utf-8")
    with pytest.raises(SourceError, match="NaN is not a JSON number"):
        scan_layout(images, "coco", annotations=ann)
    with pytest.raises(OptionError, match="--annotations FILE"):
        scan_layout(images, "coco")


# -- pairs ------------------------------------------------------------------------------------------
def basicsr_paired_paths_from_folder(lq_folder: str, gt_folder: str, filename_tmpl: str) -> list[tuple[str, str]]:
    """BasicSR's pairing, from basicsr/data/data_util.py ``paired_paths_from_folder`` (lines 200-233)
    with basicsr/utils/misc.py ``scandir`` (lines 52-91), XPixelGroup/BasicSR 8d56e3a: the files of
    each folder (not recursive, no names starting with '.', ``os.scandir`` order); for each GT file,
    the LQ file ``filename_tmpl.format(basename) + ext``; the GT folder's order. (BasicSR asserts
    that every partner exists: here the pairs are those whose partner does.)"""

    def scandir(folder: str) -> list[str]:
        return [e.name for e in os.scandir(folder) if not e.name.startswith(".") and e.is_file()]

    input_paths = scandir(lq_folder)
    paths = []
    for gt_path in scandir(gt_folder):
        basename, ext = os.path.splitext(os.path.basename(gt_path))
        input_name = f"{filename_tmpl.format(basename)}{ext}"
        if input_name in input_paths:
            paths.append((os.path.join(lq_folder, input_name), os.path.join(gt_folder, gt_path)))
    return paths


def make_pairs(root: Path, scale: int, *, gt: str = "GT", lq: str = "LQ", tmpl: str = "{}") -> Path:
    for k, name in enumerate(["0801", "0002", "ünï", "baboon.sub"]):
        w, h = 7 + k, 5 + k
        _put(root / gt / f"{name}.png", _encoded("rgb_png", w * scale, h * scale, k))
        _put(root / lq / f"{tmpl.format(name)}.png", _encoded("rgb_png", w, h, 50 + k))
    return root


@pytest.mark.parametrize("tmpl", ["{}", "{}x4"])
def test_pairs_as_basicsr(tmp_path: Path, tmpl: str) -> None:
    make_pairs(tmp_path, 4, gt="DIV2K_HR", lq="DIV2K_LR/X4", tmpl=tmpl)
    (tmp_path / "DIV2K_HR" / ".hidden.png").write_bytes(b"not listed")
    samples = scan_layout(tmp_path, "pairs", scale=4, gt_dir="DIV2K_HR", lq_dir="DIV2K_LR/X4", filename_tmpl=tmpl)
    theirs = basicsr_paired_paths_from_folder(str(tmp_path / "DIV2K_LR/X4"), str(tmp_path / "DIV2K_HR"), tmpl)
    assert [(f.name, f.kind) for f in samples.fields] == [("lq", "image"), ("gt", "image")]
    assert [(str(tmp_path / a), str(tmp_path / b)) for a, b in samples.field_paths] == theirs
    assert len(theirs) == 4 and samples.skipped == []
    assert samples.layout_info["scale"] == 4
    for i in range(4):
        lq, gt = _check_read(samples, i)
        assert _pil(gt).size == (_pil(lq).size[0] * 4, _pil(lq).size[1] * 4)


def test_pairs_missing_partner_and_wrong_scale_are_listed(tmp_path: Path) -> None:
    make_pairs(tmp_path, 2)
    (tmp_path / "LQ" / "0002.png").unlink()
    _put(tmp_path / "LQ" / "lonely.png", _encoded("rgb_png", 4, 4, 0))
    _put(tmp_path / "GT" / "odd.png", _encoded("rgb_png", 9, 8, 0))  # not 2x of 4x4
    _put(tmp_path / "LQ" / "odd.png", _encoded("rgb_png", 4, 4, 0))
    samples = scan_layout(tmp_path, "pairs", scale=2)
    listed = dict(samples.skipped)
    assert listed["GT/0002.png"] == "a GT image without its LQ (LQ/0002.png is missing)"
    assert listed["LQ/lonely.png"] == "an LQ image that no GT image names"
    odd = samples.field_paths.index(("LQ/odd.png", "GT/odd.png"))
    with pytest.raises(SampleError, match="the GT is 9x8 but the LQ is 4x4") as info:
        samples.read(odd)
    assert info.value.paths == ("LQ/odd.png", "GT/odd.png")


def test_pairs_refusals(tmp_path: Path) -> None:
    make_pairs(tmp_path, 2)
    with pytest.raises(OptionError, match="--scale N"):
        scan_layout(tmp_path, "pairs")
    with pytest.raises(OptionError, match="--scale must be"):
        scan_layout(tmp_path, "pairs", scale=0)
    with pytest.raises(OptionError, match="--filename-tmpl"):
        scan_layout(tmp_path, "pairs", scale=2, filename_tmpl="{}/../{}")
    with pytest.raises(OptionError, match="--gt-dir must be a folder inside SRC"):
        scan_layout(tmp_path, "pairs", scale=2, gt_dir="../GT")
    with pytest.raises(SourceNotFoundError, match="no GT/gt/HR/hr folder"):
        scan_layout(tmp_path / "GT", "pairs", scale=2, lq_dir=".")


# -- table ------------------------------------------------------------------------------------------
def test_table_jsonl_and_csv(tmp_path: Path) -> None:
    for k, name in enumerate(["a/1.jpg", "b/ünï.jpg", "c.jpg"]):
        _put(tmp_path / "images" / name, _encoded(IMAGE_KINDS[k], 8, 8, k))
    rows = [
        {"image": "b/ünï.jpg", "id": 7, "caption": "a ünïcode cat", "score": 0.5},
        {"image": "a/1.jpg", "id": 8, "caption": "x", "tags": ["p", "q"]},
        {"image": "a/1.jpg", "id": 9, "caption": "second caption of the same image"},
        {"image": "missing.jpg", "id": 10},
        {"image": "../images/c.jpg", "id": 11},
    ]
    table = tmp_path / "meta.jsonl"
    table.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n\n", encoding="utf-8")
    samples = scan_layout(tmp_path / "images", "table", annotations=table)
    assert [(f.name, f.kind) for f in samples.fields] == [("image", "image"), ("meta", "json")]
    assert samples.relpaths == ["b/ünï.jpg", "a/1.jpg", "a/1.jpg"]
    for i, row in enumerate(rows[:3]):
        _image, meta = _check_read(samples, i)
        assert json.loads(meta) == {k: v for k, v in row.items() if k != "image"}
        assert list(json.loads(meta)) == [k for k in row if k != "image"]  # the column order kept
    assert dict(samples.skipped) == {
        "missing.jpg": f"named by meta.jsonl:4 but missing from {tmp_path / 'images'}",
        "meta.jsonl:5": "the file name goes up a folder (..); only paths inside the source folder are packed: "
        "'../images/c.jpg'",
    }
    csv_file = tmp_path / "meta.csv"
    csv_file.write_text('file_name,id,caption\nc.jpg,007,"a, quoted\ncaption"\nb/ünï.jpg,8,plain\n', encoding="utf-8")
    samples = scan_layout(tmp_path / "images", "table", annotations=csv_file)
    assert samples.relpaths == ["c.jpg", "b/ünï.jpg"]
    assert json.loads(samples.read(0)[1]) == {"id": "007", "caption": "a, quoted\ncaption"}
    assert samples.layout_info == {"table": "meta.csv", "image_column": "file_name"}


def test_table_refusals(tmp_path: Path) -> None:
    (tmp_path / "images").mkdir()
    table = tmp_path / "t.csv"
    table.write_text("name,id\nx.jpg,1\n")
    with pytest.raises(SourceError, match="no column names the image file") as info:
        scan_layout(tmp_path / "images", "table", annotations=table)
    assert "t.csv:2" in str(info.value)
    table.write_text("name,id\nx.jpg,1,extra\n")
    with pytest.raises(SourceError, match="has 3 values but the header names 2 columns"):
        scan_layout(tmp_path / "images", "table", annotations=table, image_column="name")
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"image": "x.jpg"}\n[1, 2]\n')
    with pytest.raises(SourceError, match=r"t.jsonl:2.*not a JSON object"):
        scan_layout(tmp_path / "images", "table", annotations=jsonl)
    with pytest.raises(OptionError, match="JSON Lines"):
        scan_layout(tmp_path / "images", "table", annotations=tmp_path / "t.xlsx")


def test_unreadable_file_is_a_sample_error(tmp_path: Path) -> None:
    make_voc(tmp_path, ["a"])
    samples = scan_layout(tmp_path, "voc")
    (tmp_path / "VOCdevkit/VOC2012/SegmentationClass/a.png").unlink()  # gone after the listing
    with pytest.raises(SampleError, match="cannot read SegmentationClass/a.png") as info:
        samples.read(0)
    assert info.value.paths == ("JPEGImages/a.jpg", "SegmentationClass/a.png")


def test_the_reader_pickles(tmp_path: Path) -> None:
    """Reader processes started with spawn get the reader by pickle."""
    import pickle

    make_voc(tmp_path, ["a"])
    samples = scan_layout(tmp_path, "voc")
    assert pickle.loads(pickle.dumps(samples.read))(0) == samples.read(0)


# -- end to end: `lmdbfolder pack --layout`, `lmdbfolder import --gt` -------------------------------
def stored_fields(pack: Path) -> list[list[bytes]]:
    """Every record's fields, as the pack holds them (checksums verified); a sharded pack's
    shards one after the other, as its index names them."""
    from lmdbfolder.format.fields import split_field_payloads
    from lmdbfolder.read.reader import Reader

    if (pack / "index.json").is_file():
        shards = json.loads((pack / "index.json").read_text())["shards"]
        return [fields for entry in shards for fields in stored_fields(pack / entry["name"])]
    reader = Reader(str(pack), verify_checksums=True)
    try:
        n = len(reader.meta.field_specs)
        out = []
        for i in range(reader.meta.count):
            parts = split_field_payloads(reader.get(i).payload, n)
            assert not isinstance(parts, str), parts
            out.append([bytes(p) for p in parts])
        return out
    finally:
        reader.close()


def test_cli_pack_voc_holds_the_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lmdbfolder.cli import main

    make_voc(tmp_path / "src", ["a", "b", "été"], no_mask=("b",))
    dst = tmp_path / "voc.lmdb"
    assert main(["pack", str(tmp_path / "src"), str(dst), "--layout", "voc", "--split", "train", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "packed 2 samples of voc (split train), fields image, mask" in out
    assert "JPEGImages/b.jpg + SegmentationClass/b.png: named by ImageSets/Segmentation/train.txt:2" in out
    voc = tmp_path / "src/VOCdevkit/VOC2012"
    assert stored_fields(dst) == [
        [(voc / f"JPEGImages/{n}.jpg").read_bytes(), (voc / f"SegmentationClass/{n}.png").read_bytes()]
        for n in ("a", "été")
    ]
    assert "SegmentationClass/b.png is missing" in (dst / "skipped.txt").read_text(encoding="utf-8")


@pytest.mark.parametrize("layout", ["coco", "table", "pairs", "cityscapes"])
def test_cli_pack_layouts_json(tmp_path: Path, capsys: pytest.CaptureFixture[str], layout: str) -> None:
    from lmdbfolder.cli import main

    src = tmp_path / "src"
    kwargs: dict[str, Any]
    if layout == "coco":
        src, ann, _ = make_coco(tmp_path)
        extra, kwargs = ["--annotations", str(ann)], {"annotations": ann}
    elif layout == "table":
        _put(src / "x.jpg", _encoded("cmyk", 9, 9, 1))
        (tmp_path / "t.csv").write_text("image,caption\nx.jpg,ünï\n", encoding="utf-8")
        extra, kwargs = ["--annotations", str(tmp_path / "t.csv")], {"annotations": tmp_path / "t.csv"}
    elif layout == "pairs":
        make_pairs(src, 3)
        extra, kwargs = ["--scale", "3"], {"scale": 3}
    else:
        make_cityscapes(src)
        extra, kwargs = ["--split", "val"], {"split": "val"}
    dst = tmp_path / "out.lmdb"
    assert main(["pack", str(src), str(dst), "--layout", layout, *extra, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    expected = scan_layout(src, layout, **kwargs)
    assert report["layout"] == layout and report["count"] == len(expected.relpaths)
    assert report["fields"] == [f.to_json() for f in expected.fields]
    assert stored_fields(dst) == [expected.read(i) for i in range(len(expected.relpaths))]


def test_cli_pack_layout_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lmdbfolder.cli import main
    from lmdbfolder.cli.common import EXIT_CODES
    from lmdbfolder.cli.pack_layouts import LAYOUT_CHOICES

    assert LAYOUT_CHOICES == LAYOUTS
    make_voc(tmp_path, ["a"])
    dst = str(tmp_path / "o.lmdb")
    assert main(["pack", str(tmp_path), dst, "--split", "val"]) == EXIT_CODES["usage"]
    assert "--split goes with --layout" in capsys.readouterr().err
    assert main(["pack", str(tmp_path), dst, "--layout", "voc", "--shard-index", "0"]) == EXIT_CODES["usage"]
    assert "does not take --shard-index" in capsys.readouterr().err
    assert main(["pack", str(tmp_path), dst, "--layout", "voc", "--max-size", "64"]) == EXIT_CODES["usage"]
    assert main(["pack", str(tmp_path), dst, "--layout", "pairs"]) == EXIT_CODES["usage"]
    assert "--scale N" in capsys.readouterr().err
    assert main(["pack", str(tmp_path), dst, "--layout", "voc", "--split", "val"]) == EXIT_CODES["source error"]
    assert main(["pack", str(tmp_path), dst, "--layout", "voc", "--dry-run"]) == 0
    assert "holds 1 sample of fields image, mask" in capsys.readouterr().out
    assert not os.path.exists(dst)


def _basicsr_lmdb(path: Path, images: dict[str, bytes]) -> None:
    """A BasicSR LMDB as scripts/data_preparation/create_lmdb.py makes it: keys are the names without
    their ending, values the PNG bytes, meta_info.txt one `name (h,w,c) compression` line each."""
    import lmdb

    path.mkdir(parents=True)
    env = lmdb.open(str(path), map_size=1 << 24)
    with env.begin(write=True) as txn:
        for name, data in images.items():
            txn.put(os.path.splitext(name)[0].encode(), data)
    env.close()
    lines = []
    for name, data in images.items():
        w, h = _pil(data).size
        lines.append(f"{name} ({h},{w},3) 1\n")
    (path / "meta_info.txt").write_text("".join(lines), encoding="utf-8")


def test_import_basicsr_lmdb_pair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lmdbfolder.cli import main

    names = ["0801_s002.png", "0002_s001.png", "ünï.png"]
    lq = {n: _encoded("rgb_png", 5 + k, 4 + k, k) for k, n in enumerate(names)}
    gt = {n: _encoded("rgb_png", 2 * (5 + k), 2 * (4 + k), 10 + k) for k, n in enumerate(names)}
    lq["lq_only.png"] = _encoded("rgb_png", 3, 3, 0)
    gt["bad_scale.png"] = _encoded("rgb_png", 7, 6, 0)
    lq["bad_scale.png"] = _encoded("rgb_png", 3, 3, 0)
    _basicsr_lmdb(tmp_path / "LR_X2.lmdb", lq)
    _basicsr_lmdb(tmp_path / "HR.lmdb", gt)
    dst = tmp_path / "pairs.lmdb"
    args = ["import", str(tmp_path / "LR_X2.lmdb"), str(dst), "--gt", str(tmp_path / "HR.lmdb"), "--scale", "2"]
    assert main([*args, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "imported 3 pairs (fields lq, gt)" in out
    assert "LR_X2.lmdb/lq_only.png: an LQ image without its GT" in out
    assert "the GT is 7x6 but the LQ is 3x3" in out
    # paired_paths_from_lmdb: the keys sorted (basicsr/data/data_util.py lines 143-153)
    order = sorted(os.path.splitext(n)[0] for n in names)
    assert stored_fields(dst) == [[lq[k + ".png"], gt[k + ".png"]] for k in order]


def test_import_basicsr_pair_scale_from_meta_info(tmp_path: Path) -> None:
    from lmdbfolder.tools.importing import basicsr_pair_samples

    _basicsr_lmdb(tmp_path / "lq.lmdb", {"a.png": _encoded("rgb_png", 4, 3, 0)})
    _basicsr_lmdb(tmp_path / "gt.lmdb", {"a.png": _encoded("rgb_png", 16, 12, 0)})
    samples = basicsr_pair_samples(tmp_path / "lq.lmdb", tmp_path / "gt.lmdb")
    assert samples.layout_info["scale"] == 4 and samples.field_paths == [("lq.lmdb/a.png", "gt.lmdb/a.png")]
    assert samples.read(0)[1] == _encoded("rgb_png", 16, 12, 0)


# -- end to end: the pack read back with LMDBDataset equals the reference dataset ------------------
def _lmdbdataset() -> Any:
    torch_layer = pytest.importorskip("lmdbfolder.torch")
    return torch_layer.LMDBDataset


def test_packed_voc_reads_as_vocsegmentation_also_through_v2(tmp_path: Path) -> None:
    import torch
    from torchvision.transforms import v2

    from lmdbfolder.cli import main

    LMDBDataset = _lmdbdataset()
    make_voc(tmp_path / "src", ["2007_000032", "été_ünïcode", "cmyk", "gray"])
    dst = tmp_path / "voc.lmdb"
    assert main(["pack", str(tmp_path / "src"), str(dst), "--layout", "voc", "--no-progress"]) == 0
    theirs = datasets.VOCSegmentation(str(tmp_path / "src"), image_set="train")
    ours = LMDBDataset(dst)
    assert len(ours) == len(theirs) == 4
    for i in range(len(theirs)):
        assert_same_sample(ours[i], theirs[i])
    tf = v2.Compose([v2.RandomResizedCrop((12, 10), antialias=True), v2.RandomHorizontalFlip(), v2.PILToTensor()])
    wrapped = datasets.wrap_dataset_for_transforms_v2(datasets.VOCSegmentation(str(tmp_path / "src"), transforms=tf))
    ours = LMDBDataset(dst, transforms=tf)
    for i in range(len(theirs)):
        torch.manual_seed(i)
        expected = wrapped[i]
        torch.manual_seed(i)
        assert_same_sample(ours[i], expected)


def test_packed_cityscapes_and_ade20k_read_back(tmp_path: Path) -> None:
    from lmdbfolder.cli import main

    LMDBDataset = _lmdbdataset()
    make_cityscapes(tmp_path / "cs")
    assert (
        main(["pack", str(tmp_path / "cs"), str(tmp_path / "cs.lmdb"), "--layout", "cityscapes", "--no-progress"]) == 0
    )
    theirs = datasets.Cityscapes(str(tmp_path / "cs"), split="train", mode="fine", target_type="semantic")
    ours = LMDBDataset(tmp_path / "cs.lmdb")
    assert len(ours) == len(theirs) == 6
    for i in range(len(theirs)):
        assert_same_sample(ours[i], theirs[i])
    ade = tmp_path / "ade"
    _put(ade / "images/training/a.jpg", _encoded("cmyk", 11, 7, 0))
    _put(ade / "annotations/training/a.png", _encoded("mask16", 11, 7, 0))
    assert main(["pack", str(ade), str(tmp_path / "ade.lmdb"), "--layout", "ade20k", "--no-progress"]) == 0
    image, mask = LMDBDataset(tmp_path / "ade.lmdb")[0]
    assert_same_image(image, Image.open(ade / "images/training/a.jpg").convert("RGB"))
    assert_same_image(mask, Image.open(ade / "annotations/training/a.png"))  # 16 bits, as the file opens


def test_packed_coco_reads_as_cocodetection_also_through_v2(tmp_path: Path) -> None:
    pytest.importorskip("pycocotools")
    import torch
    from torchvision.transforms import v2

    from lmdbfolder.cli import main

    LMDBDataset = _lmdbdataset()
    images, ann, _data = make_coco(tmp_path)
    dst = tmp_path / "coco.lmdb"
    assert main(["pack", str(images), str(dst), "--layout", "coco", "--annotations", str(ann), "--no-progress"]) == 0
    theirs = datasets.CocoDetection(str(images), str(ann))
    ours = LMDBDataset(dst)
    assert len(ours) == len(theirs)
    for i in range(len(theirs)):
        assert_same_sample(ours[i], theirs[i])
    tf = v2.Compose([v2.RandomHorizontalFlip(), v2.RandomResizedCrop((16, 16), antialias=True), v2.PILToTensor()])
    wrapped = datasets.wrap_dataset_for_transforms_v2(datasets.CocoDetection(str(images), str(ann), transforms=tf))
    ours = LMDBDataset(dst, transforms=tf)
    for i in range(len(theirs)):
        torch.manual_seed(i)
        expected = wrapped[i]
        torch.manual_seed(i)
        assert_same_sample(ours[i], expected)


def test_packed_pairs_read_back_as_rgb_pairs(tmp_path: Path) -> None:
    from lmdbfolder.cli import main

    LMDBDataset = _lmdbdataset()
    make_pairs(tmp_path / "src", 2)
    assert (
        main(
            [
                "pack",
                str(tmp_path / "src"),
                str(tmp_path / "p.lmdb"),
                "--layout",
                "pairs",
                "--scale",
                "2",
                "--no-progress",
            ]
        )
        == 0
    )
    expected = basicsr_paired_paths_from_folder(str(tmp_path / "src/LQ"), str(tmp_path / "src/GT"), "{}")
    ours = LMDBDataset(tmp_path / "p.lmdb")
    assert len(ours) == len(expected) == 4
    for i, (lq, gt) in enumerate(expected):
        assert_same_sample(ours[i], (Image.open(lq).convert("RGB"), Image.open(gt).convert("RGB")))


def _listed(batch: list[Any]) -> list[Any]:
    return batch


def test_packed_table_reads_back_through_dataloader_workers(tmp_path: Path) -> None:
    import torch.utils.data

    from lmdbfolder.cli import main

    LMDBDataset = _lmdbdataset()
    rows = [("b/ünï.jpg", "cmyk"), ("a.jpg", "gray"), ("a.jpg", "rgb")]
    for name, kind in rows:
        _put(tmp_path / "images" / name, _encoded(kind, 9, 7, len(name)))
    (tmp_path / "t.jsonl").write_text(
        "".join(json.dumps({"image": n, "id": k, "caption": f"ü {k}"}) + "\n" for k, (n, _) in enumerate(rows)),
        encoding="utf-8",
    )
    dst = tmp_path / "t.lmdb"
    args = ["pack", str(tmp_path / "images"), str(dst), "--layout", "table", "--annotations", str(tmp_path / "t.jsonl")]
    assert main([*args, "--no-progress"]) == 0
    expected = [
        (Image.open(tmp_path / "images" / n).convert("RGB"), {"id": k, "caption": f"ü {k}"})
        for k, (n, _) in enumerate(rows)
    ]
    loader = torch.utils.data.DataLoader(LMDBDataset(dst), batch_size=2, num_workers=2, collate_fn=_listed)
    got = [item for batch in loader for item in batch]
    assert len(got) == 3
    for ours, theirs in zip(got, expected):
        assert_same_sample(tuple(ours), theirs)


def test_cityscapes_stray_files_beside_the_cities(tmp_path: Path) -> None:
    """A README beside the city folders of gtFine/<split> is no city (it made the listing fail)."""
    make_cityscapes(tmp_path)
    (tmp_path / "gtFine/train/README").write_text("x")
    samples = scan_layout(tmp_path, "cityscapes")
    assert len(samples.relpaths) == 6 and samples.skipped == []


# -- pack --update of a pack of several fields -------------------------------------------------------
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
    compared = pack_field_samples(scan_layout(src, "voc"), dst, update=True, check="content", progress=False)
    assert compared.changes is not None and (compared.changes.read, compared.changes.unchanged) == (4, 4)
    assert compared.changes.changed == compared.changes.added == compared.changes.removed == 0
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
    # a sharded pack: refused before any shard changes (its last shard's split is checked too)
    sharded = tmp_path / "sharded"
    pack_field_samples(scan_layout(src, "voc"), sharded, shards=2, progress=False)
    before = {p.name: (p / "data.mdb").read_bytes() for p in sharded.iterdir() if p.is_dir()}
    with pytest.raises(OptionError, match="split train.*split val"):
        pack_field_samples(scan_layout(src, "voc", split="val"), sharded, update=True, progress=False)
    with pytest.raises(OptionError, match="has 2 shards, not 3"):
        pack_field_samples(scan_layout(src, "voc"), sharded, shards=3, update=True, progress=False)
    assert {p.name: (p / "data.mdb").read_bytes() for p in sharded.iterdir() if p.is_dir()} == before
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
    # --update of a DST that does not exist packs it; of a sharded pack, updates it as it is split
    assert main([*base[:2], str(tmp_path / "shards"), *base[3:], "--shards", "2", "--update"]) == 0
    assert "packed 4 samples" in capsys.readouterr().out and (tmp_path / "shards/index.json").is_file()
    assert main([*base[:2], str(tmp_path / "sh--shards"), *base[3:], "--update"]) == 0
    assert "up to date" in capsys.readouterr().out
    assert (
        main([*base[:2], str(tmp_path / "sh--shards"), *base[3:], "--update", "--shards", "3"]) == EXIT_CODES["usage"]
    )
    assert "has 2 shards, not 3" in capsys.readouterr().err


# -- pack --update of a sharded pack of several fields -----------------------------------------------
def _change_voc(src: Path) -> None:
    """b's mask replaced (same size, other bytes), c gone (its files and split line), e added."""
    voc = src / "VOCdevkit/VOC2012"
    _put(voc / "SegmentationClass/b.png", _encoded("palette", 20, 14, 999))
    _touch_later(voc / "SegmentationClass/b.png")
    for name in ("JPEGImages/c.jpg", "SegmentationClass/c.png"):
        os.remove(voc / name)
    _put(voc / "JPEGImages/e.jpg", _encoded("gray", 11, 9, 5))
    _put(voc / "SegmentationClass/e.png", _encoded("palette", 11, 9, 6))
    (voc / "ImageSets/Segmentation/train.txt").write_text("a\nb\nd\ne\n")


def _shard_files(dst: Path) -> dict[str, bytes]:
    return {p.name: (p / "data.mdb").read_bytes() for p in sorted(dst.iterdir()) if p.is_dir()}


def test_sharded_update_of_a_voc_pack_reads_as_vocsegmentation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lmdbfolder.cli import main
    from lmdbfolder.tools.verify import verify

    LMDBDataset = _lmdbdataset()
    src = tmp_path / "src"
    make_voc(src, ["a", "b", "c", "d"])
    dst = tmp_path / "sh"
    base = ["pack", str(src), str(dst), "--layout", "voc", "--no-progress"]
    assert main([*base, "--shards", "2"]) == 0
    _change_voc(src)
    capsys.readouterr()
    assert main([*base, "--update", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    changes = out["changes"]
    assert (changes["added"], changes["removed"], changes["changed"]) == (1, 1, 1)
    assert changes["read"] == 2  # b (its mask changed) and e; a and d stat-ed only
    assert out["count"] == 4 and out["num_shards"] == 2
    theirs = datasets.VOCSegmentation(str(src), image_set="train")
    ours = LMDBDataset(str(dst))
    assert len(ours) == len(theirs) == 4
    for i in range(len(theirs)):
        assert_same_sample(ours[i], theirs[i])
    assert ours[1][1].mode == "P"  # b's new mask, its palette indices kept
    assert stored_fields(dst) == _voc_files(src, ["a", "b", "d", "e"])
    report = verify(str(dst), progress=False)
    assert report.ok, report.problems
    # the same update again: nothing read, nothing written
    before = _shard_files(dst)
    assert main([*base, "--update"]) == 0
    assert "nothing changed" in capsys.readouterr().out
    assert _shard_files(dst) == before
    history = json.loads((dst / "index.json").read_text())["history"]
    assert [h["event"] for h in history] == ["pack", "update"]


def test_sharded_update_of_pairs_keeps_each_sample_in_its_shard(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lmdbfolder.cli import main
    from lmdbfolder.tools.verify import verify

    LMDBDataset = _lmdbdataset()
    src = make_pairs(tmp_path / "src", 2)
    dst = tmp_path / "sh"
    base = ["pack", str(src), str(dst), "--layout", "pairs", "--scale", "2", "--no-progress"]
    assert main([*base, "--shards", "2"]) == 0
    first = scan_layout(src, "pairs", scale=2)
    # the first shard's first LQ replaced, a pair added, the first shard's second GT removed:
    # its LQ is left alone, listed in the shard that held its sample (a fresh pack lists it last)
    lq0, gt1 = first.field_paths[0][0], first.field_paths[1][1]
    _put(src / lq0, _encoded("rgb_png", *Image.open(src / lq0).size, 77))
    _touch_later(src / lq0)
    _put(src / "GT/new.png", _encoded("rgb_png", 8, 6, 1))
    _put(src / "LQ/new.png", _encoded("rgb_png", 4, 3, 2))
    os.remove(src / gt1)
    capsys.readouterr()
    assert main([*base, "--update"]) == 0
    out = capsys.readouterr().out
    # read: the changed pair, the new one, and the lonely LQ (a new entry, listed without a read)
    assert "updated" in out and "+1 / -1 / ~1" in out and "3 samples read" in out, out
    assert first.field_paths[1][0] in out  # the lonely LQ: listed
    now = scan_layout(src, "pairs", scale=2)
    assert stored_fields(dst) == [now.read(i) for i in range(len(now.relpaths))]  # in BasicSR's order
    shards = json.loads((dst / "index.json").read_text())["shards"]
    assert [e["skipped"] for e in shards] == [1, 0]  # the removed sample's shard lists its LQ
    fresh = tmp_path / "fresh"
    assert main(["pack", str(src), str(fresh), *base[3:], "--shards", "2"]) == 0
    single, updated = LMDBDataset(str(fresh)), LMDBDataset(str(dst))
    assert len(updated) == len(single) == 4
    for i in range(len(single)):
        assert_same_sample(updated[i], single[i])
    report = verify(str(dst), progress=False)
    assert report.ok, report.problems
    # the GT back: its sample again, in the shard that holds its LQ's name
    _put(src / gt1, _encoded("rgb_png", *(2 * v for v in Image.open(src / first.field_paths[1][0]).size), 3))
    assert main([*base, "--update"]) == 0
    now = scan_layout(src, "pairs", scale=2)
    assert stored_fields(dst) == [now.read(i) for i in range(len(now.relpaths))]
    after = json.loads((dst / "index.json").read_text())["shards"]
    assert [(e["count"], e["skipped"]) for e in after] == [(shards[0]["count"] + 1, 0), (shards[1]["count"], 0)]
    assert verify(str(dst), progress=False).ok


def test_sharded_update_of_ade20k_when_partners_come_and_go(tmp_path: Path) -> None:
    """A sample left out while listing is listed after the others, in the last shard: when
    its mask comes, it is a sample at the start of the list (it once stopped the update,
    as a file "listed after files of a later shard"); a first-shard sample losing its mask
    is listed in the first shard."""
    from lmdbfolder.tools.verify import verify

    ade = tmp_path / "ADEChallengeData2016"
    for k, name in enumerate(["b", "c", "d", "e"]):
        _put(ade / f"images/training/{name}.jpg", _encoded(IMAGE_KINDS[k % 3], 9, 7 + k, k))
        _put(ade / f"annotations/training/{name}.png", _encoded("labels", 9, 7 + k, k))
    _put(ade / "images/training/a.jpg", _encoded("rgb", 9, 9, 9))  # no mask yet
    dst = tmp_path / "sh"
    pack_field_samples(scan_layout(ade, "ade20k"), dst, shards=2, progress=False)
    _put(ade / "annotations/training/a.png", _encoded("labels", 9, 9, 9))
    os.remove(ade / "annotations/training/c.png")
    samples = scan_layout(ade, "ade20k")
    result = pack_field_samples(samples, dst, update=True, progress=False)
    assert result.changes is not None and (result.changes.added, result.changes.removed) == (1, 1)
    assert stored_fields(dst) == [samples.read(i) for i in range(len(samples.relpaths))]
    shards = json.loads((dst / "index.json").read_text())["shards"]
    assert [(e["count"], e["skipped"]) for e in shards] == [(2, 1), (2, 0)]  # a, b (c listed); d, e
    assert verify(str(dst), progress=False).ok


_KILL_AT_INDEX = """
import os, signal, sys
sys.path.insert(0, {src_dir!r})
import lmdbfolder.write.shards as shards
from lmdbfolder.cli import main
shards.write_index = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
main(["pack", {src!r}, {dst!r}, "--layout", "voc", "--update", "--no-progress"])
"""


def test_a_sharded_update_of_fields_interrupted_or_killed_reads_as_the_old_version(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    from conftest import reader_view
    from lmdbfolder.cli import main
    from lmdbfolder.tools.verify import verify

    src = tmp_path / "src"
    make_voc(src, ["a", "b", "c", "d"])
    dst = tmp_path / "sh"
    assert main(["pack", str(src), str(dst), "--layout", "voc", "--shards", "2", "--no-progress"]) == 0
    old, files = reader_view(dst), _shard_files(dst)
    _change_voc(src)  # both shards change: a, b (b's mask) | d, e (c removed, e added)
    # interrupted while reading the second shard's new sample (the first shard is updated)
    samples = scan_layout(src, "voc")
    read = samples.read

    def interrupted(i: int) -> list[bytes]:
        if samples.relpaths[i] == "JPEGImages/e.jpg":
            raise KeyboardInterrupt
        return read(i)

    samples.read = interrupted
    with pytest.raises(KeyboardInterrupt):
        pack_field_samples(samples, dst, update=True, workers=1, progress=False)
    first, second = files  # the shards (the second's staging folder beside them now)
    now = _shard_files(dst)
    assert now[first] != files[first] and now[second] == files[second]
    assert reader_view(dst) == old
    assert verify(str(dst), progress=False).ok
    # then killed before the new index
    code = _KILL_AT_INDEX.format(src_dir=str(Path(__file__).resolve().parents[1] / "src"), src=str(src), dst=str(dst))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    # every shard updated, the index the old one: the old version, whole and checked
    assert reader_view(dst) == old
    report = verify(str(dst), progress=False)
    assert report.ok, report.problems
    assert main(["pack", str(src), str(dst), "--layout", "voc", "--update", "--no-progress"]) == 0
    assert stored_fields(dst) == _voc_files(src, ["a", "b", "d", "e"])
    assert verify(str(dst), progress=False).ok


# -- export of pairs and tables ----------------------------------------------------------------------
@pytest.mark.parametrize("tmpl", ["{}", "{}x2"])
def test_export_pairs_gives_basicsr_folders(tmp_path: Path, tmpl: str) -> None:
    from lmdbfolder.tools.export import export

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


def test_a_sharded_pack_of_pairs_staged_from_object_storage_in_workers(s3: Any, tmp_path: Path) -> None:
    import torch

    import lmdbfolder
    from lmdbfolder.cli import main
    from lmdbfolder.torch import LMDBDataset

    make_pairs(tmp_path / "src", 2)
    dst = tmp_path / "p"
    assert main(["pack", str(tmp_path / "src"), str(dst), "--layout", "pairs", "--scale", "2", "--shards", "2"]) == 0
    url = s3.url("pairs")
    lmdbfolder.copy_pack(dst, url)
    local, remote = LMDBDataset(str(dst)), LMDBDataset(url, cache_dir=tmp_path / "cache")
    assert len(remote) == len(local) == 4
    for i in range(len(local)):
        assert [(im.mode, im.tobytes()) for im in remote[i]] == [(im.mode, im.tobytes()) for im in local[i]]
    # DataLoader workers (fork) stage and read the shards too
    loader = torch.utils.data.DataLoader(
        LMDBDataset(url, cache_dir=tmp_path / "cache2"), batch_size=2, num_workers=2, collate_fn=list
    )
    got = [[(im.mode, im.tobytes()) for im in item] for batch in loader for item in batch]
    assert got == [[(im.mode, im.tobytes()) for im in local[i]] for i in range(4)]


def test_an_interrupted_update_of_a_pack_of_fields_leaves_the_old_version_and_resumes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_voc(src, ["a", "b", "c"])
    dst = tmp_path / "voc.lmdb"
    pack_field_samples(scan_layout(src, "voc"), dst, progress=False)
    before = stored_fields(dst)
    voc = src / "VOCdevkit/VOC2012"
    for k, name in enumerate(["d", "e", "f"]):
        _put(voc / f"JPEGImages/{name}.jpg", _encoded("rgb", 9, 7, 40 + k))
        _put(voc / f"SegmentationClass/{name}.png", _encoded("palette", 9, 7, 50 + k))
    (voc / "ImageSets/Segmentation/train.txt").write_text("a\nb\nc\nd\ne\nf\n")
    samples = scan_layout(src, "voc")
    read = samples.read

    def interrupted(i: int) -> list[bytes]:
        if i == 4:
            raise KeyboardInterrupt
        return read(i)

    samples.read = interrupted
    with pytest.raises(KeyboardInterrupt):
        pack_field_samples(samples, dst, update=True, workers=1, commit_every=1, progress=False)
    assert stored_fields(dst) == before  # the old version, whole
    result = pack_field_samples(scan_layout(src, "voc"), dst, update=True, workers=1, progress=False)
    assert result.resumed_from == 1 and result.changes is not None and result.changes.added == 3
    assert stored_fields(dst) == _voc_files(src, ["a", "b", "c", "d", "e", "f"])

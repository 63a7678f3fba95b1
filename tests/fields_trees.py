"""Small generated trees in the layouts of torchvision's VOCSegmentation, Cityscapes and
CocoDetection (odd sizes, palette / 8-bit / 16-bit masks, grayscale and CMYK images, non-ASCII
names), for the oracle tests of packs of several fields."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

from conftest import photo_jpeg, write

#: (name, image mode, (width, height), mask mode) of the VOC samples.
VOC_SAMPLES = [
    ("2007_000032", "RGB", (37, 29), "P"),
    ("ñandú_é", "L", (31, 23), "P"),
    ("cmyk_1", "CMYK", (29, 41), "L"),
    ("deep_2", "RGB", (33, 25), "I;16"),
]


def mask_png(mode: str, size: tuple[int, int], seed: int) -> bytes:
    """A mask of blobs of a few classes (plus VOC's 255 border) in ``mode``, as PNG."""
    w, h = size
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    labels = np.zeros((h, w), np.int32)
    for k in range(1, 4):
        cx, cy, r = rng.integers(0, w), rng.integers(0, h), rng.integers(3, max(4, min(w, h) // 2))
        labels[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = k
    out = io.BytesIO()
    if mode == "P":
        labels[(labels > 0) & (np.roll(labels, 1, 1) == 0)] = 255
        img = Image.fromarray(labels.astype(np.uint8), "L").convert("P")
        palette = [c for i in range(256) for c in ((i * 37) % 256, (i * 91) % 256, (i * 53) % 256)]
        img.putpalette(palette)
    elif mode == "I;16":
        img = Image.fromarray((labels * 1000 + 7).astype(np.uint16))
    else:
        img = Image.fromarray(labels.astype(np.uint8), "L")
    img.save(out, "PNG")
    return out.getvalue()


def image_jpeg(mode: str, size: tuple[int, int], seed: int) -> bytes:
    return photo_jpeg(*size, mode=mode, seed=seed)


def make_voc(root: Path, samples: list[tuple[str, str, tuple[int, int], str]] = VOC_SAMPLES) -> Path:
    """``root/VOCdevkit/VOC2012`` with JPEGImages, SegmentationClass and ImageSets/Segmentation/train.txt."""
    voc = root / "VOCdevkit" / "VOC2012"
    for k, (name, mode, size, mask_mode) in enumerate(samples):
        write(voc / "JPEGImages" / f"{name}.jpg", image_jpeg(mode, size, k))
        write(voc / "SegmentationClass" / f"{name}.png", mask_png(mask_mode, size, k))
    split = "".join(f"{name}\n" for name, *_ in samples)
    write(voc / "ImageSets" / "Segmentation" / "train.txt", split.encode())
    return root


CITYSCAPES_SAMPLES = [
    ("aachen", "aachen_000000_000019", (41, 21), "L"),
    ("aachen", "aachen_000001_000019", (41, 21), "L"),
    ("zürich", "zürich_000002_000019", (27, 35), "I;16"),
]


def make_cityscapes(root: Path) -> Path:
    """``leftImg8bit/train/<city>/<x>_leftImg8bit.png`` and ``gtFine/train/<city>/<x>_gtFine_labelIds.png``."""
    for k, (city, stem, size, mask_mode) in enumerate(CITYSCAPES_SAMPLES):
        image = Image.open(io.BytesIO(image_jpeg("RGB", size, 10 + k)))
        out = io.BytesIO()
        image.save(out, "PNG")
        write(root / "leftImg8bit" / "train" / city / f"{stem}_leftImg8bit.png", out.getvalue())
        write(root / "gtFine" / "train" / city / f"{stem}_gtFine_labelIds.png", mask_png(mask_mode, size, 10 + k))
    return root


def make_coco(root: Path) -> tuple[Path, Path]:
    """``root/images/*.jpg`` and ``root/annotations.json``: images of unsorted ids (one with no
    annotation, one grayscale, one CMYK), boxes with polygons, categories. Returns (images, json)."""
    images_dir = root / "images"
    specs = [(7, "b_ñ.jpg", "RGB", (45, 33)), (3, "a.jpg", "L", (31, 39)), (11, "c.jpg", "CMYK", (29, 27))]
    images, annotations = [], []
    ann_id = 100
    rng = np.random.default_rng(5)
    for image_id, name, mode, (w, h) in specs:
        write(images_dir / name, image_jpeg(mode, (w, h), image_id))
        images.append({"id": image_id, "file_name": name, "width": w, "height": h})
        for _ in range(0 if image_id == 11 else 3):
            x, y = float(rng.integers(0, w - 8)), float(rng.integers(0, h - 8))
            bw, bh = float(rng.integers(2, w - x)), float(rng.integers(2, h - y))
            poly = [x, y, x + bw, y, x + bw, y + bh, x, y + bh]
            annotations.append(
                {
                    "id": ann_id,
                    "image_id": image_id,
                    "category_id": int(rng.integers(1, 4)),
                    "bbox": [x, y, bw, bh],
                    "area": bw * bh,
                    "iscrowd": 0,
                    "segmentation": [poly],
                }
            )
            ann_id += 1
    # A degenerate box (zero width): SanitizeBoundingBoxes removes it on both sides.
    annotations.append(
        {"id": ann_id, "image_id": 3, "category_id": 2, "bbox": [4.0, 5.0, 0.0, 6.0], "area": 0.0, "iscrowd": 0,
         "segmentation": [[4.0, 5.0, 4.0, 11.0, 4.5, 11.0]]}
    )
    categories = [{"id": 1, "name": "cat"}, {"id": 2, "name": "dög"}, {"id": 3, "name": "bird"}]
    ann_file = root / "annotations.json"
    ann_file.write_text(json.dumps({"images": images, "annotations": annotations, "categories": categories}))
    return images_dir, ann_file

"""Image + mask trees: Pascal VOC, ADE20K and Cityscapes, paired as torchvision pairs them.

* ``voc``: ``VOCSegmentation``'s rules (torchvision/datasets/voc.py): the split file
  ``ImageSets/Segmentation/<split>.txt`` names the samples, one per line (``x.strip()``), in its
  order; the image is ``JPEGImages/<name>.jpg``, the mask ``SegmentationClass/<name>.png``.
* ``ade20k``: ``images/<split>/**/x.<ext>`` + ``annotations/<split>/**/x.png`` (the
  ADEChallengeData2016 tree), sorted by path as mmsegmentation lists it.
* ``cityscapes``: ``Cityscapes(mode="fine", target_type="semantic")``'s rules
  (torchvision/datasets/cityscapes.py): for each city of ``os.listdir(leftImg8bit/<split>)``,
  each file of ``os.listdir`` of that city, in that order; the mask is
  ``gtFine/<split>/<city>/<name up to _leftImg8bit>_gtFine_labelIds.png``.

An image without its mask (or a mask without its image, a split line naming no file) is skipped
and listed with its file names; torchvision would fail on it, or never see it.
"""

from __future__ import annotations

import os
import re

from lmdbfolder.errors import OptionError, SourceError, SourceNotFoundError
from lmdbfolder.format.fields import FieldSpec
from lmdbfolder.write.fields import FieldSamples
from lmdbfolder.write.layouts._common import (
    file_samples,
    list_files,
    read_text,
    require_dir,
    unsafe_name,
    walk_files,
)
from lmdbfolder.write.sources import IMG_EXTENSIONS

__all__ = ["scan_voc", "scan_ade20k", "scan_cityscapes", "find_voc_root", "voc_info", "cityscapes_info"]

IMAGE_AND_MASK = (FieldSpec("image", "image"), FieldSpec("mask", "mask"))
#: What VOCSegmentation reads: the split folder, the image folder and ending, the mask folder and ending.
VOC_SPLITS_DIR = os.path.join("ImageSets", "Segmentation")
VOC_IMAGES, VOC_IMAGE_EXT = "JPEGImages", ".jpg"
VOC_MASKS, VOC_MASK_EXT = "SegmentationClass", ".png"
#: Cityscapes' image and (semantic, fine) mask name endings.
CITYSCAPES_IMAGE = "_leftImg8bit"
CITYSCAPES_MASK = "_gtFine_labelIds.png"
#: The ``mode`` a Cityscapes pack records, by torchvision's ``Cityscapes.mode`` (its mask folder).
CITYSCAPES_MODES = {"gtFine": "fine", "gtCoarse": "coarse"}


def voc_info(split: str, root: str) -> dict[str, object]:
    """The ``layout_info`` of a VOC pack (what ``pack --update`` checks it against): the split and
    the name of the year's folder holding ``JPEGImages`` (``VOC2012``). ``scan_voc`` and
    ``pack_dataset`` of a ``VOCSegmentation`` record the same, so either can update the other's pack.
    ``root`` as given (not made absolute): the packs made before record it so."""
    return {"split": split, "year_folder": os.path.basename(root)}


def cityscapes_info(split: str, mode: str = "fine") -> dict[str, object]:
    """The ``layout_info`` of a Cityscapes pack: the split and the annotation ``mode`` (``fine``, as
    the layout reads; torchvision's ``gtFine``/``gtCoarse`` are recorded as ``fine``/``coarse``)."""
    return {"split": split, "mode": CITYSCAPES_MODES.get(mode, mode)}


def find_voc_root(src: str) -> str:
    """The folder holding ``JPEGImages`` under ``src``: ``src`` itself, ``src/VOC2012`` (``src`` is a
    VOCdevkit) or ``src/VOCdevkit/VOC2012`` (the root torchvision's VOCSegmentation takes); another
    year when it is the only one there."""
    for base in (src, os.path.join(src, "VOCdevkit")):
        if os.path.isdir(os.path.join(base, VOC_IMAGES)):
            return base
        if not os.path.isdir(base):
            continue
        years = sorted(
            n for n in os.listdir(base) if re.fullmatch(r"VOC\d{4}", n) and os.path.isdir(os.path.join(base, n))
        )
        if "VOC2012" in years:
            return os.path.join(base, "VOC2012")
        if len(years) == 1:
            return os.path.join(base, years[0])
        if years:
            raise SourceError(
                base, f"holds several VOC years ({', '.join(years)})", "pass the folder of the year to pack as SRC"
            )
    raise SourceNotFoundError(
        src,
        f"no Pascal VOC tree here (no {VOC_IMAGES} folder, no VOCdevkit/VOC2012)",
        "pass the VOCdevkit folder, the VOC2012 folder or a folder holding JPEGImages and SegmentationClass",
    )


def scan_voc(src: str, split: str | None) -> FieldSamples:
    """The samples of a Pascal VOC segmentation split, as ``VOCSegmentation(image_set=split)`` lists them."""
    split = split or "train"
    _check_split_name(split)
    root = find_voc_root(src)
    split_file = os.path.join(root, VOC_SPLITS_DIR, split + ".txt")
    text = read_text(split_file, "split file")
    images = list_files(os.path.join(root, VOC_IMAGES))
    masks = list_files(os.path.join(root, VOC_MASKS))
    where = f"{VOC_SPLITS_DIR}/{split}.txt".replace(os.sep, "/")
    field_paths: list[tuple[str, ...]] = []
    skipped: list[tuple[str, str]] = []
    total = 0
    # As VOCSegmentation: readlines(), each line strip()ped (a line of blanks names nothing).
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    if lines and not lines[-1]:
        lines.pop()  # the end of the last line, not a line
    for lineno, line in enumerate(lines, 1):
        name = line.strip()
        problem = unsafe_name(name)
        if problem is not None:
            skipped.append((f"{where}:{lineno}", f"{problem}: {name[:200]!r}"))
            continue
        image, mask = f"{VOC_IMAGES}/{name}{VOC_IMAGE_EXT}", f"{VOC_MASKS}/{name}{VOC_MASK_EXT}"
        image_size = _size_of(images, root, VOC_IMAGES, name + VOC_IMAGE_EXT)
        mask_size = _size_of(masks, root, VOC_MASKS, name + VOC_MASK_EXT)
        missing = _missing(image if image_size is None else None, mask if mask_size is None else None)
        if missing:
            skipped.append((f"{image} + {mask}", f"named by {where}:{lineno} but {missing}"))
            continue
        field_paths.append((image, mask))
        total += (image_size or 0) + (mask_size or 0)
    return file_samples(
        "voc",
        root,
        IMAGE_AND_MASK,
        field_paths,
        skipped,
        voc_info(split, root),
        total,
    )


def scan_ade20k(src: str, split: str | None) -> FieldSamples:
    """The samples of an ADE20K split (``images/<split>`` + ``annotations/<split>``), sorted by path."""
    split = split or "training"
    _check_split_name(split)
    root = src
    if not os.path.isdir(os.path.join(root, "images")) and os.path.isdir(os.path.join(src, "ADEChallengeData2016")):
        root = os.path.join(src, "ADEChallengeData2016")
    image_dir = os.path.join(root, "images", split)
    mask_dir = os.path.join(root, "annotations", split)
    hint = (
        "SRC must hold images/<split>/ and annotations/<split>/ (ADEChallengeData2016); --split training or validation"
    )
    require_dir(image_dir, f"ADE20K images/{split} folder", hint)
    require_dir(mask_dir, f"ADE20K annotations/{split} folder", hint)
    images = {p: s for p, s in walk_files(image_dir).items() if p.lower().endswith(IMG_EXTENSIONS)}
    masks = {p: s for p, s in walk_files(mask_dir).items() if p.lower().endswith(".png")}
    used: dict[str, str] = {}
    field_paths: list[tuple[str, ...]] = []
    skipped: list[tuple[str, str]] = []
    total = 0
    for rel, size in images.items():
        mask_rel = os.path.splitext(rel)[0] + ".png"
        image, mask = f"images/{split}/{rel}", f"annotations/{split}/{mask_rel}"
        if mask_rel not in masks:
            skipped.append((image, f"an image without its mask ({mask} is missing)"))
            continue
        if mask_rel in used:
            skipped.append((image, f"its mask {mask} is already the mask of {used[mask_rel]}"))
            continue
        used[mask_rel] = image
        field_paths.append((image, mask))
        total += size + masks[mask_rel]
    image_stems = {os.path.splitext(rel)[0] for rel in images}
    for mask_rel in masks:
        if os.path.splitext(mask_rel)[0] not in image_stems:
            skipped.append(
                (f"annotations/{split}/{mask_rel}", "a mask without its image (no images/ file of that name)")
            )
    return file_samples("ade20k", root, IMAGE_AND_MASK, field_paths, skipped, {"split": split}, total)


def scan_cityscapes(src: str, split: str | None) -> FieldSamples:
    """The samples of a Cityscapes split, in the order of ``Cityscapes(split, target_type="semantic")``."""
    split = split or "train"
    _check_split_name(split)
    root = src
    image_dir = os.path.join(root, "leftImg8bit", split)
    mask_dir = os.path.join(root, "gtFine", split)
    hint = "SRC must hold leftImg8bit/<split>/<city>/ and gtFine/<split>/<city>/; --split train, val or test"
    require_dir(image_dir, f"Cityscapes leftImg8bit/{split} folder", hint)
    require_dir(mask_dir, f"Cityscapes gtFine/{split} folder", hint)
    field_paths: list[tuple[str, ...]] = []
    skipped: list[tuple[str, str]] = []
    total = 0
    paired_masks: set[str] = set()
    for city in os.listdir(image_dir):  # torchvision's order: os.listdir, unsorted
        if not os.path.isdir(os.path.join(image_dir, city)):
            skipped.append((f"leftImg8bit/{split}/{city}", "not a city folder"))
            continue
        masks = list_files(os.path.join(mask_dir, city))
        for file_name in os.listdir(os.path.join(image_dir, city)):
            image = f"leftImg8bit/{split}/{city}/{file_name}"
            if not os.path.isfile(os.path.join(image_dir, city, file_name)):
                skipped.append((image, "not a file"))
                continue
            mask_name = f"{file_name.split(CITYSCAPES_IMAGE)[0]}_{CITYSCAPES_MASK[1:]}"
            mask = f"gtFine/{split}/{city}/{mask_name}"
            if mask_name not in masks:
                skipped.append((image, f"an image without its mask ({mask} is missing)"))
                continue
            paired_masks.add(mask)
            field_paths.append((image, mask))
            total += os.path.getsize(os.path.join(image_dir, city, file_name)) + masks[mask_name]
    for city in sorted(os.listdir(mask_dir)):
        if not os.path.isdir(os.path.join(mask_dir, city)):
            continue  # a README beside the cities: no masks in it
        for mask_name in list_files(os.path.join(mask_dir, city)):
            mask = f"gtFine/{split}/{city}/{mask_name}"
            if mask_name.endswith(CITYSCAPES_MASK) and mask not in paired_masks:
                skipped.append((mask, "a mask without its image (no leftImg8bit file of that name)"))
    return file_samples("cityscapes", root, IMAGE_AND_MASK, field_paths, skipped, cityscapes_info(split), total)


def _check_split_name(split: str) -> None:
    """A split names a file or folder inside SRC: one plain name."""
    if unsafe_name(split) is not None or "/" in split or "\\" in split or split in (".", ".."):
        raise OptionError(f"--split must be one plain name (train, val, training ...), got {split[:100]!r}")


def _size_of(listing: dict[str, int], root: str, folder: str, name: str) -> int | None:
    """The size of ``folder/name`` (a name from a split file may hold a sub-folder: then stat it)."""
    if name in listing:
        return listing[name]
    if "/" in name or "\\" in name:
        path = os.path.join(root, folder, name)
        if os.path.isfile(path):
            return os.path.getsize(path)
    return None


def _missing(*paths: str | None) -> str:
    """ "X is missing" for the paths given (None: present); "" when none is missing."""
    gone = [p for p in paths if p is not None]
    if not gone:
        return ""
    return " and ".join(gone) + (" are missing" if len(gone) > 1 else " is missing")

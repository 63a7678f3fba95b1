"""Turn the folders people have on disk into samples of several fields (``FieldSamples``), before
anything is written: ``scan_layout(src, layout, ...)``, then ``write.fields.pack_field_samples``.

The layouts (``LAYOUTS``) and their fields, in order:

* ``voc``: ``image``, ``mask`` (Pascal VOC segmentation, as torchvision's ``VOCSegmentation``);
* ``ade20k``: ``image``, ``mask`` (``images/<split>`` + ``annotations/<split>``);
* ``cityscapes``: ``image``, ``mask`` (``leftImg8bit`` + ``gtFine`` ``_labelIds``, as torchvision's
  ``Cityscapes(target_type="semantic")``);
* ``coco``: ``image``, ``image_info``, ``annotations`` (as torchvision's ``CocoDetection``);
* ``pairs``: ``lq``, ``gt`` (BasicSR's GT/LQ folders at an integer scale);
* ``table``: ``image``, ``meta`` (a JSON Lines or CSV file naming the images).

Every scanner lists the samples in the order the reference dataset class serves them; a sample
missing a partner is skipped and listed (``FieldSamples.skipped``) with its file names, never
paired with another's; every file name read from a split file, a JSON or a CSV must stay inside
the source folder (no absolute path, no ``..``). Only the standard library is used to list (and
Pillow, to read the sizes of a pair's images while packing).
"""

from __future__ import annotations

import os
from typing import Any

from lmdbfolder.errors import OptionError, SourceNotFoundError
from lmdbfolder.write.fields import FieldSamples
from lmdbfolder.write.layouts._common import check_pair_scale, unsafe_name
from lmdbfolder.write.layouts.coco import scan_coco
from lmdbfolder.write.layouts.pairs import PAIR_FIELDS, check_scale, scan_pairs
from lmdbfolder.write.layouts.segmentation import scan_ade20k, scan_cityscapes, scan_voc
from lmdbfolder.write.layouts.table import scan_table

__all__ = ["LAYOUTS", "scan_layout", "unsafe_name", "check_pair_scale", "check_scale", "PAIR_FIELDS"]

#: The layouts ``scan_layout`` (and ``lmdbfolder pack --layout``) read.
LAYOUTS = ("voc", "ade20k", "cityscapes", "coco", "pairs", "table")
#: The options each layout takes besides ``split`` (the CLI refuses the others).
LAYOUT_OPTIONS: dict[str, tuple[str, ...]] = {
    "voc": ("split",),
    "ade20k": ("split",),
    "cityscapes": ("split",),
    "coco": ("annotations",),
    "pairs": ("scale", "gt_dir", "lq_dir", "filename_tmpl"),
    "table": ("annotations", "image_column"),
}


def scan_layout(
    src: str | os.PathLike[str],
    layout: str,
    *,
    split: str | None = None,
    annotations: str | os.PathLike[str] | None = None,
    scale: int | None = None,
    gt_dir: str | None = None,
    lq_dir: str | None = None,
    filename_tmpl: str | None = None,
    image_column: str | None = None,
) -> FieldSamples:
    """The samples of ``src`` read as ``layout`` (one of ``LAYOUTS``), listed before anything is written.

    Args:
        src: the dataset folder: for ``voc`` the VOCdevkit folder, the VOC2012 folder or a folder
            holding JPEGImages/SegmentationClass/ImageSets; for ``ade20k`` the folder holding
            images/ and annotations/ (ADEChallengeData2016); for ``cityscapes`` the folder holding
            leftImg8bit/ and gtFine/; for ``coco`` and ``table`` the images folder the annotation
            file's paths are relative to; for ``pairs`` the folder holding the GT and LQ folders.
        layout: one of ``LAYOUTS``.
        split: voc: the split file's name (``train``, ``val``, ``trainval``; default ``train``);
            ade20k: ``training`` (default) or ``validation``; cityscapes: ``train`` (default),
            ``val`` or ``test``.
        annotations: coco: the instances JSON; table: the ``.jsonl`` or ``.csv`` file.
        scale: pairs: the GT size over the LQ size, an integer (required).
        gt_dir, lq_dir: pairs: the GT and LQ folders relative to ``src`` (default: the first of
            GT/gt/HR/hr and LQ/lq/LR/lr there).
        filename_tmpl: pairs: BasicSR's ``filename_tmpl``, the LQ name made from the GT name
            without its ending (default ``'{}'``; DIV2K's bicubic LQ: ``'{}x4'``).
        image_column: table: the column naming the image file (default: the first of
            ``image``, ``file_name``, ``filename``, ``file``, ``path``, ``image_path``, ``img``).

    Returns:
        The ``FieldSamples``: fields, per-sample file paths (relative to its ``root``), a
        ``read(i)`` of the payloads, the skipped samples with why, and the ``layout_info``
        recorded in the manifest (the split, the scale, COCO's categories).

    Raises:
        OptionError: an unknown layout, an option the layout does not take, a missing required one.
        SourceNotFoundError, SourceError: the folder or annotation file is not there, or not in the
            layout (the message names the file and, for a JSON or CSV, the entry or line).

    Example:
        >>> samples = scan_layout("VOCdevkit", "voc", split="val")  # doctest: +SKIP
        >>> pack_field_samples(samples, "voc-val.lmdb")  # doctest: +SKIP
    """
    if layout not in LAYOUTS:
        raise OptionError(f"layout must be one of {', '.join(LAYOUTS)}, got {str(layout)[:100]!r}")
    given = {
        "split": split,
        "annotations": annotations,
        "scale": scale,
        "gt_dir": gt_dir,
        "lq_dir": lq_dir,
        "filename_tmpl": filename_tmpl,
        "image_column": image_column,
    }
    extra = [k for k, v in given.items() if v is not None and k not in LAYOUT_OPTIONS[layout]]
    if extra:
        flags = ", ".join("--" + k.replace("_", "-") for k in extra)
        raise OptionError(f"the {layout} layout does not take {flags}", _takes(layout))
    root = os.fspath(src)
    if not os.path.isdir(root):
        raise SourceNotFoundError(root, "no folder here", f"pass the {layout} dataset's folder as SRC")
    if layout == "voc":
        return scan_voc(root, split)
    if layout == "ade20k":
        return scan_ade20k(root, split)
    if layout == "cityscapes":
        return scan_cityscapes(root, split)
    if layout == "coco":
        return scan_coco(root, annotations)
    if layout == "pairs":
        return scan_pairs(root, scale, gt_dir=gt_dir, lq_dir=lq_dir, filename_tmpl=filename_tmpl or "{}")
    return scan_table(root, annotations, image_column)


def _takes(layout: str) -> str:
    options: Any = LAYOUT_OPTIONS[layout]
    return f"--layout {layout} takes " + ", ".join("--" + k.replace("_", "-") for k in options)

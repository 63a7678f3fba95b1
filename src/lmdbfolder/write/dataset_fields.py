"""``pack_dataset`` of datasets whose samples have several fields: the ``FieldSamples`` of a
dataset object (``field_samples_of``), one adapter per kind of dataset.

* torchvision's ``VOCSegmentation`` (layout ``voc``), ``Cityscapes`` with
  ``target_type="semantic"`` (layout ``cityscapes``) and ``CocoDetection`` (layout ``coco``): the
  files they name are read and their bytes kept (a mask's palette and mode with them); COCO's
  image entry and annotation list are kept as JSON. ``LMDBDataset`` gives back their items.
  They are listed as ``write.layouts`` lists the same files (the same root, stored paths,
  ``layout_info`` and stamps, by the layouts' own functions), so ``pack --layout L --update``
  updates a pack made here and ``pack_dataset(..., update=True)`` one made there; only the
  name of COCO's annotation file is not known here (``write.update`` compares it only when
  both packs record one).
* any other map-style dataset whose items are several values (a tuple, list or dict of PIL
  images, numpy arrays, torch tensors and JSON-able values; layout ``dataset``): stored as they
  come: PIL images losslessly (PNG, or TIFF for the modes PNG cannot hold) with their mode, arrays
  and tensors as ``.npy``, the rest as JSON. ``LMDBDataset`` gives back the same item. No stamps:
  an update reads every item again and keeps the records that come out the same.

Nothing here imports torch or torchvision: datasets are recognised by their class names and read
through their own attributes.
"""

from __future__ import annotations

import io
import os
from typing import Any, Sequence

from PIL import Image

from lmdbfolder.errors import OptionError
from lmdbfolder.format import NO_LABEL
from lmdbfolder.format.fields import FieldSpec, encode_array, encode_json
from lmdbfolder.write.fields import FieldSamples, SampleError
from lmdbfolder.write.layouts._common import file_samples
from lmdbfolder.write.layouts.coco import coco_categories, coco_samples
from lmdbfolder.write.layouts.segmentation import IMAGE_AND_MASK, cityscapes_info, voc_info

__all__ = ["field_samples_of", "FIELD_DATASETS"]

#: The torchvision dataset classes read through their files, and the layout each becomes.
FIELD_DATASETS = {"VOCSegmentation": "voc", "Cityscapes": "cityscapes", "CocoDetection": "coco"}
#: PIL modes a PNG holds exactly; other modes are stored as TIFF.
_PNG_MODES = ("1", "L", "LA", "P", "RGB", "RGBA", "I;16")
#: PIL modes stored as a mask (their values are labels, not intensities).
_MASK_MODES = ("P", "I;16", "I", "1")


def _torchvision_kind(dataset: Any) -> str | None:
    names = [cls.__name__ for cls in type(dataset).__mro__]
    return next((FIELD_DATASETS[n] for n in names if n in FIELD_DATASETS), None)


def _relpath(path: str, root: str) -> str:
    return os.path.relpath(path, root).replace(os.sep, "/")


def _mean(files: Sequence[Sequence[str]]) -> float:
    sizes = []
    for paths in files[:: max(1, len(files) // 50)]:
        try:
            sizes.append(sum(os.stat(p).st_size for p in paths))
        except OSError:
            continue
    return sum(sizes) / len(sizes) if sizes else 0.0


def _segmentation(dataset: Any, layout: str) -> FieldSamples:
    """The samples of a ``VOCSegmentation`` or ``Cityscapes``: the files it names, under the root
    and with the ``layout_info`` the layout's scanner gives the same tree (stamped as it stamps)."""
    if layout == "cityscapes":
        types = list(getattr(dataset, "target_type", []))
        if types != ["semantic"]:
            raise OptionError(
                f"pack_dataset packs Cityscapes with target_type='semantic', not {types!r}",
                "make the dataset with target_type='semantic'",
            )
        masks = [os.fspath(t[0]) for t in dataset.targets]
    else:
        masks = [os.fspath(m) for m in dataset.masks]
    images = [os.fspath(p) for p in dataset.images]
    if len(images) != len(masks):
        raise OptionError(f"the dataset lists {len(images)} images but {len(masks)} masks")
    files = list(zip(images, masks))
    if layout == "cityscapes":
        root = os.path.abspath(os.fspath(dataset.root))
        info = cityscapes_info(str(dataset.split), str(dataset.mode))
    else:
        # The year's folder (VOCdevkit/VOC2012): the one holding JPEGImages and SegmentationClass.
        first = [os.path.dirname(os.path.abspath(p)) for p in images[:1] + masks[:1]]
        root = os.path.commonpath(first) if first else os.path.abspath(os.fspath(dataset.root))
        info = voc_info(str(getattr(dataset, "image_set", "")), root)
    # A missing file is not left out here but when its sample is read (skipped, with its files):
    # the pack's samples are the dataset's, each at its index.
    field_paths: list[tuple[str, ...]] = [(_relpath(a, root), _relpath(b, root)) for a, b in files]
    total = round(_mean(files) * len(files))
    return file_samples(layout, root, IMAGE_AND_MASK, field_paths, [], info, total)


def _coco(dataset: Any) -> FieldSamples:
    """The samples of a ``CocoDetection``: its images (``dataset.ids``' order) with their entries and
    annotation lists as it serves them, listed by the coco layout's rules. The annotation file's
    name is not known (neither the dataset nor pycocotools keeps it): the pack records none."""
    coco = dataset.coco
    entries = [
        (f"image id {image_id!r}", coco.loadImgs(image_id)[0], coco.loadAnns(coco.getAnnIds(image_id)))
        for image_id in dataset.ids
    ]
    where = f"{type(dataset).__name__}(root={os.fspath(dataset.root)!r})"
    info: dict[str, object] = {"categories": coco_categories(coco.dataset.get("categories", []), where)}
    return coco_samples(os.fspath(dataset.root), entries, info)


# -- any map-style dataset of several values --------------------------------------------------------
def _value_type(value: Any) -> str:
    """How a value of an item is stored: ``pil``, ``ndarray``, ``tensor`` or ``json``."""
    if isinstance(value, Image.Image):
        return "pil"
    module = type(value).__module__
    if module.startswith("numpy") and hasattr(value, "dtype") and hasattr(value, "shape"):
        return "ndarray"
    if module.startswith("torch") and hasattr(value, "numpy") and hasattr(value, "dtype"):
        return "tensor"
    return "json"


def _pil_bytes(image: Image.Image, where: str) -> bytes:
    """A PIL image losslessly: PNG for the modes it holds exactly, else TIFF; SampleError when
    neither gives back the same mode."""
    fmt = "PNG" if image.mode in _PNG_MODES else "TIFF"
    out = io.BytesIO()
    try:
        image.save(out, fmt)
        with Image.open(io.BytesIO(out.getvalue())) as back:
            ok = back.mode == image.mode
    except (OSError, ValueError, KeyError) as exc:
        raise SampleError(f"{where}: a PIL image of mode {image.mode} cannot be stored ({exc})") from None
    if not ok:
        raise SampleError(f"{where}: a PIL image of mode {image.mode} cannot be stored losslessly")
    return out.getvalue()


def _payload(value: Any, kind: str, where: str) -> bytes:
    got = _value_type(value)
    if got != kind:
        raise SampleError(f"{where} is a {type(value).__name__}, where the first item holds a {kind} value")
    try:
        if kind == "pil":
            return _pil_bytes(value, where)
        if kind == "ndarray":
            return encode_array(value, where)
        if kind == "tensor":
            return encode_array(value.detach().cpu().numpy(), where)
        return encode_json(value, where)
    except ValueError as exc:
        raise SampleError(str(exc)) from None


def _field_name(key: Any, k: int) -> str:
    name = str(key).lower()
    try:
        FieldSpec(name, "json")
        return name
    except ValueError:
        return f"f{k}"


def _items(dataset: Any) -> FieldSamples:
    where = f"{type(dataset).__name__} dataset"
    n = len(dataset)
    if n == 0:
        raise OptionError(f"{where}: it has no items")
    first = dataset[0]
    if isinstance(first, dict):
        shape, keys, values = "dict", list(first), list(first.values())
        if not all(isinstance(k, str) for k in keys):
            raise OptionError(f"{where}: its items are dicts whose keys are not all strings")
    elif isinstance(first, (tuple, list)):
        shape, keys, values = ("tuple" if isinstance(first, tuple) else "list"), [], list(first)
    else:
        shape, keys, values = "single", [], [first]
    if not values:
        raise OptionError(f"{where}: its items are empty")
    types = [_value_type(v) for v in values]
    kinds = []
    for v, t in zip(values, types):
        if t == "pil":
            kinds.append("mask" if v.mode in _MASK_MODES else "image")
        else:
            kinds.append({"ndarray": "array", "tensor": "array", "json": "json"}[t])
    names = [_field_name(key, k) for k, key in enumerate(keys)] if shape == "dict" else []
    if shape != "dict" or len(set(names)) != len(names):
        names = [f"f{k}" for k in range(len(values))]
    fields = tuple(FieldSpec(name, kind) for name, kind in zip(names, kinds))
    ext = ".png" if types[0] == "pil" and values[0].mode in _PNG_MODES else ".tiff" if types[0] == "pil" else ""

    def read(i: int) -> list[bytes]:
        item = dataset[i]
        if shape == "dict":
            if not isinstance(item, dict) or list(item) != keys:
                raise SampleError(f"{where}, item {i}: its keys are not the first item's {keys}")
            got = list(item.values())
        elif shape == "single":
            got = [item]
        else:
            if not isinstance(item, (tuple, list)) or len(item) != len(values):
                raise SampleError(f"{where}, item {i}: it is not a {shape} of {len(values)} values as the first is")
            got = list(item)
        return [_payload(v, t, f"{where}, item {i}, value {k}") for k, (v, t) in enumerate(zip(got, types))]

    return FieldSamples(
        layout="dataset",
        root=where,
        fields=fields,
        relpaths=[f"{i:08d}{ext}" for i in range(n)],
        field_paths=[("",) * len(fields)] * n,
        labels=[NO_LABEL] * n,
        classes=[],
        read=read,
        layout_info={"item": shape, "keys": keys, "types": types, "class": type(dataset).__name__},
    )


def _is_classification_item(item: Any) -> bool:
    """``(image, int label)``: what the classification adapters of ``pack_dataset`` take."""
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        return False
    image, label = item
    is_image = isinstance(image, (str, os.PathLike, bytes, bytearray, memoryview, Image.Image))
    return is_image and not isinstance(label, bool) and hasattr(label, "__index__")


def field_samples_of(dataset: Any) -> FieldSamples | None:
    """The ``FieldSamples`` of a dataset whose samples have several fields, or None when it is one
    the classification adapters of ``pack_dataset`` take (``(image, label)`` items)."""
    layout = _torchvision_kind(dataset)
    if layout == "coco":
        return _coco(dataset)
    if layout is not None:
        return _segmentation(dataset, layout)
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")) or hasattr(dataset, "samples"):
        return None
    if len(dataset) == 0 or _is_classification_item(dataset[0]):
        return None
    return _items(dataset)

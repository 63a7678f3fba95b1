"""Images + a COCO-style instances JSON, as torchvision's ``CocoDetection`` serves them.

``CocoDetection(root, annFile)`` (torchvision/datasets/coco.py) builds pycocotools' ``COCO``
index and serves, for each id of ``sorted(coco.imgs)``: the image ``root/<file_name>`` and
``coco.loadAnns(coco.getAnnIds(id))``: that image's entries of the JSON's ``annotations`` list,
in the list's order (pycocotools/coco.py ``createIndex`` appends each to ``imgToAnns[image_id]``;
``getAnnIds`` chains those lists; ``loadAnns`` maps the ids back through ``anns[id]``). The same
is done here from the JSON alone (pycocotools is not needed to pack), with the input checked:

* duplicate image ids or annotation ids are refused (pycocotools keeps the last entry of an id:
  with a duplicate annotation id an image would get another image's annotation, silently);
* an image whose file is missing, or whose ``file_name`` leaves the images folder, is skipped and
  listed; an annotation naming no image is listed (CocoDetection never serves it).

Fields: ``image`` (the file's bytes), ``image_info`` (json: the ``images`` entry),
``annotations`` (json: the list). ``layout_info["categories"]`` keeps the JSON's categories.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from lmdbfolder.errors import OptionError, SourceError
from lmdbfolder.format.fields import FieldSpec, encode_json
from lmdbfolder.write.fields import FieldSamples
from lmdbfolder.write.layouts._common import (
    file_samples,
    json_payload,
    read_text,
    require_dir,
    resolve_name,
    unsafe_name,
)

__all__ = ["scan_coco", "coco_samples", "coco_categories", "COCO_FIELDS", "MAX_COCO_JSON_BYTES", "MAX_CATEGORIES_BYTES"]

COCO_FIELDS = (FieldSpec("image", "image"), FieldSpec("image_info", "json"), FieldSpec("annotations", "json"))
#: An annotation file larger than this is refused before it is read (COCO 2017 train: 448 MB).
MAX_COCO_JSON_BYTES = 2 << 30
#: The categories kept in the manifest are at most this many bytes of JSON (LVIS' 1,203: ~0.5 MB).
MAX_CATEGORIES_BYTES = 4 << 20
_HINT = "fix the annotation file (COCO's instances_*.json format: images, annotations, categories)"


def scan_coco(src: str, annotations: str | os.PathLike[str] | None) -> FieldSamples:
    """The samples of the images folder ``src`` with the COCO JSON ``annotations``, in
    ``CocoDetection(src, annotations)``'s order (sorted image ids)."""
    if annotations is None:
        raise OptionError(
            "the coco layout needs the annotation file: --annotations FILE (e.g. instances_train2017.json)"
        )
    ann_file = os.path.abspath(os.fspath(annotations))
    require_dir(src, "images folder", "pass the folder the JSON's file_name entries are relative to as SRC")
    data = _load(ann_file)
    images = _entries(data, "images", ann_file, required=True)
    anns = _entries(data, "annotations", ann_file, required=False)
    by_id: dict[Any, tuple[int, dict[str, Any]]] = {}
    for k, img in enumerate(images):
        where = f"{ann_file}: images[{k}]"
        if not isinstance(img, dict):
            raise SourceError(where, f"is a {type(img).__name__}, not an object", _HINT)
        image_id = _id(img, "id", where)
        if image_id in by_id:
            raise SourceError(
                where,
                f"repeats the image id {image_id!r} of images[{by_id[image_id][0]}]; each image id must be unique",
                _HINT,
            )
        by_id[image_id] = (k, img)
    per_image: dict[Any, list[dict[str, Any]]] = {}
    ann_ids: dict[Any, int] = {}
    skipped: list[tuple[str, str]] = []
    name = os.path.basename(ann_file)
    for k, ann in enumerate(anns):
        where = f"{ann_file}: annotations[{k}]"
        if not isinstance(ann, dict):
            raise SourceError(where, f"is a {type(ann).__name__}, not an object", _HINT)
        ann_id = _id(ann, "id", where)
        image_id = _id(ann, "image_id", where)
        if ann_id in ann_ids:
            raise SourceError(
                where,
                f"repeats the annotation id {ann_id!r} of annotations[{ann_ids[ann_id]}]; pycocotools would give "
                "both images the last one: each annotation id must be unique",
                _HINT,
            )
        ann_ids[ann_id] = k
        if image_id not in by_id:
            skipped.append(
                (
                    f"{name}: annotations[{k}]",
                    f"annotation {ann_id!r} names image {image_id!r}, which no images entry has",
                )
            )
            continue
        per_image.setdefault(image_id, []).append(ann)
    try:
        ids = sorted(by_id)
    except TypeError:
        raise SourceError(ann_file, "its image ids mix numbers and strings: they cannot be sorted", _HINT) from None
    entries = [(f"{name}: images[{by_id[i][0]}] (id {i!r})", by_id[i][1], per_image.get(i, [])) for i in ids]
    info: dict[str, object] = {"annotations": name, "categories": coco_categories(data.get("categories", []), ann_file)}
    return coco_samples(src, entries, info, skipped)


def coco_samples(
    src: str,
    entries: Sequence[tuple[str, dict[str, Any], list[Any]]],
    info: dict[str, object],
    skipped: list[tuple[str, str]] | None = None,
) -> FieldSamples:
    """The ``FieldSamples`` of COCO images, in the order given: each entry is (how messages name
    it, its ``images`` entry, its annotation list). An image whose ``file_name`` leaves ``src`` or
    whose file is missing is skipped and listed (with ``skipped``, those left out before); the
    entry and the list are stored as JSON. ``scan_coco`` and ``pack_dataset`` of a
    ``CocoDetection`` both list their images here, so their packs are the same."""
    skipped = list(skipped or [])
    field_paths: list[tuple[str, ...]] = []
    values: list[tuple[bytes, ...]] = []
    total = 0
    root = os.path.abspath(src)
    for label, img, anns in entries:
        file_name = img.get("file_name")
        problem = unsafe_name(file_name)
        if problem is not None:
            skipped.append((label, f"{problem}: {str(file_name)[:200]!r}"))
            continue
        rel = resolve_name(root, str(file_name))
        full = os.path.join(root, rel)
        if not os.path.isfile(full):
            skipped.append((rel, f"named by {label} but missing from {root}"))
            continue
        image_info = json_payload(img, f"{label}")
        boxes = json_payload(anns, f"the annotations of {label}")
        if isinstance(image_info, str) or isinstance(boxes, str):
            skipped.append((rel, image_info if isinstance(image_info, str) else str(boxes)))
            continue
        field_paths.append((rel, "", ""))
        values.append((image_info, boxes))
        total += os.path.getsize(full) + len(image_info) + len(boxes)
    return file_samples("coco", root, COCO_FIELDS, field_paths, skipped, info, total, values=values)


def _load(path: str) -> dict[str, Any]:
    """The annotation file's top-level object (bounded in bytes, nesting and constants)."""
    text = read_text(path, "COCO annotation file", MAX_COCO_JSON_BYTES)

    def refuse_constant(token: str) -> Any:
        raise ValueError(f"{token} is not a JSON number")

    try:
        data = json.loads(text, parse_constant=refuse_constant)
    except json.JSONDecodeError as exc:
        raise SourceError(
            path, f"is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})", _HINT
        ) from None
    except (ValueError, RecursionError) as exc:
        raise SourceError(path, f"cannot be read as JSON ({exc or 'nested too deep'})", _HINT) from None
    if not isinstance(data, dict):
        raise SourceError(path, f"holds a {type(data).__name__} at the top, not a COCO object", _HINT)
    return data


def _entries(data: dict[str, Any], key: str, path: str, *, required: bool) -> list[Any]:
    value = data.get(key)
    if value is None and not required:
        return []
    if not isinstance(value, list):
        what = "no" if value is None else f"a {type(value).__name__} as its"
        raise SourceError(path, f"has {what} {key!r} list", _HINT)
    return value


def _id(entry: dict[str, Any], key: str, where: str) -> Any:
    """The id ``entry[key]``: an integer or a string (COCO's are integers)."""
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        shown = "no" if value is None else f"a {type(value).__name__}"
        raise SourceError(where, f"has {shown} {key!r}; it must be an integer (or a string)", _HINT)
    return value


def coco_categories(cats: Any, path: str) -> list[Any]:
    """The categories a COCO pack keeps in its manifest (``path`` names where they come from in
    messages); SourceError when they are not a list or take more than ``MAX_CATEGORIES_BYTES``."""
    if not isinstance(cats, list):
        raise SourceError(path, f"its 'categories' is a {type(cats).__name__}, not a list", _HINT)
    try:
        size = len(encode_json(cats, f"{path}: categories")) if cats else 0
    except ValueError as exc:
        raise SourceError(path, str(exc), _HINT) from None
    if size > MAX_CATEGORIES_BYTES:
        raise SourceError(
            path,
            f"its categories take {size:,} bytes of JSON, more than the {MAX_CATEGORIES_BYTES:,} a pack keeps",
            "leave out the categories' long fields (descriptions, synonyms) before packing",
        )
    return cats

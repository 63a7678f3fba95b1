"""``verify`` and ``info`` of packs of several fields (format 4): each field of a record checked,
and what ``info`` shows of the fields (their encodings, per-category or per-class counts).

A record's fields are checked on their own (``check_fields``): an image or mask field must be a
whole image of its claimed kind (its end marker there, its header readable by Pillow; decoded with
``decode=True``), a mask of another size than the sample's image is reported, as is an empty
field; ``json`` fields must be bounded JSON and ``array`` fields plain ``.npy`` arrays. In a pack of
the ``coco`` layout, every annotation must name its sample's image (``image_id``), hold a box of
four finite numbers and, when the pack keeps the categories, a category of them.
"""

from __future__ import annotations

import dataclasses
import io
import math
from typing import Any, Iterable

from PIL import Image

from lmdbfolder.encodings import sniff, truncation
from lmdbfolder.format import FieldSpec, split_field_payloads
from lmdbfolder.format.fields import IMAGE_KINDS, array_problem, decode_json

__all__ = ["FieldChecks", "check_fields", "FieldStats"]

#: Encodings that lose information: a mask in one is noted.
_LOSSY = ("jpeg",)


@dataclasses.dataclass
class FieldChecks:
    """What every record of a pack of several fields is checked against."""

    fields: tuple[FieldSpec, ...]
    layout: str | None
    #: COCO: the category ids the pack keeps (None: not kept, not checked)
    categories: frozenset[Any] | None = None
    decode: bool = False


def check_fields(payload: memoryview, checks: FieldChecks) -> tuple[list[str], list[str]]:
    """``(problems, notes)`` of one record's payload of several fields (``problems`` empty: good)."""
    parts = split_field_payloads(payload, len(checks.fields))
    if isinstance(parts, str):
        return [parts], []
    problems: list[str] = []
    notes: list[str] = []
    sizes: dict[str, tuple[int, int]] = {}
    values: dict[str, Any] = {}
    for spec, data in zip(checks.fields, parts):
        where = f"field {spec.name!r}"
        if spec.kind in IMAGE_KINDS:
            if not len(data):
                problems.append(f"{where} is empty (a missing {spec.kind})")
                continue
            info = sniff(data)
            cut = truncation(data, info.encoding)
            if cut is not None:
                problems.append(f"{where} is truncated: {cut}")
                continue
            try:
                with Image.open(io.BytesIO(bytes(data))) as img:
                    size = img.size
                    if checks.decode:
                        img.load()
            except Exception as exc:  # Pillow raises many exception types for bad data
                problems.append(f"{where} does not open as an image: {type(exc).__name__}: {exc}")
                continue
            sizes[spec.name] = size
            if spec.kind == "mask" and (
                info.encoding in _LOSSY or (info.encoding == "webp" and b"VP8 " in data[:4096])
            ):
                notes.append(f"{where} is stored as a lossy {info.encoding}: its labels are not exact near edges")
        elif spec.kind == "json":
            try:
                values[spec.name] = decode_json(data, where)
            except ValueError as exc:
                problems.append(str(exc))
        elif spec.kind == "array":
            problem = array_problem(data)
            if problem is not None:
                problems.append(f"{where}: {problem}")
    image = next((sizes[f.name] for f in checks.fields if f.kind == "image" and f.name in sizes), None)
    for spec in checks.fields:
        got = sizes.get(spec.name)
        if spec.kind == "mask" and image is not None and got is not None and got != image:
            problems.append(
                f"field {spec.name!r} is {got[0]}x{got[1]} but the image is {image[0]}x{image[1]}: "
                "the mask does not cover its image"
            )
    if checks.layout == "coco" and "image_info" in values and "annotations" in values:
        problems += _coco_problems(values["image_info"], values["annotations"], checks.categories)
    return problems, notes


def _coco_problems(info: Any, annotations: Any, categories: frozenset[Any] | None) -> list[str]:
    if not isinstance(info, dict) or "id" not in info:
        return ["field 'image_info' is not a COCO image entry (an object with an id)"]
    if not isinstance(annotations, list):
        return ["field 'annotations' is not a list"]
    problems = []
    for k, ann in enumerate(annotations):
        if not isinstance(ann, dict):
            problems.append(f"annotation {k} is not an object")
            continue
        if ann.get("image_id") != info["id"]:
            problems.append(
                f"annotation {k} (id {str(ann.get('id'))[:40]}) names image {str(ann.get('image_id'))[:40]}, "
                f"not this sample's image {str(info['id'])[:40]}"
            )
        box = ann.get("bbox")
        if "bbox" in ann and not (
            isinstance(box, list)
            and len(box) == 4
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in box)
        ):
            problems.append(f"annotation {k} has a bbox that is not four finite numbers")
        if categories is not None and ann.get("category_id") not in categories:
            problems.append(f"annotation {k} names category {str(ann.get('category_id'))[:40]}, not one of the pack's")
    return problems


@dataclasses.dataclass
class FieldStats:
    """What ``info`` shows of the fields of a pack: each field's encodings (images and masks),
    and per-category (COCO) or per-class counts, from the records it looked at."""

    fields: tuple[FieldSpec, ...]
    looked_at: int = 0
    encodings: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    #: COCO: annotations per category id
    categories: dict[Any, int] = dataclasses.field(default_factory=dict)
    #: masks: how many samples hold each mask value
    mask_values: dict[int, int] = dataclasses.field(default_factory=dict)

    def add(self, payload: memoryview, layout: str | None) -> None:
        """Count one record's fields (a record that does not split is left out)."""
        parts = split_field_payloads(payload, len(self.fields))
        if isinstance(parts, str):
            return
        self.looked_at += 1
        for spec, data in zip(self.fields, parts):
            counts = self.encodings.setdefault(spec.name, {})
            name = sniff(data).encoding if spec.kind in IMAGE_KINDS else "json" if spec.kind == "json" else "npy"
            counts[name] = counts.get(name, 0) + 1
            if spec.kind == "mask":
                self._mask_values(data)
            elif layout == "coco" and spec.name == "annotations":
                try:
                    anns = decode_json(data, "annotations")
                except ValueError:
                    continue
                for ann in anns if isinstance(anns, list) else []:
                    cat = ann.get("category_id") if isinstance(ann, dict) else None
                    if isinstance(cat, (int, str)):
                        self.categories[cat] = self.categories.get(cat, 0) + 1

    def _mask_values(self, data: memoryview) -> None:
        import numpy as np

        try:
            with Image.open(io.BytesIO(bytes(data))) as img:
                values = np.unique(np.asarray(img))
        except Exception:  # verify reports it; info only counts what opens
            return
        for v in values[:4096].tolist():
            self.mask_values[int(v)] = self.mask_values.get(int(v), 0) + 1

    def as_dict(self, names: Iterable[Any] = ()) -> dict[str, Any]:
        """JSON-ready: ``fields`` (name, kind, encodings), ``looked_at``, and ``categories``
        (id -> annotations, named from ``names``) or ``mask_values`` (value -> samples)."""
        named = dict(names)
        out: dict[str, Any] = {
            "fields": [
                {"name": f.name, "kind": f.kind, "encodings": dict(sorted(self.encodings.get(f.name, {}).items()))}
                for f in self.fields
            ],
            "looked_at": self.looked_at,
        }
        if self.categories:
            out["categories"] = [
                {"id": c, "name": named.get(c), "annotations": n}
                for c, n in sorted(self.categories.items(), key=lambda kv: str(kv[0]))
            ]
        if self.mask_values:
            out["mask_values"] = {str(v): n for v, n in sorted(self.mask_values.items())}
        return out

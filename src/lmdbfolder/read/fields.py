"""Read a pack of several fields (format 4): a record's fields as Python values, and the item
a sample becomes, decided once per pack (``SampleSchema``).

What an item is follows the layout the pack was made from, so that it equals what torchvision's
own dataset class gives for that layout (``SampleSchema.of``):

* ``voc``, ``ade20k``, ``cityscapes`` (image + mask): ``(image, mask)``: the image converted to
  RGB as ``VOCSegmentation`` and ``Cityscapes`` do, the mask as its file opens (a palette PNG's
  indices stay indices, a 16-bit mask stays ``I;16``).
* ``coco``: ``(image, annotations)``: the RGB image and the list of annotation objects
  ``CocoDetection`` gives (``coco.loadAnns(coco.getAnnIds(id))``); ``image_id`` is the image's
  COCO id (its ``image_info`` field).
* ``pairs``: ``(lq, gt)``, both RGB.
* ``dataset`` (``pack_dataset`` of a map-style dataset): the item as it came, a tuple, list or
  dict of its values (PIL images with their mode, numpy arrays, tensors, JSON values) or one value.
* any other layout: a tuple of the fields in order (images RGB, masks as stored, JSON values,
  numpy arrays).

Nothing here imports torch: ``lmdbfolder.torch.LMDBDataset`` turns tensors-to-be into tensors.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any, Sequence

from PIL import Image

from lmdbfolder.errors import CorruptRecordError, NotAPackError
from lmdbfolder.format import FIELDS_FORMAT_VERSION, Manifest
from lmdbfolder.format.fields import FieldSpec, decode_array, decode_json, split_field_payloads

__all__ = ["SampleSchema", "SEGMENTATION_LAYOUTS", "decode_image", "samples_manifest", "split_record"]


def split_record(payload: memoryview, count: int, index: int) -> list[memoryview]:
    """The ``count`` field payloads of record ``index``'s payload (``split_field_payloads``);
    CorruptRecordError naming the record when it is malformed."""
    parts = split_field_payloads(payload, count)
    if isinstance(parts, str):
        raise CorruptRecordError(index, parts)
    return parts


#: Layouts whose samples are an image and its mask (torchvision's ``VOCSegmentation``,
#: ``Cityscapes(target_type="semantic")``; ADE20K's folders the same way).
SEGMENTATION_LAYOUTS = ("voc", "ade20k", "cityscapes")
#: How a field's value is made from its payload (``SampleSchema.decoders``).
RGB, AS_STORED, JSON, ARRAY, TENSOR = "rgb", "as-stored", "json", "array", "tensor"
#: Shapes of a ``dataset`` layout's item (``layout.info.item``).
ITEM_SHAPES = ("tuple", "list", "dict", "single")


def samples_manifest(reader: Any) -> Manifest | None:
    """The manifest that says what the samples of a pack of several fields hold: a single
    pack's (``Reader``), or a sharded pack's first shard's (``ShardedReader``: every shard of a
    split is written by one writer, with the same fields; a pack in object storage stages that
    shard now). None for a pack of one image per record (a sharded one: told by its index's
    ``pack_format_version``, no shard opened)."""
    meta = reader.meta
    if isinstance(meta, Manifest):
        return meta if meta.field_specs is not None else None
    if meta.pack_format_version < FIELDS_FORMAT_VERSION:
        return None
    first: Manifest = reader.shard(0).meta
    return first if first.field_specs is not None else None


def decode_image(payload: bytes | memoryview, *, rgb: bool) -> Image.Image:
    """The PIL image of an image field: converted to RGB (``Image.open(f).convert("RGB")``, the
    loader of torchvision's datasets) or as it opens (its mode and palette kept), loaded."""
    image = Image.open(io.BytesIO(bytes(payload)))
    if rgb:
        return image.convert("RGB")
    image.load()
    return image


@dataclasses.dataclass(frozen=True)
class SampleSchema:
    """How a record of a format-4 pack becomes an item, decided once when the pack is opened."""

    fields: tuple[FieldSpec, ...]
    #: the pack's layout (``"voc"``, ``"coco"``, ``"dataset"``...)
    layout: str
    #: per field: ``RGB``, ``AS_STORED``, ``JSON``, ``ARRAY`` or ``TENSOR``
    decoders: tuple[str, ...]
    #: the positions of the fields in the item, in order (COCO leaves ``image_info`` out)
    item_fields: tuple[int, ...]
    #: ``"tuple"``, ``"list"``, ``"dict"`` or ``"single"``
    shape: str = "tuple"
    #: the keys of a dict item, in field order
    keys: tuple[str, ...] = ()

    @classmethod
    def of(cls, meta: Manifest, where: str) -> SampleSchema:
        """The schema of the pack whose manifest is ``meta``; NotAPackError when it has no fields,
        or records a layout whose fields are not the ones that layout has."""
        specs = meta.field_specs
        if specs is None:
            raise NotAPackError(
                where,
                "its samples are one image and a label, not several fields",
                "read it with lmdbfolder.torch.LMDBFolder",
            )
        layout = meta.layout_name or "dataset"
        names = tuple(f.name for f in specs)
        kinds = tuple(f.kind for f in specs)
        generic = tuple(_generic_decoder(k) for k in kinds)
        if layout in SEGMENTATION_LAYOUTS:
            _expect(where, layout, names, ("image", "mask"))
            return cls(specs, layout, (RGB, AS_STORED), (0, 1))
        if layout == "coco":
            _expect(where, layout, names, ("image", "image_info", "annotations"))
            return cls(specs, layout, (RGB, JSON, JSON), (0, 2))
        if layout == "pairs":
            _expect(where, layout, names, ("lq", "gt"))
            return cls(specs, layout, (RGB, RGB), (0, 1))
        if layout == "dataset":
            return cls._dataset(meta, specs, where)
        return cls(specs, layout, generic, tuple(range(len(specs))))

    @classmethod
    def _dataset(cls, meta: Manifest, specs: tuple[FieldSpec, ...], where: str) -> SampleSchema:
        info = meta.layout_info
        shape = info.get("item", "tuple")
        types = info.get("types")
        keys = info.get("keys", [])
        if (
            shape not in ITEM_SHAPES
            or not isinstance(types, list)
            or len(types) != len(specs)
            or not all(t in ("pil", "json", "ndarray", "tensor") for t in types)
            or (shape == "dict" and (not isinstance(keys, list) or len(keys) != len(specs)))
            or (shape == "single" and len(specs) != 1)
        ):
            raise NotAPackError(where, "its manifest's layout does not describe the items of its fields")
        by_type = {"pil": AS_STORED, "json": JSON, "ndarray": ARRAY, "tensor": TENSOR}
        decoders = tuple(by_type[t] for t in types)
        return cls(
            specs,
            "dataset",
            decoders,
            tuple(range(len(specs))),
            shape,
            tuple(str(k) for k in keys) if shape == "dict" else (),
        )

    # -- reading ---------------------------------------------------------------------------------
    def split(self, payload: memoryview, index: int) -> list[memoryview]:
        """The field payloads of a record's payload; CorruptRecordError when it is malformed."""
        return split_record(payload, len(self.fields), index)

    def value(self, k: int, data: memoryview, index: int) -> Any:
        """Field ``k``'s value (``TENSOR`` fields as numpy arrays: the caller makes the tensor)."""
        how = self.decoders[k]
        where = f"sample {index}, field {self.fields[k].name!r}"
        try:
            if how in (RGB, AS_STORED):
                return decode_image(data, rgb=how == RGB)
            if how == JSON:
                return decode_json(data, where)
            return decode_array(data, where)
        except (ValueError, OSError, SyntaxError, Image.DecompressionBombError) as exc:
            raise CorruptRecordError(index, f"its field {self.fields[k].name!r} cannot be read: {exc}") from None

    def values(self, payload: memoryview, index: int) -> list[Any]:
        """Every field's value, in field order."""
        parts = self.split(payload, index)
        return [self.value(k, parts[k], index) for k in range(len(parts))]

    def item(self, values: Sequence[Any]) -> Any:
        """The item of a sample whose field values are ``values``."""
        if self.shape == "single":
            return values[0]
        if self.shape == "dict":
            return dict(zip(self.keys, values))
        chosen = [values[k] for k in self.item_fields]
        return chosen if self.shape == "list" else tuple(chosen)


def _generic_decoder(kind: str) -> str:
    return {"image": RGB, "mask": AS_STORED, "json": JSON, "array": ARRAY}[kind]


def _expect(where: str, layout: str, names: tuple[str, ...], expected: tuple[str, ...]) -> None:
    if names != expected:
        raise NotAPackError(
            where,
            f"its layout {layout!r} has the fields {', '.join(expected)}, but the manifest lists {', '.join(names)}",
        )

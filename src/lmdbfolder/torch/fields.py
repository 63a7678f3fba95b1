"""``LMDBDataset``: the dataset of a pack of several fields (an image and its mask, an image and
its COCO annotations, an image pair), whose items are what torchvision's own dataset class gives.

* ``LMDBDataset(pack)[i]`` equals ``dataset[i]`` of the torchvision dataset the pack was made from
  (``VOCSegmentation``, ``Cityscapes(target_type="semantic")``, ``CocoDetection``; a map-style
  dataset packed with ``pack_dataset``: its item as it came). See ``lmdbfolder.read.fields``.
* With ``transforms`` (or ``transform`` / ``target_transform``), the item is first wrapped as
  ``torchvision.datasets.wrap_dataset_for_transforms_v2`` wraps that dataset's (the mask a
  ``tv_tensors.Mask``; COCO's target a dict of ``image_id``, ``boxes`` as ``BoundingBoxes``
  in XYXY and ``labels``), then transformed jointly: ``LMDBDataset(pack, transforms=tf)[i]``
  equals ``tf(*wrap_dataset_for_transforms_v2(dataset)[i])`` under the same random state.

How a sample is made is decided once, when the dataset is made (``SampleSchema``, the wrapper of
the pack's layout); ``__getitem__`` reads the record, splits it into its fields, decodes each and
applies the transforms: the path a fused joint crop can later replace as a whole.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import torch
from torchvision.datasets import VisionDataset

from lmdbfolder.errors import CorruptRecordError, NotAPackError, OptionError
from lmdbfolder.read.fields import RGB, SEGMENTATION_LAYOUTS, TENSOR, SampleSchema, samples_manifest
from lmdbfolder.read.opening import AnyReader, open_pack
from lmdbfolder.torch.options import ReadOptions, read_options
from lmdbfolder.torch.replay import Replay

__all__ = ["LMDBDataset"]

#: ReadOptions fields that a dataset of several fields does not use (they are about decoding
#: one image on the classification fast path); a value other than the default is refused.
_UNUSED = ("source_root", "decoder", "size_hint", "prefetch", "threads", "class_order")
#: COCO target keys: what ``wrap_dataset_for_transforms_v2`` offers and gives by default.
COCO_TARGET_KEYS = frozenset(
    {"segmentation", "area", "iscrowd", "image_id", "bbox", "category_id", "boxes", "masks", "labels"}
)
COCO_DEFAULT_KEYS = frozenset({"image_id", "boxes", "labels"})


class LMDBDataset(VisionDataset):
    """A pack of several fields as a map-style dataset (see the module docstring).

    Args:
        root: the pack (a directory made by ``lmdbfolder.pack_dataset``, ``pack_field_samples``
            or ``lmdbfolder pack --layout ...``; a sharded pack's directory or URL too).
        transforms: a callable taking the item's parts (``transforms(image, target)``), such as a
            ``torchvision.transforms.v2`` pipeline: the parts are wrapped for v2 first.
        transform, target_transform: torchvision's: applied to the image and to the target
            (after the same wrapping).
        wrap: wrap the item for ``transforms.v2`` (None: when a transform is given, as
            ``wrap_dataset_for_transforms_v2`` with the dataset's transforms).
        target_keys: COCO only: the target keys of the wrapped item (None: ``image_id``,
            ``boxes``, ``labels``; ``"all"``; or a collection of ``COCO_TARGET_KEYS``), as
            ``wrap_dataset_for_transforms_v2``'s ``target_keys``.
        options: ``ReadOptions`` (or its fields as keywords): ``readahead``, ``verify_checksums``,
            ``torch_threads``, ``cache_dir``, ``cache_limit``, ``seed`` apply.

    Attributes: ``reader`` (the pack), ``fields`` (its ``FieldSpec``s), ``layout`` (``"voc"``,
    ``"coco"``...), ``schema`` (``SampleSchema``), ``ids`` (COCO: the image id of each sample),
    ``categories`` (COCO: the annotation file's categories), ``classes``.

    Example:
        >>> from torchvision.transforms import v2
        >>> from lmdbfolder.torch import LMDBDataset
        >>> tf = v2.Compose([v2.RandomResizedCrop(256), v2.RandomHorizontalFlip(), v2.ToDtype(...)])
        >>> ds = LMDBDataset("voc-train.lmdb", transforms=tf)  # doctest: +SKIP
        >>> image, mask = ds[0]  # doctest: +SKIP
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        transforms: Callable[..., Any] | None = None,
        transform: Callable[..., Any] | None = None,
        target_transform: Callable[..., Any] | None = None,
        *,
        wrap: bool | None = None,
        target_keys: Any = None,
        options: ReadOptions | None = None,
        **settings: Any,
    ) -> None:
        self.options: ReadOptions = read_options(options, settings, f"{type(self).__name__}.__init__")
        defaults = ReadOptions()
        for name in _UNUSED:
            if getattr(self.options, name) != getattr(defaults, name):
                raise OptionError(
                    f"LMDBDataset does not use the setting {name} (it is about LMDBFolder's images)",
                    "leave it out",
                )
        self.reader: AnyReader = open_pack(
            root,
            readahead=self.options.readahead,
            verify_checksums=self.options.verify_checksums,
            cache_dir=self.options.cache_dir,
            cache_limit=self.options.cache_limit,
        )
        meta = samples_manifest(self.reader)
        if meta is None:
            raise NotAPackError(
                self.reader.path,
                "its samples are one image and a label, not several fields",
                "read it with lmdbfolder.torch.LMDBFolder",
            )
        super().__init__(os.fspath(root), transforms=transforms, transform=transform, target_transform=target_transform)
        self.schema = SampleSchema.of(meta, self.reader.path)
        self.fields = self.schema.fields
        self.layout = self.schema.layout
        self.layout_info = dict(meta.layout_info)
        self.classes: list[str] = list(meta.classes)
        self.replay: Replay | None = None if self.options.seed is None else Replay(self.options.seed)
        self.wrap = (self.transforms is not None) if wrap is None else bool(wrap)
        self._wrapper = _Wrapper(self.layout, target_keys)
        self._tensor_fields = tuple(k for k, how in enumerate(self.schema.decoders) if how == TENSOR)
        self.categories: list[Any] = list(self.layout_info.get("categories") or []) if self.layout == "coco" else []
        self._ids: list[Any] | None = None
        #: The fused crop of the item's image fields (``lmdbfolder.torch.joint``), decided once: a
        #: v2 pipeline that starts with RandomResizedCrop (+ RandomHorizontalFlip), or
        #: PairedRandomCrop for pairs; None: every field decoded whole, then ``transforms``.
        self._fused = _fused_slot(self)

    def __len__(self) -> int:
        return len(self.reader)

    @property
    def ids(self) -> list[Any]:
        """COCO: the image id of every sample (``CocoDetection.ids``), read from the pack once."""
        if self.layout != "coco":
            raise AttributeError("ids: only a pack of the coco layout has image ids")
        if self._ids is None:
            schema = self.schema
            ids = []
            for i in range(len(self)):
                record = self.reader.get(i)
                ids.append(schema.value(1, schema.split(record.payload, i)[1], i).get("id"))
            self._ids = ids
        return list(self._ids)

    def _values(self, index: int) -> list[Any]:
        record = self.reader.get(index)
        values = self.schema.values(record.payload, record.index)
        for k in self._tensor_fields:
            values[k] = torch.from_numpy(values[k])
        return values

    def __getitem__(self, index: int) -> Any:
        """Sample ``index``: the item of the pack's layout, wrapped for v2 and transformed as
        the dataset was made to (see the class docstring)."""
        if self._fused is not None:
            plan = self._fused.get(self.transforms)
            if plan.fused:
                return self._fused_item(index, plan)
        values = self._values(index)
        item = self.schema.item(values)
        if not self.wrap and self.transforms is None:
            return item
        with self._torch_threads():
            if self.wrap:
                item = self._wrapper(values, item)
            if self.transforms is None:
                return item
            if self.replay is not None:
                with self.replay.seeded(index):
                    return self._transformed(item)
            return self._transformed(item)

    def __getitems__(self, indices: list[int]) -> list[Any]:
        """Samples ``indices`` (a DataLoader's batch): with a fused plan that batches
        (``JointPlan.batches``: nothing after the crop and flip draws random numbers), every
        sample's box and flip drawn in order, then all their crops decoded in one run; else
        ``[self[i] for i in indices]``. The same samples either way."""
        plan = self._fused.get(self.transforms) if self._fused is not None else None
        if plan is None or not plan.fused or not plan.batches or self.replay is not None:
            return [self[i] for i in indices]
        made = [self._pending_item(i, plan) for i in indices]
        items = [item for item, _ in made]
        return self._run_fused(_owners(made), lambda: plan.batch(items))

    def _pending_item(self, index: int, plan: Any) -> tuple[tuple[Any, ...], int]:
        """Sample ``index``'s item, wrapped, with its image fields still encoded
        (``PendingImage``; a segmentation mask: ``PendingMask``), and its record's index."""
        from lmdbfolder.torch.joint import PendingImage, PendingMask, size_stand_in

        record = self.reader.get(index)
        schema = self.schema
        parts = schema.split(record.payload, record.index)
        segmentation = self.layout in SEGMENTATION_LAYOUTS
        values: list[Any] = []
        for k, data in enumerate(parts):
            name = self.fields[k].name
            where = f"{self.reader.path}: sample {index}, field {name!r}"
            if schema.decoders[k] == RGB:
                values.append(PendingImage(data, where, name))
            elif segmentation and self.fields[k].kind == "mask":
                values.append(PendingMask(data, where, name))
            else:
                values.append(schema.value(k, data, record.index))
        for k in self._tensor_fields:
            values[k] = torch.from_numpy(values[k])
        item = schema.item(values)
        if segmentation:
            # (image, mask): the wrapper's Mask is what PendingMask makes (its crop only).
            return item, record.index
        # The wrapper may read the image's size (COCO's boxes): it sees a stand-in of that size.
        image = item[0]
        probe = size_stand_in(image, plan.read)
        return (image, *self._wrapper(values, (probe, *item[1:]))[1:]), record.index

    def _fused_item(self, index: int, plan: Any) -> Any:
        """Sample ``index`` through a fused plan (``lmdbfolder.torch.joint``)."""
        item, record = self._pending_item(index, plan)
        owners = _owners([(item, record)])
        if self.replay is not None:
            replay = self.replay

            def seeded() -> Any:
                with replay.seeded(index):
                    return plan(*item)

            return self._run_fused(owners, seeded)
        return self._run_fused(owners, lambda: plan(*item))

    def _run_fused(self, owners: dict[int, int], make: Callable[[], Any]) -> Any:
        """``make()`` in the dataset's torch threads; an image field it cannot decode is
        reported as ``CorruptRecordError`` naming its record (``owners``: the record of
        each ``PendingImage``, by id) and field."""
        from lmdbfolder.torch.joint import ImageFieldError

        try:
            with self._torch_threads():
                return make()
        except ImageFieldError as exc:
            record = owners.get(id(exc.pending), -1)
            raise CorruptRecordError(record, f"its field {exc.pending.field!r} cannot be read: {exc.cause}") from (
                exc.cause
            )

    def _transformed(self, item: Any) -> Any:
        assert self.transforms is not None
        return self.transforms(*item) if isinstance(item, tuple) else self.transforms(item)

    def _torch_threads(self) -> Any:
        """One torch thread while a sample is made in the main process, like a DataLoader worker."""
        n = self.options.torch_threads
        if n is None or torch.utils.data.get_worker_info() is not None:
            return contextlib.nullcontext()
        from lmdbfolder.torch.dataset import _torch_threads

        return _torch_threads(n)

    def set_epoch(self, epoch: int) -> None:
        """With ``seed``: make ``epoch`` the current one (every worker sees it)."""
        if self.replay is None:
            raise OptionError("set_epoch needs a dataset made with seed=...", "pass seed=S")
        self.replay.epoch.set(epoch)

    def extra_repr(self) -> str:
        """The layout and the fields, for ``repr``."""
        return f"Layout: {self.layout}\nFields: " + ", ".join(f"{f.name} ({f.kind})" for f in self.fields)

    def close(self) -> None:
        """Release this process's handles of the pack."""
        self.reader.close()


def _owners(made: list[tuple[tuple[Any, ...], int]]) -> dict[int, int]:
    """The record index of each encoded image field of these items, by the field's id."""
    from lmdbfolder.torch.joint import PendingImage

    return {id(part): record for item, record in made for part in item if isinstance(part, PendingImage)}


def _fused_slot(dataset: LMDBDataset) -> Any:
    """The dataset's ``PlanSlot`` when its transforms start with steps a plan fuses, else None."""
    if dataset.transforms is None or not dataset.wrap or dataset.layout not in (*SEGMENTATION_LAYOUTS, "coco", "pairs"):
        return None
    from lmdbfolder.torch.joint import PlanSlot, fusable

    pairs = dataset.layout == "pairs"
    return PlanSlot(pairs=pairs) if fusable(dataset.transforms, pairs=pairs) else None


class _Wrapper:
    """How a sample's item is wrapped for ``transforms.v2``, as ``wrap_dataset_for_transforms_v2``
    wraps the item of the torchvision dataset of the pack's layout (decided once; picklable, for
    spawned workers)."""

    def __init__(self, layout: str, target_keys: Any) -> None:
        self.layout = layout
        self.keys = _coco_keys(target_keys) if layout == "coco" else None
        if layout != "coco" and target_keys is not None:
            raise OptionError(
                f"target_keys apply to packs of the coco layout, not to {layout!r}", "leave target_keys out"
            )

    def __call__(self, values: list[Any], item: Any) -> Any:
        if self.keys is not None:
            return _coco_target(values, item, self.keys)
        if self.layout in SEGMENTATION_LAYOUTS:
            from torchvision import tv_tensors

            return item[0], tv_tensors.Mask(item[1])
        return item  # pairs, datasets: as they are (the wrapper's identity)


def _coco_keys(target_keys: Any) -> frozenset[str]:
    if target_keys is None:
        return COCO_DEFAULT_KEYS
    if target_keys == "all":
        return COCO_TARGET_KEYS
    if isinstance(target_keys, str) or not all(isinstance(k, str) for k in target_keys):
        raise OptionError(f"target_keys must be None, 'all' or a collection of strings, got {target_keys!r}")
    keys = frozenset(target_keys)
    extra = keys - COCO_TARGET_KEYS
    if extra:
        raise OptionError(f"target keys {sorted(extra)} are not available", f"choose from {sorted(COCO_TARGET_KEYS)}")
    return keys


def _coco_target(values: list[Any], item: Any, keys: frozenset[str]) -> Any:
    """The COCO item as ``wrap_dataset_for_transforms_v2`` makes it: a dict of lists, with
    ``boxes`` (XYXY ``BoundingBoxes``), ``masks`` and ``labels`` as tv_tensors and tensors."""
    from torchvision import tv_tensors
    from torchvision.transforms.v2 import functional as F

    image, annotations = item
    image_id = values[1].get("id")
    if not annotations:
        return image, {"image_id": image_id}
    canvas_size = tuple(F.get_size(image))
    batched: dict[str, list[Any]] = {}
    for annotation in annotations:
        for key, value in annotation.items():
            batched.setdefault(key, []).append(value)
    target: dict[str, Any] = {}
    if "image_id" in keys:
        target["image_id"] = image_id
    if "boxes" in keys:
        target["boxes"] = F.convert_bounding_box_format(
            tv_tensors.BoundingBoxes(
                batched["bbox"], format=tv_tensors.BoundingBoxFormat.XYWH, canvas_size=canvas_size
            ),
            new_format=tv_tensors.BoundingBoxFormat.XYXY,
        )
    if "masks" in keys:
        target["masks"] = tv_tensors.Mask(
            torch.stack([_segmentation_mask(s, canvas_size) for s in batched["segmentation"]])
        )
    if "labels" in keys:
        target["labels"] = torch.tensor(batched["category_id"])
    for key in keys - {"image_id", "boxes", "masks", "labels"}:
        target[key] = batched[key]
    return image, target


def _segmentation_mask(segmentation: Any, canvas_size: tuple[int, ...]) -> torch.Tensor:
    from pycocotools import mask

    if isinstance(segmentation, dict):
        if not isinstance(segmentation["counts"], str):  # an uncompressed RLE
            segmentation = mask.frPyObjects(segmentation, *canvas_size)
    elif isinstance(segmentation, list):
        segmentation = mask.merge(mask.frPyObjects(segmentation, *canvas_size))
    else:
        raise ValueError(f"COCO segmentation expected to be a dict or a list, got {type(segmentation)}")
    return torch.from_numpy(mask.decode(segmentation))

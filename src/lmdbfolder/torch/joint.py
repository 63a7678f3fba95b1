"""Fused crops of samples with several fields: one box for every field, decoded by region.

A segmentation or detection sample is an image with a mask, boxes or both; a
restoration sample is a pair of images. torchvision's v2 transforms crop all the
fields of a sample jointly, but only after the whole image has been decoded into a
PIL image. These plans make the same result while decoding only the crop:

``JointPlan`` (image fields under a ``transforms.v2`` pipeline). When the pipeline
starts with ``v2.RandomResizedCrop`` (optionally followed by ``v2.RandomHorizontalFlip``),
the dataset hands the sample over with its image fields still encoded
(``PendingImage``). The plan then does what v2 does, with v2's own code wherever it
costs nothing: it flattens the sample as v2 does, asks the crop's ``make_params``
for the box (the same random numbers, drawn from a stand-in of the image's size,
read from the file's header), draws the flip as v2 does (``torch.rand(1) < p``),
decodes each image field's crop only (a JPEG's rows and columns of the box, by the
region decoder, where it reproduces Pillow here; a PNG down to the box's last row,
``read.pairs.open_rows``) and resizes it as Pillow does (``read.plan.ReadPlan``, the
same executor as ``LMDBFolder``'s exact fused crop), mirrored for the flip. A
segmentation mask handed over encoded (``PendingMask``) is decoded down to the box,
cut to it, then resized by the rows and columns torch's nearest resize takes. Every
other field (``tv_tensors.Mask``: nearest; ``BoundingBoxes``: cropped, scaled and
clamped; keypoints, videos) goes through the v2 transform's own ``transform`` with
the same parameters. Then the rest of the pipeline runs unchanged
(``SanitizeBoundingBoxes`` and the photometric steps included). Under the same seed
the sample equals the unfused pipeline's, pixel for pixel. A batch (``batch``) draws
every sample's box and flip in the per-sample order, then decodes all its JPEG crops
in one ``ReadPlan.run`` (on the plan's threads), when nothing after the fused steps
draws random numbers.

The opt-in: ``lmdbfolder.fused.RandomResizedCrop`` in the crop's place draws the same
box (a ``v2.RandomResizedCrop`` of its settings draws it) and makes masks and boxes the
same, but its ``resize``, ``reduce`` and ``output`` apply to the image fields:
``resize="native"`` decodes and resizes a JPEG's crop in one C call (within about a grey
level of Pillow's pixels), ``output="tensor"`` gives ``tv_tensors.Image`` without a PIL image.

``PairPlan`` (an LQ/GT pair under ``PairedRandomCrop``, BasicSR's ``paired_random_crop``
+ ``augment``): the LQ patch and the ``scale`` times larger GT patch are decoded alone
(a JPEG's by region, an 8-bit PNG's rows down to the patch by ``read.pairs.png_rows``:
zlib-ng and the compiled ``png_unfilter_stream``, checked against Pillow once per process), then
mirrored and turned as small uint8 patches (``read.pairs``).

Both are decided once, when made (per dataset, transform and process), as
``TransformPlan`` is for ``LMDBFolder``: a pipeline they do not recognise is applied
as given, to the decoded sample.
"""

from __future__ import annotations

import functools
import io
import sys
import threading
from typing import Any, Callable, Sequence

import numpy as np
from PIL import Image

from lmdbfolder.errors import MissingDependencyError

try:
    import torch
    from torch.utils._pytree import tree_flatten, tree_unflatten
    from torchvision.transforms.functional import InterpolationMode, pil_modes_mapping
except ImportError as exc:  # a core-only install: say what to install
    raise MissingDependencyError(
        "lmdbfolder.torch.joint (fused crops of several fields)", "torch", "torchvision"
    ) from exc

from lmdbfolder.encodings import sniff
from lmdbfolder.read.capabilities import Capabilities, current
from lmdbfolder.read.crops import exact_resize_into, resize_region, thread_buffer
from lmdbfolder.read.pairs import (
    PairDraw,
    PatchReader,
    augment_patch,
    draw_pair,
    open_rows,
    pillow_patch,
    png_rows_view,
)
from lmdbfolder.read.plan import BatchItemError, CropJob, CropSpec, ReadPlan
from lmdbfolder.torch.crop import RandomResizedCrop as _FusedCrop
from lmdbfolder.torch.crop import bulk_drawer, fast_drawer, shared_probe

__all__ = [
    "PendingImage",
    "PendingMask",
    "ImageFieldError",
    "PlanSlot",
    "resolve",
    "split_joint",
    "joint_key",
    "JointPlan",
    "PairedRandomCrop",
    "split_paired",
    "PairPlan",
    "plan_fields",
    "fusable",
    "size_stand_in",
]


class PendingImage:
    """An image field of a sample, not decoded yet: its stored file (``payload``) and
    where it is (``where``, for messages: the pack, the record and the field). A fused
    plan decodes only its crop; ``resolve`` decodes it whole (an RGB PIL image, as the
    torchvision dataset's loader gives it)."""

    __slots__ = ("payload", "where", "field", "_info")

    def __init__(self, payload: bytes | memoryview, where: str = "an image field", field: str = "image") -> None:
        self.payload = payload
        self.where = where
        self.field = field
        self._info: tuple[str, int, int, int] | None = None

    def info(self) -> tuple[str, int, int, int]:
        """``(encoding, width, height, channels)`` from the file's header (0: unknown)."""
        if self._info is None:
            found = sniff(self.payload)
            self._info = (found.encoding, found.width, found.height, found.channels)
        return self._info

    def sized(self) -> bool:
        """Whether the file's header gives its size (else it is decoded whole first)."""
        _, width, height, _ = self.info()
        return width > 0 and height > 0

    def decode(self, plan: ReadPlan) -> Image.Image:
        """The whole image, RGB, as ImageFolder's loader (and VOCSegmentation's) gives it."""
        name, width, height, channels = self.info()
        try:
            return plan.image(self.payload, name, width, height, channels)
        except Exception as exc:  # Pillow raises many exception types for bad data
            raise ImageFieldError(self, exc) from exc

    def __repr__(self) -> str:
        return f"<PendingImage {self.where}>"


class PendingMask(PendingImage):
    """A mask field not decoded yet (its file's bytes). ``decode`` gives the ``tv_tensors.Mask``
    that ``wrap_dataset_for_transforms_v2`` makes of the mask as its file opens (a palette PNG's
    indices, a 16-bit mask's values); ``crop`` gives what v2's ``resized_crop`` (nearest) and
    ``horizontal_flip`` make of it, converting only the box to a tensor."""

    __slots__ = ()

    def _open(self, rows: int = 0) -> Image.Image:
        # A PNG only down to row ``rows`` where that gives the full decode's rows (open_rows).
        img = open_rows(self.payload, rows) if rows else Image.open(io.BytesIO(self.payload))
        _, width, height, _ = self.info()
        if width > 0 and height > 0 and (img.width != width or img.height not in (height, rows)):
            raise ValueError(f"its header says {width}x{height}, Pillow opens it as {img.width}x{img.height}")
        return img

    def decode(self, plan: ReadPlan | None = None) -> Any:
        """The whole mask, as the v2 wrapper makes it: ``tv_tensors.Mask(Image.open(f))``."""
        from torchvision import tv_tensors

        try:
            return tv_tensors.Mask(self._open())
        except Exception as exc:  # Pillow raises many exception types for bad data
            raise ImageFieldError(self, exc) from exc

    def crop(self, box: tuple[int, int, int, int], size: Sequence[int], flip: bool) -> Any:
        """v2's ``resized_crop`` of the decoded mask to ``size`` = (height, width), then its
        ``horizontal_flip`` with ``flip``: the same values and dtype.

        Every conversion of a PIL image to a tensor works pixel by pixel, so the box is cut
        from the PIL image first. Masks whose values a float32 holds exactly (8- and 16-bit,
        boolean: what v2's nearest resize keeps exactly, after its cast) are resized by
        gathering the rows and columns torch's nearest picks; others by v2's own kernel.
        """
        from torchvision import tv_tensors
        from torchvision.transforms.v2 import functional as F

        top, left, height, width = box
        out_h, out_w = size
        found = png_rows_view(self.payload, top + height)
        _, full_w, _, _ = self.info()
        if found is not None and found[1] in ("L", "P") and found[0].shape[:2] == (top + height, full_w):
            # An 8-bit grey or palette PNG: its samples are what pil_to_tensor gives (uint8),
            # gathered straight from the decoded rows (no copy of the box first).
            rows, cols = nearest_indices(height, out_h), nearest_indices(width, out_w)
            gather = getattr(current().compiled(), "gather", None)
            if gather is not None:  # the compiled gather: one pass (AVX-512: ~10x the takes)
                out = np.empty((1, out_h, out_w), np.uint8)
                gather(found[0], full_w, rows, top, cols, left, flip, out)
                return tv_tensors.Mask(torch.from_numpy(out))
            rows, cols = rows + top, cols + left
            plane = found[0][:, :, 0]
            # take() along one axis, then the other: a contiguous result, as v2's mask (a 2-D
            # fancy index gives a transposed one: the same values in column order).
            return tv_tensors.Mask(torch.from_numpy(plane.take(rows, 0).take(cols[::-1] if flip else cols, 1)[None]))
        try:
            part = F.pil_to_tensor(self._open(top + height).crop((left, top, left + width, top + height)))
        except Exception as exc:  # Pillow raises many exception types for bad data
            raise ImageFieldError(self, exc) from exc
        if part.dtype in _FLOAT_EXACT:
            rows = nearest_indices(height, out_h)
            cols = nearest_indices(width, out_w)
            if flip:
                cols = cols[::-1]
            # Two takes along one axis each: ~7x faster than one 2-D gather (measured), and
            # contiguous, as v2's mask.
            return tv_tensors.Mask(torch.from_numpy(part.numpy().take(rows, 1).take(cols, 2)))
        out = F.resize_mask(part, list(size))
        return tv_tensors.Mask(F.horizontal_flip_mask(out) if flip else out)


#: Mask dtypes whose every value a float32 holds exactly (v2 resizes other dtypes through float32).
_FLOAT_EXACT = (torch.uint8, torch.int8, torch.int16, torch.uint16, torch.bool)


@functools.lru_cache(maxsize=1024)
def nearest_indices(size: int, out: int) -> np.ndarray:
    """The source index of each of ``out`` outputs of torch's ``nearest`` resize of ``size``
    inputs (``interpolate(mode="nearest")`` on CPU: ``floor(i * (float)size / out)`` in float32,
    at most ``size - 1``; the identity at the same size, ``i // 2`` at twice it). Read-only."""
    if out == size:
        idx = np.arange(size, dtype=np.int64)
    elif out == 2 * size:
        idx = np.arange(out, dtype=np.int64) // 2
    else:
        scale = np.float32(size) / np.float32(out)  # float32 division, as the kernel's
        idx = np.minimum(np.floor(np.arange(out, dtype=np.float32) * scale).astype(np.int64), size - 1)
    idx.flags.writeable = False
    return idx


class ImageFieldError(Exception):
    """An image field that cannot be decoded (damaged, or a header its file denies): ``pending``
    names it (``where``, ``field``), ``cause`` is what the decoder raised (also chained). A
    dataset turns it into its own error naming the record."""

    def __init__(self, pending: PendingImage, cause: BaseException) -> None:
        super().__init__(f"{pending.where}: cannot be decoded: {type(cause).__name__}: {cause}")
        self.pending = pending
        self.cause = cause


def resolve(sample: Any, plan: ReadPlan) -> Any:
    """``sample`` with every ``PendingImage`` in it decoded whole (``PendingImage.decode``)."""
    flat, spec = tree_flatten(sample)
    if not any(isinstance(leaf, PendingImage) for leaf in flat):
        return sample
    return tree_unflatten([leaf.decode(plan) if isinstance(leaf, PendingImage) else leaf for leaf in flat], spec)


# -- the joint crop of an image and its mask, boxes ... ------------------------------------------------------
def _v2() -> Any:
    # Only if the caller uses v2 (importing it costs time): a pipeline of v2 steps has imported it.
    return sys.modules.get("torchvision.transforms.v2")


def _interpolation(value: Any) -> InterpolationMode | None:
    """The ``InterpolationMode`` a v2 transform's ``interpolation`` setting means, if Pillow has it."""
    mode: Any = value
    try:
        if isinstance(value, str):
            mode = InterpolationMode(value.lower())
        elif isinstance(value, int) and not isinstance(value, InterpolationMode):
            from torchvision.transforms.functional import _interpolation_modes_from_int

            mode = _interpolation_modes_from_int(value)
    except (ValueError, KeyError):
        return None
    return mode if isinstance(mode, InterpolationMode) and mode in pil_modes_mapping else None


def _steps(transforms: Any, v2: Any) -> list[Any]:
    """The steps of a ``v2.Compose`` (exactly that class), or ``[transforms]`` for one step."""
    return list(transforms.transforms) if type(transforms) is v2.Compose else [transforms]


def split_joint(transforms: Any) -> tuple[Any, Any, Any]:
    """``(crop, flip, rest)`` when ``transforms`` is a ``v2.RandomResizedCrop`` or a
    ``v2.Compose`` that starts with one (exactly those classes: a subclass may do
    otherwise), optionally followed by a ``v2.RandomHorizontalFlip`` (``flip``, else
    None), with an interpolation Pillow has; ``rest``: a ``v2.Compose`` of the steps
    after them, or None. Else ``(None, None, transforms)``. ``lmdbfolder.fused.RandomResizedCrop``
    counts as the crop too: the opt-in to its ``resize``, ``reduce`` and ``output`` options
    (``JointPlan``)."""
    v2 = _v2()
    if v2 is None or transforms is None:
        return None, None, transforms
    steps = _steps(transforms, v2)
    if (
        not steps
        or type(steps[0]) not in (v2.RandomResizedCrop, _FusedCrop)
        or _interpolation(steps[0].interpolation) is None
    ):
        return None, None, transforms
    crop, flip, at = steps[0], None, 1
    if len(steps) > 1 and type(steps[1]) is v2.RandomHorizontalFlip:
        flip, at = steps[1], 2
    rest = v2.Compose(steps[at:]) if len(steps) > at else None
    return crop, flip, rest


def joint_key(transforms: Any) -> tuple[Any, ...]:
    """What a ``JointPlan`` copies from ``transforms`` when it is made: the steps of a
    ``Compose`` and the settings of its leading crop and flip. A plan whose key differs
    is stale (a training script changed the pipeline in place between epochs)."""
    found = getattr(transforms, "transforms", None)
    steps = tuple(found) if isinstance(found, list) else (transforms,)
    key: list[Any] = [transforms, steps]
    for step in steps[:2]:
        # The settings are plain attributes (in the instance's __dict__): looking a missing one up
        # on an nn.Module goes through its __getattr__ and an AttributeError, on every sample.
        state = getattr(step, "__dict__", None)
        for name in _SETTINGS:
            value = state.get(name) if state is not None else getattr(step, name, None)
            key.append(tuple(value) if isinstance(value, (list, tuple)) else value)
    return tuple(key)


_SETTINGS = ("size", "scale", "ratio", "interpolation", "antialias", "p", "resize", "reduce", "output")


#: v2 steps that draw no random numbers: after the fused steps, a batch's crops may be
#: decoded together only when the rest of the pipeline is made of these.
_DETERMINISTIC = (
    "ToImage",
    "ToDtype",
    "ToPureTensor",
    "PILToTensor",
    "Normalize",
    "SanitizeBoundingBoxes",
    "ClampBoundingBoxes",
    "ConvertBoundingBoxFormat",
    "Identity",
)


def _draws_nothing(rest: Any) -> bool:
    v2 = _v2()
    if rest is None:
        return True
    if v2 is None:
        return False
    steps = _steps(rest, v2)
    return all(type(step) is getattr(v2, type(step).__name__, None) for step in steps) and all(
        type(step).__name__ in _DETERMINISTIC for step in steps
    )


def _starts_with_to_image(rest: Any) -> bool:
    """Whether the steps after the fused crop and flip start with exactly ``v2.ToImage``: it turns
    a PIL image into ``tv_tensors.Image`` and leaves a ``tv_tensors.Image`` as it is, so the crop
    may give that tensor itself (``JointPlan.to_image``)."""
    v2 = _v2()
    if v2 is None or rest is None:
        return False
    steps = _steps(rest, v2)
    return bool(steps) and type(steps[0]) is v2.ToImage


def _converts(leaf: Any) -> bool:
    """Whether ``v2.ToImage`` converts ``leaf`` (its ``_transformed_types``: a PIL image, an
    array, a tensor that is no ``tv_tensors`` type)."""
    if isinstance(leaf, (Image.Image, np.ndarray)):
        return True
    if isinstance(leaf, torch.Tensor):
        from torchvision.tv_tensors import TVTensor

        return not isinstance(leaf, TVTensor)
    return False


def _hooked(module: Any) -> bool:
    """Whether calling ``module`` runs hooks besides its ``forward`` (its own or global ones)."""
    from torch.nn.modules import module as nn_module

    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or nn_module._global_forward_hooks
        or nn_module._global_forward_pre_hooks
    )


def _to_image(img: Image.Image) -> Any:
    """A PIL image as the ``tv_tensors.Image`` (uint8 CHW, contiguous) that v2's ``ToImage`` makes of it."""
    from torchvision import tv_tensors

    arr = np.asarray(img)
    arr = arr[:, :, None] if arr.ndim == 2 else arr
    return tv_tensors.Image(torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1))))


@functools.lru_cache(maxsize=512)
def _stand_in(width: int, height: int) -> torch.Tensor:
    """A pure tensor of an image's size, holding one byte: what v2's ``query_size`` reads
    (v2 only reads it: one per size is kept)."""
    return torch.empty((1, 1, 1), dtype=torch.uint8).expand(1, height, width)


_TYPE_PROBE = Image.new("RGB", (1, 1))


@functools.lru_cache(maxsize=512)
def _mask_stand_in(width: int, height: int) -> Any:
    """A ``tv_tensors.Mask`` of a mask's size, holding one byte: what v2 reads of a mask
    before its transform (its type, its size)."""
    from torchvision import tv_tensors

    return tv_tensors.Mask(_stand_in(width, height))


def size_stand_in(image: Any, plan: ReadPlan) -> Any:
    """What code that only reads an image's size (``F.get_size``) may be given for ``image``: a
    one-byte tensor of its size for a ``PendingImage`` whose header gives it, the decoded image
    for one whose header does not, ``image`` itself for anything else."""
    if type(image) is not PendingImage:
        return image
    if not image.sized():
        return image.decode(plan)
    _, width, height, _ = image.info()
    return _stand_in(width, height)


@shared_probe
def _v2_boxes_ok() -> bool:
    """Whether ``fast_drawer`` and ``bulk_drawer`` draw v2's boxes and flips here: v2's
    ``RandomResizedCrop.make_params`` then ``RandomHorizontalFlip``'s ``torch.rand(1)``,
    sample by sample, on sizes that take every branch, with the RNG state restored.
    (Asked once per process, through the capabilities.)"""
    from torchvision.transforms import v2  # a v2 crop is being planned: imported already

    state = torch.random.get_rng_state()
    try:
        sizes = [(500, 375), (375, 500), (64, 64), (3, 1000), (1000, 3), (1, 1), (257, 2)]
        for scale, ratio in (((0.08, 1.0), (3 / 4, 4 / 3)), ((0.9, 1.0), (0.5, 2.0))):
            crop = v2.RandomResizedCrop(8, scale=scale, ratio=ratio)
            torch.manual_seed(3)
            want = []
            for w, h in sizes:
                params = crop.make_params([_stand_in(w, h)])
                box = (params["top"], params["left"], params["height"], params["width"])
                want.append((tuple(int(v) for v in box), not bool(torch.rand(1) >= 0.5)))
            one = fast_drawer(scale, ratio)
            many = bulk_drawer(scale, ratio)
            if one is None:
                return False
            torch.manual_seed(3)
            got = [(one(w, h), not bool(torch.rand(1) >= 0.5)) for w, h in sizes]
            if got != want:
                return False
            if many is not None:
                torch.manual_seed(3)
                boxes, flips = many(sizes, 0.5)
                if list(zip(boxes, flips)) != want:
                    return False
        return True
    finally:
        torch.random.set_rng_state(state)


class JointPlan:
    """How a dataset applies a ``transforms.v2`` pipeline to a sample whose image fields
    are ``PendingImage``: the leading crop and flip fused with decoding (``fused``), or
    (a pipeline it does not recognise) the images decoded whole and the pipeline as given.

    Args:
        transforms: the v2 pipeline (None: the decoded sample as it is).
        decoder: the resolved JPEG decoder (one that gives Pillow's pixels keeps the
            result equal to the unfused pipeline).
        threads: threads that decode a batch's crops.
        caps: the capabilities to decide from (default: this process's).
    """

    def __init__(
        self,
        transforms: Any,
        *,
        decoder: Any,
        threads: int = 1,
        caps: Capabilities | None = None,
    ) -> None:
        caps = current() if caps is None else caps
        self.transforms = transforms
        self.key = joint_key(transforms)
        crop, self.flip, self.rest = split_joint(transforms)
        #: Whether the leading crop (and flip) are fused with decoding.
        self.fused = crop is not None
        #: Whether image fields come out as ``tv_tensors.Image`` (uint8 CHW) rather than PIL images.
        self.tensors = False
        spec = None
        if crop is not None:
            mode = _interpolation(crop.interpolation)
            spec = CropSpec(tuple(crop.size), "pil", int(pil_modes_mapping[mode]), False)  # type: ignore[index]
            if type(crop) is _FusedCrop:
                # The opt-in: its resize backend and DCT reduction on the image fields; the box,
                # the flip and every other field stay v2's, drawn and made by v2's own transform.
                spec = crop.spec()
                self.tensors = crop.output == "tensor"
                crop = _v2().RandomResizedCrop(  # type: ignore[union-attr]
                    crop.size, crop.scale, crop.ratio, interpolation=mode, antialias=crop.antialias
                )
        #: The v2 crop whose ``make_params`` draws the box (and whose ``transform`` does the other fields).
        self.crop = crop
        #: Whether the fused crops of a JPEG come out as what the ``v2.ToImage`` that follows the
        #: crop and flip makes of their PIL images (the same values, dtype and strides), so that
        #: no PIL image is made and converted; ``ToImage`` still runs, on the other fields.
        self.to_image = crop is not None and not self.tensors and _starts_with_to_image(self.rest)
        #: With ``to_image``: that ``ToImage``, and the steps after it (None: none), run instead
        #: of the whole rest for a sample in which it has nothing to convert (``_rest``).
        self._to_image_step: Any = None
        self._after_to_image: Any = None
        if self.to_image:
            self._to_image_step, *after = _steps(self.rest, _v2())
            self._after_to_image = _v2().Compose(after) if after else None  # type: ignore[union-attr]
        self.read = ReadPlan(decoder, crop=spec, threads=threads, caps=caps)
        self._local = threading.local()  # each thread's batch buffer (_decode_jobs)
        #: Whether a batch's crops are decoded together (``batch``).
        self.batches = self.fused and _draws_nothing(self.rest)
        #: The boxes and flips of samples of image fields and masks only, drawn without v2's
        #: per-sample machinery: (one at a time, in bulk), the same numbers as v2's draws
        #: (checked once per process); None where not confirmed here.
        self.drawers: tuple[Any, Any] | None = None
        if crop is not None and caps.answer("torchvision.v2_boxes", _v2_boxes_ok):
            one = fast_drawer(crop.scale, crop.ratio, caps)
            if one is not None:
                self.drawers = (one, bulk_drawer(crop.scale, crop.ratio, caps))

    def stale(self, transforms: Any) -> bool:
        """Whether ``transforms`` is no longer what this plan was made from."""
        return joint_key(transforms) != self.key

    def __call__(self, *inputs: Any) -> Any:
        """The transformed sample (``inputs``: the fields, as the pipeline is called)."""
        if not self.fused:
            sample = resolve(inputs, self.read)
            if self.transforms is None:
                return sample if len(sample) > 1 else sample[0]
            return self.transforms(*sample)
        return self._rest(*self._crop_flip([inputs])[0])

    def batch(self, samples: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Every sample transformed, as ``[self(*s) for s in samples]`` gives them (the
        same random numbers, in the same order); with ``batches``, the crops of all of
        them are decoded in one run on the plan's threads."""
        if not self.batches:
            return [self(*s) for s in samples]
        return [self._rest(out, plain) for out, plain in self._crop_flip(samples)]

    def _rest(self, outputs: tuple[Any, ...], plain: bool) -> Any:
        # As v2.Compose hands one step's outputs to the next.
        rest = self.rest
        if plain and self.to_image and not _hooked(self._to_image_step):
            # The leading ToImage would convert nothing here: it would only rebuild the
            # sample's containers (a pass over every leaf, ~3% of a fused sample's time).
            rest = self._after_to_image
        if rest is None:
            return outputs if len(outputs) > 1 else outputs[0]
        return rest(*outputs)

    def _draw_all(self, samples: Sequence[tuple[Any, ...]]) -> list[tuple[tuple[int, int, int, int], bool]] | None:
        """Every sample's box and flip, as v2's ``make_params`` and flip draw them sample by
        sample, where every sample is image fields and masks of one size given by their
        headers (what v2 would do to them is then known: crop all, or raise for sizes that
        differ, which the per-sample path below leaves to v2); None otherwise."""
        if self.drawers is None:
            return None
        sizes = []
        for inputs in samples:
            if not all(type(x) is PendingImage or type(x) is PendingMask for x in inputs):
                return None
            _, width, height, _ = inputs[0].info()
            if width <= 0 or height <= 0 or any(x.info()[1:3] != (width, height) for x in inputs[1:]):
                return None
            sizes.append((width, height))
        one, many = self.drawers
        p = None if self.flip is None else self.flip.p
        if many is not None and len(sizes) > 1:
            boxes, flips = many(sizes, p)
            return list(zip(boxes, flips))
        # v2's RandomHorizontalFlip: ``if torch.rand(1) >= p: return inputs``.
        return [(one(w, h), p is not None and not bool(torch.rand(1) >= p)) for w, h in sizes]

    def _crop_flip(self, samples: Sequence[tuple[Any, ...]]) -> list[tuple[tuple[Any, ...], bool]]:
        """Each sample cropped and flipped, with whether none of its fields is a kind that
        ``v2.ToImage`` converts (a PIL image, an array, a plain tensor)."""
        crop, flip = self.crop, self.flip
        read = self.read
        made: list[tuple[list[Any], Any]] = []
        jobs: list[CropJob] = []
        places: list[tuple[int, int, PendingImage]] = []  # (sample, leaf, pending) of each job
        rows_jobs: list[tuple[int, int, PendingImage, tuple[int, int, int, int], bool]] = []
        drawn = self._draw_all(samples)
        for k, inputs in enumerate(samples):
            flat, spec = tree_flatten(inputs if len(inputs) > 1 else inputs[0])
            pending = [type(leaf) is PendingImage for leaf in flat]
            masks = [type(leaf) is PendingMask for leaf in flat]
            if drawn is not None:
                box, flipped = drawn[k]
                needs = [True] * len(flat)
            elif not all(leaf.sized() for leaf in flat if isinstance(leaf, PendingImage)):
                made.append(([self._unfused(flat, spec, len(inputs) > 1)], None))
                continue
            else:
                sizes = [leaf.info() if isinstance(leaf, PendingImage) else None for leaf in flat]
                # What v2 reads of the fields (their types, their sizes): stand-ins of the encoded ones.
                typed = [
                    _TYPE_PROBE if p else (_mask_stand_in(info[1], info[2]) if m else leaf)  # type: ignore[index]
                    for leaf, p, m, info in zip(flat, pending, masks, sizes)
                ]
                crop.check_inputs(typed)
                needs = crop._needs_transform_list(typed)
                params = crop.make_params(
                    [
                        (_stand_in(info[1], info[2]) if p else probe) if info is not None else probe
                        for probe, p, info, need in zip(typed, pending, sizes, needs)
                        if need
                    ]
                )
                # v2's RandomHorizontalFlip: ``if torch.rand(1) >= p: return inputs``.
                flipped = flip is not None and not bool(torch.rand(1) >= flip.p)
                box = (params["top"], params["left"], params["height"], params["width"])
            for at, (leaf, p, m, need) in enumerate(zip(flat, pending, masks, needs)):
                if p:
                    name, width, height, channels = leaf.info()
                    try:
                        enc = read.claim(leaf.payload, name, width, height, channels)
                    except Exception as exc:  # Pillow raises many exception types for bad data
                        raise ImageFieldError(leaf, exc) from exc
                    if name == "png":
                        # Pillow decodes it: only down to the box's last row (open_rows).
                        rows_jobs.append((k, at, leaf, box, flipped))
                        continue
                    jobs.append(read.job(leaf.payload, enc, width, height, channels, box, flipped))
                    places.append((k, at, leaf))
                elif m:
                    flat[at] = leaf.crop(box, crop.size, flipped)
                elif need:
                    leaf = crop.transform(leaf, params)
                    flat[at] = flip.transform(leaf, {}) if flipped else leaf
            made.append((flat, spec))
        if jobs:
            self._decode_jobs(jobs, places, made)
        for k, at, leaf, box, flipped in rows_jobs:
            img = self._png_crop(leaf, box, flipped)
            made[k][0][at] = _to_image(img) if self.tensors else img
        results: list[tuple[tuple[Any, ...], bool]] = []
        for (flat, spec), inputs in zip(made, samples):
            if spec is None:  # made by v2 itself
                results.append((flat[0] if len(inputs) > 1 else (flat[0],), False))
                continue
            out = tree_unflatten(flat, spec)
            plain = not any(_converts(leaf) for leaf in flat) if self.to_image else False
            results.append((out if len(inputs) > 1 else (out,), plain))
        return results

    def _unfused(self, flat: list[Any], spec: Any, several: bool) -> Any:
        """A sample whose image's file header gives no size: decoded whole, then v2's own steps."""
        crop, flip = self.crop, self.flip
        flat = [leaf.decode(self.read) if isinstance(leaf, PendingImage) else leaf for leaf in flat]
        out = crop(*tree_unflatten(flat, spec)) if several else crop(tree_unflatten(flat, spec))
        if flip is not None:
            out = flip(*out) if several else flip(out)
        if self.tensors:
            leaves, out_spec = tree_flatten(out)
            out = tree_unflatten([_to_image(x) if isinstance(x, Image.Image) else x for x in leaves], out_spec)
        return out

    def _decode_jobs(
        self, jobs: list[CropJob], places: list[tuple[int, int, PendingImage]], made: list[tuple[list[Any], Any]]
    ) -> None:
        """The batch's image crops decoded in one run, each put in its sample's place."""
        out_h, out_w = self.crop.size
        tensors = self.tensors
        shape = (len(jobs), 3, out_h, out_w) if tensors else (len(jobs), out_h, out_w, 3)
        if tensors or self.to_image:
            pixels = np.empty(shape, np.uint8)  # handed out: the tensors are views of it
        else:
            # Copied into PIL images: one buffer per thread, kept. A fresh one per batch is a
            # new mapping, page-faulted afresh every batch (~40 faults per sample at 224x224).
            need = len(jobs) * out_h * out_w * 3
            pixels = thread_buffer(self._local, "batch", need)[:need].reshape(shape)
        try:
            self.read.run(jobs, pixels, planar=tensors)
        except BatchItemError as exc:
            raise ImageFieldError(places[exc.position][2], exc.cause) from exc.cause
        if tensors or self.to_image:
            from torchvision import tv_tensors

            batch = torch.from_numpy(pixels)
            for j, (k, at, _leaf) in enumerate(places):
                # ToImage of a PIL image: its HWC pixels, permuted to CHW (not made contiguous).
                made[k][0][at] = tv_tensors.Image(batch[j] if tensors else batch[j].permute(2, 0, 1))
        else:
            for j, (k, at, _leaf) in enumerate(places):
                made[k][0][at] = Image.fromarray(pixels[j], "RGB")

    def _png_crop(self, pending: PendingImage, box: tuple[int, int, int, int], flip: bool) -> Image.Image:
        """A PNG image field's crop, resized and flipped as v2 does to its RGB PIL image: the
        rows down to the box decoded (``read.pairs.pillow_patch``), then Pillow's resize (its
        arithmetic in the compiled module where that reproduces it here)."""
        _, width, height, _ = pending.info()
        out_h, out_w = self.crop.size
        resample = self.read.crop.resample  # type: ignore[union-attr]
        try:
            patch = pillow_patch(pending.payload, box, width, height, pending.where)
        except Exception as exc:  # Pillow raises many exception types for bad data
            raise ImageFieldError(pending, exc) from exc
        rows, cols = patch.shape[:2]
        whole = (0, 0, cols, rows)
        exact = self.read.exact
        if exact is not None and resample == Image.Resampling.BILINEAR:
            out = np.empty((out_h, out_w, 3), np.uint8)
            if exact_resize_into(exact[0], exact[1], patch, whole, (out_w, out_h), out, flip=flip):
                return Image.fromarray(out, "RGB")
        img = resize_region(patch, whole, (out_w, out_h), resample=resample)
        return img.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else img

    def describe(self) -> dict[str, Any]:
        """What was decided, for ``repr`` and troubleshooting."""
        return {
            "fused": self.fused,
            "flip": self.flip is not None,
            "batches": self.batches,
            "tensors": self.tensors,
            "to_image": self.to_image,
            **self.read.describe(),
        }


# -- pairs: BasicSR's paired_random_crop + augment ---------------------------------------------------------
class PairedRandomCrop:
    """BasicSR's ``paired_random_crop`` then ``augment`` as one transform of ``(lq, gt)``.

    The ``gt_size // scale`` square of LQ at a random place and the ``gt_size`` square
    of GT at ``scale`` times it, both mirrored left-right (``hflip``), upside down and
    transposed (``rotation``) the same way, each with probability 1/2; the random
    numbers are Python's ``random``, drawn as BasicSR draws them (``read.pairs``), so
    under the same seed the patches are BasicSR's (in RGB where BasicSR's are BGR).

    Args:
        gt_size: the GT patch's side (BasicSR's ``gt_size``).
        scale: GT's size over LQ's (an integer).
        hflip, rotation: BasicSR's ``use_hflip`` and ``use_rot``.
        output: ``"same"`` (PIL images for PIL images, arrays for ``H x W x C``
            arrays) or ``"tensor"``: uint8 ``C x H x W`` ``tv_tensors.Image`` (so later v2
            steps transform both; add
            ``v2.ToDtype(torch.float32, scale=True)`` for BasicSR's [0, 1] floats).

    An ``LMDBDataset`` of a ``pairs`` pack fuses it with decoding (``PairPlan``): only
    the patches are decoded (a JPEG's box by region) and turned, never a whole image.

    Example:
        >>> from lmdbfolder import fused
        >>> tf = fused.PairedRandomCrop(gt_size=128, scale=4, output="tensor")
        >>> ds = LMDBDataset("div2k.lmdb", transforms=tf)  # doctest: +SKIP
    """

    def __init__(
        self, gt_size: int, scale: int, *, hflip: bool = True, rotation: bool = True, output: str = "same"
    ) -> None:
        if int(scale) != scale or scale < 1:
            raise ValueError(f"scale must be a positive integer, got {scale!r}")
        if gt_size < scale:
            raise ValueError(f"gt_size must be at least scale ({scale}), got {gt_size}")
        if output not in ("same", "tensor"):
            raise ValueError(f"output must be 'same' or 'tensor', got {output!r}")
        self.gt_size = int(gt_size)
        self.scale = int(scale)
        self.hflip = bool(hflip)
        self.rotation = bool(rotation)
        self.output = output

    def draw(self, lq_size: tuple[int, int], gt_size: tuple[int, int], where: str = "the pair") -> PairDraw:
        """The patches and flags for an LQ and GT of these ``(width, height)`` sizes, drawn
        from Python's ``random`` as BasicSR draws them."""
        return draw_pair(
            lq_size, gt_size, self.gt_size, self.scale, hflip=self.hflip, rotation=self.rotation, where=where
        )

    def __call__(self, lq: Any, gt: Any) -> tuple[Any, Any]:
        """The ``(lq, gt)`` patches of a decoded pair (PIL images or ``H x W [x C]`` arrays)."""
        arrays = [np.asarray(img) for img in (lq, gt)]
        if any(a.ndim not in (2, 3) for a in arrays):
            raise TypeError("PairedRandomCrop takes PIL images or H x W (x C) arrays")
        sizes = [(a.shape[1], a.shape[0]) for a in arrays]
        draw = self.draw(sizes[0], sizes[1])
        patches = []
        for arr, (top, left, h, w) in zip(arrays, (draw.lq_box(), draw.gt_box())):
            patches.append(augment_patch(arr[top : top + h, left : left + w], draw))
        return self.finish(patches[0], patches[1], like=lq)

    def finish(self, lq: np.ndarray, gt: np.ndarray, like: Any = None) -> tuple[Any, Any]:
        """The output of two patches (``H x W [x C]`` uint8 arrays): tensors with
        ``output="tensor"``; else PIL images (for a PIL ``like``, or None) or the arrays."""
        if self.output == "tensor":
            return _chw(lq), _chw(gt)
        if like is None or isinstance(like, Image.Image):
            mode = like.mode if isinstance(like, Image.Image) else None
            return _pil(lq, mode), _pil(gt, mode)
        return lq, gt

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(gt_size={self.gt_size}, scale={self.scale}, hflip={self.hflip}, "
            f"rotation={self.rotation}, output={self.output!r})"
        )


def _chw(patch: np.ndarray) -> torch.Tensor:
    # A tv_tensors.Image, not a plain tensor: v2 treats only the first plain tensor of a
    # sample as an image and passes the others through, so a later ToDtype or Normalize
    # would change LQ and leave GT as it was.
    from torchvision import tv_tensors

    arr = patch[:, :, None] if patch.ndim == 2 else patch
    return tv_tensors.Image(torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1))))


def _pil(patch: np.ndarray, mode: str | None) -> Image.Image:
    img = Image.fromarray(patch)
    return img.convert(mode) if mode is not None and img.mode != mode else img


def split_paired(transforms: Any) -> tuple[PairedRandomCrop | None, Any]:
    """``(crop, rest)`` when ``transforms`` is a ``PairedRandomCrop`` or a ``Compose``
    (``transforms.v2``'s, or a list-holding one of the same kind) that starts with one;
    else ``(None, transforms)``."""
    if isinstance(transforms, PairedRandomCrop):
        return transforms, None
    v2 = _v2()
    if v2 is not None and type(transforms) is v2.Compose:
        steps = list(transforms.transforms)
        if steps and isinstance(steps[0], PairedRandomCrop):
            return steps[0], (v2.Compose(steps[1:]) if len(steps) > 1 else None)
    return None, transforms


class PairPlan:
    """How a dataset applies a pipeline to a pair ``(lq, gt)`` of ``PendingImage``: a
    leading ``PairedRandomCrop`` fused with decoding (only the two patches are decoded,
    a JPEG's by region, then mirrored and turned as uint8 patches), the rest as given.
    A pipeline without one: the pair decoded whole, the pipeline as given."""

    def __init__(self, transforms: Any, *, decoder: Any, threads: int = 1, caps: Capabilities | None = None) -> None:
        caps = current() if caps is None else caps
        self.transforms = transforms
        self.key = (transforms, tuple(getattr(transforms, "transforms", None) or ()))
        self.crop, self.rest = split_paired(transforms)
        self.fused = self.crop is not None
        self.read = ReadPlan(decoder, threads=threads, caps=caps)
        self.patches = PatchReader(self.read)
        self.batches = False

    def stale(self, transforms: Any) -> bool:
        """Whether ``transforms`` is no longer what this plan was made from."""
        return (transforms, tuple(getattr(transforms, "transforms", None) or ())) != self.key

    def __call__(self, lq: Any, gt: Any) -> Any:
        """The transformed pair."""
        crop = self.crop
        if crop is None or type(lq) is not PendingImage or type(gt) is not PendingImage:
            lq, gt = resolve((lq, gt), self.read)
            return (lq, gt) if self.transforms is None else self.transforms(lq, gt)
        sizes = [p.info() for p in (lq, gt)]
        if not all(w > 0 and h > 0 for _, w, h, _ in sizes):
            out = crop(*resolve((lq, gt), self.read))
        else:
            draw = crop.draw((sizes[0][1], sizes[0][2]), (sizes[1][1], sizes[1][2]), where=lq.where)
            made = []
            for pending, box in ((lq, draw.lq_box()), (gt, draw.gt_box())):
                try:
                    patch = self.patches.patch(pending.payload, box, pending.where)
                except Exception as exc:  # Pillow raises many exception types for bad data
                    raise ImageFieldError(pending, exc) from exc
                made.append(augment_patch(patch, draw))
            out = crop.finish(made[0], made[1])
        return out if self.rest is None else self.rest(*out)

    def batch(self, samples: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Every pair transformed, in order (the random numbers drawn as one by one)."""
        return [self(*s) for s in samples]

    def describe(self) -> dict[str, Any]:
        """What was decided, for ``repr`` and troubleshooting."""
        return {"fused": self.fused, **self.read.describe()}


def plan_fields(
    transforms: Any, *, decoder: Any, threads: int = 1, caps: Capabilities | None = None, pairs: bool = False
) -> JointPlan | PairPlan:
    """The plan for a dataset's ``transforms``: ``PairPlan`` for a pack of pairs
    (``pairs``) or a pipeline that starts with ``PairedRandomCrop``, else ``JointPlan``."""
    make: Callable[..., JointPlan | PairPlan] = JointPlan
    if pairs or split_paired(transforms)[0] is not None:
        make = PairPlan
    return make(transforms, decoder=decoder, threads=threads, caps=caps)


def fusable(transforms: Any, *, pairs: bool = False) -> bool:
    """Whether ``transforms`` starts with steps a plan fuses (a cheap look at its types)."""
    if pairs or split_paired(transforms)[0] is not None:
        return split_paired(transforms)[0] is not None
    return split_joint(transforms)[0] is not None


class PlanSlot:
    """A dataset's fused plan, made in the process that uses it (a plan holds this process's
    libraries and threads: never pickled, so a spawned DataLoader worker makes its own) and
    made again when the dataset's transforms change (``stale``). ``decoder``: the resolved
    decoder's name (None: ``auto``, the fastest that gives Pillow's pixels here)."""

    def __init__(self, *, pairs: bool = False, decoder: str | None = None) -> None:
        self.pairs = pairs
        self.decoder = decoder
        self._plan: JointPlan | PairPlan | None = None
        self._pid = 0

    def get(self, transforms: Any) -> JointPlan | PairPlan:
        """The plan for ``transforms`` in this process."""
        import os

        plan = self._plan
        if plan is None or self._pid != os.getpid() or plan.stale(transforms):
            caps = current()
            decoder = caps.decoder(self.decoder or caps.auto_decoder())
            plan = self._plan = plan_fields(transforms, decoder=decoder, caps=caps, pairs=self.pairs)
            self._pid = os.getpid()
        return plan

    def __getstate__(self) -> dict[str, Any]:
        return {"pairs": self.pairs, "decoder": self.decoder}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

"""``TransformPlan``: how a dataset applies its ``transform`` to a record, decided once
(in the style of ``lmdbfolder.read.plan``): whether a fused crop leads it (``split_fused``,
``split_exact``), whether a batch can be made whole (``batch_recipe``), and when a plan
is stale (``plan_key``).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, NamedTuple, Sequence

import numpy as np
from PIL import Image

from lmdbfolder.errors import MissingDependencyError

try:
    import torch
    import torch.utils.data
    from torchvision import transforms as T
    from torchvision.transforms.functional import pil_modes_mapping
except ImportError as exc:  # a core-only install: say what to install
    raise MissingDependencyError(
        "lmdbfolder.fused (the fused RandomResizedCrop)", "torch", "torch and torchvision"
    ) from exc

from lmdbfolder.read.capabilities import Capabilities, current
from lmdbfolder.read.decoders import to_pil
from lmdbfolder.read.plan import BatchItemError, CropJob, ReadPlan
from lmdbfolder.torch.crop import RandomResizedCrop
from lmdbfolder.torch.multicrop import MultiCrop, resizers
from lmdbfolder.torch.replay import kept_state
from lmdbfolder.torch.transport import pool

__all__ = [
    "split_fused",
    "split_exact",
    "batch_recipe",
    "BatchRecipe",
    "TransformPlan",
    "plan_key",
    "fast_path",
    "NATIVE_CHUNK",
]


def split_fused(transform: Any) -> tuple[RandomResizedCrop | None, Any]:
    """If ``transform`` is a fused crop, or a ``Compose`` (``transforms.Compose`` or
    ``transforms.v2.Compose``) that starts with one, return ``(crop, rest)`` (``rest``,
    a ``Compose`` of the same kind, may be None); else ``(None, transform)``."""
    if isinstance(transform, RandomResizedCrop):
        return transform, None
    composes: tuple[type, ...] = (T.Compose,)
    v2 = sys.modules.get("torchvision.transforms.v2")  # only if the caller uses v2 (importing it costs time)
    if v2 is not None:
        composes += (v2.Compose,)
    steps: list[Any] = list(getattr(transform, "transforms", None) or []) if isinstance(transform, composes) else []
    if steps and isinstance(steps[0], RandomResizedCrop):
        kind = v2.Compose if v2 is not None and isinstance(transform, v2.Compose) else T.Compose
        return steps[0], (kind(steps[1:]) if len(steps) > 1 else None)
    return None, transform


def _flip_probability(step: Any) -> float | None:
    """``p`` of a horizontal flip (torchvision's v1 or v2 RandomHorizontalFlip), else None."""
    if type(step) is T.RandomHorizontalFlip:
        return float(step.p)
    v2 = sys.modules.get("torchvision.transforms.v2")
    if v2 is not None and type(step) is v2.RandomHorizontalFlip:
        return float(step.p)
    return None


def _is_to_tensor(step: Any) -> bool:
    """``PILToTensor`` (v1 or v2) or v2's ``ToImage``: uint8 CHW, values unchanged."""
    if type(step) is T.PILToTensor:
        return True
    v2 = sys.modules.get("torchvision.transforms.v2")
    return v2 is not None and type(step) in (v2.PILToTensor, v2.ToImage)


def split_exact(transform: Any) -> tuple[RandomResizedCrop | None, Any]:
    """``split_fused``, and also for a transform that starts with torchvision's own
    ``transforms.RandomResizedCrop`` (exactly that class, with an interpolation
    Pillow has): then the crop is an equivalent fused crop that changes nothing
    (``reduce=False``, Pillow's resize, PIL output), so the same boxes, random
    numbers and pixels come out while the decode skips the full-size PIL image
    and batches can take the fast path. That equivalence is what the tests check
    against torchvision's transform (and ImageFolder) pixel by pixel.
    """
    crop, rest = split_fused(transform)
    if crop is not None:
        return crop, rest
    steps = list(transform.transforms) if type(transform) is T.Compose else [transform]
    first: Any = steps[0] if steps else None
    if type(first) is not T.RandomResizedCrop or first.interpolation not in pil_modes_mapping:
        return None, transform
    twin = RandomResizedCrop(
        first.size,
        scale=first.scale,
        ratio=first.ratio,
        interpolation=first.interpolation,
        antialias=first.antialias,
        reduce=False,
        resize="pil",
        output="pil",
    )
    rest = T.Compose(steps[1:]) if len(steps) > 1 else None
    return twin, rest


def plan_key(transform: Any) -> tuple[Any, ...]:
    """What a ``TransformPlan`` of ``transform`` takes from it when it is made: the steps
    of a ``Compose`` (the objects its list holds now), and the settings of each
    ``RandomResizedCrop`` and horizontal flip among them, which the plan copies (size,
    scale, ratio, interpolation, antialias, the fused crop's own; the flip's ``p``).

    A plan whose key differs is stale. Training scripts change a transform in place
    between epochs (progressive resizing: ``tf.transforms[0].size = (160, 160)``,
    ``tf.transforms.append(...)``), and ImageFolder applies the transform as it is now.
    """
    if isinstance(transform, MultiCrop):
        return (transform, transform.views)  # its views (a tuple of frozen specs) as they are now
    found = getattr(transform, "transforms", None)
    steps = tuple(found) if isinstance(found, list) else (transform,)
    key: list[Any] = [transform, steps]
    for step in steps:
        if isinstance(step, T.RandomResizedCrop):
            key.append(
                (_frozen(step.size), _frozen(step.scale), _frozen(step.ratio), step.interpolation, step.antialias)
            )
            if isinstance(step, RandomResizedCrop):
                key.append((step.reduce, step.resize, step.output))
        elif _flip_probability(step) is not None:
            key.append(step.p)
    return tuple(key)


def _frozen(value: Any) -> Any:
    # A copy of a list or tuple setting, so that a change to the list itself shows too.
    return tuple(value) if isinstance(value, (list, tuple)) else value


class BatchRecipe(NamedTuple):
    """How the batch fast path makes a batch: the crop, then a flip with probability
    ``flip`` (None: no flip step, so no random number is drawn for it)."""

    flip: float | None


def batch_recipe(crop: RandomResizedCrop | None, rest: Any) -> BatchRecipe | None:
    """The recipe when a fused ``crop`` followed by ``rest`` can be computed a whole
    batch at a time, into uint8 CHW tensors; None when it cannot (then every
    sample goes through the transforms as given).

    Batchable: the crop, then at most a horizontal flip and (for a crop with
    ``output="pil"``) a ``PILToTensor``/``ToImage``; nothing else, because only
    these are known to give the same values on the batch as on each sample.
    """
    if crop is None:
        return None
    steps: list[Any] = []
    if rest is not None:
        v2 = sys.modules.get("torchvision.transforms.v2")
        if _flip_probability(rest) is not None or _is_to_tensor(rest):
            steps = [rest]
        elif type(rest) is T.Compose or (v2 is not None and type(rest) is v2.Compose):
            steps = list(rest.transforms)
        else:
            return None
    flip: float | None = None
    to_tensor = crop.output == "tensor"
    for step in steps:
        p = _flip_probability(step)
        if p is not None and flip is None:
            flip = p
        elif _is_to_tensor(step) and not to_tensor:
            to_tensor = True
        else:
            return None
    return BatchRecipe(flip) if to_tensor else None


#: Images claimed, drawn and handed to a ``resize="native"`` batch at a time (``TransformPlan.batch``).
NATIVE_CHUNK = 16


class TransformPlan:
    """How a dataset applies its ``transform`` to a record, resolved once per
    (dataset, transform, process): the fused crop and the steps after it, whether
    batches take the fast path (and its flip), and the ``ReadPlan`` that decodes.

    Args:
        transform: the dataset's transform (None: the whole image).
        decoder: the resolved JPEG decoder.
        size_hint: as ``LMDBFolder``'s (no exact fused twin of torchvision's crop then).
        threads: threads per batch.
        caps: the capabilities to decide from (default: this process's).

    ``decode(record)`` makes one sample before ``rest`` (a PIL image or a uint8
    CHW tensor) and ``batch(records, out)`` a whole batch into one uint8 ``N x 3
    x H x W`` array; both decode through ``read.run``, the one executor.
    """

    def __init__(
        self,
        transform: Any,
        *,
        decoder: Any,
        size_hint: int | None = None,
        threads: int = 1,
        caps: Capabilities | None = None,
    ) -> None:
        caps = current() if caps is None else caps
        crop: RandomResizedCrop | None = None
        rest = transform
        #: The fused multi-crop (``MultiCrop``: all its views from one region decode), or None.
        self.multicrop = transform if isinstance(transform, MultiCrop) and size_hint is None else None
        if self.multicrop is not None:
            rest = None  # ``decode`` makes the views themselves
        elif transform is not None:
            # size_hint asks for the DCT-scaled full image: no exact twin then.
            crop, rest = (split_exact if size_hint is None else split_fused)(transform)
        self.transform = transform
        self.crop = crop
        self.rest = rest
        recipe = batch_recipe(crop, rest)
        #: Whether a batch is made whole (``batch``), and its flip probability.
        self.batches = recipe is not None
        self.flip = None if recipe is None else recipe.flip
        self.read = ReadPlan(
            decoder, crop=None if crop is None else crop.spec(), size_hint=size_hint, threads=threads, caps=caps
        )
        self._draw = None if crop is None else crop.drawer(caps)
        #: The multi-crop's compiled resizes (``multicrop.resizers``), decided here once.
        self._resizers = resizers(caps) if self.multicrop is not None else {}
        self._draw_many = crop.batch_drawer(caps) if crop is not None and self.batches else None
        self._planar = crop is not None and crop.output == "tensor"
        #: Whether this plan serves a DataLoader worker (its batches go to shared memory).
        self.in_worker = torch.utils.data.get_worker_info() is not None

    def decode(self, payload: memoryview | bytes, encoding: str, width: int, height: int, channels: int) -> Any:
        """One stored image as the transform's first steps would leave it: the fused
        crop's output (PIL, or a uint8 CHW tensor), or the whole RGB image."""
        crop, read = self.crop, self.read
        if self.multicrop is not None:
            return self._views(self.multicrop, payload, encoding, width, height, channels)
        if crop is None:
            return read.image(payload, encoding, width, height, channels)
        if width <= 0 or height <= 0:
            # The header has no size to draw the box from: decode, then torchvision's own crop.
            return crop.finish(crop.forward(to_pil(read.pixels(payload, encoding, width, height, channels))))
        enc = read.claim(payload, encoding, width, height, channels)  # the box is drawn from a checked size
        job = read.job(payload, enc, width, height, channels, self._draw(width, height), False)  # type: ignore[misc]
        out_h, out_w = crop.size
        planar = self._planar
        out = np.empty((1, 3, out_h, out_w) if planar else (1, out_h, out_w, 3), np.uint8)
        read.run([job], out, planar=planar)
        return torch.from_numpy(out[0]) if planar else Image.fromarray(out[0], "RGB")

    def _views(
        self, multicrop: MultiCrop, payload: memoryview | bytes, encoding: str, width: int, height: int, channels: int
    ) -> list[Any]:
        """A multi-crop sample: every view's random numbers drawn (the original's order),
        the union of their boxes decoded once (``ReadPlan.covering``), the views made from it."""
        read = self.read
        if width <= 0 or height <= 0:
            # The header has no size to draw the boxes from: the whole image, then the views.
            return multicrop(to_pil(read.pixels(payload, encoding, width, height, channels)))
        enc = read.claim(payload, encoding, width, height, channels)  # the boxes are drawn from a checked size
        draws = multicrop.draw(width, height)
        pixels, top, left = read.covering(payload, enc, width, height, channels, multicrop.union(draws))
        return multicrop.make(pixels, top, left, draws, self._resizers)

    def views_many(self, records: Sequence[Any], seeded: Any = None) -> list[torch.Tensor]:
        """The multi-crop views of ``records`` (each with a size in its header) as batch
        tensors, one per view (``N x 3 x H x W``, what the DataLoader's collate would
        stack; all in one reused buffer, ``transport.BatchPool.take_many``): every
        record claimed and its views' random numbers drawn in order, in this thread
        (the numbers the per-sample path draws, sample after sample;
        ``seeded(k)``: a context in which record ``k`` draws, ``lmdbfolder.replay``), then
        the decodes and the views made by the plan's threads (``threads``), each written
        into its slots. Raises BatchItemError for the first record that failed (every
        record is claimed before any number is drawn)."""
        multicrop, read = self.multicrop, self.read
        if multicrop is None:
            raise ValueError("this plan has no multi-crop")
        encodings = []
        for k, rec in enumerate(records):
            try:
                encodings.append(read.claim(rec.payload, rec.encoding, rec.width, rec.height, rec.channels))
            except Exception as exc:  # Pillow raises many exception types for bad data
                raise BatchItemError(k, exc) from exc
        # Every claim before any number is drawn (as ``batch`` does); then all the batch's
        # numbers in bulk (``MultiCrop.draw_many``: the per-sample draws' numbers), else
        # sample by sample.
        drawn = None if seeded is not None else multicrop.draw_many([(rec.width, rec.height) for rec in records])
        if drawn is None:
            drawn = []
            for k, rec in enumerate(records):
                with contextlib.nullcontext() if seeded is None else seeded(k):
                    drawn.append(multicrop.draw(rec.width, rec.height))
        samples = [(k, rec, enc, draws) for k, (rec, enc, draws) in enumerate(zip(records, encodings, drawn))]
        # One reused buffer for every view's batch (``transport``): no fresh memory to
        # fault in per batch and, in a DataLoader worker, sent by reference, not copied.
        into = pool().take_many(multicrop.batch_specs(len(samples)))
        found = self._resizers

        def load(sample: tuple[int, Any, Any, Any]) -> tuple[Any, int, int, Any]:
            at, rec, enc, draws = sample
            try:
                pixels, top, left = read.covering(
                    rec.payload, enc, rec.width, rec.height, rec.channels, multicrop.union(draws)
                )
            except Exception as exc:  # decoders raise many exception types for bad data
                raise BatchItemError(at, exc) from exc
            return pixels, top, left, draws

        # A few samples per job: the photometric operations run once per view size for
        # them all (fewer calls), while the threads still share the batch.
        jobs = [samples[lo : lo + VIEW_CHUNK] for lo in range(0, len(samples), VIEW_CHUNK)]

        def make(job: list[tuple[int, Any, Any, Any]]) -> None:
            multicrop.make_many(job, load, into, job[0][0], found)

        try:
            read.map(make, jobs)
        except BatchItemError as exc:
            if isinstance(exc.cause, BatchItemError):  # a record's decode: name the record
                raise exc.cause from exc.cause.cause
            raise BatchItemError(jobs[exc.position][0][0], exc.cause) from exc.cause
        return into

    def batch(self, records: Sequence[Any], seeds: Sequence[int] | None = None) -> torch.Tensor:
        """Every record's box and flip, drawn in the per-sample order (a sample's box,
        then its flip), then the whole batch made into one uint8 ``N x 3 x H x W``
        tensor in a reused buffer (``lmdbfolder.transport``: shared memory in a
        DataLoader worker, which ``collate`` sends by reference). Raises
        BatchItemError for the first record that failed; a record whose header its
        payload denies (``ReadPlan.claim``) fails before its box is drawn.

        ``seeds`` (``lmdbfolder.replay``): record ``k``'s box and flip are drawn
        from torch's generator seeded with ``seeds[k]``, as the per-sample path
        draws them under that seed."""
        claim, job, flip = self.read.claim, self.read.job, self.flip
        draw_many = self._draw_many
        out_h, out_w = self.crop.size  # type: ignore[union-attr]
        images = pool().take((len(records), 3, out_h, out_w))
        bulk = draw_many is not None and seeds is None and torch.get_default_dtype() == torch.float32
        started = self.read.start(images.numpy()) if bulk else None
        if bulk:
            # Every claim of a part before any of its boxes is drawn. resize="native": the
            # batch's threads start on the first images while this thread claims, draws and
            # adds the next ones (NATIVE_CHUNK at a time: the same boxes and flips as one
            # bulk draw, which consumes exactly what it used); else the batch is one part.
            part_size = NATIVE_CHUNK if started is not None else max(1, len(records))
            jobs: list[CropJob] = []
            try:
                for lo in range(0, len(records), part_size):
                    part = records[lo : lo + part_size]
                    encodings = []
                    for k, rec in enumerate(part, lo):
                        try:
                            encodings.append(claim(rec.payload, rec.encoding, rec.width, rec.height, rec.channels))
                        except Exception as exc:  # Pillow raises many exception types for bad data
                            raise BatchItemError(k, exc) from exc
                    boxes, flips = draw_many([(rec.width, rec.height) for rec in part], flip)  # type: ignore[misc]
                    for rec, enc, box, flipped in zip(part, encodings, boxes, flips):
                        made = job(rec.payload, enc, rec.width, rec.height, rec.channels, box, flipped)
                        if started is not None:
                            started.add(len(jobs), made)
                        jobs.append(made)
            except BaseException:
                if started is not None:
                    started.close()  # its threads end now, not when the traceback is let go
                raise
            if started is not None:
                started.finish(jobs)
                return images
        else:
            draw, rand = self._draw, torch.rand
            jobs = []
            # Seeded: each sample's box and flip from its own stream. They draw from torch's
            # generator only (Python's random is the per-sample path's, for transforms that
            # use it): its state is kept once for the batch, not once per sample.
            with contextlib.nullcontext(torch.default_generator) if seeds is None else kept_state() as generator:
                for k, rec in enumerate(records):
                    try:
                        enc = claim(rec.payload, rec.encoding, rec.width, rec.height, rec.channels)
                    except Exception as exc:  # Pillow raises many exception types for bad data
                        raise BatchItemError(k, exc) from exc
                    if seeds is not None:
                        generator.manual_seed(seeds[k])
                    box = draw(rec.width, rec.height)  # type: ignore[misc]
                    flipped = flip is not None and bool(rand(1) < flip)
                    jobs.append(job(rec.payload, enc, rec.width, rec.height, rec.channels, box, flipped))
        self.read.run(jobs, images.numpy(), planar=True)
        return images


#: Samples per job of a multi-crop batch (``views_many``): their views' photometric
#: operations run together (fewer calls), and the working set stays in cache.
VIEW_CHUNK = 4


def fast_path(transform: Any, *, size_hint: int | None = None) -> tuple[bool, str]:
    """Whether an ``LMDBFolder`` applies ``transform`` on a fast path, and a sentence
    saying which, or why not (``repr(dataset)`` and ``lmdbfolder doctor DST
    --transform`` print it once, so that a transform that buys nothing from the pack
    says so without a warning per sample)."""
    if transform is None:
        return False, "none (samples are whole RGB PIL images)"
    if isinstance(transform, MultiCrop):
        if size_hint is not None:
            return False, "MultiCrop with size_hint: the whole image is decoded (scaled), then the views are made"
        return True, f"fused multi-crop: {len(transform.views)} views from one region decode per sample"
    crop, rest = (split_exact if size_hint is None else split_fused)(transform)
    if crop is not None:
        how = "fused RandomResizedCrop (only the crop's rows decoded)"
        if batch_recipe(crop, rest) is not None:
            how += "; whole batches made at once"
        return True, how
    name = type(transform).__name__
    if name == "DataAugmentationDINO" or hasattr(transform, "global_transfo1"):
        return False, (
            f"no fast path: {name} makes each of its views from a fully decoded PIL image, one PIL step at a "
            "time (lmdbfolder cannot see inside it); put lmdbfolder.fused.MultiCrop.dino(...) with the same "
            "arguments in its place: the same random numbers, one decode for all views"
        )
    found = getattr(transform, "transforms", None)
    steps = list(found) if isinstance(found, list) else []
    first = steps[0] if steps else transform
    # The full path: torchvision's v1 and v2 RandomResizedCrop share a name, not a fast path.
    module = type(first).__module__
    first_name = type(first).__qualname__ if module == "builtins" else f"{module}.{type(first).__qualname__}"
    if type(first).__name__ == "RandomResizedCropAndInterpolation":
        why = f"its first step is {first_name}, which lmdbfolder does not fuse"
    elif isinstance(first, T.RandomResizedCrop):
        why = f"its first step, {first_name} with interpolation {first.interpolation}, has no Pillow twin"
    else:
        why = f"it does not start with torchvision's transforms.RandomResizedCrop (its first step is {first_name})"
    return False, (
        f"no fast path: {why}, so every image is decoded whole and given to it; "
        "torchvision's RandomResizedCrop (or lmdbfolder.fused.RandomResizedCrop) first would be fused"
    )

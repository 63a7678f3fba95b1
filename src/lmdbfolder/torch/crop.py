"""A ``RandomResizedCrop`` that ``LMDBFolder`` fuses with JPEG decoding.

``lmdbfolder.fused.RandomResizedCrop`` is a subclass of torchvision's
``RandomResizedCrop`` with the same arguments and the same behaviour on a PIL
image, so a transform list that starts with it works unchanged with
``ImageFolder``. When it is the first step of an ``LMDBFolder``'s transform,
the dataset does not decode the full image first (raw packs: does not copy
it first), the crop box is drawn from
the image size in the record header with torchvision's own ``get_params``
(so the boxes, and the random numbers consumed, are exactly the unfused
transform's), the JPEG is decoded at the smallest DCT scale (1/2, 1/4, 1/8)
whose crop still has at least ``size`` pixels each way, and only the crop is
resized.

Resampling difference: with ``reduce=False, resize="pil"`` and the Pillow
decoder the output is pixel-identical to the unfused transform. With DCT
scaling, libjpeg's scaled IDCT does part of the downsampling (a box-like
filter in the DCT domain) and the crop box is mapped to the smaller image
with sub-pixel precision before the bilinear resize; ``resize="native"``
lmdbfolder's compiled bilinear (OpenCV's INTER_LINEAR geometry, within one grey
level of it, over the sub-pixel box), with which a batch's JPEGs are decoded and
resized in C without the GIL. These change pixel values slightly (a few grey levels
on average on photos), not the geometry. ``resize="opencv"`` uses ``cv2.resize``
(INTER_AREA when shrinking 2x or more, INTER_LINEAR otherwise), which takes whole
pixels only: at a reduced DCT scale its box is rounded to whole decoded pixels, which
can move the crop by up to half a decoded pixel (a fraction of an output pixel).
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Any, Callable, Iterable, NamedTuple, Sequence, TypeVar

import numpy as np

from lmdbfolder.errors import MissingDependencyError

try:
    import torch
    from torchvision import transforms as T
    from torchvision.transforms.functional import InterpolationMode, pil_modes_mapping
except ImportError as exc:  # a core-only install: say what to install
    raise MissingDependencyError(
        "lmdbfolder.fused (the fused RandomResizedCrop)", "torch", "torch and torchvision"
    ) from exc

from lmdbfolder.read.capabilities import Capabilities, current
from lmdbfolder.read.crops import NATIVE_MISSING, RESIZE_BACKENDS, Box
from lmdbfolder.read.plan import CropSpec

__all__ = ["RandomResizedCrop", "BatchDrawer", "fast_drawer", "bulk_drawer"]


class RandomResizedCrop(T.RandomResizedCrop):
    """torchvision's ``RandomResizedCrop``, fused with decoding by ``LMDBFolder``.

    Args:
        size, scale, ratio, interpolation, antialias: as in torchvision.
        reduce: decode JPEGs at a reduced DCT scale when the crop allows it.
        resize: ``"pil"`` (Pillow, as the unfused transform), ``"opencv"``
            (faster; needs opencv-python-headless; OpenCV is limited to one
            thread per process, since DataLoader workers already use the cores)
            or ``"native"``: lmdbfolder's compiled bilinear (OpenCV's INTER_LINEAR
            geometry, within one grey level of its pixels), the fastest: a batch's
            JPEGs are decoded and resized in C by the batch's threads, none of them
            holding the GIL, so ``threads=N`` scales with cores (needs the compiled
            helper, which ``make demo`` builds; no OpenCV). Without the fusion (a
            PIL image given to the transform itself) every backend is torchvision's
            own crop.
        output: ``"pil"`` (a PIL image, for the usual transforms after it) or
            ``"tensor"``: a uint8 CHW tensor, what ``PILToTensor`` would make
            of the PIL image, without the round trip through PIL (then drop
            ``PILToTensor`` from the pipeline; ``RandomHorizontalFlip`` and
            the v2 transforms accept tensors).

    Example:
        >>> from torchvision import transforms as T
        >>> from lmdbfolder import fused
        >>> tf = T.Compose([fused.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.PILToTensor()])
        >>> ds = LMDBFolder("train.lmdb", transform=tf, decoder="auto")  # doctest: +SKIP
    """

    def __init__(
        self,
        size: int | Sequence[int],
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0),
        interpolation: InterpolationMode = InterpolationMode.BILINEAR,
        antialias: bool | None = True,
        *,
        reduce: bool = True,
        resize: str = "pil",
        output: str = "pil",
    ) -> None:
        super().__init__(size, scale=scale, ratio=ratio, interpolation=interpolation, antialias=antialias)
        if resize not in RESIZE_BACKENDS:
            raise ValueError(f"resize must be one of {RESIZE_BACKENDS}, got {resize!r}")
        if output not in ("pil", "tensor"):
            raise ValueError(f"output must be 'pil' or 'tensor', got {output!r}")
        if resize == "opencv" and current().cv2() is None:  # fail here, not in a worker
            raise MissingDependencyError('lmdbfolder.fused.RandomResizedCrop(resize="opencv")', "opencv", "OpenCV")
        if resize == "native" and current().native_resize() is None:
            raise ImportError(NATIVE_MISSING)
        self.reduce = reduce
        self.resize = resize
        self.output = output

    def sample_box(self, width: int, height: int) -> Box:
        """Draw a crop box ``(top, left, height, width)`` for an image of this size,
        exactly as torchvision's ``get_params`` draws it from the global torch RNG
        (the same boxes and the same random numbers consumed). For many images,
        take ``drawer()`` once and call it."""
        return self.drawer()(width, height)

    def drawer(self, caps: Capabilities | None = None) -> Callable[[int, int], Box]:
        """``sample_box`` decided once: a function ``(width, height) -> box``.

        The draws are made with the same torch calls as ``get_params``, without
        its per-call set-up (a tensor of the image's shape, the logarithms of
        ``ratio``): about a fifth of the time. That this gives ``get_params``'
        boxes is checked once per process against ``get_params`` itself
        (``caps``, default this process's capabilities); if it ever does not
        (another torchvision), the function calls ``get_params``.
        """
        return fast_drawer(self.scale, self.ratio, caps) or self._torchvision_box

    def batch_drawer(self, caps: Capabilities | None = None) -> BatchDrawer | None:
        """The boxes of a whole batch and the flips after them, drawn in bulk: a
        function ``(sizes, flip) -> (boxes, flips)`` giving what ``drawer()`` then
        ``torch.rand(1) < flip`` give sample by sample, in that order (the same
        numbers, the same count of random numbers consumed), or None when that was
        not confirmed here (checked once per process; see ``_draw_boxes``)."""
        return bulk_drawer(self.scale, self.ratio, caps)

    def _torchvision_box(self, width: int, height: int) -> Box:
        shape_only = torch.empty((1, 1, 1), dtype=torch.uint8).expand(1, height, width)
        top, left, h, w = self.get_params(shape_only, list(self.scale), list(self.ratio))
        return int(top), int(left), int(h), int(w)

    def spec(self) -> CropSpec:
        """What the read plan needs of this crop: its size, resize backend, Pillow's
        resampling constant for its interpolation, and ``reduce``."""
        return CropSpec(tuple(self.size), self.resize, int(pil_modes_mapping[self.interpolation]), self.reduce)

    def finish(self, img: Any) -> Any:
        """This crop's output for an image cropped by torchvision's own transform
        (``forward``): the PIL image, or its uint8 CHW tensor with ``output="tensor"``."""
        if self.output == "pil":
            return img
        arr = np.asarray(img)
        if arr.ndim == 2:
            arr = arr[:, :, None]
        # A contiguous CHW copy (one pass in numpy) rather than PILToTensor's
        # permuted view: the flip and the DataLoader's collate then copy
        # contiguous memory instead of striding through it (measured: ~70 us
        # less per 224x224 sample).
        return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", reduce={self.reduce}, resize={self.resize!r}, output={self.output!r})"


def fast_drawer(
    scale: Sequence[float], ratio: Sequence[float], caps: Capabilities | None = None
) -> Callable[[int, int], Box] | None:
    """``(width, height) -> box``: torchvision's RandomResizedCrop box (v1's ``get_params``
    and v2's ``make_params`` draw alike) with the same torch random calls, without their
    per-call set-up; None where that was not confirmed in this process (``caps``)."""
    caps = current() if caps is None else caps
    if not caps.answer("torchvision.fast_boxes", _fast_boxes_ok):
        return None
    scale, ratio = tuple(scale), tuple(ratio)
    log_ratio = _log_ratio(ratio)

    def draw(width: int, height: int) -> Box:
        return _draw_box(width, height, scale, ratio, log_ratio)

    return draw


def bulk_drawer(scale: Sequence[float], ratio: Sequence[float], caps: Capabilities | None = None) -> BatchDrawer | None:
    """``(sizes, flip) -> (boxes, flips)``: what ``fast_drawer`` then ``torch.rand(1) < flip``
    give sample by sample, drawn in bulk; None where that was not confirmed here."""
    caps = current() if caps is None else caps
    if not caps.answer("torchvision.fast_boxes", _fast_boxes_ok) or not caps.answer(
        "torchvision.batch_boxes", _batch_boxes_ok
    ):
        return None
    scale, ratio = tuple(scale), tuple(ratio)
    log_ratio = _log_ratio(ratio)

    def draw_many(sizes: Sequence[tuple[int, int]], flip: float | None) -> tuple[list[Box], list[bool]]:
        # One bulk draw at a time: it puts torch's generator state back between its
        # passes, so two at once (a dataset shared by threads) read each other's numbers.
        with _BULK_DRAWS:
            try:
                return _draw_boxes(sizes, flip, scale, ratio, log_ratio)
            except ArithmeticError:
                # Other code drew from the generator meanwhile: this batch is drawn
                # sample by sample (the generator's state is as before the bulk draw).
                boxes, flips = [], []
                for width, height in sizes:
                    boxes.append(_draw_box(width, height, scale, ratio, log_ratio))
                    flips.append(flip is not None and bool(torch.rand(1) < flip))
                return boxes, flips

    return draw_many


def _draw_box(
    width: int, height: int, scale: Sequence[float], ratio: Sequence[float], log_ratio: tuple[float, float]
) -> Box:
    """torchvision's RandomResizedCrop box for a ``width`` x ``height`` image, drawn
    with the same torch random calls in the same order (see ``sample_box``).

    ``get_params`` makes a new one-element tensor for every draw
    (``torch.empty(1).uniform_``, ``torch.exp``, ``torch.randint``); the same
    kernels run here in place on two reused tensors (``randint`` is
    ``empty(...).random_(low, high)``), which draws the same numbers.
    """
    u, k = _draw_buffers()
    area = height * width
    for _ in range(10):
        target_area = area * u.uniform_(scale[0], scale[1]).item()
        aspect_ratio = u.uniform_(log_ratio[0], log_ratio[1]).exp_().item()
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            top = int(k.random_(0, height - h + 1).item())
            left = int(k.random_(0, width - w + 1).item())
            return top, left, h, w
    # Ten draws that did not fit: the central crop of the allowed aspect ratio.
    return _central_box(width, height, ratio)


def _central_box(width: int, height: int, ratio: Sequence[float]) -> Box:
    """torchvision's fallback box: the central crop of the allowed aspect ratio."""
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _log_ratio(ratio: Sequence[float]) -> tuple[float, float]:
    # float32 logarithms, as get_params computes them (torch.log of a float tensor).
    logs = torch.log(torch.tensor(tuple(ratio)))
    return float(logs[0]), float(logs[1])


#: ``(sizes, flip probability or None) -> (boxes, flips)``: ``RandomResizedCrop.batch_drawer``.
BatchDrawer = Callable[[Sequence[tuple[int, int]], "float | None"], tuple[list[Box], list[bool]]]


class Streams(NamedTuple):
    """The next ``k`` numbers of torch's CPU generator, read each way a draw may use one
    (``bulk_draws``): ``low``, the low 31 bits (``random_()`` of int32), and ``mod3``, the
    number modulo 3 (together they give the whole 32-bit number: ``_raw``); ``uniform[r]``,
    float32 ``uniform_(*r)``; ``aspects[lr]``, float32 ``uniform_(*lr).exp_()``; ``rands``,
    float32 ``rand``."""

    low: list[int]
    mod3: list[int]
    uniform: dict[tuple[float, float], list[float]]
    aspects: dict[tuple[float, float], list[float]]
    rands: list[float]


_Drawn = TypeVar("_Drawn")


def bulk_draws(
    k: int,
    ranges: Iterable[tuple[float, float]],
    log_ratios: Iterable[tuple[float, float]],
    scan: Callable[[Streams, int], tuple[_Drawn, int] | None],
) -> _Drawn:
    """What a sequence of per-sample draws from torch's CPU generator gives, drawn in bulk.

    Every one of those draws takes one 32-bit number from the generator (float32
    ``uniform_`` and ``rand``, ``random_`` below 2**32, ``randperm``'s swaps). So the next
    ``k`` numbers are drawn once for each way they can be used (``Streams``), with the
    generator's state put back before each pass; ``scan(streams, k)`` then reads the samples'
    values in the order they draw them and returns ``(result, used)``, or None when ``k``
    numbers were not enough (drawn again, twice as many). Finally the state is put back and
    advanced by exactly the count used. ArithmeticError from ``scan`` (``_raw``: other code drew
    meanwhile) leaves the state as before. ``crop.RandomResizedCrop``'s boxes and flips
    (``_draw_boxes``) and the multi-crop's views are drawn this way; each is confirmed against
    its per-sample draws once per process."""
    ranges, log_ratios = sorted(set(ranges)), sorted(set(log_ratios))
    while True:
        state = torch.get_rng_state()
        try:
            low = torch.empty(k, dtype=torch.int32).random_().tolist()
            torch.set_rng_state(state)
            mod3 = torch.empty(k, dtype=torch.int64).random_(0, 3).tolist()
            uniform = {}
            for r in ranges:
                torch.set_rng_state(state)
                uniform[r] = torch.empty(k).uniform_(r[0], r[1]).tolist()
            aspects = {}
            for lr in log_ratios:
                torch.set_rng_state(state)
                aspects[lr] = torch.empty(k).uniform_(lr[0], lr[1]).exp_().tolist()
            torch.set_rng_state(state)
            rands = torch.rand(k).tolist()
        finally:
            torch.set_rng_state(state)
        scanned = scan(Streams(low, mod3, uniform, aspects, rands), k)
        if scanned is not None:
            result, used = scanned
            if used:
                torch.empty(used, dtype=torch.int32).random_()  # consume what the samples drew
            return result
        k *= 2  # more rejected draws than drawn for: draw again, more


def _draw_boxes(
    sizes: Sequence[tuple[int, int]],
    flip: float | None,
    scale: Sequence[float],
    ratio: Sequence[float],
    log_ratio: tuple[float, float],
) -> tuple[list[Box], list[bool]]:
    """For each ``(width, height)`` in order, ``_draw_box`` then (unless ``flip`` is
    None) ``bool(torch.rand(1) < flip)``: the same values and the same count of
    random numbers consumed, with a few torch calls per batch instead of ~9 per sample
    (``bulk_draws``; ``_batch_boxes_ok`` confirms it once per process)."""
    area = (float(scale[0]), float(scale[1]))
    # torch compares a float32 rand with a Python float in float32
    p = None if flip is None else float(np.float32(flip))

    def scan(streams: Streams, k: int) -> tuple[tuple[list[Box], list[bool]], int] | None:
        return _scan_boxes(sizes, p, ratio, k, streams, streams.uniform[area], streams.aspects[log_ratio])

    # ~5.7 numbers per sample on 4:3 photos with torchvision's scale and ratio
    return bulk_draws(7 * len(sizes) + 16, [area], [log_ratio], scan)


def _scan_boxes(
    sizes: Sequence[tuple[int, int]],
    flip: float | None,
    ratio: Sequence[float],
    k: int,
    streams: Streams,
    areas: list[float],
    aspects: list[float],
) -> tuple[tuple[list[Box], list[bool]], int] | None:
    """The samples' boxes and flips from the pre-drawn numbers, and the count used
    (None: ``k`` numbers were not enough)."""
    boxes: list[Box] = []
    flipped: list[bool] = []
    rands = streams.rands
    j = 0
    for width, height in sizes:
        scanned = _scan_box(width, height, ratio, j, k, streams.low, streams.mod3, areas, aspects)
        if scanned is None:
            return None
        box, j = scanned
        boxes.append(box)
        if flip is not None:
            if j + 1 > k:
                return None
            flipped.append(rands[j] < flip)
            j += 1
        else:
            flipped.append(False)
    return (boxes, flipped), j


def _scan_box(
    width: int,
    height: int,
    ratio: Sequence[float],
    j: int,
    k: int,
    low: list[int],
    mod3: list[int],
    areas: list[float],
    aspects: list[float],
) -> tuple[Box, int] | None:
    """One image's box from the pre-drawn numbers at ``j`` (``_draw_box``'s ten tries, then
    the central crop) and where its numbers end (None: ``k`` numbers were not enough)."""
    area = height * width
    for _ in range(10):
        if j + 2 > k:
            return None
        target_area = area * areas[j]
        aspect_ratio = aspects[j + 1]
        j += 2
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            if j + 2 > k:
                return None
            top = _raw(low[j], mod3[j]) % (height - h + 1)
            left = _raw(low[j + 1], mod3[j + 1]) % (width - w + 1)
            return (top, left, h, w), j + 2
    return _central_box(width, height, ratio), j


#: Held by each bulk draw of boxes (``RandomResizedCrop.batch_drawer``).
_BULK_DRAWS = threading.Lock()


def _raw(low31: int, mod3: int) -> int:
    """The 32-bit number whose low 31 bits and remainder modulo 3 these are."""
    high = ((mod3 - low31) * 2) % 3  # 2**31 = 2 (mod 3), and 2 is its own inverse mod 3
    if high > 1:
        raise ArithmeticError("the generator's numbers are not what the bulk draw expects")
    return low31 | high << 31


#: How many times a probe that draws from the process's shared generators is tried (``shared_probe``).
PROBE_TRIES = 3


def shared_probe(probe: Callable[[], bool]) -> Callable[[], bool]:
    """``probe`` tried up to ``PROBE_TRIES`` times, True as soon as one try is. The probes that
    compare two ways of drawing from torch's (and Python's, numpy's) global generators share
    them with every thread of the process: a thread that draws meanwhile (a dataset read from
    several threads, whose first samples ask the question) makes a try fail, and the fast path
    was then off for the whole process. A draw from elsewhere can only make the sequences
    compared differ, never agree, so a try that passes is an answer."""

    @functools.wraps(probe)
    def tried() -> bool:
        return any(probe() for _ in range(PROBE_TRIES))

    return tried


@shared_probe
def _batch_boxes_ok() -> bool:
    """Whether ``_draw_boxes`` gives what the per-sample draws give here: several
    seeds, sizes that take every branch (and the central fallback), flip
    probabilities, and the generator's state afterwards. (Asked once per process,
    through the capabilities; the global RNG state is restored.)"""
    if torch.get_default_dtype() != torch.float32:
        return False
    state = torch.random.get_rng_state()
    try:
        crop = T.RandomResizedCrop(8)
        scale, ratio = tuple(crop.scale), tuple(crop.ratio)
        log_ratio = _log_ratio(ratio)
        shapes = [(500, 375), (375, 500), (256, 341), (64, 64), (3, 1000), (1000, 3), (1, 1), (257, 2), (2, 2)]
        for seed in range(4):
            sizes = [shapes[(seed * 7 + i * 5) % len(shapes)] for i in range(40)]
            for flip in (None, 0.5) if seed else (None, 0.5, 0.0, 1.0):
                for sc in (scale, (0.9, 1.0)):
                    torch.manual_seed(seed)
                    want = []
                    for w, h in sizes:
                        box = _draw_box(w, h, sc, ratio, log_ratio)
                        want.append((box, flip is not None and bool(torch.rand(1) < flip)))
                    after = torch.rand(2)
                    torch.manual_seed(seed)
                    boxes, flips = _draw_boxes(sizes, flip, sc, ratio, log_ratio)
                    if list(zip(boxes, flips)) != want or not torch.equal(torch.rand(2), after):
                        return False
        return True
    except ArithmeticError:
        return False
    finally:
        torch.random.set_rng_state(state)


_DRAW = threading.local()


def _draw_buffers() -> tuple[torch.Tensor, torch.Tensor]:
    buffers = getattr(_DRAW, "buffers", None)
    if buffers is None:
        buffers = _DRAW.buffers = (torch.empty(1), torch.empty(1, dtype=torch.int64))
    return buffers


@shared_probe
def _fast_boxes_ok() -> bool:
    """Whether ``_draw_box`` gives ``get_params``' boxes here: on sizes that take every
    branch, with the global RNG state restored. (Asked once per process, through
    the capabilities.)"""
    state = torch.random.get_rng_state()
    try:
        ok = True
        crop = T.RandomResizedCrop(8)
        logs = torch.log(torch.tensor(crop.ratio))
        log_ratio = (float(logs[0]), float(logs[1]))
        for seed, (w, h) in enumerate([(500, 375), (375, 500), (64, 64), (3, 1000), (1000, 3), (1, 1), (257, 2)]):
            torch.manual_seed(seed)
            shape = torch.empty((1, 1, 1), dtype=torch.uint8).expand(1, h, w)
            expected = [tuple(int(v) for v in crop.get_params(shape, list(crop.scale), list(crop.ratio)))]
            expected.append(tuple(int(v) for v in crop.get_params(shape, [0.9, 1.0], [0.5, 2.0])))
            torch.manual_seed(seed)
            got = [_draw_box(w, h, crop.scale, crop.ratio, log_ratio)]
            logs2 = torch.log(torch.tensor([0.5, 2.0]))
            got.append(_draw_box(w, h, [0.9, 1.0], [0.5, 2.0], (float(logs2[0]), float(logs2[1]))))
            ok = ok and got == expected
    finally:
        torch.random.set_rng_state(state)
    return ok

"""``MultiCrop``: the self-supervised multi-crop augmentation, N views from one decode.

A DINO / iBOT / SwAV / SimCLR training script gives its dataset an augmentation
object that makes several views of each image (DINO's ``DataAugmentationDINO``:
2 global 224 px views and 8 local 96 px ones). Through torchvision each view is
made from the whole decoded PIL image, one PIL operation at a time, so ~95 % of a
sample's CPU goes to ten crops, ten resizes and the colour operations of ten
views. ``MultiCrop`` is that augmentation, described as data (``View`` s), which an
``LMDBFolder`` runs fused (``lmdbfolder.torch.plan``):

* every random number is drawn first, with the same generators, in the same
  order and of the same kind as the torchvision ``Compose`` it replaces (so with
  the same seed the boxes, flips, jitter orders and factors, grayscale, blur radii
  and solarization are the original's);
* the JPEG is decoded once, only the rows that hold the union of the views' boxes
  (the compiled region decoder; its pixels are Pillow's);
* each view is cropped from that region and resized with Pillow's arithmetic (the
  view's interpolation, bicubic for DINO: the original's pixels; the compiled helper's
  exact resize where it reproduces the installed Pillow, else Pillow itself), straight
  into its slot of a planar batch of the views of its size;
* the photometric operations run on the views as uint8 tensors, a batch per view
  size (``lmdbfolder.torch.photometric``: Pillow's arithmetic, bit for bit), then
  ``ToTensor`` + ``Normalize`` (or uint8 output); for a DataLoader batch, into one
  batch tensor per view (``batches``, ``make(..., into=)``).

On a PIL image (``ImageFolder``) ``MultiCrop`` makes the same views from the whole
image, so it is a drop-in there too. The presets ``MultiCrop.dino``, ``.swav`` and
``.simclr`` build the original projects' pipelines, each cited by file and line.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
from PIL import Image

from lmdbfolder.errors import MissingDependencyError

try:
    import torch
    from torchvision import transforms as T
    from torchvision.transforms.functional import InterpolationMode, pil_modes_mapping
except ImportError as exc:  # a core-only install: say what to install
    raise MissingDependencyError("lmdbfolder.fused.MultiCrop", "torch", "torch and torchvision") from exc

from lmdbfolder.read.capabilities import Capabilities, current
from lmdbfolder.read.crops import Box, exact_resize_into
from lmdbfolder.torch import crop as _crop
from lmdbfolder.torch import photometric as ops
from lmdbfolder.torch.crop import RandomResizedCrop

__all__ = ["View", "MultiCrop", "ViewDraw", "Resizers", "resizers", "IMAGENET_MEAN", "IMAGENET_STD"]

#: Per interpolation, the compiled resize that gives Pillow's pixels here: ``(fn, pass order, cubic)``.
Resizers = dict[InterpolationMode, tuple[Callable[..., None], int, bool]]


def resizers(caps: Capabilities | None = None) -> Resizers:
    """The compiled resizes that reproduce the installed Pillow's here (``caps``, default
    this process's capabilities): bilinear and bicubic, each where it is built and
    checked (``Capabilities.exact_resize``, ``exact_bicubic``). A view whose
    interpolation has none is resized by Pillow (the same pixels, slower)."""
    caps = current() if caps is None else caps
    found: Resizers = {}
    bilinear, bicubic = caps.exact_resize(), caps.exact_bicubic()
    if bilinear is not None:
        found[InterpolationMode.BILINEAR] = (bilinear[0], bilinear[1], False)
    if bicubic is not None:
        found[InterpolationMode.BICUBIC] = (bicubic[0], bicubic[1], True)
    return found


_RESIZERS: dict[int, Resizers] = {}


def _process_resizers() -> Resizers:
    """``resizers()`` of this process, found once."""
    pid = os.getpid()
    if pid not in _RESIZERS:
        _RESIZERS[pid] = resizers()
    return _RESIZERS[pid]


#: torchvision's ImageNet statistics, as DINO normalizes (main_dino.py line 431).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class View:
    """One view's augmentation, in torchvision's order: ``RandomResizedCrop`` ->
    ``RandomHorizontalFlip`` -> ``RandomApply([ColorJitter], jitter_p)`` ->
    ``RandomGrayscale`` -> Gaussian blur -> solarization -> ``ToTensor`` + ``Normalize``.

    A step set to None is absent (it draws no random number); a probability, even
    0 or 1, is a step that draws its number, as the original's does.

    Args:
        size: output size (an int: square), as ``RandomResizedCrop``'s.
        scale, ratio, interpolation: ``RandomResizedCrop``'s.
        flip: ``RandomHorizontalFlip``'s ``p``.
        jitter: ``ColorJitter(brightness, contrast, saturation, hue)``'s arguments.
        jitter_p: ``RandomApply``'s ``p`` around the jitter.
        grayscale: ``RandomGrayscale``'s ``p``.
        blur: probability of Pillow's ``GaussianBlur(radius)``, the radius drawn
            uniformly in ``blur_radius`` with Python's ``random.uniform`` (DINO's and
            SwAV's ``GaussianBlur``).
        blur_radius: the radius range.
        blur_draw: what decides whether to blur: ``"python"`` (``random.random() <= p``,
            DINO's ``utils.GaussianBlur``) or ``"numpy"`` (``np.random.rand() <= p``,
            SwAV's ``PILRandomGaussianBlur``).
        solarize: probability of ``ImageOps.solarize`` (``random.random() < p``, DINO's
            ``utils.Solarization``).
        mean, std: ``Normalize``'s (after ``ToTensor``); both None: uint8 ``3 x H x W``
            output (``PILToTensor``'s).
    """

    size: int | tuple[int, int]
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0)
    interpolation: InterpolationMode = InterpolationMode.BILINEAR
    flip: float | None = 0.5
    jitter: tuple[float, float, float, float] | None = None
    jitter_p: float = 0.8
    grayscale: float | None = None
    blur: float | None = None
    blur_radius: tuple[float, float] = (0.1, 2.0)
    blur_draw: str = "python"
    solarize: float | None = None
    mean: tuple[float, ...] | None = IMAGENET_MEAN
    std: tuple[float, ...] | None = IMAGENET_STD
    _jitter: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.interpolation not in pil_modes_mapping:
            raise ValueError(f"interpolation {self.interpolation} has no Pillow filter")
        if self.blur_draw not in ("python", "numpy"):
            raise ValueError(f"blur_draw must be 'python' or 'numpy', got {self.blur_draw!r}")
        if (self.mean is None) != (self.std is None):
            raise ValueError("give both mean and std (normalized float output) or neither (uint8 output)")
        size = (self.size, self.size) if isinstance(self.size, int) else tuple(self.size)
        object.__setattr__(self, "size", size)
        # tuples, so that a view is hashable and compares by value (lists given are copied)
        for name in ("scale", "ratio", "blur_radius", "jitter", "mean", "std"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(float(v) for v in value))
        # torchvision's own checks and ranges (brightness 0.4 -> [0.6, 1.4], hue 0.1 -> [-0.1, 0.1])
        jitter = None if self.jitter is None else T.ColorJitter(*self.jitter)
        object.__setattr__(self, "_jitter", jitter)

    @property
    def out_size(self) -> tuple[int, int]:
        """``(height, width)`` of the view."""
        return self.size  # type: ignore[return-value]

    def crop(self) -> RandomResizedCrop:
        """The fused ``RandomResizedCrop`` whose boxes this view draws."""
        return RandomResizedCrop(self.size, scale=self.scale, ratio=self.ratio, interpolation=self.interpolation)


class ViewDraw(NamedTuple):
    """One view's random numbers, drawn: the box ``(top, left, height, width)`` in the
    full image, the flip, the jitter's order and four factors (None: not applied),
    grayscale, the blur radius (None: no blur) and solarization."""

    box: Box
    flip: bool
    order: tuple[int, ...]
    factors: tuple[float | None, ...]
    gray: bool
    blur: float | None
    solarize: bool


_NO_FACTORS = (None, None, None, None)


def _python_draws(view: View) -> tuple[float | None, bool]:
    """A view's blur radius (None: no blur) and solarization, from Python's (and, for
    ``blur_draw="numpy"``, numpy's) generator, as DINO's and SwAV's classes draw them."""
    radius = None
    if view.blur is not None:
        chance = random.random() if view.blur_draw == "python" else float(np.random.rand())
        if chance <= view.blur:
            radius = random.uniform(view.blur_radius[0], view.blur_radius[1])
    solar = view.solarize is not None and random.random() < view.solarize
    return radius, solar


def _pixels(region: Image.Image | np.ndarray) -> tuple[np.ndarray, Image.Image | None]:
    """A region's pixels as a C-contiguous ``H x W x 3`` array, and the PIL image it is (if one)."""
    pixels = np.asarray(region) if isinstance(region, Image.Image) else region
    if not pixels.flags.c_contiguous:
        pixels = np.ascontiguousarray(pixels)
    return pixels, region if isinstance(region, Image.Image) else None


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _f32(p: float) -> float:
    """``p`` as float32, as torch compares a float32 ``rand`` with it."""
    return float(np.float32(p))


class _BulkSpec(NamedTuple):
    """What a view draws from torch's generator, for ``_bulk_torch_draws``."""

    scale: tuple[float, float]
    ratio: tuple[float, float]
    log_ratio: tuple[float, float]
    flip: float | None  # float32 probabilities, as compared
    jitter_p: float | None  # None: no jitter step
    ranges: tuple[tuple[float, float] | None, ...]  # brightness, contrast, saturation, hue (None: not drawn)
    gray: float | None

    @classmethod
    def of(cls, view: View) -> _BulkSpec:
        jitter = view._jitter
        ranges: tuple[tuple[float, float] | None, ...] = ()
        if jitter is not None:
            ranges = tuple(
                None if r is None else (float(r[0]), float(r[1]))
                for r in (jitter.brightness, jitter.contrast, jitter.saturation, jitter.hue)
            )
        return cls(
            (float(view.scale[0]), float(view.scale[1])),
            (float(view.ratio[0]), float(view.ratio[1])),
            _crop._log_ratio(view.ratio),
            None if view.flip is None else _f32(view.flip),
            None if jitter is None else _f32(view.jitter_p),
            ranges,
            None if view.grayscale is None else _f32(view.grayscale),
        )


#: One view's torch draws: box, flip, jitter order, jitter factors, grayscale.
_TorchDraw = tuple[Box, bool, tuple[int, ...], tuple[float | None, ...], bool]


def _bulk_torch_draws(sizes: Sequence[tuple[int, int]], specs: Sequence[_BulkSpec]) -> list[list[_TorchDraw]]:
    """Every sample's views' torch draws, as ``MultiCrop.draw`` makes them one by one, drawn
    in bulk (``crop.bulk_draws``: each of those draws takes one 32-bit number from torch's CPU
    generator: float32 ``uniform_`` and ``rand``, ``random_`` below 2**32, ``randperm(4)``'s
    three swaps). Raises ArithmeticError when the numbers are not what it expects (other
    code drew)."""
    ranges = {s.scale for s in specs} | {r for s in specs for r in s.ranges if r is not None}
    per_view = 14  # the most a view draws that fits at the first try: box 4, flip, jitter 1 + 3 + 4, gray
    return _crop.bulk_draws(
        per_view * len(specs) * len(sizes) + 16,
        ranges,
        {s.log_ratio for s in specs},
        lambda streams, k: _scan_views(sizes, specs, k, streams),
    )


def _scan_views(
    sizes: Sequence[tuple[int, int]], specs: Sequence[_BulkSpec], k: int, streams: _crop.Streams
) -> tuple[list[list[_TorchDraw]], int] | None:
    """The samples' torch draws from the pre-drawn numbers, and the count used (None:
    ``k`` numbers were not enough)."""
    scan_box, raw = _crop._scan_box, _crop._raw
    low, mod3, uniform, aspects, rands = streams
    out: list[list[_TorchDraw]] = []
    j = 0
    for width, height in sizes:
        row: list[_TorchDraw] = []
        for spec in specs:
            # RandomResizedCrop's box (crop._draw_box, from the stream as crop's bulk draw reads it)
            scanned = scan_box(width, height, spec.ratio, j, k, low, mod3, uniform[spec.scale], aspects[spec.log_ratio])
            if scanned is None:
                return None
            box, j = scanned
            if j + 12 > k:  # the rest of the view's draws, at most
                return None
            flip = False
            if spec.flip is not None:
                flip = rands[j] < spec.flip
                j += 1
            order: tuple[int, ...] = ()
            factors: tuple[float | None, ...] = _NO_FACTORS
            if spec.jitter_p is not None:
                applied = not rands[j] > spec.jitter_p  # RandomApply: skipped when p < rand
                j += 1
                if applied:
                    # torch.randperm(4): Fisher-Yates, each swap position from one 32-bit number
                    perm = [0, 1, 2, 3]
                    for i in range(3):
                        z = i + raw(low[j], mod3[j]) % (4 - i)
                        perm[i], perm[z] = perm[z], perm[i]
                        j += 1
                    order = tuple(perm)
                    drawn: list[float | None] = []
                    for r in spec.ranges:
                        if r is None:
                            drawn.append(None)
                        else:
                            drawn.append(uniform[r][j])
                            j += 1
                    factors = tuple(drawn)
            gray = False
            if spec.gray is not None:
                gray = rands[j] < spec.gray
                j += 1
            row.append((box, flip, order, factors, gray))
        out.append(row)
    return out, j


class MultiCrop:
    """Several augmented views of one image, as self-supervised methods train on:
    ``MultiCrop(views)(img)`` is the list of the views, in ``views``' order.

    Put it where the method's augmentation class was: ``LMDBFolder(pack,
    transform=MultiCrop.dino())`` makes each sample's views from one region decode
    (see the module docstring); on a PIL image (``ImageFolder``) it makes the same
    views from the whole image. The random numbers are the original pipeline's
    (same generators, same order), so under the same seed both give the same views.

    Args:
        views: the views' ``View`` s (repeat one to get several of its kind).

    Example:
        >>> from lmdbfolder.fused import MultiCrop
        >>> tf = MultiCrop.dino(global_crops_scale=(0.4, 1.0), local_crops_scale=(0.05, 0.4), local_crops_number=8)
        >>> len(tf.views)
        10
    """

    def __init__(self, views: Sequence[View]) -> None:
        if not views:
            raise ValueError("MultiCrop needs at least one view")
        self.views = tuple(views)
        self._drawers: tuple[int, list[Callable[[int, int], Box]]] | None = None
        self._bulk: tuple[int, bool] | None = None  # (pid, whether draw_many draws what draw does here)

    # -- presets ---------------------------------------------------------------------------------
    @classmethod
    def dino(
        cls,
        global_crops_scale: tuple[float, float] = (0.4, 1.0),
        local_crops_scale: tuple[float, float] = (0.05, 0.4),
        local_crops_number: int = 8,
    ) -> MultiCrop:
        """DINO's ``DataAugmentationDINO`` (facebookresearch/dino ``main_dino.py`` lines
        419-464 at 7c446df; its ``utils.py`` lines 36-68 for ``GaussianBlur`` and
        ``Solarization``; the defaults are ``main_dino.py``'s arguments, lines 108-115):
        two global 224 px views (bicubic, scale ``global_crops_scale``; the first always
        blurred, the second blurred with p 0.1 and solarized with p 0.2), then
        ``local_crops_number`` local 96 px views (scale ``local_crops_scale``, blurred
        with p 0.5); every view flipped with p 0.5, ``ColorJitter(0.4, 0.4, 0.2, 0.1)``
        with p 0.8, grayscale with p 0.2, normalized with ImageNet's statistics."""
        common: dict[str, Any] = {
            "interpolation": InterpolationMode.BICUBIC,
            "flip": 0.5,
            "jitter": (0.4, 0.4, 0.2, 0.1),
            "jitter_p": 0.8,
            "grayscale": 0.2,
            "blur_radius": (0.1, 2.0),
        }
        g1 = View(224, scale=tuple(global_crops_scale), blur=1.0, **common)  # type: ignore[arg-type]
        g2 = View(224, scale=tuple(global_crops_scale), blur=0.1, solarize=0.2, **common)  # type: ignore[arg-type]
        local = View(96, scale=tuple(local_crops_scale), blur=0.5, **common)  # type: ignore[arg-type]
        return cls([g1, g2] + [local] * int(local_crops_number))

    @classmethod
    def swav(
        cls,
        size_crops: Sequence[int] = (224,),
        nmb_crops: Sequence[int] = (2,),
        min_scale_crops: Sequence[float] = (0.14,),
        max_scale_crops: Sequence[float] = (1.0,),
    ) -> MultiCrop:
        """SwAV's ``MultiCropDataset`` transforms (facebookresearch/swav
        ``src/multicropdataset.py`` lines 37-52 and 64-94 at 06b1b7c; defaults from
        ``main_swav.py`` lines 45-52): per crop size, ``nmb_crops`` views of
        ``RandomResizedCrop(size, scale=(min, max))`` (bilinear), flip p 0.5,
        ``ColorJitter(0.8, 0.8, 0.8, 0.2)`` with p 0.8, grayscale p 0.2, Pillow's
        Gaussian blur with p 0.5 (decided by ``np.random.rand()``, radius by
        ``random.uniform(0.1, 2.0)``), normalized with SwAV's std (0.228, 0.224, 0.225).
        The paper's multi-crop: ``swav((224, 96), (2, 6), (0.14, 0.05), (1.0, 0.14))``."""
        lists = (list(size_crops), list(nmb_crops), list(min_scale_crops), list(max_scale_crops))
        if len({len(x) for x in lists}) != 1:
            raise ValueError("size_crops, nmb_crops, min_scale_crops and max_scale_crops need the same length")
        views: list[View] = []
        for size, count, low, high in zip(*lists):
            view = View(
                int(size),
                scale=(float(low), float(high)),
                flip=0.5,
                jitter=(0.8, 0.8, 0.8, 0.2),
                jitter_p=0.8,
                grayscale=0.2,
                blur=0.5,
                blur_draw="numpy",
                mean=(0.485, 0.456, 0.406),
                std=(0.228, 0.224, 0.225),
            )
            views += [view] * int(count)
        return cls(views)

    @classmethod
    def simclr(cls, size: int = 224, strength: float = 1.0, views: int = 2) -> MultiCrop:
        """SimCLR's training augmentation (google-research/simclr ``data_util.py`` at
        383d414: ``crop_and_resize`` lines 304-325, bicubic, area 0.08-1, ratio 3/4-4/3;
        ``color_jitter`` lines 61-83, strength ``s``: ``ColorJitter(0.8s, 0.8s, 0.8s,
        0.2s)``; ``random_color_jitter`` lines 387-393, p 0.8 then grayscale p 0.2;
        ``random_blur`` lines 397-413, sigma 0.1-2.0, applied with p 0.5 by
        ``batch_random_blur``, line 417), output in [0, 1] (``ToTensor``, no
        ``Normalize``). In torchvision's terms, as SwAV's port of it: the jitter is
        torchvision's (not TF's), and the blur is Pillow's ``GaussianBlur(sigma)``
        (SwAV's ``PILRandomGaussianBlur``), not TF's ``size // 10`` kernel."""
        s = float(strength)
        view = View(
            int(size),
            scale=(0.08, 1.0),
            interpolation=InterpolationMode.BICUBIC,
            flip=0.5,
            jitter=(0.8 * s, 0.8 * s, 0.8 * s, 0.2 * s),
            jitter_p=0.8,
            grayscale=0.2,
            blur=0.5,
            mean=(0.0, 0.0, 0.0),
            std=(1.0, 1.0, 1.0),
        )
        return cls([view] * int(views))

    # -- drawing ---------------------------------------------------------------------------------
    def _box_drawers(self) -> list[Callable[[int, int], Box]]:
        """Each view's box drawer (``RandomResizedCrop.drawer``), made once per process."""
        made = self._drawers
        if made is None or made[0] != os.getpid():
            made = (os.getpid(), [view.crop().drawer() for view in self.views])
            self._drawers = made
        return made[1]

    def draw(self, width: int, height: int) -> list[ViewDraw]:
        """Every view's random numbers for a ``width`` x ``height`` image, drawn as the
        torchvision pipeline draws them, view after view, step after step."""
        drawers = self._box_drawers()
        rand = torch.rand
        out: list[ViewDraw] = []
        for view, draw_box in zip(self.views, drawers):
            box = draw_box(width, height)
            flip = view.flip is not None and bool(rand(1) < view.flip)
            order: tuple[int, ...] = ()
            factors: tuple[float | None, ...] = _NO_FACTORS
            jitter = view._jitter
            if jitter is not None and not view.jitter_p < rand(1):  # RandomApply: skipped when p < rand
                fn_idx, b, c, s, h = T.ColorJitter.get_params(
                    jitter.brightness, jitter.contrast, jitter.saturation, jitter.hue
                )
                order = tuple(int(i) for i in fn_idx.tolist())
                factors = (b, c, s, h)
            gray = view.grayscale is not None and bool(rand(1) < view.grayscale)
            radius, solar = _python_draws(view)
            out.append(ViewDraw(box, flip, order, factors, gray, radius, solar))
        return out

    def draw_many(self, sizes: Sequence[tuple[int, int]]) -> list[list[ViewDraw]] | None:
        """``[draw(w, h) for w, h in sizes]``, the same numbers and the same count of
        numbers consumed from each generator, with a few torch calls per batch instead
        of ~15 per view: torch's numbers are drawn in bulk, once per way a view uses
        them, from the same generator state (as ``RandomResizedCrop.batch_drawer`` draws
        boxes), and read in the order the views draw them; Python's and numpy's are
        drawn as ``draw`` draws them. None where that was not confirmed in this process
        (checked once, against ``draw``), or when other code drew from torch's generator
        meanwhile: then draw sample by sample."""
        if torch.get_default_dtype() != torch.float32 or not self._bulk_confirmed():
            return None
        return self._draw_many(sizes)

    def _draw_many(self, sizes: Sequence[tuple[int, int]]) -> list[list[ViewDraw]] | None:
        specs = [_BulkSpec.of(view) for view in self.views]
        with _crop._BULK_DRAWS:  # it puts torch's generator state back between its passes
            try:
                parts = _bulk_torch_draws(sizes, specs)
            except ArithmeticError:
                return None  # the generator's state is as before
        views = self.views
        out = []
        for sample in parts:
            row = []
            for view, (box, flip, order, factors, gray) in zip(views, sample):
                radius, solar = _python_draws(view)
                row.append(ViewDraw(box, flip, order, factors, gray, radius, solar))
            out.append(row)
        return out

    def _bulk_confirmed(self) -> bool:
        """Whether ``_draw_many`` gives ``draw``'s numbers here, for these views (checked
        once per process on sizes that take every branch, every generator's state put back)."""
        pid = os.getpid()
        if self._bulk is None or self._bulk[0] != pid:
            self._bulk = (pid, _crop.shared_probe(self._check_bulk)())
        return self._bulk[1]

    def _check_bulk(self) -> bool:
        shapes = [(500, 375), (375, 500), (256, 341), (64, 64), (3, 1000), (1000, 3), (1, 1), (257, 2), (2, 2)]
        states = (torch.random.get_rng_state(), random.getstate(), np.random.get_state())
        try:
            for seed in range(3):
                sizes = [shapes[(seed * 7 + i * 5) % len(shapes)] for i in range(12)]
                _seed_all(seed)
                want = [self.draw(w, h) for w, h in sizes]
                after = (torch.rand(2).tolist(), random.random(), float(np.random.rand()))
                _seed_all(seed)
                got = self._draw_many(sizes)
                if got != want or (torch.rand(2).tolist(), random.random(), float(np.random.rand())) != after:
                    return False
            return True
        except ArithmeticError:
            return False
        finally:
            torch.random.set_rng_state(states[0])
            random.setstate(states[1])
            np.random.set_state(states[2])

    @staticmethod
    def union(draws: Sequence[ViewDraw]) -> Box:
        """The smallest box ``(top, left, height, width)`` that holds every view's box."""
        top = min(d.box[0] for d in draws)
        left = min(d.box[1] for d in draws)
        bottom = max(d.box[0] + d.box[2] for d in draws)
        right = max(d.box[1] + d.box[3] for d in draws)
        return top, left, bottom - top, right - left

    # -- making the views ------------------------------------------------------------------------
    def make(
        self,
        region: Image.Image | np.ndarray,
        top: int,
        left: int,
        draws: Sequence[ViewDraw],
        resizers: Resizers | None = None,
        into: Sequence[torch.Tensor] | None = None,
        at: int = 0,
    ) -> list[Any]:
        """The views, from ``region``: the pixels of the full image from row ``top``,
        column ``left`` on (an ``H x W x 3`` uint8 array or an RGB PIL image) that hold
        every view's box; ``draws`` from ``draw``. Each view is cropped and resized into
        its slot of a planar uint8 batch of the views of its size, mirrored if drawn so:
        by the compiled resize where ``resizers`` (``resizers()``; default this process's)
        has one for its interpolation that gives Pillow's pixels, else by Pillow.

        ``into`` (``batches``: one batch tensor per view): view ``k`` is written into
        ``into[k][at]`` and the views returned are those slots."""
        if resizers is None:
            resizers = _process_resizers()
        if into is not None:
            self.make_many([(region, top, left, draws)], lambda sample: sample, into, at, resizers)
            return [into[k][at] for k in range(len(self.views))]
        pixels, img = _pixels(region)
        out: list[Any] = [None] * len(self.views)
        for (size, mean, std), members in self._groups().items():
            out_h, out_w = size
            batch = torch.empty((len(members), 3, out_h, out_w), dtype=torch.uint8)
            planes = batch.numpy()
            for j, k in enumerate(members):
                img = self._resize_into(planes[j], pixels, img, top, left, k, draws[k], resizers)
            result = self.photometric(batch, [draws[k] for k in members], inplace=True)
            if mean is not None:
                result = ops.normalize(result, mean, std)  # type: ignore[arg-type]
            for j, k in enumerate(members):
                out[k] = result[j]
        return out

    def make_many(
        self,
        samples: Sequence[Any],
        load: Callable[[Any], tuple[Image.Image | np.ndarray, int, int, Sequence[ViewDraw]]],
        into: Sequence[torch.Tensor],
        at: int = 0,
        resizers: Resizers | None = None,
    ) -> None:
        """``make(*load(samples[i]), resizers, into=into, at=at + i)`` for each sample, the
        photometric operations run once per view size over all of them (a few calls for
        several samples: the same values, each image with its own parameters). Each
        sample's region is loaded (``load``: ``(region, top, left, draws)``) and resized
        from, then let go, before the next is loaded."""
        if resizers is None:
            resizers = _process_resizers()
        count = len(samples)
        groups: list[tuple[list[int], Any, Any, torch.Tensor, np.ndarray, list[ViewDraw]]] = []
        for (size, mean, std), members in self._groups().items():
            batch = torch.empty((count * len(members), 3, *size), dtype=torch.uint8)
            groups.append((members, mean, std, batch, batch.numpy(), []))
        for i, sample in enumerate(samples):
            region, top, left, draws = load(sample)
            pixels, img = _pixels(region)
            for members, _, _, _, planes, flat in groups:
                base = i * len(members)
                for j, k in enumerate(members):
                    img = self._resize_into(planes[base + j], pixels, img, top, left, k, draws[k], resizers)
                    flat.append(draws[k])
            del region, pixels, img
        for members, mean, std, batch, _, flat in groups:
            result = self.photometric(batch, flat, inplace=True)
            norm = None if mean is None else self._normalizer(mean, std)
            m = len(members)
            for i in range(count):
                for j, k in enumerate(members):
                    slot = into[k][at + i : at + i + 1]
                    if norm is not None:
                        norm(result[i * m + j : i * m + j + 1], slot)
                    else:
                        slot.copy_(result[i * m + j : i * m + j + 1])

    def _resize_into(
        self,
        plane: np.ndarray,
        pixels: np.ndarray,
        img: Image.Image | None,
        top: int,
        left: int,
        k: int,
        d: ViewDraw,
        resizers: Resizers,
    ) -> Image.Image | None:
        """View ``k``'s crop of the region, resized (and mirrored if drawn so) into ``plane``
        (planar ``3 x H x W``): by the compiled resize where ``resizers`` has one for its
        interpolation that gives Pillow's pixels, else by Pillow (``img``: the region as a
        PIL image, made here the first time it is needed; returned)."""
        view = self.views[k]
        out_h, out_w = view.out_size
        t, x, h, w = d.box
        box = (x - left, t - top, x - left + w, t - top + h)
        found = resizers.get(view.interpolation)
        if found is not None:
            fn, order, cubic = found
            if exact_resize_into(fn, order, pixels, box, (out_w, out_h), plane, planar=True, flip=d.flip, cubic=cubic):
                return img
        if img is None:
            img = Image.fromarray(pixels, "RGB")
        resized = img.crop(box).resize((out_w, out_h), pil_modes_mapping[view.interpolation])
        if d.flip:
            resized = resized.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        plane[...] = np.asarray(resized).transpose(2, 0, 1)
        return img

    def batches(self, count: int) -> list[torch.Tensor]:
        """Empty batch tensors for ``count`` samples, one per view (``count x 3 x H x W``:
        float32 for a normalized view, uint8 otherwise), for ``make(..., into=)``."""
        return [torch.empty(tuple(shape), dtype=dtype) for dtype, shape in self.batch_specs(count)]

    def batch_specs(self, count: int) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        """``(dtype, shape)`` of each view's batch tensor for ``count`` samples (as
        ``batches`` makes them; ``transport.BatchPool.take_many`` takes these)."""
        return [
            (torch.uint8 if view.mean is None else torch.float32, (count, 3, *view.out_size)) for view in self.views
        ]

    def _groups(self) -> dict[tuple[Any, ...], list[int]]:
        """The views by (size, mean, std): each group is made as one batch (found once)."""
        found = self.__dict__.get("_groups_found")
        if found is not None and found[0] is self.views:  # views given anew: found again
            return found[1]
        groups: dict[tuple[Any, ...], list[int]] = {}
        for k, view in enumerate(self.views):
            groups.setdefault((view.out_size, view.mean, view.std), []).append(k)
        self.__dict__["_groups_found"] = (self.views, groups)
        return groups

    def _normalizer(self, mean: tuple[float, ...], std: tuple[float, ...]) -> Any:
        """``photometric.normalizer(mean, std)``, made once per process."""
        found = self.__dict__.setdefault("_normalizers", {})
        key = (os.getpid(), mean, std)
        norm = found.get(key)
        if norm is None:
            norm = found[key] = ops.normalizer(mean, std)
        return norm

    @staticmethod
    def photometric(batch: torch.Tensor, draws: Sequence[ViewDraw], *, inplace: bool = False) -> torch.Tensor:
        """Jitter, grayscale, blur and solarization of a uint8 ``N x 3 x H x W`` batch
        (any device), image ``k`` with ``draws[k]``' parameters (``inplace``: in ``batch``
        itself where the operations can)."""
        x = batch.contiguous()
        if x.data_ptr() == batch.data_ptr() and not inplace:
            x = x.clone()  # one copy of the batch, then every operation in place in it
        if any(d.order for d in draws):
            x = ops.color_jitter(x, [d.order for d in draws], [d.factors for d in draws], inplace=True)
        if any(d.gray for d in draws):
            x = ops.grayscale(x, [d.gray for d in draws], inplace=True)
        if any(d.blur is not None for d in draws):
            x = ops.gaussian_blur(x, [0.0 if d.blur is None else d.blur for d in draws], inplace=True)
        if any(d.solarize for d in draws):
            x = ops.solarize(x, 128, [d.solarize for d in draws], inplace=True)
        return x

    def __call__(self, img: Image.Image) -> list[Any]:
        """The views of a PIL image (what ``ImageFolder`` gives)."""
        if not isinstance(img, Image.Image):
            raise TypeError(f"MultiCrop takes a PIL image, got {type(img).__name__}")
        if img.mode != "RGB":
            img = img.convert("RGB")
        width, height = img.size
        return self.make(img, 0, 0, self.draw(width, height))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_drawers"] = None  # closures of this process: made again where it is unpickled
        state.pop("_normalizers", None)
        return state

    def __repr__(self) -> str:
        lines = ",\n    ".join(repr(v) for v in self.views)
        return f"{type(self).__name__}([\n    {lines}\n])"

"""Crop-and-resize arithmetic for reduced-size decoding (no torch needed).

A crop box is ``(top, left, height, width)`` in the pixels of the full-size
image, as torchvision's ``RandomResizedCrop.get_params`` returns it. When a
JPEG is decoded at DCT scale ``1/denom``, the same box covers
``box * (decoded size / full size)`` of the smaller image; ``crop_scale``
picks the largest ``denom`` for which that region still has at least the
output's pixels, so the final resize never upsamples more than the unfused
transform would.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable

import numpy as np
from PIL import Image

__all__ = [
    "Box",
    "thread_buffer",
    "crop_scale",
    "scaled_box",
    "resize_region",
    "exact_resize_into",
    "opencv_resize_into",
    "native_resize_into",
    "whole_pixel_box",
    "pillow_pass_order",
    "native_matches_pillow",
    "RESIZE_BACKENDS",
    "NATIVE_MISSING",
]

#: ``(top, left, height, width)`` in full-size pixels.
Box = tuple[int, int, int, int]
#: ``pil``: Pillow's resampling (the unfused transform's, bit-exact at full
#: scale); ``opencv``: ``cv2.resize`` (INTER_AREA when shrinking by 2x or
#: more, else INTER_LINEAR), several times faster, not bit-exact; ``native``:
#: lmdbfolder's compiled bilinear (OpenCV's INTER_LINEAR geometry, 8-bit
#: weights: within one grey level of it), which lets a whole batch be made
#: without the GIL (``_crops.Batch``).
RESIZE_BACKENDS = ("pil", "opencv", "native")
#: Why ``resize="native"`` cannot run here, and what to do (an ImportError's message).
NATIVE_MISSING = (
    "resize='native' needs lmdbfolder's compiled helper (lmdbfolder.read._crops), which was not built here: "
    "install the libjpeg headers (apt-get install libjpeg-dev, or `make system-deps`) and reinstall lmdbfolder, "
    "or use resize='opencv'"
)


def crop_scale(crop_height: int, crop_width: int, out_height: int, out_width: int, scales: tuple[int, ...]) -> int:
    """Largest ``denom`` in ``scales`` with ``crop / denom >= out`` in both dimensions (at least 1)."""
    best = 1
    for denom in scales:
        if denom > best and crop_width >= out_width * denom and crop_height >= out_height * denom:
            best = denom
    return best


def scaled_box(box: Box, full: tuple[int, int], decoded: tuple[int, int]) -> tuple[float, float, float, float]:
    """``box`` in the coordinates of an image decoded at ``decoded`` = (width, height)
    instead of ``full``: ``(left, upper, right, lower)`` as floats (Pillow's box order)."""
    top, left, height, width = box
    fx = decoded[0] / full[0]
    fy = decoded[1] / full[1]
    return (left * fx, top * fy, (left + width) * fx, (top + height) * fy)


def resize_region(
    pixels: np.ndarray | Image.Image,
    box: tuple[float, float, float, float],
    size: tuple[int, int],
    *,
    resample: int = Image.Resampling.BILINEAR,
) -> Image.Image:
    """Crop ``box`` (left, upper, right, lower; floats allowed) out of ``pixels``
    and resize it to ``size`` = (width, height) with Pillow; returns an RGB PIL image.

    With an integer box this is exactly ``img.crop(box).resize(size, resample)``,
    i.e. what torchvision's ``resized_crop`` does to a PIL image.
    """
    x0, y0, x1, y1 = box
    ix0, iy0 = max(0, math.floor(x0)), max(0, math.floor(y0))
    if isinstance(pixels, Image.Image):
        w, h = pixels.size
    else:
        h, w = pixels.shape[:2]
    ix1, iy1 = min(w, math.ceil(x1)), min(h, math.ceil(y1))
    if isinstance(pixels, Image.Image):
        region = pixels.crop((ix0, iy0, ix1, iy1))
    else:
        region = _region_image(pixels, ix0, iy0, ix1, iy1)
    inner = (x0 - ix0, y0 - iy0, x1 - ix0, y1 - iy0)
    if inner == (0, 0, ix1 - ix0, iy1 - iy0):
        return region.resize(size, resample)
    return region.resize(size, resample, box=inner)


_SCRATCH = threading.local()
#: The smallest per-thread buffer ``thread_buffer`` makes (bytes).
_BUFFER_START = 1 << 20


def thread_buffer(local: threading.local, name: str, need: int) -> np.ndarray:
    """This thread's flat uint8 buffer ``name`` on ``local``, of at least ``need``
    bytes: made at 1 MiB (or ``need``) and replaced by a larger one when it is too
    small, so a decode or resize allocates (and page-faults) only while sizes grow."""
    buf = getattr(local, name, None)
    if buf is None or buf.size < need:
        buf = np.empty(max(need, _BUFFER_START), np.uint8)
        setattr(local, name, buf)
    return buf


def pillow_pass_order() -> int | None:
    """Which of its two passes the installed Pillow's bilinear resize runs first:
    0, always the horizontal one (Pillow <= 12); 1, the vertical one when the height
    shrinks by more than twice as many pixels as the width (Pillow 13); None, neither
    (another algorithm: nothing here then claims Pillow's pixels).

    Pillow only: a two-pass resize equals two one-pass resizes in its order (each
    pass rounds to 8 bits), and a tall image shrunk more in height tells them apart.
    Read from the behaviour, not a version number.
    """
    src = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 5, 3), dtype=np.uint8), "RGB")
    bilinear = Image.Resampling.BILINEAR
    want = np.asarray(src.resize((3, 9), bilinear))
    vertical = np.asarray(src.resize((5, 9), bilinear).resize((3, 9), bilinear))
    horizontal = np.asarray(src.resize((3, 40), bilinear).resize((3, 9), bilinear))
    if np.array_equal(want, vertical) and not np.array_equal(want, horizontal):
        return 1
    if np.array_equal(want, horizontal):
        return 0
    return None


def native_matches_pillow(fn: Callable[..., None], order: int, *, cubic: bool = False) -> bool:
    """Whether the compiled resize ``fn`` run with pass ``order`` reproduces the
    installed Pillow's ``crop(box).resize(size, BILINEAR)`` (``BICUBIC`` with ``cubic``)
    on boxes that take every branch: both passes in either order, one pass, none,
    upscaling."""
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, (97, 131, 3), dtype=np.uint8)
    # (left, width, height, out_w, out_h)
    cases = [(3, 120, 97, 119, 31), (0, 131, 97, 40, 90), (5, 101, 60, 101, 60), (0, 131, 97, 131, 20)]
    cases += [(9, 37, 25, 224, 224), (0, 1, 1, 3, 2), (2, 70, 97, 33, 97), (0, 131, 90, 128, 7)]
    try:
        return all(
            np.array_equal(
                _resize(fn, order, src, (left, 0, left + w, h), (ow, oh), cubic),
                _pil(src, left, w, h, ow, oh, cubic),
            )
            for left, w, h, ow, oh in cases
        )
    except Exception:  # a helper that fails on a valid image does not match either
        return False


def _pil(
    src: np.ndarray, left: int, width: int, height: int, out_w: int, out_h: int, cubic: bool = False
) -> np.ndarray:
    crop = Image.fromarray(np.ascontiguousarray(src[:height, left : left + width]), "RGB")
    resample = Image.Resampling.BICUBIC if cubic else Image.Resampling.BILINEAR
    return np.asarray(crop.resize((out_w, out_h), resample))


def _resize(
    fn: Callable[..., None],
    order: int,
    src: np.ndarray,
    box: tuple[int, int, int, int],
    size: tuple[int, int],
    cubic: bool = False,
) -> np.ndarray:
    out = np.empty((size[1], size[0], 3), np.uint8)
    _call(fn, order, src, box, size, out, planar=False, flip=False, cubic=cubic)
    return out


def _call(
    fn: Callable[..., None],
    order: int,
    src: np.ndarray,
    box: tuple[int, int, int, int],
    size: tuple[int, int],
    dst: np.ndarray,
    *,
    planar: bool,
    flip: bool,
    cubic: bool = False,
) -> None:
    left, top, right, bottom = box
    width, height = right - left, bottom - top
    tmp = thread_buffer(_SCRATCH, "tmp", 3 * max(size[0] * height, width * size[1]))
    rows = src[top:bottom]
    if cubic:
        fn(rows, src.shape[1], left, width, height, size[0], size[1], dst, tmp, planar, flip, order, True)
    else:
        fn(rows, src.shape[1], left, width, height, size[0], size[1], dst, tmp, planar, flip, order)


def exact_resize_into(
    fn: Callable[..., None],
    order: int,
    pixels: np.ndarray,
    box: tuple[float, float, float, float],
    size: tuple[int, int],
    dst: np.ndarray,
    *,
    planar: bool = False,
    flip: bool = False,
    cubic: bool = False,
) -> bool:
    """Resize the whole-pixel ``box`` (left, upper, right, lower) of the ``H x W x 3``
    uint8 array ``pixels`` to ``size`` = (width, height) exactly as
    ``Image.crop(box).resize(size, BILINEAR)`` (``BICUBIC`` with ``cubic``) does, into ``dst`` (``H x W x 3``,
    or with ``planar`` its ``3 x H x W`` planes; mirrored with ``flip``, as
    ``RandomHorizontalFlip`` mirrors), with the compiled resize ``fn`` and
    Pillow's pass ``order`` (``Capabilities.exact_resize`` gives both, where they
    reproduce the installed Pillow). Returns False, having written nothing, when
    the arguments are not a case it takes (a fractional box, a non-contiguous
    array, a box outside the image); the caller then uses Pillow.

    It reads the crop in place and writes straight into ``dst``: the copies into
    and out of a PIL image, and the flip's and the planes' copies, are not made.
    """
    if pixels.ndim != 3 or pixels.shape[2] != 3 or pixels.dtype != np.uint8 or not pixels.flags.c_contiguous:
        return False
    left, top, right, bottom = box
    if not (float(left).is_integer() and float(top).is_integer() and float(right).is_integer()):
        return False
    if not float(bottom).is_integer():
        return False
    h, w = pixels.shape[:2]
    ibox = (int(left), int(top), int(right), int(bottom))
    if not (0 <= ibox[0] < ibox[2] <= w and 0 <= ibox[1] < ibox[3] <= h):
        return False
    if not dst.flags.c_contiguous or dst.dtype != np.uint8 or dst.size != 3 * size[0] * size[1]:
        return False
    _call(fn, order, pixels, ibox, size, dst, planar=planar, flip=flip, cubic=cubic)
    return True


def _region_image(pixels: np.ndarray, x0: int, y0: int, x1: int, y1: int) -> Image.Image:
    """The RGB PIL image of ``pixels[y0:y1, x0:x1]``, read in one pass.

    Pillow's raw decoder takes a row stride, so the crop is unpacked straight
    from the full image's rows (one copy of the crop, into Pillow's own
    layout) instead of first being made contiguous and then copied again.
    """
    height, width = pixels.shape[:2]
    if pixels.ndim != 3 or pixels.shape[2] != 3 or pixels.strides[1:] != (3, 1) or x1 <= x0 or y1 <= y0:
        return Image.fromarray(np.ascontiguousarray(pixels[y0:y1, x0:x1]), "RGB")
    row = pixels.strides[0]
    start = y0 * row + x0 * 3
    flat = pixels.reshape(-1) if pixels.flags.c_contiguous else None
    if flat is None:
        return Image.fromarray(np.ascontiguousarray(pixels[y0:y1, x0:x1]), "RGB")
    end = (y1 - 1) * row + x1 * 3
    return Image.frombuffer("RGB", (x1 - x0, y1 - y0), flat[start:end], "raw", "RGB", row, 1)


def whole_pixel_box(box: tuple[float, float, float, float], width: int, height: int) -> tuple[int, int, int, int]:
    """``box`` (left, upper, right, lower) rounded to whole pixels inside a ``width`` x
    ``height`` image, at least one pixel each way: the box the ``opencv`` and ``native``
    resizes take."""
    x0, y0, x1, y1 = box
    rx0, ry0 = min(max(0, round(x0)), width - 1), min(max(0, round(y0)), height - 1)
    rx1, ry1 = max(rx0 + 1, min(width, round(x1))), max(ry0 + 1, min(height, round(y1)))
    return rx0, ry0, rx1, ry1


def _covering_box(box: tuple[float, float, float, float], width: int, height: int) -> tuple[int, int, int, int]:
    """The whole pixels that hold ``box`` (left, upper, right, lower), inside the image."""
    x0, y0, x1, y1 = box
    rx0, ry0 = min(max(0, math.floor(x0)), width - 1), min(max(0, math.floor(y0)), height - 1)
    rx1, ry1 = max(rx0 + 1, min(width, math.ceil(x1))), max(ry0 + 1, min(height, math.ceil(y1)))
    return rx0, ry0, rx1, ry1


def _window(box: tuple[float, float, float, float], pixels: tuple[int, int, int, int]) -> tuple[float, ...]:
    """``box`` as (x, y, width, height) inside the whole ``pixels`` that hold it, clipped to them."""
    x0, y0, x1, y1 = box
    px0, py0, px1, py1 = pixels
    left, top = min(max(x0 - px0, 0.0), px1 - px0), min(max(y0 - py0, 0.0), py1 - py0)
    right, bottom = min(max(x1 - px0, left), px1 - px0), min(max(y1 - py0, top), py1 - py0)
    if right - left <= 0 or bottom - top <= 0:  # a box thinner than a pixel at the edge
        return (0.0, 0.0, float(px1 - px0), float(py1 - py0))
    return (float(left), float(top), float(right - left), float(bottom - top))


def native_resize_into(
    fn: Callable[..., None],
    pixels: np.ndarray,
    box: tuple[float, float, float, float],
    size: tuple[int, int],
    dst: np.ndarray,
    *,
    planar: bool,
    flip: bool,
    work: np.ndarray | None = None,
) -> None:
    """The ``native`` resize backend for one image: ``box`` (left, upper, right, lower;
    floats: a box scaled to an image decoded at a reduced DCT scale) of the ``H x W x
    3`` uint8 array ``pixels`` resized to ``size`` = (width, height) by the compiled
    bilinear ``fn`` (``_crops.resize_native``), mirrored with ``flip``, into ``dst``:
    its ``3 x H x W`` planes with ``planar``, else ``H x W x 3`` through ``work``
    (``3 x H x W`` scratch). The output covers the box itself, fractions of a pixel
    included (torchvision's geometry; rounding it to whole pixels moved a reduced
    crop by up to a third of an output pixel); for a whole-pixel box, the same
    pixels as ``_crops.Batch``."""
    h, w = pixels.shape[:2]
    x0, y0, x1, y1 = _covering_box(box, w, h)
    rows = np.ascontiguousarray(pixels[y0:y1])
    out = dst if planar else (work if work is not None else np.empty((3, size[1], size[0]), np.uint8))
    window = _window(box, (x0, y0, x1, y1))
    fn(rows, w, x0, x1 - x0, y1 - y0, size[0], size[1], out, flip, window)
    if not planar:
        np.copyto(dst, out.transpose(1, 2, 0))


def opencv_resize_into(
    cv2: Any,
    pixels: np.ndarray,
    box: tuple[float, float, float, float],
    size: tuple[int, int],
    dst: np.ndarray | None,
) -> np.ndarray:
    """The ``opencv`` resize backend: ``box`` (left, upper, right, lower) rounded to
    whole pixels, ``cv2.resize`` (INTER_AREA when shrinking 2x or more, else
    INTER_LINEAR) into ``dst`` (an HxWx3 uint8 array, e.g. one image of a batch) or a
    new array; returns it. ``cv2``: the module (``Capabilities.cv2`` gives it, set
    to one thread).

    The crop is a view of ``pixels`` (no copy): OpenCV reads its rows in place.
    """
    h, w = pixels.shape[:2]
    rx0, ry0, rx1, ry1 = whole_pixel_box(box, w, h)
    part = pixels[ry0:ry1, rx0:rx1]
    # INTER_AREA only from a factor of 2 down: at fractional factors OpenCV's
    # area filter took ~8x the time of a bilinear resize (0.8 ms for 400x300 ->
    # 224x224, measured), while bilinear below 2x aliases little. Larger
    # factors are mostly taken by the DCT-scaled decode before this.
    shrink = part.shape[1] >= 2 * size[0] and part.shape[0] >= 2 * size[1]
    interpolation = cv2.INTER_AREA if shrink else cv2.INTER_LINEAR
    if dst is None:
        return cv2.resize(part, size, interpolation=interpolation)
    cv2.resize(part, size, dst=dst, interpolation=interpolation)
    return dst

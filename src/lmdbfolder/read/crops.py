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
from typing import Any

import numpy as np
from PIL import Image

__all__ = ["Box", "crop_scale", "scaled_box", "resize_region", "RESIZE_BACKENDS"]

#: ``(top, left, height, width)`` in full-size pixels.
Box = tuple[int, int, int, int]
#: ``pil``: Pillow's resampling (the unfused transform's, bit-exact at full
#: scale); ``opencv``: ``cv2.resize`` (INTER_AREA when shrinking, else
#: INTER_LINEAR), several times faster, not bit-exact.
RESIZE_BACKENDS = ("pil", "opencv")


_CV2: Any = None


def _cv2() -> Any:
    # OpenCV's own thread pool costs more than it gains on crop-sized images and
    # fights the DataLoader's worker processes for the cores: one thread.
    global _CV2
    if _CV2 is None:
        import cv2

        cv2.setNumThreads(1)
        _CV2 = cv2
    return _CV2


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
    backend: str = "pil",
    as_array: bool = False,
) -> Image.Image | np.ndarray:
    """Crop ``box`` (left, upper, right, lower; floats allowed) out of ``pixels``
    and resize it to ``size`` = (width, height); returns an RGB PIL image
    (or, with ``as_array``, possibly an HxWx3 uint8 array, which saves a copy).

    With the ``pil`` backend and an integer box this is exactly
    ``img.crop(box).resize(size, resample)``, i.e. what torchvision's
    ``resized_crop`` does to a PIL image.
    """
    x0, y0, x1, y1 = box
    ix0, iy0 = max(0, math.floor(x0)), max(0, math.floor(y0))
    if backend == "opencv":
        cv2 = _cv2()

        arr = np.asarray(pixels)
        h, w = arr.shape[:2]
        rx0, ry0 = min(max(0, round(x0)), w - 1), min(max(0, round(y0)), h - 1)
        rx1, ry1 = max(rx0 + 1, min(w, round(x1))), max(ry0 + 1, min(h, round(y1)))
        part = arr[ry0:ry1, rx0:rx1]
        shrink = part.shape[1] >= size[0] and part.shape[0] >= size[1]
        out = cv2.resize(part, size, interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)
        return out if as_array else Image.fromarray(out, "RGB")
    if backend != "pil":
        raise ValueError(f"resize backend must be one of {RESIZE_BACKENDS}, got {backend!r}")
    if isinstance(pixels, Image.Image):
        w, h = pixels.size
    else:
        h, w = pixels.shape[:2]
    ix1, iy1 = min(w, math.ceil(x1)), min(h, math.ceil(y1))
    if isinstance(pixels, Image.Image):
        region = pixels.crop((ix0, iy0, ix1, iy1))
    else:
        region = Image.fromarray(np.ascontiguousarray(pixels[iy0:iy1, ix0:ix1]), "RGB")
    inner = (x0 - ix0, y0 - iy0, x1 - ix0, y1 - iy0)
    if inner == (0, 0, ix1 - ix0, iy1 - iy0):
        return region.resize(size, resample)
    return region.resize(size, resample, box=inner)

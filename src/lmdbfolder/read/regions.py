"""Decode only the region of a JPEG that a crop covers, with the full decode's pixels.

Under ``RandomResizedCrop`` a full-resolution JPEG is decoded whole and then
mostly thrown away: the crop covers about half of the image on average. The
compiled helper ``lmdbfolder.read._crops`` (libjpeg's partial decode,
built from ``setup.py`` when the system libjpeg headers are there) decodes
the crop's rows only, skips the rows below it entirely and the inverse DCT
and colour conversion of the columns outside it: about a quarter less time per
image on ImageNet-like photos (see docs/design.md).

Exactness is a fact checked here, not an assumption: before the first region
is used in a process, the helper decodes regions of the probe JPEGs of
``decoders`` (every subsampling, progressive, restart markers, greyscale, odd
sizes; boxes touching every edge) and each must equal Pillow's full decode,
cropped, bit for bit. If one does not, or the helper is not built, every
image is decoded whole, as before.

``LMDBFOLDER_REGIONS=0`` in the environment turns region decoding off (for
troubleshooting, and to measure what it saves: ``benchmarks/bench_peers.py``
runs the default both ways).

A JPEG is only decoded by region when it ends with its end-of-image marker
and libjpeg decodes the rows up to the crop's bottom without a warning;
anything else (a truncated or damaged file, which ImageFolder would fail on or
decode past) is decoded whole by the usual decoder, so it ends as it does in
ImageFolder.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

import numpy as np

from lmdbfolder.read.crops import Box, thread_buffer

__all__ = ["ENV_SWITCH", "region_decoding", "regions_apply", "decode_crop", "decode_region", "region_available"]

#: The environment variable that turns region decoding off when it is "0".
ENV_SWITCH = "LMDBFOLDER_REGIONS"

_EOI = b"\xff\xd9"
_STATE: dict[str, Any] = {}
_LOCAL = threading.local()


def _helper() -> Callable[..., tuple[int, int]] | None:
    """The compiled ``decode_region``, or None when it is not built here."""
    if "helper" not in _STATE:
        try:
            from lmdbfolder.read import _crops  # type: ignore[attr-defined]

            _STATE["helper"] = _crops.decode_region
        except ImportError:
            _STATE["helper"] = None
    return _STATE["helper"]


def region_available() -> str | None:
    """None when region decoding works in this process, else why not (one line)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"{ENV_SWITCH}=0 in the environment"
    if _helper() is None:
        return (
            "the compiled helper lmdbfolder.read._crops is not built (it needs a C compiler and the "
            "libjpeg headers at install time: apt-get install libjpeg-dev, then reinstall lmdbfolder)"
        )
    if not region_decoding():
        return "the helper's regions differ from Pillow's full decode here (checked on probe JPEGs)"
    return None


def region_decoding() -> bool:
    """Whether regions may be decoded in this process: the helper is built and its
    regions of every probe JPEG equal Pillow's (checked once per process)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    ok = _STATE.get("ok")
    if ok is None:
        ok = _STATE["ok"] = _helper() is not None and _matches_pillow()
    return bool(ok)


def regions_apply(decoder_name: str) -> bool:
    """Whether crops decoded with the decoder ``decoder_name`` are decoded by region
    here: with any decoder but ``"pillow"`` (the whole-image Pillow path, kept as
    it is), when ``region_decoding()``."""
    return decoder_name != "pillow" and region_decoding()


def _probe_boxes(width: int, height: int) -> list[Box]:
    """Boxes ``(top, left, height, width)`` that touch every edge and none."""
    boxes = [(0, 0, height, width), (height - 1, width - 1, 1, 1), (0, width - 1, height, 1)]
    if width > 2 and height > 2:
        boxes += [(1, 1, height - 2, width - 2), (height // 3, width // 3, height // 2, width // 2)]
    if width > 17:
        boxes += [(0, 17, height, width - 17), (height // 2, 15, height - height // 2, 3)]
    return boxes


def _matches_pillow() -> bool:
    from lmdbfolder.read.decoders import _probe_jpegs

    try:
        for data, expected in _probe_jpegs():
            height, width = expected.shape[:2]
            for box in _probe_boxes(width, height):
                got = _decode(data, box, width)
                top, left, h, w = box
                if got is None:
                    return False
                pixels, offset = got
                if not np.array_equal(pixels[:, offset : offset + w], expected[top : top + h, left : left + w]):
                    return False
    except Exception:  # a helper that fails on a valid JPEG does not match either
        return False
    return True


def _decode(payload: memoryview | bytes, box: Box, image_width: int) -> tuple[np.ndarray, int] | None:
    helper = _helper()
    if helper is None or bytes(payload[-2:]) != _EOI:
        return None
    top, left, height, width = box
    buf = thread_buffer(_LOCAL, "buf", 3 * image_width * height)  # the region's rows are at most the image's width
    try:
        x0, w0 = helper(payload, left, top, width, height, buf)
    except ValueError:
        return None  # damaged, or a kind libjpeg refuses: the caller decodes it whole
    return buf[: 3 * w0 * height].reshape(height, w0, 3), left - x0


def decode_region(
    payload: memoryview | bytes, box: Box, image_width: int
) -> tuple[np.ndarray, tuple[int, int, int, int]] | None:
    """Decode the rows of ``box`` = ``(top, left, height, width)`` of a 1- or
    3-component JPEG whose header says it is ``image_width`` pixels wide.

    Returns ``(pixels, inner)``: an ``height x W x 3`` uint8 RGB array (a view
    of a per-thread buffer, valid until this thread's next call) holding the
    box's rows and at least its columns, and the box within it as Pillow's
    ``(left, upper, right, lower)``. Returns None when the image should be
    decoded whole instead: region decoding is off here (``region_decoding``),
    or the JPEG is truncated, damaged, or not one libjpeg decodes to RGB.
    """
    if not region_decoding():
        return None
    return _region(payload, box, image_width)


def _region(
    payload: memoryview | bytes, box: Box, image_width: int
) -> tuple[np.ndarray, tuple[int, int, int, int]] | None:
    got = _decode(payload, box, image_width)
    if got is None:
        return None
    pixels, offset = got
    height, width = box[2], box[3]
    return pixels, (offset, 0, offset + width, height)


def decode_crop(
    payload: memoryview | bytes,
    encoding: str,
    channels: int,
    box: Box,
    image_width: int,
    denom: int,
    decoder_name: str,
) -> tuple[np.ndarray, tuple[int, int, int, int]] | None:
    """``decode_region`` for a crop of a stored image, where it applies: a 1- or
    3-component JPEG decoded at full scale (``denom`` 1) with a decoder for which
    ``regions_apply``. None means: decode the image whole, as before."""
    if denom != 1 or encoding != "jpeg" or channels not in (1, 3) or not regions_apply(decoder_name):
        return None
    return _region(payload, box, image_width)

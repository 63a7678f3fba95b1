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
cropped, bit for bit (``matches_pillow``). If one does not, or the helper is
not built, every image is decoded whole, as before. The question is asked
once per process by ``lmdbfolder.read.capabilities`` (``region_decoder``,
and ``why_no_regions`` says why not); the per-record decode is
``lmdbfolder.encodings.Jpeg.region``.

``LMDBFOLDER_REGIONS=0`` in the environment turns region decoding off (for
troubleshooting, and to measure what it saves: ``benchmarks/bench_peers.py``
runs the default both ways). It is read once per process, when the
capabilities are first asked for.

A JPEG is only decoded by region when it ends with its end-of-image marker
and libjpeg decodes the rows up to the crop's bottom without a warning;
anything else (a truncated or damaged file, which ImageFolder would fail on or
decode past) is decoded whole by the usual decoder, so it ends as it does in
ImageFolder.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from lmdbfolder.encodings import JPEG, sniff
from lmdbfolder.read.crops import Box

__all__ = ["ENV_SWITCH", "matches_pillow", "probe_boxes"]

#: The environment variable that turns region decoding off when it is "0".
ENV_SWITCH = "LMDBFOLDER_REGIONS"


def probe_boxes(width: int, height: int) -> list[Box]:
    """Boxes ``(top, left, height, width)`` that touch every edge and none."""
    boxes = [(0, 0, height, width), (height - 1, width - 1, 1, 1), (0, width - 1, height, 1)]
    if width > 2 and height > 2:
        boxes += [(1, 1, height - 2, width - 2), (height // 3, width // 3, height // 2, width // 2)]
    if width > 17:
        boxes += [(0, 17, height, width - 17), (height // 2, 15, height - height // 2, 3)]
    return boxes


def matches_pillow(helper: Callable[..., tuple[int, int]], probes: list[tuple[bytes, np.ndarray]]) -> bool:
    """Whether the compiled ``helper`` decodes every ``probe_boxes`` region of every
    probe JPEG (``(data, Pillow's RGB pixels)``) to exactly Pillow's pixels."""
    try:
        for data, expected in probes:
            height, width = expected.shape[:2]
            channels = sniff(data).channels
            for box in probe_boxes(width, height):
                buf = np.empty(3 * width * box[2], np.uint8)
                got = JPEG.region(data, box, width, channels, helper, buf)
                if got is None:
                    return False
                pixels, (x0, _y0, x1, _y1) = got
                top, left, h, w = box
                if not np.array_equal(pixels[:, x0:x1], expected[top : top + h, left : left + w]):
                    return False
    except Exception:  # a helper that fails on a valid JPEG does not match either
        return False
    return True

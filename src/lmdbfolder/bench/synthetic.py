"""Generate ImageNet-like image folders for demos and benchmarks.

The images are real JPEGs whose size and decode cost resemble ImageNet's
(about 90 KB at 500x375, quality 90): a smooth random colour field with
luminance noise, so they neither compress to nothing nor decode unusually
fast. Deterministic for a given seed.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass

import numpy as np
from PIL import Image

from lmdbfolder.progress import Progress

__all__ = ["SyntheticSpec", "make_imagefolder", "synthetic_jpeg"]

# ImageNet's most common shapes; 500x375 dominates.
_SHAPES = [(500, 375)] * 6 + [(375, 500), (500, 333), (500, 400), (640, 480)]


@dataclass(frozen=True)
class SyntheticSpec:
    """What ``make_imagefolder`` generates."""

    classes: int = 10
    per_class: int = 50
    quality: int = 90
    noise: float = 13.0
    seed: int = 0


def synthetic_jpeg(
    rng: np.random.Generator, width: int, height: int, *, quality: int = 90, noise: float = 13.0
) -> bytes:
    """One JPEG of ``width`` x ``height``: a smooth colour field plus noise."""
    cells = rng.integers(0, 256, (height // 25 + 2, width // 25 + 2, 3), dtype=np.uint8)
    base = np.asarray(Image.fromarray(cells).resize((width, height), Image.Resampling.BICUBIC), dtype=np.int16)
    pixels = np.clip(base + rng.normal(0.0, noise, (height, width, 1)), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=quality)
    return out.getvalue()


def make_imagefolder(
    root: str | os.PathLike[str], spec: SyntheticSpec = SyntheticSpec(), *, progress: bool | None = None
) -> int:
    """Write ``spec.classes`` x ``spec.per_class`` JPEGs as ``root/class_XXX/img_XXXXX.jpg``.

    Existing files with the right names are kept, so a second call is free.
    Returns the number of images in the tree.

    Example:
        >>> make_imagefolder("/tmp/synthetic", SyntheticSpec(classes=2, per_class=3), progress=False)  # doctest: +SKIP
        6
    """
    rng = np.random.default_rng(spec.seed)
    total = spec.classes * spec.per_class
    with Progress(total, "generate", enabled=progress) as bar:
        for c in range(spec.classes):
            folder = os.path.join(os.fspath(root), f"class_{c:03d}")
            os.makedirs(folder, exist_ok=True)
            for k in range(spec.per_class):
                path = os.path.join(folder, f"img_{k:05d}.jpg")
                # Draw the shape even for files that exist, so the stream stays
                # deterministic whichever files are already there.
                width, height = _SHAPES[int(rng.integers(len(_SHAPES)))]
                seed = int(rng.integers(1 << 63))
                if not os.path.exists(path):
                    data = synthetic_jpeg(
                        np.random.default_rng(seed), width, height, quality=spec.quality, noise=spec.noise
                    )
                    tmp = path + ".tmp"
                    with open(tmp, "wb") as f:
                        f.write(data)
                    os.replace(tmp, path)
                bar.update(1)
    return total

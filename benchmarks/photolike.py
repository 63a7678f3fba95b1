"""Generate a photo-like ImageNet-style tree of JPEGs from the few real photos installed packages ship.

Usage:
    python benchmarks/photolike.py OUT [--count 4000] [--classes 100] [--photos DIR] [--workers N]

Flat synthetic images (``lmdbfolder.synthetic``) decode about 2.5x faster than
photos and so hide the decode cost that a GPU decoder removes. This script
makes each image from a real photo instead: a random zoomed crop of one source
photo (Lanczos-resized to an ImageNet shape, mostly 500x375), a random flip and
colour gain, and a little sensor-like noise, saved as a baseline 4:2:0 JPEG at
quality 90 (about ImageNet's 90-110 KB per image).

Source photos, in this order: ``--photos DIR`` (any JPEG/PNG files there),
then the sample photos bundled with scikit-image (astronaut, chelsea, coffee,
rocket, ...: read from its data folder, never downloaded) and matplotlib
(grace_hopper.jpg). With none of these it falls back to
``lmdbfolder.synthetic`` and says so. Deterministic for a given seed and set
of sources; existing files are kept.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Sequence

import numpy as np
from PIL import Image

# ImageNet's most common shapes (width, height); 500x375 dominates.
SHAPES = [(500, 375)] * 6 + [(375, 500), (500, 333), (500, 400), (640, 480)]
_SKIMAGE_PHOTOS = (
    "astronaut.png",
    "chelsea.png",
    "coffee.png",
    "rocket.jpg",
    "hubble_deep_field.jpg",
    "ihc.png",
    "retina.jpg",
    "motorcycle_left.png",
    "motorcycle_right.png",
    "color.png",
)


def _package_dir(name: str) -> str | None:
    spec = importlib.util.find_spec(name)  # finds the folder without importing the package
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def find_photos(extra: str | None = None) -> list[str]:
    """Paths of the source photos found (see the module docstring)."""
    found: list[str] = []
    if extra:
        for dirpath, _dirs, names in os.walk(extra):
            found += [os.path.join(dirpath, n) for n in sorted(names) if n.lower().endswith((".jpg", ".jpeg", ".png"))]
    skimage = _package_dir("skimage")
    if skimage:
        found += [p for n in _SKIMAGE_PHOTOS if os.path.isfile(p := os.path.join(skimage, "data", n))]
    mpl = _package_dir("matplotlib")
    if mpl:
        path = os.path.join(mpl, "mpl-data", "sample_data", "grace_hopper.jpg")
        if os.path.isfile(path):
            found.append(path)
    usable = []
    for path in found:
        try:
            with Image.open(path) as img:
                if img.mode in ("RGB", "RGBA", "P", "CMYK") and min(img.size) >= 256:
                    usable.append(path)
        except OSError:
            continue
    return usable


def photo_jpeg(source: np.ndarray, rng: np.random.Generator, width: int, height: int, quality: int = 90) -> bytes:
    """One JPEG of ``width`` x ``height`` made from the RGB array ``source``."""
    sh, sw = source.shape[:2]
    cover = max(width / sw, height / sh)  # smallest scale at which the source covers the target
    scale = cover * float(rng.uniform(1.0, 1.6))  # then zoom in a little: a crop, as photos are framed
    crop_w, crop_h = min(sw, width / scale), min(sh, height / scale)
    x0 = float(rng.uniform(0, sw - crop_w))
    y0 = float(rng.uniform(0, sh - crop_h))
    img = Image.fromarray(source).resize(
        (width, height), Image.Resampling.LANCZOS, box=(x0, y0, x0 + crop_w, y0 + crop_h)
    )
    pixels = np.asarray(img, dtype=np.float32)
    if rng.random() < 0.5:
        pixels = pixels[:, ::-1]
    gain = rng.uniform(0.8, 1.2, 3).astype(np.float32) * np.float32(rng.uniform(0.85, 1.15))
    # Sensor-like noise, in luminance and a little per channel: real photos' fine
    # texture, which the smooth upscaled sources lack (it sets the decode cost).
    noise = rng.normal(0.0, float(rng.uniform(3.0, 7.0)), pixels.shape[:2] + (1,)).astype(np.float32)
    noise = noise + rng.normal(0.0, 2.0, pixels.shape).astype(np.float32)
    pixels = np.clip(pixels * gain + noise, 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=quality)
    return out.getvalue()


def _load(path: str) -> np.ndarray:
    with Image.open(path) as img:
        return np.asarray(img.convert("RGB"))


_SOURCES: list[np.ndarray] = []


def _init(paths: Sequence[str]) -> None:
    _SOURCES[:] = [_load(p) for p in paths]


def _write_one(job: tuple[str, int, int, int, int]) -> int:
    path, seed, width, height, quality = job
    if os.path.exists(path):
        return os.path.getsize(path)
    rng = np.random.default_rng(seed)
    data = photo_jpeg(_SOURCES[int(rng.integers(len(_SOURCES)))], rng, width, height, quality)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return len(data)


def make_tree(
    root: str,
    count: int,
    *,
    classes: int = 100,
    photos: Sequence[str] = (),
    seed: int = 0,
    quality: int = 90,
    workers: int | None = None,
) -> dict[str, float | int | str]:
    """Write ``count`` photo-like JPEGs as ``root/class_XXX/img_XXXXX.jpg``; returns a summary."""
    if not photos:
        from lmdbfolder.synthetic import SyntheticSpec, make_imagefolder

        per_class = max(1, count // classes)
        n = make_imagefolder(root, SyntheticSpec(classes=classes, per_class=per_class, seed=seed), progress=False)
        return {"images": n, "kind": "synthetic (no source photo found: decode cost is lower than photos')"}
    rng = np.random.default_rng(seed)
    jobs = []
    for i in range(count):
        folder = os.path.join(root, f"class_{i % classes:03d}")
        os.makedirs(folder, exist_ok=True)
        width, height = SHAPES[int(rng.integers(len(SHAPES)))]
        jobs.append(
            (os.path.join(folder, f"img_{i // classes:05d}.jpg"), int(rng.integers(1 << 63)), width, height, quality)
        )
    workers = workers or os.cpu_count() or 1
    if workers > 1:
        with ProcessPoolExecutor(workers, initializer=_init, initargs=(list(photos),)) as pool:
            sizes = list(pool.map(_write_one, jobs, chunksize=16))
    else:
        _init(photos)
        sizes = [_write_one(job) for job in jobs]
    return {
        "images": count,
        "kind": f"photo-like from {len(photos)} photos",
        "mean_kb": round(sum(sizes) / len(sizes) / 1024, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the tree to write (root/class_XXX/img_XXXXX.jpg)")
    parser.add_argument("--count", type=int, default=4000)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--photos", default=None, help="a folder of your own source photos (used first)")
    parser.add_argument("--quality", type=int, default=90)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=None, help="processes (default: all CPUs)")
    args = parser.parse_args(argv)
    photos = find_photos(args.photos)
    summary = make_tree(
        args.out,
        args.count,
        classes=args.classes,
        photos=photos,
        seed=args.seed,
        quality=args.quality,
        workers=args.workers,
    )
    print(f"{args.out}: {summary} (sources: {', '.join(os.path.basename(p) for p in photos) or 'none'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

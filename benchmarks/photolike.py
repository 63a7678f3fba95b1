"""A held-out tree of ImageNet-like JPEGs made from real photographs.

Usage:
    python benchmarks/photolike.py make DIR [--images 10000] [--classes 100] [--seed 0]
    python benchmarks/photolike.py stats DIR [--sample 200]

Flat synthetic images (``lmdbfolder.bench.synthetic``: a smooth colour field plus
noise) decode about 2.5x faster than photographs of the same size and hide the
decode cost, so loader benchmarks need photo content. There is no network here
but the package registries, so the sources are the photographs that ship in
three Debian packages (``mate-backgrounds``, ``plasma-workspace-wallpapers``,
``lomiri-wallpapers-20.04``; ``benchmarks/peers/install.sh`` installs them):
24 photos of 1280x1024 to 6028x3391 pixels. Each output image is a random
crop of one of them (a scale of 1x to 4x the output size, so the detail is
that of a downscaled camera image), resized with Lanczos to a shape drawn
from ImageNet's common shapes (mostly 500x375), flipped at random, colour
jittered, in about half the images mixed with a second photo (a blend or a
pasted patch), with mild sensor noise, and stored as a quality-90 JPEG with
4:2:0 chroma (Pillow's default, as most ImageNet files). Mean file size is
close to ImageNet's ~110 KB at these shapes (the ``stats`` command measures it).

The ``small`` profile (``make --profile small``) makes thumbnails of the same
photos for scale benchmarks (``bench_scale.py``: 1.28M files in minutes):
the same shapes scaled by 0.18 (mostly 90x68), crops of the photos shrunk to
320 pixels, the same mixing, jitter and noise, a cheaper sharpening, quality
90: 2-6 KB files (mean ~3.8 KB), whose records straddle LMDB's 4 KB pages.

Deterministic: image ``i`` depends only on ``(seed, i)``, the profile and the
source photos (for the same Pillow and numpy releases), so a partly written
tree is finished by running ``make`` again, with any number of processes.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Iterable, Sequence, cast

import numpy as np
from PIL import Image, ImageFilter

__all__ = [
    "SOURCES",
    "PROFILES",
    "PhotoSpec",
    "find_sources",
    "make_tree",
    "photo_jpeg",
    "small_photo_jpeg",
    "tree_stats",
]

# (Debian package, path) of each photograph used. Illustrations and renders
# shipped in the same packages are left out on purpose: their flat regions
# compress and decode like synthetic images.
_MATE = "Aqua Blinds Dune FreshFlower Garden GreenMeadow LadyBird RainDrops Storm TwoWings Wood YellowFlower"
_PLASMA = "BytheWater ColdRipple ColorfulCups DarkestHour EveningGlow FallenLeaf Grey Kite OneStandsOut Path summer_1am"
SOURCES: tuple[tuple[str, str], ...] = (
    *[("mate-backgrounds", f"/usr/share/backgrounds/mate/nature/{n}.jpg") for n in _MATE.split()],
    *[
        ("plasma-workspace-wallpapers", f"/usr/share/wallpapers/{n}/contents/images/2560x1600.jpg")
        for n in _PLASMA.split()
    ],
    ("lomiri-wallpapers-20.04", "/usr/share/backgrounds/Kleiber_by_Lukas_Baubkus.jpg"),
)

# ImageNet's common shapes (width, height) with rough frequencies; 500x375
# dominates, as in the ILSVRC-2012 train set.
SHAPES: tuple[tuple[tuple[int, int], float], ...] = (
    ((500, 375), 0.58),
    ((375, 500), 0.08),
    ((500, 333), 0.12),
    ((333, 500), 0.04),
    ((500, 500), 0.05),
    ((500, 400), 0.05),
    ((640, 480), 0.04),
    ((400, 300), 0.04),
)

# The ``small`` profile: ImageNet's shapes scaled down, so that files are 2-6 KB.
SMALL_SCALE = 0.18
SMALL_SHAPES: tuple[tuple[tuple[int, int], float], ...] = tuple(
    ((round(w * SMALL_SCALE), round(h * SMALL_SCALE)), f) for (w, h), f in SHAPES
)
#: Longer side of the source photos the small profile crops from.
_SMALL_SOURCE_SIDE = 320
PROFILES = ("imagenet", "small")

# Sources are kept at most this large (longer side) in memory: still 4x the
# largest output, and it bounds each process to ~400 MB.
_MAX_SOURCE_SIDE = 2560


@dataclass(frozen=True)
class PhotoSpec:
    """What ``make_tree`` generates."""

    images: int = 10_000
    classes: int = 100
    quality: int = 90
    seed: int = 0
    profile: str = "imagenet"


def find_sources(paths: Sequence[tuple[str, str]] = SOURCES) -> list[str]:
    """The source photo paths; raises SystemExit naming the Debian packages to
    install when any is missing (all are needed, so that a seed means one tree).

    With ``PHOTOLIKE_SOURCES=DIR`` set, the copies in ``DIR`` (``00.jpg`` ...,
    written by ``photolike.py sources DIR``) are used instead: for a machine
    without the Debian packages (an offline GPU machine)."""
    folder = os.environ.get("PHOTOLIKE_SOURCES")
    if folder:
        copies = [os.path.join(folder, f"{k:02d}.jpg") for k in range(len(paths))]
        absent = [c for c in copies if not os.path.isfile(c)]
        if absent:
            raise SystemExit(
                f"photolike: PHOTOLIKE_SOURCES={folder} lacks {', '.join(absent[:3])}; "
                "write it with `photolike.py sources DIR` where the photos are installed"
            )
        return copies
    missing = sorted({pkg for pkg, path in paths if not os.path.isfile(path)})
    if missing:
        raise SystemExit(
            "photolike: the source photographs are missing; install them with\n"
            f"    apt-get install -y {' '.join(missing)}\n"
            "(or run benchmarks/peers/install.sh, which does)"
        )
    return [path for _, path in paths]


def sources_fingerprint(paths: Iterable[str]) -> str:
    """A short hash of the source files' names and sizes (printed with the stats,
    so two trees made from different sources are told apart)."""
    h = hashlib.sha256()
    for p in paths:
        h.update(f"{p}:{os.path.getsize(p)}\n".encode())
    return h.hexdigest()[:12]


_loaded: list[np.ndarray] = []


def _load_sources(paths: Sequence[str]) -> list[np.ndarray]:
    """Decode every source once per process (RGB uint8), shrunk to at most
    ``_MAX_SOURCE_SIDE``."""
    if not _loaded:
        for p in paths:
            with Image.open(p) as f:
                im = f.convert("RGB")
            if max(im.size) > _MAX_SOURCE_SIDE:
                s = _MAX_SOURCE_SIDE / max(im.size)
                im = im.resize((round(im.width * s), round(im.height * s)), Image.Resampling.LANCZOS)
            _loaded.append(np.asarray(im))
    return _loaded


_loaded_small: list[np.ndarray] = []


def _load_small_sources(paths: Sequence[str]) -> list[np.ndarray]:
    """The sources shrunk to ``_SMALL_SOURCE_SIDE`` (decoded at a DCT scale first: fast)."""
    if not _loaded_small:
        side = _SMALL_SOURCE_SIDE
        for p in paths:
            with Image.open(p) as f:
                f.draft("RGB", (2 * side, 2 * side))
                im = f.convert("RGB")
            s = side / max(im.size)
            im = im.resize((round(im.width * s), round(im.height * s)), Image.Resampling.LANCZOS)
            _loaded_small.append(np.asarray(im))
    return _loaded_small


def _small_crop(rng: np.random.Generator, src: np.ndarray, width: int, height: int) -> np.ndarray:
    """``_crop`` for thumbnails: 1x-4x the output size, bilinear."""
    return _crop(rng, src, width, height, max_scale=4.0, resample=Image.Resampling.BILINEAR)


_SMALL_WEIGHTS = np.array([w for _, w in SMALL_SHAPES]) / sum(w for _, w in SMALL_SHAPES)


def small_photo_jpeg(rng: np.random.Generator, sources: Sequence[np.ndarray], *, quality: int = 90) -> bytes:
    """One photo-like thumbnail (the ``small`` profile): the steps of ``photo_jpeg``
    at ~90x68 pixels, with float32 noise and a 3x3 sharpening (2-6 KB at quality 90)."""
    width, height = SMALL_SHAPES[int(rng.choice(len(SMALL_SHAPES), p=_SMALL_WEIGHTS))][0]

    def pick() -> np.ndarray:
        return sources[int(rng.integers(len(sources)))]

    img = _small_crop(rng, pick(), width, height)
    mix = rng.random()
    if mix < 0.25:
        alpha = np.float32(rng.uniform(0.15, 0.35))
        img = (1 - alpha) * img + alpha * _small_crop(rng, pick(), width, height)
    elif mix < 0.5:
        pw, ph = max(1, int(width * rng.uniform(0.25, 0.6))), max(1, int(height * rng.uniform(0.25, 0.6)))
        px, py = int(rng.integers(0, width - pw + 1)), int(rng.integers(0, height - ph + 1))
        img[py : py + ph, px : px + pw] = _small_crop(rng, pick(), pw, ph)
    if rng.random() < 0.5:
        img = img[:, ::-1]
    img = img * rng.uniform(0.85, 1.15, 3).astype(np.float32)
    grey = img.mean(axis=2, keepdims=True)
    img = grey + (img - grey) * np.float32(rng.uniform(0.6, 1.4))
    img = img * np.float32(rng.uniform(0.8, 1.2))
    sigma = np.float32(rng.uniform(2.0, 7.0))
    img = img + rng.standard_normal((height, width, 1), dtype=np.float32) * sigma
    pil = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).filter(ImageFilter.SHARPEN)
    out = io.BytesIO()
    pil.save(out, "JPEG", quality=quality)
    return out.getvalue()


def _shape(rng: np.random.Generator) -> tuple[int, int]:
    weights = np.array([w for _, w in SHAPES])
    return SHAPES[int(rng.choice(len(SHAPES), p=weights / weights.sum()))][0]


def _crop(
    rng: np.random.Generator,
    src: np.ndarray,
    width: int,
    height: int,
    *,
    max_scale: float = 5.0,
    resample: Image.Resampling = Image.Resampling.LANCZOS,
) -> np.ndarray:
    """A random crop of ``src`` with the output's aspect ratio, 1x-``max_scale``x the
    output size (log-uniform, capped by the source), resized to ``width`` x ``height``."""
    sh, sw = src.shape[:2]
    cap = min(sw / width, sh / height)
    lo = min(1.0, cap)
    scale = float(np.exp(rng.uniform(np.log(lo), np.log(max(lo, min(max_scale, cap))) + 1e-9)))
    cw, ch = max(1, min(sw, round(width * scale))), max(1, min(sh, round(height * scale)))
    x = int(rng.integers(0, sw - cw + 1))
    y = int(rng.integers(0, sh - ch + 1))
    patch = Image.fromarray(src[y : y + ch, x : x + cw])
    return np.asarray(patch.resize((width, height), resample), dtype=np.float32)


def photo_jpeg(rng: np.random.Generator, sources: Sequence[np.ndarray], *, quality: int = 90) -> bytes:
    """One photo-like JPEG: crop, resize, flip, jitter, mix, noise, encode."""
    width, height = _shape(rng)
    img = _crop(rng, sources[int(rng.integers(len(sources)))], width, height)
    mix = rng.random()
    if mix < 0.25:  # blend a second photo, faintly
        other = _crop(rng, sources[int(rng.integers(len(sources)))], width, height)
        alpha = rng.uniform(0.15, 0.35)
        img = (1 - alpha) * img + alpha * other
    elif mix < 0.5:  # paste a patch of a second photo (an "object" on a background)
        pw, ph = int(width * rng.uniform(0.25, 0.6)), int(height * rng.uniform(0.25, 0.6))
        patch = _crop(rng, sources[int(rng.integers(len(sources)))], pw, ph)
        px, py = int(rng.integers(0, width - pw + 1)), int(rng.integers(0, height - ph + 1))
        img[py : py + ph, px : px + pw] = patch
    if rng.random() < 0.5:
        img = img[:, ::-1]
    # Colour jitter: per-channel gain (white balance), saturation, contrast, brightness.
    img = img * rng.uniform(0.85, 1.15, 3).astype(np.float32)
    grey = img.mean(axis=2, keepdims=True)
    img = grey + (img - grey) * rng.uniform(0.6, 1.4)
    mean = float(img.mean())
    img = mean + (img - mean) * rng.uniform(0.8, 1.25)
    img = img * rng.uniform(0.8, 1.2)
    # Camera-like finish: sensor noise (luma, and a little chroma), then the
    # sharpening that cameras apply. The wallpaper photos are smoother than
    # typical ImageNet photos (shallow focus, skies, downscaled by their
    # makers); without this they are ~35 KB and decode ~2x faster than
    # ImageNet's files of the same shape.
    sigma = rng.uniform(2.5, 9.0)
    img = img + rng.normal(0.0, sigma, (height, width, 1)).astype(np.float32)
    img = img + rng.normal(0.0, sigma / 3, (height, width, 3)).astype(np.float32)
    pil = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    pil = pil.filter(
        ImageFilter.UnsharpMask(radius=rng.uniform(1.0, 2.0), percent=int(rng.uniform(80, 200)), threshold=0)
    )
    out = io.BytesIO()
    pil.save(out, "JPEG", quality=quality)
    return out.getvalue()


def _path(root: str, spec: PhotoSpec, i: int) -> str:
    # Classes are contiguous blocks, as many images in each as possible.
    per_class = -(-spec.images // spec.classes)
    digits = max(6, len(str(spec.images - 1)))
    return os.path.join(root, f"class_{i // per_class:03d}", f"img_{i:0{digits}d}.jpg")


def _image(spec: PhotoSpec, i: int, paths: Sequence[str]) -> bytes:
    rng = np.random.default_rng(np.random.SeedSequence([spec.seed, i]))
    if spec.profile == "small":
        return small_photo_jpeg(rng, _load_small_sources(paths), quality=spec.quality)
    return photo_jpeg(rng, _load_sources(paths), quality=spec.quality)


def _write_one(args: tuple[str, PhotoSpec, int, tuple[str, ...]]) -> int:
    root, spec, i, paths = args
    path = _path(root, spec, i)
    if os.path.exists(path):
        return 0
    data = _image(spec, i, paths)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # a file is there whole or not at all: a rerun finishes the tree
    return 1


def _write_range(args: tuple[str, PhotoSpec, int, int, tuple[str, ...]]) -> tuple[int, int]:
    """Write images ``lo..hi-1`` (those not there yet); returns (done, written)."""
    root, spec, lo, hi, paths = args
    return hi - lo, sum(_write_one((root, spec, i, paths)) for i in range(lo, hi))


def make_tree(root: str, spec: PhotoSpec = PhotoSpec(), *, processes: int | None = None, quiet: bool = False) -> int:
    """Write ``spec.images`` photo-like JPEGs as ``root/class_XXX/img_XXXXXX.jpg``
    (ImageFolder layout, ``spec.classes`` classes). Files already there are kept.
    Returns the number of files written now."""
    if spec.images < spec.classes:
        raise ValueError(f"need at least one image per class: images={spec.images} < classes={spec.classes}")
    if spec.profile not in PROFILES:
        raise ValueError(f"profile must be one of {PROFILES}, got {spec.profile!r}")
    paths = tuple(find_sources())
    processes = processes or os.cpu_count() or 1
    start = time.perf_counter()
    # Ranges of indices, not one task per image: a million-image tree is
    # planned without a million task tuples, and each worker skips what exists.
    step = 512
    jobs = [(root, spec, lo, min(lo + step, spec.images), paths) for lo in range(0, spec.images, step)]
    written = done = 0
    report = max(1000, spec.images // 100)
    next_report = report
    if processes == 1:
        results: Iterable[tuple[int, int]] = map(_write_range, jobs)
        pool = None
    else:
        pool = get_context("fork").Pool(processes)
        results = pool.imap_unordered(_write_range, jobs)
    try:
        for n, w in results:
            done += n
            written += w
            if not quiet and done >= next_report:
                next_report += report
                rate = written / max(time.perf_counter() - start, 1e-9)
                print(f"photolike: {done:,}/{spec.images:,} ({written:,} written, {rate:,.0f}/s)", file=sys.stderr)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    if not quiet:
        print(
            f"photolike: wrote {written:,} images to {root} in {time.perf_counter() - start:.1f} s "
            f"({processes} processes)",
            file=sys.stderr,
        )
    return written


def _decode_rate(blobs: Sequence[bytes], repeat: int = 3) -> float:
    """Single-thread Pillow decode rate (decode to RGB, img/s), best of ``repeat``."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for b in blobs:
            with Image.open(io.BytesIO(b)) as im:
                im.convert("RGB")
        best = min(best, time.perf_counter() - start)
    return len(blobs) / best


def tree_stats(root: str, *, sample: int = 200, seed: int = 0) -> dict[str, object]:
    """Mean file size and shape mix of the tree, and the single-core Pillow decode
    rate of a sample of its files against ``lmdbfolder.bench.synthetic`` images of the
    same shapes (decoded alternately in this process)."""
    files = sorted(
        os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.lower().endswith((".jpg", ".jpeg"))
    )
    if not files:
        raise SystemExit(f"photolike: no JPEG under {root}")
    sizes = [os.path.getsize(f) for f in files]
    rng = np.random.default_rng(seed)
    picked = [files[int(i)] for i in rng.choice(len(files), size=min(sample, len(files)), replace=False)]
    blobs = []
    for p in picked:
        with open(p, "rb") as f:
            blobs.append(f.read())
    shapes: dict[str, int] = {}
    for b in blobs:
        with Image.open(io.BytesIO(b)) as im:
            key = f"{im.width}x{im.height}"
        shapes[key] = shapes.get(key, 0) + 1
    stats: dict[str, object] = {
        "files": len(files),
        "mean_kb": statistics.fmean(sizes) / 1000,
        "median_kb": statistics.median(sizes) / 1000,
        "shapes_in_sample": dict(sorted(shapes.items(), key=lambda kv: -kv[1])),
        "sample": len(blobs),
    }
    try:
        from lmdbfolder.bench.synthetic import synthetic_jpeg
    except ImportError:  # lmdbfolder not on the path: photos only
        synthetic_jpeg = None
    sets: dict[str, list[bytes]] = {"photolike": blobs}
    if synthetic_jpeg is not None:
        # lmdbfolder.bench.synthetic's images of the same shapes: its default (a colour
        # field plus noise 13) and a flat one (noise 0).
        for name, noise in (("synthetic", 13.0), ("synthetic_flat", 0.0)):
            srng = np.random.default_rng(seed)
            made = []
            for b in blobs:
                with Image.open(io.BytesIO(b)) as im:
                    w, h = im.size
                made.append(synthetic_jpeg(srng, w, h, quality=90, noise=noise))
            sets[name] = made
    # Alternate the sets, so that a change in machine load hits all alike.
    rates: dict[str, list[float]] = {name: [] for name in sets}
    for _ in range(3):
        for name, bl in sets.items():
            rates[name].append(_decode_rate(bl, repeat=1))
    photo_rate = max(rates["photolike"])
    stats["pillow_decode_img_s"] = photo_rate
    for name in sets:
        if name != "photolike":
            stats[f"{name}_mean_kb"] = statistics.fmean(len(b) for b in sets[name]) / 1000
            stats[f"{name}_pillow_decode_img_s"] = max(rates[name])
            stats[f"{name}_decode_speed_vs_photolike"] = max(rates[name]) / photo_rate
    return stats


def format_stats(stats: dict[str, object]) -> str:
    """The stats as a few readable lines."""
    shapes = cast("dict[str, int]", stats["shapes_in_sample"])
    total = sum(shapes.values())
    mix = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in list(shapes.items())[:6])
    lines = [
        f"{stats['files']:,} files, mean {stats['mean_kb']:.1f} KB (median {stats['median_kb']:.1f} KB)",
        f"shapes (sample of {stats['sample']}): {mix}",
        f"Pillow decode to RGB, 1 thread: {stats['pillow_decode_img_s']:.0f} img/s",
    ]
    for name, what in (("synthetic", "default, noise 13"), ("synthetic_flat", "flat, noise 0")):
        if f"{name}_pillow_decode_img_s" in stats:
            lines.append(
                f"lmdbfolder.bench.synthetic ({what}), same shapes: mean {stats[f'{name}_mean_kb']:.1f} KB, "
                f"{stats[f'{name}_pillow_decode_img_s']:.0f} img/s "
                f"({stats[f'{name}_decode_speed_vs_photolike']:.2f}x the photo-like decode rate)"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line: ``make`` a tree, or print ``stats`` of one."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make", help="write (or finish) a photo-like tree")
    mk.add_argument("root")
    mk.add_argument("--images", type=int, default=PhotoSpec.images)
    mk.add_argument("--classes", type=int, default=PhotoSpec.classes)
    mk.add_argument("--quality", type=int, default=PhotoSpec.quality)
    mk.add_argument("--seed", type=int, default=PhotoSpec.seed)
    mk.add_argument("--profile", choices=PROFILES, default=PhotoSpec.profile, help="small: 2-6 KB thumbnails")
    mk.add_argument("--processes", type=int, default=None, help="default: one per CPU")
    cp = sub.add_parser("sources", help="copy the source photos into DIR (00.jpg ...) for PHOTOLIKE_SOURCES=DIR")
    cp.add_argument("root")
    st = sub.add_parser("stats", help="file size, shape mix and decode rate of a tree")
    st.add_argument("root")
    st.add_argument("--sample", type=int, default=200)
    st.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = parser.parse_args(argv)
    if args.cmd == "make":
        spec = PhotoSpec(
            images=args.images, classes=args.classes, quality=args.quality, seed=args.seed, profile=args.profile
        )
        make_tree(args.root, spec, processes=args.processes)
        print(f"sources: {len(SOURCES)} photos, fingerprint {sources_fingerprint(find_sources())}")
        return 0
    if args.cmd == "sources":
        import shutil

        os.makedirs(args.root, exist_ok=True)
        for k, path in enumerate(find_sources()):
            shutil.copyfile(path, os.path.join(args.root, f"{k:02d}.jpg"))
        print(f"copied {len(SOURCES)} photos into {args.root}; use PHOTOLIKE_SOURCES={args.root}")
        return 0
    stats = tree_stats(args.root, sample=args.sample)
    print(json.dumps(stats, indent=2) if args.json else format_stats(stats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""DINO's multi-crop augmentation: ImageFolder + ``DataAugmentationDINO`` against ``MultiCrop.dino`` through LMDBFolder.

Usage:
    python benchmarks/bench_multicrop.py TREE [--pack PACK] [--images 2000] [--warmup 128] [--rounds 3]
        [--workers 2] [--threads 2] [--batch 32] [--only NAME ...] [--profile 200] [--json PATH]

Contestants, each run in a fresh interpreter, alternated round after round (the
order rotates), every one making DINO's 2 global + 8 local views per sample:

* ``dino-imagefolder``: ``ImageFolder(TREE, transform=DataAugmentationDINO((0.4, 1), (0.05, 0.4), 8))``
  (the class rebuilt from torchvision transforms as facebookresearch/dino ``main_dino.py``
  lines 419-464 builds it, ``utils.py`` lines 36-68 for its blur and solarization),
  ``DataLoader(num_workers=WORKERS)``;
* ``preset-workers``: ``LMDBFolder(PACK, transform=lmdbfolder.fused.MultiCrop.dino(...))``,
  the same DataLoader;
* ``preset-threads``: the same dataset with ``threads=THREADS`` and ``num_workers=0``
  (threads mode: a batch's samples made by the dataset's threads);
* ``dali-cpu`` (where ``nvidia.dali`` imports): DALI's CPU pipeline making the same
  views the way DALI's ResNet-50 example makes a training crop
  (NVIDIA/DALI ``docs/examples/use_cases/pytorch/resnet50/main.py`` at 040019d, ``create_dali_pipeline``:
  ``fn.decoders.image_random_crop`` per view, ``fn.resize``, ``fn.crop_mirror_normalize``
  with a ``coin_flip`` mirror), plus ``fn.color_twist`` (brightness, contrast, saturation,
  hue; identity when the 0.8 coin says no, saturation 0 for the 0.2 grayscale),
  ``fn.gaussian_blur`` (sigma 0.1-2.0, mixed in by its probability) and a solarization
  by arithmetic; ``num_threads=THREADS``. Not the same pixels (DALI's own operations
  and random numbers): the same work.

Each cell: samples/s, CPU ms per sample (the process tree's user + system time: the
main process and its DataLoader workers), and the cores other processes used during
the run (from /proc/stat, less the run's own); median of the rounds. Run it on a quiet
machine; compare ratios measured in one run.

``--profile N`` instead makes N samples of the preset in this process, one thread, and
prints where the time goes (CPU ms per sample per stage: drawing the random numbers,
the region decode, crop + resize, the photometric operations, the normalization),
then cProfile's top functions. Writes JSON to benchmarks/results/ (and --json PATH).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)  # dino_reference
sys.path.insert(0, os.path.join(HERE, "peers"))
from contestants import _tree_cpu_seconds, epochs, machine_busy_seconds  # noqa: E402

NAMES = ("dino-imagefolder", "preset-workers", "preset-threads", "dali-cpu")
SCALES = {"global_crops_scale": (0.4, 1.0), "local_crops_scale": (0.05, 0.4), "local_crops_number": 8}


# -- DINO's augmentation (main_dino.py lines 419-464, utils.py lines 36-68), from torchvision ---------
def dino_augmentation() -> Any:
    """``DataAugmentationDINO((0.4, 1.0), (0.05, 0.4), 8)`` as main_dino.py builds it."""
    from dino_reference import DataAugmentationDINO

    return DataAugmentationDINO(**SCALES)


# -- the contestants' loaders ------------------------------------------------------------------------
def make_loader(name: str, tree: str, pack: str, workers: int, threads: int, batch: int) -> Any:
    """An iterable of batches for contestant ``name``."""
    from torch.utils.data import DataLoader

    if name == "dali-cpu":
        return dali_loader(tree, threads, batch)
    kw: dict[str, Any] = {"batch_size": batch, "shuffle": True, "drop_last": True}
    if name == "dino-imagefolder":
        from torchvision.datasets import ImageFolder

        ds: Any = ImageFolder(tree, transform=dino_augmentation())
        return DataLoader(ds, num_workers=workers, persistent_workers=workers > 0, **kw)
    from lmdbfolder.fused import MultiCrop
    from lmdbfolder.torch import LMDBFolder

    if name == "preset-workers":
        ds = LMDBFolder(pack, transform=MultiCrop.dino(**SCALES))
        return DataLoader(ds, num_workers=workers, persistent_workers=workers > 0, **kw)
    if name == "preset-threads":
        ds = LMDBFolder(pack, transform=MultiCrop.dino(**SCALES), threads=threads)
        return DataLoader(ds, num_workers=0, **kw)
    raise ValueError(f"unknown contestant {name}")


def dali_loader(tree: str, threads: int, batch: int) -> Any:
    """DALI's CPU pipeline making DINO's ten views (see the module docstring)."""
    from nvidia.dali import fn, pipeline_def, types

    views = [(224, (0.4, 1.0), 1.0, 0.0), (224, (0.4, 1.0), 0.1, 0.2)] + [(96, (0.05, 0.4), 0.5, 0.0)] * 8

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=None, seed=0)  # type: ignore[misc]
    def pipe() -> Any:
        jpegs, labels = fn.readers.file(file_root=tree, random_shuffle=True, name="Reader")
        outs = []
        for size, scale, blur_p, solar_p in views:
            img = fn.decoders.image_random_crop(
                jpegs,
                device="cpu",
                output_type=types.RGB,
                random_area=list(scale),
                random_aspect_ratio=[3 / 4, 4 / 3],
                num_attempts=10,
            )
            img = fn.resize(img, resize_x=size, resize_y=size, interp_type=types.INTERP_CUBIC)
            jitter = fn.random.coin_flip(probability=0.8)
            gray = fn.random.coin_flip(probability=0.2)
            brightness = jitter * fn.random.uniform(range=[0.6, 1.4]) + (1 - jitter)
            contrast = jitter * fn.random.uniform(range=[0.6, 1.4]) + (1 - jitter)
            saturation = (jitter * fn.random.uniform(range=[0.8, 1.2]) + (1 - jitter)) * (1 - gray)
            hue = jitter * fn.random.uniform(range=[-36.0, 36.0])  # degrees: 0.1 of a turn
            img = fn.color_twist(img, brightness=brightness, contrast=contrast, saturation=saturation, hue=hue)
            blur = fn.random.coin_flip(probability=blur_p)
            blurred = fn.gaussian_blur(img, sigma=fn.random.uniform(range=[0.1, 2.0]))
            img = fn.cast(blur * blurred + (1 - blur) * img, dtype=types.UINT8)
            if solar_p:
                solar = fn.random.coin_flip(probability=solar_p) * (img >= 128)
                img = fn.cast(solar * (255 - img) + (1 - solar) * img, dtype=types.UINT8)
            img = fn.crop_mirror_normalize(
                img,
                dtype=types.FLOAT,
                output_layout="CHW",
                mean=[0.485 * 255, 0.456 * 255, 0.406 * 255],
                std=[0.229 * 255, 0.224 * 255, 0.225 * 255],
                mirror=fn.random.coin_flip(probability=0.5),
            )
            outs.append(img)
        return (*outs, labels)

    p = pipe()
    p.build()

    class Batches:
        def __iter__(self) -> Any:
            while True:
                out = p.run()
                yield [o.as_array() for o in out[:-1]], out[-1]

    return Batches()


# -- one run (in a fresh interpreter) ---------------------------------------------------------------------
def child(name: str, tree: str, pack: str, workers: int, threads: int, batch: int, images: int, warmup: int) -> dict:
    """Make ``warmup`` samples, then time ``images`` more; the measures as a dict."""
    import torch

    torch.manual_seed(0)
    loader = make_loader(name, tree, pack, workers, threads, batch)

    it = epochs(loader, f"{name} (fewer samples than --batch?)")
    made = 0
    while made < warmup:
        next(it)
        made += batch
    cpu0, (busy0, _), t0 = _tree_cpu_seconds(), machine_busy_seconds(), time.perf_counter()
    made = 0
    while made < images:
        next(it)
        made += batch
    wall = time.perf_counter() - t0
    cpu = _tree_cpu_seconds() - cpu0
    busy = machine_busy_seconds()[0] - busy0
    return {
        "name": name,
        "samples": made,
        "wall_s": wall,
        "samples_per_s": made / wall,
        "cpu_ms_per_sample": 1000 * cpu / made,
        "other_cores": max(0.0, busy - cpu) / wall,
    }


def available(name: str) -> str | None:
    """Why contestant ``name`` cannot run here, or None."""
    if name == "dali-cpu":
        try:
            import nvidia.dali  # noqa: F401
        except ImportError as exc:
            return f"not installed ({exc}); pip install nvidia-dali-cuda120 to compare"
    return None


# -- where the time goes ------------------------------------------------------------------------------------
def profile(pack: str, samples: int) -> dict[str, float]:
    """CPU ms per sample of each stage of the preset, one thread, in this process."""
    import cProfile
    import pstats

    import torch

    from lmdbfolder.fused import MultiCrop
    from lmdbfolder.read.crops import exact_resize_into
    from lmdbfolder.torch import LMDBFolder, photometric
    from lmdbfolder.torch.multicrop import resizers

    torch.set_num_threads(1)
    mc = MultiCrop.dino(**SCALES)
    ds = LMDBFolder(pack, transform=mc)
    plan = ds._plan()
    read = plan.read
    found = resizers()
    if len(found) < 2:
        print("note: the compiled resize is not built here: the profile needs it (pip install -e .)")
        return {}
    stages = dict.fromkeys(
        ("draw", "decode", "crop+resize", "jitter", "grayscale", "blur", "solarize", "normalize"), 0.0
    )
    clock = time.process_time
    for i in range(samples):
        rec, _ = ds._selection.fetch(ds.reader, i % len(ds))
        t = clock()
        enc = read.claim(rec.payload, rec.encoding, rec.width, rec.height, rec.channels)
        draws = mc.draw(rec.width, rec.height)
        t1 = clock()
        pixels, top, left = read.covering(rec.payload, enc, rec.width, rec.height, rec.channels, mc.union(draws))
        t2 = clock()
        batches = {}
        for size in (224, 96):
            members = [k for k, v in enumerate(mc.views) if v.out_size == (size, size)]
            batch = torch.empty((len(members), 3, size, size), dtype=torch.uint8)
            for j, k in enumerate(members):
                view, d = mc.views[k], draws[k]
                y, x, h, w = d.box
                box = (x - left, y - top, x - left + w, y - top + h)
                fn, order, cubic = found[view.interpolation]
                exact_resize_into(
                    fn, order, pixels, box, (size, size), batch[j].numpy(), planar=True, flip=d.flip, cubic=cubic
                )
            batches[size] = (members, batch)
        t3 = clock()
        stages["draw"] += t1 - t
        stages["decode"] += t2 - t1
        stages["crop+resize"] += t3 - t2
        for size in (224, 96):
            members, x = batches[size]
            dd = [draws[k] for k in members]
            t = clock()
            x = photometric.color_jitter(x, [d.order for d in dd], [d.factors for d in dd], inplace=True)
            t1 = clock()
            x = photometric.grayscale(x, [d.gray for d in dd], inplace=True)
            t2 = clock()
            x = photometric.gaussian_blur(x, [0.0 if d.blur is None else d.blur for d in dd], inplace=True)
            t3 = clock()
            x = photometric.solarize(x, 128, [d.solarize for d in dd], inplace=True)
            t4 = clock()
            photometric.normalize(x, mc.views[members[0]].mean, mc.views[members[0]].std)  # type: ignore[arg-type]
            t5 = clock()
            for key, dt in zip(
                ("jitter", "grayscale", "blur", "solarize", "normalize"), (t1 - t, t2 - t1, t3 - t2, t4 - t3, t5 - t4)
            ):
                stages[key] += dt
    per = {k: 1000 * v / samples for k, v in stages.items()}
    per["total"] = sum(per.values())
    compiled = photometric.compiled()
    print(f"where the time goes, CPU ms per sample ({samples} samples, one thread, compiled ops: {compiled}):")
    for k, v in per.items():
        print(f"  {k:12s} {v:7.2f}")
    prof = cProfile.Profile()
    prof.enable()
    for i in range(min(samples, 100)):
        ds[i % len(ds)]
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    return per


# -- the driver ---------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("tree", help="an ImageFolder tree of photos (benchmarks/photolike.py make)")
    ap.add_argument("--pack", help="the tree packed (default: packed now into a temporary folder)")
    ap.add_argument("--images", type=int, default=2000, help="samples timed per run")
    ap.add_argument("--warmup", type=int, default=128, help="samples made before the timing starts")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers (the workers rows)")
    ap.add_argument("--threads", type=int, default=2, help="threads of the threads rows (and DALI's)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--only", nargs="*", choices=NAMES, help="these contestants only")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="profile the preset on N samples instead")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        out = child(args.child, args.tree, args.pack, args.workers, args.threads, args.batch, args.images, args.warmup)
        print("RESULT " + json.dumps(out))
        return 0

    scratch = None
    pack = args.pack
    if pack is None:
        from lmdbfolder.write.writer import pack as pack_tree

        scratch = tempfile.TemporaryDirectory(prefix="bench-multicrop-")
        pack = os.path.join(scratch.name, "pack")
        pack_tree(args.tree, pack, progress=False)
    try:
        if args.profile:
            result: dict[str, Any] = {"profile": profile(pack, args.profile)}
        else:
            result = run_all(args, pack)
    finally:
        if scratch is not None:
            scratch.cleanup()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    for path in filter(None, (os.path.join(HERE, "results", f"multicrop-{stamp}.json"), args.json)):
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def run_all(args: argparse.Namespace, pack: str) -> dict[str, Any]:
    """Every contestant's runs, alternated; prints the table."""
    names = list(args.only or NAMES)
    skipped = {n: why for n in names if (why := available(n)) is not None}
    names = [n for n in names if n not in skipped]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(REPO, "src"), os.environ.get("PYTHONPATH")]))
    )
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            cmd = [sys.executable, os.path.abspath(__file__), args.tree, "--pack", pack, "--child", name]
            cmd += ["--images", str(args.images), "--warmup", str(args.warmup), "--workers", str(args.workers)]
            cmd += ["--threads", str(args.threads), "--batch", str(args.batch)]
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
            if done.returncode != 0 or not lines:
                print(f"{name}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
                continue
            runs[name].append(json.loads(lines[-1][len("RESULT ") :]))
    table = {}
    base = None
    print(f"{'contestant':18s} {'samples/s':>10s} {'CPU ms/sample':>14s} {'vs DINO':>8s} {'other cores':>12s}")
    for name in names:
        if not runs[name]:
            continue
        cell = {
            k: statistics.median(r[k] for r in runs[name])
            for k in ("samples_per_s", "cpu_ms_per_sample", "other_cores")
        }
        table[name] = cell
        if name == "dino-imagefolder":
            base = cell["cpu_ms_per_sample"]
        ratio = f"{cell['cpu_ms_per_sample'] / base:.2f}" if base else "-"
        rate, cpu, other = cell["samples_per_s"], cell["cpu_ms_per_sample"], cell["other_cores"]
        print(f"{name:18s} {rate:10.1f} {cpu:14.2f} {ratio:>8s} {other:12.2f}")
    for name, why in skipped.items():
        print(f"{name:18s} {why}")
    return {"args": vars(args), "runs": runs, "table": table, "skipped": skipped}


if __name__ == "__main__":
    sys.exit(main())

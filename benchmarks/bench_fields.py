"""The fused crops of several fields against the same steps on the files (issue 35, "Fast").

Usage:
    python benchmarks/bench_fields.py                              # the measurement (quiet machine)
    python benchmarks/bench_fields.py --samples 40 --rounds 1 --pairs 8   # a smoke run

Two comparisons, each in one alternated run (the contestants' order rotates from round
to round; every contestant runs the same samples in the same order), in this process,
one sample at a time (no DataLoader: the CPU of one sample is what is compared):

(a) segmentation, a Pascal VOC tree of photo-like JPEGs (about 500x375) and palette
    PNG masks: ``v2.Compose([v2.RandomResizedCrop(224), v2.RandomHorizontalFlip()])``
    applied to the image and its mask
    - ``voc-files``: torchvision's ``VOCSegmentation`` on the files, wrapped with
      ``wrap_dataset_for_transforms_v2`` (what people run today);
    - ``lmdbfolder``: ``LMDBDataset`` on a pack of the same tree (made with
      ``lmdbfolder.pack_dataset``): the crop and flip fused with the image's decode;
    - ``fused-bytes``: the fused plan itself (``lmdbfolder.torch.joint.JointPlan``) on the
      files' bytes, read with open/read: what the fusion costs without the pack, and the
      row that runs where this checkout has no ``LMDBDataset`` yet;
    - ``lmdbfolder-native``: the opt-in inexact crop, ``fused.RandomResizedCrop(224,
      resize="native", output="tensor")`` then the flip: v2's boxes and flips, masks exact,
      images within about a grey level of v2's (docs/fields-fast.md), as uint8 tensors
      (where the files' row gives PIL images, which a training pipeline then converts).
    - ``lmdbfolder-batches``, ``lmdbfolder-native-batches``: the same, through
      ``LMDBDataset.__getitems__`` of 32 samples at a time, as a DataLoader with a batch
      size calls it (the batch's crops decoded in one run). ``VOCSegmentation`` has no
      ``__getitems__``: a DataLoader calls the files' row one sample at a time.
(a') the same pipeline followed by ``v2.ToImage()`` (the tensors a training pipeline goes on
    with; ``LMDBDataset`` then makes the crops as those tensors, no PIL image between):
    ``voc-files+toimage``, ``lmdbfolder+toimage``, ``lmdbfolder+toimage-batches``.
(b) super-resolution, BasicSR's folder layout (GT PNGs and their x``--scale`` LQ PNGs,
    DIV2K-like sizes scaled down by ``--pair-size``): a ``--gt-size`` patch, flips and rotation
    - ``basicsr-files``: BasicSR's ``PairedImageDataset`` training path written out here
      (BasicSR is not a dependency): read each file's bytes, ``cv2.imdecode`` to BGR,
      float32 / 255 (basicsr/utils/img_util.py ``imfrombytes``, lines 114-132), then
      ``paired_random_crop`` (basicsr/data/transforms.py, lines 26-91), ``augment``
      (same file, lines 94-158: cv2.flip, transpose) and ``img2tensor`` (img_util.py,
      lines 9-35: BGR to RGB, HWC to CHW float32), as ``PairedImageDataset.__getitem__``
      (basicsr/data/paired_image_dataset.py, lines 63-103) calls them; line numbers of
      XPixelGroup/BasicSR at commit 8d56e3a;
    - ``lmdbfolder-pairs``: ``LMDBDataset`` on a pack of the pairs with
      ``PairedRandomCrop(gt_size, scale, output="tensor")`` then
      ``v2.ToDtype(torch.float32, scale=True)`` (BasicSR's float32 [0, 1] RGB tensors);
    - ``fused-pair-bytes``: the fused pair plan on the files' bytes.

Reported per contestant: samples/s (wall), CPU ms per sample (this process's CPU time)
and page faults per sample (fresh pages: glibc's heap state, which every row of this one
process shares, can hand a row's allocations back as new pages, and that costs CPU), the
median of the uncontended rounds, and the CPU other processes used during
each round; a round during which other processes used more than ``--max-other`` cores
is dropped (and said). The target of issue 35: the fused rows at most 1/3 of the CPU
per sample of the files' rows. Results: a Markdown table on stdout, JSON with
``--json PATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from workdir import scratch  # noqa: E402


# -- the trees ------------------------------------------------------------------------------------
def _photo(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """A photo-like RGB image: smooth gradients and shapes, mild noise, some texture."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    fx, fy = rng.uniform(8, 40, 2)
    r = 128 + 90 * np.sin(x / fx + rng.uniform(0, 6)) * np.cos(y / fy)
    g = 255 * (x + y) / (w + h)
    cx, cy, rad = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(20, min(w, h) / 2)
    b = np.where((x - cx) ** 2 + (y - cy) ** 2 < rad**2, 210.0, 50.0)
    noise = rng.normal(0, 6, (h, w, 3))
    return np.clip(np.stack([r, g, b], -1) + noise, 0, 255).astype(np.uint8)


def make_voc(root: str, count: int, seed: int = 0) -> str:
    """A Pascal VOC 2012 tree of ``count`` photo-like JPEGs and palette masks (train split)."""
    from PIL import Image

    base = os.path.join(root, "VOCdevkit", "VOC2012")
    for sub in ("JPEGImages", "SegmentationClass", os.path.join("ImageSets", "Segmentation")):
        os.makedirs(os.path.join(base, sub), exist_ok=True)
    rng = np.random.default_rng(seed)
    names = []
    palette = [v for i in range(256) for v in ((37 * i) % 256, (91 * i) % 256, (173 * i) % 256)]
    for i in range(count):
        w, h = (500, 375) if rng.random() < 0.7 else (375, 500)
        name = f"2012_{i:06d}"
        Image.fromarray(_photo(rng, w, h)).save(os.path.join(base, "JPEGImages", name + ".jpg"), quality=90)
        yy, xx = np.mgrid[0:h, 0:w]
        classes = ((xx // rng.integers(20, 90) + yy // rng.integers(20, 90)) % 21).astype(np.uint8)
        classes[(xx + yy) % 97 == 0] = 255  # VOC's void outlines
        mask = Image.fromarray(classes, "L").convert("P")
        mask.putpalette(palette)
        mask.save(os.path.join(base, "SegmentationClass", name + ".png"))
        names.append(name)
    with open(os.path.join(base, "ImageSets", "Segmentation", "train.txt"), "w") as f:
        f.write("\n".join(names) + "\n")
    return root


def make_pairs(root: str, count: int, scale: int, size: tuple[int, int], seed: int = 1) -> tuple[str, str]:
    """BasicSR's folders: ``gt/NNNN.png`` and ``lq/NNNN.png`` (GT bicubic-downscaled by ``scale``)."""
    from PIL import Image

    gt_dir, lq_dir = os.path.join(root, "gt"), os.path.join(root, "lq")
    os.makedirs(gt_dir, exist_ok=True)
    os.makedirs(lq_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    w, h = size
    for i in range(count):
        gt = Image.fromarray(_photo(rng, w * scale, h * scale))
        gt.save(os.path.join(gt_dir, f"{i:04d}.png"))
        gt.resize((w, h), Image.Resampling.BICUBIC).save(os.path.join(lq_dir, f"{i:04d}.png"))
    return lq_dir, gt_dir


# -- BasicSR's training path on the folders (written per its code; see the module docstring) ----------
class BasicSRPairs:
    """``PairedImageDataset`` (phase train, disk backend), as BasicSR runs it."""

    def __init__(self, lq_dir: str, gt_dir: str, gt_size: int, scale: int) -> None:
        import cv2

        # One OpenCV thread, as everything else here: its pool's spinning would count as
        # BasicSR's CPU (in a DataLoader worker OpenCV's threads compete with the workers).
        cv2.setNumThreads(1)
        self.cv2 = cv2
        names = sorted(os.listdir(gt_dir))
        self.paths = [(os.path.join(lq_dir, n), os.path.join(gt_dir, n)) for n in names]
        self.gt_size, self.scale = gt_size, scale

    def __len__(self) -> int:
        return len(self.paths)

    def _imfrombytes(self, content: bytes) -> np.ndarray:
        img = self.cv2.imdecode(np.frombuffer(content, np.uint8), self.cv2.IMREAD_COLOR)
        return img.astype(np.float32) / 255.0

    def __getitem__(self, index: int) -> dict[str, Any]:
        import torch

        cv2 = self.cv2
        lq_path, gt_path = self.paths[index]
        with open(gt_path, "rb") as f:  # FileClient('disk').get
            img_gt = self._imfrombytes(f.read())
        with open(lq_path, "rb") as f:
            img_lq = self._imfrombytes(f.read())
        scale, gt_size = self.scale, self.gt_size
        lq_size = gt_size // scale
        h_lq, w_lq = img_lq.shape[:2]
        top = random.randint(0, h_lq - lq_size)
        left = random.randint(0, w_lq - lq_size)
        img_lq = img_lq[top : top + lq_size, left : left + lq_size, ...]
        img_gt = img_gt[top * scale : top * scale + gt_size, left * scale : left * scale + gt_size, ...]
        hflip = random.random() < 0.5
        vflip = random.random() < 0.5
        rot90 = random.random() < 0.5
        out = []
        for img in (img_gt, img_lq):
            if hflip:
                img = cv2.flip(img, 1)
            if vflip:
                img = cv2.flip(img, 0)
            if rot90:
                img = img.transpose(1, 0, 2)
            img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
            out.append(torch.from_numpy(img.transpose(2, 0, 1)).float())
        return {"lq": out[1], "gt": out[0], "lq_path": lq_path, "gt_path": gt_path}


# -- contestants --------------------------------------------------------------------------------------
def _voc_files(root: str, tf: Any) -> Callable[[int], Any]:
    from torchvision.datasets import VOCSegmentation, wrap_dataset_for_transforms_v2

    ds = wrap_dataset_for_transforms_v2(VOCSegmentation(root, year="2012", image_set="train"))

    def item(i: int) -> Any:
        return tf(*ds[i])

    return item


def _fused_bytes(root: str, tf: Any) -> Callable[[int], Any]:
    from lmdbfolder.read.capabilities import current
    from lmdbfolder.torch.joint import JointPlan, PendingImage, PendingMask

    caps = current()
    plan = JointPlan(tf, decoder=caps.decoder(caps.auto_decoder()))
    base = os.path.join(root, "VOCdevkit", "VOC2012")
    with open(os.path.join(base, "ImageSets", "Segmentation", "train.txt")) as f:
        names = f.read().split()

    def item(i: int) -> Any:
        with open(os.path.join(base, "JPEGImages", names[i] + ".jpg"), "rb") as f:
            image = PendingImage(f.read())
        with open(os.path.join(base, "SegmentationClass", names[i] + ".png"), "rb") as f:
            mask = PendingMask(f.read())
        return plan(image, mask)

    return item


def _lmdbfolder(pack: str, tf: Any) -> Callable[[int], Any]:
    from lmdbfolder.torch import LMDBDataset

    ds = LMDBDataset(pack, transforms=tf)
    return ds.__getitem__


#: Samples per call of the batch rows (``__getitems__``, which a DataLoader with a batch size calls).
BATCH = 32


class _Batches:
    """``LMDBDataset.__getitems__`` over BATCH samples at a time: what a DataLoader with
    ``batch_size`` calls (the fused crops of a batch decoded in one run)."""

    def __init__(self, pack: str, tf: Any) -> None:
        from lmdbfolder.torch import LMDBDataset

        self.ds = LMDBDataset(pack, transforms=tf)

    def __call__(self, i: int) -> Any:
        return self.ds[i]

    def many(self, indices: list[int]) -> Any:
        return self.ds.__getitems__(indices)


def _native_tf(size: int) -> Any:
    """The opt-in inexact crop: ``fused.RandomResizedCrop(size, resize="native", output="tensor")``
    then the flip (v2's box and flip; images resized by the compiled bilinear after a DCT
    reduction, given as uint8 tensors; masks exact). None where the compiled helper is missing."""
    from torchvision.transforms import v2

    from lmdbfolder import fused

    try:
        crop = fused.RandomResizedCrop(size, resize="native", output="tensor")
    except ImportError:
        return None
    return v2.Compose([crop, v2.RandomHorizontalFlip()])


def _fused_pair_bytes(lq_dir: str, gt_dir: str, tf: Any) -> Callable[[int], Any]:
    from lmdbfolder.read.capabilities import current
    from lmdbfolder.torch.joint import PairPlan, PendingImage

    caps = current()
    plan = PairPlan(tf, decoder=caps.decoder(caps.auto_decoder()))
    names = sorted(os.listdir(gt_dir))

    def item(i: int) -> Any:
        with open(os.path.join(lq_dir, names[i]), "rb") as f:
            lq = PendingImage(f.read())
        with open(os.path.join(gt_dir, names[i]), "rb") as f:
            gt = PendingImage(f.read())
        return plan(lq, gt)

    return item


def _make_pack(what: str, make: Callable[[], None]) -> str | None:
    """Run ``make``; the reason (a string) when this checkout cannot make the pack yet."""
    try:
        make()
    except Exception as exc:  # any failure: the row says why, the others run
        return f"{what}: {type(exc).__name__}: {exc}"
    return None


# -- the run -----------------------------------------------------------------------------------------
def _busy() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def run_once(item: Callable[[int], Any], order: list[int], seed: int) -> dict[str, float]:
    """One pass over ``order``: samples/s, CPU ms per sample, other processes' cores."""
    import torch

    torch.manual_seed(seed)
    random.seed(seed)
    many = getattr(item, "many", None)  # a batch contestant: ``many(indices)``, BATCH at a time
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    busy0, cpu0, t0 = _busy(), time.process_time(), time.perf_counter()
    if many is not None:
        for j in range(0, len(order), BATCH):
            many(order[j : j + BATCH])
    else:
        for i in order:
            item(i)
    wall, cpu, busy = time.perf_counter() - t0, time.process_time() - cpu0, _busy() - busy0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    return {
        "samples_s": len(order) / wall,
        "cpu_ms": 1000 * cpu / len(order),
        "other_cores": max(0.0, busy - cpu) / wall,
        # Fresh pages touched: glibc's heap state (shared by the rows of this one process) moves it.
        "faults": faults / len(order),
    }


def alternate(
    contestants: dict[str, Callable[[int], Any]], n: int, rounds: int, max_other: float
) -> dict[str, dict[str, Any]]:
    """Each contestant once per round over the same shuffled samples, the order rotating."""
    names = list(contestants)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    dropped: dict[str, list[float]] = {name: [] for name in names}
    order = list(range(n))
    random.Random(0).shuffle(order)
    for name in names:  # warm-up: page cache, imports, plans
        run_once(contestants[name], order[: min(8, n)], 0)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            res = run_once(contestants[name], order, 1000 + r)
            print(
                f"round {r + 1} {name}: {res['samples_s']:,.1f} samples/s, {res['cpu_ms']:.2f} CPU ms/sample, "
                f"{res['faults']:.1f} page faults/sample, others {res['other_cores']:.2f} cores",
                file=sys.stderr,
                flush=True,
            )
            (runs if res["other_cores"] <= max_other else dropped)[name].append(res)
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        kept = runs[name]
        out[name] = {
            "samples_s": statistics.median(r["samples_s"] for r in kept) if kept else None,
            "cpu_ms": statistics.median(r["cpu_ms"] for r in kept) if kept else None,
            "faults": statistics.median(r["faults"] for r in kept) if kept else None,
            "other_cores": [round(r["other_cores"], 2) for r in kept],
            "dropped_other_cores": [round(r["other_cores"], 2) for r in dropped[name]],
        }
    return out


def table(title: str, results: dict[str, dict[str, Any]], base: str, skipped: dict[str, str]) -> str:
    lines = [
        f"### {title}",
        "",
        "| contestant | samples/s | CPU ms/sample | CPU vs " + base + " | page faults/sample | other cores |",
    ]
    lines.append("|---|---:|---:|---:|---:|---|")
    ref = results.get(base, {}).get("cpu_ms")
    for name, r in results.items():
        rate = "—" if r["samples_s"] is None else f"{r['samples_s']:,.1f}"
        cpu = "—" if r["cpu_ms"] is None else f"{r['cpu_ms']:.2f}"
        ratio = "—" if r["cpu_ms"] is None or not ref else f"{r['cpu_ms'] / ref:.2f}"
        faults = "—" if r.get("faults") is None else f"{r['faults']:.1f}"
        others = ", ".join(f"{v:.2f}" for v in r["other_cores"]) or "—"
        if r["dropped_other_cores"]:
            others += f" (dropped: {', '.join(f'{v:.2f}' for v in r['dropped_other_cores'])})"
        lines.append(f"| {name} | {rate} | {cpu} | {ratio} | {faults} | {others} |")
    for name, why in skipped.items():
        lines.append(f"| {name} | not run: {why} | | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=500, help="VOC samples (default 500)")
    p.add_argument("--pairs", type=int, default=100, help="pairs (default 100)")
    p.add_argument("--size", type=int, default=224, help="RandomResizedCrop size (default 224)")
    p.add_argument("--scale", type=int, default=4, help="the pairs' scale (default 4)")
    p.add_argument("--gt-size", type=int, default=128, help="BasicSR's gt_size (default 128)")
    p.add_argument(
        "--pair-size", type=int, nargs=2, default=(510, 339), help="LQ width height (default 510 339: DIV2K x4)"
    )
    p.add_argument("--rounds", type=int, default=5, help="alternated rounds (default 5)")
    p.add_argument("--max-other", type=float, default=0.3, help="drop a round when others used more cores")
    p.add_argument("--work", default=None, help="the scratch's parent folder (default: the system's temp)")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)

    import torch
    from torchvision.transforms import v2

    import lmdbfolder

    torch.set_num_threads(1)
    report: dict[str, Any] = {"args": vars(args), "cpus": os.cpu_count()}
    with scratch(args.work, "bench-fields-", keep=args.keep) as work:
        voc_root = make_voc(os.path.join(work, "voc"), args.samples)
        lq_dir, gt_dir = make_pairs(os.path.join(work, "pairs"), args.pairs, args.scale, tuple(args.pair_size))
        tf = v2.Compose([v2.RandomResizedCrop(args.size), v2.RandomHorizontalFlip()])

        # (a) image + mask
        voc_pack = os.path.join(work, "voc.lmdb")
        skipped_a: dict[str, str] = {}

        def pack_voc() -> None:
            from torchvision.datasets import VOCSegmentation

            lmdbfolder.pack_dataset(VOCSegmentation(voc_root, year="2012", image_set="train"), voc_pack)

        why = _make_pack("pack_dataset(VOCSegmentation)", pack_voc)
        contestants_a = {"voc-files": _voc_files(voc_root, tf), "fused-bytes": _fused_bytes(voc_root, tf)}
        if why is None:
            contestants_a["lmdbfolder"] = _lmdbfolder(voc_pack, tf)
            contestants_a["lmdbfolder-batches"] = _Batches(voc_pack, tf)
            native = _native_tf(args.size)
            if native is not None:
                contestants_a["lmdbfolder-native"] = _lmdbfolder(voc_pack, native)
                contestants_a["lmdbfolder-native-batches"] = _Batches(voc_pack, native)
            else:
                skipped_a["lmdbfolder-native"] = "the compiled helper is not built here"
        else:
            skipped_a["lmdbfolder"] = why
        res_a = alternate(contestants_a, args.samples, args.rounds, args.max_other)

        # (a') the same steps then v2.ToImage(): the tensors a training pipeline goes on with.
        tensor_tf = v2.Compose([v2.RandomResizedCrop(args.size), v2.RandomHorizontalFlip(), v2.ToImage()])
        contestants_t: dict[str, Callable[[int], Any]] = {"voc-files+toimage": _voc_files(voc_root, tensor_tf)}
        skipped_t: dict[str, str] = {}
        if why is None:
            contestants_t["lmdbfolder+toimage"] = _lmdbfolder(voc_pack, tensor_tf)
            contestants_t["lmdbfolder+toimage-batches"] = _Batches(voc_pack, tensor_tf)
        else:
            skipped_t["lmdbfolder+toimage"] = why
        res_t = alternate(contestants_t, args.samples, args.rounds, args.max_other)

        # (b) pairs
        from lmdbfolder.torch.joint import PairedRandomCrop

        pair_tf = v2.Compose(
            [PairedRandomCrop(args.gt_size, args.scale, output="tensor"), v2.ToDtype(torch.float32, scale=True)]
        )
        pairs_pack = os.path.join(work, "pairs.lmdb")
        skipped_b: dict[str, str] = {}

        def pack_pairs() -> None:
            import subprocess

            cmd = [sys.executable, "-m", "lmdbfolder", "pack", os.path.join(work, "pairs"), pairs_pack]
            cmd += ["--layout", "pairs", "--scale", str(args.scale)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode == 0:
                return
            # No --layout pairs in this checkout: the same pack from Python (pack_field_samples).
            from lmdbfolder.format import NO_LABEL
            from lmdbfolder.write.fields import FieldSamples, FieldSpec, pack_field_samples

            names = sorted(os.listdir(gt_dir))

            def read(i: int) -> list[bytes]:
                out = []
                for folder in (lq_dir, gt_dir):
                    with open(os.path.join(folder, names[i]), "rb") as f:
                        out.append(f.read())
                return out

            samples = FieldSamples(
                layout="pairs",
                root=os.path.join(work, "pairs"),
                fields=(FieldSpec("lq", "image"), FieldSpec("gt", "image")),
                relpaths=[f"lq/{n}" for n in names],
                field_paths=[(f"lq/{n}", f"gt/{n}") for n in names],
                labels=[NO_LABEL] * len(names),
                classes=[],
                read=read,
                layout_info={"scale": args.scale},
            )
            pack_field_samples(samples, pairs_pack)

        basicsr = BasicSRPairs(lq_dir, gt_dir, args.gt_size, args.scale)
        contestants_b = {
            "basicsr-files": basicsr.__getitem__,
            "fused-pair-bytes": _fused_pair_bytes(lq_dir, gt_dir, pair_tf),
        }
        why = _make_pack("lmdbfolder pack --layout pairs", pack_pairs)
        if why is None:
            contestants_b["lmdbfolder-pairs"] = _lmdbfolder(pairs_pack, pair_tf)
        else:
            skipped_b["lmdbfolder-pairs"] = why
        res_b = alternate(contestants_b, args.pairs, args.rounds, args.max_other)

    report["segmentation"] = res_a
    report["segmentation_tensors"] = res_t
    report["pairs"] = res_b
    print(
        table(
            f"(a) image + mask: RandomResizedCrop({args.size}) + flip, {args.samples} VOC samples",
            res_a,
            "voc-files",
            skipped_a,
        )
    )
    print()
    print(
        table(
            f"(a') image + mask: RandomResizedCrop({args.size}) + flip + ToImage, {args.samples} VOC samples",
            res_t,
            "voc-files+toimage",
            skipped_t,
        )
    )
    print()
    print(
        table(
            f"(b) pairs x{args.scale}: gt_size {args.gt_size}, flips + rotation, {args.pairs} pairs "
            f"(LQ {args.pair_size[0]}x{args.pair_size[1]})",
            res_b,
            "basicsr-files",
            skipped_b,
        )
    )
    print(
        f"\nmedian of the uncontended rounds (other processes <= {args.max_other} cores) of {args.rounds} "
        f"alternated rounds; one process, one thread; command: python benchmarks/bench_fields.py "
        + " ".join(argv if argv is not None else sys.argv[1:])
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

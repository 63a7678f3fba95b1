"""The contestants of the peers benchmark, and the subprocess that runs one.

``benchmarks/bench_peers.py`` (the driver) starts this file once per step, with
the interpreter the contestant needs (lmdbfolder's venv, or the peers venv that
``benchmarks/peers/install.sh`` makes):

    python contestants.py probe NAME
    python contestants.py prepare NAME --tree DIR --work DIR
    python contestants.py run NAME --tree DIR --work DIR --workers W --images N --warmup M

Each prints one line ``RESULT {json}`` on stdout (anything else it prints is
the libraries' own output, which the driver keeps in a log file).

Every contestant delivers the same thing: shuffled batches of 64 uint8 CHW
tensors of 224x224 (``RandomResizedCrop(224)`` with torchvision's default
scale and ratio, then a horizontal flip with p=0.5) plus the labels. "Workers"
means DataLoader worker processes where the contestant uses the DataLoader;
FFCV, DALI and SPDL parallelise with their own threads, and get W threads
(at least 1: their in-process mode still runs one worker thread beside the
main thread).

Nothing heavy is imported at module level: each contestant imports its own
libraries, so this file runs in either venv.
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import os
import pickle
import random
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

SIZE = 224


class Unavailable(Exception):
    """This contestant cannot run here (library missing, feature not supported)."""


# ----------------------------------------------------------------------------
# The contestants


@dataclass(frozen=True)
class Contestant:
    """One row of the table."""

    name: str
    label: str
    env: str  # "lmdbfolder": lmdbfolder's interpreter; "peers": the peers venv; "baseline": either
    fmt: str  # the prepared data it reads (several rows share one); "tree": the JPEG tree itself
    parallelism: str  # what "W workers" means for it
    versus: str | None = None  # the FFCV row of the same resolution, for the "x FFCV" column


#: The resize of lmdbfolder's fast settings: the compiled one, which makes a
#: batch's JPEGs in C on threads that hold no GIL (README, "The batch fast path").
FAST_RESIZE = "native"
#: lmdbfolder's fast settings: FFCV's model, one process whose decode threads
#: make each batch (no GIL held), no transfer.
LMDBFOLDER_THREADS = "lmdbfolder threads (DataLoader num_workers=0, threads=max(W,1))"
#: The fast settings through DataLoader worker processes, with lmdbfolder's collate_fn ...
LMDBFOLDER_WORKERS = "DataLoader workers (threads=1, collate_fn=lmdbfolder.torch.collate)"
#: ... and with torch's default collate (the drop-in case: nothing to know).
LMDBFOLDER_WORKERS_DC = "DataLoader workers (threads=1, torch's default collate_fn)"

CONTESTANTS: tuple[Contestant, ...] = (
    Contestant("imagefolder", "torchvision ImageFolder", "baseline", "tree", "DataLoader workers"),
    Contestant("recipe", "blog recipe (LMDB + pickle)", "baseline", "recipe", "DataLoader workers"),
    Contestant(
        "lmdbfolder-default",
        "lmdbfolder default (torchvision RRC+flip)",
        "lmdbfolder",
        "lmdbfolder-full",
        "DataLoader workers",
    ),
    Contestant(
        "lmdbfolder-default-whole",
        "the same, whole-image decode (LMDBFOLDER_REGIONS=0)",
        "lmdbfolder",
        "lmdbfolder-full",
        "DataLoader workers",
    ),
    Contestant(
        "lmdbfolder-fast",
        "lmdbfolder fast, full-res, threads=W, num_workers=0",
        "lmdbfolder",
        "lmdbfolder-full",
        LMDBFOLDER_THREADS,
        "ffcv-full",
    ),
    Contestant(
        "lmdbfolder-fast-workers",
        "lmdbfolder fast, full-res, W workers, collate_fn=collate",
        "lmdbfolder",
        "lmdbfolder-full",
        LMDBFOLDER_WORKERS,
        "ffcv-full",
    ),
    Contestant(
        "lmdbfolder-fast-workers-dc",
        "lmdbfolder fast, full-res, W workers, default collate",
        "lmdbfolder",
        "lmdbfolder-full",
        LMDBFOLDER_WORKERS_DC,
        "ffcv-full",
    ),
    Contestant(
        "lmdbfolder-256",
        "lmdbfolder --max-size 256 fast, threads=W, num_workers=0",
        "lmdbfolder",
        "lmdbfolder-256",
        LMDBFOLDER_THREADS,
        "ffcv-256",
    ),
    Contestant(
        "lmdbfolder-256-opencv",
        "lmdbfolder --max-size 256 fast with resize='opencv', threads=W",
        "lmdbfolder",
        "lmdbfolder-256",
        LMDBFOLDER_THREADS,
        "ffcv-256",
    ),
    Contestant(
        "lmdbfolder-256-workers",
        "lmdbfolder --max-size 256 fast, W workers, collate_fn=collate",
        "lmdbfolder",
        "lmdbfolder-256",
        LMDBFOLDER_WORKERS,
        "ffcv-256",
    ),
    Contestant(
        "lmdbfolder-256-workers-dc",
        "lmdbfolder --max-size 256 fast, W workers, default collate",
        "lmdbfolder",
        "lmdbfolder-256",
        LMDBFOLDER_WORKERS_DC,
        "ffcv-256",
    ),
    Contestant(
        "lmdbfolder-256-raw",
        "lmdbfolder --max-size 256 --store raw fast, threads=W",
        "lmdbfolder",
        "lmdbfolder-256-raw",
        LMDBFOLDER_THREADS,
        "ffcv-256",
    ),
    Contestant(
        "lmdbfolder-256-webp",
        "lmdbfolder --max-size 256 --format webp fast, threads=W",
        "lmdbfolder",
        "lmdbfolder-256-webp",
        LMDBFOLDER_THREADS,
        "ffcv-256",
    ),
    Contestant(
        "ffcv-full",
        "FFCV full-res (JPEG q90), its ImageNet pipeline",
        "peers",
        "ffcv-full",
        "FFCV threads (num_workers=max(W,1))",
    ),
    Contestant(
        "ffcv-256",
        "FFCV max_resolution=256 (JPEG q90), its ImageNet pipeline",
        "peers",
        "ffcv-256",
        "FFCV threads (num_workers=max(W,1))",
    ),
    Contestant("dali", "NVIDIA DALI (CPU pipeline)", "peers", "tree", "DALI threads (num_threads=max(W,1))"),
    Contestant("spdl", "Meta SPDL", "peers", "tree", "SPDL threads (concurrency=max(W,1))"),
    Contestant("litdata", "LitData", "peers", "litdata", "StreamingDataLoader workers"),
    Contestant("webdataset", "WebDataset", "peers", "webdataset", "WebLoader workers"),
)
BY_NAME = {c.name: c for c in CONTESTANTS}

# The import that tells whether a contestant can run, and the versions it reports.
_PROBES: dict[str, tuple[str, ...]] = {
    "imagefolder": ("torch", "torchvision", "PIL"),
    "recipe": ("torch", "torchvision", "PIL", "lmdb"),
    "lmdbfolder-default": ("torch", "torchvision", "PIL", "lmdbfolder"),
    "lmdbfolder-default-whole": ("torch", "torchvision", "PIL", "lmdbfolder"),
    "lmdbfolder-fast": ("torch", "torchvision", "PIL", "lmdbfolder", "cv2"),
    "lmdbfolder-fast-workers": ("torch", "torchvision", "PIL", "lmdbfolder", "cv2"),
    "lmdbfolder-fast-workers-dc": ("torch", "torchvision", "PIL", "lmdbfolder", "cv2"),
    "lmdbfolder-256-workers-dc": ("torch", "torchvision", "PIL", "lmdbfolder", "cv2"),
    "lmdbfolder-256": ("torch", "torchvision", "PIL", "lmdbfolder", "cv2"),
    "lmdbfolder-256-opencv": ("torch", "torchvision", "PIL", "lmdbfolder", "cv2"),
    "lmdbfolder-256-workers": ("torch", "torchvision", "PIL", "lmdbfolder", "cv2"),
    "lmdbfolder-256-raw": ("torch", "torchvision", "PIL", "lmdbfolder", "cv2"),
    "lmdbfolder-256-webp": ("torch", "torchvision", "PIL", "lmdbfolder", "cv2"),
    "ffcv-full": ("torch", "ffcv", "numba", "numpy", "cv2"),
    "ffcv-256": ("torch", "ffcv", "numba", "numpy", "cv2"),
    "dali": ("torch", "nvidia.dali"),
    "spdl": ("torch", "torchvision", "spdl"),
    "litdata": ("torch", "torchvision", "litdata"),
    "webdataset": ("torch", "torchvision", "PIL", "webdataset"),
}
_DISTS = {"PIL": "pillow", "cv2": "opencv-python", "nvidia.dali": "nvidia-dali-cuda120", "lmdbfolder": "lmdbfolder"}


def _version(module: str) -> str:
    from importlib import metadata

    mod = sys.modules[module]
    for dist in (_DISTS.get(module, module), module, "opencv-python-headless", "nvidia-dali-cuda130"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return str(getattr(mod, "__version__", "?"))


def probe(name: str) -> dict[str, Any]:
    """Import what ``name`` needs; report the versions, or why it cannot run."""
    import importlib

    versions = {}
    for module in _PROBES[name]:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001  (any import failure means "cannot run")
            raise Unavailable(f"import {module} failed: {type(exc).__name__}: {exc}") from exc
        versions[module] = _version(module)
    if name == "lmdbfolder-256-webp" and not _lmdbfolder_has_format():
        raise Unavailable("not supported by this lmdbfolder (pack has no --format option)")
    if name == "spdl":
        import spdl.io

        try:
            spdl.io.demux_image  # noqa: B018
            from spdl.io.lib import _import_libspdl

            _import_libspdl()
        except Exception as exc:  # noqa: BLE001
            raise Unavailable(f"spdl cannot load FFmpeg: {exc}") from exc
    versions["python"] = sys.version.split()[0]
    if "torch" in sys.modules:
        import torch

        versions["torch_threads"] = str(torch.get_num_threads())
    return {"versions": versions, "executable": sys.executable}


# ----------------------------------------------------------------------------
# Helpers shared by several contestants


def scan_tree(tree: str) -> list[tuple[str, int]]:
    """(path, label) of every image, with ImageFolder's rules for this tree's
    layout: sorted class folders, then sorted files under each."""
    classes = sorted(e.name for e in os.scandir(tree) if e.is_dir())
    samples = []
    for label, cls in enumerate(classes):
        for dirpath, dirnames, files in sorted(os.walk(os.path.join(tree, cls))):
            dirnames.sort()
            for f in sorted(files):
                if f.lower().endswith((".jpg", ".jpeg")):
                    samples.append((os.path.join(dirpath, f), label))
    if not samples:
        raise SystemExit(f"no JPEG files in class folders under {tree}")
    return samples


def pil_transform() -> Any:
    """torchvision's RandomResizedCrop(224) + flip + PILToTensor (the baseline)."""
    from torchvision import transforms as T

    return T.Compose([T.RandomResizedCrop(SIZE), T.RandomHorizontalFlip(), T.PILToTensor()])


def tensor_transform() -> Any:
    """The same on a uint8 CHW tensor (torchvision v2, antialiased bilinear)."""
    from torchvision.transforms import v2

    return v2.Compose([v2.RandomResizedCrop(SIZE, antialias=True), v2.RandomHorizontalFlip()])


def dataloader(dataset: Any, workers: int, batch: int, **kw: Any) -> Any:
    """torch's DataLoader as every DataLoader contestant uses it."""
    from torch.utils.data import DataLoader

    return DataLoader(
        dataset,
        batch_size=batch,
        shuffle=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        drop_last=True,
        **kw,
    )


def disk_bytes(path: str) -> int:
    """Bytes of a file or folder: the apparent size, or the allocated size when
    smaller (a sparse file, as an LMDB map can be)."""
    files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    total = 0
    for f in files:
        st = os.stat(f)
        total += min(st.st_size, st.st_blocks * 512)
    return total


# ----------------------------------------------------------------------------
# lmdbfolder


_PACK_ARGS = {
    "lmdbfolder-full": [],
    "lmdbfolder-256": ["--max-size", "256", "--quality", "90"],
    "lmdbfolder-256-raw": ["--max-size", "256", "--store", "raw"],
    "lmdbfolder-256-webp": ["--max-size", "256", "--format", "webp"],
}


def _lmdbfolder_pack_help() -> str:
    import contextlib

    from lmdbfolder.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(["pack", "--help"])
        except SystemExit:
            pass
    return out.getvalue()


def _lmdbfolder_has_format() -> bool:
    return "--format" in _lmdbfolder_pack_help()


def prepare_lmdbfolder(fmt: str, tree: str, out: str) -> dict[str, Any]:
    """``lmdbfolder pack`` through its command line, in this process."""
    import contextlib

    from lmdbfolder.cli import main

    if fmt == "lmdbfolder-256-webp" and not _lmdbfolder_has_format():
        raise Unavailable("not supported by this lmdbfolder (pack has no --format option)")
    argv = ["pack", tree, out, "--json", *_PACK_ARGS[fmt]]
    captured = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(captured):
        rc = main(argv)
    seconds = time.perf_counter() - start
    if rc != 0:
        raise RuntimeError(f"lmdbfolder {' '.join(argv)} exited {rc}: {captured.getvalue()[-500:]}")
    return {"write_s": seconds, "command": "lmdbfolder " + " ".join(argv)}


def loader_lmdbfolder(name: str, work: str, workers: int, batch: int) -> Any:
    """LMDBFolder with torchvision's transform (default) or lmdbfolder's fast settings."""
    from torchvision import transforms as T

    from lmdbfolder.torch import LMDBFolder

    path = os.path.join(work, BY_NAME[name].fmt)
    if name in ("lmdbfolder-default", "lmdbfolder-default-whole"):
        # Region decoding (lmdbfolder.read.regions) off for the "-whole" row: what it
        # saves, measured in the same run. The switch is read once per process, when
        # the capabilities are first asked for: start a fresh snapshot after setting
        # it (forked workers inherit it).
        from lmdbfolder.read.capabilities import install

        os.environ["LMDBFOLDER_REGIONS"] = "0" if name.endswith("-whole") else "1"
        install(None)
        return dataloader(LMDBFolder(path, transform=pil_transform()), workers, batch)
    from lmdbfolder import fused
    from lmdbfolder.torch import collate

    resize = "opencv" if name.endswith("-opencv") else FAST_RESIZE
    tf = T.Compose([fused.RandomResizedCrop(SIZE, resize=resize, output="tensor"), T.RandomHorizontalFlip()])
    if name.endswith("-workers"):
        return dataloader(LMDBFolder(path, transform=tf), workers, batch, collate_fn=collate)
    if name.endswith("-workers-dc"):  # the drop-in case: torch's default collate_fn
        return dataloader(LMDBFolder(path, transform=tf), workers, batch)
    # Fast settings: the batch path on max(W, 1) threads of this process (as FFCV's threads).
    return dataloader(LMDBFolder(path, transform=tf, threads=max(workers, 1)), 0, batch, collate_fn=collate)


# ----------------------------------------------------------------------------
# torchvision ImageFolder and the blog recipe


def loader_imagefolder(tree: str, workers: int, batch: int) -> Any:
    """torchvision's ImageFolder, PIL decode, torchvision transforms."""
    from torchvision.datasets import ImageFolder

    return dataloader(ImageFolder(tree, transform=pil_transform()), workers, batch)


def prepare_recipe(tree: str, out: str) -> dict[str, Any]:
    """The blog recipe's folder2lmdb: one LMDB, pickled ``(bytes, label)`` values."""
    import lmdb

    samples = scan_tree(tree)
    total = sum(os.path.getsize(p) for p, _ in samples)
    start = time.perf_counter()
    os.makedirs(out)
    env = lmdb.open(out, map_size=int(total * 1.5) + (64 << 20), subdir=True, readonly=False, meminit=False)
    txn = env.begin(write=True)
    for i, (path, label) in enumerate(samples):
        with open(path, "rb") as f:
            txn.put(f"{i}".encode(), pickle.dumps((f.read(), label)))
        if (i + 1) % 1000 == 0:
            txn.commit()
            txn = env.begin(write=True)
    txn.put(b"__len__", pickle.dumps(len(samples)))
    txn.commit()
    env.sync()
    env.close()
    return {"write_s": time.perf_counter() - start}


class RecipeDataset:
    """The blog recipe's reader: opened lazily in each worker, lock=False,
    readahead=False, pickle.loads per sample, PIL decode."""

    def __init__(self, path: str, transform: Any) -> None:
        self.path = path
        self.transform = transform
        self.env: Any = None
        env = self._open()
        with env.begin() as txn:
            self.length = pickle.loads(txn.get(b"__len__"))
        env.close()
        self.env = None

    def _open(self) -> Any:
        import lmdb

        return lmdb.open(self.path, readonly=True, lock=False, readahead=False, meminit=False)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[Any, int]:
        from PIL import Image

        if self.env is None:
            self.env = self._open()
        with self.env.begin(write=False) as txn:
            data, label = pickle.loads(txn.get(f"{index}".encode()))
        img = Image.open(io.BytesIO(data)).convert("RGB")
        return self.transform(img), label


def loader_recipe(work: str, workers: int, batch: int) -> Any:
    return dataloader(RecipeDataset(os.path.join(work, "recipe"), pil_transform()), workers, batch)


# ----------------------------------------------------------------------------
# FFCV


def prepare_ffcv(fmt: str, tree: str, out: str) -> dict[str, Any]:
    """FFCV's DatasetWriter from torchvision's ImageFolder: every image decoded
    and re-encoded as JPEG q90 (at most 256 px on the longer side for ffcv-256)."""
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter
    from torchvision.datasets import ImageFolder

    max_res = 256 if fmt == "ffcv-256" else None
    fields = {
        "image": RGBImageField(write_mode="jpg", max_resolution=max_res, jpeg_quality=90),
        "label": IntField(),
    }
    os.makedirs(out)
    start = time.perf_counter()
    DatasetWriter(os.path.join(out, "data.beton"), fields, num_workers=os.cpu_count() or 1).from_indexed_dataset(
        ImageFolder(tree)
    )
    return {
        "write_s": time.perf_counter() - start,
        "command": f"RGBImageField(write_mode='jpg', max_resolution={max_res}, jpeg_quality=90)",
    }


def loader_ffcv(name: str, work: str, workers: int, batch: int, seed: int) -> Any:
    """FFCV's Loader as its ImageNet example builds it (ffcv-imagenet's
    train_imagenet.py, ``create_train_loader``; see benchmarks/README.md): its fused
    RandomResizedCrop decoder, flip, ``ToTensor``, ``ToTorchImage()`` (the default,
    ``channels_last=True``: an N x 3 x H x W view of FFCV's N x H x W x 3 batch, for
    a channels_last model), ``os_cache`` on (the example's configs set
    ``in_memory: 1``). Not the example's GPU steps (``ToDevice``, ``NormalizeImage``):
    every contestant delivers uint8 on the CPU. The order is RANDOM, as the example
    uses it with ``distributed``; without, it uses QUASI_RANDOM, which FFCV's own
    docstring calls "mostly useful when os_cache=False" (a page-local order for
    reads from disk; here every format is in the page cache)."""
    from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import RandomHorizontalFlip, Squeeze, ToTensor, ToTorchImage

    return Loader(
        os.path.join(work, BY_NAME[name].fmt, "data.beton"),
        batch_size=batch,
        num_workers=max(workers, 1),
        order=OrderOption.RANDOM,
        os_cache=True,
        drop_last=True,
        seed=seed,
        pipelines={
            "image": [
                RandomResizedCropRGBImageDecoder((SIZE, SIZE)),
                RandomHorizontalFlip(),
                ToTensor(),
                ToTorchImage(),
            ],
            "label": [IntDecoder(), ToTensor(), Squeeze()],
        },
    )


# ----------------------------------------------------------------------------
# NVIDIA DALI (CPU)


def loader_dali(tree: str, workers: int, batch: int, seed: int) -> Any:
    """DALI's CPU pipeline: file reader (its shuffle buffer), ROI-decoding
    ``image_random_crop`` (RandomResizedCrop's scale and ratio), resize to
    224x224, random mirror, uint8 CHW."""
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    @pipeline_def(batch_size=batch, num_threads=max(workers, 1), device_id=None, seed=seed)
    def pipe() -> Any:
        jpegs, labels = fn.readers.file(file_root=tree, random_shuffle=True, name="Reader")
        images = fn.decoders.image_random_crop(
            jpegs, device="cpu", output_type=types.RGB, random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3]
        )
        images = fn.resize(images, resize_x=SIZE, resize_y=SIZE)
        images = fn.crop_mirror_normalize(
            images, dtype=types.UINT8, output_layout="CHW", mirror=fn.random.coin_flip(probability=0.5)
        )
        return images, labels

    p = pipe()
    p.build()
    it = DALIGenericIterator(
        [p], ["image", "label"], reader_name="Reader", last_batch_policy=LastBatchPolicy.DROP, auto_reset=True
    )

    class _Batches:
        def __iter__(self) -> Iterator[tuple[Any, Any]]:
            for out in it:
                yield out[0]["image"], out[0]["label"]

    return _Batches()


# ----------------------------------------------------------------------------
# Meta SPDL


class SPDLLoader:
    """SPDL's thread pipeline over the tree: FFmpeg demux + decode with a filter
    graph doing the crop (box from torchvision's ``get_params``), the bilinear
    scale to 224x224 and the flip; batches converted with ``convert_frames``."""

    def __init__(self, tree: str, workers: int, batch: int, seed: int) -> None:
        self.samples = scan_tree(tree)
        self.threads = max(workers, 1)
        self.batch = batch
        self.rng = random.Random(seed)

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        import spdl.io
        import torch
        from spdl.pipeline import PipelineBuilder
        from torchvision import transforms as T

        rrc = T.RandomResizedCrop(SIZE)
        order = list(range(len(self.samples)))
        self.rng.shuffle(order)

        def load(i: int) -> tuple[Any, int]:
            path, label = self.samples[i]
            packets = spdl.io.demux_image(path)
            w, h = packets.width, packets.height
            shape = torch.empty((1, 1, 1), dtype=torch.uint8).expand(1, h, w)
            top, left, ch, cw = rrc.get_params(shape, list(rrc.scale), list(rrc.ratio))
            flip = ",hflip" if random.random() < 0.5 else ""
            desc = f"crop={cw}:{ch}:{left}:{top},scale={SIZE}:{SIZE}:flags=bilinear{flip},format=rgb24"
            return spdl.io.decode_packets(packets, filter_desc=desc), label

        def collate(items: list[tuple[Any, int]]) -> tuple[Any, Any]:
            frames = spdl.io.convert_frames([f for f, _ in items])
            images = spdl.io.to_torch(frames).permute(0, 3, 1, 2).contiguous()
            return images, torch.tensor([label for _, label in items])

        pipeline = (
            PipelineBuilder()
            .add_source(order)
            .pipe(load, concurrency=self.threads)
            .aggregate(self.batch, drop_last=True)
            .pipe(collate)
            .add_sink(3)
            .build(num_threads=self.threads)
        )
        with pipeline.auto_stop():
            yield from pipeline.get_iterator()


# ----------------------------------------------------------------------------
# LitData


def _litdata_item(sample: tuple[str, int]) -> dict[str, Any]:
    from PIL import Image

    path, label = sample
    # A JpegImageFile with a filename: LitData stores the file's bytes as they are.
    return {"image": Image.open(path), "label": label}


def prepare_litdata(tree: str, out: str) -> dict[str, Any]:
    """``litdata.optimize`` of the tree (original JPEG bytes, 64 MB chunks)."""
    import litdata

    samples = scan_tree(tree)
    start = time.perf_counter()
    litdata.optimize(
        fn=_litdata_item,
        inputs=samples,
        output_dir=out,
        chunk_bytes="64MB",
        num_workers=os.cpu_count() or 1,
        verbose=False,
    )
    return {"write_s": time.perf_counter() - start}


def _litdata_transform() -> Callable[[dict[str, Any]], tuple[Any, int]]:
    tf = tensor_transform()

    def apply(item: dict[str, Any]) -> tuple[Any, int]:
        return tf(item["image"]), item["label"]

    return apply


def loader_litdata(work: str, workers: int, batch: int, seed: int) -> Any:
    """StreamingDataset (its chunk + in-chunk shuffle, torchvision decode_jpeg to
    a tensor) + the v2 transforms, StreamingDataLoader."""
    import litdata

    ds = litdata.StreamingDataset(
        os.path.join(work, "litdata"),
        cache_dir=os.path.join(work, "litdata-cache"),
        shuffle=True,
        drop_last=True,
        seed=seed,
        transform=_litdata_transform(),
    )
    return litdata.StreamingDataLoader(
        ds, batch_size=batch, num_workers=workers, persistent_workers=workers > 0, drop_last=True
    )


# ----------------------------------------------------------------------------
# WebDataset


def prepare_webdataset(tree: str, out: str) -> dict[str, Any]:
    """tar shards (16, or ~1,000 images each for bigger trees) written in a
    shuffled order, as WebDataset recommends (its reader only shuffles a buffer)."""
    import webdataset as wds

    samples = scan_tree(tree)
    random.Random(0).shuffle(samples)
    per_shard = max(1, min(1000, -(-len(samples) // 16)))
    os.makedirs(out)
    start = time.perf_counter()
    with wds.ShardWriter(os.path.join(out, "shard-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i, (path, label) in enumerate(samples):
            with open(path, "rb") as f:
                sink.write({"__key__": f"{i:08d}", "jpg": f.read(), "cls": label})
    return {"write_s": time.perf_counter() - start, "shards": len(glob.glob(os.path.join(out, "*.tar")))}


def loader_webdataset(work: str, workers: int, batch: int, seed: int) -> Any:
    """WebDataset: shard shuffle, a 1,000-sample shuffle buffer, PIL decode,
    the torchvision transforms, batched in the workers; WebLoader."""
    import webdataset as wds

    urls = sorted(glob.glob(os.path.join(work, "webdataset", "*.tar")))
    ds = (
        wds.WebDataset(urls, shardshuffle=len(urls), seed=seed, empty_check=False)
        .shuffle(1000)
        .decode("pil")
        .to_tuple("jpg", "cls")
        .map_tuple(pil_transform(), int)
        .batched(batch, partial=False)
    )
    return wds.WebLoader(ds, batch_size=None, num_workers=workers, persistent_workers=workers > 0)


# ----------------------------------------------------------------------------
# Dispatch


def prepare(name: str, tree: str, work: str) -> dict[str, Any]:
    """Write the format ``name`` reads under ``work`` (once; rows share formats)."""
    fmt = BY_NAME[name].fmt
    out = os.path.join(work, fmt)
    if fmt == "tree":
        return {"write_s": None, "bytes": disk_bytes(tree), "count": len(scan_tree(tree))}
    if os.path.exists(out):
        raise RuntimeError(f"{out} exists; the driver removes unfinished formats before preparing them")
    if fmt.startswith("lmdbfolder-"):
        result = prepare_lmdbfolder(fmt, tree, out)
    elif fmt == "recipe":
        result = prepare_recipe(tree, out)
    elif fmt.startswith("ffcv-"):
        result = prepare_ffcv(fmt, tree, out)
    elif fmt == "litdata":
        result = prepare_litdata(tree, out)
    elif fmt == "webdataset":
        result = prepare_webdataset(tree, out)
    else:
        raise ValueError(f"unknown format {fmt}")
    result["bytes"] = disk_bytes(out)
    result["count"] = len(scan_tree(tree))
    return result


def make_loader(name: str, tree: str, work: str, workers: int, batch: int, seed: int) -> Iterable[Any]:
    """An iterable of (images, labels) batches; iterating it again is a new epoch."""
    if name == "imagefolder":
        return loader_imagefolder(tree, workers, batch)
    if name == "recipe":
        return loader_recipe(work, workers, batch)
    if name.startswith("lmdbfolder-"):
        return loader_lmdbfolder(name, work, workers, batch)
    if name.startswith("ffcv-"):
        return loader_ffcv(name, work, workers, batch, seed)
    if name == "dali":
        return loader_dali(tree, workers, batch, seed)
    if name == "spdl":
        return SPDLLoader(tree, workers, batch, seed)
    if name == "litdata":
        return loader_litdata(work, workers, batch, seed)
    if name == "webdataset":
        return loader_webdataset(work, workers, batch, seed)
    raise ValueError(f"unknown contestant {name}")


def _tree_cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and all its descendants now."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    mine = {os.getpid()}
    grew = True
    while grew:
        grew = False
        for pid, ppid in parents.items():
            if ppid in mine and pid not in mine:
                mine.add(pid)
                grew = True
    return sum(times.get(pid, 0.0) for pid in mine)


def machine_busy_seconds() -> tuple[float, float]:
    """CPU seconds every process on the machine has used since boot (user, nice,
    system, irq, softirq, and steal: time this VM's CPUs were taken by the host), and
    the steal part alone, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq + steal) / tick, steal / tick


def epochs(loader: Any, name: str) -> Iterator[Any]:
    """The loader's batches, epoch after epoch, so that a small tree still serves any
    number of images; RuntimeError for an epoch without a batch (fewer samples than
    one batch with ``drop_last``), which would otherwise loop for ever."""
    while True:
        produced = False
        for b in loader:
            produced = True
            yield b
        if not produced:
            raise RuntimeError(f"{name}: an epoch produced no batch")


def run(
    name: str, tree: str, work: str, workers: int, images: int, warmup: int, batch: int, seed: int
) -> dict[str, Any]:
    """Warm up, then time ``images`` images (whole batches) and check every batch."""
    import torch

    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
    start = time.perf_counter()
    loader = make_loader(name, tree, work, workers, batch, seed)

    it = epochs(loader, name)
    seen = 0
    while seen < warmup:
        x, _ = next(it)
        seen += len(x)
    first = time.perf_counter() - start
    cpu0 = _tree_cpu_seconds()
    busy0, steal0 = machine_busy_seconds()
    t0 = time.perf_counter()
    n = 0
    while n < images:
        x, y = next(it)
        if not isinstance(x, torch.Tensor) or x.dtype != torch.uint8 or tuple(x.shape[1:]) != (3, SIZE, SIZE):
            raise RuntimeError(
                f"{name}: batch is {type(x).__name__} {getattr(x, 'dtype', '')} {tuple(getattr(x, 'shape', ()))}, "
                f"expected uint8 (B, 3, {SIZE}, {SIZE})"
            )
        if len(y) != len(x):
            raise RuntimeError(f"{name}: {len(x)} images but {len(y)} labels")
        n += len(x)
    seconds = time.perf_counter() - t0
    busy1, steal1 = machine_busy_seconds()
    cpu = _tree_cpu_seconds() - cpu0
    return {
        "images": n,
        "seconds": seconds,
        "img_s": n / seconds,
        "cpu_ms_per_img": 1000 * cpu / n,
        # What the rest of the machine used meanwhile, in cores: all the CPU time
        # /proc/stat counts, less this run's own process tree (the driver waits idle).
        "other_cores": max(0.0, (busy1 - busy0) - cpu) / seconds,
        "steal_cores": (steal1 - steal0) / seconds,
        "own_cores": cpu / seconds,
        "startup_s": first,
        "torch_threads": torch.get_num_threads(),
        "contiguous": bool(x.is_contiguous()),
        "channels_last": bool(x.is_contiguous(memory_format=torch.channels_last)),
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of the subprocess; prints ``RESULT {json}``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cmd", choices=("probe", "prepare", "run"))
    parser.add_argument("name", choices=sorted(BY_NAME))
    parser.add_argument("--tree")
    parser.add_argument("--work")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=320)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch-threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.torch_threads is not None:
        import torch

        torch.set_num_threads(args.torch_threads)
    try:
        if args.cmd == "probe":
            result: dict[str, Any] = probe(args.name)
        elif args.cmd == "prepare":
            result = prepare(args.name, args.tree, args.work)
        else:
            result = run(args.name, args.tree, args.work, args.workers, args.images, args.warmup, args.batch, args.seed)
        result["ok"] = True
    except Unavailable as exc:
        result = {"ok": False, "unavailable": True, "error": str(exc)}
    sys.stdout.flush()
    print("RESULT " + json.dumps(result), flush=True)
    # Some loaders (DALI, FFCV, SPDL) keep threads that can delay exit; the
    # result is out, so leave at once.
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())

"""The GPU batch path (lmdbfolder.gpu), run on CPU tensors; the `cuda` tests need a GPU and skip without one.

Oracles: torchvision's own RandomResizedCrop/RandomHorizontalFlip (the boxes
and flips it applies, recorded from its calls) and the CPU path
(``LMDBFolder`` + torchvision's transforms + ``PILToTensor``) for pixels.
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF
from PIL import Image, ImageFile
from torch.utils.data import ConcatDataset, DataLoader
from torchvision import transforms as T

from conftest import image_bytes, write
from lmdbfolder.bench.gpu_timing import time_device_path, time_device_transform
from lmdbfolder.bench.synthetic import synthetic_jpeg
from lmdbfolder.errors import DecodeError
from lmdbfolder.gpu import (
    STAT_KEYS,
    DeviceRandomResizedCrop,
    RecordBatch,
    RecordBytes,
    collate_records,
)
from lmdbfolder.read.capabilities import current
from lmdbfolder.torch import LMDBFolder
from lmdbfolder.torch.gpu import _vertical_first_never, _vertical_first_new
from lmdbfolder.write.writer import pack

SIZE = 40
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available())")


def _photo_tree(root: Path, per_class: int = 6) -> Path:
    """Small photo-like JPEGs (smooth colour field + noise) of several shapes and
    encoder settings: 4:2:0, 4:4:4, progressive, grayscale."""
    rng = np.random.default_rng(7)
    shapes = [(96, 72), (72, 96), (120, 50), (64, 64), (30, 140), (57, 43)]
    for c in range(2):
        for k in range(per_class):
            w, h = shapes[(k + c) % len(shapes)]
            data = synthetic_jpeg(rng, w, h, quality=90)
            if k == 1:  # re-encode: 4:4:4 and progressive variants
                img = Image.open(io.BytesIO(data))
                out = io.BytesIO()
                img.save(out, "JPEG", quality=85, subsampling=0, progressive=c == 1)
                data = out.getvalue()
            if k == 2 and c == 0:
                img = Image.open(io.BytesIO(data)).convert("L")
                out = io.BytesIO()
                img.save(out, "JPEG", quality=90)
                data = out.getvalue()
            write(root / f"class{c}" / f"img{k}.jpg", data)
    return root


@pytest.fixture(scope="module")
def photo_pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("gpu")
    src = _photo_tree(base / "src")
    pack(src, base / "photos.lmdb", progress=False)
    return base / "photos.lmdb"


def _cpu_reference(pack_dir: Path, seed: int, flip: bool = True) -> torch.Tensor:
    """The CPU path, sample by sample in index order, in this process."""
    steps: list[Any] = [T.RandomResizedCrop(SIZE)]
    if flip:
        steps.append(T.RandomHorizontalFlip())
    ds = LMDBFolder(pack_dir, transform=T.Compose([*steps, T.PILToTensor()]))
    torch.manual_seed(seed)
    return torch.stack([ds[i][0] for i in range(len(ds))])


def _all(ds: RecordBytes) -> RecordBatch:
    return ds.__getitems__(list(range(len(ds))))


# -- crop boxes and random numbers ------------------------------------------------------------------
def test_boxes_and_flips_are_torchvisions(photo_pack: Path) -> None:
    """The boxes/flips torchvision applies (recorded from its calls) are the ones we draw, and the RNG ends equal."""
    ds = LMDBFolder(photo_pack)
    images = [ds[i][0] for i in range(len(ds))]
    tv = T.Compose([T.RandomResizedCrop(SIZE, scale=(0.05, 1.0)), T.RandomHorizontalFlip(p=0.3)])
    boxes: list[tuple[int, ...]] = []
    flips: list[int] = []
    real_crop, real_flip = TF.resized_crop, TF.hflip

    def record_crop(img: Any, top: int, left: int, height: int, width: int, *a: Any, **k: Any) -> Any:
        boxes.append((int(top), int(left), int(height), int(width)))
        flips.append(0)
        return real_crop(img, top, left, height, width, *a, **k)

    def record_flip(img: Any) -> Any:
        flips[-1] = 1
        return real_flip(img)

    torch.manual_seed(123)
    with mock.patch.object(TF, "resized_crop", record_crop), mock.patch.object(TF, "hflip", record_flip):
        for img in images:
            tv(img)
    tv_state = torch.get_rng_state()

    crop = DeviceRandomResizedCrop(SIZE, scale=(0.05, 1.0), flip=0.3, device="cpu")
    torch.manual_seed(123)
    ours = [crop.draw(*img.size) for img in images]
    assert [o[:4] for o in ours] == boxes
    assert [o[4] for o in ours] == flips
    assert 0 < sum(flips) < len(flips)
    assert torch.equal(torch.get_rng_state(), tv_state)  # same random numbers consumed

    # Planned in the dataset: the same draws, stored in the batch.
    torch.manual_seed(123)
    batch = _all(RecordBytes(photo_pack, plan=crop))
    assert batch.planned
    assert batch.meta[:, 7:11].tolist() == [list(b) for b in boxes]
    assert batch.meta[:, 11].tolist() == flips


def test_no_flip_draws_no_number(photo_pack: Path) -> None:
    crop = DeviceRandomResizedCrop(SIZE, flip=None, device="cpu")
    torch.manual_seed(5)
    drawn = [crop.draw(96, 72) for _ in range(4)]
    state = torch.get_rng_state()
    torch.manual_seed(5)
    rrc = T.RandomResizedCrop(SIZE)
    shape = torch.empty((1, 1, 1)).expand(1, 72, 96)
    expected = [(*rrc.get_params(shape, list(rrc.scale), list(rrc.ratio)), 0) for _ in range(4)]
    assert drawn == expected and torch.equal(torch.get_rng_state(), state)


# -- pixels against the CPU path --------------------------------------------------------------------
@pytest.mark.parametrize("planned", [False, True])
def test_pixels_identical_to_cpu_path(photo_pack: Path, planned: bool) -> None:
    """Measured on CPU: max and mean absolute difference 0 (bit-identical), planned or not."""
    ref = _cpu_reference(photo_pack, seed=11)
    crop = DeviceRandomResizedCrop(SIZE, device="cpu")
    torch.manual_seed(11)
    batch = _all(RecordBytes(photo_pack, plan=crop if planned else None))
    images, targets = crop(batch)
    assert images.dtype == torch.uint8 and images.shape == (len(ref), 3, SIZE, SIZE)
    diff = (images.int() - ref.int()).abs()
    assert diff.max().item() == 0 and diff.float().mean().item() == 0.0
    assert targets.tolist() == LMDBFolder(photo_pack).targets
    assert crop.stats["device"] == len(ref) and sum(crop.stats.values()) == len(ref)


def test_float_output_is_totensor_then_normalize(photo_pack: Path) -> None:
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    ref = _cpu_reference(photo_pack, seed=3)
    expected = T.Normalize(mean, std)(ref.float().div(255))
    crop = DeviceRandomResizedCrop(SIZE, device="cpu", output="float", mean=mean, std=std)
    torch.manual_seed(3)
    images, _ = crop(_all(RecordBytes(photo_pack)))
    assert images.dtype == torch.float32
    assert torch.equal(images, expected)


def test_resize_follows_pillows_pass_order() -> None:
    """Recent Pillow resizes tall shrinks vertical pass first (the rounding differs): the installed one is followed."""
    rng = np.random.default_rng(2)
    src = Image.fromarray(synthetic_jpeg_array(rng, 90, 160))
    tensor = torch.from_numpy(np.asarray(src).copy()).permute(2, 0, 1)
    crop = DeviceRandomResizedCrop((24, 30), device="cpu")
    orders = set()
    for _ in range(30):
        h, w = int(rng.integers(5, 161)), int(rng.integers(5, 91))
        top, left = int(rng.integers(0, 161 - h)), int(rng.integers(0, 91 - w))
        want = np.asarray(src.crop((left, top, left + w, top + h)).resize((30, 24), Image.Resampling.BILINEAR))
        got = crop._resize([tensor], [(top, left, h, w)], [0])[0].permute(1, 2, 0).numpy()
        assert np.array_equal(got, want), (h, w)
        orders.add(_vertical_first_new(h, w, 24, 30))
    assert orders == {False, True}  # crops of both kinds were checked
    # The order the capabilities found is the one this resize follows.
    found = current().pillow_pass_order()
    assert crop._vertical_first is (_vertical_first_new if found == 1 else _vertical_first_never)


def synthetic_jpeg_array(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(synthetic_jpeg(rng, w, h))).convert("RGB"))


def test_big_batches_are_resized_in_chunks(photo_pack: Path) -> None:
    ref = _cpu_reference(photo_pack, seed=8)
    crop = DeviceRandomResizedCrop(SIZE, device="cpu", chunk_bytes=1)  # one sample per chunk
    torch.manual_seed(8)
    images, _ = crop(_all(RecordBytes(photo_pack)))
    assert torch.equal(images, ref)


# -- fallbacks -------------------------------------------------------------------------------------
def _odd_pack(tmp_path: Path, *, truncated: bool = False, corrupt: bool = False) -> Path:
    rng = np.random.default_rng(3)
    src = tmp_path / "odd"
    for n, kind in enumerate(
        ["rgb_jpeg", "gray_jpeg", "cmyk_jpeg", "rgba_png", "gray_png", "webp", "progressive_jpeg"]
    ):
        data, ext = image_bytes(kind, rng, w=50 + n, h=38 + n)
        write(src / "a" / f"{n:02d}_{kind}{ext}", data)
    good, _ = image_bytes("rgb_jpeg", rng, w=60, h=45)
    if truncated:
        write(src / "b" / "truncated.jpg", good[: len(good) * 2 // 3])
    if corrupt:
        sos = good.index(b"\xff\xda")
        body = bytes(rng.integers(0, 256, len(good) - sos - 20, dtype=np.uint8))
        write(src / "b" / "corrupt.jpg", good[:sos] + b"\xff\xda" + body + b"\xff\xd9")
    out = tmp_path / f"odd-{truncated}-{corrupt}.lmdb"
    pack(src, out, check="none", progress=False)
    return out


def test_fallback_counters_and_pixels(tmp_path: Path) -> None:
    odd = _odd_pack(tmp_path)
    ref = _cpu_reference(odd, seed=4)
    crop = DeviceRandomResizedCrop(SIZE, device="cpu")
    torch.manual_seed(4)
    images, _ = crop(_all(RecordBytes(odd, plan=crop)))
    assert torch.equal(images, ref)  # Pillow's RGB conversion for every odd record
    assert crop.stats == dict.fromkeys(STAT_KEYS, 0) | {"device": 3, "cpu_cmyk": 1, "cpu_not_jpeg": 3}


def test_truncated_jpeg_is_pillows_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    odd = _odd_pack(tmp_path, truncated=True)
    ds = RecordBytes(odd)
    idx = ds.reader.index_of("b/truncated.jpg")
    crop = DeviceRandomResizedCrop(SIZE, device="cpu")
    with pytest.raises(DecodeError) as info:
        crop(_all(ds))
    assert info.value.index == idx and info.value.path == "b/truncated.jpg"
    assert "truncated" in str(info.value) and crop.stats["cpu_truncated"] == 1
    # As for ImageFolder, Pillow's LOAD_TRUNCATED_IMAGES lets it through; the pixels are Pillow's.
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    ref = _cpu_reference(odd, seed=9)
    crop = DeviceRandomResizedCrop(SIZE, device="cpu")
    torch.manual_seed(9)
    images, _ = crop(_all(ds))
    assert torch.equal(images, ref) and crop.stats["cpu_truncated"] == 1


def test_jpeg_the_decoder_refuses(tmp_path: Path) -> None:
    odd = _odd_pack(tmp_path, corrupt=True)
    ds = RecordBytes(odd)
    idx = ds.reader.index_of("b/corrupt.jpg")
    crop = DeviceRandomResizedCrop(SIZE, device="cpu")
    with pytest.raises(DecodeError) as info:
        crop(_all(ds))
    assert info.value.index == idx and info.value.path == "b/corrupt.jpg"
    assert crop.stats["cpu_refused"] == 1
    assert crop.stats["device"] == 3  # the batch call failed; the good JPEGs were retried one by one
    # Without the bad record, the batch decodes.
    good = [i for i in range(len(ds)) if i != idx]
    images, _ = crop(ds.__getitems__(good))
    assert images.shape[0] == len(good)


def test_raw_pack_is_not_decoded(small_tree: Path, tmp_path: Path) -> None:
    raw = tmp_path / "raw.lmdb"
    pack(small_tree, raw, store="raw", progress=False)
    ref = _cpu_reference(raw, seed=6)
    crop = DeviceRandomResizedCrop(SIZE, device="cpu")
    torch.manual_seed(6)
    images, _ = crop(_all(RecordBytes(raw)))
    assert torch.equal(images, ref) and crop.stats["raw"] == len(ref) and crop.stats["device"] == 0


# -- DataLoader, pickling, collate ----------------------------------------------------------------
def _loader(ds: Any, context: str | None, workers: int = 2, **kw: Any) -> DataLoader:
    return DataLoader(
        ds,
        batch_size=5,
        shuffle=True,
        num_workers=workers,
        multiprocessing_context=context if workers else None,
        generator=torch.Generator().manual_seed(21),
        **kw,
    )


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_feed_the_transform(photo_pack: Path, context: str) -> None:
    """Workers plan with their own RNG as torchvision would in them: the same batches as the CPU path's DataLoader."""
    # The reference under fork only: the start method does not change the workers' seeds (spawn is slow to start).
    cpu = LMDBFolder(
        photo_pack, transform=T.Compose([T.RandomResizedCrop(SIZE), T.RandomHorizontalFlip(), T.PILToTensor()])
    )
    expected = [(x, y) for x, y in _loader(cpu, "fork")]
    crop = DeviceRandomResizedCrop(SIZE, device="cpu")
    ds = RecordBytes(photo_pack, plan=crop)
    ds.reader.get(0)  # the parent holds the pack open when the workers start
    got = []
    for batch in _loader(ds, context, collate_fn=collate_records):
        assert isinstance(batch, RecordBatch) and batch.planned
        got.append(crop(batch))
    assert len(got) == len(expected)
    for (x, y), (gx, gy) in zip(expected, got):
        assert torch.equal(gx, x) and torch.equal(gy, y)
    assert crop.stats["device"] == len(ds)


def test_pickles_without_handles_and_concat(photo_pack: Path, tmp_path: Path, small_pack: Path) -> None:
    crop = DeviceRandomResizedCrop(SIZE, device="cpu", output="float", mean=(0.5,) * 3, std=(0.25,) * 3)
    ds = RecordBytes(photo_pack, plan=crop)
    crop(ds.__getitems__([0, 1]))  # opens the pack, caches the normalisation tensors
    again = pickle.loads(pickle.dumps(ds))
    assert again.plan is not None and again.plan._norm is None
    assert len(again) == len(ds) and bytes(again[3].payload(0).numpy()) == ds.reader.read_bytes(3)
    # Two packs through a ConcatDataset: single-sample batches, merged by collate_records.
    both = ConcatDataset([RecordBytes(photo_pack), RecordBytes(small_pack)])
    loader = DataLoader(both, batch_size=len(both), collate_fn=collate_records)
    batch = next(iter(loader))
    assert len(batch.packs) == 2 and len(batch) == len(both)
    assert batch.meta[:, 5].tolist() == [0] * len(ds) + [1] * (len(both) - len(ds))
    images, targets = DeviceRandomResizedCrop(SIZE, device="cpu")(batch)
    assert images.shape[0] == len(both)
    assert targets.tolist() == LMDBFolder(photo_pack).targets + LMDBFolder(small_pack).targets


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="output"):
        DeviceRandomResizedCrop(8, output="png")
    with pytest.raises(ValueError, match="mean"):
        DeviceRandomResizedCrop(8, mean=(0.5, 0.5, 0.5))
    with pytest.raises(ValueError, match="float"):
        DeviceRandomResizedCrop(8, mean=(0.5,) * 3, std=(0.5,) * 3)
    with pytest.raises(ValueError, match="flip"):
        DeviceRandomResizedCrop(8, flip=2.0)


def test_bench_helpers_on_cpu(photo_pack: Path) -> None:
    m, details = time_device_path(str(photo_pack), device="cpu", workers=1, batch_size=4, size=SIZE)
    assert m.images == len(RecordBytes(photo_pack)) and m.workers == 1 and m.seconds > 0
    assert details["transform_ms_per_batch"] > 0 and details["gpu_ms_per_batch"] is None
    assert details["stats"]["device"] == m.images
    m, details = time_device_transform(str(photo_pack), device="cpu", batch_size=4, size=SIZE, indices=[0, 1, 2])
    assert m.images == 3 and m.workload == "decode+augment"


# -- on a GPU -----------------------------------------------------------------------------------------
@cuda
@needs_cuda
def test_cuda_resize_is_bit_exact() -> None:
    """The same decoded pixels give the same batch on CUDA as on CPU (float64 sums are exact)."""
    rng = np.random.default_rng(1)
    imgs = [torch.from_numpy(synthetic_jpeg_array(rng, 500, 375).copy()).permute(2, 0, 1) for _ in range(8)]
    crop_cpu = DeviceRandomResizedCrop(224, device="cpu")
    torch.manual_seed(0)
    boxes = [crop_cpu.draw(500, 375) for _ in imgs]
    flips = [b[4] for b in boxes]
    cpu = crop_cpu._resize(imgs, [b[:4] for b in boxes], flips)
    crop_gpu = DeviceRandomResizedCrop(224, device="cuda")
    gpu = crop_gpu._resize([i.cuda() for i in imgs], [b[:4] for b in boxes], flips)
    assert gpu.is_cuda and torch.equal(gpu.cpu(), cpu)


@cuda
@needs_cuda
def test_cuda_pixels_within_tolerance_of_cpu_path(photo_pack: Path) -> None:
    """nvJPEG upsamples chroma differently from libjpeg-turbo: same boxes, pixels within a tolerance."""
    ref = _cpu_reference(photo_pack, seed=11)
    crop = DeviceRandomResizedCrop(SIZE, device="cuda")
    torch.manual_seed(11)
    images, targets = crop(_all(RecordBytes(photo_pack, plan=crop)))
    assert images.is_cuda and targets.is_cuda and images.dtype == torch.uint8
    diff = (images.cpu().int() - ref.int()).abs()
    print(f"\nGPU vs CPU path: max {diff.max().item()}, mean {diff.float().mean().item():.3f}, stats {crop.stats}")
    assert diff.float().mean().item() <= 3.0 and diff.max().item() <= 96
    assert crop.stats["device"] == len(ref)


@cuda
@needs_cuda
def test_cuda_fallbacks(tmp_path: Path) -> None:
    odd = _odd_pack(tmp_path, truncated=True, corrupt=True)
    ds = RecordBytes(odd)
    bad = {ds.reader.index_of("b/truncated.jpg"), ds.reader.index_of("b/corrupt.jpg")}
    crop = DeviceRandomResizedCrop(SIZE, device="cuda")
    for i in bad:
        with pytest.raises(DecodeError) as info:
            crop(ds.__getitems__([0, i]))
        assert info.value.index == i
    good = [i for i in range(len(ds)) if i not in bad]
    crop = DeviceRandomResizedCrop(SIZE, device="cuda")
    images, _ = crop(ds.__getitems__(good))
    assert images.shape[0] == len(good)
    print(f"\nGPU fallbacks: {crop.stats}")
    assert crop.stats["cpu_cmyk"] == 1 and crop.stats["cpu_not_jpeg"] == 3
    assert crop.stats["device"] + crop.stats["cpu_refused"] == 3


@cuda
@needs_cuda
def test_cuda_dataloader_pinned(photo_pack: Path) -> None:
    crop = DeviceRandomResizedCrop(SIZE, device="cuda", output="float", mean=(0.5,) * 3, std=(0.25,) * 3)
    ds = RecordBytes(photo_pack, plan=crop)
    seen = 0
    for batch in _loader(ds, "fork", collate_fn=collate_records, pin_memory=True):
        assert batch.data.is_pinned()
        images, targets = crop(batch)
        assert images.is_cuda and images.dtype == torch.float32 and targets.is_cuda
        seen += len(images)
    assert seen == len(ds)


# -- lmdbfolder bench --device -------------------------------------------------------------------------
def test_bench_device_rows(small_tree: Path, small_pack: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lmdbfolder.cli import main

    argv = ["bench", str(small_tree), str(small_pack), "--workers", "0", "1", "--warm-only", "--no-chart"]
    assert main([*argv, "--repeat", "1", "--device", "cpu", "--batch-size", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {(m["workload"], m["contestant"], m["workers"]) for m in result["measurements"]}
    for w in (0, 1):
        assert ("train pipeline, warm", "GPU path (cpu)", w) in rows
        assert ("train pipeline, warm", "LMDBFolder + fused crop", w) in rows  # beside the CPU rows
    assert ("decode+augment, warm", "GPU path (cpu)", 1) in rows
    dev = result["summary"]["device"]
    assert dev["device"] == "cpu" and dev["batch_size"] == 4 and dev["stats"]["device"] == 12
    assert dev["vs_fastest"] > 0 and dev["transform_alone"]["gpu_ms_per_batch"] is None
    assert main([*argv, "--repeat", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "GPU path (cpu)" in out and "GPU path on cpu, batch 64" in out and "vs LMDBFolder + fused crop" in out


def test_bench_device_refused_without_cuda(small_tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lmdbfolder.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    assert main(["bench", str(small_tree), "--device", "cuda"]) == 2
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err
    assert main(["bench", str(small_tree), "--device", "tpu"]) == 2


@cuda
@needs_cuda
def test_cuda_bench_helpers_time_with_events(photo_pack: Path) -> None:
    m, details = time_device_path(str(photo_pack), device="cuda", workers=1, batch_size=4, size=SIZE)
    assert m.images == len(RecordBytes(photo_pack)) and details["gpu_ms_per_batch"] > 0
    m, details = time_device_transform(str(photo_pack), device="cuda", batch_size=4, size=SIZE)
    assert m.images == len(RecordBytes(photo_pack)) and details["gpu_ms_per_batch"] > 0
    print(f"\nGPU ms per batch of 4 at {SIZE} px: {details['gpu_ms_per_batch']}")

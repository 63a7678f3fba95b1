"""The batch fast path of LMDBFolder: a whole batch into one tensor, the same as sample by sample.

The per-sample path (``ds[i]``, the fused crop then torchvision's flip) is
the oracle: for the same seed the batch path must give the same boxes, flips,
random numbers consumed, pixels and targets, for every kind of image the
fused crop handles (JPEG, greyscale, CMYK, PNG with alpha, raw packs).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torchvision import transforms as T
from torchvision.transforms import v2

from conftest import INSTALLED, image_bytes, photo_jpeg, write
from lmdbfolder import fused, pack
from lmdbfolder.errors import CorruptRecordError, DecodeError
from lmdbfolder.format import KEY, decode_record, encode_record
from lmdbfolder.read.capabilities import get_decoder, matches_pillow, resolve_decoder_name
from lmdbfolder.torch import BatchSamples, LMDBFolder, collate, crop

KINDS = ["rgb_jpeg", "gray_jpeg", "cmyk_jpeg", "rgba_png", "palette_png", "progressive_jpeg", "webp"]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mixed")
    rng = np.random.default_rng(3)
    for k in range(18):
        w, h = [(161, 121), (121, 161), (300, 200), (37, 29), (90, 90), (500, 375)][k % 6]
        if k % 3 == 0:
            data, ext = photo_jpeg(w, h, seed=k), ".jpg"
        else:
            data, ext = image_bytes(KINDS[k % len(KINDS)], rng, w=w, h=h)
        write(root / "src" / f"c{k % 3}" / f"{k:02d}{ext}", data)
    pack(root / "src", root / "p", progress=False)
    pack(root / "src", root / "raw", store="raw", progress=False)
    return root


def _per_sample(ds: LMDBFolder, order: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    xs, ys = [], []
    for i in order:
        x, y = ds[i]
        xs.append(x)
        ys.append(y)
    return xs, ys


def _transforms() -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for resize in ("pil", "opencv", "native"):
        crop_t = fused.RandomResizedCrop(40, resize=resize, output="tensor")
        crop_p = fused.RandomResizedCrop(40, resize=resize, output="pil")
        out += [
            (f"{resize}/tensor", crop_t),
            (f"{resize}/tensor+flip", T.Compose([crop_t, T.RandomHorizontalFlip()])),
            (f"{resize}/tensor+v2flip", v2.Compose([crop_t, v2.RandomHorizontalFlip(0.7)])),
            (f"{resize}/pil+flip+totensor", T.Compose([crop_p, T.RandomHorizontalFlip(), T.PILToTensor()])),
            (f"{resize}/pil+toimage", v2.Compose([crop_p, v2.ToImage()])),
            (f"{resize}/tensor+flip(p=0)", T.Compose([crop_t, T.RandomHorizontalFlip(0.0)])),
        ]
    return out


@pytest.mark.skipif("opencv" not in INSTALLED, reason="needs opencv-python-headless")
@pytest.mark.parametrize("store", ["p", "raw"])
@pytest.mark.parametrize(("name", "transform"), _transforms(), ids=[n for n, _ in _transforms()])
def test_batch_equals_sample_by_sample(mixed: Path, store: str, name: str, transform: object) -> None:
    ds = LMDBFolder(mixed / store, transform=transform)
    order = [5, 0, 17, 3, 3, 11, 8, 1, 14, 2, 9, 16]
    torch.manual_seed(7)
    batch = ds.__getitems__(order)
    after_batch = torch.rand(1)
    assert isinstance(batch, BatchSamples)
    torch.manual_seed(7)
    xs, ys = _per_sample(ds, order)
    after_samples = torch.rand(1)
    assert torch.equal(after_batch, after_samples), "a different number of random numbers was drawn"
    assert batch.targets == ys
    assert batch.images.shape == (len(order), 3, 40, 40) and batch.images.dtype == torch.uint8
    for k, x in enumerate(xs):
        assert torch.equal(batch.images[k], x), f"{name}: sample {order[k]} differs"
        assert torch.equal(batch[k][0], x) and batch[k][1] == ys[k]


def test_other_transforms_keep_the_per_sample_path(mixed: Path) -> None:
    crop = fused.RandomResizedCrop(40, output="tensor")
    for transform in (
        T.Compose([crop, T.ConvertImageDtype(torch.float32)]),
        T.Compose([fused.RandomResizedCrop(40), T.RandomHorizontalFlip()]),  # PIL images asked for
        T.Compose([T.RandomResizedCrop(40), T.ToTensor()]),  # float output
        T.Compose([T.Resize(40), T.PILToTensor()]),
        None,
    ):
        ds = LMDBFolder(mixed / "p", transform=transform)
        assert not isinstance(ds.__getitems__([0, 1]), BatchSamples)


@pytest.mark.parametrize("resize", ["pil", "native"])
def test_threads_give_the_same_batch(mixed: Path, resize: str) -> None:
    transform = T.Compose([fused.RandomResizedCrop(40, resize=resize, output="tensor"), T.RandomHorizontalFlip()])
    one = LMDBFolder(mixed / "p", transform=transform)
    three = LMDBFolder(mixed / "p", transform=transform, threads=3)
    order = list(range(18)) * 3
    torch.manual_seed(1)
    a = one.__getitems__(order)
    torch.manual_seed(1)
    b = three.__getitems__(order)
    assert torch.equal(a.images, b.images) and a.targets == b.targets


@pytest.mark.parametrize("resize", ["pil", "native"])
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_with_collate_gives_the_per_sample_batches(mixed: Path, context: str, resize: str) -> None:
    transform = T.Compose([fused.RandomResizedCrop(40, resize=resize, output="tensor"), T.RandomHorizontalFlip()])
    ds = LMDBFolder(mixed / "p", transform=transform)
    seen: dict[int, int] = {}
    for images, targets in DataLoader(
        ds, batch_size=5, num_workers=2, collate_fn=collate, multiprocessing_context=context, shuffle=True
    ):
        assert images.shape[1:] == (3, 40, 40) and images.dtype == torch.uint8
        assert targets.dtype == torch.int64 and len(targets) == len(images)
        for t in targets.tolist():
            seen[t] = seen.get(t, 0) + 1
    assert sum(seen.values()) == len(ds) and seen == {0: 6, 1: 6, 2: 6}
    # the default collate accepts the fast path's batches too (it stacks the views)
    images, targets = next(iter(DataLoader(ds, batch_size=4)))
    assert images.shape == (4, 3, 40, 40) and targets.tolist() == [ds.targets[i] for i in range(4)]


def test_collate_of_ordinary_batches_is_default_collate() -> None:
    batch = [(torch.zeros(2), 1), (torch.ones(2), 2)]
    images, targets = collate(batch)
    assert torch.equal(images, torch.tensor([[0.0, 0.0], [1.0, 1.0]])) and targets.tolist() == [1, 2]


def test_targets_of_any_kind_collate_as_in_imagefolder(mixed: Path) -> None:
    """A target_transform's targets come out of the DataLoader as ImageFolder's do, whether
    the batch took the fast path or not (torch's collate keeps a batch of strings as a tuple)."""
    from torchvision.datasets import ImageFolder

    classes = ImageFolder(str(mixed / "src")).classes
    fast = T.Compose([T.RandomResizedCrop(8), T.PILToTensor()])
    slow = T.Compose([T.Resize((8, 8)), T.PILToTensor()])
    for target_transform in (classes.__getitem__, float, lambda t: {"y": t, "name": classes[t]}):
        for tf in (fast, slow):
            theirs = ImageFolder(str(mixed / "src"), transform=tf, target_transform=target_transform)
            ours = LMDBFolder(mixed / "p", transform=tf, target_transform=target_transform)
            for collate_fn in (None, collate):
                _, want = next(iter(DataLoader(theirs, batch_size=4, collate_fn=collate_fn)))
                _, got = next(iter(DataLoader(ours, batch_size=4, collate_fn=collate_fn)))
                assert type(got) is type(want) and repr(got) == repr(want)


def test_a_corrupt_record_in_a_batch_names_the_record(mixed: Path, tmp_path: Path) -> None:
    import shutil

    import lmdb

    shutil.copytree(mixed / "p", tmp_path / "p")
    env = lmdb.open(str(tmp_path / "p"), map_size=1 << 30)
    with env.begin(write=True) as txn:
        value = bytes(txn.get(KEY.pack(3)))
        header, payload = decode_record(value)
        broken = bytes(payload[:200]) + b"\x00" * (len(payload) - 200)
        txn.put(
            KEY.pack(3),
            encode_record(
                broken,
                label=header.label,
                encoding="jpeg",
                width=header.width,
                height=header.height,
                channels=header.channels,
            ),
        )
    env.close()
    # The record's checksum catches the damage first (as it should) ...
    ds = LMDBFolder(tmp_path / "p", transform=fused.RandomResizedCrop(40, output="tensor"))
    with pytest.raises(CorruptRecordError, match=rf"record 3 \({ds.reader.path_of(3)}\)"):
        ds.__getitems__([0, 1, 3, 4])
    # ... and without it, the decoder does, naming the record the same way.
    ds = LMDBFolder(tmp_path / "p", transform=fused.RandomResizedCrop(40, output="tensor"), verify_checksums=False)
    with pytest.raises(DecodeError, match=rf"record 3 \({ds.reader.path_of(3)}\) cannot be decoded"):
        ds.__getitems__([0, 1, 3, 4])


@pytest.mark.parametrize("resize", ["pil", "native"])
def test_with_threads_the_first_failing_image_is_named(mixed: Path, tmp_path: Path, resize: str) -> None:
    # Threads take the images one at a time in any order; the error is still the
    # first failing image's, as with one thread.
    import shutil

    import lmdb

    shutil.copytree(mixed / "p", tmp_path / "p")
    paths = LMDBFolder(tmp_path / "p").reader.paths()
    photos = [i for i, p in enumerate(paths) if int(p.split("/")[-1][:2]) % 3 == 0]  # the photo_jpeg files
    a, b = photos[1], photos[-1]
    env = lmdb.open(str(tmp_path / "p"), map_size=1 << 30)
    with env.begin(write=True) as txn:
        for index in (a, b):
            # The headers stay (the record's claim holds), the image data after them is gone.
            header, payload = decode_record(bytes(txn.get(KEY.pack(index))))
            keep = bytes(payload).index(b"\xff\xda") + 40  # up to just past the start of scan
            broken = bytes(payload[:keep]) + b"\x00" * (len(payload) - keep)
            fields = {"width": header.width, "height": header.height, "channels": header.channels}
            txn.put(KEY.pack(index), encode_record(broken, label=header.label, encoding="jpeg", **fields))
    env.close()
    crop = fused.RandomResizedCrop(40, resize=resize, output="tensor")
    others = [i for i in range(18) if i not in (a, b)]
    for threads in (1, 2, 3):
        ds = LMDBFolder(tmp_path / "p", transform=crop, verify_checksums=False, threads=threads)
        for order, first in (([b, *others, a], b), ([*others[:5], a, *others[5:], b], a)):
            with pytest.raises(DecodeError, match=rf"record {first} "):
                ds.__getitems__(order)


def test_default_decoder_is_the_fastest_that_matches_pillow(mixed: Path) -> None:
    ds = LMDBFolder(mixed / "p")
    assert ds.decoder == resolve_decoder_name("auto")
    assert matches_pillow(get_decoder(ds.decoder))
    pillow = LMDBFolder(mixed / "p", decoder="pillow")
    for i in range(len(ds)):
        assert np.array_equal(np.asarray(ds[i][0]), np.asarray(pillow[i][0]))


def test_opening_does_not_run_the_decoder_probe(
    mixed: Path, monkeypatch: pytest.MonkeyPatch, capabilities: Any
) -> None:
    # The probe (encode and decode six JPEGs) cost more than opening a
    # 100k-image pack; a dataset that is only opened (info, len, a worker's
    # copy before its first batch) must not pay it.
    from lmdbfolder.read import decoders

    probes: list[str] = []
    real = decoders.decodes_like_pillow
    monkeypatch.setattr(decoders, "decodes_like_pillow", lambda dec, p: probes.append(dec.name) or real(dec, p))
    capabilities()
    ds = LMDBFolder(mixed / "p")
    assert len(ds) > 0 and probes == []
    clone = pickle.loads(pickle.dumps(ds))  # what a spawn worker gets: still unresolved
    ds[0]
    assert ds.decoder == resolve_decoder_name("auto")
    assert clone.decoder == ds.decoder
    with pytest.raises(ValueError, match="unknown decoder 'jpeg9'"):
        LMDBFolder(mixed / "p", decoder="jpeg9")  # a wrong name still fails at once


def test_a_decoder_that_differs_from_pillow_is_not_chosen(capabilities: Any) -> None:
    from lmdbfolder.read import decoders

    if decoders.FAST_ORDER[0] not in INSTALLED:
        pytest.skip(f"{decoders.FAST_ORDER[0]} is not installed")
    first = decoders.make_decoder(decoders.FAST_ORDER[0])
    first.decode_jpeg = lambda payload, denom: np.zeros((1, 1, 3), np.uint8)  # type: ignore[method-assign]
    capabilities(**{f"decoder:{first.name}": first})
    assert resolve_decoder_name("auto") != first.name


def test_in_process_samples_use_one_torch_thread(mixed: Path) -> None:
    seen: list[int] = []

    def record_threads(img: object) -> object:
        seen.append(torch.get_num_threads())
        return img

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ds = LMDBFolder(mixed / "p", transform=record_threads)
        ds[0]
        ds.__getitems__([1, 2])
        assert seen == [1, 1, 1] and torch.get_num_threads() == 2
        seen.clear()
        LMDBFolder(mixed / "p", transform=record_threads, torch_threads=None)[0]
        assert seen == [2]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("flip", [True, False])
def test_torchvisions_own_pipeline_is_imagefolder_exactly_in_batches(mixed: Path, flip: bool) -> None:
    """torchvision's RandomResizedCrop at the front is fused exactly: ImageFolder's
    pixels and random numbers, sample by sample and a whole batch at a time."""
    from torchvision.datasets import ImageFolder

    steps = [T.RandomResizedCrop(40)] + ([T.RandomHorizontalFlip()] if flip else []) + [T.PILToTensor()]
    theirs = ImageFolder(str(mixed / "src"), transform=T.Compose(steps))
    ours = LMDBFolder(mixed / "p", transform=T.Compose(steps))
    order = [4, 0, 17, 9, 9, 2, 13]
    torch.manual_seed(11)
    expected = [theirs[i] for i in order]
    after = torch.rand(1)
    torch.manual_seed(11)
    batch = ours.__getitems__(order)
    assert isinstance(batch, BatchSamples) and torch.equal(torch.rand(1), after)
    torch.manual_seed(11)
    one_by_one = [ours[i] for i in order]
    for (x, y), (bx, by), (sx, sy) in zip(expected, batch, one_by_one):
        assert torch.equal(x, bx) and torch.equal(x, sx) and y == by == sy


def test_damaged_jpegs_end_as_imagefolder_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A JPEG the fast decoder refuses goes to Pillow: the same error as ImageFolder,
    or with LOAD_TRUNCATED_IMAGES the same (partly grey) pixels."""
    from PIL import ImageFile
    from torchvision.datasets import ImageFolder

    whole = photo_jpeg(120, 90, seed=5)
    write(tmp_path / "src" / "a" / "cut.jpg", whole[: len(whole) * 2 // 3])
    write(tmp_path / "src" / "a" / "whole.jpg", whole)
    pack(tmp_path / "src", tmp_path / "p", check="none", progress=False)
    steps = T.Compose([T.RandomResizedCrop(40), T.RandomHorizontalFlip(), T.PILToTensor()])
    theirs = ImageFolder(str(tmp_path / "src"), transform=steps)
    ours = LMDBFolder(tmp_path / "p", transform=steps)
    assert ours.decoder != "pillow" or "simplejpeg" not in INSTALLED
    with pytest.raises(OSError):
        theirs[0]
    with pytest.raises(DecodeError, match="record 0 .*cut.jpg"):
        ours[0]
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    for i in range(2):
        torch.manual_seed(i)
        a, _ = theirs[i]
        torch.manual_seed(i)
        b, _ = ours[i]
        torch.manual_seed(i)
        c = ours.__getitems__([i]).images[0]
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("resize", ["pil", "native"])
def test_a_dataset_shared_by_threads_makes_every_batch(mixed: Path, resize: str) -> None:
    # Two bulk draws at once put torch's generator state back under each other:
    # ArithmeticError ("the generator's numbers are not what the bulk draw expects").
    import threading

    transform = T.Compose([fused.RandomResizedCrop(40, resize=resize, output="tensor"), T.RandomHorizontalFlip()])
    ds = LMDBFolder(mixed / "p", transform=transform)
    ds.__getitems__([0])  # the plan, made once
    failures: list[BaseException] = []
    made = []

    def work() -> None:
        try:
            for _ in range(60):
                batch = ds.__getitems__(list(range(18)))
                made.append(batch.images.shape)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[0]
    assert made == [(18, 3, 40, 40)] * 180


def test_a_bulk_draw_disturbed_by_other_code_falls_back_to_the_per_sample_draws(
    mixed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Other code drawing from torch's generator during a bulk draw: that batch is drawn
    # sample by sample, the same boxes and flips as ds[i] (no ArithmeticError).
    def disturbed(*args: Any, **kwargs: Any) -> Any:
        raise ArithmeticError("the generator's numbers are not what the bulk draw expects")

    transform = T.Compose([fused.RandomResizedCrop(40, output="tensor"), T.RandomHorizontalFlip()])
    ds = LMDBFolder(mixed / "p", transform=transform)
    order = [5, 0, 17, 3, 11]
    monkeypatch.setattr(crop, "_draw_boxes", disturbed)
    torch.manual_seed(3)
    batch = ds.__getitems__(order)
    torch.manual_seed(3)
    xs, _ = _per_sample(ds, order)
    for k, x in enumerate(xs):
        assert torch.equal(batch.images[k], x)

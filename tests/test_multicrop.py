"""The self-supervised multi-crop (``lmdbfolder.fused.MultiCrop``) and its photometric operations.

Every photometric operation is checked against what torchvision does to a PIL
image (Pillow's arithmetic), on photo-like images: all of them are bit-exact here.
The DINO preset is run beside ``DataAugmentationDINO`` as facebookresearch/dino's
``main_dino.py`` builds it (lines 419-464 at 7c446df; ``utils.py`` lines 36-68),
rebuilt from torchvision transforms in benchmarks/dino_reference.py (the benchmark
times the same class): same seed, same views, through
``ImageFolder`` and through ``LMDBFolder`` (one region decode per sample), with
DataLoader workers (fork and spawn) and with ``threads``.
"""

from __future__ import annotations

import io
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter, ImageOps
from torch.utils.data import DataLoader
from torchvision import transforms
from torchvision.datasets import ImageFolder
from torchvision.transforms import functional as F

from conftest import photo_jpeg, write

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from dino_reference import DataAugmentationDINO  # noqa: E402

from lmdbfolder import fused
from lmdbfolder.torch import LMDBFolder
from lmdbfolder.torch import photometric as ops
from lmdbfolder.torch.plan import TransformPlan
from lmdbfolder.write.writer import pack


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _photos(count: int = 4, size: tuple[int, int] = (120, 90)) -> list[Image.Image]:
    return [Image.open(io.BytesIO(photo_jpeg(*size, seed=s))).convert("RGB") for s in range(count)]


def _batch(images: list[Image.Image]) -> torch.Tensor:
    return torch.stack([torch.from_numpy(np.array(i)).permute(2, 0, 1) for i in images])


def _assert_same(ours: torch.Tensor, theirs: list[Image.Image]) -> None:
    assert torch.equal(ours, _batch(theirs))


# -- each photometric operation against torchvision's PIL path -----------------------------------------
FACTORS = [0.6, 0.93, 1.17, 1.4]


#: Both implementations: the compiled one (where built; else this runs the tensor one twice) and the tensor one.
BOTH = pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "tensor"])


def test_the_compiled_operations_are_used_where_built() -> None:
    try:
        import lmdbfolder.torch._photometric  # noqa: F401
    except ImportError:
        pytest.skip("lmdbfolder.torch._photometric is not built here (pip install -e . builds it)")
    assert ops.compiled()  # built, and giving the tensor operations' values here


@BOTH
@pytest.mark.parametrize(
    "name, fn",
    [
        ("brightness", F.adjust_brightness),
        ("contrast", F.adjust_contrast),
        ("saturation", F.adjust_saturation),
    ],
)
def test_blends_are_pillows(name: str, fn: Any, compiled: bool) -> None:
    imgs = _photos()
    got = getattr(ops, name)(_batch(imgs), FACTORS, compiled=compiled)
    _assert_same(got, [fn(i, f) for i, f in zip(imgs, FACTORS)])


@BOTH
def test_hue_is_torchvisions(compiled: bool) -> None:
    imgs = _photos() + [Image.fromarray(np.random.default_rng(0).integers(0, 256, (90, 120, 3), dtype=np.uint8))]
    for shift in ([-0.1, -0.02, 0.05, 0.1, 0.5], [-0.5, 0.0, 0.003, -0.004, 0.25]):
        got = ops.hue(_batch(imgs), shift, compiled=compiled)
        _assert_same(got, [F.adjust_hue(i, f) for i, f in zip(imgs, shift)])


def test_grayscale_solarize_normalize() -> None:
    imgs = _photos()
    x = _batch(imgs)
    _assert_same(ops.grayscale(x), [F.rgb_to_grayscale(i, 3) for i in imgs])
    _assert_same(ops.solarize(x), [ImageOps.solarize(i) for i in imgs])
    norm = transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))]
    )
    for compiled in (True, False):
        ours = ops.normalize(x, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), compiled=compiled)
        assert all(torch.equal(o, norm(i)) for o, i in zip(ours, imgs))


@BOTH
def test_blur_is_pillows_gaussian_blur(compiled: bool) -> None:
    imgs = _photos(6)
    radii = [0.1, 0.55, 0.9, 1.31, 1.77, 2.0]
    got = ops.gaussian_blur(_batch(imgs), radii, compiled=compiled)
    _assert_same(got, [i.filter(ImageFilter.GaussianBlur(r)) for i, r in zip(imgs, radii)])
    big = [Image.fromarray(np.asarray(i)[:40, :50]) for i in imgs[:2]]  # a larger radius on a small image
    _assert_same(
        ops.gaussian_blur(_batch(big), [4.0, 7.5], compiled=compiled),
        [i.filter(ImageFilter.GaussianBlur(r)) for i, r in zip(big, [4.0, 7.5])],
    )
    _assert_same(
        ops.gaussian_blur(_batch(imgs), radii), [i.filter(ImageFilter.GaussianBlur(r)) for i, r in zip(imgs, radii)]
    )
    no_blur = ops.gaussian_blur(_batch(imgs), [0.0] * 6)
    assert torch.equal(no_blur, _batch(imgs))


def test_color_jitter_orders_per_image() -> None:
    imgs = _photos()
    orders = [(0, 1, 2, 3), (3, 2, 1, 0), (1, 3, 0, 2), ()]
    factors = [(1.2, 0.7, 1.1, 0.05), (0.8, 1.3, 0.9, -0.07), (1.0, 1.1, None, 0.02), (None, None, None, None)]
    want = []
    for img, order, fac in zip(imgs, orders, factors):
        for op in order:
            if fac[op] is not None:
                img = [F.adjust_brightness, F.adjust_contrast, F.adjust_saturation, F.adjust_hue][op](img, fac[op])
        want.append(img)
    _assert_same(ops.color_jitter(_batch(imgs), orders, factors), want)


# -- the preset against DataAugmentationDINO ------------------------------------------------------------
def test_dino_preset_is_dino_on_pil_images() -> None:
    img = _photos(1, (200, 150))[0]
    theirs = DataAugmentationDINO((0.4, 1.0), (0.05, 0.4), 3)
    ours = fused.MultiCrop.dino(global_crops_scale=(0.4, 1.0), local_crops_scale=(0.05, 0.4), local_crops_number=3)
    for seed in range(6):
        _seed(seed)
        want = theirs(img)
        after = (torch.rand(1), random.random(), np.random.rand())
        _seed(seed)
        got = ours(img)
        assert (torch.rand(1), random.random(), np.random.rand()) == after  # the same numbers consumed
        assert len(got) == len(want) == 5
        for a, b in zip(got, want):
            assert a.dtype == torch.float32 and torch.equal(a, b)


def test_presets_cite_and_build() -> None:
    dino = fused.MultiCrop.dino()
    assert [v.out_size for v in dino.views] == [(224, 224)] * 2 + [(96, 96)] * 8
    swav = fused.MultiCrop.swav((224, 96), (2, 6), (0.14, 0.05), (1.0, 0.14))
    assert len(swav.views) == 8 and swav.views[0].blur_draw == "numpy"
    simclr = fused.MultiCrop.simclr()
    out = simclr(_photos(1)[0])
    assert len(out) == 2 and float(out[0].min()) >= 0.0 and float(out[0].max()) <= 1.0
    for preset in (fused.MultiCrop.dino, fused.MultiCrop.swav, fused.MultiCrop.simclr):
        assert "line" in (preset.__doc__ or "")


def test_swav_views_are_swavs() -> None:
    """SwAV's MultiCropDataset transforms (swav/src/multicropdataset.py lines 37-94), rebuilt."""

    class PILRandomGaussianBlur:
        def __call__(self, img: Image.Image) -> Image.Image:
            if not np.random.rand() <= 0.5:
                return img
            return img.filter(ImageFilter.GaussianBlur(radius=random.uniform(0.1, 2.0)))

    jitter = transforms.RandomApply([transforms.ColorJitter(0.8, 0.8, 0.8, 0.2)], p=0.8)
    color = transforms.Compose([jitter, transforms.RandomGrayscale(p=0.2)])
    trans = [
        transforms.Compose(
            [
                transforms.RandomResizedCrop(size, scale=scale),
                transforms.RandomHorizontalFlip(p=0.5),
                transforms.Compose([color, PILRandomGaussianBlur()]),
                transforms.ToTensor(),
                transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.228, 0.224, 0.225]),
            ]
        )
        for size, scale in ((64, (0.14, 1.0)), (64, (0.14, 1.0)), (32, (0.05, 0.14)))
    ]
    ours = fused.MultiCrop.swav((64, 32), (2, 1), (0.14, 0.05), (1.0, 0.14))
    img = _photos(1, (160, 120))[0]
    for seed in range(4):
        _seed(seed)
        want = [t(img) for t in trans]
        _seed(seed)
        got = ours(img)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


# -- through LMDBFolder: one region decode per sample -----------------------------------------------
@pytest.fixture(scope="module")
def ssl_pack(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ssl")
    sizes = [(200, 150), (150, 200), (161, 121), (120, 120)]
    for k, (w, h) in enumerate(sizes):
        data = photo_jpeg(w, h, seed=k) if k != 3 else photo_jpeg(w, h, seed=k, mode="L")
        write(root / "src" / f"c{k % 2}" / f"{k}.jpg", data)
    pack(root / "src", root / "p", progress=False)
    return root / "src", root / "p"


def _dino_small() -> tuple[Any, Any]:
    return DataAugmentationDINO((0.4, 1.0), (0.05, 0.4), 2), fused.MultiCrop.dino((0.4, 1.0), (0.05, 0.4), 2)


def test_lmdbfolder_gives_dinos_views(ssl_pack: tuple[Path, Path]) -> None:
    src, packed = ssl_pack
    theirs, ours = _dino_small()
    ref = ImageFolder(str(src), transform=theirs)
    ds = LMDBFolder(packed, transform=ours, decoder="auto")
    assert "fused multi-crop" in repr(ds)
    for i in range(len(ds)):
        _seed(i)
        want, target = ref[i]
        _seed(i)
        got, label = ds[i]
        assert label == target and len(got) == 4
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_one_region_decode_per_sample(ssl_pack: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    _, packed = ssl_pack
    ds = LMDBFolder(packed, transform=fused.MultiCrop.dino((0.4, 1.0), (0.05, 0.4), 2))
    calls: list[tuple[int, ...]] = []
    real = TransformPlan._views

    def counted(self: Any, *args: Any) -> Any:
        calls.append(args[3:5])
        return real(self, *args)

    from lmdbfolder.read.plan import ReadPlan

    covering = ReadPlan.covering
    decodes: list[Any] = []

    def count_decodes(self: Any, *args: Any) -> Any:
        decodes.append(args[-1])
        return covering(self, *args)

    monkeypatch.setattr(TransformPlan, "_views", counted)
    monkeypatch.setattr(ReadPlan, "covering", count_decodes)
    for i in range(len(ds)):
        ds[i]
    assert len(calls) == len(decodes) == len(ds)


def _loader_views(ds: Any, **kwargs: Any) -> list[torch.Tensor]:
    loader = DataLoader(ds, batch_size=2, shuffle=False, **kwargs)
    out = []
    for views, _ in loader:
        out.append(torch.cat([v.flatten() for v in views]))
    return out


def _init(worker_id: int) -> None:
    _seed(1000 + worker_id)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_give_imagefolders_views(ssl_pack: tuple[Path, Path], context: str) -> None:
    src, packed = ssl_pack
    theirs, ours = _dino_small()
    kw: dict[str, Any] = {"num_workers": 2, "multiprocessing_context": context, "worker_init_fn": _init}
    torch.manual_seed(5)
    want = _loader_views(ImageFolder(str(src), transform=theirs), **kw)
    torch.manual_seed(5)
    got = _loader_views(LMDBFolder(packed, transform=ours), **kw)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_threads_setting_gives_the_same_views(ssl_pack: tuple[Path, Path]) -> None:
    src, packed = ssl_pack
    theirs, ours = _dino_small()
    _seed(3)
    want = _loader_views(ImageFolder(str(src), transform=theirs))
    _seed(3)
    got = _loader_views(LMDBFolder(packed, transform=ours, threads=2))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_uint8_views_and_device_agnostic_ops() -> None:
    view = fused.View(32, scale=(0.2, 1.0), jitter=(0.4, 0.4, 0.2, 0.1), grayscale=0.5, blur=0.5, mean=None, std=None)
    mc = fused.MultiCrop([view, view])
    out = mc(_photos(1)[0])
    assert all(v.dtype == torch.uint8 and v.shape == (3, 32, 32) for v in out)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    imgs = _photos()
    x = _batch(imgs).to(device)
    got = ops.color_jitter(x, [(3, 1, 0, 2)] * 4, [(1.1, 0.9, 1.2, 0.04)] * 4)
    got = ops.gaussian_blur(ops.solarize(got), [0.5, 1.0, 1.5, 2.0])
    assert got.device.type == device and got.dtype == torch.uint8


def test_fast_path_says_why_not(ssl_pack: tuple[Path, Path]) -> None:
    _, packed = ssl_pack
    ok, why = fused.fast_path(DataAugmentationDINO((0.4, 1.0), (0.05, 0.4), 2))
    assert not ok and "MultiCrop.dino" in why
    ds = LMDBFolder(packed, transform=DataAugmentationDINO((0.4, 1.0), (0.05, 0.4), 2))
    assert repr(ds).count("no fast path") == 1
    ok, why = fused.fast_path(transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224)]))
    assert not ok and "Resize" in why
    assert fused.fast_path(transforms.Compose([transforms.RandomResizedCrop(224), transforms.PILToTensor()]))[0]


def test_doctor_says_whether_a_transform_gets_a_fast_path(
    ssl_pack: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from lmdbfolder.cli import main

    _, packed = ssl_pack
    assert (
        main(["doctor", str(packed), "--transform", "lmdbfolder.fused:MultiCrop.dino((0.4, 1.0), (0.05, 0.4), 2)"]) == 0
    )
    assert "fused multi-crop: 4 views" in capsys.readouterr().out
    assert main(["doctor", "--json", "--transform", "torchvision.transforms:Resize(256)"]) == 0
    report = json.loads(capsys.readouterr().out)["transform"]
    assert report["fast_path"] is False and "Resize" in report["why"]
    assert main(["doctor", "--transform", "torchvision.transforms:Resize(__import__('os'))"]) != 0
    assert "Python literals" in capsys.readouterr().err


def test_compiled_bicubic_is_pillows() -> None:
    from conftest import built
    from lmdbfolder.read.capabilities import current
    from lmdbfolder.read.crops import exact_resize_into

    fn, order = built(current().exact_bicubic(), "the compiled bicubic resize")
    pixels = np.array(_photos(1, (200, 150))[0])
    for box, size in [((0, 0, 200, 150), (96, 96)), ((13, 7, 120, 148), (224, 224)), ((50, 20, 70, 31), (96, 96))]:
        dst = np.empty((3, size[1], size[0]), np.uint8)
        assert exact_resize_into(fn, order, pixels, box, size, dst, planar=True, flip=True, cubic=True)
        want = Image.fromarray(pixels).crop(box).resize(size, Image.BICUBIC).transpose(Image.FLIP_LEFT_RIGHT)
        assert np.array_equal(dst.transpose(1, 2, 0), np.asarray(want))


def test_a_cut_jpeg_fails_naming_its_record(tmp_path: Path) -> None:
    whole = photo_jpeg(120, 90, seed=5)
    write(tmp_path / "src" / "a" / "cut.jpg", whole[: len(whole) * 2 // 3])
    write(tmp_path / "src" / "a" / "whole.jpg", whole)
    pack(tmp_path / "src", tmp_path / "p", check="none", progress=False)
    from lmdbfolder.errors import DecodeError

    ds = LMDBFolder(tmp_path / "p", transform=fused.MultiCrop.dino((0.4, 1.0), (0.05, 0.4), 2), threads=2)
    with pytest.raises(DecodeError, match="record 0 .*cut.jpg"):
        ds[0]
    with pytest.raises(DecodeError, match="record 0 .*cut.jpg"):
        ds.__getitems__([1, 0])
    assert len(ds[1][0]) == 4


@BOTH
def test_hue_on_every_kind_of_colour(compiled: bool) -> None:
    """Random colours (every branch of the HSV conversions, greys included) and the
    extreme shifts, against torchvision's PIL path."""
    rng = np.random.default_rng(7)
    noise = rng.integers(0, 256, (3, 64, 80, 3), dtype=np.uint8)
    noise[1, ::3] = noise[1, ::3, :, :1]  # grey pixels
    imgs = [Image.fromarray(a) for a in noise]
    for shift in ([0.5, -0.5, 0.1], [-0.1, 0.004, -0.003]):
        got = ops.hue(_batch(imgs), shift, compiled=compiled)
        _assert_same(got, [F.adjust_hue(i, f) for i, f in zip(imgs, shift)])


def test_compiled_resizes_on_random_boxes() -> None:
    """The compiled resize (its horizontal pass over transposed rows) against Pillow, both filters."""
    from conftest import built
    from lmdbfolder.read.capabilities import current
    from lmdbfolder.read.crops import exact_resize_into

    fn, order = built(current().exact_bicubic(), "the compiled bicubic resize")
    rng = np.random.default_rng(3)
    src = np.array(_photos(1, (160, 120))[0])
    img = Image.fromarray(src)
    for trial in range(40):
        w, h = int(rng.integers(1, 161)), int(rng.integers(1, 121))
        x, y = int(rng.integers(0, 161 - w)), int(rng.integers(0, 121 - h))
        size = (int(rng.integers(1, 130)), int(rng.integers(1, 130)))
        cubic = bool(trial % 2)
        dst = np.empty((size[1], size[0], 3), np.uint8)
        assert exact_resize_into(fn, order, src, (x, y, x + w, y + h), size, dst, cubic=cubic)
        want = img.crop((x, y, x + w, y + h)).resize(size, Image.BICUBIC if cubic else Image.BILINEAR)
        assert np.array_equal(dst, np.asarray(want)), (x, y, w, h, size, cubic)


def test_seeded_views_are_the_same_one_by_one_and_in_batches(ssl_pack: tuple[Path, Path]) -> None:
    _, packed = ssl_pack
    tf = fused.MultiCrop.dino((0.4, 1.0), (0.05, 0.4), 2)
    one = LMDBFolder(packed, transform=tf, seed=7)
    many = LMDBFolder(packed, transform=tf, seed=7, threads=2)
    batch = many.__getitems__([2, 0, 3])
    for (views, target), index in zip(batch, [2, 0, 3]):
        want, label = one[index]
        assert label == target and all(torch.equal(a, b) for a, b in zip(views, want))


# -- a batch's random numbers drawn in bulk -----------------------------------------------------------
def _draw_presets() -> list[Any]:
    odd = fused.MultiCrop(
        [
            fused.View(32, jitter=(0.0, 0.5, 0.0, 0.2), grayscale=None, flip=None, blur=0.3, solarize=0.5),
            fused.View(16, scale=(0.9, 1.0), ratio=(0.5, 2.0), jitter=None, grayscale=0.5),
        ]
    )
    return [fused.MultiCrop.dino(), fused.MultiCrop.swav((224, 96), (2, 6), (0.14, 0.05), (1.0, 0.14)), odd]


@pytest.mark.parametrize("which", [0, 1, 2], ids=["dino", "swav", "odd"])
def test_bulk_draws_are_the_per_sample_draws(which: int) -> None:
    tf = _draw_presets()[which]
    # Sizes that take every branch of the box draw, the central fallback included.
    sizes = [(500, 375), (375, 500), (3, 1000), (1, 1), (64, 64), (257, 2)] * 3
    for seed in range(3):
        _seed(seed)
        want = [tf.draw(w, h) for w, h in sizes]
        after = (torch.rand(3).tolist(), random.random(), float(np.random.rand()))
        _seed(seed)
        got = tf.draw_many(sizes)
        assert got is not None, "the bulk draw was not confirmed here"
        assert got == want
        assert (torch.rand(3).tolist(), random.random(), float(np.random.rand())) == after


def test_batches_of_views_with_and_without_bulk_draws(
    ssl_pack: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, packed = ssl_pack
    ds = LMDBFolder(packed, transform=fused.MultiCrop.dino((0.4, 1.0), (0.05, 0.4), 2))
    order = [1, 3, 0, 2, 2, 1]
    _seed(4)
    bulk = ds.__getitems__(order)
    after = torch.rand(1)
    monkeypatch.setattr(fused.MultiCrop, "draw_many", lambda self, sizes: None)
    _seed(4)
    each = ds.__getitems__(order)
    assert torch.equal(torch.rand(1), after)
    assert all(torch.equal(a, b) for a, b in zip(bulk.images, each.images, strict=True))
    assert bulk.targets == each.targets


def test_normalizer_is_normalize() -> None:
    x = _batch(_photos(3))
    stats = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    norm = ops.normalizer(*stats)
    for src in (x, x[1:2], x[:, :, 1:5]):  # contiguous, one image, a strided view (the tensor path)
        out = torch.empty(src.shape, dtype=torch.float32)
        norm(src, out)
        assert torch.equal(out, ops.normalize(src, *stats, compiled=False))

"""Reduced-size decoding: the fused RandomResizedCrop and size_hint, against torchvision."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms as T
from torchvision.datasets import ImageFolder

from conftest import INSTALLED, photo_jpeg, write
from lmdbfolder import fused
from lmdbfolder.read.capabilities import current, get_decoder
from lmdbfolder.read.crops import crop_scale, opencv_resize_into, resize_region, scaled_box
from lmdbfolder.read.plan import ReadPlan
from lmdbfolder.torch import LMDBFolder
from lmdbfolder.write.writer import pack

SHAPES = [(161, 121), (121, 161), (640, 480), (900, 300), (37, 29)]


@pytest.fixture(scope="module")
def photo_pack(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("photos")
    for k, (w, h) in enumerate(SHAPES):
        write(root / "src" / f"c{k % 2}" / f"{k}.jpg", photo_jpeg(w, h, seed=k))
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (50, 70, 4), dtype=np.uint8), "RGBA").save(root / "src" / "c0" / "z.png")
    pack(root / "src", root / "p", progress=False)
    return root / "src", root / "p"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("args", [{}, {"scale": (0.5, 1.0)}, {"ratio": (0.2, 5.0)}, {"scale": (0.01, 0.02)}])
def test_crop_boxes_are_torchvisions(shape: tuple[int, int], args: dict) -> None:
    w, h = shape
    ours = fused.RandomResizedCrop(224, **args)
    img = Image.new("RGB", (w, h))
    for seed in range(50):
        torch.manual_seed(seed)
        box = ours.sample_box(w, h)
        after_ours = torch.rand(1)
        torch.manual_seed(seed)
        theirs = T.RandomResizedCrop.get_params(img, list(ours.scale), list(ours.ratio))
        assert box == tuple(theirs)
        assert torch.equal(after_ours, torch.rand(1))  # same random numbers consumed


def test_crop_scale_gives_enough_pixels() -> None:
    scales = (1, 2, 4, 8)
    assert crop_scale(300, 400, 224, 224, scales) == 1
    assert crop_scale(448, 448, 224, 224, scales) == 2
    assert crop_scale(447, 900, 224, 224, scales) == 1
    assert crop_scale(1800, 1800, 224, 224, scales) == 8
    assert crop_scale(1800, 1800, 224, 224, (1, 2)) == 2
    rng = np.random.default_rng(0)
    for _ in range(1000):
        ch, cw, oh, ow = (int(v) for v in rng.integers(1, 3000, 4))
        d = crop_scale(ch, cw, oh, ow, scales)
        assert ch / d >= oh or d == 1
        assert cw / d >= ow or d == 1
        assert d == 8 or not (ch >= oh * 2 * d and cw >= ow * 2 * d)  # the smallest scale that is enough


def test_scaled_box_maps_coordinates() -> None:
    assert scaled_box((10, 20, 100, 200), (640, 480), (320, 240)) == (10.0, 5.0, 110.0, 55.0)
    assert scaled_box((0, 0, 121, 161), (161, 121), (21, 16)) == (0.0, 0.0, 21.0, 16.0)


@pytest.mark.parametrize("backend", ["pil", "opencv"])
def test_resize_region_sizes(backend: str) -> None:
    if backend == "opencv":
        pytest.importorskip("cv2")
    arr = np.zeros((50, 80, 3), np.uint8)
    for box in [(0.0, 0.0, 80.0, 50.0), (3.5, 2.25, 9.75, 7.5), (79.2, 49.1, 80.0, 50.0)]:
        if backend == "opencv":
            assert opencv_resize_into(current().cv2(), arr, box, (17, 13), None).shape == (13, 17, 3)
        else:
            out = resize_region(arr, box, (17, 13))
            assert out.size == (17, 13) and out.mode == "RGB"


def _torchvision_and_fused(src: Path, packed: Path, size: int, **kwargs: object) -> tuple[ImageFolder, LMDBFolder]:
    decoder = str(kwargs.pop("decoder", "pillow"))
    same = {k: v for k, v in kwargs.items() if k in ("scale", "ratio")}
    theirs = ImageFolder(str(src), transform=T.Compose([T.RandomResizedCrop(size, **same), T.PILToTensor()]))  # type: ignore[arg-type]
    ours = LMDBFolder(
        packed, transform=T.Compose([fused.RandomResizedCrop(size, **kwargs), T.PILToTensor()]), decoder=decoder
    )  # type: ignore[arg-type]
    return theirs, ours


def test_unreduced_pil_path_is_pixel_identical_to_torchvision(photo_pack: tuple[Path, Path]) -> None:
    theirs, ours = _torchvision_and_fused(*photo_pack, 64, reduce=False)
    for i in range(len(theirs)):
        for seed in range(5):
            torch.manual_seed(seed)
            a, ta = theirs[i]
            torch.manual_seed(seed)
            b, tb = ours[i]
            assert ta == tb
            assert torch.equal(a, b), (i, seed)


@pytest.mark.parametrize("decoder", INSTALLED)
def test_reduced_decode_matches_torchvision_closely(photo_pack: tuple[Path, Path], decoder: str) -> None:
    theirs, ours = _torchvision_and_fused(*photo_pack, 32, decoder=decoder, scale=(0.6, 1.0))
    crop = ours.transform.transforms[0]
    dec = get_decoder(decoder)
    plan = ReadPlan(dec, crop=crop.spec())
    reduced = 0
    for i in range(len(theirs)):
        for seed in range(4):
            torch.manual_seed(seed)
            a, _ = theirs[i]
            torch.manual_seed(seed)
            b, _ = ours[i]
            assert b.shape == a.shape == (3, 32, 32)  # output size is the transform's
            diff = (a.float() - b.float()).abs().mean().item()
            assert diff < 12, (i, seed, diff)  # same region of the same picture
            rec = ours.reader.get(i)
            if rec.encoding == "jpeg":
                torch.manual_seed(seed)
                box = crop.sample_box(rec.width, rec.height)
                denom = plan.job(rec.payload, rec.encoding, rec.width, rec.height, rec.channels, box, False).denom
                reduced += denom > 1
                assert denom == 1 or (box[2] >= 32 * denom and box[3] >= 32 * denom)  # enough pixels
    if dec.scales != (1,):
        assert reduced > 0  # the big images really were decoded smaller


def test_fused_crop_alone_and_as_plain_transform(photo_pack: tuple[Path, Path]) -> None:
    src, packed = photo_pack
    crop = fused.RandomResizedCrop((40, 30), resize="pil")
    ds = LMDBFolder(packed, transform=crop, decoder="auto")
    for i in range(len(ds)):
        img, _ = ds[i]
        assert img.size == (30, 40) and img.mode == "RGB"  # torchvision's (h, w) size order
    plain = ImageFolder(str(src), transform=crop)  # works on a PIL image like torchvision's
    assert plain[0][0].size == (30, 40)
    assert "reduce=True" in repr(crop)


def test_size_hint_keeps_the_shorter_side(photo_pack: tuple[Path, Path]) -> None:
    _, packed = photo_pack
    for name in INSTALLED:
        ds = LMDBFolder(packed, decoder=name, size_hint=100)
        full = LMDBFolder(packed)
        scales = get_decoder(name).scales
        for i in range(len(ds)):
            img, t = ds[i]
            ref, tr = full[i]
            assert t == tr and img.mode == "RGB"
            w, h = ref.size
            if min(w, h) >= 200 and 2 in scales:
                assert img.size == (-(-w // 2), -(-h // 2)) or min(img.size) >= 100
                assert img.size[0] < w
            assert min(img.size) >= min(100, w, h)


def test_fused_dataset_through_dataloader_workers(photo_pack: tuple[Path, Path]) -> None:
    _, packed = photo_pack
    tf = T.Compose([fused.RandomResizedCrop(24), T.RandomHorizontalFlip(), T.PILToTensor()])
    ds = LMDBFolder(packed, transform=tf, decoder="auto", size_hint=24)
    loader = torch.utils.data.DataLoader(ds, batch_size=3, num_workers=2, shuffle=True)
    shapes = [x.shape for x, _ in loader for _ in [0]]
    assert sum(s[0] for s in shapes) == len(ds)
    assert all(s[1:] == (3, 24, 24) for s in shapes)


@pytest.mark.parametrize("resize", ["pil", "opencv"])
def test_tensor_output_is_piltotensor_of_the_image(photo_pack: tuple[Path, Path], resize: str) -> None:
    if resize == "opencv":
        pytest.importorskip("cv2")
    _, packed = photo_pack
    as_pil = LMDBFolder(packed, transform=T.Compose([fused.RandomResizedCrop(40, resize=resize), T.PILToTensor()]))
    as_tensor = LMDBFolder(packed, transform=fused.RandomResizedCrop(40, resize=resize, output="tensor"))
    for i in range(len(as_pil)):
        torch.manual_seed(i)
        a, _ = as_pil[i]
        torch.manual_seed(i)
        b, _ = as_tensor[i]
        assert b.dtype == torch.uint8 and b.shape == (3, 40, 40)
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="output"):
        fused.RandomResizedCrop(40, output="numpy")


def test_fused_crop_on_a_raw_pack_is_exact(photo_pack: tuple[Path, Path], tmp_path: Path) -> None:
    src, _ = photo_pack
    pack(src, tmp_path / "raw", store="raw", progress=False)
    theirs, ours = _torchvision_and_fused(src, tmp_path / "raw", 48)
    for i in range(len(theirs)):
        torch.manual_seed(i)
        a, _ = theirs[i]
        torch.manual_seed(i)
        b, _ = ours[i]
        assert torch.equal(a, b)  # raw pixels are Pillow's; same box; Pillow's resize

"""Region decoding (``lmdbfolder.read.regions``): only the crop's part of a JPEG is
decoded, and its pixels are the full decode's, checked against Pillow and
torchvision's ImageFolder."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile
from torch.utils.data import DataLoader
from torchvision import transforms as T
from torchvision.datasets import ImageFolder

from conftest import assert_imagefolders_samples, built, make_photo_tree, photo_jpeg, write
from lmdbfolder import pack
from lmdbfolder.encodings import JPEG
from lmdbfolder.errors import DecodeError
from lmdbfolder.read import capabilities as caps_module
from lmdbfolder.read import regions
from lmdbfolder.read.capabilities import Capabilities, current
from lmdbfolder.torch import LMDBFolder


@pytest.fixture
def helper() -> Any:
    return built(current().compiled(), "lmdbfolder.read._crops").decode_region


@pytest.fixture
def fresh(capabilities: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``fresh(**answers)``: a new capabilities snapshot (the checks run again), the
    environment switch unset."""
    monkeypatch.delenv(regions.ENV_SWITCH, raising=False)
    return capabilities


def decode_region(data: bytes, box: tuple[int, int, int, int], width: int) -> Any:
    """The crop's region of a JPEG claimed to hold 3 components, decoded by this
    process's region decoder (None: it must be decoded whole)."""
    found = current().region_decoder()
    if found is None:
        return None
    return JPEG.region(data, box, width, 3, found, np.empty(3 * width * box[2], np.uint8))


def _jpeg(img: Image.Image, **options: Any) -> bytes:
    out = io.BytesIO()
    img.save(out, "JPEG", **options)
    return out.getvalue()


def _kinds(w: int, h: int, seed: int) -> list[tuple[str, bytes]]:
    rgb = Image.open(io.BytesIO(photo_jpeg(w, h, seed=seed))).convert("RGB")
    noisy = Image.fromarray(
        np.clip(np.asarray(rgb, np.int16) + np.random.default_rng(seed).integers(-40, 40, (h, w, 3)), 0, 255).astype(
            np.uint8
        )
    )
    return [
        ("4:2:0", _jpeg(noisy, quality=90)),
        ("4:4:4", _jpeg(noisy, quality=95, subsampling=0)),
        ("4:2:2", _jpeg(noisy, quality=85, subsampling=1)),
        ("progressive", _jpeg(noisy, quality=80, progressive=True)),
        ("progressive 4:2:2", _jpeg(noisy, quality=70, progressive=True, subsampling=1)),
        ("restart markers", _jpeg(noisy, quality=75, restart_marker_blocks=1)),
        ("greyscale", _jpeg(noisy.convert("L"), quality=90)),
    ]


@pytest.mark.parametrize("size", [(161, 121), (500, 375), (33, 17), (16, 16), (1, 1), (250, 131)])
def test_regions_are_the_full_decode_bit_for_bit(helper: Any, size: tuple[int, int]) -> None:
    """Random boxes, and boxes on every edge, of every JPEG kind: the region's
    pixels equal Pillow's whole decode, converted to RGB, cropped."""
    w, h = size
    rng = np.random.default_rng(w * 1000 + h)
    for kind, data in _kinds(w, h, seed=w + h):
        expected = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        boxes = regions.probe_boxes(w, h)
        for _ in range(40):
            left, top = int(rng.integers(0, w)), int(rng.integers(0, h))
            boxes.append((top, left, int(rng.integers(1, h - top + 1)), int(rng.integers(1, w - left + 1))))
        for box in boxes:
            got = decode_region(data, box, w)
            assert got is not None, (kind, box)
            pixels, (x0, y0, x1, y1) = got
            top, left, bh, bw = box
            assert (y0, y1, x1 - x0) == (0, bh, bw)
            assert np.array_equal(pixels[:, x0:x1], expected[top : top + bh, left : left + bw]), (kind, size, box)


def test_a_cut_jpeg_is_refused_by_the_helper_itself(helper: Any) -> None:
    """Belt and braces beside the EOI rule of ``decode_region``: the helper checks
    that the bytes after the crop's rows end with EOI."""
    data = photo_jpeg(400, 400, seed=1)
    with pytest.raises(ValueError, match="marker"):
        helper(data[: len(data) // 2], 0, 0, 400, 16, np.empty(3 * 400 * 400, np.uint8))


@pytest.mark.parametrize(
    "marker", [b"\xff\xc0\x00\x11\x08\x01\x2c\x01\x2c\x03\x01\x22\x00", b"\xff\xd8", b"\xff\xc4\x00\x03"]
)
def test_a_stray_marker_below_the_crop_fails_as_in_imagefolder(helper: Any, tmp_path: Path, marker: bytes) -> None:
    """A second SOF, SOI or a bogus table in the scan data, below every crop: the
    region's rows decode cleanly, but ImageFolder's whole decode fails on it, so
    the region decoder refuses the file and the dataset fails as ImageFolder does."""
    data = photo_jpeg(300, 300, seed=3)
    start = data.index(b"\xff\xda") + 20
    pos = start + int((len(data) - 2 - start) * 0.9)
    damaged = data[:pos] + marker + data[pos:]
    assert decode_region(damaged, (0, 0, 16, 300), 300) is None
    _fails_as_in_imagefolder(tmp_path, "marker.jpg", damaged)


def test_a_truncated_jpeg_is_decoded_whole_and_fails_as_in_imagefolder(helper: Any, tmp_path: Path) -> None:
    """A JPEG cut off below every crop would decode by region (the rows needed are
    there), but ImageFolder fails on it: so a JPEG without its end-of-image marker
    is never decoded by region, and the dataset raises as ImageFolder does."""
    data = photo_jpeg(300, 300, seed=2)
    cut = data[: len(data) - 200]
    assert decode_region(cut, (0, 0, 20, 20), 300) is None
    _fails_as_in_imagefolder(tmp_path, "cut.jpg", cut)


def _fails_as_in_imagefolder(tmp_path: Path, name: str, data: bytes) -> None:
    """Packed alone, the JPEG ``data`` fails in ImageFolder (OSError) and in LMDBFolder
    (DecodeError naming it), one by one and batched, under small crops (most of
    them in rows a region decode would read cleanly)."""
    write(tmp_path / "src" / "a" / name, data)
    pack(tmp_path / "src", tmp_path / "p", check="none", progress=False)
    steps = T.Compose([T.RandomResizedCrop(32, scale=(0.01, 0.02)), T.PILToTensor()])
    theirs = ImageFolder(str(tmp_path / "src"), transform=steps)
    ours = LMDBFolder(tmp_path / "p", transform=steps)
    for seed in range(5):
        torch.manual_seed(seed)
        with pytest.raises(OSError):
            theirs[0]
        torch.manual_seed(seed)
        with pytest.raises(DecodeError, match=name):
            ours[0]
        torch.manual_seed(seed)
        with pytest.raises(DecodeError, match=name):
            ours.__getitems__([0])


def _corrupt_scan(data: bytes, at: float, *, marker: bool = False) -> bytes:
    """``data`` with bytes of its entropy-coded scan overwritten at fraction ``at``:
    garbage that decodes as other pixels, or (``marker``) a stray marker, which
    libjpeg warns about ("premature end of data segment") and decodes past."""
    start = data.index(b"\xff\xda") + 20
    pos = start + int((len(data) - 2 - start) * at)
    damaged = bytearray(data)
    damaged[pos : pos + 6] = b"\x00\xff\xd5\x42\x00\x99" if marker else b"\x00\x13\x37\x42\x00\x99"
    return bytes(damaged)


def test_a_libjpeg_warning_sends_the_jpeg_to_the_whole_decode(helper: Any) -> None:
    """Damage libjpeg warns about, in the rows the crop needs: the helper refuses
    (the usual decoder then gives ImageFolder's outcome); damage below the crop
    is never read, and the rows above it are the same in any decode."""
    data = _corrupt_scan(photo_jpeg(300, 300, seed=3), 0.3, marker=True)
    buf = np.empty(3 * 300 * 300, np.uint8)
    with pytest.raises(ValueError, match="libjpeg warned"):
        helper(data, 0, 0, 300, 300, buf)
    assert decode_region(data, (0, 0, 300, 300), 300) is None
    assert decode_region(data, (0, 0, 16, 300), 300) is not None


def test_damaged_jpegs_give_imagefolders_pixels(helper: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scan damage above, inside or below the crop, and truncation: every sample is
    what ImageFolder gives (Pillow decodes past scan damage; with
    LOAD_TRUNCATED_IMAGES it decodes a truncated file too), one by one and in batches."""
    whole = photo_jpeg(240, 200, seed=4)
    for k, at in enumerate((0.05, 0.5, 0.95)):
        write(tmp_path / "src" / "a" / f"scan{k}.jpg", _corrupt_scan(whole, at))
        write(tmp_path / "src" / "a" / f"marker{k}.jpg", _corrupt_scan(whole, at, marker=True))
    write(tmp_path / "src" / "a" / "whole.jpg", whole)
    write(tmp_path / "src" / "b" / "cut.jpg", whole[: len(whole) * 3 // 4])
    pack(tmp_path / "src", tmp_path / "p", check="none", progress=False)
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    steps = T.Compose([T.RandomResizedCrop(48), T.RandomHorizontalFlip(), T.PILToTensor()])
    assert_imagefolders_samples(
        ImageFolder(str(tmp_path / "src"), transform=steps), LMDBFolder(tmp_path / "p", transform=steps), 12
    )


def test_boxes_outside_the_image_and_small_buffers_are_refused(helper: Any) -> None:
    data = photo_jpeg(64, 48, seed=5)
    buf = np.empty(3 * 64 * 48, np.uint8)
    for box in [(0, 0, 49, 10), (0, 60, 10, 5), (-1, 0, 5, 5), (0, 0, 0, 5)]:
        top, left, h, w = box
        with pytest.raises(ValueError, match="not inside the image"):
            helper(data, left, top, w, h, buf)
    with pytest.raises(ValueError, match="too small"):
        helper(data, 0, 0, 64, 48, np.empty(100, np.uint8))
    assert decode_region(data, (0, 0, 49, 10), 64) is None  # a header that lies: decoded whole
    cmyk = _jpeg(Image.new("CMYK", (32, 32), (10, 20, 30, 40)))
    assert decode_region(cmyk, (0, 0, 8, 8), 32) is None  # CMYK -> RGB is Pillow's conversion


@pytest.mark.parametrize("sampling", [0x12, 0x41, 0x21 + 0x100])
def test_untested_chroma_layouts_are_decoded_whole(helper: Any, sampling: int) -> None:
    """4:4:0 (Y 1x2), 4:1:1 (Y 4x1), subsampled chroma: layouts the tests cannot
    make with Pillow are not trusted to the region decoder (refused at the header)."""
    data = bytearray(_jpeg(Image.new("RGB", (32, 32), (10, 200, 30)), quality=90, subsampling=0))
    sof = data.index(b"\xff\xc0")
    component = 1 if sampling > 0xFF else 0  # Cb for the last case, else Y
    data[sof + 11 + 3 * component] = sampling & 0xFF
    with pytest.raises(ValueError, match="chroma sampling"):
        helper(bytes(data), 0, 0, 8, 8, np.empty(3 * 32 * 32, np.uint8))
    assert decode_region(bytes(data), (0, 0, 8, 8), 32) is None


def test_a_helper_that_differs_from_pillow_is_not_used(helper: Any, fresh: Any, tmp_path: Path) -> None:
    def off_by_one(data: Any, left: int, top: int, width: int, height: int, out: np.ndarray) -> tuple[int, int]:
        x0, w0 = helper(data, left, top, width, height, out)
        out[0] ^= 1
        return x0, w0

    compiled = current().compiled()
    caps = fresh(compiled=SimpleNamespace(decode_region=off_by_one, resize_bilinear=compiled.resize_bilinear))
    assert caps.region_decoder() is None
    assert "differ" in (caps.why_no_regions() or "")
    assert decode_region(photo_jpeg(40, 30), (0, 0, 30, 40), 40) is None


def test_without_the_helper_images_are_decoded_whole(fresh: Any, tmp_path: Path) -> None:
    caps = fresh(compiled=None)
    assert caps.region_decoder() is None
    assert "not built" in (caps.why_no_regions() or "")
    _assert_default_path_is_imagefolder(tmp_path, expect_regions=False)


def test_the_environment_switch_turns_regions_off(helper: Any, fresh: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(regions.ENV_SWITCH, "0")
    caps = fresh()
    assert caps.region_decoder() is None
    assert regions.ENV_SWITCH in (caps.why_no_regions() or "")
    monkeypatch.setenv(regions.ENV_SWITCH, "1")
    assert caps.region_decoder() is None  # read once, when the snapshot was made
    caps = fresh()
    assert caps.region_decoder() is not None and caps.why_no_regions() is None


def _assert_default_path_is_imagefolder(tmp_path: Path, *, expect_regions: bool) -> None:
    src = make_photo_tree(tmp_path / "src")
    pack(src, tmp_path / "p", progress=False)
    steps = T.Compose([T.RandomResizedCrop(64), T.RandomHorizontalFlip(), T.PILToTensor()])
    calls = _count_regions()
    assert_imagefolders_samples(ImageFolder(str(src), transform=steps), LMDBFolder(tmp_path / "p", transform=steps))
    assert (calls["n"] > 0) == expect_regions


def _count_regions() -> dict[str, int]:
    """Count the region decodes from here on: the installed snapshot is replaced by
    one whose region decoder (if it has one) counts its calls."""
    calls = {"n": 0}
    caps = current()
    inner = caps.region_decoder()
    counted = None
    if inner is not None:

        def counted(*args: Any) -> tuple[int, int]:
            calls["n"] += 1
            return inner(*args)

    caps_module.install(Capabilities(compiled=caps.compiled(), region_decoder=counted))
    return calls


def test_the_default_path_decodes_regions_with_imagefolders_pixels(helper: Any, fresh: Any, tmp_path: Path) -> None:
    """``LMDBFolder(root, transform=torchvision's RRC + flip)``: ImageFolder's
    samples and random numbers, one by one and in batches, and the crops were
    decoded by region."""
    _assert_default_path_is_imagefolder(tmp_path, expect_regions=True)


def test_decoder_pillow_decodes_whole_images(helper: Any, fresh: Any, tmp_path: Path) -> None:
    src = make_photo_tree(tmp_path / "src")
    pack(src, tmp_path / "p", progress=False)
    ours = LMDBFolder(tmp_path / "p", transform=T.Compose([T.RandomResizedCrop(64), T.PILToTensor()]), decoder="pillow")
    calls = _count_regions()
    ours[0]
    ours.__getitems__([0, 1])
    assert calls["n"] == 0


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_give_imagefolders_batches(helper: Any, tmp_path: Path, context: str) -> None:
    """Two workers, fork and spawn: the batches are ImageFolder's, batch by batch
    (each worker checks the helper against Pillow itself)."""
    src = make_photo_tree(tmp_path / "src")
    pack(src, tmp_path / "p", progress=False)
    steps = T.Compose([T.RandomResizedCrop(64), T.RandomHorizontalFlip(), T.PILToTensor()])
    loaders = []
    for ds in (ImageFolder(str(src), transform=steps), LMDBFolder(tmp_path / "p", transform=steps)):
        torch.manual_seed(7)
        loaders.append(list(DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=context)))
    for (xa, ya), (xb, yb) in zip(*loaders):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert len(loaders[0]) == len(loaders[1]) == 3

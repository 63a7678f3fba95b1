"""The compiled resize (``lmdbfolder.read.crops.exact_resize_into``): Pillow's
``crop(box).resize(size, BILINEAR)``, bit for bit, written straight into a batch."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from PIL import Image
from torchvision import transforms as T
from torchvision.datasets import ImageFolder

from conftest import assert_imagefolders_samples, built, make_photo_tree
from lmdbfolder import pack
from lmdbfolder.read import crops
from lmdbfolder.read.capabilities import current
from lmdbfolder.torch import LMDBFolder


@pytest.fixture
def native() -> tuple[Any, int]:
    return built(current().exact_resize(), "the compiled resize")


def resize_exact_into(src: np.ndarray, box: Any, size: tuple[int, int], dst: np.ndarray, **kw: Any) -> bool:
    fn, order = current().exact_resize()  # type: ignore[misc]
    return crops.exact_resize_into(fn, order, src, box, size, dst, **kw)


def _pillow(src: np.ndarray, box: tuple[int, int, int, int], size: tuple[int, int]) -> np.ndarray:
    return np.asarray(Image.fromarray(src, "RGB").crop(box).resize(size, Image.Resampling.BILINEAR))


def test_random_boxes_and_sizes_are_pillows_pixels(native: tuple[Any, int]) -> None:
    """Noise and smooth images, boxes anywhere, shrinking and growing each way, one
    pass, both, none; HWC and planes, mirrored or not."""
    rng = np.random.default_rng(0)
    for trial in range(600):
        w_img, h_img = int(rng.integers(1, 500)), int(rng.integers(1, 400))
        src = rng.integers(0, 256, (h_img, w_img, 3), dtype=np.uint8)
        if trial % 3 == 0:
            src = np.clip(np.cumsum(rng.integers(-3, 4, (h_img, w_img, 3)), axis=1) + 128, 0, 255).astype(np.uint8)
        left, top = int(rng.integers(0, w_img)), int(rng.integers(0, h_img))
        box = (left, top, int(rng.integers(left + 1, w_img + 1)), int(rng.integers(top + 1, h_img + 1)))
        size = (
            int(rng.choice([224, 1, int(rng.integers(1, 500))])),
            int(rng.choice([224, 2, int(rng.integers(1, 400))])),
        )
        if trial % 7 == 0:
            size = (box[2] - box[0], box[3] - box[1])
        if trial % 11 == 0:
            size = (box[2] - box[0], size[1])
        expected = _pillow(src, box, size)
        planar, flip = bool(trial % 2), bool(trial % 4 < 2)
        dst = np.empty((3, size[1], size[0]) if planar else (size[1], size[0], 3), np.uint8)
        assert resize_exact_into(src, box, size, dst, planar=planar, flip=flip)
        got = dst.transpose(1, 2, 0) if planar else dst
        if flip:
            got = got[:, ::-1]
        assert np.array_equal(got, expected), (trial, src.shape, box, size)


def test_the_pass_order_is_the_installed_pillows(native: tuple[Any, int]) -> None:
    """Pillow 13 resizes vertically first when the height shrinks by more than twice
    what the width does (earlier Pillows never): the 8-bit rounding between the
    passes shows in the pixels, and the order found matches Pillow's."""
    fn, order = native
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, (255, 258, 3), dtype=np.uint8)
    box, size = (0, 0, 258, 255), (257, 85)  # height shrinks 3x, width barely
    expected = _pillow(src, box, size)
    outs = {}
    for o in (0, 1):
        out = np.empty((85, 257, 3), np.uint8)
        crops._call(fn, o, src, box, size, out, planar=False, flip=False)
        outs[o] = out
    assert not np.array_equal(outs[0], outs[1])
    assert np.array_equal(outs[order], expected)


def test_cases_it_does_not_take_are_left_to_pillow(native: tuple[Any, int]) -> None:
    src = np.zeros((10, 10, 3), np.uint8)
    dst = np.empty((4, 4, 3), np.uint8)
    assert not resize_exact_into(src, (0.5, 0, 10, 10), (4, 4), dst)  # a fractional box
    assert not resize_exact_into(src[:, ::2], (0, 0, 5, 10), (4, 4), dst)  # not contiguous
    assert not resize_exact_into(src, (0, 0, 11, 10), (4, 4), dst)  # outside
    assert not resize_exact_into(src, (0, 0, 10, 10), (5, 4), dst)  # wrong destination size
    with pytest.raises(ValueError, match="outside"):
        native[0](src, 10, 8, 5, 10, 4, 4, dst, np.empty(1000, np.uint8), False, False, native[1])


def test_a_resize_that_differs_from_pillow_is_not_used(native: tuple[Any, int], capabilities: Any) -> None:
    real = current().compiled()

    def off_by_one(*args: Any) -> None:
        real.resize_bilinear(*args)  # type: ignore[union-attr]
        args[7][0] ^= 1

    caps = capabilities(compiled=SimpleNamespace(decode_region=real.decode_region, resize_bilinear=off_by_one))  # type: ignore[union-attr]
    assert caps.exact_resize() is None
    assert crops.native_matches_pillow(real.resize_bilinear, native[1])  # type: ignore[union-attr]


def _assert_default_path(tmp_path: Path) -> None:
    src = make_photo_tree(tmp_path / "src")
    pack(src, tmp_path / "p", progress=False)
    steps = T.Compose([T.RandomResizedCrop(64), T.RandomHorizontalFlip(), T.PILToTensor()])
    normalized = T.Compose([T.RandomResizedCrop(48), T.ToTensor(), T.Normalize([0.5] * 3, [0.2] * 3)])
    for tf in (steps, normalized):
        assert_imagefolders_samples(ImageFolder(str(src), transform=tf), LMDBFolder(tmp_path / "p", transform=tf), 3)


def test_the_default_path_resizes_natively_with_imagefolders_pixels(
    native: tuple[Any, int], capabilities: Any, tmp_path: Path
) -> None:
    """torchvision's RRC (+ flip + PILToTensor: the batch path; + ToTensor +
    Normalize: the per-sample path) gives ImageFolder's samples, and the compiled
    resize made them."""
    calls = {"n": 0}
    fn, order = native

    def counted(*args: Any) -> None:
        calls["n"] += 1
        fn(*args)

    capabilities(exact_resize=(counted, order))
    _assert_default_path(tmp_path)
    assert calls["n"] > 0


def test_without_the_compiled_resize_pillow_resizes(capabilities: Any, tmp_path: Path) -> None:
    capabilities(exact_resize=None)
    _assert_default_path(tmp_path)


_EVERY_PATH = """
import sys, numpy as np
from PIL import Image
sys.path.insert(0, {tests!r})
from test_exact_resize import every_path_case
from lmdbfolder.read import _crops
print(_crops.exact_simd(), every_path_case())
"""


def every_path_case() -> str:
    """Random boxes, sizes, filters, flips and layouts of a photo-like 400x300 image, each
    against Pillow: the SIMD horizontal passes (AVX2 groups of four taps, SSE4.1, the plain
    loop at a row's end) and the row stores of every layout. "ok", or the first case that differs."""
    from conftest import built

    fn, order = built(current().exact_bicubic(), "the compiled bicubic resize")
    rng = np.random.default_rng(11)
    x = np.linspace(0, 1, 400)[None, :, None]
    src = np.clip(rng.normal(0, 20, (300, 400, 3)) + 255 * x * np.array([1.0, 0.5, 0.2]), 0, 255).astype(np.uint8)
    img = Image.fromarray(src)
    for trial in range(160):
        w, h = int(rng.integers(1, 401)), int(rng.integers(1, 301))
        left, top = int(rng.integers(0, 401 - w)), int(rng.integers(0, 301 - h))
        size = (int(rng.integers(1, 260)), int(rng.integers(1, 260)))
        cubic, flip, planar = bool(trial % 2), bool(trial % 3 == 0), bool(trial % 5 < 2)
        dst = np.empty((3, size[1], size[0]) if planar else (size[1], size[0], 3), np.uint8)
        box = (left, top, left + w, top + h)
        done = crops.exact_resize_into(fn, order, src, box, size, dst, cubic=cubic, flip=flip, planar=planar)
        want = img.crop(box).resize(size, Image.Resampling.BICUBIC if cubic else Image.Resampling.BILINEAR)
        if flip:
            want = want.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        got = dst.transpose(1, 2, 0) if planar else dst
        if not done or not np.array_equal(got, np.asarray(want)):
            return f"differs: box {box} size {size} cubic {cubic} flip {flip} planar {planar}"
    return "ok"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    except OSError:
        return set()


@pytest.mark.parametrize("simd", ["all", "avx2", "none"])
def test_every_pass_and_layout_is_pillows(simd: str) -> None:
    """With the SIMD passes this machine runs (AVX-512 VBMI's horizontal pass where the CPU
    has it), with AVX2 at most (LMDBFOLDER_NO_AVX512), and without any (LMDBFOLDER_NO_SIMD)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("LMDBFOLDER_NO_SIMD", "LMDBFOLDER_NO_AVX512")}
    if simd == "avx2":
        env["LMDBFOLDER_NO_AVX512"] = "1"
    elif simd == "none":
        env["LMDBFOLDER_NO_SIMD"] = "1"
    code = _EVERY_PATH.format(tests=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    used, result = done.stdout.split()
    assert result == "ok"
    flags = _cpu_flags()
    wanted = {"all": "avx512-vbmi", "avx2": "avx2", "none": "none"}[simd]
    if simd == "none" or {"avx512bw", "avx512vl", "avx512vbmi", "avx512_vnni"} <= flags:
        assert used == wanted  # the pass asked for is the one that ran
    elif simd == "all" and "avx2" in flags:
        assert used in ("avx2", "avx512-vbmi")

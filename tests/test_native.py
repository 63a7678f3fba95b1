"""resize="native": the compiled bilinear and the batch made in C without the GIL.

The resize is held to a float model of bilinear interpolation (OpenCV's
INTER_LINEAR geometry: half-pixel centres, edges clamped) and to OpenCV
itself; its SIMD pass to its scalar one, byte for byte. The batch
(``_crops.Batch``) is held to the per-sample path in ``test_batch_path.py``
(every kind of image, threads, fork and spawn workers, damaged records);
here: what it refuses, and that its threads end with it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torchvision import transforms as T

from conftest import INSTALLED, photo_jpeg, write
from lmdbfolder import fused, pack
from lmdbfolder.read.capabilities import current
from lmdbfolder.torch import LMDBFolder

native = current().native_resize()
pytestmark = pytest.mark.skipif(native is None, reason="the compiled helper is not built")


def _cases(seed: int, n: int) -> list[tuple[np.ndarray, tuple[int, int, int, int], tuple[int, int], bool]]:
    """Images (noise, and smooth ramps), boxes and output sizes: 1-pixel crops, enlargements,
    reductions, odd sizes, flips."""
    rng = np.random.default_rng(seed)
    cases = []
    for k in range(n):
        h, w = (int(v) for v in rng.integers(1, 160, 2))
        if k % 3 == 0:
            yy, xx = np.mgrid[0:h, 0:w]
            img = np.stack([xx * 255 // max(w - 1, 1), yy * 255 // max(h - 1, 1), (xx + yy) % 256], -1).astype(np.uint8)
        else:
            img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        left, top = int(rng.integers(0, w)), int(rng.integers(0, h))
        box = (left, top, int(rng.integers(1, w - left + 1)), int(rng.integers(1, h - top + 1)))
        size = (224, 224) if k % 4 == 0 else tuple(int(v) for v in rng.integers(1, 200, 2))
        cases.append((img, box, size, bool(rng.integers(0, 2))))
    return cases


def _resize(img: np.ndarray, box: tuple[int, int, int, int], size: tuple[int, int], flip: bool) -> np.ndarray:
    left, top, w, h = box
    out = np.empty((3, size[1], size[0]), np.uint8)
    native.resize_native(np.ascontiguousarray(img[top:]), img.shape[1], left, w, h, size[0], size[1], out, flip)
    return out.transpose(1, 2, 0)


def _model(img: np.ndarray, box: tuple[int, int, int, int], size: tuple[int, int], flip: bool) -> np.ndarray:
    left, top, w, h = box
    crop = img[top : top + h, left : left + w].astype(np.float64)

    def taps(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        f = np.clip((np.arange(n_out) + 0.5) * n_in / n_out - 0.5, 0, n_in - 1)
        i0 = np.floor(f).astype(int)
        return i0, np.minimum(i0 + 1, n_in - 1), f - i0

    x0, x1, ax = taps(w, size[0])
    y0, y1, ay = taps(h, size[1])
    rows = crop[y0] * (1 - ay)[:, None, None] + crop[y1] * ay[:, None, None]
    out = rows[:, x0] * (1 - ax)[None, :, None] + rows[:, x1] * ax[None, :, None]
    return out[:, ::-1] if flip else out


def test_the_resize_is_bilinear_within_its_rounding() -> None:
    # 8-bit weights each way: at most 1/512 of a step off per pass, and one rounding.
    for img, box, size, flip in _cases(0, 150):
        got = _resize(img, box, size, flip).astype(np.float64)
        assert np.abs(got - _model(img, box, size, flip)).max() <= 1.25, (img.shape, box, size, flip)


@pytest.mark.skipif("opencv" not in INSTALLED, reason="needs opencv-python-headless")
def test_the_resize_is_within_one_grey_level_of_opencv() -> None:
    import cv2

    for img, box, size, flip in _cases(1, 150):
        left, top, w, h = box
        if w < 2 or h < 2 or size[0] * 2 < w or size[1] * 2 < h:
            continue  # OpenCV's INTER_LINEAR takes other paths there (and ours aliases, as it does)
        theirs = cv2.resize(
            np.ascontiguousarray(img[top : top + h, left : left + w]), size, interpolation=cv2.INTER_LINEAR
        )
        ours = _resize(img, box, size, flip)
        assert np.abs(ours.astype(int) - (theirs[:, ::-1] if flip else theirs)).max() <= 1


_SCALAR = """
import sys, numpy as np
sys.path.insert(0, {tests!r})
from test_native import _cases, _resize
from lmdbfolder.read import _crops
assert not _crops.native_simd()
sys.stdout.buffer.write(b"".join(_resize(*case).tobytes() for case in _cases(2, 120)))
"""


def test_the_simd_pass_gives_the_scalar_pass_bytes() -> None:
    if not native.native_simd():
        pytest.skip("no SIMD pass on this machine: the scalar one is all there is")
    env = dict(os.environ, LMDBFOLDER_NO_SIMD="1")
    code = _SCALAR.format(tests=str(Path(__file__).parent))
    scalar = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, check=True).stdout
    assert scalar == b"".join(_resize(*case).tobytes() for case in _cases(2, 120))


def test_the_resize_refuses_what_it_cannot_do() -> None:
    src = np.zeros((10, 20, 3), np.uint8)
    out = np.empty((3, 8, 8), np.uint8)
    for args, message in [
        ((src, 20, 15, 10, 10, 8, 8, out, False), "outside the rows"),
        ((src, 20, 0, 0, 10, 8, 8, out, False), "empty"),
        ((src, 20, 0, 10, 11, 8, 8, out, False), "smaller than height rows"),
        ((src, 20, 0, 10, 10, 9, 9, out, False), "dst is too small"),
    ]:
        with pytest.raises(ValueError, match=message):
            native.resize_native(*args)


def test_a_batch_refuses_misuse_and_boxes_outside_the_image() -> None:
    jpeg = photo_jpeg(64, 48)
    out = np.zeros((2, 3, 16, 16), np.uint8)
    with pytest.raises(ValueError, match="capacity x 3 x out_h x out_w"):
        native.Batch(out, 16, 16, 3, 1)  # room for 2 images, not 3
    batch = native.Batch(out, 16, 16, 2, 2)
    with pytest.raises(ValueError, match="box outside the image"):
        batch.add(0, jpeg, 60, 0, 10, 10, 64, 48, False)
    with pytest.raises(ValueError, match="outside the batch"):
        batch.add(2, jpeg, 0, 0, 10, 10, 64, 48, False)
    held = bytearray(jpeg)
    batch.add(0, held, 0, 0, 64, 48, 64, 48, False)
    batch.add(1, b"\xff\xd8 not a JPEG \xff\xd9", 0, 0, 10, 10, 64, 48, True)
    with pytest.raises(BufferError):
        held.append(0)  # the batch holds it until it is finished
    failed = batch.finish()
    held.append(0)  # ... and lets go of it then (a payload is a view of a pack's map)
    assert [k for k, _ in failed] == [1] and "region decode" in failed[0][1]
    assert out[0].any()  # image 0 was made
    with pytest.raises(RuntimeError, match="finished"):
        batch.add(1, jpeg, 0, 0, 10, 10, 64, 48, False)
    assert batch.finish() == failed  # asking again changes nothing


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_batch_dropped_unfinished_still_joins_its_threads() -> None:
    def threads() -> int:
        return len(os.listdir("/proc/self/task"))  # the batch's threads are not Python's

    out = np.zeros((4, 3, 16, 16), np.uint8)
    before = threads()
    batch = native.Batch(out, 16, 16, 4, 3)
    assert threads() == before + 2  # this thread makes the third share
    batch.add(0, photo_jpeg(64, 48), 0, 0, 64, 48, 64, 48, False)
    del batch  # an error between add and finish: the threads end, the payloads are let go
    assert threads() == before


def test_the_dataset_says_native_and_refuses_it_without_the_helper(tmp_path: Path, capabilities: Any) -> None:
    write(tmp_path / "src" / "a" / "0.jpg", photo_jpeg(80, 60))
    pack(tmp_path / "src", tmp_path / "p", progress=False)
    tf = T.Compose([fused.RandomResizedCrop(32, resize="native", output="tensor"), T.RandomHorizontalFlip()])
    ds = LMDBFolder(tmp_path / "p", transform=tf, threads=2)
    assert "resize='native'" in repr(ds)
    assert ds.__getitems__([0, 0]).images.shape == (2, 3, 32, 32)
    capabilities(compiled=None)
    with pytest.raises(ImportError, match="libjpeg-dev.*reinstall lmdbfolder"):
        fused.RandomResizedCrop(32, resize="native")


def test_an_empty_batch_is_made_as_with_the_other_resizes() -> None:
    from lmdbfolder.read.plan import CropSpec, ReadPlan

    caps = current()
    for resize in ("pil", "native"):
        plan = ReadPlan(caps.decoder("auto"), crop=CropSpec((8, 8), resize), threads=2)
        plan.run([], np.empty((0, 3, 8, 8), np.uint8))  # Batch refuses a capacity of 0: never asked for one
        assert plan.start(np.empty((0, 3, 8, 8), np.uint8)) is None


def test_more_threads_than_a_batch_starts_are_capped_not_refused(tmp_path: Path) -> None:
    # threads=300 (a large machine's core count) with a batch of more than 256 images:
    # the C batch refuses more than 256 threads, and every batch failed with its ValueError.
    write(tmp_path / "src" / "a" / "0.jpg", photo_jpeg(24, 16))
    pack(tmp_path / "src", tmp_path / "p", progress=False)
    crop = fused.RandomResizedCrop(4, resize="native", output="tensor")
    ds = LMDBFolder(tmp_path / "p", transform=crop, threads=300)
    assert ds.__getitems__([0] * 260).images.shape == (260, 3, 4, 4)


def test_a_refused_batch_lets_go_of_its_output() -> None:
    # Batch took its out buffer before checking the sizes and kept the export when it
    # refused them: the caller's buffer stayed pinned (a bytearray could not be resized).
    out = bytearray(3 * 4 * 4)
    for args in ((out, 4, 4, 2, 1), (out, 4, 4, 1, 0), (out, 4, 4, 1, 257)):
        with pytest.raises(ValueError, match="capacity x 3 x out_h x out_w"):
            native.Batch(*args)
        out.append(0)  # no export left
        del out[-1]
    batch = native.Batch.__new__(native.Batch)
    with pytest.raises(ValueError):
        batch.__init__(out, 4, 4, 2, 1)
    batch.__init__(out, 4, 4, 1, 1)  # a second try after a refusal: one export, let go by finish
    batch.finish()
    out.append(0)


def test_a_reduced_crop_keeps_torchvisions_box() -> None:
    # With reduce=True a JPEG is decoded at 1/d of its size and torchvision's box
    # (full-size pixels) falls between the decoded pixels. The output must sample
    # the box itself: rounding it to whole decoded pixels moved the crop by up to
    # a third of an output pixel. A linear ramp makes any shift show: bilinear
    # interpolation of a ramp is the ramp, so the output must be the ramp at
    # torchvision's sample points, up to 8-bit rounding.
    from lmdbfolder.read.crops import native_resize_into, scaled_box

    full_w, full_h, d = 1000, 800, 8
    dec_w, dec_h = -(-full_w // d), -(-full_h // d)  # libjpeg's size at scale 1/d

    def ramp(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return np.stack([0.2 * x, 0.25 * y, 0.1 * x + 0.1 * y], -1)

    # decoded pixel i averages full pixels i*d .. i*d + d - 1: its centre is (i + 0.5) * d - 0.5
    yy, xx = np.mgrid[0:dec_h, 0:dec_w]
    decoded = np.round(ramp((xx + 0.5) * d - 0.5, (yy + 0.5) * d - 0.5)).astype(np.uint8)
    worst = 0.0
    for top, left, height, width in [(101, 101, 573, 573), (37, 250, 530, 690), (5, 13, 700, 515)]:
        size = (64, 56)
        box = (top, left, height, width)
        out = np.empty((3, size[1], size[0]), np.uint8)
        native_resize_into(
            native.resize_native,
            decoded,
            scaled_box(box, (full_w, full_h), (dec_w, dec_h)),
            size,
            out,
            planar=True,
            flip=False,
        )
        # torchvision's sample points, in full-size pixel coordinates
        ox = left + (np.arange(size[0]) + 0.5) * width / size[0] - 0.5
        oy = top + (np.arange(size[1]) + 0.5) * height / size[1] - 0.5
        gx, gy = np.meshgrid(ox, oy)
        want = ramp(gx, gy).transpose(2, 0, 1)
        # decoded pixels are rounded (0.5), and the image's scale is not exactly 1/d
        # (ceil(1000 / 8) = 125 pixels hold 1000): allow for both, not for a shift
        err = np.abs(out.astype(np.float64) - want)
        worst = max(worst, float(err.mean()))
        assert err.max() <= 1.5, f"box {box}: the output is off torchvision's box by {err.max():.2f} levels"
    assert worst <= 0.5, f"mean error {worst:.2f} levels: the crop is shifted"

"""The decoder registry: every installed decoder returns Pillow's RGB pixels."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from conftest import INSTALLED, ODD_KINDS, image_bytes, photo_jpeg, write
from lmdbfolder.errors import DecoderUnavailableError
from lmdbfolder.read.capabilities import available_decoders, get_decoder, resolve_decoder_name
from lmdbfolder.read.decoders import DECODER_NAMES, decode_payload, scale_for_size, size_hint_scale, to_pil
from lmdbfolder.read.reader import Reader
from lmdbfolder.write.writer import pack


def pil_rgb(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.int16)


def test_pillow_is_always_available_and_auto_resolves() -> None:
    assert available_decoders()["pillow"] is None
    assert set(available_decoders()) == set(DECODER_NAMES)
    assert resolve_decoder_name("auto") in INSTALLED


def test_unknown_decoder_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown decoder 'nope'"):
        get_decoder("nope")


def test_unavailable_decoder_says_how_to_install(monkeypatch: pytest.MonkeyPatch, capabilities: Any) -> None:
    import lmdbfolder.read.decoders as decoders

    def missing() -> object:
        raise ImportError("No module named 'simplejpeg'")

    monkeypatch.setitem(decoders._FACTORIES, "simplejpeg", missing)
    capabilities()
    with pytest.raises(DecoderUnavailableError) as info:
        get_decoder("simplejpeg")
    assert "pip install simplejpeg" in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("name", INSTALLED)
@pytest.mark.parametrize(
    "kind",
    [
        {},
        {"subsampling": 0},  # 4:4:4
        {"progressive": True},
        {"mode": "L"},
        {"exif": True},  # orientation tag: ignored, like ImageFolder
    ],
    ids=["420", "444", "progressive", "gray", "exif"],
)
def test_decoders_match_pillow(name: str, kind: dict) -> None:
    kind = dict(kind)
    if kind.pop("exif", False):
        exif = Image.Exif()
        exif[0x0112] = 6
        kind["exif"] = exif
    data = photo_jpeg(**kind)
    ref = pil_rgb(data)
    channels = 1 if kind.get("mode") == "L" else 3
    out = decode_payload(memoryview(data), "jpeg", 161, 121, channels, get_decoder(name))
    got = np.asarray(out, dtype=np.int16)
    assert got.shape == ref.shape == (121, 161, 3)  # same orientation, RGB
    diff = np.abs(got - ref)
    assert diff.mean() < 0.5 and diff.max() <= 4, (diff.mean(), diff.max())


@pytest.mark.parametrize("name", INSTALLED)
def test_scaled_decoding_sizes_and_pixels(name: str) -> None:
    data = photo_jpeg(161, 121)
    dec = get_decoder(name)
    for denom in (2, 4, 8):
        out = np.asarray(decode_payload(data, "jpeg", 161, 121, 3, dec, denom=denom), dtype=np.int16)
        if denom not in dec.scales:  # torchvision: always full size
            assert out.shape == (121, 161, 3)
            continue
        assert out.shape == (-(-121 // denom), -(-161 // denom), 3)  # libjpeg: ceil(size / denom)
        ref = np.asarray(Image.fromarray(pil_rgb(data).astype(np.uint8)).reduce(denom), dtype=np.int16)
        h, w = min(out.shape[0], ref.shape[0]), min(out.shape[1], ref.shape[1])
        assert np.abs(out[:h, :w] - ref[:h, :w]).mean() < 6  # the same picture, smaller


@pytest.mark.parametrize("name", INSTALLED)
def test_odd_images_fall_back_to_pillow(name: str) -> None:
    dec = get_decoder(name)
    rng = np.random.default_rng(3)
    for kind in ODD_KINDS:
        data, _ = image_bytes(kind, rng)
        from lmdbfolder.encodings import sniff

        info = sniff(data)
        out = to_pil(decode_payload(data, info.encoding, info.width, info.height, info.channels, dec))
        ref = Image.open(io.BytesIO(data)).convert("RGB")
        assert out.mode == "RGB" and out.size == ref.size
        if kind in ("cmyk_jpeg",) or info.encoding != "jpeg":
            assert out.tobytes() == ref.tobytes(), kind  # Pillow itself: exact


def test_decoding_reads_the_map_without_copies(tmp_path: Path) -> None:
    write(tmp_path / "src" / "a" / "x.jpg", photo_jpeg())
    pack(tmp_path / "src", tmp_path / "p", progress=False)
    with Reader(tmp_path / "p") as r:
        rec = r.get(0)
        assert isinstance(rec.payload, memoryview) and rec.payload.readonly
        for name in INSTALLED:
            out = decode_payload(rec.payload, rec.encoding, rec.width, rec.height, rec.channels, get_decoder(name))
            assert np.asarray(out).shape == (121, 161, 3)


def test_scale_choice() -> None:
    assert scale_for_size(500, 375, 224, 224, (1, 2, 4, 8)) == 1
    assert scale_for_size(1000, 800, 224, 224, (1, 2, 4, 8)) == 2
    assert scale_for_size(2000, 1800, 224, 224, (1, 2, 4, 8)) == 8
    assert scale_for_size(2000, 1800, 224, 224, (1,)) == 1
    assert scale_for_size(0, 0, 1, 1, (1, 2)) == 1  # unknown size: full decode
    assert size_hint_scale(500, 375, 160, (1, 2, 4, 8)) == 2  # ceil(375 / 2) = 188 >= 160
    assert size_hint_scale(375, 500, 160, (1, 2, 4, 8)) == 2
    assert size_hint_scale(500, 375, 188, (1, 2, 4, 8)) == 2
    assert size_hint_scale(500, 375, 189, (1, 2, 4, 8)) == 1
    assert size_hint_scale(4000, 3000, 224, (1, 2, 4, 8)) == 8


def test_every_decoder_whose_library_is_present_is_tested() -> None:
    """Guards against a decoder silently dropping out of the equivalence tests."""
    import ctypes.util
    import importlib.util

    if ctypes.util.find_library("turbojpeg") and importlib.util.find_spec("turbojpeg"):
        assert "turbojpeg" in INSTALLED
    for module, name in (("simplejpeg", "simplejpeg"), ("cv2", "opencv"), ("torchvision", "torchvision")):
        if importlib.util.find_spec(module):
            assert name in INSTALLED, available_decoders()[name]

"""The header sniffer against Pillow, and decoding against torchvision's loader."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from conftest import ODD_KINDS, image_bytes
from lmdbfolder.encodings import decode_rgb, raw_rgb, sniff

EXPECTED_ENCODING = {
    "rgb_jpeg": "jpeg",
    "gray_jpeg": "jpeg",
    "cmyk_jpeg": "jpeg",
    "progressive_jpeg": "jpeg",
    "exif_jpeg": "jpeg",
    "rgba_png": "png",
    "palette_png": "png",
    "gray_png": "png",
    "la_png": "png",
    "bmp": "bmp",
    "webp": "webp",
    "webp_lossless_alpha": "webp",
    "ppm": "pnm",
    "pgm": "pnm",
    "tiff": "tiff",
    "gif": "gif",
}
EXPECTED_CHANNELS = {
    "rgb_jpeg": 3,
    "gray_jpeg": 1,
    "cmyk_jpeg": 4,
    "progressive_jpeg": 3,
    "exif_jpeg": 3,
    "rgba_png": 4,
    "palette_png": 1,
    "gray_png": 1,
    "la_png": 2,
    "bmp": 3,
    "webp": 3,
    "webp_lossless_alpha": 4,
    "ppm": 3,
    "pgm": 1,
    "gif": 1,
}


@pytest.mark.parametrize("kind", ODD_KINDS + ["gif"])
def test_sniff_agrees_with_pillow(kind: str) -> None:
    data, _ = image_bytes(kind, np.random.default_rng(3), w=37, h=21)
    info = sniff(data)
    assert info.encoding == EXPECTED_ENCODING[kind]
    if kind == "tiff":
        assert (info.width, info.height) == (0, 0)  # not parsed: unknown is allowed
        return
    with Image.open(io.BytesIO(data)) as img:
        assert (info.width, info.height) == img.size
    assert info.channels == EXPECTED_CHANNELS[kind]


def test_sniff_large_dimensions() -> None:
    img = Image.new("RGB", (1000, 40000))
    out = io.BytesIO()
    img.save(out, "PNG")
    assert sniff(out.getvalue())[:3] == ("png", 1000, 40000)


@pytest.mark.parametrize(
    "data", [b"", b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"RIFF\x00\x00\x00\x00WEBP", b"BM", b"P6\n", b"hello"]
)
def test_sniff_never_raises_on_fragments(data: bytes) -> None:
    info = sniff(data)
    assert info.width == 0 or info.encoding != "other"


@settings(max_examples=300)
@given(
    st.binary(max_size=80),
    st.sampled_from(
        [b"", b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"RIFF\x10\x00\x00\x00WEBPVP8 ", b"BM", b"GIF89a", b"P5 "]
    ),
)
def test_sniff_never_raises_on_garbage(tail: bytes, prefix: bytes) -> None:
    sniff(prefix + tail)


@pytest.mark.parametrize("kind", ODD_KINDS)
def test_decode_matches_pil_loader(kind: str) -> None:
    data, _ = image_bytes(kind, np.random.default_rng(4))
    expected = Image.open(io.BytesIO(data)).convert("RGB")
    got = decode_rgb(data, sniff(data).encoding, 0, 0)
    assert got.mode == "RGB" and got.size == expected.size
    assert got.tobytes() == expected.tobytes()
    pixels, w, h = raw_rgb(data)
    assert decode_rgb(memoryview(pixels), "raw", w, h).tobytes() == expected.tobytes()


def test_raw_decode_owns_its_pixels() -> None:
    pixels = bytearray(b"\x01\x02\x03" * 4)
    img = decode_rgb(memoryview(pixels), "raw", 2, 2)
    pixels[:3] = b"\x00\x00\x00"
    assert img.getpixel((0, 0)) == (1, 2, 3)


def test_clean_header_vouches_only_for_what_pillow_opens_the_same() -> None:
    """The writer's Pillow-free header check (``clean_header``) may only say yes where
    Pillow's open says yes with the same size: checked on valid files of every
    kind and on thousands of header mutations of them (bit flips, byte changes,
    cuts). It must also say yes for ordinary JPEGs and PNGs, or it buys nothing."""
    import random

    from conftest import ODD_KINDS, image_bytes
    from lmdbfolder.encodings import clean_header

    rng = np.random.default_rng(0)
    vouched = {"jpeg": 0, "png": 0}
    originals = []
    for kind in ODD_KINDS:
        for k in range(3):
            data, _ = image_bytes(kind, rng, w=19 + 5 * k, h=13 + 3 * k)
            originals.append(data)
            info = sniff(data)
            if clean_header(data, info):
                vouched[info.encoding] += 1
    assert vouched["jpeg"] >= 9 and vouched["png"] >= 6
    pick = random.Random(1)
    checked = 0
    for trial in range(6000):
        data = bytearray(pick.choice(originals))
        head = min(len(data), 700)
        what = trial % 3
        if what == 0:
            pos = pick.randrange(head)
            data[pos] ^= 1 << pick.randrange(8)
        elif what == 1:
            data[pick.randrange(head)] = pick.randrange(256)
        else:
            data = data[: pick.randrange(2, head)] + data[head:]
        info = sniff(bytes(data))
        if not clean_header(bytes(data), info):
            continue
        checked += 1
        with Image.open(io.BytesIO(bytes(data))) as img:  # must not raise
            assert img.size == (info.width, info.height)
    assert checked > 1000


def test_vouch_jpeg_is_sniff_clean_header_and_data_start_in_one_walk() -> None:
    """``vouch_jpeg`` replaces three walks of a JPEG header in the writer; it must
    say exactly what they say, on valid files and on thousands of header mutations."""
    import random

    from conftest import ODD_KINDS, image_bytes
    from lmdbfolder.encodings import _jpeg_data_start, clean_header, vouch_jpeg

    rng = np.random.default_rng(3)
    originals = [image_bytes(kind, rng, w=17 + 4 * k, h=11 + 5 * k)[0] for kind in ODD_KINDS for k in range(3)]
    pick = random.Random(2)
    agreed = 0
    for trial in range(8000):
        data = bytearray(pick.choice(originals))
        if trial >= len(originals):
            head = min(len(data), 700)
            if trial % 3 == 0:
                data[pick.randrange(head)] ^= 1 << pick.randrange(8)
            elif trial % 3 == 1:
                data[pick.randrange(head)] = pick.randrange(256)
            else:
                data = data[: pick.randrange(2, head)] + data[head:]
        raw = bytes(data)
        info = sniff(raw)
        separately = (info, _jpeg_data_start(raw)) if info.encoding == "jpeg" and clean_header(raw, info) else None
        assert vouch_jpeg(raw) == separately
        assert vouch_jpeg(memoryview(raw)) == separately
        agreed += separately is not None
    assert agreed > 1000


def test_every_header_id_has_one_encoding_and_back() -> None:
    # The format defines the ids; the encodings module gives each its meaning.
    from lmdbfolder.encodings import ENCODINGS, OTHER, encoding_by_id, encoding_of
    from lmdbfolder.format import ENCODINGS as HEADER_IDS

    assert set(ENCODINGS) == set(HEADER_IDS.values())
    for ident, name in HEADER_IDS.items():
        assert encoding_by_id(ident) is ENCODINGS[name] and ENCODINGS[name].id == ident
    assert encoding_by_id(254) is None
    assert encoding_of("no such kind") is OTHER and not sniff(b"nothing").recognised


def test_each_encoding_encodes_what_it_decodes() -> None:
    from lmdbfolder.encodings import DEFAULT_RESIZE_FORMAT, ENCODINGS, JPEG, PNG, RAW, RESIZE_FORMATS

    assert RESIZE_FORMATS == ("jpeg", "webp") and DEFAULT_RESIZE_FORMAT == "jpeg"
    image = Image.fromarray(np.arange(6 * 5 * 3, dtype=np.uint8).reshape(6, 5, 3))
    for name in (*RESIZE_FORMATS, "png"):
        enc = ENCODINGS[name]
        payload = bytes(enc.encode(image, 90))
        assert sniff(payload)[:3] == (name, 5, 6)
        assert enc.decode_rgb(payload, 5, 6).size == (5, 6)
    assert bytes(PNG.encode(image)) == bytes(PNG.file_bytes(PNG.encode(image), 5, 6))  # a file as it is
    pixels = RAW.encode(image)
    assert pixels == image.tobytes() and RAW.encode(image.convert("L")) == image.convert("L").convert("RGB").tobytes()
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(RAW.file_bytes(pixels, 5, 6)))), np.asarray(image))
    assert JPEG.pillow_formats == ("JPEG",) and JPEG.extension == "jpg" and RAW.extension == "png"
    with pytest.raises(NotImplementedError):
        ENCODINGS["gif"].encode(image)

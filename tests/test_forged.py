"""Packs from strangers (issue 22): the payload is the truth, a record header is a claim.

A CRC-32 is not a MAC: whoever writes a pack can make every checksum valid
(``conftest.forge_record`` does exactly that). So every decode path (plain,
fused crop, batched, region, the GPU path's workers and CPU fallback) holds a
header's size and components against the payload's own header before a crop
box is drawn from them, and applies Pillow's decompression-bomb limits to the
payload's size before anything is allocated; ``verify`` reports the same.
Oracles: torchvision's ImageFolder on the same bytes, and Pillow's own limits.
"""

from __future__ import annotations

import io
import struct
import subprocess
import sys
import tracemalloc
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms as T
from torchvision.datasets import ImageFolder

from conftest import built, forge_record, forge_table, image_bytes, make_photo_tree, photo_jpeg, write
from lmdbfolder import fused
from lmdbfolder.encodings import ENCODINGS, PayloadMismatch, check_bomb, encoding_of, sniff
from lmdbfolder.errors import DecodeError
from lmdbfolder.gpu import DeviceRandomResizedCrop, RecordBytes
from lmdbfolder.read.capabilities import current
from lmdbfolder.read.reader import Reader
from lmdbfolder.tools.verify import verify
from lmdbfolder.torch import LMDBFolder
from lmdbfolder.write.writer import pack


def _copy_pack(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    (dst / "data.mdb").write_bytes((src / "data.mdb").read_bytes())
    return dst


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("forged")
    src = make_photo_tree(base / "src")
    rng = np.random.default_rng(3)
    cmyk, ext = image_bytes("cmyk_jpeg", rng, 40, 30)
    write(src / "c0" / f"zz-cmyk{ext}", cmyk)
    png, ext = image_bytes("rgba_png", rng, 40, 30)
    write(src / "c1" / f"zz-rgba{ext}", png)
    pack(src, base / "photos.lmdb", progress=False)
    return base / "photos.lmdb"


def _index(pack_dir: Path, name: str) -> int:
    with Reader(pack_dir) as r:
        return next(i for i, p in enumerate(r.paths()) if name in p)


def _crops(decoder: str) -> list[tuple[str, Any]]:
    exact = T.Compose([T.RandomResizedCrop(32), T.PILToTensor()])
    fast = fused.RandomResizedCrop(24, output="tensor")
    crops = [("plain", None), ("torchvision crop", exact), ("fused crop", fast)]
    if current().native_resize() is not None:  # the batch made in C
        crops.append(("native fused crop", fused.RandomResizedCrop(24, resize="native", output="tensor")))
    return crops


def _every_path_refuses(pack_dir: Path, index: int, cause: type[BaseException]) -> None:
    """Every read path raises DecodeError for ``index`` (caused by ``cause``) and reads the others."""
    other = 1 if index != 1 else 0
    for decoder in ("pillow", "auto"):
        for name, tf in _crops(decoder):
            ds = LMDBFolder(pack_dir, transform=tf, decoder=decoder)
            with pytest.raises(DecodeError, match=f"record {index} ") as info:
                ds[index]
            assert isinstance(info.value.__cause__, cause), (decoder, name, info.value)
            ds[other]
            if tf is not None:  # the batched path
                with pytest.raises(DecodeError, match=f"record {index} ") as info:
                    ds.__getitems__([other, index])
                assert isinstance(info.value.__cause__, cause), (decoder, name, "batch")
    with pytest.raises(DecodeError, match=f"record {index} "):
        Reader(pack_dir).image(index)
    # The GPU path: its workers draw the boxes from the header (and its device decodes by it).
    for plan in (DeviceRandomResizedCrop(16, device="cpu"), None):
        records = RecordBytes(pack_dir, plan=plan)
        with pytest.raises(DecodeError, match=f"record {index} "):
            records.__getitems__([other, index])


@pytest.mark.parametrize(
    "lie",
    [
        pytest.param({"width": 1}, id="width+1"),
        pytest.param({"height": -1}, id="height-1"),
        pytest.param({"width": 1, "height": 1}, id="both+1"),
    ],
)
def test_a_size_one_pixel_off_is_a_clear_error_everywhere(photos: Path, tmp_path: Path, lie: dict[str, int]) -> None:
    # A header 1 px off gave another RandomResizedCrop than ImageFolder on the same
    # bytes (and shifted every later random draw); verify said OK.
    forged = _copy_pack(photos, tmp_path / "forged.lmdb")
    index = _index(forged, "c0/03.jpg")
    with Reader(forged) as r:
        rec = r.get(index)
        changes = {"width": rec.width + lie.get("width", 0), "height": rec.height + lie.get("height", 0)}
    forge_record(forged, index, **changes)
    _every_path_refuses(forged, index, PayloadMismatch)
    for decode in (False, True):
        report = verify(forged, decode=decode)
        assert [(p.kind, p.index) for p in report.problems] == [("header", index)], report.problems
        assert "payload's own header says" in report.problems[0].message


def test_a_cmyk_jpeg_labelled_three_components_is_refused(photos: Path, tmp_path: Path) -> None:
    # It went to the fast decoder and came back in other colours.
    forged = _copy_pack(photos, tmp_path / "forged.lmdb")
    index = _index(forged, "zz-cmyk")
    forge_record(forged, index, channels=3)
    _every_path_refuses(forged, index, PayloadMismatch)
    assert [(p.kind, p.index) for p in verify(forged).problems] == [("header", index)]


def test_a_payload_of_another_kind_than_its_header_says_is_refused(photos: Path, tmp_path: Path) -> None:
    forged = _copy_pack(photos, tmp_path / "forged.lmdb")
    index = _index(forged, "zz-rgba")
    forge_record(forged, index, encoding="jpeg", channels=3)  # a PNG said to be a JPEG
    _every_path_refuses(forged, index, PayloadMismatch)
    assert ("header", index) in [(p.kind, p.index) for p in verify(forged).problems]


def test_a_record_claiming_nothing_is_still_opened_by_verify(photos: Path, tmp_path: Path) -> None:
    # An "other" record with no size claimed: verify checked nothing of its payload and said OK.
    forged = _copy_pack(photos, tmp_path / "forged.lmdb")
    index = _index(forged, "c0/03.jpg")
    forge_record(forged, index, payload=b"plain text, not an image", encoding="other", width=0, height=0, channels=0)
    _stats_say(forged, index, len(b"plain text, not an image"))  # what is checked here: the header's claims
    problems = [(p.kind, p.index) for p in verify(forged).problems]
    assert problems == [("decode", index)]
    forge_record(forged, index, payload=_png(7, 5), encoding="other", width=0, height=0, channels=0)
    _stats_say(forged, index, len(_png(7, 5)))
    assert verify(forged).ok  # an image that claims nothing is fine: readers size it from its decode


def _stats_say(pack_dir: Path, index: int, size: int) -> None:
    """``__stats__`` says sample ``index``'s file had ``size`` bytes (a forger who rewrote
    its record kept the tables in step: verify checks the payload's length against it)."""
    import lmdb

    from lmdbfolder.format import STAT_DTYPE, STATS_KEY

    env = lmdb.open(str(pack_dir), subdir=True, readonly=True, lock=False)
    with env.begin() as txn:
        stats = np.frombuffer(txn.get(STATS_KEY), dtype=STAT_DTYPE).copy()
    env.close()
    stats["size"][index] = size
    forge_table(pack_dir, STATS_KEY, stats.tobytes())


def test_a_payload_swapped_for_another_image_is_refused(photos: Path, tmp_path: Path) -> None:
    # The bytes of another image under the old header: the header is the lie.
    forged = _copy_pack(photos, tmp_path / "forged.lmdb")
    index = _index(forged, "c0/03.jpg")
    forge_record(forged, index, payload=photo_jpeg(330, 250, seed=9))
    _every_path_refuses(forged, index, PayloadMismatch)


def test_honest_headers_of_every_kind_pass(odd_tree: Path, tmp_path: Path) -> None:
    # No false alarm: every kind the writer packs (with each check, and without one)
    # reads as ImageFolder reads it.
    for check in ("header", "none", "decode"):
        out = tmp_path / f"{check}.lmdb"
        pack(odd_tree, out, progress=False, check=check)
        assert verify(out, decode=True).ok
        with Reader(out) as r:
            for rec in r:
                encoding_of(rec.encoding).check(rec.payload, rec.width, rec.height, rec.channels)
        theirs = ImageFolder(str(odd_tree), allow_empty=True)
        ours = LMDBFolder(out, transform=T.Compose([T.RandomResizedCrop(16), T.PILToTensor()]))
        ours_plain = LMDBFolder(out)
        assert len(theirs) == len(ours)
        for i in range(len(ours)):
            assert np.array_equal(np.asarray(theirs[i][0]), np.asarray(ours_plain[i][0]))
        torch.manual_seed(0)
        expected = [T.PILToTensor()(T.RandomResizedCrop(16)(theirs[i][0])) for i in range(len(theirs))]
        torch.manual_seed(0)
        got = ours.__getitems__(list(range(len(ours))))
        assert all(torch.equal(e, g) for e, (g, _) in zip(expected, got))


def test_every_encoding_checks_its_claim() -> None:
    rng = np.random.default_rng(0)
    for kind in ("rgb_jpeg", "gray_jpeg", "cmyk_jpeg", "rgba_png", "la_png", "webp", "bmp", "tiff", "gif", "ppm"):
        data, _ = image_bytes(kind, rng, 23, 17)
        info = sniff(data)
        enc = ENCODINGS[info.encoding]
        enc.check(data, 23, 17, info.channels)
        enc.check(data, 0, 0, 0)  # nothing claimed (a pack written with --check none of an unknown kind)
        with pytest.raises(PayloadMismatch):
            enc.check(data, 24, 17, info.channels)
        if info.encoding in ("jpeg", "png", "webp"):  # the kinds whose components route the decode
            with pytest.raises(PayloadMismatch):
                enc.check(data, 23, 17, info.channels % 4 + 1)
    raw = ENCODINGS["raw"]
    raw.check(b"\0" * 6, 2, 1, 3)
    with pytest.raises(PayloadMismatch):
        raw.check(b"\0" * 6, 1, 2, 1)


# -- decompression bombs -----------------------------------------------------------------------------
def _bomb_jpeg(width: int, height: int) -> bytes:
    """A 64x64 JPEG whose frame header (SOF) claims ``width`` x ``height``."""
    data = bytearray(photo_jpeg(64, 64))
    sof = data.index(b"\xff\xc0")
    struct.pack_into(">HH", data, sof + 5, height, width)
    return bytes(data)


def test_a_jpeg_whose_frame_claims_a_bomb_is_refused_before_any_allocation(tmp_path: Path) -> None:
    # 30000 x 30000 claimed by a 64x64 file: a plain read took 47 s and 3.2 GB, the
    # batched path asked for a 2.5 GiB array. ImageFolder raises DecompressionBombError.
    write(tmp_path / "src" / "a" / "0.jpg", photo_jpeg(64, 48))
    write(tmp_path / "src" / "a" / "1.jpg", photo_jpeg(64, 64))
    pack(tmp_path / "src", tmp_path / "p.lmdb", progress=False)
    forge_record(tmp_path / "p.lmdb", 1, payload=_bomb_jpeg(30000, 30000), width=30000, height=30000)
    write(tmp_path / "if" / "a" / "1.jpg", _bomb_jpeg(30000, 30000))
    with pytest.raises(Image.DecompressionBombError):
        ImageFolder(str(tmp_path / "if"))[0]
    tracemalloc.start()
    try:
        _every_path_refuses(tmp_path / "p.lmdb", 1, Image.DecompressionBombError)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20  # nothing the size of the claim was allocated (2.7 GB of pixels)
    problems = verify(tmp_path / "p.lmdb").problems
    assert [(p.kind, p.index) for p in problems] == [("decode", 1)] and "DecompressionBomb" in problems[0].message


def _limit_pack(tmp_path: Path) -> Path:
    write(tmp_path / "src" / "a" / "0.jpg", photo_jpeg(64, 48, seed=1))  # 3,072 pixels
    write(tmp_path / "src" / "a" / "1.png", _png(40, 30))  # 1,200 pixels
    write(tmp_path / "src" / "a" / "2.jpg", photo_jpeg(20, 10, seed=2))  # 200 pixels
    pack(tmp_path / "src", tmp_path / "p.lmdb", progress=False)
    return tmp_path / "p.lmdb"


def _png(w: int, h: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(w).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def test_pillows_bomb_limits_give_imagefolders_outcome_on_every_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fast paths skipped Image.MAX_IMAGE_PIXELS: a real 20000x20000 JPEG gave a
    # crop where ImageFolder raises. Here the limit is lowered instead (a program may
    # change it, as for ImageFolder): 1,000 pixels, so 3,072 is over twice it.
    pack_dir = _limit_pack(tmp_path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    theirs = ImageFolder(str(tmp_path / "src"))
    with pytest.raises(Image.DecompressionBombError):
        theirs[0]
    _every_path_refuses(pack_dir, 0, Image.DecompressionBombError)
    # Between the limit and twice it: readable, with Pillow's warning (once), on every
    # path: a PNG (Pillow decodes it) and a JPEG (the fast decoders and the region decoder).
    tf = T.Compose([T.RandomResizedCrop(8), T.PILToTensor()])
    for limit, index in ((1000, 1), (2000, 0)):
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", limit)
        for decoder in ("pillow", "auto"):
            for transform in (None, tf):
                ours = LMDBFolder(pack_dir, transform=transform, decoder=decoder)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.manual_seed(0)
                    got = ours[index][0]
                    if transform is not None:
                        ours.__getitems__([index, 2])
                bombs = [w.category for w in caught].count(Image.DecompressionBombWarning)
                assert bombs == (1 if transform is None else 2), (limit, decoder, transform)
                torch.manual_seed(0)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    expected = ImageFolder(str(tmp_path / "src"), transform=transform)[index][0]
                assert np.array_equal(np.asarray(got), np.asarray(expected))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)  # no limit: nothing refused
    LMDBFolder(pack_dir, transform=tf)[0]


def test_check_bomb_is_pillows_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    data = photo_jpeg(50, 40)
    for limit in (10_000, 1_500, 1_000, 999, None):
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", limit)
        outcomes = []
        for check in (lambda: Image.open(io.BytesIO(data)), lambda: check_bomb(50, 40)):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    check()
                    outcomes.append(("ok", [w.category for w in caught]))
                except Image.DecompressionBombError as exc:
                    outcomes.append(("error", str(exc)))
        assert outcomes[0] == outcomes[1], limit


# -- the compiled helper ------------------------------------------------------------------------------
def test_the_region_decoder_holds_libjpegs_size_to_the_claim() -> None:
    helper = built(current().compiled(), "lmdbfolder.read._crops").decode_region
    data = photo_jpeg(64, 48)
    out = np.empty(3 * 64 * 48, np.uint8)
    assert helper(data, 0, 0, 64, 48, out, 64, 48) == (0, 64)
    for size in ((65, 48), (64, 47)):
        with pytest.raises(ValueError, match="not 6"):
            helper(data, 0, 0, 10, 10, out, *size)


def test_resize_with_a_box_near_int_max_is_refused_not_a_crash() -> None:
    # left + width was computed in int: left = 2**31 - 1, width = 2 read outside the rows.
    built(current().compiled(), "lmdbfolder.read._crops")
    code = (
        "import numpy as np\n"
        "from lmdbfolder.read import _crops\n"
        "src = np.zeros(4 * 3 * 2, np.uint8); dst = np.zeros(3 * 4, np.uint8); tmp = np.zeros(1 << 16, np.uint8)\n"
        "try:\n"
        "    _crops.resize_bilinear(src, 4, 2**31 - 1, 2, 2, 2, 2, dst, tmp, False, False, 0)\n"
        "except ValueError as exc:\n"
        "    print('refused:', exc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "refused: the box is empty or outside the rows" in proc.stdout

"""Pack-time resize: pack --max-size N --quality Q (encoded and raw)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import photo_jpeg, write
from lmdbfolder.cli import main
from lmdbfolder.read.reader import Reader
from lmdbfolder.torch import LMDBFolder
from lmdbfolder.write.options import Resize
from lmdbfolder.write.writer import pack


@pytest.fixture
def mixed_tree(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    write(root / "a" / "big.jpg", photo_jpeg(300, 200))
    write(root / "a" / "tall.jpg", photo_jpeg(90, 240))
    write(root / "b" / "small.jpg", photo_jpeg(60, 40))
    rgba = Image.fromarray(np.random.default_rng(0).integers(0, 256, (150, 250, 4), dtype=np.uint8), "RGBA")
    out = io.BytesIO()
    rgba.save(out, "PNG")
    write(root / "b" / "alpha.png", out.getvalue())
    return root


def test_resize_target_sides() -> None:
    assert Resize(100).target(300, 200) == (100, 67)
    assert Resize(100, side="shorter").target(300, 200) == (150, 100)
    assert Resize(100).target(100, 60) is None
    assert Resize(100, side="shorter").target(300, 90) is None
    with pytest.raises(ValueError, match="quality"):
        Resize(100, quality=0)
    with pytest.raises(ValueError, match="side"):
        Resize(100, side="width")


@pytest.mark.parametrize("side", ["longer", "shorter"])
def test_encoded_pack_is_resized_and_recorded(mixed_tree: Path, tmp_path: Path, side: str) -> None:
    pack(mixed_tree, tmp_path / "p", resize=Resize(80, quality=85, side=side), progress=False)
    with Reader(tmp_path / "p") as r:
        assert r.meta["params"]["max_size"] == 80
        assert r.meta["params"]["quality"] == 85
        assert r.meta["params"]["resize_side"] == side
        sizes = {}
        for rec in r:
            path = r.path_of(rec.index)
            img = Image.open(io.BytesIO(rec.payload))
            assert img.size == (rec.width, rec.height)
            sizes[path] = img.size
            if path.endswith("small.jpg"):
                assert bytes(rec.payload) == (mixed_tree / path).read_bytes()  # small: original bytes
            else:
                assert rec.encoding == "jpeg" and img.mode == "RGB"
    edge = max if side == "longer" else min
    for path, (w, h) in sizes.items():
        if not path.endswith("small.jpg"):
            assert edge(w, h) == 80, (path, w, h)
    assert sizes["a/big.jpg"] == ((80, 53) if side == "longer" else (120, 80))


def test_resized_pixels_look_like_the_original(mixed_tree: Path, tmp_path: Path) -> None:
    pack(mixed_tree, tmp_path / "p", resize=Resize(150), progress=False)
    ds = LMDBFolder(tmp_path / "p")
    i = ds.filenames().index("a/big.jpg")
    got = np.asarray(ds[i][0], dtype=np.int16)
    ref = Image.open(mixed_tree / "a" / "big.jpg").convert("RGB").resize((150, 100), Image.Resampling.BILINEAR)
    assert np.abs(got - np.asarray(ref, dtype=np.int16)).mean() < 3


def test_raw_pack_with_max_size(mixed_tree: Path, tmp_path: Path) -> None:
    pack(mixed_tree, tmp_path / "r", store="raw", resize=Resize(64), progress=False)
    ds = LMDBFolder(tmp_path / "r")
    with Reader(tmp_path / "r") as r:
        assert r.meta["params"]["max_size"] == 64
        for rec in r:
            assert rec.encoding == "raw" and max(rec.width, rec.height) <= 64
            assert len(rec.payload) == rec.width * rec.height * 3
    img, _ = ds[0]
    assert img.mode == "RGB" and max(img.size) <= 64


def test_resume_refuses_other_resize_options(mixed_tree: Path, tmp_path: Path) -> None:
    from lmdbfolder.errors import OutputExistsError, SourceError

    write(mixed_tree / "b" / "zz_bad.jpg", b"not a jpeg")
    dst = tmp_path / "p"
    with pytest.raises(SourceError):
        pack(mixed_tree, dst, resize=Resize(80), strict=True, commit_every=1, progress=False)
    with pytest.raises(OutputExistsError, match="resize was \\[80, 90, .longer.\\], now \\[81"):
        pack(mixed_tree, dst, resize=Resize(81), progress=False)
    (mixed_tree / "b" / "zz_bad.jpg").unlink()
    with pytest.raises(OutputExistsError):  # the source list changed too
        pack(mixed_tree, dst, resize=Resize(80), progress=False)


def test_cli_max_size_flags(mixed_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pack", str(mixed_tree), str(tmp_path / "p"), "--max-size", "50", "--quality", "70"]) == 0
    out = capsys.readouterr().out
    assert "resized to longer side <= 50 px" in out
    assert Reader(tmp_path / "p").meta["params"]["quality"] == 70
    assert main(["pack", str(mixed_tree), str(tmp_path / "q"), "--quality", "70"]) == 2
    assert "--quality needs --max-size" in capsys.readouterr().err


def test_webp_re_encoding(mixed_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pack", str(mixed_tree), str(tmp_path / "w"), "--max-size", "80", "--format", "webp"]) == 0
    assert "WebP quality 90" in capsys.readouterr().out
    with Reader(tmp_path / "w") as r:
        assert r.meta["params"]["resize_format"] == "webp"
        kinds = {r.path_of(rec.index): rec.encoding for rec in r}
        for rec in r:
            img = Image.open(io.BytesIO(rec.payload))
            assert img.size == (rec.width, rec.height) and max(img.size) <= 80 or kinds[r.path_of(rec.index)] != "webp"
    assert kinds == {"a/big.jpg": "webp", "a/tall.jpg": "webp", "b/alpha.png": "webp", "b/small.jpg": "jpeg"}
    assert main(["verify", str(tmp_path / "w"), "--against", str(mixed_tree), "--decode"]) == 0
    capsys.readouterr()
    # JPEG packs of the same source are another pack: no resume across formats, and the rerun says so
    assert main(["pack", str(mixed_tree), str(tmp_path / "w"), "--max-size", "80"]) == 4
    assert "--format was [80, 90, 'longer', 'webp'], now [80, 90, 'longer']" in capsys.readouterr().err
    assert main(["pack", str(mixed_tree), str(tmp_path / "x"), "--format", "webp"]) == 2  # needs --max-size
    # the fused crop and its batch path read WebP records like JPEGs
    from torchvision import transforms as T

    from lmdbfolder import fused
    from lmdbfolder.torch import BatchSamples

    ds = LMDBFolder(tmp_path / "w", transform=T.Compose([fused.RandomResizedCrop(32, output="tensor")]))
    batch = ds.__getitems__([0, 1, 2, 3])
    assert isinstance(batch, BatchSamples) and batch.images.shape == (4, 3, 32, 32)
    import torch

    for k in range(4):
        torch.manual_seed(k)
        one = ds[k][0]
        torch.manual_seed(k)
        assert torch.equal(ds.__getitems__([k]).images[0], one)

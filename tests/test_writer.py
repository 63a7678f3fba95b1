"""pack(): round trips, map growth, batching, output safety."""

from __future__ import annotations

import os
from pathlib import Path

import lmdb
import pytest
from PIL import Image

import lmdbfolder.write.output as output_mod
from conftest import make_small_tree, write
from lmdbfolder.errors import NotAPackError, OutputExistsError, SourceError
from lmdbfolder.read.reader import Reader
from lmdbfolder.tools.verify import verify
from lmdbfolder.write import sizing
from lmdbfolder.write.sources import scan
from lmdbfolder.write.writer import pack


def test_encoded_round_trip_keeps_original_bytes(odd_tree: Path, tmp_path: Path) -> None:
    result = pack(odd_tree, tmp_path / "p", progress=False)
    sources = scan(str(odd_tree))
    assert result.count == len(sources)
    with Reader(tmp_path / "p") as r:
        assert len(r) == len(sources)
        assert r.paths() == sources.relpaths
        assert list(r.labels) == sources.labels
        for i in range(len(r)):
            rec = r.get(i)
            assert bytes(rec.payload) == Path(sources.abspath(i)).read_bytes()
            assert rec.label == sources.labels[i]
            if rec.width:
                with Image.open(sources.abspath(i)) as img:
                    assert (rec.width, rec.height) == img.size
    assert result.encodings == {"bmp": 2, "jpeg": 10, "png": 6, "pnm": 2, "tiff": 1, "webp": 2}
    assert result.input_bytes == sum(os.path.getsize(sources.abspath(i)) for i in range(len(sources)))


def test_raw_round_trip_is_rgb_pixels(odd_tree: Path, tmp_path: Path) -> None:
    pack(odd_tree, tmp_path / "raw", store="raw", progress=False)
    sources = scan(str(odd_tree))
    with Reader(tmp_path / "raw") as r:
        assert r.store == "raw"
        for i in range(len(r)):
            rec = r.get(i)
            expected = Image.open(sources.abspath(i)).convert("RGB")
            assert (rec.encoding, rec.channels, rec.width, rec.height) == ("raw", 3, *expected.size)
            assert bytes(rec.payload) == expected.tobytes()


def test_small_batches_and_map_growth(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_small_tree(tmp_path / "src", classes=2, per_class=30)
    big = Image.effect_noise((300, 300), 80).convert("RGB")
    for k in range(8):
        big.save(src / "class1" / f"big{k}.png")  # ~270 KB each, ~2 MB in all
    monkeypatch.setattr(sizing, "_MIN_MAP", 256 * 1024)
    monkeypatch.setattr(sizing, "_map_size", lambda *args: 256 * 1024)  # a dishonest estimate
    # Only the measured rule may compact (a tiny pack's few free pages are >1% of it).
    monkeypatch.setattr(output_mod, "_COMPACT_FREE_FRACTION", 0.5)
    result = pack(src, tmp_path / "p", commit_every=7, progress=False)
    assert result.count == 68
    assert not result.compacted  # growing leaves no free pages: it forces no compaction copy
    assert verify(tmp_path / "p", decode=True, progress=False).ok
    env = lmdb.open(str(tmp_path / "p"), readonly=True, lock=False)
    assert env.info()["map_size"] > 2 * 1024 * 1024  # it grew from 256 KB
    env.close()


def test_commit_bytes_limit(small_tree: Path, tmp_path: Path) -> None:
    result = pack(small_tree, tmp_path / "p", commit_bytes=1, progress=False)  # one record per transaction
    assert result.count == 12
    assert verify(tmp_path / "p", progress=False).ok


def test_refuses_existing_output(small_tree: Path, tmp_path: Path) -> None:
    out = tmp_path / "p"
    pack(small_tree, out, progress=False)
    write(tmp_path / "taken" / "file.txt", b"x")
    with pytest.raises(OutputExistsError, match="already exists") as info:
        pack(small_tree, tmp_path / "taken", progress=False)
    assert "--overwrite" in info.value.hint and "overwrite=True" in str(info.value)
    # --overwrite replaces a pack
    make_small_tree(tmp_path / "other", classes=2, per_class=2, seed=5)
    assert pack(tmp_path / "other", out, overwrite=True, progress=False).count == 4
    assert len(Reader(out)) == 4
    assert sorted(os.listdir(tmp_path)) == ["other", "p", "small", "taken"]


def test_overwrite_refuses_what_is_not_a_pack(small_tree: Path, tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    write(precious / "thesis.tex", b"do not delete")
    with pytest.raises(OutputExistsError, match="not provably an lmdbfolder pack.*thesis.tex"):
        pack(small_tree, precious, overwrite=True, progress=False)
    assert (precious / "thesis.tex").read_bytes() == b"do not delete"
    write(tmp_path / "afile", b"x")
    with pytest.raises(OutputExistsError):
        pack(small_tree, tmp_path / "afile", overwrite=True, progress=False)


def test_failed_pack_leaves_no_output(small_tree: Path, tmp_path: Path) -> None:
    os.symlink(small_tree / "nowhere.jpg", small_tree / "class1" / "broken.jpg")
    out = tmp_path / "p"
    with pytest.raises(SourceError, match="broken.jpg: broken symbolic link"):
        pack(small_tree, out, commit_every=2, strict=True, progress=False)
    assert not out.exists()
    assert (tmp_path / "p.partial").is_dir()
    with pytest.raises(NotAPackError, match="unfinished pack"):
        Reader(out)
    with pytest.raises(NotAPackError, match="unfinished pack"):
        Reader(tmp_path / "p.partial")
    with pytest.raises(OutputExistsError, match="different sources or options: check was 'header', now 'none'"):
        pack(small_tree, out, check="none", progress=False)


def test_finished_pack_is_one_file(small_pack: Path) -> None:
    assert os.listdir(small_pack) == ["data.mdb"]


def test_list_and_flat_layouts(small_tree: Path, tmp_path: Path) -> None:
    listing = tmp_path / "list.txt"
    listing.write_text("class2/img1.jpg 5\nclass0/img0.jpg 1\n")
    pack(small_tree, tmp_path / "l", list_file=listing, progress=False)
    with Reader(tmp_path / "l") as r:
        assert r.paths() == ["class2/img1.jpg", "class0/img0.jpg"]
        assert list(r.labels) == [5, 1]
        assert r.classes == ["0", "1", "2", "3", "4", "5"]
        assert r.meta["source"]["layout"] == "list"
    pack(small_tree, tmp_path / "f", layout="flat", progress=False)
    with Reader(tmp_path / "f") as r:
        assert len(r) == 12 and set(r.labels) == {-1} and r.classes == []
        assert r.index_of("class1/img2.jpg") == 6


def test_list_file_missing_image_is_named(small_tree: Path, tmp_path: Path) -> None:
    listing = tmp_path / "list.txt"
    listing.write_text("class0/img0.jpg 0\nclass0/typo.jpg 0\n")
    with pytest.raises(SourceError, match="typo.jpg: file not found"):
        pack(small_tree, tmp_path / "l", list_file=listing, strict=True, progress=False)
    result = pack(small_tree, tmp_path / "l", list_file=listing, restart=True, progress=False)
    assert result.count == 1
    assert result.skipped == [("class0/typo.jpg", "file not found (it vanished, or the listed path is wrong)")]


def test_bad_arguments(small_tree: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="store must be"):
        pack(small_tree, tmp_path / "x", store="pickle", progress=False)
    with pytest.raises(ValueError, match="at least 1"):
        pack(small_tree, tmp_path / "x", commit_every=0, progress=False)


def test_manifest_contents(small_pack: Path, small_tree: Path) -> None:
    with Reader(small_pack) as r:
        meta = r.meta
    assert meta["count"] == 12
    assert meta["classes"] == ["class0", "class1", "class2"]
    assert meta["encodings"] == {"jpeg": 12}
    assert meta["checksum"] == "crc32"
    assert meta["source"]["root"] == str(small_tree)
    assert meta["created_by"].startswith("lmdbfolder ")
    assert meta["params"]["commit_every"] == 2000

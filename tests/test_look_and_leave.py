"""The tools users look for: `show` (a contact sheet), per-class `info`, `export`
(files and WebDataset), and list files with class names."""

from __future__ import annotations

import filecmp
import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import make_odd_tree, make_small_tree, write
from lmdbfolder.cli import EXIT_CODES, main
from lmdbfolder.errors import ListFileError, OptionError, OutputExistsError
from lmdbfolder.read.opening import open_pack
from lmdbfolder.tools.export import export, webdataset_key
from lmdbfolder.tools.info import pack_statistics
from lmdbfolder.tools.show import MAX_TILES, PAD, choose_samples, contact_sheet
from lmdbfolder.write.shards import pack_sharded
from lmdbfolder.write.sources import read_list_file
from lmdbfolder.write.writer import pack


def make_colour_tree(root: Path, classes: int = 3, per_class: int = 3) -> Path:
    """Images of one flat colour each (distinct per sample) and different sizes, as PNG and JPEG."""
    rng = np.random.default_rng(7)
    for c in range(classes):
        for k in range(per_class):
            colour = tuple(int(v) for v in rng.integers(0, 256, 3))
            size = (60 + 40 * k, 40 + 30 * c)
            image = Image.new("RGB", size, colour)
            out = io.BytesIO()
            image.save(out, "PNG" if k % 2 else "JPEG", quality=95)
            write(root / f"cls{c}" / f"s{k}.{'png' if k % 2 else 'jpg'}", out.getvalue())
    return root


# -- show -------------------------------------------------------------------------------------
def test_contact_sheet_tiles_are_the_samples(tmp_path: Path) -> None:
    src = make_colour_tree(tmp_path / "src")
    pack(src, tmp_path / "p", progress=False)
    result = contact_sheet(tmp_path / "p", tmp_path / "sheet.png", per_class=3, size=64)
    sheet = Image.open(tmp_path / "sheet.png")
    assert sheet.format == "PNG" and sheet.size == (result.width, result.height)
    assert (result.columns, result.rows) == (3, 3)
    assert sheet.size == (PAD + 3 * (64 + PAD), PAD + 3 * (64 + 14 + PAD))
    assert result.indices == list(range(9))  # every sample of every class, a row per class
    with open_pack(tmp_path / "p") as reader:
        for index, box in zip(result.indices, result.boxes):
            tile = np.asarray(sheet.convert("RGB").crop(box), dtype=float).reshape(-1, 3).mean(axis=0)
            sample = np.asarray(reader.image(index), dtype=float).reshape(-1, 3).mean(axis=0)
            assert np.abs(tile - sample).max() < 3, (index, tile, sample)
            width, height = reader.image(index).size
            assert max(box[2] - box[0], box[3] - box[1]) == min(64, max(width, height))  # aspect kept


def test_contact_sheet_selections_and_the_command(
    tmp_path: Path, small_pack: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    default = contact_sheet(small_pack, tmp_path / "a.png")
    assert len(default.indices) == 12 and default.columns == 4  # 4 per class, spread over each class
    picked = contact_sheet(small_pack, tmp_path / "b.png", indices=[5, 0, -1])
    assert picked.indices == [5, 0, 11]
    drawn = contact_sheet(small_pack, tmp_path / "c.png", random=5, seed=1)
    assert len(set(drawn.indices)) == 5
    with pytest.raises(OptionError, match="out of range"):
        contact_sheet(small_pack, tmp_path / "d.png", indices=[12])
    out = tmp_path / "e.png"
    assert main(["show", str(small_pack), "-o", str(out), "--per-class", "2", "--size", "32"]) == 0
    said = capsys.readouterr().out
    assert f"wrote {out}: 6 samples" in said and "3 rows of 2 tiles" in said
    assert Image.open(out).size == (PAD + 2 * (32 + PAD), PAD + 3 * (32 + 14 + PAD))
    assert main(["show", str(small_pack), "--random", "2", "--indices", "1"]) == EXIT_CODES["usage"]
    capsys.readouterr()
    assert main(["show", str(small_pack), "-o", str(tmp_path / "f.png"), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["boxes"]) == 12


def test_show_by_default_fits_a_pack_of_many_classes_on_one_sheet() -> None:
    # `lmdbfolder show DST` (what pack suggests next) refused a pack of 300 classes: 4 per class is 1,200 tiles.
    labels = [c for c in range(300) for _ in range(5)]
    chosen, columns = choose_samples(labels, 300)
    assert columns == MAX_TILES // 300 and len(chosen) == 300 * columns
    assert sorted({labels[i] for i in chosen}) == list(range(300))  # every class shown
    labels = [c for c in range(MAX_TILES + 1) for _ in range(2)]
    chosen, _ = choose_samples(labels, MAX_TILES + 1)
    assert 0 < len(chosen) <= MAX_TILES  # more classes than a sheet holds: random samples
    with pytest.raises(OptionError, match="tiles"):
        choose_samples(labels, MAX_TILES + 1, per_class=1)  # asked for: still refused


def test_contact_sheet_marks_what_does_not_decode(tmp_path: Path) -> None:
    src = make_small_tree(tmp_path / "src", classes=1, per_class=2)
    data = (src / "class0" / "img1.jpg").read_bytes()
    middle = len(data) // 2
    (src / "class0" / "img1.jpg").write_bytes(data[: middle - 100] + data[middle:])  # damaged, end marker kept
    pack(src, tmp_path / "p", progress=False)
    result = contact_sheet(tmp_path / "p", tmp_path / "s.png")
    assert result.undecodable == [1] and result.indices == [0, 1]


def test_show_never_writes_over_the_pack_or_a_file_that_is_not_a_sheet(
    small_pack: Path, small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = small_pack / "data.mdb"
    before = data.read_bytes()
    assert main(["show", str(small_pack), "-o", str(data)]) == EXIT_CODES["usage"]
    assert "inside the pack" in capsys.readouterr().err
    assert main(["show", str(small_pack), "-o", str(small_pack / "x.png")]) == EXIT_CODES["usage"]
    assert data.read_bytes() == before and sorted(os.listdir(small_pack)) == ["data.mdb"]
    image = small_tree / "class0" / "img0.jpg"
    photo = image.read_bytes()
    assert main(["show", str(small_pack), "-o", str(image)]) == EXIT_CODES["output exists"]
    err = capsys.readouterr().err
    assert str(image) in err and "not a PNG" in err and "hint:" in err
    assert image.read_bytes() == photo
    sheet = tmp_path / "sheet.png"
    assert main(["show", str(small_pack), "-o", str(sheet), "--size", "16"]) == 0
    assert main(["show", str(small_pack), "-o", str(sheet)]) == 0  # an earlier sheet is replaced
    assert Image.open(sheet).size[0] > 200 and sorted(p.name for p in tmp_path.glob("sheet*")) == ["sheet.png"]


def test_show_refuses_a_sheet_too_large_to_draw(
    small_pack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 12 tiles of 100,000 px would take ~360 GB of memory: refused before drawing, not killed by the system.
    assert main(["show", str(small_pack), "-o", str(tmp_path / "s.png"), "--size", "100000"]) == EXIT_CODES["usage"]
    err = capsys.readouterr().err
    assert "--size" in err and "pixels" in err
    assert not (tmp_path / "s.png").exists()


# -- info -------------------------------------------------------------------------------------
def test_info_counts_per_class_and_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = make_colour_tree(tmp_path / "src", classes=3, per_class=3)
    (src / "cls1" / "s2.jpg").unlink()
    (src / "cls0" / "s1.png").unlink()
    (src / "cls0" / "s2.jpg").unlink()
    pack(src, tmp_path / "p", progress=False)
    stats = pack_statistics(tmp_path / "p")
    assert stats["class_counts"] == {"cls0": 1, "cls1": 2, "cls2": 3}
    assert stats["smallest_classes"][0] == ["cls0", 1] and stats["largest_classes"][0] == ["cls2", 3]
    assert stats["encodings"] == {"jpeg": {"count": 4, "share": 0.6667}, "png": {"count": 2, "share": 0.3333}}
    sizes = stats["image_sizes"]
    assert sizes["sampled"] == 6 and sizes["unknown"] == 0
    assert sizes["width"] == {"min": 60, "median": 80, "max": 140}
    assert sizes["height"] == {"min": 40, "median": 85, "max": 100}
    assert pack_statistics(tmp_path / "p", sizes=2)["image_sizes"]["sampled"] == 2
    assert pack_statistics(tmp_path / "p", sizes=-1)["image_sizes"] is None
    assert main(["info", str(tmp_path / "p")]) == 0
    text = capsys.readouterr().out
    assert "per class:" in text and "cls0 1, cls1 2, cls2 3" in text
    assert "jpeg 4 (67%), png 2 (33%)" in text and "width 60..140 (median 80)" in text
    assert main(["info", str(tmp_path / "p"), "--json", "--no-sizes"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["class_counts"]["cls2"] == 3 and info["image_sizes"] is None and info["count"] == 6


def test_info_on_many_classes_names_the_extremes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(0)
    src = tmp_path / "src"
    for c in range(25):
        for k in range(1 + c % 4):
            out = io.BytesIO()
            Image.new("RGB", (8, 8), tuple(int(v) for v in rng.integers(0, 256, 3))).save(out, "PNG")
            write(src / f"c{c:02d}" / f"{k}.png", out.getvalue())
    pack_sharded(src, tmp_path / "s", shards=2, progress=False)
    assert main(["info", str(tmp_path / "s")]) == 0
    text = capsys.readouterr().out
    assert "per class:    1..4 samples (median 2)" in text
    assert "smallest:     c00 1, c04 1, c08 1" in text and "largest:      c03 4, c07 4, c11 4" in text


# -- export -----------------------------------------------------------------------------------
def test_export_files_round_trip(odd_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pack(odd_tree, tmp_path / "p", progress=False)
    assert main(["export", str(tmp_path / "p"), str(tmp_path / "out"), "--no-progress"]) == 0
    assert "exported 23 samples" in capsys.readouterr().out
    with open_pack(tmp_path / "p") as reader:
        paths = reader.paths()
    for rel in paths:  # every packed file, byte for byte, at its relative path (symlinked folders followed)
        assert filecmp.cmp(odd_tree / rel, tmp_path / "out" / rel, shallow=False), rel
    exported = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert exported == sorted(paths)
    # Packing the export again gives the same samples and classes.
    pack(tmp_path / "out", tmp_path / "again", progress=False)
    with open_pack(tmp_path / "p") as a, open_pack(tmp_path / "again") as b:
        assert a.paths() == b.paths() and list(a.labels) == list(b.labels) and a.classes == b.classes
    # Never overwrites.
    with pytest.raises(OutputExistsError, match="not empty; export never overwrites"):
        export(tmp_path / "p", tmp_path / "out")
    os.mkdir(tmp_path / "empty")
    assert export(tmp_path / "p", tmp_path / "empty").samples == 23


def test_export_flat_and_list_packs(small_tree: Path, tmp_path: Path) -> None:
    pack(small_tree, tmp_path / "flat", layout="flat", progress=False)
    export(tmp_path / "flat", tmp_path / "flat-out")
    assert not filecmp.dircmp(small_tree, tmp_path / "flat-out").diff_files
    assert sorted(os.listdir(tmp_path / "flat-out")) == ["class0", "class1", "class2"]
    listing = tmp_path / "pets.txt"
    listing.write_text("class2/img1.jpg dog\nclass0/img0.jpg cat\nclass1/img3.jpg dog\n")
    pack(small_tree, tmp_path / "l", list_file=listing, progress=False)
    result = export(tmp_path / "l", tmp_path / "l-out")
    assert result.list_file == str(tmp_path / "l-out" / "pets.txt")
    assert (tmp_path / "l-out" / "pets.txt").read_text() == listing.read_text()
    for rel in ("class2/img1.jpg", "class0/img0.jpg", "class1/img3.jpg"):
        assert filecmp.cmp(small_tree / rel, tmp_path / "l-out" / rel, shallow=False)
    repacked = pack(tmp_path / "l-out", tmp_path / "l2", list_file=tmp_path / "l-out" / "pets.txt", progress=False)
    with open_pack(repacked.path) as r:
        assert r.classes == ["cat", "dog"] and list(r.labels) == [1, 0, 1]


def test_export_refuses_what_is_not_the_original_bytes(small_tree: Path, tmp_path: Path) -> None:
    pack(small_tree, tmp_path / "raw", store="raw", progress=False)
    with pytest.raises(OptionError, match="stores decoded pixels"):
        export(tmp_path / "raw", tmp_path / "o1")
    pack(small_tree, tmp_path / "shrunk", resize=__import__("lmdbfolder").Resize(10), progress=False)
    with pytest.raises(OptionError, match="re-encoded"):
        export(tmp_path / "shrunk", tmp_path / "o2")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
    assert not (tmp_path / "o1.partial").exists()


def test_export_webdataset(small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(small_tree / "class1" / "with.dot.png", _png())
    pack_sharded(small_tree, tmp_path / "s", shards=2, progress=False)
    argv = ["export", str(tmp_path / "s"), str(tmp_path / "wds"), "--format", "webdataset", "--shard-size", "8KB"]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["shards"]) > 1 and result["samples"] == 13
    with open_pack(tmp_path / "s") as reader:
        expected = {
            webdataset_key(p): (bytes(reader.get(i).payload), reader.labels[i]) for i, p in enumerate(reader.paths())
        }
    assert "class1/with_dot" in expected and "class0/img0" in expected
    seen: dict[str, dict[str, bytes]] = {}
    order = []
    for shard in result["shards"]:
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                key, _, ext = member.name.partition(".")  # WebDataset: the key ends at the first dot
                assert "." not in key.rsplit("/", 1)[-1]
                if not order or order[-1] != key:
                    order.append(key)
                seen.setdefault(key, {})[ext] = tar.extractfile(member).read()  # type: ignore[union-attr]
    assert len(order) == len(set(order)) == 13  # a sample's members are adjacent
    for key, (payload, label) in expected.items():
        image_ext = "png" if key.endswith("with_dot") else "jpg"
        assert seen[key] == {image_ext: payload, "cls": str(label).encode()}
    assert (tmp_path / "wds" / "classes.txt").read_text().splitlines() == ["class0", "class1", "class2"]
    # Raw packs become lossless PNGs.
    pack(small_tree, tmp_path / "raw", store="raw", progress=False)
    export(tmp_path / "raw", tmp_path / "wds-raw", format="webdataset")
    with tarfile.open(tmp_path / "wds-raw" / "shard-000000.tar") as tar, open_pack(tmp_path / "raw") as reader:
        png = tar.extractfile("class0/img0.png").read()  # type: ignore[union-attr]
        assert Image.open(io.BytesIO(png)).tobytes() == reader.image(0).tobytes()


def test_webdataset_keys_stay_unique_when_the_renamed_key_is_taken(tmp_path: Path) -> None:
    # x.2.jpg's key is x_2; x.png's key x is x.jpg's, and the renamed x_<index 2> was x_2 again:
    # two samples with one key (an extracted shard kept one of the two labels).
    jpeg = io.BytesIO()
    Image.new("RGB", (8, 6), (9, 9, 9)).save(jpeg, "JPEG")
    for c in ("c0", "c1"):
        write(tmp_path / "tree" / c / "x.jpg", jpeg.getvalue())
    write(tmp_path / "tree" / "c0" / "x.2.jpg", jpeg.getvalue())
    write(tmp_path / "tree" / "c0" / "x.png", _png())
    pack(tmp_path / "tree", tmp_path / "p", progress=False)
    assert main(["export", str(tmp_path / "p"), str(tmp_path / "wds"), "--format", "webdataset", "--no-progress"]) == 0
    with tarfile.open(tmp_path / "wds" / "shard-000000.tar") as tar:
        names = tar.getnames()
    assert len(names) == len(set(names)) == 8  # 4 samples, an image and a .cls each
    keys = [n.partition(".")[0] for n in names]
    assert len(set(keys)) == 4


def _png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (9, 7), (1, 2, 3)).save(out, "PNG")
    return out.getvalue()


# -- list files with class names -------------------------------------------------------------
def test_list_file_with_class_names(tmp_path: Path) -> None:
    listing = tmp_path / "l.txt"
    listing.write_text("a.jpg zebra\nb.jpg 9\nc.jpg ant\nd.jpg 10\ne.jpg zebra\n")
    src = read_list_file(str(listing), str(tmp_path))
    assert src.classes == ["10", "9", "ant", "zebra"]  # sorted like ImageFolder's class folders
    assert src.labels == [3, 1, 2, 0, 3]
    assert src.class_to_idx == {"10": 0, "9": 1, "ant": 2, "zebra": 3}
    integers = tmp_path / "i.txt"
    integers.write_text("a.jpg 2\nb.jpg 0\n")
    assert read_list_file(str(integers), str(tmp_path)).classes == ["0", "1", "2"]


def test_list_file_naming_a_path_twice_is_refused(tmp_path: Path, small_tree: Path) -> None:
    listing = tmp_path / "l.txt"
    listing.write_text("class0/img0.jpg cat\n# comment\nclass1/img0.jpg dog\nclass0//img0.jpg dog\n")
    with pytest.raises(ListFileError, match="is listed twice, on lines 1 and 4") as info:
        read_list_file(str(listing), str(small_tree))
    assert info.value.lineno == 4
    assert main(["pack", str(small_tree), str(tmp_path / "p"), "--list", str(listing)]) == EXIT_CODES["source error"]


def test_odd_tree_export_keeps_empty_classes(tmp_path: Path) -> None:
    src = make_odd_tree(tmp_path / "odd")
    (src / "empty class").mkdir()
    pack(src, tmp_path / "p", allow_empty=True, progress=False)
    export(tmp_path / "p", tmp_path / "out")
    assert (tmp_path / "out" / "empty class").is_dir()
    with open_pack(tmp_path / "p") as reader:
        assert "empty class" in reader.classes

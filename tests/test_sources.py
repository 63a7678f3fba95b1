"""Sample lists: ImageFolder rules checked against torchvision itself."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS as TV_EXTENSIONS

from conftest import make_small_tree, write
from lmdbfolder.errors import ListFileError, OptionError, SourceError
from lmdbfolder.write.sources import IMG_EXTENSIONS, SourceSpec, read_list_file, scan, scan_flat, scan_imagefolder


def test_extensions_are_torchvisions() -> None:
    assert IMG_EXTENSIONS == TV_EXTENSIONS


def test_imagefolder_order_classes_and_labels_match_torchvision(odd_tree: Path) -> None:
    tv = ImageFolder(str(odd_tree))
    ours = scan_imagefolder(str(odd_tree))
    assert ours.classes == tv.classes
    assert ours.class_to_idx == tv.class_to_idx
    assert [os.path.join(ours.root, p) for p in ours.relpaths] == [p for p, _ in tv.samples]
    assert ours.labels == tv.targets
    assert "beta/linkdir/linked.jpg" in ours.relpaths  # symlinked folders are followed
    assert not any(p.endswith((".gif", ".txt")) for p in ours.relpaths)


def test_imagefolder_no_classes(tmp_path: Path) -> None:
    write(tmp_path / "a.jpg", b"x")
    with pytest.raises(SourceError, match="Couldn.t find any class folder") as info:
        scan_imagefolder(str(tmp_path))
    assert "--flat" in info.value.hint


def test_imagefolder_empty_class(tmp_path: Path) -> None:
    make_small_tree(tmp_path, classes=2, per_class=1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="Found no valid file for the classes empty"):
        scan_imagefolder(str(tmp_path))
    with pytest.raises(FileNotFoundError):  # torchvision agrees that this is an error
        ImageFolder(str(tmp_path))
    ours = scan_imagefolder(str(tmp_path), allow_empty=True)
    tv = ImageFolder(str(tmp_path), allow_empty=True)
    assert ours.classes == tv.classes and ours.labels == tv.targets


def test_missing_root(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="does not exist"):
        scan(str(tmp_path / "nope"))
    write(tmp_path / "file", b"")
    with pytest.raises(SourceError, match="is not a directory"):
        scan(str(tmp_path / "file"))


def test_flat_folder_sorted_by_relative_path(odd_tree: Path) -> None:
    flat = scan_flat(str(odd_tree))
    assert flat.relpaths == sorted(flat.relpaths)
    assert set(flat.labels) == {-1}
    assert flat.classes == [] and flat.class_to_idx == {}
    assert len(flat) == len(ImageFolder(str(odd_tree)))


def test_flat_folder_without_images(tmp_path: Path) -> None:
    write(tmp_path / "a.txt", b"x")
    with pytest.raises(SourceError, match="no images found"):
        scan_flat(str(tmp_path))


def test_list_file(tmp_path: Path) -> None:
    listing = tmp_path / "train.txt"
    listing.write_text("\ufeff# a comment\n\nimg/a b.jpg 3\n  img/c.jpg\t0  \r\n/abs/path.png 1\n", encoding="utf-8")
    src = read_list_file(str(listing), str(tmp_path))
    assert src.relpaths == ["img/a b.jpg", "img/c.jpg", "/abs/path.png"]
    assert src.labels == [3, 0, 1]
    assert src.classes == ["0", "1", "2", "3"]
    assert src.abspath(2) == "/abs/path.png"
    assert src.abspath(0) == os.path.join(str(tmp_path), "img/a b.jpg")


@pytest.mark.parametrize(
    "line, message",
    [
        ("lonely.jpg", "expected `path label`"),
        ("ok.jpg 1", "'ok.jpg' is listed twice, on lines 1 and 3"),
        ("./ok.jpg 0", "listed twice, on lines 1 and 3"),
        ("a.jpg -1", "outside"),
        # A stray huge label: refused at once, not after building 2**31 class names.
        ("a.jpg 2147483647", "label 2,147,483,647 means 2,147,483,648 classes"),
        ("a.jpg 1000000", "means 1,000,001 classes"),
    ],
)
def test_list_file_bad_line_names_line_number(tmp_path: Path, line: str, message: str) -> None:
    listing = tmp_path / "l.txt"
    listing.write_text(f"ok.jpg 0\n# c\n{line}\n", encoding="utf-8")
    with pytest.raises(ListFileError, match=message) as info:
        read_list_file(str(listing), str(tmp_path))
    assert info.value.lineno == 3
    assert f"{listing}:3" in str(info.value)


def test_list_file_empty_or_missing(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(SourceError, match="no `path label` lines"):
        read_list_file(str(tmp_path / "empty.txt"), str(tmp_path))
    with pytest.raises(SourceError, match="cannot read the list file"):
        read_list_file(str(tmp_path / "missing.txt"), str(tmp_path))


def test_scan_picks_layout(tmp_path: Path, small_tree: Path) -> None:
    assert scan(str(small_tree)).layout == "imagefolder"
    assert scan(str(small_tree), layout="flat").layout == "flat"
    (tmp_path / "l.txt").write_text("class0/img0.jpg 0\n")
    assert scan(str(small_tree), list_file=str(tmp_path / "l.txt")).layout == "list"
    with pytest.raises(ValueError, match="unknown layout"):
        scan(str(small_tree), layout="tar")


def test_a_source_spec_scans_as_the_keywords_do(tmp_path: Path, small_tree: Path) -> None:
    write(small_tree / "class1" / "note.PNG", b"x")
    spec = SourceSpec(allow_empty=True, extensions=".png", match="class[12]/")
    found = spec.scan(small_tree)
    assert found == scan(small_tree, allow_empty=True, extensions=".png", match="class[12]/")
    assert (found.relpaths, found.classes) == (["class1/note.PNG"], ["class0", "class1", "class2"])
    assert SourceSpec(layout="flat").scan(small_tree) == scan(small_tree, layout="flat")
    (tmp_path / "l.txt").write_text("class0/img0.jpg 0\n")
    assert SourceSpec(list_file=tmp_path / "l.txt").scan(small_tree).relpaths == ["class0/img0.jpg"]
    # checked by the scan, as the keywords are: a list file names its files itself
    with pytest.raises(OptionError, match="a list file names its files itself"):
        SourceSpec(list_file=tmp_path / "l.txt", match="x").scan(small_tree)


def test_numbered_class_names_bound_is_the_manifest_size(tmp_path: Path) -> None:
    import json

    from lmdbfolder.write.sources import _numbered_classes_bytes

    for n in (1, 9, 10, 11, 99, 100, 1234):
        names = [str(i) for i in range(n)]
        encoded = json.dumps(
            {"classes": names, "class_to_idx": {c: i for i, c in enumerate(names)}}, separators=(",", ":")
        )
        assert _numbered_classes_bytes(n) == len(encoded) - len('{"classes":[],"class_to_idx":{}}') + 2
    listing = tmp_path / "l.txt"
    listing.write_text("ok.jpg 0\nb.jpg 99999\n", encoding="utf-8")
    assert len(read_list_file(str(listing), str(tmp_path)).classes) == 100_000  # big, but fits

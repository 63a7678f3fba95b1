"""Hugging Face ``datasets`` both ways: ``export --format huggingface`` loads with a real
``datasets.load_dataset`` (features ``image`` and a ``ClassLabel`` of the pack's classes, rows equal to
the pack: labels and bytes), and ``pack_dataset`` takes a Hugging Face dataset (or an ImageFolder, or
(image, label) items) back into a pack, the bytes kept. The round trip pack -> export -> load_dataset ->
pack_dataset gives the same classes, labels, bytes and paths.

``load_dataset`` reads local folders only here, its cache in the test's tmp_path, offline.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

# Offline before datasets is imported (it reads these once): a local folder needs no network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
datasets = pytest.importorskip("datasets")  # pinned in requirements-test.txt: always there under `make test`

from conftest import forge_meta, image_bytes, write  # noqa: E402
from lmdbfolder import pack, pack_dataset  # noqa: E402
from lmdbfolder.cli import EXIT_CODES, main  # noqa: E402
from lmdbfolder.errors import OptionError, SourceError  # noqa: E402
from lmdbfolder.read.reader import Reader  # noqa: E402
from lmdbfolder.tools.export import export  # noqa: E402


def mixed_tree(root: Path) -> Path:
    """JPEG, PNG (RGBA, palette), grayscale and WebP samples, nested folders, a file name with dots,
    an empty class, a non-ASCII class and class names that YAML reads otherwise when unquoted."""
    rng = np.random.default_rng(0)
    files = {
        "cat/a.jpg": image_bytes("rgb_jpeg", rng)[0],
        "cat/sub/b.png": image_bytes("rgba_png", rng)[0],
        "cat/x.2.jpg": image_bytes("gray_jpeg", rng)[0],
        "chien été/c.png": image_bytes("palette_png", rng)[0],
        'dog: "yes"/d.webp': image_bytes("webp", rng)[0],
        "no/e.jpg": image_bytes("rgb_jpeg", rng)[0],
        "007/f.png": image_bytes("gray_png", rng)[0],
    }
    for rel, data in files.items():
        write(root / rel, data)
    (root / "zz-empty").mkdir()
    return root


def pack_of(path: Path) -> dict[str, Any]:
    with Reader(path) as r:
        return {
            "classes": list(r.meta["classes"]),
            "labels": list(r.labels),
            "paths": r.paths(),
            "bytes": [bytes(r.get(i).payload) for i in range(len(r))],
        }


def load(folder: Path, tmp_path: Path, split: str = "train") -> Any:
    return datasets.load_dataset(str(folder), split=split, cache_dir=str(tmp_path / "hf-cache"))


def rows_of(ds: Any) -> tuple[list[bytes], list[str], list[int]]:
    raw = ds.cast_column("image", datasets.Image(decode=False))
    images = raw["image"]
    return [im["bytes"] for im in images], [im["path"] for im in images], list(raw["label"])


@pytest.fixture
def mixed_pack(tmp_path: Path) -> Path:
    out = tmp_path / "mixed.lmdb"
    pack(mixed_tree(tmp_path / "tree"), out, allow_empty=True, progress=False)
    return out


def test_load_dataset_of_the_export_equals_the_pack(mixed_pack: Path, tmp_path: Path) -> None:
    ours = pack_of(mixed_pack)
    result = export(mixed_pack, tmp_path / "hf", format="huggingface", progress=False)
    assert result.samples == len(ours["labels"]) and (tmp_path / "hf" / "README.md").is_file()
    ds = load(tmp_path / "hf", tmp_path)
    assert set(ds.features) == {"image", "label"}
    assert isinstance(ds.features["image"], datasets.Image)
    assert isinstance(ds.features["label"], datasets.ClassLabel)
    assert ds.features["label"].names == ours["classes"]  # the empty class and the odd names included
    blobs, paths, labels = rows_of(ds)
    assert (blobs, paths, labels) == (ours["bytes"], ours["paths"], ours["labels"])
    # the images decode as the pack's (PIL, what datasets gives)
    assert ds[0]["image"].size == Image.open(io.BytesIO(ours["bytes"][0])).size
    # the Parquet files alone carry the features too (their schema metadata)
    alone = datasets.load_dataset(
        "parquet", data_files=str(tmp_path / "hf" / "data" / "*.parquet"), split="train", cache_dir=str(tmp_path / "c")
    )
    assert alone.features == ds.features


def test_the_round_trip_through_hugging_face_keeps_classes_labels_bytes_and_paths(
    mixed_pack: Path, tmp_path: Path
) -> None:
    export(mixed_pack, tmp_path / "hf", format="huggingface", progress=False, shard_size="2KB")
    assert len(list((tmp_path / "hf" / "data").glob("train-*-of-*.parquet"))) > 1  # several files, in order
    ds = load(tmp_path / "hf", tmp_path)
    result = pack_dataset(ds, tmp_path / "back.lmdb", progress=False)
    assert result.count == len(ds) and not result.skipped
    assert pack_of(tmp_path / "back.lmdb") == pack_of(mixed_pack)


def test_the_cli_exports_a_named_split(mixed_pack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hf"
    argv = ["export", str(mixed_pack), str(out), "--format", "huggingface", "--split", "validation"]
    assert main(argv) == 0
    assert "Hugging Face dataset (1 Parquet file and README.md)" in capsys.readouterr().out
    ds = load(out, tmp_path, split="validation")
    assert ds.features["label"].names == pack_of(mixed_pack)["classes"]
    bad = ["export", str(mixed_pack), str(tmp_path / "other"), "--format", "huggingface", "--split", "no/slash"]
    assert main(bad) == EXIT_CODES["usage"] and not (tmp_path / "other").exists()
    assert "split must be a name" in capsys.readouterr().err


def test_an_unlabelled_pack_exports_images_only(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    for k in range(3):
        write(tmp_path / "flat" / f"{k}.jpg", image_bytes("rgb_jpeg", rng)[0])
    pack(tmp_path / "flat", tmp_path / "flat.lmdb", layout="flat", progress=False)
    export(tmp_path / "flat.lmdb", tmp_path / "hf", format="huggingface", progress=False)
    ds = load(tmp_path / "hf", tmp_path)
    assert list(ds.features) == ["image"] and len(ds) == 3
    back = pack_dataset(ds, tmp_path / "back.lmdb", progress=False)
    assert back.count == 3
    ours, theirs = pack_of(tmp_path / "flat.lmdb"), pack_of(tmp_path / "back.lmdb")
    assert theirs["bytes"] == ours["bytes"] and theirs["classes"] == [] and set(theirs["labels"]) == {-1}


def test_a_raw_pack_exports_lossless_pngs(small_tree: Path, tmp_path: Path) -> None:
    pack(small_tree, tmp_path / "raw.lmdb", store="raw", progress=False)
    export(tmp_path / "raw.lmdb", tmp_path / "hf", format="huggingface", progress=False)
    ds = load(tmp_path / "hf", tmp_path)
    with Reader(tmp_path / "raw.lmdb") as r:
        for i in range(len(r)):
            rec = r.get(i)
            assert ds[i]["image"].convert("RGB").tobytes() == bytes(rec.payload)
            assert ds[i]["label"] == rec.label


def test_pack_dataset_keeps_the_bytes_a_hugging_face_dataset_holds(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    blobs = [image_bytes(kind, rng)[0] for kind in ("rgb_jpeg", "rgba_png", "webp", "rgb_jpeg")]
    on_disk = write(tmp_path / "files" / "only-a-path.jpg", image_bytes("rgb_jpeg", rng)[0])
    features = datasets.Features({"img": datasets.Image(), "y": datasets.ClassLabel(names=["a", "b", "c"])})
    ds = datasets.Dataset.from_dict(
        {
            "img": [
                {"bytes": blobs[0], "path": "a/one.jpg"},
                {"bytes": blobs[1], "path": None},  # no name: <index>.<ext of its encoding>
                {"bytes": blobs[2], "path": "/abs/elsewhere.webp"},  # not a relative path: numbered
                {"bytes": blobs[3], "path": "../escape.jpg"},  # never a path leading outside
                {"bytes": None, "path": str(on_disk)},  # only a local file: its bytes
            ],
            "y": [2, 0, 1, 2, 0],
        },
        features=features,
    )
    pack_dataset(ds, tmp_path / "p.lmdb", progress=False)
    got = pack_of(tmp_path / "p.lmdb")
    assert got["classes"] == ["a", "b", "c"] and got["labels"] == [2, 0, 1, 2, 0]
    assert got["bytes"] == [*blobs, on_disk.read_bytes()]
    assert got["paths"] == ["a/one.jpg", "00000001.png", "00000002.webp", "00000003.jpg", "00000004.jpg"]
    # decoded images too (the default, Image(decode=True)): still the stored bytes, never re-encoded
    shuffled = ds.select([4, 0])
    pack_dataset(shuffled, tmp_path / "sel.lmdb", progress=False)
    assert pack_of(tmp_path / "sel.lmdb")["bytes"] == [on_disk.read_bytes(), blobs[0]]


def test_pack_dataset_takes_an_imagefolder_and_image_label_items(tmp_path: Path) -> None:
    torchvision = pytest.importorskip("torchvision")
    tree = mixed_tree(tmp_path / "tree")
    folder = torchvision.datasets.ImageFolder(str(tree), allow_empty=True)
    pack_dataset(folder, tmp_path / "from-folder.lmdb", progress=False)
    pack(tree, tmp_path / "direct.lmdb", allow_empty=True, progress=False)
    assert pack_of(tmp_path / "from-folder.lmdb") == pack_of(tmp_path / "direct.lmdb")

    rng = np.random.default_rng(3)
    pil = Image.fromarray(rng.integers(0, 256, (9, 11, 3), dtype=np.uint8))
    path = write(tmp_path / "p.jpg", image_bytes("rgb_jpeg", rng)[0])
    items = [(pil, 1), (str(path), 0)]
    pack_dataset(items, tmp_path / "items.lmdb", classes=["x", "y"], progress=False)
    got = pack_of(tmp_path / "items.lmdb")
    assert got["classes"] == ["x", "y"] and got["labels"] == [1, 0]
    assert Image.open(io.BytesIO(got["bytes"][0])).tobytes() == pil.tobytes()  # a lossless PNG
    assert got["bytes"][1] == path.read_bytes() and got["paths"] == ["00000000.png", "00000001.jpg"]


def test_pack_dataset_refuses_what_it_cannot_keep(tmp_path: Path) -> None:
    ds = datasets.Dataset.from_dict({"text": ["a"], "n": [1]})
    with pytest.raises(OptionError, match="no Image column"):
        pack_dataset(ds, tmp_path / "a.lmdb")
    rng = np.random.default_rng(4)
    images = datasets.Dataset.from_dict(
        {"image": [{"bytes": image_bytes("rgb_jpeg", rng)[0], "path": "x.jpg"}]},
        features=datasets.Features({"image": datasets.Image()}),
    )
    with pytest.raises(OptionError, match="store='raw'"):
        pack_dataset(images, tmp_path / "b.lmdb", store="raw")
    with pytest.raises(OptionError, match="IterableDataset"):
        pack_dataset(images.to_iterable_dataset(), tmp_path / "c.lmdb")
    with pytest.raises(OptionError, match="ClassLabel names"):
        pack_dataset(images, tmp_path / "d.lmdb", classes=["a"])
    assert not any((tmp_path / name).exists() for name in ("a.lmdb", "b.lmdb", "c.lmdb", "d.lmdb"))


@pytest.mark.parametrize(
    "names",
    [
        ["line\nbreak", "tab\there", 'back\\slash "q"', "#hash", "- dash", "😀 \x7f\x85", "yes", "null", "1e3"],
        ["ok", "not utf-8 \udcff"],
    ],
    ids=["yaml-hazards", "undecodable"],
)
def test_class_names_reach_the_class_label_exactly_or_are_refused(tmp_path: Path, names: list[str]) -> None:
    rng = np.random.default_rng(5)
    for k, _ in enumerate(names):
        write(tmp_path / "tree" / f"c{k:02d}" / "a.jpg", image_bytes("rgb_jpeg", rng)[0])
    pack(tmp_path / "tree", tmp_path / "p.lmdb", progress=False)
    forge_meta(tmp_path / "p.lmdb", classes=names, class_to_idx={n: i for i, n in enumerate(names)})
    if any("\udcff" in n for n in names):
        with pytest.raises(SourceError, match="not valid Unicode"):
            export(tmp_path / "p.lmdb", tmp_path / "hf", format="huggingface", progress=False)
        assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.partial").exists()
        return
    export(tmp_path / "p.lmdb", tmp_path / "hf", format="huggingface", progress=False)
    ds = load(tmp_path / "hf", tmp_path)
    assert ds.features["label"].names == names
    # the card alone declares them too (load_dataset reads it first)
    from huggingface_hub import DatasetCard  # installed with datasets

    card = DatasetCard.load(str(tmp_path / "hf" / "README.md"))
    declared = card.data.dataset_info["features"][1]["dtype"]["class_label"]["names"]
    assert [declared[str(i)] for i in range(len(names))] == names

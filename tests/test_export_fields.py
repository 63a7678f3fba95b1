"""``export --format webdataset|huggingface`` of packs of several fields (issue 35): WebDataset tar
shards with one member a field (``<key>.<field>.<ext>``, the stored bytes) read back with
``tarfile`` and held against the pack's stored fields and the original files; the Hugging Face
folder (a column a field) loaded by ``datasets``; the ``files`` export of the ``dataset`` layout
refused with what to do instead."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from conftest import make_coco, make_voc, write
from lmdbfolder import pack_dataset
from lmdbfolder.cli import main
from lmdbfolder.errors import OptionError, OutputExistsError
from lmdbfolder.format import split_field_payloads
from lmdbfolder.read.fields import samples_manifest
from lmdbfolder.read.opening import open_pack
from lmdbfolder.tools.export import export, webdataset_key
from lmdbfolder.write.fields import FieldSamples, pack_field_samples
from lmdbfolder.write.layouts import scan_layout


# -- helpers ---------------------------------------------------------------------------------------
def stored(pack: Path) -> tuple[list[str], list[str], list[list[bytes]]]:
    """``(field names, stored paths, each sample's field bytes)`` of a pack, as stored."""
    with open_pack(pack) as reader:
        meta = samples_manifest(reader)
        assert meta is not None and meta.field_specs is not None
        names = [f.name for f in meta.field_specs]
        fields = []
        for i in range(len(reader)):
            parts = split_field_payloads(reader.get(i).payload, len(names))
            assert not isinstance(parts, str)
            fields.append([bytes(p) for p in parts])
        return names, reader.paths(), fields


def read_shards(shards: list[str]) -> tuple[list[str], dict[str, dict[str, bytes]]]:
    """The sample keys in the order their members come, and each key's members (name after the
    key -> bytes), checking WebDataset's rules: a key ends at the first dot of the last
    component, and a sample's members are adjacent (never split over shards)."""
    order: list[str] = []
    members: dict[str, dict[str, bytes]] = {}
    for shard in shards:
        with tarfile.open(shard) as tar:
            for info in tar.getmembers():
                assert info.isfile()
                folder, _, name = info.name.rpartition("/")
                stem, _, rest = name.partition(".")
                key = f"{folder}/{stem}" if folder else stem
                if not order or order[-1] != key:
                    assert key not in members, f"the members of {key} are not adjacent"
                    order.append(key)
                got = members.setdefault(key, {})
                assert rest not in got
                got[rest] = tar.extractfile(info).read()  # type: ignore[union-attr]
    return order, members


def ext_of(data: bytes) -> str:
    return {b"\xff\xd8": "jpg", b"\x89P": "png"}[data[:2]]


def expected_members(names: list[str], fields: list[bytes], kinds: dict[str, str]) -> dict[str, bytes]:
    out = {}
    for name, data in zip(names, fields):
        kind = kinds[name]
        ext = "json" if kind == "json" else "npy" if kind == "array" else ext_of(data)
        out[f"{name}.{ext}"] = data
    return out


def kinds_of(pack: Path) -> dict[str, str]:
    with open_pack(pack) as reader:
        meta = samples_manifest(reader)
        assert meta is not None and meta.field_specs is not None
        return {f.name: f.kind for f in meta.field_specs}


def check_webdataset(pack: Path, shards: list[str]) -> tuple[list[str], dict[str, dict[str, bytes]]]:
    """Every sample of ``pack`` is one WebDataset sample of its shards, in pack order, its members
    the stored field bytes; returns what ``read_shards`` read."""
    names, paths, fields = stored(pack)
    order, members = read_shards(shards)
    assert len(order) == len(paths)
    kinds = kinds_of(pack)
    for i, (key, path) in enumerate(zip(order, paths)):
        assert key == webdataset_key(path) or key.startswith(webdataset_key(path) + f"_{i}")
        assert members[key] == expected_members(names, fields[i], kinds)
        assert list(members[key]) == list(expected_members(names, fields[i], kinds))  # in field order
    return order, members


# -- webdataset ------------------------------------------------------------------------------------
def test_voc_exports_to_webdataset_with_a_member_a_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make_voc(tmp_path / "voc")
    samples = scan_layout(root, "voc")
    pack_field_samples(samples, tmp_path / "voc.lmdb", progress=False)
    argv = ["export", str(tmp_path / "voc.lmdb"), str(tmp_path / "wds"), "--format", "webdataset", "--json"]
    assert main([*argv, "--no-progress"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["samples"] == len(samples.relpaths) == 4 and result["format"] == "webdataset"
    order, members = check_webdataset(tmp_path / "voc.lmdb", result["shards"])
    assert order[0] == "JPEGImages/2007_000032"
    assert set(members["JPEGImages/2007_000032"]) == {"image.jpg", "mask.png"}
    # the members are the original files, byte for byte (a mask's palette and 16 bits kept)
    base = Path(samples.root)
    for key, (image_path, mask_path) in zip(order, samples.field_paths):
        assert members[key]["image.jpg"] == (base / image_path).read_bytes()
        assert members[key]["mask.png"] == (base / mask_path).read_bytes()
    assert Image.open(io.BytesIO(members[order[0]]["mask.png"])).mode == "P"
    assert sorted(os.listdir(tmp_path / "wds")) == ["shard-000000.tar"]  # unlabelled: no classes.txt
    assert result["bytes"] == sum(len(d) for m in members.values() for d in m.values())


def test_a_sharded_pack_of_fields_exports_to_shards_of_the_size_asked(tmp_path: Path) -> None:
    root = make_voc(tmp_path / "voc")
    pack_field_samples(scan_layout(root, "voc"), tmp_path / "sharded", shards=2, progress=False)
    result = export(tmp_path / "sharded", tmp_path / "wds", format="webdataset", shard_size="3KB", progress=False)
    assert len(result.shards) > 1
    order, members = check_webdataset(tmp_path / "sharded", result.shards)
    sizes = [sum(len(d) + 1024 for d in m.values()) for m in members.values()]
    for shard in result.shards:
        with tarfile.open(shard) as tar:
            keys = {n.partition(".")[0] for n in tar.getnames()}
        inside = sum(sizes[order.index(k)] for k in keys)
        assert len(keys) == 1 or inside <= 3000  # a shard is over the size only when one sample is
    assert not (tmp_path / "wds.partial").exists()
    # nothing is overwritten: a second export into OUT is refused
    with pytest.raises(OutputExistsError, match="not empty"):
        export(tmp_path / "sharded", tmp_path / "wds", format="webdataset")


def test_coco_exports_json_members_of_its_annotations(tmp_path: Path) -> None:
    datasets = pytest.importorskip("torchvision.datasets")
    images, annotations = make_coco(tmp_path / "coco")
    coco = datasets.CocoDetection(str(images), str(annotations))
    pack_dataset(coco, tmp_path / "coco.lmdb", progress=False)
    result = export(tmp_path / "coco.lmdb", tmp_path / "wds", format="webdataset", progress=False)
    order, members = check_webdataset(tmp_path / "coco.lmdb", result.shards)
    for i, key in enumerate(order):
        assert set(members[key]) == {"image.jpg", "image_info.json", "annotations.json"}
        assert members[key]["image.jpg"] == (images / coco.coco.imgs[coco.ids[i]]["file_name"]).read_bytes()
        assert json.loads(members[key]["annotations.json"]) == coco[i][1]
        assert json.loads(members[key]["image_info.json"])["id"] == coco.ids[i]


class _Items:
    """A map-style dataset of dict items: an RGB image, a palette mask, a JSON value and an array."""

    def __init__(self) -> None:
        rng = np.random.default_rng(3)
        self.items: list[dict[str, Any]] = []
        for k in range(3):
            mask = Image.fromarray(rng.integers(0, 5, (6, 7), dtype=np.uint8), "P")
            mask.putpalette([v for i in range(256) for v in (i * 40 % 256, i * 90 % 256, 7)])
            self.items.append(
                {
                    "image": Image.fromarray(rng.integers(0, 256, (6, 7, 3), dtype=np.uint8)),
                    "mask": mask,
                    "meta": {"id": k, "name": f"ünï {k}", "boxes": [[1.5, 2, 3, 4]] * k},
                    "points": rng.normal(size=(k + 1, 2)).astype(np.float32),
                }
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


def test_a_dataset_of_several_values_exports_to_webdataset_and_not_as_files(tmp_path: Path) -> None:
    items = _Items()
    pack_dataset(items, tmp_path / "d.lmdb", progress=False)
    result = export(tmp_path / "d.lmdb", tmp_path / "wds", format="webdataset", progress=False)
    order, members = check_webdataset(tmp_path / "d.lmdb", result.shards)
    assert order == ["00000000", "00000001", "00000002"]
    for key, item in zip(order, items.items):
        got = members[key]
        assert list(got) == ["image.png", "mask.png", "meta.json", "points.npy"]
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(got["image.png"]))), np.asarray(item["image"]))
        mask = Image.open(io.BytesIO(got["mask.png"]))
        assert mask.mode == "P" and mask.getpalette() == item["mask"].getpalette()
        assert json.loads(got["meta.json"]) == item["meta"]
        points = np.load(io.BytesIO(got["points.npy"]), allow_pickle=False)
        assert points.dtype == np.float32 and np.array_equal(points, item["points"])
    # as files: no layout of files to write back; the message says what does it
    with pytest.raises(OptionError, match="items of a Python dataset") as refused:
        export(tmp_path / "d.lmdb", tmp_path / "files")
    assert "--format webdataset" in str(refused.value) and "--format huggingface" in str(refused.value)
    assert not (tmp_path / "files").exists() and not (tmp_path / "files.partial").exists()


def test_pairs_and_tables_export_to_webdataset_with_unique_keys(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)

    def png(w: int, h: int) -> bytes:
        out = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(out, "PNG")
        return out.getvalue()

    for name in ["0801", "ünï", "baboon.sub"]:
        write(tmp_path / "pairs" / "HR" / f"{name}.png", png(8, 6))
        write(tmp_path / "pairs" / "LR" / f"{name}.png", png(4, 3))
    samples = scan_layout(tmp_path / "pairs", "pairs", scale=2, gt_dir="HR", lq_dir="LR")
    pack_field_samples(samples, tmp_path / "p.lmdb", progress=False)
    result = export(tmp_path / "p.lmdb", tmp_path / "p-wds", format="webdataset", progress=False)
    order, members = check_webdataset(tmp_path / "p.lmdb", result.shards)
    assert "LR/baboon_sub" in order  # the dot of the stem: WebDataset's key ends at the first dot
    for key, (lq, gt) in zip(order, samples.field_paths):
        assert members[key] == {
            "lq.png": (tmp_path / "pairs" / lq).read_bytes(),
            "gt.png": (tmp_path / "pairs" / gt).read_bytes(),
        }
    # a table naming one image in two rows: two samples, two keys
    for name in ["a/1.jpg", "b/2.png"]:
        write(tmp_path / "images" / name, png(5, 5) if name.endswith("png") else _jpeg())
    table = tmp_path / "meta.csv"
    table.write_text("file_name,caption\na/1.jpg,one\nb/2.png,two\na/1.jpg,again\n", encoding="utf-8")
    pack_field_samples(scan_layout(tmp_path / "images", "table", annotations=table), tmp_path / "t.lmdb")
    result = export(tmp_path / "t.lmdb", tmp_path / "t-wds", format="webdataset", progress=False)
    order, members = check_webdataset(tmp_path / "t.lmdb", result.shards)
    assert order == ["a/1", "b/2", "a/1_2"]
    assert members["a/1_2"]["image.jpg"] == (tmp_path / "images" / "a/1.jpg").read_bytes()
    assert [json.loads(members[k]["meta.json"])["caption"] for k in order] == ["one", "two", "again"]


def _jpeg() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (5, 5), (200, 10, 30)).save(out, "JPEG")
    return out.getvalue()


def test_a_pack_of_another_layout_exports_to_webdataset_not_as_files(tmp_path: Path) -> None:
    def read(i: int) -> list[bytes]:
        return [_jpeg(), b'{"a":1}']

    from lmdbfolder.write.fields import FieldSpec

    samples = FieldSamples(
        layout="pairs_like",
        root=str(tmp_path),
        fields=(FieldSpec("image", "image"), FieldSpec("info", "json")),
        relpaths=["x.jpg"],
        field_paths=[("x.jpg", "")],
        labels=[-1],
        classes=[],
        read=read,
    )
    pack_field_samples(samples, tmp_path / "ok.lmdb", progress=False)
    result = export(tmp_path / "ok.lmdb", tmp_path / "wds", format="webdataset", progress=False)
    _, members = read_shards(result.shards)
    assert members == {"x": {"image.jpg": _jpeg(), "info.json": b'{"a":1}'}}
    # the files export of a layout it does not know: refused before anything is written
    with pytest.raises(OptionError, match="(?s)layout pairs_like.*--format webdataset"):
        export(tmp_path / "ok.lmdb", tmp_path / "files")
    assert not (tmp_path / "files.partial").exists()


# -- huggingface -----------------------------------------------------------------------------------
@pytest.fixture
def hf(monkeypatch: pytest.MonkeyPatch) -> Any:
    # Offline before datasets is imported (it reads these once): a local folder needs no network.
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
        monkeypatch.setenv(name, "1")
    return pytest.importorskip("datasets")


def test_huggingface_export_has_a_column_a_field(tmp_path: Path, hf: Any) -> None:
    pytest.importorskip("pyarrow")
    root = make_voc(tmp_path / "voc")
    pack_field_samples(scan_layout(root, "voc"), tmp_path / "voc.lmdb", progress=False)
    result = export(tmp_path / "voc.lmdb", tmp_path / "hf", format="huggingface", split="validation", progress=False)
    assert [os.path.basename(s) for s in result.shards] == ["validation-00000-of-00001.parquet"]
    ds = hf.load_dataset(str(tmp_path / "hf"), split="validation", cache_dir=str(tmp_path / "cache"))
    assert list(ds.features) == ["image", "mask"]
    assert all(isinstance(ds.features[n], hf.Image) for n in ("image", "mask"))
    names, paths, fields = stored(tmp_path / "voc.lmdb")
    raw = ds.cast_column("image", hf.Image(decode=False)).cast_column("mask", hf.Image(decode=False))
    assert [[r["image"]["bytes"], r["mask"]["bytes"]] for r in raw] == fields
    assert [r["image"]["path"] for r in raw] == paths and {r["mask"]["path"] for r in raw} == {None}
    mask = ds[0]["mask"]  # decoded as the file opens: its palette kept
    assert mask.mode == "P" and mask.getpalette() == Image.open(io.BytesIO(fields[0][1])).getpalette()


def test_huggingface_export_of_json_and_arrays(tmp_path: Path, hf: Any) -> None:
    pytest.importorskip("pyarrow")
    items = _Items()
    pack_dataset(items, tmp_path / "d.lmdb", progress=False)
    export(tmp_path / "d.lmdb", tmp_path / "hf", format="huggingface", shard_size="1KB", progress=False)
    files = sorted(os.listdir(tmp_path / "hf" / "data"))
    assert len(files) > 1 and files[0].endswith("-of-" + f"{len(files):05d}.parquet")
    ds = hf.load_dataset(str(tmp_path / "hf"), split="train", cache_dir=str(tmp_path / "cache"))
    assert list(ds.features) == ["image", "mask", "meta", "points"]
    assert ds.features["meta"] == hf.Value("string") and ds.features["points"] == hf.Value("binary")
    assert len(ds) == len(items)
    for row, item in zip(ds, items.items):
        assert json.loads(row["meta"]) == item["meta"]
        assert np.array_equal(np.load(io.BytesIO(row["points"]), allow_pickle=False), item["points"])
        assert np.array_equal(np.asarray(row["image"]), np.asarray(item["image"]))
        assert row["mask"].mode == "P"
    card = (tmp_path / "hf" / "README.md").read_text(encoding="utf-8")
    assert "- name: meta\n    dtype: string" in card and "- name: points\n    dtype: binary" in card


def test_datasets_loads_the_webdataset_export_with_two_image_columns(tmp_path: Path, hf: Any) -> None:
    root = make_voc(tmp_path / "voc")
    pack_field_samples(scan_layout(root, "voc"), tmp_path / "voc.lmdb", progress=False)
    result = export(tmp_path / "voc.lmdb", tmp_path / "wds", format="webdataset", progress=False)
    ds = hf.load_dataset("webdataset", data_files=result.shards, split="train", cache_dir=str(tmp_path / "cache"))
    assert isinstance(ds.features["image.jpg"], hf.Image) and isinstance(ds.features["mask.png"], hf.Image)
    _, _, fields = stored(tmp_path / "voc.lmdb")
    raw = ds.cast_column("mask.png", hf.Image(decode=False))
    assert [r["mask.png"]["bytes"] for r in raw] == [f[1] for f in fields]


def test_a_json_field_utf8_cannot_hold_reaches_hugging_face_escaped(tmp_path: Path, hf: Any) -> None:
    # A lone surrogate is stored as JSON writes it with surrogatepass: not UTF-8, so not an Arrow
    # string as it is; the column holds the same value with a \ud800 escape.
    pytest.importorskip("pyarrow")

    class Odd:
        def __len__(self) -> int:
            return 1

        def __getitem__(self, i: int) -> tuple[Image.Image, Any]:
            return Image.new("RGB", (3, 2)), {"name": "a\ud800b"}

    pack_dataset(Odd(), tmp_path / "odd.lmdb", progress=False)
    export(tmp_path / "odd.lmdb", tmp_path / "hf", format="huggingface", progress=False)
    ds = hf.load_dataset(str(tmp_path / "hf"), split="train", cache_dir=str(tmp_path / "cache"))
    assert ds[0]["f1"] == '{"name":"a\\ud800b"}' and json.loads(ds[0]["f1"]) == {"name": "a\ud800b"}
    export(tmp_path / "odd.lmdb", tmp_path / "wds", format="webdataset", progress=False)
    _, members = read_shards([str(tmp_path / "wds" / "shard-000000.tar")])
    assert members["00000000"]["f1.json"] == '{"name":"a\ud800b"}'.encode("utf-8", "surrogatepass")

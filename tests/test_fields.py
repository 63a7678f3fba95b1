"""Packs of several fields (format 4): the record and manifest, the writer's checks, and the
oracle tests: torchvision's VOCSegmentation, Cityscapes and CocoDetection packed with
``pack_dataset`` read back identical through ``LMDBDataset``, sample by sample, pixel for pixel,
plain and through one v2 pipeline under the same seed, in DataLoader workers and threads."""

from __future__ import annotations

import io
import json
import struct
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import datasets, tv_tensors
from torchvision.transforms import v2

import lmdbfolder
from conftest import assert_same_image, make_cityscapes, make_coco, make_voc, mask_png, photo_jpeg
from conftest import assert_same_sample as assert_same
from lmdbfolder import format as fmt
from lmdbfolder.errors import CorruptRecordError, LossyMaskWarning, NotAPackError, OptionError
from lmdbfolder.tools.export import export
from lmdbfolder.torch import LMDBDataset, LMDBFolder
from lmdbfolder.write.fields import FieldSamples, FieldSpec, SampleError, check_fields, pack_field_samples

PACK_ID = bytes(range(16))
#: A record of two fields (image ``abc``: jpeg 2x3x3; mask ``de``), unlabelled, under key 0 of a
#: format-4 pack whose ``binding_id`` is 00 01 .. 0f: flags 1, three u32 offsets, the payloads.
GOLDEN_FIELDS_RECORD = bytes.fromhex(
    "4c46"
    "01"
    "01"
    "03"
    "01"
    "0000"  # magic, version, jpeg, 3 channels, flags=1 (several fields), reserved
    "02000000"
    "03000000"  # width, height of field 0
    "1100000000000000"  # payload length 17 = 3 offsets (12 bytes) + 5 bytes of fields
    "ffffffff"  # label -1
    "0c1209ca"  # crc32: header[0:28], the payload, then binding_id || u64le(key 0)
    "00000000"
    "03000000"
    "05000000"  # offsets 0, 3, 5
    "616263"
    "6465"  # "abc", "de"
)
GOLDEN_FIELDS_MANIFEST_EXCERPT = (
    b'"fields":[{"kind":"image","name":"image"},{"kind":"mask","name":"mask"}],"format":"lmdbfolder",'
    b'"format_version":4,"layout":{"info":{"split":"train"},"name":"voc"}'
)
V4_META = {
    "format": "lmdbfolder",
    "format_version": 4,
    "count": 1,
    "classes": [],
    "class_to_idx": {},
    "store": "encoded",
    "pack_id": PACK_ID.hex(),
    "binding_id": PACK_ID.hex(),
    "next_record": 1,
    "fields": [{"name": "image", "kind": "image"}, {"name": "mask", "kind": "mask"}],
    "layout": {"name": "voc", "info": {"split": "train"}},
}


def _canonical(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


# -- the format --------------------------------------------------------------------------------------
def test_golden_record_of_two_fields() -> None:
    payload = fmt.pack_field_payloads([b"abc", b"de"])
    record = fmt.encode_record(
        payload,
        label=-1,
        encoding="jpeg",
        width=2,
        height=3,
        channels=3,
        flags=fmt.FIELDS_FLAG,
        binding=PACK_ID,
        index=0,
    )
    assert record == GOLDEN_FIELDS_RECORD
    crc = zlib.crc32(PACK_ID + struct.pack("<Q", 0), zlib.crc32(record[32:], zlib.crc32(record[:28])))
    assert crc == 0xCA09120C
    header, body = fmt.decode_record(record, index=0, verify=True, binding=PACK_ID, key=0, fields=2)
    assert header.flags == fmt.FIELDS_FLAG and (header.encoding, header.width, header.height) == ("jpeg", 2, 3)
    assert [bytes(p) for p in fmt.split_field_payloads(body, 2)] == [b"abc", b"de"]  # type: ignore[union-attr]


def test_format_md_shows_the_golden_bytes_of_format_4() -> None:
    with open(Path(__file__).parent.parent / "FORMAT.md", encoding="utf-8") as f:
        doc = f.read()
    flat = doc.replace(" ", "").replace("\n", "")
    assert GOLDEN_FIELDS_RECORD.hex() in flat
    assert GOLDEN_FIELDS_MANIFEST_EXCERPT.decode() in doc
    assert f"version {fmt.FIELDS_FORMAT_VERSION}" in doc
    for kind in fmt.FIELD_KINDS:
        assert f"| `{kind}` |" in doc


def test_a_record_is_never_read_as_the_other_kind() -> None:
    # An old reader (no fields) refuses a record of several fields; a reader of a pack of
    # fields refuses a record of one payload.
    with pytest.raises(CorruptRecordError, match="reserved header bits set"):
        fmt.decode_record(GOLDEN_FIELDS_RECORD, index=0)
    plain = fmt.encode_record(b"abc", label=7, encoding="jpeg")
    with pytest.raises(CorruptRecordError, match="holds one payload"):
        fmt.decode_record(plain, index=0, fields=2)
    forged = bytearray(GOLDEN_FIELDS_RECORD)
    forged[5] = 3  # an unknown flag bit
    with pytest.raises(CorruptRecordError, match="reserved header bits"):
        fmt.decode_record(bytes(forged), index=0, fields=2)


@pytest.mark.parametrize(
    "offsets",
    [
        b"\x01\x00\x00\x00\x03\x00\x00\x00\x05\x00\x00\x00",
        b"\x00\x00\x00\x00\x04\x00\x00\x00\x03\x00\x00\x00",
        b"\x00\x00\x00\x00\x03\x00\x00\x00\x06\x00\x00\x00",
    ],
)
def test_field_offsets_that_do_not_split_the_record_are_refused(offsets: bytes) -> None:
    body = memoryview(offsets + b"abcde")
    assert isinstance(fmt.split_field_payloads(body, 2), str)
    assert isinstance(fmt.split_field_payloads(memoryview(b"\x00" * 8), 2), str)  # too short for its offsets


def test_format_4_manifest() -> None:
    blob = _canonical(V4_META)
    assert GOLDEN_FIELDS_MANIFEST_EXCERPT in blob
    meta = fmt.Manifest.from_json(blob, where="x")
    assert meta.to_json() == blob and meta.binding == PACK_ID and meta.ordered
    assert meta.field_specs == (FieldSpec("image", "image"), FieldSpec("mask", "mask"))
    assert (meta.layout_name, meta.layout_info) == ("voc", {"split": "train"})
    for change, message in (
        ({"fields": None}, "fields is not a non-empty list"),
        ({"fields": [{"name": "image", "kind": "image"}, {"name": "image", "kind": "mask"}]}, "twice"),
        ({"fields": [{"name": "Image", "kind": "image"}]}, "is not"),
        ({"fields": [{"name": "image", "kind": "pickle"}]}, "not one of"),
        ({"store": "raw"}, "store='encoded'"),
        ({"binding_id": None}, "binding_id"),
    ):
        with pytest.raises(NotAPackError, match=message):
            fmt.Manifest.from_json(_canonical({**V4_META, **change}), where="x")
    # A version-3 manifest with a `fields` entry is kept as it is, never acted on.
    v3 = fmt.Manifest.from_json(_canonical({**V4_META, "format_version": 3}), where="x")
    assert v3.field_specs is None


def test_json_and_array_fields_are_bounded_and_never_pickled() -> None:
    assert fmt.fields.encode_json({"a": [1, "é"]}) == '{"a":[1,"é"]}'.encode()
    with pytest.raises(ValueError, match="JSON"):
        fmt.fields.encode_json({"a": float("nan")})
    with pytest.raises(ValueError, match="JSON"):
        fmt.fields.decode_json(b"[" * 40 + b"]" * 40, "x")
    arr = np.arange(12, dtype="<f4").reshape(3, 4)
    back = fmt.fields.decode_array(fmt.fields.encode_array(arr), "x")
    assert back.dtype == arr.dtype and np.array_equal(back, arr)
    with pytest.raises(ValueError, match="numbers and booleans only"):
        fmt.fields.encode_array(np.array([{}, 1], dtype=object))
    with pytest.raises(ValueError, match="dimensions"):
        fmt.fields.encode_array(np.zeros((1,) * 9))
    pickled = io.BytesIO()
    np.save(pickled, np.array([{}, 1], dtype=object), allow_pickle=True)
    assert "numbers and booleans only" in str(fmt.fields.array_problem(pickled.getvalue()))
    good = fmt.fields.encode_array(arr)
    assert "data is" in str(fmt.fields.array_problem(good[:-1]))


# -- the writer ------------------------------------------------------------------------------------
def _jpeg(size: tuple[int, int] = (9, 7), mode: str = "RGB") -> bytes:
    return photo_jpeg(*size, mode=mode)


def _samples(reads: list[Any], fields: tuple[FieldSpec, ...], skipped: list[tuple[str, str]] | None = None) -> Any:
    def read(i: int) -> list[bytes]:
        got = reads[i]
        if isinstance(got, Exception):
            raise got
        return got

    n = len(reads)
    return FieldSamples(
        "voc",
        "/src",
        fields,
        [f"x{i}.jpg" for i in range(n)],
        [(f"x{i}.jpg", f"x{i}.png") for i in range(n)],
        [-1] * n,
        [],
        read,
        skipped=list(skipped or []),
    )


IMAGE_MASK = (FieldSpec("image", "image"), FieldSpec("mask", "mask"))


def test_bad_samples_are_skipped_and_listed_with_their_files(tmp_path: Path) -> None:
    good = [_jpeg(), mask_png("P", (9, 7), 0)]
    reads = [
        good,
        [_jpeg(), mask_png("P", (5, 5), 1)],  # a mask of another size
        [_jpeg(), b"not a png"],
        SampleError("SegmentationClass/x3.png does not exist", ["JPEGImages/x3.jpg", "SegmentationClass/x3.png"]),
        [_jpeg()[:-40], mask_png("P", (9, 7), 0)],  # a truncated image
        good,
    ]
    samples = _samples(reads, IMAGE_MASK, skipped=[("JPEGImages/lonely.jpg", "no mask SegmentationClass/lonely.png")])
    with pytest.warns(lmdbfolder.SkippedFilesWarning):
        result = pack_field_samples(samples, tmp_path / "p.lmdb", progress=False)
    assert result.count == 2
    reasons = dict(result.skipped)
    assert set(reasons) == {"x1.jpg", "x2.jpg", "x3.jpg", "x4.jpg", "JPEGImages/lonely.jpg"}
    assert reasons["x1.jpg"] == "mask (x1.png): the mask is 5x5 but the image is 9x7"
    assert reasons["x2.jpg"].startswith("mask (x2.png): ")
    assert "SegmentationClass/x3.png" in reasons["x3.jpg"] and "truncated" in reasons["x4.jpg"]
    assert "lonely.png" in (tmp_path / "p.lmdb" / "skipped.txt").read_text()


def test_a_lossy_mask_is_packed_and_reported(tmp_path: Path) -> None:
    samples = _samples([[_jpeg(), _jpeg(mode="L")]], IMAGE_MASK)
    with pytest.warns(LossyMaskWarning, match=r"x0.jpg: mask \(x0.png\)"):
        assert pack_field_samples(samples, tmp_path / "p.lmdb", progress=False).count == 1


def test_json_and_array_fields_are_checked() -> None:
    fields = (FieldSpec("image", "image"), FieldSpec("meta", "json"), FieldSpec("depth", "array"))
    ok = check_fields([_jpeg(), b'{"a":1}', fmt.fields.encode_array(np.zeros((2, 2)))], fields, -1)
    assert isinstance(ok.result, lmdbfolder.write.records.Loaded)
    bad_json = check_fields([_jpeg(), b"{", fmt.fields.encode_array(np.zeros(2))], fields, -1)
    assert "meta" in bad_json.result.reason  # type: ignore[union-attr]
    bad_array = check_fields([_jpeg(), b"1", b"\x93NUMPY junk"], fields, -1)
    assert bad_array.result.reason.startswith("depth: ")  # type: ignore[union-attr]


def test_a_pack_of_fields_resumes_and_is_not_rewritten(tmp_path: Path) -> None:
    reads = [[_jpeg(), mask_png("P", (9, 7), k)] for k in range(5)]
    samples = _samples(reads, IMAGE_MASK)
    calls = []
    real = samples.read

    def interrupted(i: int) -> list[bytes]:
        calls.append(i)
        if i == 3 and len(calls) < 10:
            raise KeyboardInterrupt
        return real(i)

    samples.read = interrupted
    with pytest.raises(KeyboardInterrupt):
        pack_field_samples(samples, tmp_path / "p.lmdb", progress=False, commit_every=2, workers=1)
    calls.clear()
    calls.extend([0] * 10)  # the rerun reads on
    result = pack_field_samples(samples, tmp_path / "p.lmdb", progress=False, commit_every=2, workers=1)
    assert result.count == 5 and result.resumed_from == 2
    again = pack_field_samples(samples, tmp_path / "p.lmdb", progress=False, commit_every=2, workers=1)
    assert again.already_packed
    ours = LMDBDataset(tmp_path / "p.lmdb")
    assert [np.array(ours[i][1]).tolist() for i in range(5)] == [
        np.array(Image.open(io.BytesIO(r[1]))).tolist() for r in reads
    ]


def test_old_readers_and_lmdbfolder_refuse_a_pack_of_fields(tmp_path: Path) -> None:
    samples = _samples([[_jpeg(), mask_png("P", (9, 7), 0)]], IMAGE_MASK)
    pack_field_samples(samples, tmp_path / "p.lmdb", progress=False)
    with pytest.raises(OptionError, match="LMDBDataset"):
        LMDBFolder(tmp_path / "p.lmdb")
    env = lmdb.open(str(tmp_path / "p.lmdb"), readonly=True, lock=False)
    with env.begin() as txn:
        meta = json.loads(txn.get(fmt.META_KEY))
    env.close()
    assert meta["format_version"] == 4  # readers of 1-3 refuse it ("format version 4")
    small = make_voc(tmp_path / "voc", [("a", "RGB", (9, 7), "P")])
    lmdbfolder.pack(small / "VOCdevkit", tmp_path / "cls.lmdb", progress=False)  # classification: untouched
    with pytest.raises(NotAPackError, match="LMDBFolder"):
        LMDBDataset(tmp_path / "cls.lmdb")


# -- the oracles ------------------------------------------------------------------------------------
def _pipeline(detection: bool = False) -> v2.Compose:
    steps = [
        v2.RandomResizedCrop(16, antialias=True),
        v2.RandomHorizontalFlip(),
        v2.RandomPhotometricDistort(p=1.0),
        v2.ToImage(),
        v2.ToDtype({tv_tensors.Image: torch.float32, "others": None}, scale=True),
    ]
    if detection:
        steps.append(v2.SanitizeBoundingBoxes())
    return v2.Compose(steps)


def _same_under_seed(oracle: Any, ours: Any, n: int) -> None:
    for i in range(n):
        torch.manual_seed(100 + i)
        try:
            expected: Any = oracle[i]
        except ValueError as exc:  # the oracle refuses the sample: so must we, the same way
            torch.manual_seed(100 + i)
            with pytest.raises(ValueError, match=str(exc)[:30]):
                ours[i]
            continue
        torch.manual_seed(100 + i)
        assert_same(expected, ours[i])


@pytest.fixture
def voc(tmp_path: Path) -> tuple[Any, Path]:
    root = make_voc(tmp_path / "voc")
    dataset = datasets.VOCSegmentation(str(root), year="2012", image_set="train")
    result = lmdbfolder.pack_dataset(dataset, tmp_path / "voc.lmdb", progress=False)
    assert result.count == len(dataset) and not result.skipped
    return dataset, tmp_path / "voc.lmdb"


def test_voc_reads_back_as_vocsegmentation(voc: tuple[Any, Path]) -> None:
    dataset, pack = voc
    ours = LMDBDataset(pack)
    assert len(ours) == len(dataset) and ours.layout == "voc"
    modes = set()
    for i in range(len(dataset)):
        expected, got = dataset[i], ours[i]
        assert_same(expected, got)
        modes.add(got[1].mode)
    assert modes == {"P", "L", "I;16"}  # palette indices, 8 and 16-bit masks kept as they are
    _same_under_seed(datasets.wrap_dataset_for_transforms_v2(dataset), LMDBDataset(pack, wrap=True), len(dataset))


def test_voc_through_one_v2_pipeline(voc: tuple[Any, Path], tmp_path: Path) -> None:
    dataset, pack = voc
    tf = _pipeline()
    oracle = datasets.wrap_dataset_for_transforms_v2(
        datasets.VOCSegmentation(dataset.root, year="2012", image_set="train", transforms=tf)
    )
    ours = LMDBDataset(pack, transforms=tf)
    _same_under_seed(oracle, ours, len(dataset))
    assert isinstance(ours[0][1], tv_tensors.Mask)


def test_cityscapes_reads_back_and_transforms_as_the_oracle(tmp_path: Path) -> None:
    root = make_cityscapes(tmp_path / "cityscapes")
    dataset = datasets.Cityscapes(str(root), split="train", target_type="semantic")
    lmdbfolder.pack_dataset(dataset, tmp_path / "cs.lmdb", progress=False)
    ours = LMDBDataset(tmp_path / "cs.lmdb")
    # the layout info --layout cityscapes records (an update may come from either)
    assert ours.layout == "cityscapes" and ours.layout_info == {"split": "train", "mode": "fine"}
    for i in range(len(dataset)):
        assert_same(dataset[i], ours[i])
    tf = _pipeline()
    oracle = datasets.wrap_dataset_for_transforms_v2(
        datasets.Cityscapes(str(root), split="train", target_type="semantic", transforms=tf)
    )
    _same_under_seed(oracle, LMDBDataset(tmp_path / "cs.lmdb", transforms=tf), len(dataset))
    with pytest.raises(OptionError, match="semantic"):
        lmdbfolder.pack_dataset(
            datasets.Cityscapes(str(root), split="train", target_type="instance"), tmp_path / "x.lmdb"
        )


def test_coco_reads_back_and_transforms_as_the_oracle(tmp_path: Path) -> None:
    images, annotations = make_coco(tmp_path / "coco")
    dataset = datasets.CocoDetection(str(images), str(annotations))
    lmdbfolder.pack_dataset(dataset, tmp_path / "coco.lmdb", progress=False)
    ours = LMDBDataset(tmp_path / "coco.lmdb")
    assert ours.ids == dataset.ids and [c["name"] for c in ours.categories] == ["cat", "dög", "bird"]
    for i in range(len(dataset)):
        assert_same(dataset[i], ours[i])  # the annotation lists as CocoDetection gives them
    for keys in (None, "all"):
        wrapped = datasets.wrap_dataset_for_transforms_v2(dataset, target_keys=keys)
        mine = LMDBDataset(tmp_path / "coco.lmdb", wrap=True, target_keys=keys)
        for i in range(len(dataset)):
            a, b = wrapped[i], mine[i]
            assert_same_image(a[0], b[0])
            assert sorted(a[1]) == sorted(b[1])
            for k in a[1]:
                assert_same(a[1][k], b[1][k])
    tf = _pipeline(detection=True)
    oracle = datasets.wrap_dataset_for_transforms_v2(
        datasets.CocoDetection(str(images), str(annotations), transforms=tf)
    )
    _same_under_seed(oracle, LMDBDataset(tmp_path / "coco.lmdb", transforms=tf), len(dataset))


def test_a_missing_mask_is_skipped_and_named(tmp_path: Path) -> None:
    root = make_voc(tmp_path / "voc")
    (root / "VOCdevkit" / "VOC2012" / "SegmentationClass" / "cmyk_1.png").unlink()
    dataset = datasets.VOCSegmentation(str(root), year="2012", image_set="train")
    with pytest.warns(lmdbfolder.SkippedFilesWarning, match="SegmentationClass/cmyk_1.png"):
        result = lmdbfolder.pack_dataset(dataset, tmp_path / "voc.lmdb", progress=False)
    assert result.count == len(dataset) - 1 and result.skipped[0][0] == "JPEGImages/cmyk_1.jpg"


class _Items(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A dataset whose items are several values of every kind pack_dataset stores as they come."""

    def __init__(self, n: int = 3) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        rgb = Image.open(io.BytesIO(photo_jpeg(11 + i, 7, seed=i))).convert("RGB")
        mask = Image.open(io.BytesIO(mask_png("P", (11 + i, 7), i)))
        mask.load()
        cmyk = rgb.convert("CMYK")
        depth = np.linspace(0, 1, 6, dtype="<f4").reshape(2, 3) * i
        boxes = torch.tensor([[1.0, 2.0, 3.0, 4.0 + i]])
        return rgb, mask, cmyk, depth, boxes, {"id": i, "caption": f"ñ {i}", "tags": [1, 2]}, i


def test_a_dataset_of_several_values_reads_back_as_it_came(tmp_path: Path) -> None:
    dataset = _Items()
    result = lmdbfolder.pack_dataset(dataset, tmp_path / "items.lmdb", progress=False)
    assert result.count == 3
    ours = LMDBDataset(tmp_path / "items.lmdb")
    assert [f.kind for f in ours.fields] == ["image", "mask", "image", "array", "array", "json", "json"]
    for i in range(len(dataset)):
        assert_same(dataset[i], ours[i])

    class Dicts(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 2

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"lq": dataset[i][0], "Depth Map": dataset[i][3]}

    lmdbfolder.pack_dataset(Dicts(), tmp_path / "dicts.lmdb", progress=False)
    back = LMDBDataset(tmp_path / "dicts.lmdb")
    assert [f.name for f in back.fields] == ["lq", "f1"]
    assert_same(Dicts()[1], back[1])


# -- workers and threads ----------------------------------------------------------------------------
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers(voc: tuple[Any, Path], context: str) -> None:
    dataset, pack = voc
    # A uint16 Mask (an I;16 PNG) cannot cross a worker's queue in this torch (its storage does not
    # rebuild, as for torchvision's own dataset): masks become int64, as training needs them anyway.
    to_int64 = v2.ToDtype({tv_tensors.Mask: torch.int64, "others": None})
    ours = LMDBDataset(pack, transforms=v2.Compose([v2.ToImage(), v2.Resize((8, 8)), to_int64]))
    ours[0]  # used in the parent before the workers start
    # batch_size=None: the masks differ in dtype (uint8, uint16), which no batch holds together
    loader = DataLoader(ours, batch_size=None, num_workers=2, multiprocessing_context=context)
    wrapped = datasets.wrap_dataset_for_transforms_v2(
        datasets.VOCSegmentation(dataset.root, year="2012", image_set="train", transforms=ours.transforms)
    )
    got = list(loader)
    assert len(got) == len(dataset)
    for i, item in enumerate(got):
        assert_same(wrapped[i], tuple(item))  # the default conversion makes tuples lists


def test_threads_share_one_dataset(voc: tuple[Any, Path]) -> None:
    dataset, pack = voc
    ours = LMDBDataset(pack)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(ours.__getitem__, [i % len(dataset) for i in range(16)]))
    for i, item in enumerate(got):
        assert_same(dataset[i % len(dataset)], item)


def test_settings_of_lmdbfolder_that_do_not_apply_are_refused(voc: tuple[Any, Path]) -> None:
    _, pack = voc
    with pytest.raises(OptionError, match="size_hint"):
        LMDBDataset(pack, size_hint=224)
    with pytest.raises(OptionError, match="target_keys"):
        LMDBDataset(pack, target_keys="all")
    assert LMDBDataset(pack, verify_checksums=False, readahead=False)[0][1].mode == "P"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        repr(LMDBDataset(pack))


# -- verify and info ----------------------------------------------------------------------------------
def test_verify_checks_every_field(tmp_path: Path) -> None:
    from conftest import forge_record

    images, annotations = make_coco(tmp_path / "coco")
    lmdbfolder.pack_dataset(datasets.CocoDetection(str(images), str(annotations)), tmp_path / "c.lmdb", progress=False)
    assert lmdbfolder.verify(tmp_path / "c.lmdb", decode=True).ok
    ours = LMDBDataset(tmp_path / "c.lmdb")
    info, anns = ours._values(0)[1], ours._values(0)[2]
    image = bytes(fmt.split_field_payloads(lmdbfolder.Reader(tmp_path / "c.lmdb").get(0).payload, 3)[0])  # type: ignore[index]
    foreign = [dict(anns[0], image_id=999), dict(anns[1], category_id=42), dict(anns[2], bbox=[1, 2, "x", 4])]
    forge_record(
        tmp_path / "c.lmdb",
        0,
        flags=fmt.FIELDS_FLAG,
        label=-1,
        payload=fmt.pack_field_payloads([image, json.dumps(info).encode(), json.dumps(foreign).encode()]),
    )
    forge_record(
        tmp_path / "c.lmdb",
        1,
        flags=fmt.FIELDS_FLAG,
        label=-1,
        payload=fmt.pack_field_payloads([image[:-30], b"{", b"[]"]),
    )
    report = lmdbfolder.verify(tmp_path / "c.lmdb")
    found = [(p.index, p.kind, p.message) for p in report.problems]
    assert not report.ok and {i for i, *_ in found} == {0, 1}
    text = " | ".join(m for *_, m in found)
    for expected in (
        "names image 999, not this sample's image",
        "names category 42",
        "not four finite numbers",
        "field 'image' is truncated",
        "field 'image_info': not valid UTF-8 JSON",
    ):
        assert expected in text


def test_verify_reports_a_mask_of_another_size_an_empty_one_and_a_lossy_one(voc: tuple[Any, Path]) -> None:
    from conftest import forge_record

    _, pack = voc
    image = _jpeg((37, 29))
    forge_record(
        pack, 0, flags=fmt.FIELDS_FLAG, label=-1, payload=fmt.pack_field_payloads([image, mask_png("P", (5, 5), 0)])
    )
    forge_record(pack, 1, flags=fmt.FIELDS_FLAG, label=-1, payload=fmt.pack_field_payloads([image, b""]))
    forge_record(
        pack, 2, flags=fmt.FIELDS_FLAG, label=-1, payload=fmt.pack_field_payloads([image, _jpeg((37, 29), "L")])
    )
    report = lmdbfolder.verify(pack)
    found = {p.index: p.message for p in report.problems}
    assert set(found) == {0, 1}
    assert "is 5x5 but the image is 37x29" in found[0] and "empty (a missing mask)" in found[1]
    assert any("lossy jpeg" in note for note in report.notes)


def test_info_lists_the_fields_and_the_counts(tmp_path: Path, voc: tuple[Any, Path]) -> None:
    from lmdbfolder.tools.info import format_info, pack_info, pack_statistics

    _, pack = voc
    info = pack_info(pack)
    assert info["fields"] == [{"name": "image", "kind": "image"}, {"name": "mask", "kind": "mask"}]
    stats = pack_statistics(pack)["field_stats"]
    assert stats["fields"][1]["encodings"] == {"png": 4} and stats["mask_values"]["255"] == 2
    images, annotations = make_coco(tmp_path / "coco")
    lmdbfolder.pack_dataset(datasets.CocoDetection(str(images), str(annotations)), tmp_path / "c.lmdb", progress=False)
    info = pack_info(tmp_path / "c.lmdb")
    stats = pack_statistics(tmp_path / "c.lmdb")
    info.update({k: v for k, v in stats.items() if k not in ("path", "count", "encodings")})  # as the CLI does
    info["encoding_shares"] = {"jpeg": 1.0}
    text = format_info(info)
    assert "layout:" in text and "field annotations: json (json 3)" in text
    assert "categories:" in text and "(annotations in 3 samples)" in text
    assert {c["name"]: c["annotations"] for c in info["field_stats"]["categories"]} == {
        name: sum(1 for a in json.loads(annotations.read_text())["annotations"] if a["category_id"] == cid)
        for cid, name in ((1, "cat"), (2, "dög"), (3, "bird"))
    }


# -- export, copy, update ---------------------------------------------------------------------------
def _same_dataset(a: Any, b: Any) -> None:
    assert len(a) == len(b)
    for i in range(len(a)):
        assert_same(a[i], b[i])


def test_export_writes_the_layout_back_for_torchvision(tmp_path: Path, voc: tuple[Any, Path]) -> None:
    dataset, pack = voc
    export(pack, tmp_path / "voc-out")
    _same_dataset(dataset, datasets.VOCSegmentation(str(tmp_path / "voc-out"), year="2012", image_set="train"))
    root = make_cityscapes(tmp_path / "cityscapes")
    city = datasets.Cityscapes(str(root), split="train", target_type="semantic")
    lmdbfolder.pack_dataset(city, tmp_path / "cs.lmdb", progress=False)
    export(tmp_path / "cs.lmdb", tmp_path / "cs-out")
    back = datasets.Cityscapes(str(tmp_path / "cs-out"), split="train", target_type="semantic")
    by_path = {Path(p).name: i for i, p in enumerate(back.images)}  # os.listdir order differs
    for i, image in enumerate(city.images):
        assert_same(city[i], back[by_path[Path(image).name]])
    images, annotations = make_coco(tmp_path / "coco")
    coco = datasets.CocoDetection(str(images), str(annotations))
    lmdbfolder.pack_dataset(coco, tmp_path / "coco.lmdb", progress=False)
    export(tmp_path / "coco.lmdb", tmp_path / "coco-out")
    out = tmp_path / "coco-out"
    _same_dataset(coco, datasets.CocoDetection(str(out), str(out / "annotations.json")))
    # and as WebDataset shards, a member a field (tests/test_export_fields.py)
    assert export(pack, tmp_path / "wds", format="webdataset").samples == len(dataset)


def test_copy_and_update_of_a_pack_of_fields(tmp_path: Path, voc: tuple[Any, Path]) -> None:
    dataset, pack = voc
    lmdbfolder.copy_pack(pack, tmp_path / "copy.lmdb")
    _same_dataset(dataset, LMDBDataset(tmp_path / "copy.lmdb"))
    assert lmdbfolder.verify(tmp_path / "copy.lmdb").ok
    with pytest.raises(OptionError, match="an update without --layout would read a folder of classes"):
        lmdbfolder.pack(tmp_path / "voc", pack, update=True, progress=False)


def test_show_draws_masks_over_images_and_outlines_boxes(tmp_path: Path, voc: tuple[Any, Path]) -> None:
    from lmdbfolder.tools.show import contact_sheet

    dataset, pack = voc
    sheet = contact_sheet(pack, tmp_path / "voc.png", indices=[0], size=64)
    assert sheet.undecodable == [] and sheet.indices == [0]
    left, top, right, bottom = sheet.boxes[0]
    tile = np.asarray(Image.open(tmp_path / "voc.png").convert("RGB"))[top:bottom, left:right]
    plain = np.asarray(dataset[0][0].resize((right - left, bottom - top), Image.Resampling.BILINEAR))
    assert np.abs(tile.astype(int) - plain.astype(int)).mean() > 10  # the mask's colours are over it
    images, annotations = make_coco(tmp_path / "coco")
    lmdbfolder.pack_dataset(datasets.CocoDetection(str(images), str(annotations)), tmp_path / "c.lmdb", progress=False)
    assert contact_sheet(tmp_path / "c.lmdb", tmp_path / "coco.png", size=48).undecodable == []


def test_the_segmentation_example_of_the_readme(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The README's example (workers and batch size made small), as a user runs it.
    make_voc(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    lmdbfolder.pack_dataset(datasets.VOCSegmentation("data", image_set="train"), "voc.lmdb", progress=False)
    tf = v2.Compose(
        [
            v2.RandomResizedCrop(32),
            v2.RandomHorizontalFlip(),
            v2.ToImage(),
            v2.ToDtype({tv_tensors.Image: torch.float32, tv_tensors.Mask: torch.int64}, scale=True),
        ]
    )
    loader = DataLoader(LMDBDataset("voc.lmdb", transforms=tf), batch_size=2, num_workers=2)
    images, masks = next(iter(loader))
    assert images.shape == (2, 3, 32, 32) and masks.shape == (2, 1, 32, 32) and masks.dtype == torch.int64


def test_a_sharded_pack_of_fields(tmp_path: Path) -> None:
    root = make_voc(tmp_path / "voc")
    dataset = datasets.VOCSegmentation(str(root), year="2012", image_set="train")
    result = lmdbfolder.pack_dataset(dataset, tmp_path / "sharded", shards=2, progress=False)
    assert result.count == len(dataset) and len(result.shards) == 2  # type: ignore[union-attr]
    assert (tmp_path / "sharded" / "index.json").is_file()
    _same_dataset(dataset, LMDBDataset(tmp_path / "sharded"))
    tf = _pipeline()
    oracle = datasets.wrap_dataset_for_transforms_v2(
        datasets.VOCSegmentation(str(root), year="2012", image_set="train", transforms=tf)
    )
    _same_under_seed(oracle, LMDBDataset(tmp_path / "sharded", transforms=tf), len(dataset))
    assert lmdbfolder.verify(tmp_path / "sharded").ok
    with pytest.raises(OptionError, match="LMDBDataset"):
        LMDBFolder(tmp_path / "sharded")
    assert lmdbfolder.pack_dataset(dataset, tmp_path / "sharded", shards=2, progress=False).already_packed
    with pytest.raises(OptionError, match="several fields"):
        lmdbfolder.pack_dataset(_Pairs(), tmp_path / "x", shards=2)


class _Pairs(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> tuple[Image.Image, int]:
        return Image.new("RGB", (3, 3)), i


def test_info_show_and_export_of_a_sharded_pack_of_fields(tmp_path: Path) -> None:
    from lmdbfolder.tools.info import pack_info, pack_statistics
    from lmdbfolder.tools.show import contact_sheet

    root = make_voc(tmp_path / "voc")
    dataset = datasets.VOCSegmentation(str(root), year="2012", image_set="train")
    lmdbfolder.pack_dataset(dataset, tmp_path / "sharded", shards=2, progress=False)
    assert pack_info(tmp_path / "sharded")["layout"] == "voc"
    assert pack_statistics(tmp_path / "sharded")["field_stats"]["looked_at"] == len(dataset)
    assert contact_sheet(tmp_path / "sharded", tmp_path / "s.png", size=32).undecodable == []
    export(tmp_path / "sharded", tmp_path / "out")
    _same_dataset(dataset, datasets.VOCSegmentation(str(tmp_path / "out"), year="2012", image_set="train"))


def test_a_sharded_pack_of_fields_through_object_storage(s3: Any, tmp_path: Path) -> None:
    root = make_voc(tmp_path / "voc")
    dataset = datasets.VOCSegmentation(str(root), year="2012", image_set="train")
    lmdbfolder.pack_dataset(dataset, tmp_path / "sharded", shards=2, progress=False)
    url = s3.url("voc")
    lmdbfolder.copy_pack(tmp_path / "sharded", url)
    _same_dataset(dataset, LMDBDataset(url, cache_dir=tmp_path / "cache"))  # staged shard by shard
    lmdbfolder.copy_pack(url, tmp_path / "back")
    _same_dataset(dataset, LMDBDataset(tmp_path / "back"))


def test_pairs_and_other_layouts_read_as_tuples_of_their_fields(tmp_path: Path) -> None:
    lq = [photo_jpeg(8, 6, seed=k) for k in range(2)]
    gt = [photo_jpeg(16, 12, seed=k, mode="L") for k in range(2)]
    pairs = FieldSamples(
        "pairs", "/src", (FieldSpec("lq", "image"), FieldSpec("gt", "image")), ["a.jpg", "b.jpg"],
        [("LQ/a.jpg", "GT/a.jpg"), ("LQ/b.jpg", "GT/b.jpg")], [-1, -1], [], lambda i: [lq[i], gt[i]],
        layout_info={"scale": 2},
    )  # fmt: skip
    pack_field_samples(pairs, tmp_path / "pairs.lmdb", progress=False)
    ours = LMDBDataset(tmp_path / "pairs.lmdb")
    for i in range(2):
        got_lq, got_gt = ours[i]
        assert_same_image(got_lq, Image.open(io.BytesIO(lq[i])).convert("RGB"))
        assert_same_image(got_gt, Image.open(io.BytesIO(gt[i])).convert("RGB"))
    assert ours.layout_info == {"scale": 2}
    depth = fmt.fields.encode_array(np.arange(6, dtype="<i2").reshape(2, 3))
    table = FieldSamples(
        "table", "/src", (FieldSpec("image", "image"), FieldSpec("meta", "json"), FieldSpec("depth", "array")),
        ["a.jpg"], [("a.jpg", "", "")], [0], ["cat"], lambda i: [lq[0], b'{"caption":"\\u00e9t\\u00e9"}', depth],
    )  # fmt: skip
    pack_field_samples(table, tmp_path / "table.lmdb", progress=False)
    image, meta, array = LMDBDataset(tmp_path / "table.lmdb")[0]
    assert image.mode == "RGB" and meta == {"caption": "été"} and array.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert LMDBDataset(tmp_path / "table.lmdb").classes == ["cat"]


def test_seeded_transforms_replay(voc: tuple[Any, Path]) -> None:
    _, pack = voc
    ours = LMDBDataset(pack, transforms=_pipeline(), seed=7)
    first = [ours[i] for i in range(2)]
    torch.manual_seed(123)  # the global state does not matter with a seed
    again = [ours[i] for i in range(2)]
    for a, b in zip(first, again):
        assert_same(a, b)
    ours.set_epoch(1)
    assert not torch.equal(ours[0][0], first[0][0])

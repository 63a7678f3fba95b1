"""The byte layout, pinned: any change here must come with a format version bump."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import make_small_tree
from lmdbfolder import format as fmt
from lmdbfolder.errors import CorruptRecordError, FormatVersionError, NotAPackError
from lmdbfolder.write.shards import pack_sharded, write_index

GOLDEN_RECORD = bytes.fromhex(
    "4c46"  # magic "LF"
    "01"  # record version
    "01"  # encoding id 1 = jpeg
    "03"  # channels
    "00"  # flags
    "0000"  # reserved
    "02000000"  # width 2
    "03000000"  # height 3
    "0300000000000000"  # payload length 3
    "07000000"  # label 7
    "5a5d6b3a"  # crc32 of the 28 header bytes before it, then of the payload = 0x3a6b5d5a
    "616263"  # payload
)

#: Format 2: the same record bound to pack id 00 01 .. 0f and index 5: the CRC
#: continues over those 16 bytes and u64le(5).
PACK_ID = bytes(range(16))
GOLDEN_BOUND_RECORD = GOLDEN_RECORD[:28] + bytes.fromhex("7d36bb56") + GOLDEN_RECORD[32:]

GOLDEN_META = (
    b'{"class_to_idx":{"cat":0,"\\u00f1":1},"classes":["cat","\\u00f1"],"count":2,'
    b'"format":"lmdbfolder","format_version":2,"pack_id":"000102030405060708090a0b0c0d0e0f","store":"encoded"}'
)
META = {
    "format": "lmdbfolder",
    "format_version": 2,
    "count": 2,
    "classes": ["cat", "ñ"],
    "class_to_idx": {"cat": 0, "ñ": 1},
    "store": "encoded",
    "pack_id": PACK_ID.hex(),
}
GOLDEN_META_V1 = (
    b'{"class_to_idx":{"cat":0,"\\u00f1":1},"classes":["cat","\\u00f1"],"count":2,'
    b'"format":"lmdbfolder","format_version":1,"store":"encoded"}'
)
#: ``__check__`` of GOLDEN_META, labels [0, 1], paths ["a.jpg", "b.png"] and no skipped file.
GOLDEN_CHECK = (
    b'{"__labels__":[8,3718166540],"__meta__":[178,4024643661],"__paths__":[34,2376063627],"__skipped__":[2,223132457]}'
)


def test_header_is_32_bytes_little_endian() -> None:
    assert fmt.RECORD_HEADER.size == 32
    assert fmt.RECORD_HEADER.format.startswith("<")


def test_golden_record() -> None:
    assert fmt.encode_record(b"abc", label=7, encoding="jpeg", width=2, height=3, channels=3) == GOLDEN_RECORD
    header, payload = fmt.decode_record(GOLDEN_RECORD, verify=True)
    assert header == fmt.RecordHeader("jpeg", 3, 2, 3, 7, 0x3A6B5D5A, 3)
    assert zlib.crc32(b"abc", zlib.crc32(GOLDEN_RECORD[:28])) == 0x3A6B5D5A
    assert bytes(payload) == b"abc"


def test_golden_bound_record() -> None:
    """Format 2: crc32(pack_id || u64le(index), crc32(payload, crc32(header[:28])))."""
    bound = fmt.encode_record(b"abc", label=7, encoding="jpeg", width=2, height=3, channels=3, binding=PACK_ID, index=5)
    assert bound == GOLDEN_BOUND_RECORD
    assert zlib.crc32(PACK_ID + struct.pack("<Q", 5), 0x3A6B5D5A) == 0x56BB367D
    header, payload = fmt.decode_record(bound, index=5, verify=True, binding=PACK_ID)
    assert header.crc32 == 0x56BB367D and bytes(payload) == b"abc"
    for index, binding in ((4, PACK_ID), (5, bytes(16))):  # another index, another pack
        with pytest.raises(CorruptRecordError, match="CRC-32") as info:
            fmt.decode_record(bound, index=index, verify=True, binding=binding)
        assert info.value.kind == "checksum"
    # the writer binds records built before their index was known, in place when it can
    buf = bytearray(GOLDEN_RECORD)
    assert fmt.bind_record(buf, PACK_ID, 5) is buf and bytes(buf) == GOLDEN_BOUND_RECORD
    copied = fmt.bind_record(GOLDEN_RECORD, PACK_ID, 5)
    assert bytes(copied) == GOLDEN_BOUND_RECORD
    view = memoryview(bytearray(GOLDEN_RECORD))
    fmt.bind_record(view, PACK_ID, 5)
    assert bytes(view) == GOLDEN_BOUND_RECORD


#: ``index.json`` of a 2-shard pack of 3 classes x 4 JPEGs, byte for byte as ``write_index``
#: wrote it before the index had a type (only the source root is changed); older packs must still open.
GOLDEN_INDEX = b"""{
 "checksum": "sha256 of each shard's manifest (checked on open) and tables (verify); crc32 of every record",
 "class_to_idx": {
  "class0": 0,
  "class1": 1,
  "class2": 2
 },
 "classes": [
  "class0",
  "class1",
  "class2"
 ],
 "count": 12,
 "created_at": "2026-12-02T21:50:53Z",
 "created_by": "lmdbfolder 0.1.0",
 "encodings": {
  "jpeg": 12
 },
 "format": "lmdbfolder-shards",
 "index_version": 1,
 "num_shards": 2,
 "pack_format_version": 2,
 "payload_bytes": 12701,
 "shards": [
  {
   "bytes": 24576,
   "count": 6,
   "first_index": 0,
   "first_source": 0,
   "manifest_sha256": "ea2da13b751fa16303e3cf6b10b69c28ad2ff1eb204695c1a6548e86846d97e0",
   "name": "train-00000-of-00002.lmdb",
   "pack_id": "7bf3015c7c1ae3cf8debed3ca86378fa",
   "payload_bytes": 6143,
   "skipped": 0,
   "sources": 6,
   "tables_bytes": [
    24,
    146
   ],
   "tables_sha256": "04e12dd270268f315716556298544981919e790ace54dc3f03507c0e770acf68"
  },
  {
   "bytes": 24576,
   "count": 6,
   "first_index": 6,
   "first_source": 6,
   "manifest_sha256": "1400de56f527fa6d0eb1b6b964131b22ece3aa15746cd8ecdb0a9f9ac862ffd1",
   "name": "train-00001-of-00002.lmdb",
   "pack_id": "b688b79e642bfc36e1d5fac7376f71dc",
   "payload_bytes": 6558,
   "skipped": 0,
   "sources": 6,
   "tables_bytes": [
    24,
    146
   ],
   "tables_sha256": "57762ea67c2cecdb3054da6c87564a70ac68655cc1d29a6656e4c214a3f8a71b"
  }
 ],
 "skipped": 0,
 "source": {
  "extensions": [
   ".jpg",
   ".jpeg",
   ".png",
   ".ppm",
   ".bmp",
   ".pgm",
   ".tif",
   ".tiff",
   ".webp"
  ],
  "layout": "imagefolder",
  "list_file": null,
  "root": "/data/train"
 },
 "split": {
  "method": "contiguous",
  "num_shards": 2,
  "prefix": "train",
  "sources": 12,
  "sources_sha256": "aca42809b768852b4bb190c438ab58f20ff1c8dcc930ab2e831c4da8f5918d4e"
 },
 "store": "encoded"
}
"""


def test_golden_meta() -> None:
    assert fmt.encode_meta(META) == GOLDEN_META
    assert fmt.decode_meta(GOLDEN_META, where="x") == META
    assert fmt.pack_binding(META) == PACK_ID
    old = fmt.decode_meta(GOLDEN_META_V1, where="x")  # format 1 stays readable
    assert old["format_version"] == 1 and fmt.pack_binding(old) is None


def test_golden_check() -> None:
    tables = {
        fmt.META_KEY: GOLDEN_META,
        fmt.LABELS_KEY: fmt.encode_labels([0, 1]),
        fmt.PATHS_KEY: fmt.encode_paths(["a.jpg", "b.png"]),
        fmt.SKIPPED_KEY: fmt.encode_skipped([]),
    }
    assert fmt.encode_check(tables) == GOLDEN_CHECK
    check = fmt.decode_check(GOLDEN_CHECK, where="x")
    for key, blob in tables.items():
        fmt.check_table(check, key, blob, where="x")
    with pytest.raises(NotAPackError, match="__paths__ table is damaged"):
        fmt.check_table(check, fmt.PATHS_KEY, fmt.encode_paths(["a.jpg", "c.png"]), where="x")
    for bad in (None, b"[]", b'{"__meta__":[1]}', b'{"__meta__":[1,2]}'):  # the three tables are required
        with pytest.raises(NotAPackError, match="table checksums"):
            fmt.decode_check(bad, where="x")


#: Format 3 (an updated pack): the records are bound to ``binding_id`` (the first
#: version's pack id) and their key; ``record_classes`` names the class of each
#: header label ("cat" is header label 0, a class the pack has as index 1).
GOLDEN_META_V3 = (
    b'{"binding_id":"000102030405060708090a0b0c0d0e0f","class_to_idx":{"ant":0,"cat":1},"classes":["ant","cat"],'
    b'"count":2,"format":"lmdbfolder","format_version":3,"next_record":9,"pack_id":"ffffffffffffffffffffffffffffffff",'
    b'"record_classes":["cat","dog","ant"],"store":"encoded"}'
)
#: ``__order__`` of that pack: sample 0 is the record under key 8, sample 1 the one under key 0.
GOLDEN_ORDER = bytes.fromhex("08000000000000000000000000000000")
#: ``__stats__``: (size u64, mtime_ns i64) per sample; -1 = not known.
GOLDEN_STATS = bytes.fromhex("030000000000000015cd853dfe9c97170010000000000000ffffffffffffffff")
GOLDEN_HISTORY = (
    b'[{"added":2,"at":"2026-01-02T03:04:05Z","count":2,"event":"pack","pack_id":"00000000000000000000000000000000"}]'
)
#: The record ``abc`` (label 0 = record class "cat", jpeg, 2x3x3) under key 8 of that pack.
GOLDEN_V3_RECORD = bytes.fromhex("4c4601010300000002000000030000000300000000000000000000009bb909e5616263")


def test_golden_format_3() -> None:
    meta = fmt.decode_meta(GOLDEN_META_V3, where="x")
    assert fmt.encode_meta(meta) == GOLDEN_META_V3
    assert fmt.pack_binding(meta) == PACK_ID  # binding_id, not pack_id
    assert fmt.label_map(meta) == [1, -2, 0]  # "dog" is no class of the pack any more
    assert fmt.label_map(fmt.decode_meta(GOLDEN_META, where="x")) is None
    assert fmt.encode_order([8, 0]) == GOLDEN_ORDER
    assert fmt.order_values(GOLDEN_ORDER, 2, where="x").tolist() == [8, 0]
    assert fmt.encode_stats([3, 4096], [1700000000123456789, fmt.UNKNOWN_MTIME]) == GOLDEN_STATS
    stats = fmt.stats_values(GOLDEN_STATS, 2, where="x")
    assert stats["size"].tolist() == [3, 4096] and stats["mtime_ns"].tolist() == [1700000000123456789, -1]
    event = {"event": "pack", "at": "2026-01-02T03:04:05Z", "pack_id": "00" * 16, "count": 2, "added": 2}
    assert fmt.encode_history([event]) == GOLDEN_HISTORY and fmt.decode_history(GOLDEN_HISTORY, where="x") == [event]
    record = fmt.encode_record(
        b"abc", label=0, encoding="jpeg", width=2, height=3, channels=3, binding=PACK_ID, index=8
    )
    assert record == GOLDEN_V3_RECORD
    # Sample 0's record: its CRC is bound to its key (8), whatever the sample's index.
    header, _ = fmt.decode_record(GOLDEN_V3_RECORD, index=0, key=8, verify=True, binding=PACK_ID)
    assert header.label == 0
    with pytest.raises(CorruptRecordError, match="CRC-32"):
        fmt.decode_record(GOLDEN_V3_RECORD, index=0, key=0, verify=True, binding=PACK_ID)
    for blob, what in ((GOLDEN_ORDER[:-1], "__order__"), (GOLDEN_STATS[:-1], "__stats__")):
        with pytest.raises(NotAPackError, match=what):
            (fmt.order_values if what == "__order__" else fmt.stats_values)(blob, 2, where="x")


@pytest.mark.parametrize(
    "change, message",
    [
        ((b'"binding_id":"000102030405060708090a0b0c0d0e0f",', b""), "binding_id=None"),
        ((b'"next_record":9', b'"next_record":-1'), "next_record=-1"),
        ((b'"dog","ant"', b'"dog","dog"'), "record_classes is not a list of distinct strings"),
        ((b'"record_classes":["cat","dog","ant"]', b'"record_classes":"cat"'), "record_classes"),
    ],
)
def test_format_3_manifests_are_checked(change: tuple[bytes, bytes], message: str) -> None:
    with pytest.raises(NotAPackError, match=message):
        fmt.decode_meta(GOLDEN_META_V3.replace(*change), where="x")


def _index_shape(value: object) -> object:
    """The keys and JSON types of ``value``, recursively (what a layout change changes)."""
    if isinstance(value, dict):
        return {k: _index_shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_index_shape(v) for v in value]
    return type(value).__name__


def test_golden_shard_index() -> None:
    index = fmt.ShardIndex.from_json(GOLDEN_INDEX, where="index.json")
    assert index.to_json() == GOLDEN_INDEX  # to_json(from_json(x)) == x
    assert fmt.decode_shard_index(GOLDEN_INDEX, where="index.json") == json.loads(GOLDEN_INDEX)
    assert (index.pack_format_version, index.count, index.store, index.num_shards) == (2, 12, "encoded", 2)
    assert index.classes == ["class0", "class1", "class2"] and index.encodings == {"jpeg": 12}
    assert index.split is not None and (index.split.prefix, index.split.num_shards, index.split.sources) == (
        "train",
        2,
        12,
    )
    first, second = index.shards
    assert (second.name, second.count, second.first_index, second.first_source) == (
        "train-00001-of-00002.lmdb",
        6,
        6,
        6,
    )
    assert (first.data_bytes, first.tables_bytes) == (24576, (24, 146))
    assert first.pack_id == "7bf3015c7c1ae3cf8debed3ca86378fa"
    assert not index.extra and not any(entry.extra for entry in index.shards)
    # Built from its values as write_index builds it, the index writes the same bytes.
    raw = json.loads(GOLDEN_INDEX)
    entries = [
        fmt.ShardEntry(
            name=e["name"],
            count=e["count"],
            tables_sha256=e["tables_sha256"],
            first_index=e["first_index"],
            first_source=e["first_source"],
            sources=e["sources"],
            skipped=e["skipped"],
            payload_bytes=e["payload_bytes"],
            data_bytes=e["bytes"],
            manifest_sha256=e["manifest_sha256"],
            tables_bytes=tuple(e["tables_bytes"]),
            pack_id=e["pack_id"],
        )
        for e in raw["shards"]
    ]
    built = fmt.ShardIndex(
        pack_format_version=2,
        count=12,
        classes=raw["classes"],
        class_to_idx=raw["class_to_idx"],
        store="encoded",
        shards=entries,
        num_shards=2,
        split=fmt.ShardSplit("contiguous", "train", 2, 12, raw["split"]["sources_sha256"]),
        encodings={"jpeg": 12},
        payload_bytes=12701,
        skipped=0,
        checksum=raw["checksum"],
        source=raw["source"],
        created_by="lmdbfolder 0.1.0",
        created_at="2026-12-02T21:50:53Z",
    )
    assert built == index and built.to_json() == GOLDEN_INDEX


def test_shard_index_of_format_1_shards_round_trips() -> None:
    # Indexes written before shard identities and pack ids: no manifest_sha256,
    # tables_bytes or pack_id, format-1 shards, the old checksum words.
    old = json.loads(GOLDEN_INDEX)
    old["pack_format_version"] = 1
    old["checksum"] = "sha256 of each shard's tables; crc32 of every record"
    for entry in old["shards"]:
        for key in ("manifest_sha256", "tables_bytes", "pack_id"):
            del entry[key]
    blob = fmt.encode_shard_index(old)
    index = fmt.ShardIndex.from_json(blob, where="index.json")
    assert index.to_json() == blob and index.to_dict() == old
    assert index.pack_format_version == 1
    assert all(e.pack_id is None and e.manifest_sha256 is None and e.tables_bytes is None for e in index.shards)
    assert "pack_id" not in fmt.decode_shard_index(blob, where="index.json")["shards"][0]


def test_shard_index_keeps_unknown_and_mistyped_fields_as_they_are() -> None:
    # A newer writer's fields, and informational fields of another type (a
    # reader must not require them): kept in ``extra``, written back unchanged.
    obj = json.loads(GOLDEN_INDEX)
    obj["future"] = {"a": [1, 2]}
    obj["created_at"] = 17
    obj["split"] = "contiguous"
    obj["shards"][0]["bytes"] = None
    obj["shards"][0]["pack_id"] = None
    obj["shards"][1]["colour"] = "blue"
    blob = fmt.encode_shard_index(obj)
    index = fmt.ShardIndex.from_json(blob, where="index.json")
    assert index.extra == {"future": {"a": [1, 2]}, "created_at": 17, "split": "contiguous"}
    assert (index.created_at, index.split) == (None, None)
    assert index.shards[0].extra == {"bytes": None, "pack_id": None} and index.shards[0].data_bytes is None
    assert index.shards[1].extra == {"colour": "blue"}
    assert index.to_json() == blob and index.to_dict() == obj
    assert _index_shape(fmt.decode_shard_index(blob, where="index.json")) == _index_shape(obj)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=False) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)
_INDEX_KEYS = sorted(json.loads(GOLDEN_INDEX)) + ["unknown"]
_ENTRY_KEYS = sorted(json.loads(GOLDEN_INDEX)["shards"][0]) + ["unknown"]


@given(st.sampled_from(_INDEX_KEYS), st.sampled_from(_ENTRY_KEYS), _JSON, st.booleans())
def test_a_changed_index_is_refused_or_read_as_it_is(top: str, key: str, value: object, in_entry: bool) -> None:
    # Whatever one field holds, the index is refused with an lmdbfolder error,
    # or readers get exactly the JSON object on disk and it encodes back to it.
    obj = json.loads(GOLDEN_INDEX)
    if in_entry:
        obj["shards"][1][key] = value
    else:
        obj[top] = value
    blob = fmt.encode_shard_index(obj)
    try:
        index = fmt.ShardIndex.from_json(blob, where="index.json")
    except (NotAPackError, FormatVersionError):
        return
    assert index.to_dict() == json.loads(blob)
    assert index.to_json() == blob


def test_written_index_round_trips_and_keeps_the_golden_layout(tmp_path: Path) -> None:
    tree = make_small_tree(tmp_path / "src")  # the tree GOLDEN_INDEX was written from
    result = pack_sharded(tree, tmp_path / "sh", shards=2, progress=False)
    blob = (tmp_path / "sh" / fmt.SHARD_INDEX_FILE).read_bytes()
    index = fmt.ShardIndex.from_json(blob, where="index.json")
    assert index.to_json() == blob
    assert index.count == result.count == 12 and [e.count for e in index.shards] == [6, 6]
    assert write_index(tmp_path / "sh") == json.loads((tmp_path / "sh" / fmt.SHARD_INDEX_FILE).read_bytes())
    # The same fields and JSON types as the index written before it had a type
    # (GOLDEN_INDEX, from the same tree): older and newer packs agree.
    assert _index_shape(json.loads(blob)) == _index_shape(json.loads(GOLDEN_INDEX))


# -- the manifest and the index as objects (issue 33) ---------------------------------------
#: A manifest as `pack` writes it (format 2), with every informational field.
WRITTEN_META = {
    **META,
    "encodings": {"jpeg": 1, "png": 1},
    "payload_bytes": 1234,
    "checksum": "crc32",
    "source": {"layout": "imagefolder", "root": "/data", "list_file": None, "extensions": [".jpg"]},
    "fingerprint": {"sources": 2},
    "skipped_count": 0,
    "created_by": "lmdbfolder 9.9",
    "created_at": "2026-01-02T03:04:05Z",
    "params": {"check": "header"},
}


def _canonical(obj: dict) -> bytes:
    """The canonical bytes of a manifest object, as the writer always produced them."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


@pytest.mark.parametrize("blob", [GOLDEN_META, GOLDEN_META_V1, GOLDEN_META_V3, _canonical(WRITTEN_META)])
def test_golden_manifests_round_trip_byte_for_byte(blob: bytes) -> None:
    meta = fmt.Manifest.from_json(blob, where="x")
    assert meta.to_json() == blob
    assert fmt.encode_meta(meta) == blob  # the wrapper, given the object
    assert dict(meta) == json.loads(blob)  # the read-only mapping view: the JSON object
    meta.validate(where="x")


def test_the_attributes_are_the_fields() -> None:
    meta = fmt.Manifest.from_json(GOLDEN_META, where="x")
    assert (meta.format, meta.format_version, meta.count, meta.store) == ("lmdbfolder", 2, 2, "encoded")
    assert meta.classes == ["cat", "ñ"] and meta.class_to_idx == {"cat": 0, "ñ": 1}
    assert meta.pack_id == PACK_ID.hex() and meta.binding == PACK_ID and meta.label_map is None
    assert meta.identity(b"\x00" * 32) == PACK_ID.hex() and meta.version_pack_id == PACK_ID.hex()
    assert not meta.extra and meta.invalid_fields == []
    v3 = fmt.Manifest.from_json(GOLDEN_META_V3, where="x")
    assert (v3.next_record, v3.record_classes, v3.label_map, v3.ordered) == (9, ["cat", "dog", "ant"], [1, -2, 0], True)
    assert v3.binding == PACK_ID and v3.pack_id == "f" * 32  # bound to binding_id, not pack_id
    v1 = fmt.Manifest.from_json(GOLDEN_META_V1, where="x")
    assert v1.binding is None and v1.version_pack_id is None and v1.identity(b"\x01" * 32) == "sha256:" + "01" * 32


def test_unknown_and_mistyped_fields_are_kept_as_they_are() -> None:
    # A newer writer's fields, and informational fields of another type: a reader
    # must neither fail on them nor lose them when the manifest is written back.
    obj = dict(WRITTEN_META, future={"a": [1, None]}, payload_bytes="lots", created_at=[], source=7, skipped_count=True)
    blob = _canonical(obj)
    meta = fmt.Manifest.from_json(blob, where="x")
    assert meta.to_json() == blob
    assert meta.extra == {"future": {"a": [1, None]}, "payload_bytes": "lots", "created_at": [], "source": 7,
                          "skipped_count": True}  # fmt: skip
    assert (meta.payload_bytes, meta.created_at, meta.source, meta.skipped_count) == (None, None, None, None)
    assert meta.invalid_fields == ["created_at", "payload_bytes", "skipped_count", "source"]
    assert meta.invalid_fields == fmt.invalid_fields(json.loads(blob))  # the wrapper over the dict agrees
    shown = meta.shown
    assert (shown.payload_bytes, shown.created_at, shown.source) == (fmt.INVALID,) * 3
    assert shown.encodings == {"jpeg": 1, "png": 1} and shown.updated_at is None  # absent: None
    assert meta.as_stored("payload_bytes") == "lots" and meta.as_stored("updated_at") is None


@pytest.mark.parametrize(
    "change, error, message",
    [
        ({"count": -1}, NotAPackError, "count=-1"),
        ({"classes": "cat"}, NotAPackError, "classes is not a list of strings"),
        ({"class_to_idx": {"cat": 1, "ñ": 0}}, NotAPackError, "contradict each other"),
        ({"store": "pickle"}, NotAPackError, "store='pickle'"),
        ({"pack_id": "zz"}, NotAPackError, "pack_id='zz'"),
        ({"format": "other"}, NotAPackError, "format='lmdbfolder'"),
        ({"format_version": 7}, FormatVersionError, "7"),
        ({"format_version": 3}, NotAPackError, "binding_id=None"),
    ],
)
def test_validate_refuses_what_from_json_refuses(change: dict, error: type, message: str) -> None:
    # One copy of the rules: a manifest built in code is checked as one read from a pack.
    obj = dict(META, **change)
    with pytest.raises(error, match=message):
        fmt.Manifest.from_json(_canonical(obj), where="/some/pack")
    good = fmt.Manifest.from_json(GOLDEN_META, where="x")
    typed = {k: v for k, v in change.items() if k in {f.name for f in dataclasses.fields(fmt.Manifest)}}
    built = dataclasses.replace(good, **typed).with_extra({k: v for k, v in change.items() if k not in typed})
    with pytest.raises(error, match=message):
        built.validate(where="/some/pack")


def test_the_manifest_is_frozen_and_read_only() -> None:
    meta = fmt.Manifest.from_json(GOLDEN_META, where="x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.count = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        meta["count"] = 3  # type: ignore[index]
    assert meta == META and meta["count"] == 2 and meta.get("missing", 5) == 5 and "pack_id" in meta


def test_new_pack_writes_the_bytes_the_writer_wrote() -> None:
    # The dict the writer built before (write/loop.py), field for field.
    fields = {k: v for k, v in WRITTEN_META.items() if k not in ("format", "format_version", "checksum")}
    made = fmt.Manifest.new_pack(**fields, extra={"shard": {"index": 0, "num_shards": 2}, "mine": 1})
    assert made.to_json() == _canonical(dict(WRITTEN_META, shard={"index": 0, "num_shards": 2}, mine=1))
    assert made.shard_place == (0, 2) and made.extra == {"mine": 1}
    made.validate(where="x")
    with pytest.raises(ValueError, match=r"must not replace the manifest fields \['count'\]"):
        fmt.Manifest.new_pack(**fields, extra={"count": 3})


def test_updated_writes_the_bytes_the_update_wrote() -> None:
    # payload_bytes of the wrong type in the old version: the update's value replaces it.
    old = fmt.Manifest.from_json(_canonical(dict(WRITTEN_META, future=1, payload_bytes="lots")), where="x")
    assert old.extra == {"future": 1, "payload_bytes": "lots"}
    new = old.updated(
        count=3,
        classes=["ant", "cat"],
        class_to_idx={"ant": 0, "cat": 1},
        pack_id="f" * 32,
        next_record=5,
        record_classes=["cat", "ñ", "ant"],
        encodings={"jpeg": 3},
        payload_bytes=99,
        skipped_count=1,
        source={"layout": "flat"},
        fingerprint={"sources": 4},
        params={"check": "none"},
        updated_at="2026-02-03T04:05:06Z",
        extra={"mine": 2},
    )
    # What write/update.py built: the old manifest, these fields set, binding_id the old pack_id.
    expected = dict(
        WRITTEN_META,
        future=1,
        mine=2,
        format_version=fmt.UPDATED_FORMAT_VERSION,
        count=3,
        classes=["ant", "cat"],
        class_to_idx={"ant": 0, "cat": 1},
        pack_id="f" * 32,
        binding_id=PACK_ID.hex(),
        next_record=5,
        record_classes=["cat", "ñ", "ant"],
        encodings={"jpeg": 3},
        payload_bytes=99,
        skipped_count=1,
        source={"layout": "flat"},
        fingerprint={"sources": 4},
        params={"check": "none"},
        updated_at="2026-02-03T04:05:06Z",
    )
    assert new.to_json() == _canonical(expected)
    new.validate(where="x")
    assert new.binding == PACK_ID and new.label_map == [1, -2, 0]
    again = new.described(source={"layout": "list"}, fingerprint={}, params={}, extra={"mine": 3})
    assert json.loads(again.to_json()) == dict(expected, source={"layout": "list"}, fingerprint={}, params={}, mine=3)
    assert again.differs_from({"mine": 3}) is False and again.differs_from({"mine": 4}) is True


def test_an_absent_schema_is_one_image_and_its_label() -> None:
    # The place of issue 35's sample schema: absent in every pack of today (no byte changes).
    meta = fmt.Manifest.from_json(GOLDEN_META, where="x")
    assert meta.fields is None
    assert [f["name"] for f in meta.sample_fields] == ["image", "label"]
    schema = [{"name": "image", "kind": "image"}, {"name": "mask", "kind": "image", "encoding": "png"}]
    blob = _canonical(dict(META, fields=schema))
    with_fields = fmt.Manifest.from_json(blob, where="x")
    assert with_fields.fields == schema and with_fields.sample_fields == schema and with_fields.to_json() == blob
    twice = _canonical(dict(META, fields=[{"name": "a"}, {"name": "a"}]))  # names must be distinct: kept, not typed
    odd = fmt.Manifest.from_json(twice, where="x")
    assert odd.fields is None and odd.to_json() == twice and odd.invalid_fields == []


_MANIFEST_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 1 << 40) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)


@given(
    st.sampled_from(sorted(WRITTEN_META) + ["fields", "shard", "updated_at", "record_classes", "unknown"]),
    _MANIFEST_JSON,
)
def test_a_changed_manifest_is_refused_or_read_back_as_it_is(key: str, value: object) -> None:
    blob = _canonical(dict(WRITTEN_META, **{key: value}))
    try:
        meta = fmt.Manifest.from_json(blob, where="x")
    except (NotAPackError, FormatVersionError):
        return
    assert meta.to_json() == blob and dict(meta) == json.loads(blob)
    meta.validate(where="x")


def test_the_index_and_its_entries_as_objects() -> None:
    index = fmt.ShardIndex.from_json(GOLDEN_INDEX, where="index.json")
    assert index.to_json() == GOLDEN_INDEX and index == json.loads(GOLDEN_INDEX)  # a mapping of its JSON object
    assert index.names == ["train-00000-of-00002.lmdb", "train-00001-of-00002.lmdb"]
    assert (index.format, index.index_version) == ("lmdbfolder-shards", 1)
    first = index.shards[0]
    assert first["name"] == first.name and first["bytes"] == first.data_bytes
    changed = first.replaced(data_bytes=1, class_counts=((0, 4), (1, 2)))
    assert changed.to_dict() == dict(json.loads(GOLDEN_INDEX)["shards"][0], bytes=1, class_counts=[[0, 4], [1, 2]])
    rewritten = index.with_shards([changed, index.shards[1]])
    assert fmt.ShardIndex.from_json(rewritten.to_json(), where="index.json").shards[0] == changed
    # A mistyped value kept in ``extra`` is replaced, not written twice.
    odd = dataclasses.replace(first, data_bytes=None, extra={"bytes": "x"})
    assert odd.replaced(data_bytes=5).to_dict()["bytes"] == 5
    mistyped = GOLDEN_INDEX.replace(b'"created_by": "lmdbfolder 0.1.0"', b'"created_by": 7')
    shown = fmt.ShardIndex.from_json(mistyped, where="index.json").shown
    assert shown.encodings == {"jpeg": 12} and shown.created_by == fmt.INVALID and shown.updated_at is None


def test_golden_keys_sort_numerically() -> None:
    assert fmt.encode_key(258) == bytes.fromhex("0000000000000102")
    keys = [fmt.encode_key(i) for i in (0, 1, 255, 256, 65535, 1 << 40)]
    assert keys == sorted(keys)
    # Reserved keys sort after every record key.
    assert all(k < fmt.META_KEY and k < fmt.LABELS_KEY and k < fmt.PATHS_KEY for k in keys)
    assert fmt.decode_key(fmt.encode_key(12345)) == 12345
    with pytest.raises(ValueError):
        fmt.decode_key(fmt.META_KEY)
    with pytest.raises(ValueError):
        fmt.encode_key(-1)


def test_golden_labels_and_paths() -> None:
    assert fmt.encode_labels([0, 1, -1]) == bytes.fromhex("00000000 01000000 ffffffff")
    assert list(fmt.decode_labels(fmt.encode_labels([0, 1, -1]), 3, where="x")) == [0, 1, -1]
    blob = fmt.encode_paths(["a/x.jpg", "ñ.png"])
    assert blob == struct.pack("<3Q", 0, 7, 13) + b"a/x.jpg" + "ñ.png".encode()
    assert fmt.decode_paths(blob, 2, where="x") == ["a/x.jpg", "ñ.png"]
    assert fmt.path_at(blob, 2, 1) == "ñ.png"


def test_paths_keep_undecodable_file_names() -> None:
    name = os.fsdecode(b"bad\xff\xfename.jpg")  # not UTF-8: a lone surrogate in Python
    blob = fmt.encode_paths([name])
    assert fmt.decode_paths(blob, 1, where="x") == [name]
    assert b"bad\xff\xfename.jpg" in blob
    # and the manifest (class names) keeps them too, through ASCII escapes
    meta = dict(META, classes=[name], class_to_idx={name: 0})
    assert fmt.decode_meta(fmt.encode_meta(meta), where="x")["classes"] == [name]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b[:10], "shorter than the 32-byte header"),
        (lambda b: b"XX" + b[2:], "bad record magic"),
        (lambda b: b[:2] + b"\x02" + b[3:], "record header version 2"),
        (lambda b: b[:3] + b"\x63" + b[4:], "unknown encoding id 99"),
        (lambda b: b[:5] + b"\x01" + b[6:], "reserved header bits"),
        (lambda b: b + b"d", "payload is 4 bytes but the header says 3"),
        (lambda b: b[:-1] + b"x", "CRC-32"),
        (lambda b: b[:8] + b"\x09" + b[9:], "CRC-32"),  # the width: headers are covered too
        (lambda b: b[:3] + b"\x02" + b[4:], "CRC-32"),  # another valid encoding id
        (lambda b: b[:24] + b"\x08" + b[25:], "CRC-32"),  # the label
    ],
)
def test_decode_record_rejects(mutate, message) -> None:
    bad = mutate(GOLDEN_RECORD)
    with pytest.raises(CorruptRecordError, match=message) as info:
        fmt.decode_record(bad, index=5, verify=True)
    assert "record 5" in str(info.value)
    assert "lmdbfolder verify" in str(info.value)  # the hint


def test_crc_is_only_checked_when_asked() -> None:
    bad = GOLDEN_RECORD[:-1] + b"x"
    header, payload = fmt.decode_record(bad)
    assert bytes(payload) == b"abx"


@pytest.mark.parametrize(
    "blob, error, message",
    [
        (None, NotAPackError, "no lmdbfolder manifest"),
        (b"[1, 2]", NotAPackError, "not a JSON object"),
        (b"{not json", NotAPackError, "not valid JSON"),
        (b'{"format": "other"}', NotAPackError, "format='lmdbfolder'"),
        (GOLDEN_META.replace(b'"format_version":2', b'"format_version":5'), FormatVersionError, "format version 5"),
        (GOLDEN_META.replace(b'"format_version":2', b'"format_version":true'), FormatVersionError, "version True"),
        (GOLDEN_META.replace(b'"count":2', b'"count":-1'), NotAPackError, "count=-1"),
        (GOLDEN_META.replace(b'"store":"encoded"', b'"store":"pickle"'), NotAPackError, "store='pickle'"),
        (GOLDEN_META.replace(b'"cat":0', b'"cat":1'), NotAPackError, "contradict each other"),
        (GOLDEN_META.replace(b'"cat":0,', b""), NotAPackError, "contradict each other"),
        (GOLDEN_META.replace(b'"pack_id":"00', b'"pack_id":"zz'), NotAPackError, "pack_id"),
        (b'{"a":' * 100 + b"1" + b"}" * 100, NotAPackError, "nested more than 16 levels"),
        (b'{"a":"' + b"x" * (fmt.MAX_MANIFEST_BYTES) + b'"}', NotAPackError, "more than the 16,777,216 allowed"),
    ],
)
def test_decode_meta_rejects(blob, error, message) -> None:
    with pytest.raises(error, match=message):
        fmt.decode_meta(blob, where="/some/pack")


def test_newer_version_says_upgrade() -> None:
    with pytest.raises(FormatVersionError) as info:
        fmt.decode_meta(GOLDEN_META.replace(b'"format_version":2', b'"format_version":7'), where="p")
    assert "upgrade" in info.value.hint


def test_bad_label_and_shape_arguments() -> None:
    with pytest.raises(ValueError, match="32-bit"):
        fmt.encode_record(b"", label=1 << 31, encoding="png")
    with pytest.raises(ValueError, match="unknown encoding"):
        fmt.encode_record(b"", label=0, encoding="heic")


@given(
    payload=st.binary(max_size=300),
    label=st.integers(-(1 << 31), (1 << 31) - 1),
    encoding=st.sampled_from(sorted(set(fmt.ENCODING_IDS) - {"raw"})),
    width=st.integers(0, (1 << 32) - 1),
    height=st.integers(0, (1 << 32) - 1),
    channels=st.integers(0, 255),
)
def test_record_round_trip(payload, label, encoding, width, height, channels) -> None:
    value = fmt.encode_record(payload, label=label, encoding=encoding, width=width, height=height, channels=channels)
    header, view = fmt.decode_record(value, verify=True)
    assert (header.label, header.encoding, header.width, header.height, header.channels) == (
        label,
        encoding,
        width,
        height,
        channels,
    )
    assert bytes(view) == payload


@given(
    width=st.integers(0, 40),
    height=st.integers(0, 40),
    extra=st.integers(-3, 3),
    index=st.integers(0, fmt.MAX_INDEX),
)
def test_raw_records_must_hold_width_x_height_x_3_bytes(width, height, extra, index) -> None:
    n = max(0, width * height * 3 + extra)
    value = fmt.encode_record(
        bytes(n), label=0, encoding="raw", width=width, height=height, channels=3, binding=PACK_ID, index=index
    )
    if n == width * height * 3:
        assert fmt.decode_record(value, index=index, verify=True, binding=PACK_ID)[0].payload_len == n
    else:
        with pytest.raises(CorruptRecordError, match="raw pixels"):
            fmt.decode_record(value, index=index, verify=False)


def test_labels_and_paths_are_checked() -> None:
    labels = fmt.decode_labels(fmt.encode_labels([0, 2, -1]), 3, where="x")
    fmt.check_labels(labels, 3, where="x")
    with pytest.raises(NotAPackError, match="sample 1 the label 2"):
        fmt.check_labels(labels, 2, where="x")
    with pytest.raises(NotAPackError, match="label -2"):
        fmt.check_labels(fmt.decode_labels(fmt.encode_labels([-2]), 1, where="x"), 1, where="x")
    blob = bytearray(fmt.encode_paths(["a", "bc"]))
    fmt.check_paths(blob, 2, where="x")
    blob[8] = 9  # offset 1 beyond offset 2
    with pytest.raises(NotAPackError, match="inconsistent offsets"):
        fmt.check_paths(blob, 2, where="x")
    with pytest.raises(NotAPackError, match="too short"):
        fmt.check_paths(b"\0" * 8, 5, where="x")


def test_informational_fields() -> None:
    meta = {"encodings": {"jpeg": 3}, "payload_bytes": "lots", "source": 7, "somethingnew": [1]}
    assert fmt.informational(meta, "encodings") == {"jpeg": 3}
    assert fmt.informational(meta, "payload_bytes") == fmt.INVALID == fmt.informational(meta, "source")
    assert fmt.informational(meta, "created_at", "-") == "-" and fmt.informational(meta, "somethingnew") == [1]


def test_json_bounds_before_parsing() -> None:
    assert fmt.loads_json(b'{"a":"[[[[[[[[[[[[[[[[[[[[[[[\\"[["}', where="x", what="v", max_bytes=100) == {
        "a": '[[[[[[[[[[[[[[[[[[[[[[["[['
    }  # brackets inside strings do not count
    with pytest.raises(NotAPackError, match="more than 3 arrays and objects"):
        fmt.loads_json(b"[[],[],[]]", where="x", what="v", max_bytes=100, max_containers=3)
    with pytest.raises(NotAPackError, match="not valid JSON"):
        fmt.loads_json(b"\xff", where="x", what="v", max_bytes=100)


@given(
    st.lists(st.text(alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",))), max_size=20)
)
def test_paths_round_trip(paths) -> None:
    blob = fmt.encode_paths(paths)
    assert fmt.decode_paths(blob, len(paths), where="x") == paths
    for i, p in enumerate(paths):
        assert fmt.path_at(blob, len(paths), i) == p


def test_format_md_matches_constants() -> None:
    """FORMAT.md quotes the struct strings and keys; keep it in step with the format package."""
    with open(os.path.join(os.path.dirname(__file__), "..", "FORMAT.md"), encoding="utf-8") as f:
        doc = f.read()
    assert fmt.RECORD_HEADER.format in doc
    assert fmt.KEY.format in doc
    for key in fmt.TABLE_KEYS + (fmt.CHECK_KEY,):
        assert key.decode() in doc
    for enc_id, name in fmt.ENCODINGS.items():
        assert f"| {enc_id} | `{name}` |" in doc
    flat = doc.replace(" ", "").replace("\n", "")
    assert GOLDEN_RECORD.hex() in flat and GOLDEN_BOUND_RECORD.hex() in flat
    assert GOLDEN_CHECK.decode() in doc and f"version {fmt.FORMAT_VERSION}" in doc
    assert f"version {fmt.UPDATED_FORMAT_VERSION}" in doc and GOLDEN_META_V3.decode() in flat.replace("\\", "\\")
    for golden in (GOLDEN_ORDER, GOLDEN_STATS, GOLDEN_V3_RECORD):
        assert golden.hex() in flat
    assert GOLDEN_HISTORY.decode() in doc


@given(st.text(alphabet='[]{}"\\ab,:', max_size=60))
def test_json_scan_shortcut_agrees_with_the_full_scan(text: str) -> None:
    # Few brackets anywhere means neither bound can be passed: the shortcut may
    # skip the regular expressions, never change the answer.
    raw = text.encode()
    brackets = fmt._JSON_BRACKETS.sub(b"", fmt._JSON_STRINGS.sub(b'""', raw))
    depth = deepest = 0
    for c in brackets:
        depth += 1 if c in b"[{" else -1
        deepest = max(deepest, depth)
    for max_depth, max_containers in ((2, 3), (4, 2), (16, 1 << 20)):
        full = len(brackets) > 2 * max_containers or deepest > max_depth
        assert (fmt._scan_json(raw, "v", max_depth, max_containers) is not None) == full


def test_an_ordinary_manifest_is_not_scanned_by_regular_expression(monkeypatch: pytest.MonkeyPatch) -> None:
    class Refuse:
        def sub(self, *args: object) -> bytes:
            raise AssertionError("scanned")

    meta = {"classes": [f"c[{i}" for i in range(5)], "class_to_idx": {f"c[{i}": i for i in range(5)}, "x": {"y": [1]}}
    raw = fmt.encode_meta(meta)
    monkeypatch.setattr(fmt.manifest, "_JSON_STRINGS", Refuse())
    assert fmt.loads_json(raw, where="x", what="m", max_bytes=1 << 20) == meta
    with pytest.raises(AssertionError, match="scanned"):  # many brackets: the full scan runs
        fmt.loads_json(b"[" * 17 + b"]" * 17, where="x", what="m", max_bytes=100)


def test_format_md_lists_every_table_object() -> None:
    """FORMAT.md's "Tables" section is written from the table objects: one row each."""
    with open(os.path.join(os.path.dirname(__file__), "..", "FORMAT.md"), encoding="utf-8") as f:
        doc = f.read()
    for name in ("CHECKS", "LABELS", "PATHS", "ORDER", "STATS", "HISTORY", "SKIPPED"):
        table = getattr(fmt, name)
        assert f"| `{table.key.decode()}` | `{name}` |" in doc, name
    assert "| `record_classes` (manifest, v3) | `RECORD_CLASSES` |" in doc


def test_new_tables_encode_the_bytes_of_each_table_and_check_last() -> None:
    labels, paths = fmt.encode_labels([0, 1]), fmt.encode_paths(["a/x.jpg", "b/y.png"])
    tables = fmt.NewTables(b'{"m":1}', labels, paths, [], [], order=[8, 0], stats=([3, 4096], [1, -1])).encode()
    assert list(tables)[-1] == fmt.CHECK_KEY
    assert tables[fmt.ORDER_KEY] == GOLDEN_ORDER and tables[fmt.SKIPPED_KEY] == b"[]"
    check = fmt.decode_check(tables[fmt.CHECK_KEY], where="x")
    for key, blob in tables.items():
        if key != fmt.CHECK_KEY:
            fmt.check_table(check, key, blob, where="x")
    assert fmt.ORDER_KEY not in fmt.NewTables(b"{}", labels, paths, [], []).encode()


def test_the_order_rules() -> None:
    keys = np.array([8, 0, 3], dtype="<u8")
    fmt.ORDER.check(keys, 9, where="x", exhaustive=True)
    with pytest.raises(fmt.TableDamage, match="not below next_record=8") as caught:
        fmt.ORDER.check(keys, 8, where="x")
    assert caught.value.kind == "table" and isinstance(caught.value, NotAPackError)
    twice = np.array([8, 0, 8], dtype="<u8")
    fmt.ORDER.check(twice, 9, where="x")  # a reader's open does not sort
    with pytest.raises(fmt.TableDamage, match=r"names 1 record key\(s\) twice") as caught:
        fmt.ORDER.check(twice, 9, where="x", exhaustive=True)
    assert caught.value.kind == "order"


def test_the_record_classes_rules() -> None:
    meta = {"format_version": 3, "classes": ["ant", "cat"], "class_to_idx": {"ant": 0, "cat": 1}}
    fmt.RECORD_CLASSES.check({**meta, "record_classes": ["cat", "dog", "ant"]}, where="x")
    with pytest.raises(fmt.TableDamage, match="lack the class 'ant'"):
        fmt.RECORD_CLASSES.check({**meta, "record_classes": ["cat", "dog"]}, where="x")
    mapping = fmt.label_map({**meta, "record_classes": ["cat", "dog", "ant"]})
    assert mapping == [1, -2, 0] and fmt.RECORD_CLASSES.sample_label(1, mapping) is None
    fmt.RECORD_CLASSES.check_records([0, 2, -1], [1, 0, -1], mapping, where="x")
    with pytest.raises(fmt.TableDamage, match="sample 0 is labelled 0") as caught:
        fmt.RECORD_CLASSES.check_records([2, 0], [1, 0], mapping, where="x")  # names permuted
    assert caught.value.kind == "label"


def test_a_recorded_source_is_read_by_one_set_of_rules() -> None:
    # The manifest's `source`: what update, verify, export and the dataset read back. One
    # SourceRecord says what a valid one is (verify and the update had a copy each).
    from lmdbfolder.format import SourceRecord

    assert SourceRecord.of(None) is None and SourceRecord.of("invalid") is None
    assert not SourceRecord.of({}).recorded  # a pack made before the layout was recorded
    good = SourceRecord.of({"layout": "imagefolder", "root": "/d", "list_file": None, "extensions": [".jpg"]})
    assert good is not None and good.problem is None and good.extensions == (".jpg",) and good.root == "/d"
    for forged, what in [
        ({"layout": "tree"}, "layout"),
        ({"layout": "flat", "extensions": [".jpg"] * 1001}, "extensions"),
        ({"layout": "flat", "extensions": ["x" * 101]}, "extensions"),
        ({"layout": "flat", "match": "a" * 4097}, "match"),
        ({"layout": "flat", "is_valid_file": 3}, "is_valid_file"),
        ({"layout": "list", "list_file": ["x"]}, "list_file"),
    ]:
        record = SourceRecord.of(forged)
        assert record is not None and record.recorded and what in (record.problem or ""), forged
    assert SourceRecord.of({"layout": "flat", "root": 7}).root is None  # not of its type: not used


def test_a_shards_place_is_checked_member_by_member() -> None:
    from lmdbfolder.format import ShardPlace

    place = {"split": "s", "prefix": "train", "index": 1, "num_shards": 2, "first_source": 3, "sources": 3}
    place |= {"total_sources": 6, "sources_sha256": "ab"}
    assert ShardPlace.of(place).problem is None and ShardPlace.of(place).first_source == 3
    assert ShardPlace.of({**place, "index": True}).problem == "shard.index=True is not a non-negative integer"
    assert ShardPlace.of({**place, "prefix": 5}).problem == "shard.prefix=5 is not a string"
    assert ShardPlace.of([1]).problem == "the `shard` field is not an object ([1])"

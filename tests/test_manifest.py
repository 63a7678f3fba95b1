"""``format.Manifest`` and the shard index as objects: byte-exact round trips, the
one ``validate``, and the writer's constructors (issue 33)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmdbfolder import format as fmt
from lmdbfolder.errors import FormatVersionError, NotAPackError
from test_format import GOLDEN_INDEX, GOLDEN_META, GOLDEN_META_V1, GOLDEN_META_V3, META, PACK_ID

#: A manifest as `pack` writes it (format 2), with every informational field.
WRITTEN = {
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


def encode(obj: dict) -> bytes:
    """The canonical bytes of a manifest object, as the writer always produced them."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


@pytest.mark.parametrize("blob", [GOLDEN_META, GOLDEN_META_V1, GOLDEN_META_V3, encode(WRITTEN)])
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
    obj = dict(WRITTEN, future={"a": [1, None]}, payload_bytes="lots", created_at=[], source=7, skipped_count=True)
    blob = encode(obj)
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
        fmt.Manifest.from_json(encode(obj), where="/some/pack")
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
    fields = {k: v for k, v in WRITTEN.items() if k not in ("format", "format_version", "checksum")}
    made = fmt.Manifest.new_pack(**fields, extra={"shard": {"index": 0, "num_shards": 2}, "mine": 1})
    assert made.to_json() == encode(dict(WRITTEN, shard={"index": 0, "num_shards": 2}, mine=1))
    assert made.shard_place == (0, 2) and made.extra == {"mine": 1}
    made.validate(where="x")
    with pytest.raises(ValueError, match=r"must not replace the manifest fields \['count'\]"):
        fmt.Manifest.new_pack(**fields, extra={"count": 3})


def test_updated_writes_the_bytes_the_update_wrote() -> None:
    # payload_bytes of the wrong type in the old version: the update's value replaces it.
    old = fmt.Manifest.from_json(encode(dict(WRITTEN, future=1, payload_bytes="lots")), where="x")
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
        WRITTEN,
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
    assert new.to_json() == encode(expected)
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
    blob = encode(dict(META, fields=schema))
    with_fields = fmt.Manifest.from_json(blob, where="x")
    assert with_fields.fields == schema and with_fields.sample_fields == schema and with_fields.to_json() == blob
    twice = encode(dict(META, fields=[{"name": "a"}, {"name": "a"}]))  # names must be distinct: kept, not typed
    odd = fmt.Manifest.from_json(twice, where="x")
    assert odd.fields is None and odd.to_json() == twice and odd.invalid_fields == []


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 1 << 40) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)


@given(st.sampled_from(sorted(WRITTEN) + ["fields", "shard", "updated_at", "record_classes", "unknown"]), _JSON)
def test_a_changed_manifest_is_refused_or_read_back_as_it_is(key: str, value: object) -> None:
    blob = encode(dict(WRITTEN, **{key: value}))
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

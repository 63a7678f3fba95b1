"""The on-disk format of an lmdbfolder pack: the single source of truth.

Every constant, key and ``struct`` layout described in ``FORMAT.md`` lives here
and nowhere else. The writer and the reader share only this module (and
``errors``), so a layout change is a change to this file, pinned by the
golden-bytes tests in ``tests/test_format.py``.

This module needs only the standard library (zlib-ng, when installed,
computes the same CRC-32 about ten times faster) and never unpickles anything.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import re
import struct
import sys
import zlib
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from lmdbfolder.errors import CorruptRecordError, FormatVersionError, NotAPackError

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "RECORD_VERSION",
    "RECORD_MAGIC",
    "RECORD_HEADER",
    "KEY",
    "MAX_INDEX",
    "META_KEY",
    "LABELS_KEY",
    "PATHS_KEY",
    "PROGRESS_KEY",
    "RESERVED_PREFIX",
    "ENCODINGS",
    "ENCODING_IDS",
    "NO_LABEL",
    "DATA_FILE",
    "LOCK_FILE",
    "PARTIAL_SUFFIX",
    "SKIPPED_REPORT",
    "COPYING_SUFFIX",
    "OLD_SUFFIX",
    "TEMP_MARKER",
    "SYNC_PROBE",
    "COMPACT_DIR",
    "LEGACY_KEYS",
    "LEGACY_META_FILES",
    "RecordHeader",
    "encode_key",
    "decode_key",
    "checksum",
    "CRC32_IMPLEMENTATION",
    "encode_record",
    "encode_header_into",
    "decode_record",
    "encode_meta",
    "decode_meta",
    "encode_progress",
    "decode_progress",
    "encode_labels",
    "decode_labels",
    "encode_paths",
    "labels_table",
    "paths_table",
    "path_at",
    "decode_paths",
    "SHARD_INDEX_FILE",
    "SHARD_INDEX_TMP",
    "SHARD_INDEX_FORMAT",
    "SHARD_INDEX_VERSION",
    "SHARD_FIELD",
    "shard_name",
    "parse_shard_name",
    "tables_digest",
    "shard_identity",
    "shard_matches",
    "encode_shard_index",
    "decode_shard_index",
]

FORMAT_NAME = "lmdbfolder"
#: Version of the pack as a whole (metadata keys and their meaning). A reader
#: refuses any other value; see "Version rules" in FORMAT.md.
FORMAT_VERSION = 1
#: Version of the per-record header layout below.
RECORD_VERSION = 1
RECORD_MAGIC = b"LF"

#: Record header, little-endian, 32 bytes, naturally aligned:
#: magic, record version, encoding id, channels, flags, reserved,
#: width, height, payload length, label, crc32. The CRC-32 covers the 28
#: header bytes before it and then the payload, so no bit of a record can
#: change unnoticed.
RECORD_HEADER = struct.Struct("<2sBBBBHIIQiI")
_CRC_OFFSET = 28

#: Sample keys: the index as 8 bytes big-endian, so byte order == numeric order
#: and the writer can append.
KEY = struct.Struct(">Q")
#: Record keys start with a 0x00 byte, reserved keys with "__" (0x5f).
MAX_INDEX = (1 << 56) - 1
RESERVED_PREFIX = b"__"
META_KEY = b"__meta__"
LABELS_KEY = b"__labels__"
PATHS_KEY = b"__paths__"
#: Only in unfinished packs: how far the writer got (JSON), committed in the
#: same transaction as the batch it describes. Deleted when the pack finishes.
PROGRESS_KEY = b"__progress__"

#: Encoding ids stored in the record header. ``raw`` means uint8 pixels,
#: row-major height x width x channels (always RGB, 3 channels, in version 1).
#: ``other`` is an encoded image whose format was not recognised by the
#: writer's sniffer; readers hand it to Pillow like any other encoded image.
ENCODINGS: dict[int, str] = {
    0: "raw",
    1: "jpeg",
    2: "png",
    3: "webp",
    4: "bmp",
    5: "tiff",
    6: "pnm",
    7: "gif",
    255: "other",
}
ENCODING_IDS: dict[str, int] = {name: i for i, name in ENCODINGS.items()}

#: Label of a sample that has none (flat folders).
NO_LABEL = -1

# -- names on disk ------------------------------------------------------------------
# Every file and directory name a pack, or work on one, puts on disk. Only
# ``lmdbfolder.packdir`` decides what they mean for a path (what kind of pack
# it is, whether it may be replaced); everything else asks it.
DATA_FILE = "data.mdb"
LOCK_FILE = "lock.mdb"
#: The readable report of the source files that were not packed (in the pack).
SKIPPED_REPORT = "skipped.txt"
#: An unfinished pack is built in ``<dst>.partial`` and renamed when complete.
PARTIAL_SUFFIX = ".partial"
#: ``lmdbfolder copy`` builds the copy in ``<dst>.copying``.
COPYING_SUFFIX = ".copying"
#: A pack being replaced is moved to ``<dst>.old-<pid>`` until the new one is in place.
OLD_SUFFIX = ".old-"
#: Written first into every temporary directory we create (``.copying``), so
#: that a later run can prove the directory is ours before removing it.
TEMP_MARKER = ".lmdbfolder-temp"
#: Left in an unfinished pack by a run killed at the wrong moment: the writer's
#: fdatasync probe file and its compaction folder.
SYNC_PROBE = ".sync-probe"
COMPACT_DIR = "compact.tmp"
#: Keys by which the folder2lmdb recipes' LMDBs are recognised (pickled
#: samples; ``lmdbfolder import`` converts them), and the files beside
#: ``data.mdb`` that mark a BasicSR-style image LMDB.
LEGACY_KEYS = (b"__keys__", b"__len__")
LEGACY_META_FILES = ("meta_info.txt", "meta_info.pkl")

_LABEL = struct.Struct("<i")
_OFFSET = struct.Struct("<Q")


@dataclass(frozen=True)
class RecordHeader:
    """The fixed header in front of every record's payload."""

    encoding: str
    channels: int
    width: int
    height: int
    label: int
    crc32: int
    payload_len: int


def encode_key(index: int) -> bytes:
    """Return the LMDB key of sample ``index`` (8 bytes, big-endian)."""
    if not 0 <= index <= MAX_INDEX:
        raise ValueError(f"sample index must be in 0..{MAX_INDEX}, got {index}")
    return KEY.pack(index)


def decode_key(key: bytes | memoryview) -> int:
    """Return the sample index of a record key; ValueError for a reserved key."""
    if len(key) != KEY.size or bytes(key[:1]) != b"\x00":
        raise ValueError(f"not a record key: {bytes(key)!r}")
    return KEY.unpack(key)[0]


def _crc32_implementation() -> tuple[Any, str]:
    # zlib-ng computes the same CRC-32 (same polynomial, same values) at about
    # 20 GB/s against zlib's 2.3 GB/s here: 40 us less per 100 KB record, for
    # packing and for verify alike. Optional (the `fast` extra, or `pip install zlib-ng`).
    try:
        from zlib_ng import zlib_ng

        return zlib_ng.crc32, "zlib-ng"
    except ImportError:
        return zlib.crc32, "zlib"


_crc32, CRC32_IMPLEMENTATION = _crc32_implementation()


def checksum(payload: bytes | memoryview, start: int = 0) -> int:
    """CRC-32 (zlib's, ISO-HDLC polynomial) of ``payload``, continuing from ``start``.

    Computed by zlib-ng when it is installed (``CRC32_IMPLEMENTATION``), else
    by zlib; the values are the same.
    """
    return int(_crc32(payload, start)) & 0xFFFFFFFF


def _check_header_args(label: int, encoding: str, width: int, height: int, channels: int) -> None:
    if encoding not in ENCODING_IDS:
        raise ValueError(f"unknown encoding {encoding!r}; expected one of {sorted(ENCODING_IDS)}")
    if not -(1 << 31) <= label < (1 << 31):
        raise ValueError(f"label {label} does not fit in a signed 32-bit integer")
    if not (0 <= width < 1 << 32 and 0 <= height < 1 << 32 and 0 <= channels < 256):
        raise ValueError(f"bad image shape {width}x{height}x{channels}")


def _pack_header(
    buf: bytearray | memoryview,
    payload: bytes | memoryview,
    label: int,
    encoding: str,
    width: int,
    height: int,
    channels: int,
) -> None:
    """Write the header into ``buf[:32]``, CRC last (it covers the header and the payload)."""
    _check_header_args(label, encoding, width, height, channels)
    RECORD_HEADER.pack_into(
        buf,
        0,
        RECORD_MAGIC,
        RECORD_VERSION,
        ENCODING_IDS[encoding],
        channels,
        0,
        0,
        width,
        height,
        len(payload),
        label,
        0,
    )
    crc = checksum(payload, checksum(memoryview(buf)[:_CRC_OFFSET]))
    struct.pack_into("<I", buf, _CRC_OFFSET, crc)


def encode_record(
    payload: bytes | memoryview,
    *,
    label: int,
    encoding: str,
    width: int = 0,
    height: int = 0,
    channels: int = 0,
) -> bytes:
    """Return header + payload for one sample.

    ``width``, ``height`` and ``channels`` are 0 when unknown. The payload is
    copied once, because an LMDB value must be one contiguous buffer; see
    ``encode_header_into`` to avoid that copy.
    """
    header = bytearray(RECORD_HEADER.size)
    _pack_header(header, payload, label, encoding, width, height, channels)
    return b"".join((header, payload))


def encode_header_into(
    value: bytearray | memoryview,
    *,
    label: int,
    encoding: str,
    width: int = 0,
    height: int = 0,
    channels: int = 0,
) -> bytearray | memoryview:
    """Fill in the header of a record whose payload is already at ``value[32:]``.

    The writer reads each file straight into such a buffer, so the payload is
    never copied on its way to LMDB. Returns ``value``.
    """
    payload = memoryview(value)[RECORD_HEADER.size :]
    try:
        _pack_header(value, payload, label, encoding, width, height, channels)
    finally:
        payload.release()
    return value


def decode_record(
    value: bytes | memoryview, *, index: int | None = None, verify: bool = False
) -> tuple[RecordHeader, memoryview]:
    """Split a stored value into its header and a zero-copy payload view.

    Raises CorruptRecordError (naming ``index``) for a value that is too short,
    has the wrong magic, an unknown record version, encoding or flags, a
    length that disagrees with the header, or (with ``verify=True``) a CRC-32
    (over header and payload) that does not match.
    """
    view = value if isinstance(value, memoryview) else memoryview(value)
    if len(view) < RECORD_HEADER.size:
        raise CorruptRecordError(
            index, f"value is {len(view)} bytes, shorter than the {RECORD_HEADER.size}-byte header"
        )
    (magic, version, enc_id, channels, flags, reserved, width, height, length, label, crc) = RECORD_HEADER.unpack_from(
        view
    )
    if magic != RECORD_MAGIC:
        raise CorruptRecordError(index, f"bad record magic {magic!r}, expected {RECORD_MAGIC!r}")
    if version != RECORD_VERSION:
        raise CorruptRecordError(index, f"record header version {version}, this reader understands {RECORD_VERSION}")
    encoding = ENCODINGS.get(enc_id)
    if encoding is None:
        raise CorruptRecordError(index, f"unknown encoding id {enc_id}")
    if flags or reserved:
        raise CorruptRecordError(index, f"reserved header bits set (flags={flags}, reserved={reserved})")
    payload = view[RECORD_HEADER.size :]
    if len(payload) != length:
        raise CorruptRecordError(index, f"payload is {len(payload)} bytes but the header says {length}")
    if verify:
        actual = checksum(payload, checksum(view[:_CRC_OFFSET]))
        if actual != crc:
            raise CorruptRecordError(index, f"record CRC-32 is {actual:08x}, header says {crc:08x}", kind="checksum")
    header = RecordHeader(encoding, channels, width, height, label, crc, length)
    return header, payload


def encode_meta(meta: Mapping[str, Any]) -> bytes:
    """Serialise the manifest: canonical JSON (sorted keys, ASCII, no spaces).

    ASCII escapes keep class names that are not valid UTF-8 (undecodable file
    names, held as lone surrogates by Python) lossless.
    """
    return json.dumps(meta, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def decode_meta(blob: bytes | memoryview | None, *, where: str) -> dict[str, Any]:
    """Parse and validate the manifest stored under ``META_KEY``.

    ``where`` names the pack in error messages. Raises NotAPackError for a
    missing or malformed manifest and FormatVersionError for a version this
    reader does not understand.
    """
    if blob is None:
        raise NotAPackError(
            where,
            "it is an LMDB but has no lmdbfolder manifest (key __meta__)",
            "an LMDB of the folder2lmdb or BasicSR recipes converts with `lmdbfolder import OLD NEW`; "
            "one made by another tool: pack the source images with `lmdbfolder pack`",
        )
    raw = bytes(blob)
    if not raw.startswith(b"{"):
        raise NotAPackError(where, "its manifest (key __meta__) is not a JSON object")
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NotAPackError(where, f"its manifest (key __meta__) is not valid JSON: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise NotAPackError(where, f"its manifest does not say format={FORMAT_NAME!r}")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise FormatVersionError(where, version, FORMAT_VERSION)
    _check_meta_fields(meta, where)
    return meta


def encode_progress(progress: Mapping[str, Any]) -> bytes:
    """Serialise the writer's checkpoint (same canonical JSON as the manifest)."""
    return encode_meta(progress)


def decode_progress(blob: bytes | memoryview, *, where: str) -> dict[str, Any]:
    """Parse a checkpoint written by encode_progress; NotAPackError if malformed."""
    try:
        progress = json.loads(bytes(blob))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NotAPackError(where, f"its checkpoint (key __progress__) is not valid JSON: {exc}") from None
    if not isinstance(progress, dict) or not isinstance(progress.get("next_source"), int):
        raise NotAPackError(where, "its checkpoint (key __progress__) is malformed")
    return progress


def _check_meta_fields(meta: dict[str, Any], where: str) -> None:
    count = meta.get("count")
    classes = meta.get("classes")
    class_to_idx = meta.get("class_to_idx")
    problems = []
    if not isinstance(count, int) or count < 0:
        problems.append(f"count={count!r} is not a non-negative integer")
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        problems.append("classes is not a list of strings")
    if not isinstance(class_to_idx, dict) or not all(isinstance(v, int) for v in class_to_idx.values()):
        problems.append("class_to_idx is not a mapping of strings to integers")
    if meta.get("store") not in ("encoded", "raw"):
        problems.append(f"store={meta.get('store')!r} is neither 'encoded' nor 'raw'")
    if problems:
        raise NotAPackError(where, "its manifest is invalid: " + "; ".join(problems))


def encode_labels(labels: Sequence[int]) -> bytes:
    """Labels of all samples as consecutive little-endian int32."""
    if isinstance(labels, array.array) and labels.typecode == "i" and labels.itemsize == _LABEL.size:
        return labels_table(labels)
    return struct.pack(f"<{len(labels)}i", *labels)


def labels_table(labels: array.array) -> bytes:
    """``encode_labels`` of an ``array('i')`` (int32) without a Python int per label."""
    if sys.byteorder == "little":
        return labels.tobytes()
    swapped = array.array("i", labels)
    swapped.byteswap()
    return swapped.tobytes()


def decode_labels(blob: bytes | memoryview, count: int, *, where: str) -> array.array:
    """Inverse of encode_labels: a compact ``array('i')`` (4 bytes a sample).

    A compact array rather than a list of ints keeps a million-sample pack's
    labels at 4 MB and out of the way of copy-on-write after fork.
    """
    if len(blob) != count * _LABEL.size:
        raise NotAPackError(where, f"{LABELS_KEY.decode()} holds {len(blob)} bytes, expected {count * _LABEL.size}")
    labels = array.array("i")
    labels.frombytes(blob)  # straight from the (zero-copy) value: no transient bytes copy
    if sys.byteorder != "little":
        labels.byteswap()
    return labels


def encode_paths(paths: Iterable[str]) -> bytes:
    """Relative paths: (count + 1) little-endian u64 offsets, then the names.

    Names are the file system's bytes (``os.fsencode``, UTF-8 on Linux), so
    any file name round-trips, including names that are not valid UTF-8.
    Path ``i`` is ``names[offsets[i]:offsets[i + 1]]``.
    """
    encoded = [os.fsencode(p) for p in paths]
    offsets = [0]
    for name in encoded:
        offsets.append(offsets[-1] + len(name))
    return struct.pack(f"<{len(offsets)}Q", *offsets) + b"".join(encoded)


def paths_table(offsets: Any, names: bytes | memoryview) -> bytearray:
    """``encode_paths`` from parts: ``offsets`` is a buffer of ``count + 1`` native
    uint64 (the first 0, the last ``len(names)``), ``names`` every name's bytes in order.

    Builds the table in one allocation, with no Python object per path.
    """
    offs = memoryview(offsets).cast("B")
    if len(offs) % _OFFSET.size or not len(offs):
        raise ValueError("offsets must hold count + 1 uint64 values")
    out = bytearray(len(offs) + len(names))
    out[: len(offs)] = offs
    if sys.byteorder != "little":
        swapped = array.array("Q")
        swapped.frombytes(offs)
        swapped.byteswap()
        out[: len(offs)] = swapped.tobytes()
    out[len(offs) :] = names
    return out


def path_at(blob: bytes | memoryview, count: int, index: int) -> str:
    """Return relative path ``index`` from an encode_paths blob without parsing the rest."""
    start, end = struct.unpack_from("<2Q", blob, index * _OFFSET.size)
    base = (count + 1) * _OFFSET.size
    return os.fsdecode(bytes(blob[base + start : base + end]))


def decode_paths(blob: bytes | memoryview, count: int, *, where: str) -> list[str]:
    """Inverse of encode_paths, with bounds checks (NotAPackError if malformed)."""
    base = (count + 1) * _OFFSET.size
    if len(blob) < base:
        raise NotAPackError(where, f"{PATHS_KEY.decode()} is too short for {count} samples")
    offsets = struct.unpack_from(f"<{count + 1}Q", blob)
    if offsets[0] != 0 or base + offsets[-1] != len(blob) or any(a > b for a, b in zip(offsets, offsets[1:])):
        raise NotAPackError(where, f"{PATHS_KEY.decode()} has inconsistent offsets")
    names = bytes(blob[base:])
    return [os.fsdecode(names[a:b]) for a, b in zip(offsets, offsets[1:])]


# -- sharded packs ---------------------------------------------------------------
#: A sharded pack is a directory holding ordinary packs (the shards, each a
#: complete pack of a contiguous part of the sample list) and this index.
SHARD_INDEX_FILE = "index.json"
#: The index is written here first, then renamed to SHARD_INDEX_FILE.
SHARD_INDEX_TMP = ".index.json.tmp"
SHARD_INDEX_FORMAT = "lmdbfolder-shards"
#: Version of the index file's layout (independent of FORMAT_VERSION, which
#: every shard carries itself).
SHARD_INDEX_VERSION = 1
#: Optional manifest field of a shard: where it sits in the split (FORMAT.md).
SHARD_FIELD = "shard"
_SHARD_DIGITS = 5
_SHARD_NAME = re.compile(r"^(?P<prefix>[^/\\]+)-(?P<index>[0-9]{5,})-of-(?P<total>[0-9]{5,})\.lmdb$")
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


def shard_name(prefix: str, index: int, num_shards: int) -> str:
    """Directory name of shard ``index`` of ``num_shards``: ``train-00003-of-00008.lmdb``.

    Numbers have at least five digits (more when ``num_shards`` needs them).
    """
    if not prefix or "/" in prefix or "\\" in prefix or prefix in (".", ".."):
        raise ValueError(f"shard prefix must be a plain name, got {prefix!r}")
    if not 0 <= index < num_shards:
        raise ValueError(f"shard index must be in 0..{num_shards - 1}, got {index}")
    width = max(_SHARD_DIGITS, len(str(num_shards)))
    return f"{prefix}-{index:0{width}d}-of-{num_shards:0{width}d}.lmdb"


def parse_shard_name(name: str) -> tuple[str, int, int] | None:
    """``(prefix, index, num_shards)`` of a shard directory name, or None if it is not one."""
    m = _SHARD_NAME.match(name)
    if m is None:
        return None
    index, total = int(m.group("index")), int(m.group("total"))
    if not 0 <= index < total or shard_name(m.group("prefix"), index, total) != name:
        return None
    return m.group("prefix"), index, total


def tables_digest(meta: bytes | memoryview, labels: bytes | memoryview, paths: bytes | memoryview) -> str:
    """SHA-256 (hex) identifying a pack: its manifest, label table and path table.

    Each value is prefixed with its length (u64 little-endian), so the three
    cannot be shifted into one another. The index stores it per shard.
    """
    h = hashlib.sha256()
    for blob in (meta, labels, paths):
        h.update(_OFFSET.pack(len(blob)))
        h.update(blob)
    return h.hexdigest()


def shard_identity(meta: bytes | memoryview, labels: bytes | memoryview, paths: bytes | memoryview) -> dict[str, Any]:
    """The index entry fields that identify a shard cheaply: ``manifest_sha256`` (of
    its stored manifest) and ``tables_bytes`` (the lengths of its label and path tables).

    The manifest names what the shard holds (count, skipped files, payload
    bytes, encodings, the split and a fingerprint of its sources) and when
    it was written (``created_at``), so a replaced or repacked shard has
    another manifest; hashing a few KB instead of the tables (megabytes per
    shard) is what lets every DataLoader worker check every shard it opens.
    """
    return {"manifest_sha256": hashlib.sha256(meta).hexdigest(), "tables_bytes": [len(labels), len(paths)]}


def shard_matches(
    entry: Mapping[str, Any], meta: bytes | memoryview, labels: bytes | memoryview, paths: bytes | memoryview
) -> bool:
    """Whether a shard's stored manifest and tables are those its index ``entry`` names.

    Entries that carry ``shard_identity`` are checked by it (cheap); entries of
    indexes written before it existed carry only ``tables_sha256``, checked
    over the whole tables. ``verify`` checks ``tables_sha256`` in any case.
    """
    if "manifest_sha256" in entry:
        found = shard_identity(meta, labels, paths)
        return all(entry.get(key) == value for key, value in found.items())
    return tables_digest(meta, labels, paths) == entry.get("tables_sha256")


def encode_shard_index(index: Mapping[str, Any]) -> bytes:
    """Serialise a sharded pack's index: JSON, sorted keys, ASCII, indented, final newline."""
    return (json.dumps(index, sort_keys=True, indent=1, ensure_ascii=True) + "\n").encode("ascii")


def decode_shard_index(blob: bytes, *, where: str) -> dict[str, Any]:
    """Parse and validate a sharded pack's ``index.json``.

    ``where`` names the file in errors. Raises NotAPackError for a malformed
    index and FormatVersionError for an index or shard format version this
    reader does not know.
    """
    try:
        index = json.loads(blob)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NotAPackError(where, f"it is not valid JSON: {exc}") from None
    if not isinstance(index, dict) or index.get("format") != SHARD_INDEX_FORMAT:
        raise NotAPackError(where, f"it does not say format={SHARD_INDEX_FORMAT!r}")
    if index.get("index_version") != SHARD_INDEX_VERSION:
        raise FormatVersionError(where, index.get("index_version"), SHARD_INDEX_VERSION)
    if index.get("pack_format_version") != FORMAT_VERSION:
        raise FormatVersionError(where, index.get("pack_format_version"), FORMAT_VERSION)
    _check_meta_fields(index, where)
    shards = index.get("shards")
    problems = []
    if not isinstance(shards, list) or not shards:
        raise NotAPackError(where, "its index is invalid: shards is not a non-empty list")
    names = set()
    total = 0
    for k, shard in enumerate(shards):
        if not isinstance(shard, dict):
            problems.append(f"shard {k} is not an object")
            continue
        name, count, digest = shard.get("name"), shard.get("count"), shard.get("tables_sha256")
        if not isinstance(name, str) or parse_shard_name(name) is None:
            problems.append(f"shard {k} has no valid name ({name!r})")
        elif name in names:
            problems.append(f"shard name {name} appears twice")
        names.add(name)
        if not isinstance(count, int) or count < 0:
            problems.append(f"shard {k} count={count!r} is not a non-negative integer")
        else:
            total += count
        if not isinstance(digest, str) or not _SHA256_HEX.match(digest):
            problems.append(f"shard {k} has no tables_sha256")
        if "manifest_sha256" in shard:
            sizes = shard.get("tables_bytes")
            if not isinstance(shard["manifest_sha256"], str) or not _SHA256_HEX.match(shard["manifest_sha256"]):
                problems.append(f"shard {k} has an invalid manifest_sha256")
            if not (
                isinstance(sizes, list)
                and len(sizes) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in sizes)
            ):
                problems.append(f"shard {k} has manifest_sha256 but no valid tables_bytes")
    if not problems and total != index["count"]:
        problems.append(f"the shard counts add up to {total}, the index says count={index['count']}")
    if problems:
        raise NotAPackError(where, "its index is invalid: " + "; ".join(problems))
    return index

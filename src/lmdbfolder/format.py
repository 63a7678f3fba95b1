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
import reprlib
import struct
import sys
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Mapping, Sequence

from lmdbfolder.errors import CorruptRecordError, FormatVersionError, NotAPackError

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "UPDATED_FORMAT_VERSION",
    "READABLE_VERSIONS",
    "RECORD_VERSION",
    "RECORD_MAGIC",
    "RECORD_HEADER",
    "KEY",
    "MAX_INDEX",
    "META_KEY",
    "LABELS_KEY",
    "PATHS_KEY",
    "PROGRESS_KEY",
    "CHECK_KEY",
    "SKIPPED_KEY",
    "ORDER_KEY",
    "STATS_KEY",
    "HISTORY_KEY",
    "TABLE_KEYS",
    "UNKNOWN_MTIME",
    "PACK_ID_BYTES",
    "MAX_MANIFEST_BYTES",
    "MAX_JSON_DEPTH",
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
    "WRITER_LOCK_SUFFIX",
    "UPDATE_SUFFIX",
    "PARTS_SUFFIX",
    "NEEDS_PREFIX",
    "ROOM_LOCK",
    "LEGACY_KEYS",
    "LEGACY_META_FILES",
    "RecordHeader",
    "encode_key",
    "decode_key",
    "checksum",
    "CRC32_IMPLEMENTATION",
    "encode_record",
    "encode_header_into",
    "bind_record",
    "record_binding",
    "decode_record",
    "new_pack_id",
    "pack_binding",
    "label_map",
    "encode_order",
    "order_values",
    "STAT_DTYPE",
    "encode_stats",
    "stats_values",
    "encode_history",
    "decode_history",
    "loads_json",
    "encode_check",
    "decode_check",
    "check_table",
    "encode_skipped",
    "decode_skipped",
    "INVALID",
    "informational",
    "invalid_fields",
    "encode_meta",
    "decode_meta",
    "encode_progress",
    "decode_progress",
    "encode_labels",
    "decode_labels",
    "check_labels",
    "encode_paths",
    "labels_table",
    "paths_table",
    "check_paths",
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
    "ShardIndex",
    "ShardEntry",
    "ShardSplit",
    "encode_shard_index",
    "decode_shard_index",
]

FORMAT_NAME = "lmdbfolder"
#: Version of the pack as a whole (metadata keys and their meaning), written
#: by this writer. Version 2 binds each record's CRC-32 to its index and to
#: the pack (``pack_id``) and adds the table checksums (``__check__``); see
#: "Version rules" in FORMAT.md.
FORMAT_VERSION = 2
#: Version of a pack that ``pack --update`` changed in place: format 2 plus a
#: level of indirection (sample ``i`` is the record under key ``__order__[i]``,
#: whose CRC is bound to ``binding_id`` and that key), so that unchanged
#: records keep their keys and bytes when samples are added before them, and
#: ``record_classes`` (the class each record header's label names), so that
#: they keep them when class indices shift. Fresh packs are still written as
#: version 2, which older readers open.
UPDATED_FORMAT_VERSION = 3
#: The versions this reader understands; it refuses any other.
READABLE_VERSIONS = (1, 2, 3)
#: Version of the per-record header layout below (unchanged in format 2:
#: only what the CRC covers changed, and the pack's format version says so).
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
#: Format 2: the length and CRC-32 of each table below (JSON), checked on open.
CHECK_KEY = b"__check__"
#: Format 2: the source files left out (JSON list of {path, reason}); format 1
#: kept them in the manifest, which every reader process parses.
SKIPPED_KEY = b"__skipped__"
#: Format 3 (required there): the record key of every sample, count x u64 LE.
ORDER_KEY = b"__order__"
#: Optional (formats 2 and 3): size and modification time (ns) of every
#: sample's source file when it was read, count x (u64 LE, i64 LE); what
#: ``pack --update`` compares to find the files that changed.
STATS_KEY = b"__stats__"
#: Optional (formats 2 and 3): the pack's history, a JSON list (the pack, then
#: every update: when, and what changed).
HISTORY_KEY = b"__history__"
#: The tables ``__check__`` covers (the last three only when present).
TABLE_KEYS = (META_KEY, LABELS_KEY, PATHS_KEY, SKIPPED_KEY, ORDER_KEY, STATS_KEY, HISTORY_KEY)
#: A ``__stats__`` modification time that is not known (the file was read by a
#: run that was interrupted and resumed): an update compares its bytes.
UNKNOWN_MTIME = -1
#: Format 2: bytes of the random pack id (32 hex digits in the manifest).
PACK_ID_BYTES = 16
#: A manifest longer than this is refused before it is parsed: every reader
#: process parses it, and JSON costs up to ~30x its size in memory.
MAX_MANIFEST_BYTES = 16 << 20
#: A sharded pack's ``index.json`` longer than this is refused before it is read.
MAX_INDEX_FILE_BYTES = 256 << 20
#: JSON nested deeper than this (manifest, checkpoint, index, ...) is refused.
MAX_JSON_DEPTH = 16
#: More arrays and objects than this in one JSON value are refused.
MAX_JSON_CONTAINERS = 1 << 20

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
#: ``<file>.parts``: the journal of a resumable download (``lmdbfolder.remote.download``):
#: the parts of ``<file>`` already on disk, one number a line after a JSON header.
PARTS_SUFFIX = ".parts"
#: ``.needs-<pid>-<n>``: in a staging cache, the shards one sampler of a rank still needs this epoch
#: (held with a shared flock by that rank while it lives).
NEEDS_PREFIX = ".needs-"
#: ``.room.lock``: in a staging cache, held (flock, exclusive) while one process
#: decides what to evict to make room for a download, so two downloads that start
#: at once count each other.
ROOM_LOCK = ".room.lock"
#: ``<dst>.lock``: held (flock) by the ``pack`` writing ``<dst>`` for its whole
#: run, holding that process's id; removed when it ends.
WRITER_LOCK_SUFFIX = ".lock"
#: ``pack --update`` reads the changed files into ``<dst>.update`` (a small LMDB
#: with a checkpoint, or one per shard), then changes ``<dst>`` in one transaction.
UPDATE_SUFFIX = ".update"
#: Keys by which the folder2lmdb recipes' LMDBs are recognised (pickled
#: samples; ``lmdbfolder import`` converts them), and the files beside
#: ``data.mdb`` that mark a BasicSR-style image LMDB.
LEGACY_KEYS = (b"__keys__", b"__len__")
LEGACY_META_FILES = ("meta_info.txt", "meta_info.pkl")

_LABEL = struct.Struct("<i")
_OFFSET = struct.Struct("<Q")
_CRC = struct.Struct("<I")


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


def checksum(payload: bytes | bytearray | memoryview, start: int = 0) -> int:
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
    _CRC.pack_into(buf, _CRC_OFFSET, crc)


def encode_record(
    payload: bytes | memoryview,
    *,
    label: int,
    encoding: str,
    width: int = 0,
    height: int = 0,
    channels: int = 0,
    binding: bytes | None = None,
    index: int | None = None,
) -> bytes:
    """Return header + payload for one sample.

    ``width``, ``height`` and ``channels`` are 0 when unknown. With
    ``binding`` (``pack_binding(meta)``, format 2) and ``index``, the CRC is
    bound to that pack and index (``bind_record``); without, it covers header
    and payload only (format 1, or a record not yet bound). The payload is
    copied once, because an LMDB value must be one contiguous buffer; see
    ``encode_header_into`` to avoid that copy.
    """
    header = bytearray(RECORD_HEADER.size)
    _pack_header(header, payload, label, encoding, width, height, channels)
    value = b"".join((header, payload))
    if binding is None:
        return value
    if index is None:
        raise ValueError("a bound record needs its index")
    return bytes(bind_record(value, binding, index))


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
    never copied on its way to LMDB. The CRC is not yet bound (``bind_record``
    does that once the index is known). Returns ``value``.
    """
    payload = memoryview(value)[RECORD_HEADER.size :]
    try:
        _pack_header(value, payload, label, encoding, width, height, channels)
    finally:
        payload.release()
    return value


def record_binding(binding: bytes, index: int) -> bytes:
    """The bytes a format-2 record's CRC continues over: the pack id, then the index (u64 LE)."""
    return binding + _OFFSET.pack(index)


def bind_record(value: bytes | bytearray | memoryview, binding: bytes, index: int) -> bytes | bytearray | memoryview:
    """Bind a record's CRC to its pack and index (format 2): CRC-32 continued over
    ``binding || u64le(index)``, written into the header.

    CRC-32 continues cheaply (``crc32(extra, crc_so_far)``), so records built
    before their index is known (in the writer's reader processes) are bound
    in place: ``value`` is patched when it is writable (a bytearray, a view of
    shared memory) and copied into a new bytearray when it is not.
    """
    if len(binding) != PACK_ID_BYTES:
        raise ValueError(f"a pack binding is {PACK_ID_BYTES} bytes, got {len(binding)}")
    view = memoryview(value)
    if view.readonly:
        value = bytearray(view)
        view = memoryview(value)
    (crc,) = _CRC.unpack_from(view, _CRC_OFFSET)
    _CRC.pack_into(view, _CRC_OFFSET, checksum(record_binding(binding, index), crc))
    return value


def decode_record(
    value: bytes | memoryview,
    *,
    index: int | None = None,
    verify: bool = False,
    binding: bytes | None = None,
    key: int | None = None,
) -> tuple[RecordHeader, memoryview]:
    """Split a stored value into its header and a zero-copy payload view.

    Raises CorruptRecordError (naming ``index``) for a value that is too short,
    has the wrong magic, an unknown record version, encoding or flags, a
    length that disagrees with the header, raw pixels whose count is not
    width x height x 3 (checked before anything is allocated for them), or
    (with ``verify=True``) a CRC-32 that does not match. ``binding`` is the
    pack's (``pack_binding``, format 2 and 3): the CRC then also covers it and
    the record's key number, so a record found under another key, or from
    another pack, fails the check. The key number is ``key`` (format 3: the
    sample's ``__order__`` entry), else ``index`` (format 2: key = index).
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
    if encoding == "raw" and (channels != 3 or width * height * 3 != length):
        raise CorruptRecordError(
            index, f"raw pixels: the header says {width}x{height}x{channels}, the payload holds {length:,} bytes"
        )
    if verify:
        actual = checksum(payload, checksum(view[:_CRC_OFFSET]))
        if binding is not None:
            bound = index if key is None else key
            if bound is None:
                raise ValueError("checking a bound record needs its index")
            actual = checksum(record_binding(binding, bound), actual)
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


def _scan_json(raw: bytes, what: str, max_depth: int, max_containers: int) -> str | None:
    """Why ``raw`` must not be handed to ``json.loads``, or None.

    A linear pre-scan (strings removed by one regular expression, then the
    brackets counted) that refuses nesting deeper than ``max_depth``, where
    ``json.loads`` would recurse (RecursionError), and more than
    ``max_containers`` arrays and objects, which cost memory out of all
    proportion to their bytes.
    """
    # Every array and object opens with a bracket: when the brackets anywhere
    # (strings included) are few, neither bound can be passed, and the two
    # regular expressions (most of a manifest's parse time) are not needed.
    openers = raw.count(b"[") + raw.count(b"{")
    if openers <= max_depth and openers + raw.count(b"]") + raw.count(b"}") <= 2 * max_containers:
        return None
    brackets = _JSON_BRACKETS.sub(b"", _JSON_STRINGS.sub(b'""', raw))
    if len(brackets) > 2 * max_containers:
        return f"its {what} holds more than {max_containers:,} arrays and objects"
    depth = 0
    for c in brackets:
        depth += 1 if c in b"[{" else -1
        if depth > max_depth:
            return f"its {what} is nested more than {max_depth} levels deep"
    return None


#: The hint of errors about a damaged (or foreign) table.
DAMAGED_HINT = (
    "it is damaged, or was not written by lmdbfolder: run `lmdbfolder verify` on it, "
    "then copy it again from a good copy or repack it"
)
_JSON_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_JSON_BRACKETS = re.compile(rb"[^\[\]{}]")


def loads_json(
    blob: bytes | memoryview,
    *,
    where: str,
    what: str,
    max_bytes: int,
    max_depth: int = MAX_JSON_DEPTH,
    max_containers: int = MAX_JSON_CONTAINERS,
) -> Any:
    """``json.loads`` for values read from a pack or an index, with bounds checked first.

    Refuses (NotAPackError naming ``where`` and ``what``) a value longer than
    ``max_bytes`` (before copying it), nesting deeper than ``max_depth``, more
    than ``max_containers`` arrays and objects, and anything that is not
    valid UTF-8 JSON. Never a traceback for hostile input.
    """
    if len(blob) > max_bytes:
        raise NotAPackError(
            where, f"its {what} is {len(blob):,} bytes, more than the {max_bytes:,} allowed", DAMAGED_HINT
        )
    raw = bytes(blob)
    why = _scan_json(raw, what, max_depth, max_containers)
    if why is not None:
        raise NotAPackError(where, why, DAMAGED_HINT)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        # ValueError: also an integer of more digits than Python converts (sys.set_int_max_str_digits).
        raise NotAPackError(where, f"its {what} is not valid JSON: {exc}", DAMAGED_HINT) from None


def decode_meta(blob: bytes | memoryview | None, *, where: str) -> dict[str, Any]:
    """Parse and validate the manifest stored under ``META_KEY``.

    ``where`` names the pack in error messages. Raises NotAPackError for a
    missing, oversized or malformed manifest (required fields of the wrong
    type, classes and class_to_idx that contradict each other, a format-2
    manifest without a valid ``pack_id``) and FormatVersionError for a
    version this reader does not understand.
    """
    if blob is None:
        raise NotAPackError(
            where,
            "it is an LMDB but has no lmdbfolder manifest (key __meta__)",
            "an LMDB of the folder2lmdb or BasicSR recipes converts with `lmdbfolder import OLD NEW`; "
            "one made by another tool: pack the source images with `lmdbfolder pack`",
        )
    if not bytes(blob[:1]) == b"{":
        raise NotAPackError(where, "its manifest (key __meta__) is not a JSON object")
    meta = loads_json(blob, where=where, what="manifest (key __meta__)", max_bytes=MAX_MANIFEST_BYTES)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise NotAPackError(where, f"its manifest does not say format={FORMAT_NAME!r}")
    version = meta.get("format_version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise FormatVersionError(where, version, FORMAT_VERSION, READABLE_VERSIONS)
    _check_meta_fields(meta, where)
    return meta


def new_pack_id() -> str:
    """A fresh random pack id (32 hex digits) for the manifest of a new pack."""
    return os.urandom(PACK_ID_BYTES).hex()


def pack_binding(meta: Mapping[str, Any]) -> bytes | None:
    """What a pack's record CRCs are bound to: its ``pack_id`` (format 2), its
    ``binding_id`` (format 3: the ``pack_id`` of the version that first wrote
    its records), or None for format 1."""
    version = meta.get("format_version", 1)
    if version < 2:
        return None
    return bytes.fromhex(meta["binding_id"] if version >= 3 else meta["pack_id"])


def label_map(meta: Mapping[str, Any]) -> list[int] | None:
    """How a record header's label becomes the sample's label (format 3 with
    ``record_classes``): ``out[h]`` is the class index of ``record_classes[h]``
    in ``classes``, or -2 for a class the pack no longer has (no sample may
    then refer to such a record). None: header labels are class indices."""
    names = meta.get("record_classes") if meta.get("format_version", 1) >= 3 else None
    if names is None:
        return None
    class_to_idx = meta["class_to_idx"]
    return [int(class_to_idx.get(name, -2)) for name in names]


def encode_progress(progress: Mapping[str, Any]) -> bytes:
    """Serialise the writer's checkpoint (same canonical JSON as the manifest)."""
    return encode_meta(progress)


def decode_progress(blob: bytes | memoryview, *, where: str) -> dict[str, Any]:
    """Parse a checkpoint written by encode_progress; NotAPackError if malformed."""
    progress = loads_json(blob, where=where, what="checkpoint (key __progress__)", max_bytes=1 << 30)
    if not isinstance(progress, dict) or not isinstance(progress.get("next_source"), int):
        raise NotAPackError(where, "its checkpoint (key __progress__) is malformed")
    return progress


_PACK_ID = re.compile(r"^[0-9a-f]{32}$")


def _check_meta_fields(meta: dict[str, Any], where: str) -> None:
    count = meta.get("count")
    classes = meta.get("classes")
    class_to_idx = meta.get("class_to_idx")
    problems = []
    if type(count) is not int or count < 0 or count > MAX_INDEX + 1:
        problems.append(f"count={_short(count)} is not a non-negative integer")
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        problems.append("classes is not a list of strings")
        classes = None
    if not isinstance(class_to_idx, dict) or not all(type(v) is int for v in class_to_idx.values()):
        problems.append("class_to_idx is not a mapping of strings to integers")
    elif classes is not None and not _consistent_classes(classes, class_to_idx):
        problems.append("classes and class_to_idx contradict each other")
    if meta.get("store") not in ("encoded", "raw"):
        problems.append(f"store={_short(meta.get('store'))} is neither 'encoded' nor 'raw'")
    if meta.get("format_version") in (2, 3):
        pack_id = meta.get("pack_id")
        if not isinstance(pack_id, str) or not _PACK_ID.match(pack_id):
            problems.append(f"pack_id={_short(pack_id)} is not {2 * PACK_ID_BYTES} hex digits")
    if meta.get("format_version") == 3:
        binding_id = meta.get("binding_id")
        if not isinstance(binding_id, str) or not _PACK_ID.match(binding_id):
            problems.append(f"binding_id={_short(binding_id)} is not {2 * PACK_ID_BYTES} hex digits")
        names = meta.get("record_classes")
        if names is not None and (
            not isinstance(names, list) or not all(isinstance(c, str) for c in names) or len(set(names)) != len(names)
        ):
            problems.append("record_classes is not a list of distinct strings")
        next_record = meta.get("next_record")
        if type(next_record) is not int or not 0 <= next_record <= MAX_INDEX + 1:
            problems.append(f"next_record={_short(next_record)} is not a record key count")
    if problems:
        raise NotAPackError(where, "its manifest is invalid: " + "; ".join(problems), DAMAGED_HINT)


def _consistent_classes(classes: list[str], class_to_idx: dict[str, int]) -> bool:
    # Each name maps to a position that holds that name, and every name is
    # mapped: what ImageFolder's {c: i for i, c in enumerate(classes)} gives
    # (a name listed twice maps to one of its positions).
    return len(class_to_idx) == len(set(classes)) and all(
        0 <= v < len(classes) and classes[v] == k for k, v in class_to_idx.items()
    )


def _short(value: Any) -> str:
    """A repr of a value read from a file, cut short (a hostile value may be huge)."""
    text = reprlib.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


#: The informational manifest fields (FORMAT.md) and what each must be; a reader
#: shows a field that is not as ``INVALID`` instead of failing on it.
INVALID = "invalid"
_INFORMATIONAL: dict[str, Callable[[Any], bool]] = {
    "encodings": lambda v: isinstance(v, dict) and all(isinstance(k, str) and _count(n) for k, n in v.items()),
    "payload_bytes": lambda v: _count(v),
    "checksum": lambda v: isinstance(v, str),
    "source": lambda v: isinstance(v, dict),
    "created_by": lambda v: isinstance(v, str),
    "created_at": lambda v: isinstance(v, str),
    "updated_at": lambda v: isinstance(v, str),
    "params": lambda v: isinstance(v, dict),
    "fingerprint": lambda v: isinstance(v, dict),
    "shard": lambda v: isinstance(v, dict),
    "skipped": lambda v: isinstance(v, list) and all(isinstance(x, dict) for x in v),
    "skipped_count": lambda v: _count(v),
}


def _count(value: Any) -> bool:
    # A count or a size: an int a reader can do arithmetic with (a float of it, a share).
    return type(value) is int and 0 <= value < 1 << 63


def informational(meta: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """Informational field ``key`` of a manifest: its value, ``default`` when it is
    absent, or ``INVALID`` when it does not have the type FORMAT.md gives it."""
    if key not in meta:
        return default
    value = meta[key]
    valid = _INFORMATIONAL.get(key, lambda v: True)
    return value if valid(value) else INVALID


def invalid_fields(meta: Mapping[str, Any]) -> list[str]:
    """The informational fields of ``meta`` that do not have their documented type, sorted."""
    return sorted(key for key, valid in _INFORMATIONAL.items() if key in meta and not valid(meta[key]))


def encode_check(tables: Mapping[bytes, bytes | bytearray | memoryview]) -> bytes:
    """The ``__check__`` value (format 2): for each table, ``[length, crc32]``, as canonical JSON."""
    return encode_meta({key.decode(): [len(blob), checksum(blob)] for key, blob in tables.items()})


def decode_check(blob: bytes | memoryview | None, *, where: str) -> dict[bytes, tuple[int, int]]:
    """Parse ``__check__``: table key -> (length, crc32); NotAPackError if missing or malformed."""
    if blob is None:
        raise NotAPackError(where, f"its table checksums (key {CHECK_KEY.decode()}) are missing")
    check = loads_json(blob, where=where, what=f"table checksums (key {CHECK_KEY.decode()})", max_bytes=4096)
    out: dict[bytes, tuple[int, int]] = {}
    if isinstance(check, dict):
        for name, entry in check.items():
            if isinstance(entry, list) and len(entry) == 2 and all(type(x) is int and x >= 0 for x in entry):
                out[name.encode("ascii", "replace")] = (entry[0], entry[1])
    if not isinstance(check, dict) or len(out) != len(check) or not {META_KEY, LABELS_KEY, PATHS_KEY} <= set(out):
        raise NotAPackError(where, f"its table checksums (key {CHECK_KEY.decode()}) are malformed")
    return out


def check_table(check: Mapping[bytes, tuple[int, int]], key: bytes, blob: bytes | memoryview, *, where: str) -> None:
    """Raise NotAPackError unless ``blob`` (the value of table ``key``) has the length
    and CRC-32 that ``__check__`` gives it."""
    if key not in check:
        raise NotAPackError(where, f"its table checksums do not cover {key.decode()}")
    length, crc = check[key]
    if len(blob) != length or checksum(blob) != crc:
        raise NotAPackError(
            where,
            f"its {key.decode()} table is damaged (its length or CRC-32 differs from {CHECK_KEY.decode()})",
            DAMAGED_HINT,
        )


def encode_skipped(skipped: Sequence[Mapping[str, str]]) -> bytes:
    """The ``__skipped__`` value: the list of ``{path, reason}``, canonical JSON."""
    return json.dumps(list(skipped), sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def decode_skipped(blob: bytes | memoryview, *, where: str) -> list[dict[str, Any]]:
    """Parse ``__skipped__`` (NotAPackError if malformed)."""
    items = loads_json(blob, where=where, what=f"list of skipped files ({SKIPPED_KEY.decode()})", max_bytes=1 << 30)
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise NotAPackError(where, f"its {SKIPPED_KEY.decode()} is not a list of objects")
    return items


def encode_order(keys: Any) -> bytes:
    """The ``__order__`` value (format 3): the record key of every sample, in sample
    order, as little-endian u64 (``keys``: any sequence or array of integers)."""
    import numpy as np

    return np.asarray(keys, dtype="<u8").tobytes()


def order_values(blob: bytes | memoryview, count: int, *, where: str) -> Any:
    """``__order__`` as a read-only little-endian u64 numpy view of ``blob`` (no copy),
    its length checked (NotAPackError)."""
    import numpy as np

    if len(blob) != count * _OFFSET.size:
        raise NotAPackError(where, f"{ORDER_KEY.decode()} holds {len(blob)} bytes, expected {count * _OFFSET.size}")
    return np.frombuffer(blob, dtype="<u8")


#: One ``__stats__`` entry: the source file's size and modification time in ns.
STAT_DTYPE = [("size", "<u8"), ("mtime_ns", "<i8")]


def encode_stats(sizes: Any, mtimes: Any) -> bytes:
    """The ``__stats__`` value: for every sample, its source file's size (u64 LE)
    and modification time in nanoseconds (i64 LE; ``UNKNOWN_MTIME`` if unknown)."""
    import numpy as np

    sizes = np.asarray(sizes, dtype="<u8")
    out = np.empty(len(sizes), dtype=STAT_DTYPE)
    out["size"] = sizes
    out["mtime_ns"] = np.asarray(mtimes, dtype="<i8")
    return out.tobytes()


def stats_values(blob: bytes | memoryview, count: int, *, where: str) -> Any:
    """``__stats__`` as a read-only numpy view (fields ``size``, ``mtime_ns``), its length checked."""
    import numpy as np

    size = np.dtype(STAT_DTYPE).itemsize
    if len(blob) != count * size:
        raise NotAPackError(where, f"{STATS_KEY.decode()} holds {len(blob)} bytes, expected {count * size}")
    return np.frombuffer(blob, dtype=STAT_DTYPE)


def encode_history(history: Sequence[Mapping[str, Any]]) -> bytes:
    """The ``__history__`` value: a JSON list of events (canonical JSON, ASCII)."""
    return json.dumps(list(history), sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def decode_history(blob: bytes | memoryview, *, where: str) -> list[dict[str, Any]]:
    """Parse ``__history__`` (NotAPackError if malformed); entries that are not objects are dropped."""
    items = loads_json(blob, where=where, what=f"history ({HISTORY_KEY.decode()})", max_bytes=1 << 30)
    if not isinstance(items, list):
        raise NotAPackError(where, f"its {HISTORY_KEY.decode()} is not a list")
    return [item for item in items if isinstance(item, dict)]


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
    _check_labels_length(blob, count, where)
    labels = array.array("i")
    labels.frombytes(blob)  # straight from the (zero-copy) value: no transient bytes copy
    if sys.byteorder != "little":
        labels.byteswap()
    return labels


def _check_labels_length(blob: bytes | memoryview, count: int, where: str) -> None:
    if len(blob) != count * _LABEL.size:
        raise NotAPackError(where, f"{LABELS_KEY.decode()} holds {len(blob)} bytes, expected {count * _LABEL.size}")


def label_values(blob: bytes | memoryview, count: int, *, where: str) -> Any:
    """The label table as a read-only little-endian int32 numpy view of ``blob``
    (no copy), its length checked like ``decode_labels``."""
    import numpy as np

    _check_labels_length(blob, count, where)
    return np.frombuffer(blob, dtype="<i4")


def check_labels(labels: Any, n_classes: int, *, where: str) -> None:
    """NotAPackError unless every label is -1 (unlabelled) or a class index ``0..n_classes-1``."""
    import numpy as np  # a dependency of the package; the format module itself needs only the standard library

    if not len(labels):
        return
    values = labels if isinstance(labels, np.ndarray) else np.frombuffer(labels, dtype=np.int32)
    low, high = int(values.min()), int(values.max())
    if low < NO_LABEL or high >= n_classes:
        bad = int(np.flatnonzero((values < NO_LABEL) | (values >= n_classes))[0])
        raise NotAPackError(
            where,
            f"its label table gives sample {bad} the label {int(values[bad])}, "
            f"not a class index (0..{n_classes - 1}) or -1",
        )


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


def check_paths(blob: bytes | memoryview, count: int, *, where: str) -> None:
    """NotAPackError unless ``blob`` is a well-formed path table for ``count`` samples
    (then ``path_at`` stays inside it for every index)."""
    import numpy as np

    base = (count + 1) * _OFFSET.size
    if len(blob) < base:
        raise NotAPackError(where, f"{PATHS_KEY.decode()} is too short for {count} samples")
    offsets = np.frombuffer(blob, dtype="<u8", count=count + 1)
    if int(offsets[0]) != 0 or base + int(offsets[-1]) != len(blob) or bool(np.any(offsets[1:] < offsets[:-1])):
        raise NotAPackError(where, f"{PATHS_KEY.decode()} has inconsistent offsets")


def path_at(blob: bytes | memoryview, count: int, index: int) -> str:
    """Return relative path ``index`` from an encode_paths blob without parsing the rest
    (``check_paths`` first: this trusts the offsets)."""
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
    """Parse and validate a sharded pack's ``index.json`` into its JSON object
    (``ShardIndex.from_json``, as a dict: what the readers index).

    ``where`` names the file in errors. Raises NotAPackError for a malformed
    index and FormatVersionError for an index or shard format version this
    reader does not know.
    """
    return ShardIndex.from_json(blob, where=where).to_dict()


def _check_shard_index(index: Any, where: str) -> None:
    """Raise unless the parsed ``index`` is one a reader may open (FORMAT.md, "Sharded packs")."""
    if not isinstance(index, dict) or index.get("format") != SHARD_INDEX_FORMAT:
        raise NotAPackError(where, f"it does not say format={SHARD_INDEX_FORMAT!r}")
    if index.get("index_version") != SHARD_INDEX_VERSION:
        raise FormatVersionError(where, index.get("index_version"), SHARD_INDEX_VERSION)
    if index.get("pack_format_version") not in READABLE_VERSIONS:
        raise FormatVersionError(where, index.get("pack_format_version"), FORMAT_VERSION, READABLE_VERSIONS)
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
            problems.append(f"shard {k} has no valid name ({_short(name)})")
        elif name in names:
            problems.append(f"shard name {name} appears twice")
        else:
            names.add(name)  # only a valid name: another value may be a list, which no set holds
        if type(count) is not int or count < 0:
            problems.append(f"shard {k} count={_short(count)} is not a non-negative integer")
        else:
            total += count
        if not isinstance(digest, str) or not _SHA256_HEX.match(digest):
            problems.append(f"shard {k} has no tables_sha256")
        if "manifest_sha256" in shard:
            sizes = shard.get("tables_bytes")
            if not isinstance(shard["manifest_sha256"], str) or not _SHA256_HEX.match(shard["manifest_sha256"]):
                problems.append(f"shard {k} has an invalid manifest_sha256")
            if not _is_sizes(sizes):
                problems.append(f"shard {k} has manifest_sha256 but no valid tables_bytes")
        pack_id = shard.get("pack_id")
        if pack_id is not None and (not isinstance(pack_id, str) or not _PACK_ID.match(pack_id)):
            problems.append(f"shard {k} has an invalid pack_id")
    if not problems and total != index["count"]:
        problems.append(f"the shard counts add up to {total}, the index says count={index['count']}")
    if problems:
        raise NotAPackError(where, "its index is invalid: " + "; ".join(problems))


def _is_int(value: Any) -> bool:
    # 64 bits at most: a hostile index's huge integers must not reach arithmetic that overflows.
    return type(value) is int and -(1 << 63) <= value < 1 << 63


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_sha256(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _is_class_counts(value: Any) -> bool:
    # [[class index, samples], ...]: the classes a shard holds, sparse (a shard
    # of a class-sorted list holds few).
    return isinstance(value, list) and all(
        isinstance(p, list) and len(p) == 2 and all(_is_int(x) and x >= 0 for x in p) for p in value
    )


def _is_sizes(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(_is_int(x) and x >= 0 for x in value)


def _typed(
    obj: Mapping[str, Any], checks: Mapping[str, Callable[[Any], bool]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a JSON object into (the fields named in ``checks`` whose value passes its
    check, every other field as it is).

    The second part becomes ``extra``: fields this version does not know, and
    informational fields of an unexpected type (a reader must not require
    them), so that an index decodes and encodes back byte for byte.
    """
    typed: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in obj.items():
        if key in checks and checks[key](value):
            typed[key] = value
        else:
            extra[key] = value
    return typed, extra


def _present(fields: Iterable[tuple[str, Any]], extra: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON object of the ``fields`` that are set (not None), then ``extra``."""
    out = {key: value for key, value in fields if value is not None}
    out.update(extra)
    return out


@dataclass(frozen=True)
class ShardEntry:
    """One shard of a sharded pack, as its index (``index.json``) lists it.

    ``name`` (the shard's directory), ``count`` (its samples) and
    ``tables_sha256`` (``tables_digest`` of its tables) are required.
    ``pack_id`` (v2 shards), ``manifest_sha256`` and ``tables_bytes``
    (``shard_identity``) are what a reader checks when it opens the shard.
    The others are informational: ``first_index`` (the global index of its
    first sample), ``first_source``, ``sources`` (source files of the shard,
    packed or skipped), ``skipped``, ``payload_bytes`` and ``data_bytes``
    (the size of its ``data.mdb``, ``bytes`` in the JSON). Written by
    ``lmdbfolder copy PACK URL`` (an upload) for staging: ``data_sha256``
    (SHA-256 of the uploaded ``data.mdb``, which a download must match
    before the shard is published) and ``class_counts`` (``[[class,
    samples], ...]``, the classes the shard holds, so a staged pack knows its
    class counts without downloading every shard). None: not in the index.
    ``extra``: what ``_typed`` kept as it was.
    """

    name: str
    count: int
    tables_sha256: str
    first_index: int | None = None
    first_source: int | None = None
    sources: int | None = None
    skipped: int | None = None
    payload_bytes: int | None = None
    data_bytes: int | None = None
    manifest_sha256: str | None = None
    tables_bytes: tuple[int, int] | None = None
    pack_id: str | None = None
    data_sha256: str | None = None
    class_counts: tuple[tuple[int, int], ...] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    _CHECKS: ClassVar[Mapping[str, Callable[[Any], bool]]] = {
        "name": _is_str,
        "count": _is_int,
        "tables_sha256": _is_str,
        "first_index": _is_int,
        "first_source": _is_int,
        "sources": _is_int,
        "skipped": _is_int,
        "payload_bytes": _is_int,
        "bytes": _is_int,
        "manifest_sha256": _is_str,
        "tables_bytes": _is_sizes,
        "pack_id": _is_str,
        "data_sha256": _is_sha256,
        "class_counts": _is_class_counts,
    }

    def to_dict(self) -> dict[str, Any]:
        """This entry as its JSON object."""
        sizes = None if self.tables_bytes is None else list(self.tables_bytes)
        return _present(
            [
                ("name", self.name),
                ("count", self.count),
                ("first_index", self.first_index),
                ("first_source", self.first_source),
                ("sources", self.sources),
                ("skipped", self.skipped),
                ("payload_bytes", self.payload_bytes),
                ("bytes", self.data_bytes),
                ("tables_sha256", self.tables_sha256),
                ("manifest_sha256", self.manifest_sha256),
                ("tables_bytes", sizes),
                ("pack_id", self.pack_id),
                ("data_sha256", self.data_sha256),
                ("class_counts", None if self.class_counts is None else [list(p) for p in self.class_counts]),
            ],
            self.extra,
        )

    @classmethod
    def _from_dict(cls, obj: Mapping[str, Any]) -> ShardEntry:
        # ``obj`` passed _check_shard_index: name, count and tables_sha256 are typed.
        typed, extra = _typed(obj, cls._CHECKS)
        if "tables_bytes" in typed:
            typed["tables_bytes"] = tuple(typed["tables_bytes"])
        if "bytes" in typed:
            typed["data_bytes"] = typed.pop("bytes")
        if "class_counts" in typed:
            typed["class_counts"] = tuple((int(c), int(n)) for c, n in typed["class_counts"])
        return cls(**typed, extra=extra)


@dataclass(frozen=True)
class ShardSplit:
    """The ``split`` of a sharded pack's index (informational): ``method``
    (``"contiguous"``), the shards' ``prefix`` and ``num_shards``, the
    ``sources`` of the complete sample list and its ``sources_sha256``."""

    method: str | None = None
    prefix: str | None = None
    num_shards: int | None = None
    sources: int | None = None
    sources_sha256: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    _CHECKS: ClassVar[Mapping[str, Callable[[Any], bool]]] = {
        "method": _is_str,
        "prefix": _is_str,
        "num_shards": _is_int,
        "sources": _is_int,
        "sources_sha256": _is_str,
    }

    def to_dict(self) -> dict[str, Any]:
        """This split as its JSON object."""
        return _present(((name, getattr(self, name)) for name in self._CHECKS), self.extra)

    @classmethod
    def _from_dict(cls, obj: Mapping[str, Any]) -> ShardSplit:
        typed, extra = _typed(obj, cls._CHECKS)
        return cls(**typed, extra=extra)


@dataclass(frozen=True)
class ShardIndex:
    """A sharded pack's index, ``index.json`` (FORMAT.md, "Sharded packs").

    Required: ``pack_format_version`` (of the shards), ``count`` (the sum of
    the shards' counts), ``classes``, ``class_to_idx`` and ``store`` (as in
    every shard's manifest) and ``shards`` (in global order). The others are
    informational; None: not in the index. ``extra``: fields this version
    does not know, and informational fields of an unexpected type, kept as
    they are. ``format`` and ``index_version`` are this module's constants.

    ``to_json`` and ``from_json`` mirror each other:
    ``ShardIndex.from_json(blob, where=...).to_json() == blob`` for an index
    that ``to_json`` wrote (sorted keys, so field order is not kept).
    """

    pack_format_version: int
    count: int
    classes: list[str]
    class_to_idx: dict[str, int]
    store: str
    shards: list[ShardEntry]
    num_shards: int | None = None
    split: ShardSplit | None = None
    encodings: dict[str, int] | None = None
    payload_bytes: int | None = None
    skipped: int | None = None
    checksum: str | None = None
    source: dict[str, Any] | None = None
    created_by: str | None = None
    created_at: str | None = None
    #: The sharded pack's history (``pack --update``): a list of JSON objects, as
    #: a pack's ``__history__``.
    history: list[dict[str, Any]] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    # The required fields pass whatever _check_shard_index let through, so they
    # are always typed; informational ones are checked as in a manifest.
    _CHECKS: ClassVar[Mapping[str, Callable[[Any], bool]]] = {
        "pack_format_version": lambda v: v in READABLE_VERSIONS,
        "count": _is_int,
        "classes": lambda v: isinstance(v, list),
        "class_to_idx": lambda v: isinstance(v, dict),
        "store": _is_str,
        "shards": lambda v: isinstance(v, list),
        "num_shards": _is_int,
        "split": lambda v: isinstance(v, dict),
        "skipped": _is_int,
        **{
            key: _INFORMATIONAL[key]
            for key in ("encodings", "payload_bytes", "checksum", "source", "created_by", "created_at")
        },
        "history": lambda v: isinstance(v, list) and all(isinstance(x, dict) for x in v),
    }

    def to_dict(self) -> dict[str, Any]:
        """This index as its JSON object."""
        plain = [(name, getattr(self, name)) for name in self._CHECKS if name not in ("shards", "split")]
        out = {"format": SHARD_INDEX_FORMAT, "index_version": SHARD_INDEX_VERSION, **_present(plain, self.extra)}
        out["shards"] = [entry.to_dict() for entry in self.shards]
        if self.split is not None:
            out["split"] = self.split.to_dict()
        return out

    def to_json(self) -> bytes:
        """The bytes of ``index.json`` (``encode_shard_index``)."""
        return encode_shard_index(self.to_dict())

    @classmethod
    def from_json(cls, blob: bytes, *, where: str) -> ShardIndex:
        """Parse and validate ``index.json``; ``where`` names the file in errors.

        Raises NotAPackError for a malformed index and FormatVersionError for
        an index or shard format version this reader does not know. Only the
        required fields are checked; informational ones of an unexpected type
        are kept in ``extra``.
        """
        index = loads_json(blob, where=where, what="index", max_bytes=MAX_INDEX_FILE_BYTES)
        _check_shard_index(index, where)
        # format and index_version are constants; one that passed the check in
        # another form (``true`` equals 1) stays in ``extra``, as it is.
        constants = {"format": SHARD_INDEX_FORMAT, "index_version": SHARD_INDEX_VERSION}
        obj = {k: v for k, v in index.items() if not (k in constants and type(v) is type(constants[k]))}
        typed, extra = _typed(obj, cls._CHECKS)
        typed["shards"] = [ShardEntry._from_dict(entry) for entry in typed["shards"]]
        if "split" in typed:
            typed["split"] = ShardSplit._from_dict(typed["split"])
        return cls(**typed, extra=extra)

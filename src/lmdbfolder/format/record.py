"""A record: its key, its 32-byte header, its checksum and the binding of that checksum."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

from lmdbfolder.errors import CorruptRecordError
from lmdbfolder.format.fields import FIELDS_FLAG
from lmdbfolder.format.layout import (
    _CRC,
    _CRC_OFFSET,
    _OFFSET,
    ENCODING_IDS,
    ENCODINGS,
    KEY,
    MAX_INDEX,
    PACK_ID_BYTES,
    RAW_ENCODING_ID,
    RECORD_HEADER,
    RECORD_MAGIC,
    RECORD_VERSION,
)


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
    #: ``FIELDS_FLAG`` for a record of several fields (format 4), else 0.
    flags: int = 0


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
    flags: int = 0,
) -> None:
    """Write the header into ``buf[:32]``, CRC last (it covers the header and the payload)."""
    _check_header_args(label, encoding, width, height, channels)
    if flags not in (0, FIELDS_FLAG):
        raise ValueError(f"record flags must be 0 or {FIELDS_FLAG} (several fields), got {flags}")
    if flags and ENCODING_IDS[encoding] == RAW_ENCODING_ID:
        raise ValueError("a record of several fields holds encoded images, not raw pixels")
    RECORD_HEADER.pack_into(
        buf,
        0,
        RECORD_MAGIC,
        RECORD_VERSION,
        ENCODING_IDS[encoding],
        channels,
        flags,
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
    flags: int = 0,
) -> bytes:
    """Return header + payload for one sample.

    ``width``, ``height`` and ``channels`` are 0 when unknown (for a record of
    several fields, ``flags=FIELDS_FLAG``, they describe field 0). With
    ``binding`` (``pack_binding(meta)``, format 2) and ``index``, the CRC is
    bound to that pack and index (``bind_record``); without, it covers header
    and payload only (format 1, or a record not yet bound). The payload is
    copied once, because an LMDB value must be one contiguous buffer; see
    ``encode_header_into`` to avoid that copy.
    """
    header = bytearray(RECORD_HEADER.size)
    _pack_header(header, payload, label, encoding, width, height, channels, flags)
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
    flags: int = 0,
) -> bytearray | memoryview:
    """Fill in the header of a record whose payload is already at ``value[32:]``.

    The writer reads each file straight into such a buffer, so the payload is
    never copied on its way to LMDB. The CRC is not yet bound (``bind_record``
    does that once the index is known). Returns ``value``.
    """
    payload = memoryview(value)[RECORD_HEADER.size :]
    try:
        _pack_header(value, payload, label, encoding, width, height, channels, flags)
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
    fields: int | None = None,
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

    ``fields``: the number of fields of the pack's samples (format 4), None for
    a pack of one image per sample. A record with ``flags`` bit 0 is refused
    unless ``fields`` is given, and one without it when it is: a record is
    never read as the other kind. The payload returned is then the whole
    payload (offsets and fields: ``format.fields.split_field_payloads``).
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
    if flags or reserved or fields is not None:
        _check_flags(index, flags, reserved, fields, enc_id)
    payload = view[RECORD_HEADER.size :]
    if len(payload) != length:
        raise CorruptRecordError(index, f"payload is {len(payload)} bytes but the header says {length}")
    if enc_id == RAW_ENCODING_ID and (channels != 3 or width * height * 3 != length):
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
    header = RecordHeader(encoding, channels, width, height, label, crc, length, flags)
    return header, payload


def _check_flags(index: int | None, flags: int, reserved: int, fields: int | None, enc_id: int) -> None:
    """``decode_record``'s check of the header's flags (off the path of a record with none)."""
    if reserved or flags & ~FIELDS_FLAG:
        raise CorruptRecordError(index, f"reserved header bits set (flags={flags}, reserved={reserved})")
    if fields is None:
        raise CorruptRecordError(
            index,
            f"reserved header bits set (flags={flags}): bit 0 marks a record of several fields, "
            "but the pack's manifest lists none",
        )
    if not flags:
        raise CorruptRecordError(index, f"the pack's samples have {fields} fields, but the record holds one payload")
    if enc_id == RAW_ENCODING_ID:
        raise CorruptRecordError(index, "a record of several fields says raw pixels: only encoded images are")

"""The pack's constants: format versions, the record header layout, keys, limits, encoding ids."""

from __future__ import annotations

import struct

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
#: Version of a pack whose samples have several fields (an image and its mask,
#: an image and its annotations): format 3 (``__order__``, ``binding_id``,
#: ``next_record``; a fresh pack has ``binding_id`` = ``pack_id`` and the
#: identity order) plus the manifest's ``fields`` and ``layout`` and records
#: whose header has ``flags`` bit 0 set (FORMAT.md, "Several fields per
#: sample"). Readers of versions 1 to 3 refuse such a pack.
FIELDS_FORMAT_VERSION = 4
#: The versions this reader understands; it refuses any other.
READABLE_VERSIONS = (1, 2, 3, 4)
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
#: The id of raw pixels, whose payload the format itself checks (width x height x 3 bytes).
RAW_ENCODING_ID = 0

#: Label of a sample that has none (flat folders).
NO_LABEL = -1

#: Fixed-width fields of the tables (label, path offset, CRC).
_LABEL = struct.Struct("<i")
_OFFSET = struct.Struct("<Q")
_CRC = struct.Struct("<I")

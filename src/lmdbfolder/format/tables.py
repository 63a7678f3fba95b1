"""The pack's tables beside the manifest, each one object that encodes, decodes and checks itself.

A table is the value of one reserved key (FORMAT.md, "Tables"). Each has one
object here (``CHECKS``, ``LABELS``, ``PATHS``, ``ORDER``, ``STATS``,
``HISTORY``, ``SKIPPED``) that owns its bytes (``encode``, ``decode`` or a
zero-copy ``view``) and its rules (``check``: length, content). ``PackTables``
is a pack's tables as a reader loads them (the manifest, the ``__check__``
table, the label table checked in place); it gives every other table checked
when first asked for (``labels``, ``paths``, ``order``...), ``audit``s them all
for ``verify`` (the same rules, each problem reported rather than raised,
plus the ``exhaustive`` ones an open skips); its write half, ``NewTables``,
encodes a new version's tables for the writer and the update. ``SAMPLE_RECORDS`` holds the
rules that bind a record to its sample's tables (its header label, its payload's length
against ``__stats__``), which ``verify`` and an update both check. So the rules of a valid
table are written once, here.

A table's bytes come from a ``TableSource`` (``packfile`` gives one over a
``PageFile``), so this module needs no LMDB code; numpy (a dependency of the
package) is imported where a table is viewed as an array.

Several fields per sample (FORMAT.md, "Fields"): every table here is per
sample or per pack, never per field, so a table of field names can join them
(a new reserved key, named in ``__check__`` like ``__stats__``) without
changing these bytes.
"""

from __future__ import annotations

import array
import collections
import hashlib
import json
import os
import re
import struct
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence

from lmdbfolder.errors import FormatVersionError, NotAPackError
from lmdbfolder.format.layout import (
    _LABEL,
    _OFFSET,
    CHECK_KEY,
    HISTORY_KEY,
    LABELS_KEY,
    MAX_JSON_DEPTH,
    META_KEY,
    NO_LABEL,
    ORDER_KEY,
    PATHS_KEY,
    SKIPPED_KEY,
    STATS_KEY,
    UNKNOWN_MTIME,
)
from lmdbfolder.format.manifest import (
    DAMAGED_HINT,
    Manifest,
    decode_meta,
    encode_meta,
    informational,
    loads_json,
    pack_binding,
)
from lmdbfolder.format.record import checksum

__all__ = [
    "TableDamage",
    "TableSource",
    "CHECKS",
    "LABELS",
    "PATHS",
    "ORDER",
    "STATS",
    "HISTORY",
    "SKIPPED",
    "RECORD_CLASSES",
    "SAMPLE_RECORDS",
    "PackTables",
    "Audit",
    "NewTables",
    "class_counts",
]


class TableDamage(NotAPackError):
    """A table breaks a rule of the format. ``why`` is the rule broken (without the pack's
    path), ``kind`` what ``verify`` calls it: ``checksum`` (its length or CRC-32 differs
    from ``__check__``, or ``__check__`` does not cover it), ``order`` (``__order__``
    names a record key twice), else ``table``."""

    def __init__(self, where: Any, why: str, hint: str | None = None, *, kind: str = "table") -> None:
        super().__init__(where, why, hint)
        self.why = why
        self.kind = kind


class TableSource(Protocol):
    """Where a pack's tables are read from (``packfile`` gives one over a ``PageFile``)."""

    where: str

    def get(self, key: bytes) -> memoryview | None:
        """The value of ``key`` (zero-copy), or None; NotAPackError if it cannot be read."""

    def size(self, key: bytes) -> int | None:
        """The length of ``key``'s value without reading it, or None when it is missing."""


# -- the table checksums (__check__) -----------------------------------------------------
class ChecksumTable:
    """``__check__`` (format 2): for each table, ``[length, crc32]``, as canonical JSON.

    Decoded, it is a ``dict``: table key -> (length, crc32)."""

    key = CHECK_KEY
    #: The most bytes a ``__check__`` may hold (one entry per table).
    max_bytes = 4096

    def encode(self, tables: Mapping[bytes, bytes | bytearray | memoryview]) -> bytes:
        """The ``__check__`` value covering every table of ``tables``."""
        return encode_meta({key.decode(): [len(blob), checksum(blob)] for key, blob in tables.items()})

    def decode(self, blob: bytes | memoryview | None, *, where: str) -> dict[bytes, tuple[int, int]]:
        """Parse ``__check__``; TableDamage if missing or malformed."""
        if blob is None:
            raise TableDamage(where, f"its table checksums (key {CHECK_KEY.decode()}) are missing")
        check = loads_json(
            blob, where=where, what=f"table checksums (key {CHECK_KEY.decode()})", max_bytes=self.max_bytes
        )
        out: dict[bytes, tuple[int, int]] = {}
        if isinstance(check, dict):
            for name, entry in check.items():
                if isinstance(entry, list) and len(entry) == 2 and all(type(x) is int and x >= 0 for x in entry):
                    out[name.encode("ascii", "replace")] = (entry[0], entry[1])
        if not isinstance(check, dict) or len(out) != len(check) or not {META_KEY, LABELS_KEY, PATHS_KEY} <= set(out):
            raise TableDamage(where, f"its table checksums (key {CHECK_KEY.decode()}) are malformed")
        return out

    def check(
        self, check: Mapping[bytes, tuple[int, int]], key: bytes, blob: bytes | memoryview, *, where: str
    ) -> None:
        """TableDamage unless ``blob`` (the value of table ``key``) has the length and
        CRC-32 that ``check`` gives it."""
        self.check_length(check, key, len(blob), where=where)
        if checksum(blob) != check[key][1]:
            raise TableDamage(where, _damaged(key), DAMAGED_HINT, kind="checksum")

    def check_length(self, check: Mapping[bytes, tuple[int, int]], key: bytes, length: int, *, where: str) -> None:
        """The cheap half of ``check`` (no byte read): ``check`` covers ``key`` with this length."""
        if key not in check:
            raise TableDamage(where, f"its table checksums do not cover {key.decode()}", DAMAGED_HINT, kind="checksum")
        if length != check[key][0]:
            raise TableDamage(where, _damaged(key), DAMAGED_HINT, kind="checksum")


def _damaged(key: bytes) -> str:
    return f"its {key.decode()} table is damaged (its length or CRC-32 differs from {CHECK_KEY.decode()})"


CHECKS = ChecksumTable()


# -- per-sample tables --------------------------------------------------------------------
def _length(key: bytes, blob: bytes | memoryview, expected: int, where: str) -> None:
    if len(blob) != expected:
        raise TableDamage(where, f"{key.decode()} holds {len(blob)} bytes, expected {expected}")


class LabelTable:
    """``__labels__``: every sample's class index (or -1, unlabelled) as little-endian int32."""

    key = LABELS_KEY
    what = "label table"

    def encode(self, labels: Sequence[int]) -> bytes:
        """The table of ``labels`` (an ``array('i')`` is encoded without a Python int per label)."""
        if isinstance(labels, array.array) and labels.typecode == "i" and labels.itemsize == _LABEL.size:
            return self.encode_array(labels)
        return struct.pack(f"<{len(labels)}i", *labels)

    def encode_array(self, labels: array.array) -> bytes:
        """``encode`` of an ``array('i')`` (int32) without a Python int per label."""
        if sys.byteorder == "little":
            return labels.tobytes()
        swapped = array.array("i", labels)
        swapped.byteswap()
        return swapped.tobytes()

    def decode(self, blob: bytes | memoryview, count: int, *, where: str) -> array.array:
        """A compact ``array('i')`` (4 bytes a sample), its length checked.

        A compact array rather than a list of ints keeps a million-sample pack's
        labels at 4 MB and out of the way of copy-on-write after fork.
        """
        _length(self.key, blob, count * _LABEL.size, where)
        labels = array.array("i")
        labels.frombytes(blob)  # straight from the (zero-copy) value: no transient bytes copy
        if sys.byteorder != "little":
            labels.byteswap()
        return labels

    def view(self, blob: bytes | memoryview, count: int, *, where: str) -> Any:
        """A read-only little-endian int32 numpy view of ``blob`` (no copy), its length checked."""
        import numpy as np

        _length(self.key, blob, count * _LABEL.size, where)
        return np.frombuffer(blob, dtype="<i4")

    def check(self, labels: Any, n_classes: int, *, where: str) -> None:
        """TableDamage unless every label is -1 (unlabelled) or a class index ``0..n_classes-1``."""
        import numpy as np

        if not len(labels):
            return
        values = labels if isinstance(labels, np.ndarray) else np.frombuffer(labels, dtype=np.int32)
        low, high = int(values.min()), int(values.max())
        if low < NO_LABEL or high >= n_classes:
            bad = int(np.flatnonzero((values < NO_LABEL) | (values >= n_classes))[0])
            raise TableDamage(
                where,
                f"its label table gives sample {bad} the label {int(values[bad])}, "
                f"not a class index (0..{n_classes - 1}) or -1",
            )


LABELS = LabelTable()


class PathTable:
    """``__paths__``: ``count + 1`` little-endian u64 offsets, then every sample's relative path.

    Names are the file system's bytes (``os.fsencode``, UTF-8 on Linux), so any
    file name round-trips, including names that are not valid UTF-8. Path ``i``
    is ``names[offsets[i]:offsets[i + 1]]``.
    """

    key = PATHS_KEY
    what = "path table"

    def encode(self, paths: Iterable[str]) -> bytes:
        """The table of ``paths``."""
        encoded = [os.fsencode(p) for p in paths]
        offsets = [0]
        for name in encoded:
            offsets.append(offsets[-1] + len(name))
        return struct.pack(f"<{len(offsets)}Q", *offsets) + b"".join(encoded)

    def encode_parts(self, offsets: Any, names: bytes | memoryview) -> bytearray:
        """``encode`` from parts: ``offsets`` a buffer of ``count + 1`` native uint64 (the
        first 0, the last ``len(names)``), ``names`` every name's bytes in order. One
        allocation, no Python object per path."""
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

    def check(self, blob: bytes | memoryview, count: int, *, where: str) -> None:
        """TableDamage unless ``blob`` is a well-formed path table for ``count`` samples
        (then ``path_at`` stays inside it for every index)."""
        import numpy as np

        base = (count + 1) * _OFFSET.size
        if len(blob) < base:
            raise TableDamage(where, f"{PATHS_KEY.decode()} is too short for {count} samples")
        offsets = np.frombuffer(blob, dtype="<u8", count=count + 1)
        if int(offsets[0]) != 0 or base + int(offsets[-1]) != len(blob) or bool(np.any(offsets[1:] < offsets[:-1])):
            raise TableDamage(where, f"{PATHS_KEY.decode()} has inconsistent offsets")

    def path_at(self, blob: bytes | memoryview, count: int, index: int) -> str:
        """Path ``index`` without parsing the rest (``check`` first: this trusts the offsets)."""
        start, end = struct.unpack_from("<2Q", blob, index * _OFFSET.size)
        base = (count + 1) * _OFFSET.size
        return os.fsdecode(bytes(blob[base + start : base + end]))

    def decode(self, blob: bytes | memoryview, count: int, *, where: str) -> list[str]:
        """Every path, checked first (TableDamage if malformed)."""
        self.check(blob, count, where=where)
        base = (count + 1) * _OFFSET.size
        offsets = struct.unpack_from(f"<{count + 1}Q", blob)
        names = bytes(blob[base:])
        return [os.fsdecode(names[a:b]) for a, b in zip(offsets, offsets[1:])]


PATHS = PathTable()


class OrderTable:
    """``__order__`` (format 3): the record key of every sample, in sample order, as
    little-endian u64. Keys are distinct and below the manifest's ``next_record``
    (the key the next new record gets), so a record is never shared by two samples
    and never overwritten by an update."""

    key = ORDER_KEY
    what = "record order"

    def encode(self, keys: Any) -> bytes:
        """The table of ``keys`` (any sequence or array of integers)."""
        import numpy as np

        return np.asarray(keys, dtype="<u8").tobytes()

    def view(self, blob: bytes | memoryview, count: int, *, where: str) -> Any:
        """A read-only little-endian u64 numpy view of ``blob`` (no copy), its length checked."""
        import numpy as np

        _length(self.key, blob, count * _OFFSET.size, where)
        return np.frombuffer(blob, dtype="<u8")

    def check(self, keys: Any, next_record: int, *, where: str, exhaustive: bool = False) -> None:
        """TableDamage unless every key is below ``next_record`` (one pass: a reader's
        open pays it with the CRC); ``exhaustive`` (verify, an update): and no key twice
        (a sort)."""
        import numpy as np

        if len(keys) and int(keys.max()) >= next_record:
            raise TableDamage(
                where,
                f"its {ORDER_KEY.decode()} names record key {int(keys.max())}, not below next_record={next_record}: "
                "an update would write a new record over it",
            )
        if exhaustive:
            twice = len(keys) - len(np.unique(keys))
            if twice:
                raise TableDamage(where, f"{ORDER_KEY.decode()} names {twice} record key(s) twice", kind="order")


ORDER = OrderTable()

#: One ``__stats__`` entry: the source file's size and modification time in ns.
STAT_DTYPE = [("size", "<u8"), ("mtime_ns", "<i8")]


class StatsTable:
    """``__stats__`` (optional): every sample's source file size (u64 LE) and modification
    time in nanoseconds (i64 LE; ``UNKNOWN_MTIME`` if unknown) when it was read."""

    key = STATS_KEY
    what = "file stats"

    def encode(self, sizes: Any, mtimes: Any) -> bytes:
        """The table of ``sizes`` and ``mtimes`` (sequences or arrays, one entry a sample)."""
        import numpy as np

        sizes = np.asarray(sizes, dtype="<u8")
        out = np.empty(len(sizes), dtype=STAT_DTYPE)
        out["size"] = sizes
        out["mtime_ns"] = np.asarray(mtimes, dtype="<i8")
        return out.tobytes()

    def view(self, blob: bytes | memoryview, count: int, *, where: str) -> Any:
        """A read-only numpy view (fields ``size``, ``mtime_ns``), its length checked."""
        import numpy as np

        _length(self.key, blob, count * np.dtype(STAT_DTYPE).itemsize, where)
        return np.frombuffer(blob, dtype=STAT_DTYPE)


STATS = StatsTable()


class JsonListTable:
    """A table that is a JSON list of objects (canonical JSON, ASCII): ``__history__``
    (the pack, then each update) and ``__skipped__`` (``{path, reason}`` of the files left out)."""

    def __init__(self, key: bytes, what: str, *, strict: bool, keep: int | None = None) -> None:
        self.key = key
        self.what = what
        #: Whether an entry that is not an object makes the table malformed (else it is dropped).
        self.strict = strict
        #: Entries held at most (the first one and the last ``keep - 1``; None: all), with
        #: a ``{"event": "truncated", "dropped": n}`` entry after the first saying how many
        #: were left out. The table is read an entry at a time, so memory follows what is
        #: kept, not the table's size (a 150 MB history once took 4.4 GB as Python objects).
        self.keep = keep

    def encode(self, items: Sequence[Mapping[str, Any]]) -> bytes:
        """The table of ``items``."""
        return json.dumps(list(items), sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")

    def decode(self, blob: bytes | memoryview, *, where: str) -> list[dict[str, Any]]:
        """The list (TableDamage if malformed); with ``keep``, its first entry and last
        ``keep - 1`` ones, and a ``truncated`` entry between them counting the others."""
        what = f"{self.what} ({self.key.decode()})"
        if self.keep is None or len(blob) <= _WHOLE_JSON_LIST:
            items = loads_json(blob, where=where, what=what, max_bytes=1 << 30)
            if not isinstance(items, list) or (self.strict and not all(isinstance(item, dict) for item in items)):
                raise TableDamage(where, f"its {self.key.decode()} is not a list{' of objects' if self.strict else ''}")
            items = [item for item in items if isinstance(item, dict)]
            return items if self.keep is None else _kept(items, len(items), self.keep)
        # Large: the entries are found by their brackets (no Python object made), and only
        # those kept are parsed: the first, and the last ones within ``_KEPT_JSON_BYTES``.
        if len(blob) > 1 << 30:
            raise TableDamage(where, f"its {what} is {len(blob):,} bytes, more than the {1 << 30:,} allowed")
        try:
            text = str(blob, "utf-8")
        except UnicodeDecodeError:
            raise TableDamage(where, f"its {what} is not valid UTF-8 JSON") from None
        first: list[tuple[int, int]] = []
        tail: collections.deque[tuple[int, int]] = collections.deque()
        total = held = 0
        for start, end in _json_list_entries(text, where, what):
            total += 1
            if end - start > _KEPT_JSON_BYTES // 4:
                continue  # one entry this large is not a history entry of ours: left out
            if not first:
                first.append((start, end))
                continue
            tail.append((start, end))
            held += end - start
            while len(tail) > self.keep - 1 or held > _KEPT_JSON_BYTES:
                a, b = tail.popleft()
                held -= b - a
        items = [_json_entry(text, a, b, where, what) for a, b in [*first, *tail]]
        kept = [item for item in items if isinstance(item, dict)]
        return _kept(kept, total - (len(items) - len(kept)), self.keep, cut=total > len(items))


#: A JSON list table up to this many bytes is parsed whole; a longer one, an entry at a time.
_WHOLE_JSON_LIST = 4 << 20
#: The JSON of the entries a long list table keeps, at most (and a quarter of it, one entry).
_KEPT_JSON_BYTES = 16 << 20
#: The history entries a reader holds (and an update writes back): the pack's creation and
#: the last ones; a ``truncated`` entry counts those left out.
HISTORY_KEEP = 1000


def _kept(items: list[dict[str, Any]], total: int, keep: int, *, cut: bool = False) -> list[dict[str, Any]]:
    """``items`` (the first of ``total`` entries and the last ones read) cut to the first and
    the last ``keep - 1``, with one ``truncated`` entry after the first counting every entry
    left out (an earlier ``truncated`` entry's count included); ``cut``: some were left out
    already."""
    if total <= keep and len(items) == total and not cut:
        return items
    head, rest = items[:1], items[1:]
    earlier = [e for e in rest if e.get("event") == "truncated"]
    rest = [e for e in rest if e.get("event") != "truncated"]
    kept = rest[-(keep - 1) :] if keep > 1 else []
    dropped = total - len(head) - len(kept) - len(earlier)
    for e in earlier:
        if type(e.get("dropped")) is int and e["dropped"] > 0:
            dropped += e["dropped"]
    marker = {"event": "truncated", "dropped": dropped}
    return [*head, marker, *kept] if dropped > 0 else [*head, *kept]


# Everything up to the next bracket outside a string (strings skipped inside the regular
# expression engine, not one Python step each), then that bracket.
_TOKENS = re.compile(r'(?:[^"\[\]{}]++|"[^"\\]*+(?:\\.[^"\\]*+)*+")*+([\[\]{}])')


def _json_list_entries(text: str, where: str, what: str) -> Iterator[tuple[int, int]]:
    """Where each object or array entry of the JSON list ``text`` starts and ends (a scan of
    its strings and brackets: entries that are neither are not history entries, and are
    skipped); TableDamage when it is not a list or its brackets do not close."""
    head = text.lstrip(" \t\n\r")
    if not head.startswith("["):
        raise TableDamage(where, f"its {what} is not a list")
    depth, start = 0, -1
    for m in _TOKENS.finditer(text):
        at = m.start(1)
        c = text[at]
        if c in "[{":
            depth += 1
            if depth == 2:
                start = at
            elif depth > MAX_JSON_DEPTH:
                raise TableDamage(where, f"its {what} is nested more than {MAX_JSON_DEPTH} levels deep")
        else:
            depth -= 1
            if depth == 1 and start >= 0:
                yield start, at + 1
                start = -1
            elif depth == 0:
                if text[at + 1 :].strip(" \t\n\r"):
                    raise TableDamage(where, f"its {what} is not valid JSON (data after the list)")
                return
            elif depth < 0:
                break
    raise TableDamage(where, f"its {what} is not valid JSON (its brackets do not close)")


def _json_entry(text: str, start: int, end: int, where: str, what: str) -> Any:
    """The JSON value of ``text[start:end]`` (TableDamage if it is not one)."""
    try:
        value, stop = json.JSONDecoder().raw_decode(text[start:end])
    except (ValueError, RecursionError) as exc:
        raise TableDamage(where, f"its {what} is not valid JSON: {exc}") from None
    if stop != end - start:
        raise TableDamage(where, f"its {what} is not valid JSON (at character {start + stop:,})")
    return value


HISTORY = JsonListTable(HISTORY_KEY, "history", strict=False, keep=HISTORY_KEEP)
SKIPPED = JsonListTable(SKIPPED_KEY, "list of skipped files", strict=True)


class RecordClasses:
    """The manifest's ``record_classes`` (format 3) as the bridge between a record's header
    label and its sample's label: header label ``h`` names class ``record_classes[h]``
    (``format.label_map``). A valid one holds every class of the pack (the writer only
    appends to it), and maps each record's header label to its sample's label."""

    def check(self, meta: Mapping[str, Any], *, where: str) -> None:
        """TableDamage unless ``record_classes`` (if any) names every class of ``classes``
        (``meta``: a ``Manifest``, or its JSON object)."""
        names = meta.get("record_classes") if meta.get("format_version", 1) >= 3 else None
        if names is None:
            return
        named = set(names)
        missing = [name for name in meta["classes"] if name not in named]
        if missing:
            raise TableDamage(
                where, f"its record_classes lack the class {str(missing[0])[:80]!r}: they are not the pack's classes"
            )

    def sample_label(self, header_label: int, mapping: Sequence[int]) -> int | None:
        """The sample label a record's ``header_label`` gives through ``mapping`` (``label_map``),
        None when it names no class of the pack (a removed class's, or none at all)."""
        if not 0 <= header_label < len(mapping) or mapping[header_label] < 0:
            return None
        return int(mapping[header_label])

    def check_records(self, header_labels: Any, labels: Any, mapping: Any, *, where: str) -> None:
        """TableDamage unless every record's header label (``header_labels``, -1:
        unlabelled), through ``mapping`` (``label_map``; None: the same), is its sample's
        label (``labels``): a permuted ``record_classes`` serves labels that are not the
        targets (``SAMPLE_RECORDS``' label rule, sample ``k`` the ``k``-th given)."""
        SAMPLE_RECORDS.check(header_labels, None, labels, None, mapping, where=where)


RECORD_CLASSES = RecordClasses()


class SampleRecords:
    """What binds a stored record to its sample, beyond the key ``__order__`` gives it
    (the CRC binds a record to its key, not to its sample, so a swap of two ``__order__``
    entries leaves every checksum valid): the rules ``verify`` checks of every record
    and ``pack --update`` of every record before it keeps one.

    * Its header label, through ``record_classes`` (``mapping``, ``label_map``), is the
      sample's label in ``__labels__``.
    * In a pack that stores each file's bytes as they are (``exact_sizes``: encoded, not
      resized, one image a sample), its payload is as long as the file ``__stats__``
      says was read (where it knows the file: a known modification time).

    A swap of two samples of one class whose files have the same size (where the size
    rule does not apply: of any two of one class) breaks neither rule: nothing in the pack
    tells those two records apart (no table holds a digest of each file, and
    ``__paths__`` names samples, not records); ``verify --against SRC`` compares the
    bytes with the source files.
    """

    def exact_sizes(self, meta: Manifest, stats: Any) -> Any:
        """Per sample, the payload length its record must have (int64; -1: not known),
        from ``__stats__`` (``stats``, None: the pack has none); None when the pack's
        records are not the files' bytes (raw pixels, resized, several fields)."""
        import numpy as np

        params = meta.params
        if (
            stats is None
            or meta.store != "encoded"
            or meta.field_specs is not None
            or not isinstance(params, dict)
            or params.get("max_size") is not None
        ):
            return None
        sizes = np.asarray(stats["size"], dtype=np.int64)
        return np.where(np.asarray(stats["mtime_ns"]) == UNKNOWN_MTIME, -1, sizes)

    def mismatches(
        self, header_labels: Any, payload_lens: Any, labels: Any, sizes: Any, mapping: Any
    ) -> list[tuple[int, str, str]]:
        """``(k, kind, why)`` for each record ``k`` of the arrays given that is not its
        sample's: ``header_labels`` (its header's label; -1: unlabelled) through ``mapping``
        (``label_map``; None: the same) against the label table's ``labels`` (None: not
        known), ``payload_lens`` against ``sizes`` (``exact_sizes``' entries; None, or -1 in
        an entry: not known). ``why`` follows "the record of sample N" ("is labelled 2, its
        label table says 1"). Whole arrays at once: an update checks every record by it."""
        import numpy as np

        header = np.asarray(header_labels, dtype=np.int64)
        sample = header
        no_class = np.zeros(len(header), dtype=bool)
        if mapping is not None:
            lookup = np.append(np.asarray(mapping, dtype=np.int64), NO_LABEL)  # -1 indexes "no label"
            inside = (header >= NO_LABEL) & (header < len(lookup) - 1)
            sample = np.where(inside, lookup[np.where(inside, header, NO_LABEL)], -2)
            no_class = sample < NO_LABEL  # a removed class's (-2 in the map), or no class at all
        bad_label = np.zeros(len(header), dtype=bool)
        if labels is not None:
            bad_label = ~no_class & (sample != np.asarray(labels, dtype=np.int64))
        bad_size = np.zeros(len(header), dtype=bool)
        if sizes is not None:
            known = np.asarray(sizes, dtype=np.int64)
            bad_size = ~no_class & ~bad_label & (known >= 0) & (np.asarray(payload_lens, dtype=np.int64) != known)
        out = []
        for k in np.flatnonzero(no_class | bad_label | bad_size).tolist():
            h = int(header[k])
            if no_class[k]:
                kind, why = "label", f"has the header label {h}, which names no class of the pack (record_classes)"
            elif bad_label[k]:
                through = f" through record_classes (header label {h})" if mapping is not None and h != NO_LABEL else ""
                kind, why = "label", f"is labelled {int(sample[k])}{through}, its label table says {int(labels[k])}"
            else:
                length, size = int(payload_lens[k]), int(sizes[k])
                why = f"holds {length:,} bytes, but the file it was read from had {size:,} ({STATS_KEY.decode()})"
                kind = "size"
            out.append((k, kind, why))
        return out

    def check(
        self,
        header_labels: Any,
        payload_lens: Any,
        labels: Any,
        sizes: Any,
        mapping: Any,
        *,
        where: str,
        hint: str | None = None,
        describe: Callable[[int], str] = "sample {}".format,
    ) -> None:
        """TableDamage (with ``hint``) naming the first record that breaks a rule of
        ``mismatches`` (``describe(k)`` says which sample record ``k`` is) and how many do."""
        wrong = self.mismatches(header_labels, payload_lens, labels, sizes, mapping)
        if wrong:
            k, kind, why = wrong[0]
            raise TableDamage(
                where, f"the record of {describe(k)} {why} ({len(wrong)} sample(s) differ)", hint, kind=kind
            )


SAMPLE_RECORDS = SampleRecords()


def class_counts(labels: Any, classes: int) -> Any:
    """Samples per class index ``0..classes-1`` of int32 labels (any buffer);
    labels outside that range are not counted.

    Labels sorted by class (every ImageFolder pack) are counted by binary
    search: under 1 ms at 1.28M samples. Work goes in chunks, so temporaries
    stay under a megabyte whatever the count (``bincount`` alone would make
    an 8-byte copy of every label).
    """
    import numpy as np

    values = labels if isinstance(labels, np.ndarray) else np.frombuffer(labels, dtype=np.int32)
    n = len(values)
    if n and values[0] >= 0 and values[-1] < classes and _is_sorted(values):
        edges = np.searchsorted(values, np.arange(classes + 1, dtype=values.dtype), side="left")
        return np.diff(edges)
    counts = np.zeros(classes, dtype=np.int64)
    for start in range(0, n, _CHUNK):
        chunk = values[start : start + _CHUNK]
        chunk = chunk[(chunk >= 0) & (chunk < classes)]
        counts += np.bincount(chunk, minlength=classes)[:classes]
    return counts


def _is_sorted(values: Any) -> bool:
    import numpy as np

    n = len(values)
    return all(
        bool(np.all(values[start + 1 : start + _CHUNK + 1] >= values[start : min(n - 1, start + _CHUNK)]))
        for start in range(0, n - 1, _CHUNK)
    )


_CHUNK = 1 << 15


# -- a pack's tables ----------------------------------------------------------------------
def _required(source: TableSource, key: bytes, what: str) -> memoryview:
    value = source.get(key)
    if value is None:
        raise TableDamage(source.where, f"its {what} (key {key.decode()}) is missing", DAMAGED_HINT)
    return value


@dataclass(frozen=True)
class PackTables:
    """What a reader needs of a pack before its first record, every part checked (``load``);
    the other tables, each checked when first asked for."""

    meta: Manifest
    #: Samples per class index (the label table's counts), from the check at open.
    class_counts: Any
    #: Format 2: what every record's CRC is bound to (the pack id); None for format 1.
    binding: bytes | None
    #: Format 2: the parsed ``__check__``; None for format 1.
    check: dict[bytes, tuple[int, int]] | None
    #: Names this pack among all others: its ``pack_id`` (format 2), or the
    #: SHA-256 of its manifest (format 1).
    identity: str
    #: SHA-256 of the manifest's bytes: the same bytes are the same pack, so a
    #: process reopening the file need not parse the manifest again.
    manifest_sha256: bytes
    #: Format 3 with ``record_classes``: header label -> sample label
    #: (``format.label_map``; -2 for a class the pack no longer has). None: the same.
    label_map: Any = None

    @property
    def ordered(self) -> bool:
        """Whether sample ``i`` is the record under key ``__order__[i]`` (format 3), not key ``i``."""
        return self.version >= 3

    @property
    def version(self) -> int:
        """The pack's format version."""
        return self.meta.format_version

    @property
    def count(self) -> int:
        """The number of samples."""
        return self.meta.count

    @property
    def next_record(self) -> int:
        """The key the next new record gets: above every key in use (format 3), else the count."""
        if not self.ordered or self.meta.next_record is None:
            return self.count
        return self.meta.next_record

    # -- open -------------------------------------------------------------------------
    @classmethod
    def load(cls, source: TableSource, meta_blob: memoryview) -> PackTables:
        """Read and check the manifest ``meta_blob`` and the tables a reader needs at open.

        Checks: the manifest (``decode_meta``); for format 2, ``__check__`` and the
        manifest's and label table's length and CRC-32 against it, and that the path
        table has the length it gives; the label table's length (4 x count) and that
        every label is -1 or a class index; format 3, that ``__order__`` has its length
        and ``record_classes`` names every class. TableDamage names what is wrong. The
        other tables are checked when first used (``paths``, ``order``...): an open
        touches no page of them.
        """
        where = source.where
        check = cls._check_manifest(source, meta_blob)
        meta = decode_meta(meta_blob, where=where)
        if meta.format_version < 2:
            check = None
        elif check is None:
            check = CHECKS.decode(None, where=where)  # raises: format 2 has table checksums
        labels_blob = _required(source, LABELS_KEY, LABELS.what)
        if check is not None:
            CHECKS.check(check, LABELS_KEY, labels_blob, where=where)
        # Checked and counted in place: the copy (``labels``) is made when a caller asks
        # for it, which opening a dataset does not (its first-touch page faults were
        # half of LMDBFolder's open at 1.28M samples).
        labels = LABELS.view(labels_blob, meta.count, where=where)
        LABELS.check(labels, len(meta.classes), where=where)
        counts = class_counts(labels, len(meta.classes))
        del labels
        paths_size = source.size(PATHS_KEY)
        if paths_size is None:
            raise TableDamage(where, f"its path table (key {PATHS_KEY.decode()}) is missing", DAMAGED_HINT)
        if check is not None and PATHS_KEY in check and paths_size != check[PATHS_KEY][0]:
            raise TableDamage(
                where, f"its {PATHS_KEY.decode()} table has the wrong length", DAMAGED_HINT, kind="checksum"
            )
        tables = cls.of(meta, meta_blob, check, counts)
        if tables.ordered:
            tables._order_blob(source)  # the record keys: present, of the right length
            RECORD_CLASSES.check(meta, where=where)
        return tables

    @classmethod
    def of(cls, meta: Manifest, meta_blob: bytes | memoryview, check: Any = None, counts: Any = None) -> PackTables:
        """The tables of the parsed manifest ``meta`` (its bytes ``meta_blob``), nothing else
        read or checked (``load`` checks; ``verify`` audits)."""
        digest = hashlib.sha256(meta_blob).digest()
        mapping = meta.label_map
        return cls(
            meta,
            counts,
            pack_binding(meta),
            check,
            identity(meta, digest),
            digest,
            None if mapping is None else _int64(mapping),
        )

    @staticmethod
    def _check_manifest(source: TableSource, meta_blob: memoryview) -> dict[bytes, tuple[int, int]] | None:
        """The parsed ``__check__`` (None: there is none), the manifest checked against it.

        Checked before the manifest is parsed: a damaged one is said to be damaged, not
        "invalid". Unless it names a newer format version: a newer writer may mean
        something else by ``__check__``, and "upgrade" is the answer then
        (``decode_meta`` raises FormatVersionError).
        """
        where = source.where
        check_blob = source.get(CHECK_KEY)
        if check_blob is None:
            return None
        check = CHECKS.decode(check_blob, where=where)
        try:
            CHECKS.check(check, META_KEY, meta_blob, where=where)
        except NotAPackError as damaged:
            try:
                decode_meta(meta_blob, where=where)
            except FormatVersionError:
                raise
            except NotAPackError:
                pass
            raise damaged from None
        return check

    # -- the tables, each checked when first used ------------------------------------------
    def _covered(self, source: TableSource, key: bytes, blob: memoryview) -> memoryview:
        if self.check is not None:
            CHECKS.check(self.check, key, blob, where=source.where)
        return blob

    def _order_blob(self, source: TableSource) -> memoryview:
        blob = _required(source, ORDER_KEY, ORDER.what)
        if self.check is None or ORDER_KEY not in self.check:
            raise TableDamage(
                source.where, f"its table checksums do not cover {ORDER_KEY.decode()}", DAMAGED_HINT, kind="checksum"
            )
        if len(blob) != self.check[ORDER_KEY][0]:
            raise TableDamage(
                source.where, f"its {ORDER_KEY.decode()} table has the wrong length", DAMAGED_HINT, kind="checksum"
            )
        ORDER.view(blob, self.count, where=source.where)
        return blob

    def order(self, source: TableSource, *, exhaustive: bool = False) -> Any:
        """Format 3: the record key of every sample (a zero-copy u64 view), checked against
        ``__check__`` and ``next_record`` (``exhaustive``: and that no key is named twice)."""
        keys = ORDER.view(self._covered(source, ORDER_KEY, self._order_blob(source)), self.count, where=source.where)
        ORDER.check(keys, self.next_record, where=source.where, exhaustive=exhaustive)
        return keys

    def labels(self, source: TableSource) -> array.array:
        """The label table as a compact ``array('i')`` (a copy), checked again: against
        ``__check__`` for format 2 (the bytes ``load`` checked), every label for format 1."""
        blob = self._covered(source, LABELS_KEY, _required(source, LABELS_KEY, LABELS.what))
        labels = LABELS.decode(blob, self.count, where=source.where)
        if self.check is None:
            LABELS.check(labels, len(self.meta.classes), where=source.where)
        return labels

    def paths(self, source: TableSource) -> memoryview:
        """The path table, checked (against ``__check__`` for format 2, and its offsets)."""
        blob = self._covered(source, PATHS_KEY, _required(source, PATHS_KEY, PATHS.what))
        PATHS.check(blob, self.count, where=source.where)
        return blob

    def _optional(self, source: TableSource, key: bytes, what: str) -> memoryview | None:
        # An optional table (__stats__, __history__, __skipped__): None when the pack has
        # none (its __check__ does not name it), checked against __check__ otherwise.
        if self.check is None or key not in self.check:
            return None
        return self._covered(source, key, _required(source, key, what))

    def stats(self, source: TableSource) -> Any:
        """The size and modification time each sample's source file had when it was read
        (a zero-copy view with fields ``size`` and ``mtime_ns``), or None for a pack
        without them (written before they were recorded, or by ``import``)."""
        blob = self._optional(source, STATS_KEY, f"{STATS_KEY.decode()} table")
        return None if blob is None else STATS.view(blob, self.count, where=source.where)

    def history(self, source: TableSource) -> list[dict[str, Any]]:
        """The pack's history (the pack, then each update), oldest first; [] for a pack without one."""
        blob = self._optional(source, HISTORY_KEY, f"{HISTORY_KEY.decode()} table")
        return [] if blob is None else HISTORY.decode(blob, where=source.where)

    def skipped(self, source: TableSource) -> list[dict[str, Any]] | str:
        """The source files the writer left out (``{path, reason}``), or ``"invalid"``.

        Format 2 keeps them in ``__skipped__`` (checked against ``__check__``);
        format 1 in the manifest.
        """
        if self.version < 2:
            items = informational(self.meta, "skipped", [])
            return items if isinstance(items, list) else str(items)
        blob = source.get(SKIPPED_KEY)  # a damaged page on the way is an error even when __check__ lacks it
        if self.check is None or SKIPPED_KEY not in self.check:
            return []
        if blob is None:
            raise TableDamage(
                source.where, f"its list of skipped files (key {SKIPPED_KEY.decode()}) is missing", DAMAGED_HINT
            )
        return SKIPPED.decode(self._covered(source, SKIPPED_KEY, blob), where=source.where)

    # -- verify ---------------------------------------------------------------------------
    def audit(self, source: TableSource, meta_blob: memoryview) -> Audit:
        """Every table checked with every rule (``exhaustive`` ones included), each problem
        kept (``Audit.problems``) rather than raised, so that the rest is still checked;
        the tables that pass are decoded for the checks of the records."""
        return Audit.of(self, source, meta_blob)


def identity(meta: Manifest, manifest_sha256: bytes) -> str:
    """The identity of a pack (``PackTables.identity``) from its parsed manifest and its digest."""
    return meta.identity(manifest_sha256)


def _int64(values: Sequence[int]) -> Any:
    import numpy as np

    return np.asarray(values, dtype=np.int64)


@dataclass
class Audit:
    """``PackTables.audit``'s verdict: the problems (``TableDamage``, in the order found),
    and what of the tables could be decoded (None: damaged or missing, a problem says why)."""

    problems: list[TableDamage]
    labels: Any = None
    paths: list[str] | None = None
    order: Any = None
    skipped: Any = None
    stats: Any = None

    @classmethod
    def of(cls, tables: PackTables, source: TableSource, meta_blob: memoryview) -> Audit:
        """Audit ``tables`` (loaded from ``source``, manifest ``meta_blob``); see ``PackTables.audit``."""
        where, count, version = source.where, tables.count, tables.version
        out = cls([], skipped=[] if version >= 2 else tables.skipped(source))
        check = tables.check
        keys = [LABELS_KEY, PATHS_KEY] + ([ORDER_KEY] if version >= 3 else []) + ([SKIPPED_KEY] if version >= 2 else [])
        if version >= 2:
            try:
                check = CHECKS.decode(source.get(CHECK_KEY), where=where)
            except NotAPackError as exc:
                out._add(exc)
            keys += [key for key in (STATS_KEY, HISTORY_KEY) if check is not None and key in check]
            if version >= 3 and check is not None and ORDER_KEY not in check:
                out._add(TableDamage(where, f"the table checksums do not cover {ORDER_KEY.decode()}", kind="checksum"))
        blobs = {key: out._get(source, key) for key in keys}
        if check is not None:
            for key, blob in ((META_KEY, meta_blob), *blobs.items()):
                if blob is not None:
                    out._try(CHECKS.check, check, key, blob, where=where)
        rules: dict[bytes, Callable[[memoryview], Any]] = {
            LABELS_KEY: lambda b: out._labels(b, count, len(tables.meta.classes), where),
            PATHS_KEY: lambda b: setattr(out, "paths", PATHS.decode(b, count, where=where)),
            ORDER_KEY: lambda b: out._order(b, count, tables.next_record, where),
            STATS_KEY: lambda b: setattr(out, "stats", STATS.view(b, count, where=where)),
            HISTORY_KEY: lambda b: HISTORY.decode(b, where=where),
            SKIPPED_KEY: lambda b: setattr(out, "skipped", SKIPPED.decode(b, where=where)),
        }
        for key, blob in blobs.items():
            if blob is not None:
                out._try(rules[key], blob)
        out._try(RECORD_CLASSES.check, tables.meta, where=where)
        return out

    def _add(self, exc: NotAPackError) -> None:
        self.problems.append(exc if isinstance(exc, TableDamage) else TableDamage(exc.path, _why(exc), exc.hint))

    def _try(self, rule: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        try:
            rule(*args, **kwargs)
        except NotAPackError as exc:
            self._add(exc)

    def _get(self, source: TableSource, key: bytes) -> memoryview | None:
        try:
            blob = source.get(key)
        except NotAPackError as exc:
            self._add(exc)
            return None
        if blob is None:
            self._add(TableDamage(source.where, f"{key.decode()} is missing"))
        return blob

    def _labels(self, blob: memoryview, count: int, n_classes: int, where: str) -> None:
        labels = LABELS.decode(blob, count, where=where)
        self.labels = labels
        LABELS.check(labels, n_classes, where=where)

    def _order(self, blob: memoryview, count: int, next_record: int, where: str) -> None:
        keys = ORDER.view(blob, count, where=where)
        self.order = keys  # the records can still be looked up: a rule below is a problem, not a blindness
        ORDER.check(keys, next_record, where=where, exhaustive=True)


def _why(exc: NotAPackError) -> str:
    # What is wrong, without the path (the problem is listed under the pack): every
    # NotAPackError raised here carries it (only one rebuilt from a worker's text has none).
    return exc.why or exc.message


@dataclass
class NewTables:
    """The tables of a new version, as the writer and an update give them: the manifest's
    bytes, then every table's contents (``order``/``stats``: None for a pack without them)."""

    meta: bytes
    labels: bytes | bytearray
    paths: bytes | bytearray
    skipped: Sequence[Mapping[str, Any]]
    history: Sequence[Mapping[str, Any]]
    order: Any = None
    stats: tuple[Any, Any] | None = None

    def encode(self) -> dict[bytes, bytes | bytearray]:
        """Every table by key, ``__check__`` last (it covers the others)."""
        tables: dict[bytes, bytes | bytearray] = {
            META_KEY: self.meta,
            LABELS_KEY: self.labels,
            PATHS_KEY: self.paths,
            SKIPPED_KEY: SKIPPED.encode(self.skipped),
            HISTORY_KEY: HISTORY.encode(self.history),
        }
        if self.order is not None:
            tables[ORDER_KEY] = ORDER.encode(self.order)
        if self.stats is not None:
            tables[STATS_KEY] = STATS.encode(*self.stats)
        tables[CHECK_KEY] = CHECKS.encode(tables)
        return tables


# -- the functions of format 1 and 2's readers, kept as names of the objects' methods ------
encode_check = CHECKS.encode
decode_check = CHECKS.decode
check_table = CHECKS.check
encode_skipped = SKIPPED.encode
decode_skipped = SKIPPED.decode
encode_order = ORDER.encode
order_values = ORDER.view
encode_stats = STATS.encode
stats_values = STATS.view
encode_history = HISTORY.encode
decode_history = HISTORY.decode
encode_labels = LABELS.encode
labels_table = LABELS.encode_array
decode_labels = LABELS.decode
label_values = LABELS.view
check_labels = LABELS.check
encode_paths = PATHS.encode
paths_table = PATHS.encode_parts
check_paths = PATHS.check
path_at = PATHS.path_at
decode_paths = PATHS.decode

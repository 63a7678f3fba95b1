"""The pack's tables beside the manifest: checksums, skipped, order, stats, history, labels, paths."""

from __future__ import annotations

import array
import json
import os
import struct
import sys
from typing import Any, Iterable, Mapping, Sequence

from lmdbfolder.errors import NotAPackError
from lmdbfolder.format.layout import (
    _LABEL,
    _OFFSET,
    CHECK_KEY,
    HISTORY_KEY,
    LABELS_KEY,
    META_KEY,
    NO_LABEL,
    ORDER_KEY,
    PATHS_KEY,
    SKIPPED_KEY,
    STATS_KEY,
)
from lmdbfolder.format.manifest import DAMAGED_HINT, encode_meta, loads_json
from lmdbfolder.format.record import checksum


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

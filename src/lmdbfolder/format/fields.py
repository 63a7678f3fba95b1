"""Samples of several fields (format 4): the field list of the manifest and the payload of a record.

A record whose header has ``flags`` bit 0 (``FIELDS_FLAG``) set holds, after its 32-byte header,
``n + 1`` little-endian u32 offsets (``n``: the pack's number of fields) and then the fields'
payloads concatenated; field ``k`` is ``body[offsets[k]:offsets[k + 1]]`` where ``body`` starts
right after the offsets. ``offsets[0]`` is 0, they never decrease and ``offsets[n]`` ends the
record. The header's ``payload_len`` counts all of it (offsets and payloads) and its CRC covers all
of it, as for any record. See FORMAT.md, "Several fields per sample".

The payload of each field kind:

* ``image``, ``mask``: an encoded image, the source file's bytes unchanged.
* ``json``: compact UTF-8 JSON, at most ``MAX_JSON_FIELD_BYTES``, nested at most
  ``MAX_JSON_DEPTH`` levels.
* ``array``: a ``.npy`` file (numpy's format 1.0/2.0/3.0 header, then the data): numeric or bool
  dtypes only (never an object array, never pickle), at most ``MAX_ARRAY_DIMS`` dimensions and
  ``MAX_ARRAY_BYTES`` of data.
"""

from __future__ import annotations

import ast
import json
import struct
from typing import Any, Sequence

from lmdbfolder.format.layout import MAX_JSON_CONTAINERS
from lmdbfolder.format.manifest import (
    FIELD_KINDS,
    IMAGE_KINDS,
    MAX_FIELDS,
    FieldSpec,
    _scan_json,
    fields_from_json,
    fields_problem,
)

__all__ = [
    "FIELD_KINDS",
    "IMAGE_KINDS",
    "FieldSpec",
    "FIELDS_FLAG",
    "MAX_FIELDS",
    "MAX_JSON_FIELD_BYTES",
    "MAX_ARRAY_DIMS",
    "MAX_ARRAY_BYTES",
    "pack_field_payloads",
    "split_field_payloads",
    "encode_json",
    "decode_json",
    "encode_array",
    "decode_array",
    "array_problem",
    "fields_from_json",
    "fields_problem",
]

#: ``flags`` bit 0 of a record header: its payload is several fields.
FIELDS_FLAG = 1
#: A ``json`` field longer than this is refused (writing and reading).
MAX_JSON_FIELD_BYTES = 16 << 20
#: A ``json`` field nested deeper than this is refused.
MAX_JSON_FIELD_DEPTH = 16
#: An ``array`` field of more dimensions, or more bytes of data, is refused.
MAX_ARRAY_DIMS = 8
MAX_ARRAY_BYTES = 1 << 30
#: A ``.npy`` header longer than this is refused (numpy's own reader stops at 10,000).
_MAX_NPY_HEADER = 10000
_U32 = struct.Struct("<I")
_NPY_MAGIC = b"\x93NUMPY"
#: dtype kinds an ``array`` field may have: bool, integers, floats, complex.
_ARRAY_DTYPE_KINDS = "biufc"


# -- the record's payload ---------------------------------------------------------------------------
def pack_field_payloads(payloads: Sequence[bytes | bytearray | memoryview], room: int = 0) -> bytearray:
    """The payload of a record of several fields: ``n + 1`` u32 offsets, then the payloads,
    behind ``room`` zero bytes (where the writer puts the record header)."""
    n = len(payloads)
    offsets = bytearray(4 * (n + 1))
    total = 0
    _U32.pack_into(offsets, 0, 0)
    for k, payload in enumerate(payloads):
        total += len(payload)
        if total >= 1 << 32:
            raise ValueError(f"the fields of a sample hold {total:,} bytes, more than a record's 4 GiB")
        _U32.pack_into(offsets, 4 * (k + 1), total)
    out = bytearray(room + len(offsets) + total)
    out[room : room + len(offsets)] = offsets
    pos = room + len(offsets)
    for payload in payloads:
        out[pos : pos + len(payload)] = payload
        pos += len(payload)
    return out


def split_field_payloads(payload: memoryview, n: int) -> list[memoryview] | str:
    """The ``n`` field payloads (zero-copy views) of a record of several fields, or why it is
    malformed (a string): too short for its offsets, an offset that is not 0 first, decreases, or
    does not end the record."""
    table = 4 * (n + 1)
    if len(payload) < table:
        return f"its payload is {len(payload)} bytes, too short for the offsets of {n} fields"
    offsets = struct.unpack_from(f"<{n + 1}I", payload)
    body = payload[table:]
    if offsets[0] != 0 or offsets[-1] != len(body) or any(a > b for a, b in zip(offsets, offsets[1:])):
        return f"its field offsets {list(offsets)[:8]} do not split its {len(body)} bytes of fields"
    return [body[offsets[k] : offsets[k + 1]] for k in range(n)]


# -- json fields ------------------------------------------------------------------------------------
def encode_json(value: Any, where: str = "a json field") -> bytes:
    """Compact UTF-8 JSON of ``value`` (``separators=(",", ":")``, ``ensure_ascii=False``);
    ValueError naming ``where`` when it is not JSON-able, not finite, or too large."""
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"{where}: cannot be stored as JSON ({type(exc).__name__}: {exc})") from None
    data = text.encode("utf-8", "surrogatepass")
    if len(data) > MAX_JSON_FIELD_BYTES:
        raise ValueError(f"{where}: its JSON is {len(data):,} bytes, more than the {MAX_JSON_FIELD_BYTES:,} allowed")
    return data


def decode_json(data: bytes | bytearray | memoryview, where: str) -> Any:
    """The value of a ``json`` field (bounds checked first); ValueError naming ``where``."""
    if len(data) > MAX_JSON_FIELD_BYTES:
        raise ValueError(f"{where}: its JSON is {len(data):,} bytes, more than the {MAX_JSON_FIELD_BYTES:,} allowed")
    raw = bytes(data)
    why = _scan_json(raw, "JSON", MAX_JSON_FIELD_DEPTH, MAX_JSON_CONTAINERS)
    if why is not None:
        raise ValueError(f"{where}: {why}")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{where}: not valid UTF-8 JSON ({exc})") from None


# -- array fields -----------------------------------------------------------------------------------
def encode_array(array: Any, where: str = "an array field") -> bytes:
    """The ``.npy`` bytes of a numeric numpy array (never pickled); ValueError naming ``where``
    for an object array, or one over the bounds."""
    import io

    import numpy as np

    arr = np.asarray(array)
    problem = _array_problem(arr.dtype, arr.shape)
    if problem is not None:
        raise ValueError(f"{where}: {problem}")
    out = io.BytesIO()
    np.lib.format.write_array(out, arr, allow_pickle=False)
    return out.getvalue()


def _array_problem(dtype: Any, shape: Sequence[int]) -> str | None:
    if dtype.kind not in _ARRAY_DTYPE_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        return f"an array of dtype {dtype} cannot be stored (numbers and booleans only)"
    if len(shape) > MAX_ARRAY_DIMS:
        return f"an array of {len(shape)} dimensions, more than {MAX_ARRAY_DIMS}"
    size = dtype.itemsize
    for d in shape:
        size *= d
    if size > MAX_ARRAY_BYTES:
        return f"an array of {size:,} bytes, more than {MAX_ARRAY_BYTES:,}"
    return None


def _npy_header(data: memoryview) -> tuple[dict[str, Any], int] | str:
    """The ``.npy`` header dict and where the data starts, or why it is not one."""
    if len(data) < 10 or bytes(data[:6]) != _NPY_MAGIC:
        return "not a .npy array (bad magic)"
    major = data[6]
    if major == 1:
        (hlen,) = struct.unpack_from("<H", data, 8)
        start = 10
    elif major in (2, 3):
        if len(data) < 12:
            return "a .npy array cut short"
        (hlen,) = struct.unpack_from("<I", data, 8)
        start = 12
    else:
        return f"a .npy array of format version {major}, unknown"
    if hlen > _MAX_NPY_HEADER or start + hlen > len(data):
        return "a .npy header that is too long or cut short"
    try:
        text = bytes(data[start : start + hlen]).decode("latin1" if major < 3 else "utf-8")
        header = ast.literal_eval(text)  # a dict of literals, as numpy's own reader parses it
    except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError):
        return "a .npy header that does not parse"
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        return "a .npy header without exactly descr, fortran_order and shape"
    return header, start + hlen


def array_problem(data: bytes | bytearray | memoryview) -> str | None:
    """Why ``data`` is not an ``array`` field this format accepts, or None (checks the header
    and that the data has the size it gives; nothing is allocated)."""
    import numpy as np

    view = memoryview(data)
    parsed = _npy_header(view)
    if isinstance(parsed, str):
        return parsed
    header, start = parsed
    shape, descr = header["shape"], header["descr"]
    if not isinstance(shape, tuple) or not all(type(d) is int and d >= 0 for d in shape):
        return f"a .npy shape {str(shape)[:80]} that is not a tuple of sizes"
    if not isinstance(descr, str) or type(header["fortran_order"]) is not bool:
        return "a .npy descr that is not a plain dtype"
    try:
        dtype = np.dtype(descr)
    except (TypeError, ValueError):
        return f"a .npy dtype {descr[:40]!r} that numpy does not know"
    problem = _array_problem(dtype, shape)
    if problem is not None:
        return problem
    expected = dtype.itemsize
    for d in shape:
        expected *= d
    if len(view) - start != expected:
        return f"a .npy array whose data is {len(view) - start:,} bytes where its header says {expected:,}"
    return None


def decode_array(data: bytes | memoryview, where: str) -> Any:
    """The numpy array of an ``array`` field (checked first, read without pickle); ValueError
    naming ``where``."""
    import io

    import numpy as np

    problem = array_problem(data)
    if problem is not None:
        raise ValueError(f"{where}: {problem}")
    return np.load(io.BytesIO(bytes(data)), allow_pickle=False)

"""The manifest (key ``__meta__``), JSON with bounds, and the writer's checkpoint."""

from __future__ import annotations

import json
import os
import re
import reprlib
from typing import Any, Callable, Mapping

from lmdbfolder.errors import FormatVersionError, NotAPackError
from lmdbfolder.format.layout import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_INDEX,
    MAX_JSON_CONTAINERS,
    MAX_JSON_DEPTH,
    MAX_MANIFEST_BYTES,
    PACK_ID_BYTES,
    READABLE_VERSIONS,
)


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

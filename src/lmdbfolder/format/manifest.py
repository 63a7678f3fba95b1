"""The manifest (key ``__meta__``), JSON with bounds, and the writer's checkpoint."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import reprlib
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, Mapping

from lmdbfolder.errors import FormatVersionError, NotAPackError
from lmdbfolder.format.layout import (
    FIELDS_FORMAT_VERSION,
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_INDEX,
    MAX_JSON_CONTAINERS,
    MAX_JSON_DEPTH,
    MAX_MANIFEST_BYTES,
    PACK_ID_BYTES,
    READABLE_VERSIONS,
    UPDATED_FORMAT_VERSION,
)


def encode_meta(meta: Mapping[str, Any]) -> bytes:
    """Serialise the manifest: canonical JSON (sorted keys, ASCII, no spaces).

    ASCII escapes keep class names that are not valid UTF-8 (undecodable file
    names, held as lone surrogates by Python) lossless.
    """
    if isinstance(meta, Manifest):
        meta = meta.to_object()
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


def decode_meta(blob: bytes | memoryview | None, *, where: str) -> Manifest:
    """Parse and validate the manifest stored under ``META_KEY`` (``Manifest.from_json``)."""
    return Manifest.from_json(blob, where=where)


def new_pack_id() -> str:
    """A fresh random pack id (32 hex digits) for the manifest of a new pack."""
    return os.urandom(PACK_ID_BYTES).hex()


def pack_binding(meta: Mapping[str, Any]) -> bytes | None:
    """What a pack's record CRCs are bound to: its ``pack_id`` (format 2), its
    ``binding_id`` (format 3: the ``pack_id`` of the version that first wrote
    its records), or None for format 1."""
    if isinstance(meta, Manifest):
        return meta.binding
    version = meta.get("format_version", 1)
    if version < 2:
        return None
    return bytes.fromhex(meta["binding_id"] if version >= 3 else meta["pack_id"])


def label_map(meta: Mapping[str, Any]) -> list[int] | None:
    """How a record header's label becomes the sample's label (format 3 with
    ``record_classes``): ``out[h]`` is the class index of ``record_classes[h]``
    in ``classes``, or -2 for a class the pack no longer has (no sample may
    then refer to such a record). None: header labels are class indices."""
    if isinstance(meta, Manifest):
        return meta.label_map
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
    if meta.get("format_version") in (2, 3, 4):
        pack_id = meta.get("pack_id")
        if not isinstance(pack_id, str) or not _PACK_ID.match(pack_id):
            problems.append(f"pack_id={_short(pack_id)} is not {2 * PACK_ID_BYTES} hex digits")
    if meta.get("format_version") in (3, 4):
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
    if meta.get("format_version") == FIELDS_FORMAT_VERSION:
        problem = fields_problem(meta.get("fields"))
        if problem is not None:
            problems.append(problem)
        layout = meta.get("layout")
        if layout is not None and not _is_layout(layout):
            problems.append("layout is not an object with a string name")
        if meta.get("store") != "encoded":
            problems.append("a pack of several fields must have store='encoded'")
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


# -- the fields of a pack of several fields (format 4) -------------------------------
#: The kinds of field a sample may hold, and what its payload is (module docstring).
FIELD_KINDS = ("image", "mask", "json", "array")
#: The kinds whose payload is an encoded image.
IMAGE_KINDS = ("image", "mask")
#: A pack holds at most this many fields per sample.
MAX_FIELDS = 64
#: A field name: lower-case letters, digits and ``_``, starting with a letter.
MAX_FIELD_NAME = 64
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """One entry of the manifest's ``fields`` list: a field's ``name`` (distinct within a pack,
    ``[a-z][a-z0-9_]*``, at most 64 characters) and ``kind`` (one of ``FIELD_KINDS``)."""

    name: str
    kind: str

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem is not None:
            raise ValueError(problem)

    def problem(self) -> str | None:
        """Why this is not a valid field, or None."""
        if not isinstance(self.name, str) or not _NAME.match(self.name) or len(self.name) > MAX_FIELD_NAME:
            return f"field name {str(self.name)[:80]!r} is not [a-z][a-z0-9_]* of at most {MAX_FIELD_NAME} characters"
        if self.kind not in FIELD_KINDS:
            return f"field {self.name!r} has kind {str(self.kind)[:80]!r}, not one of {', '.join(FIELD_KINDS)}"
        return None

    def to_json(self) -> dict[str, Any]:
        """The manifest entry: ``{"name": ..., "kind": ...}``."""
        return {"name": self.name, "kind": self.kind}

    @classmethod
    def from_json(cls, value: Any, where: str) -> FieldSpec:
        """The field an entry of a manifest's ``fields`` describes; NotAPackError naming
        ``where`` when it is not a valid one."""
        if not isinstance(value, dict):
            raise NotAPackError(where, f"its manifest's fields hold a {type(value).__name__}, not an object")
        try:
            return cls(value.get("name"), value.get("kind"))  # type: ignore[arg-type]  # checked by __post_init__
        except ValueError as exc:
            raise NotAPackError(where, f"its manifest's fields are invalid: {exc}") from None


def fields_problem(value: Any) -> str | None:
    """Why ``value`` (a manifest's ``fields``) is not a valid field list, or None."""
    if not isinstance(value, list) or not value:
        return "fields is not a non-empty list"
    if len(value) > MAX_FIELDS:
        return f"fields lists {len(value)} fields, more than {MAX_FIELDS}"
    names = set()
    for entry in value:
        if not isinstance(entry, dict):
            return "fields holds an entry that is not an object"
        try:
            FieldSpec(entry.get("name"), entry.get("kind"))  # type: ignore[arg-type]  # checked by __post_init__
        except ValueError as exc:
            return str(exc)
        names.add(entry["name"])
    if len(names) != len(value):
        return "fields names a field twice"
    return None


def fields_from_json(value: Any, where: str) -> tuple[FieldSpec, ...]:
    """The fields of a manifest's ``fields`` list; NotAPackError naming ``where`` when invalid."""
    problem = fields_problem(value)
    if problem is not None:
        raise NotAPackError(where, f"its manifest is invalid: {problem}")
    return tuple(FieldSpec.from_json(entry, where) for entry in value)


# -- the manifest as an object --------------------------------------------------------
def _is_count(value: Any) -> bool:
    return _count(value)


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_hex_id(value: Any) -> bool:
    return isinstance(value, str) and _PACK_ID.match(value) is not None


def _is_names(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(c, str) for c in value)


def _is_fields(value: Any) -> bool:
    # The sample schema (docs/design.md, "Samples with several fields"): a list of
    # objects, each with a distinct string ``name``. Format 4 requires a valid one
    # (``format.fields.fields_problem``); older versions only keep it.
    if not isinstance(value, list) or not all(isinstance(f, dict) and isinstance(f.get("name"), str) for f in value):
        return False
    return len({f["name"] for f in value}) == len(value)


def _is_layout(value: Any) -> bool:
    # Format 4: where the samples came from ({"name": "voc", "info": {...}}).
    return isinstance(value, dict) and isinstance(value.get("name"), str)


#: The manifest fields ``Manifest`` holds as attributes (of the same name), and the
#: type a value must have to be held there; any other value stays in ``extra``.
_TYPED: dict[str, Callable[[Any], bool]] = {
    # Required fields: ``_check_manifest`` checked them before they get here.
    "format_version": lambda v: type(v) is int,
    "count": _is_count,
    "classes": _is_names,
    "class_to_idx": lambda v: isinstance(v, dict),
    "store": _is_str,
    # Required by version (v2, v3) or optional (v3); typed when of their type in any version.
    "pack_id": _is_hex_id,
    "binding_id": _is_hex_id,
    "record_classes": lambda v: _is_names(v) and len(set(v)) == len(v),
    "next_record": lambda v: type(v) is int and 0 <= v <= MAX_INDEX + 1,
    **_INFORMATIONAL,
    "fields": _is_fields,
    "layout": _is_layout,
}


class JsonView(Mapping[str, Any]):
    """A read-only mapping view of a typed part's JSON object (``Reader.meta["params"]``,
    ``dict(reader.meta)``, as when the parts were dicts), built once: the part's
    ``_json_object``. Code of the package reads the attributes."""

    def _json_object(self) -> dict[str, Any]:
        raise NotImplementedError

    @functools.cached_property
    def _object(self) -> dict[str, Any]:
        return self._json_object()

    def __getitem__(self, key: str) -> Any:
        return self._object[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._object)

    def __len__(self) -> int:
        return len(self._object)


@dataclass(frozen=True, eq=False)
class Manifest(JsonView):
    """A pack's manifest (key ``__meta__``, FORMAT.md "Manifest"), typed.

    Required: ``format_version``, ``count``, ``classes``, ``class_to_idx`` and
    ``store``; ``pack_id`` (v2, v3), ``binding_id`` and ``next_record`` (v3)
    and ``record_classes`` (v3, optional). The informational fields hold their
    value when it has the type FORMAT.md gives it, else None (absent or not of
    that type: ``invalid_fields`` names the latter, ``shown`` shows them as
    ``INVALID``). ``fields``: the sample schema of a pack of several fields
    (docs/design.md; None: one image and its label, every pack of today).
    ``extra``: the fields this version does not know and the informational
    ones of the wrong type, kept as they are, so that a newer writer's
    manifest round-trips: ``Manifest.from_json(b, where=...).to_json() == b``
    for a canonical ``b``.

    Read-only ``Mapping`` of its JSON object, for code that indexed the
    manifest dict (``Reader.meta["classes"]``); the package's own code uses the
    attributes. Do not mutate the lists and dicts it holds.
    """

    format_version: int
    count: int
    classes: list[str]
    class_to_idx: dict[str, int]
    store: str
    pack_id: str | None = None
    binding_id: str | None = None
    record_classes: list[str] | None = None
    next_record: int | None = None
    encodings: dict[str, int] | None = None
    payload_bytes: int | None = None
    checksum: str | None = None
    source: dict[str, Any] | None = None
    created_by: str | None = None
    created_at: str | None = None
    updated_at: str | None = None
    params: dict[str, Any] | None = None
    fingerprint: dict[str, Any] | None = None
    shard: dict[str, Any] | None = None
    skipped: list[dict[str, Any]] | None = None
    skipped_count: int | None = None
    fields: list[dict[str, Any]] | None = None
    layout: dict[str, Any] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    format: ClassVar[str] = FORMAT_NAME

    # -- serialisation -----------------------------------------------------------------
    @classmethod
    def from_json(cls, blob: bytes | memoryview | None, *, where: str) -> Manifest:
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
        obj = loads_json(blob, where=where, what="manifest (key __meta__)", max_bytes=MAX_MANIFEST_BYTES)
        _check_manifest(obj, where)
        return cls._from_object(obj)

    @classmethod
    def _from_object(cls, obj: Mapping[str, Any]) -> Manifest:
        # The fields of their type become attributes, the rest ``extra``; ``format``
        # is the constant (``_check_manifest`` checked it, when it was called).
        typed: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in obj.items():
            if key == "format" and value == FORMAT_NAME:
                continue
            if key in _TYPED and _TYPED[key](value):
                typed[key] = value
            else:
                extra[key] = value
        return cls(**typed, extra=extra)

    def to_object(self) -> dict[str, Any]:
        """This manifest as its JSON object (a new dict; the values are shared)."""
        out: dict[str, Any] = {"format": FORMAT_NAME}
        for key in _TYPED:
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        out.update(self.extra)
        return out

    def to_json(self) -> bytes:
        """The canonical bytes of this manifest (``encode_meta``): sorted keys, ASCII, no spaces."""
        return encode_meta(self.to_object())

    def validate(self, *, where: str) -> None:
        """Raise (NotAPackError, FormatVersionError) unless a reader may open a pack
        with this manifest: the checks of ``from_json``, FORMAT.md's rules, in one copy."""
        _check_manifest(self.to_object(), where)

    def _json_object(self) -> dict[str, Any]:
        return self.to_object()

    # -- what the fields mean ----------------------------------------------------------
    @property
    def binding(self) -> bytes | None:
        """What the pack's record CRCs are bound to: its ``pack_id`` (format 2), its
        ``binding_id`` (format 3: the ``pack_id`` of the version that first wrote
        its records), or None for format 1."""
        if self.format_version < 2:
            return None
        bound = self.binding_id if self.format_version >= 3 else self.pack_id
        if bound is None:  # from_json and validate refuse such a manifest
            raise ValueError(f"a format-{self.format_version} manifest without its binding id: validate it first")
        return bytes.fromhex(bound)

    @property
    def label_map(self) -> list[int] | None:
        """How a record header's label becomes the sample's label (format 3 with
        ``record_classes``): ``out[h]`` is the class index of ``record_classes[h]``
        in ``classes``, or -2 for a class the pack no longer has (no sample may
        then refer to such a record). None: header labels are class indices."""
        if self.format_version < 3 or self.record_classes is None:
            return None
        return [int(self.class_to_idx.get(name, -2)) for name in self.record_classes]

    @property
    def ordered(self) -> bool:
        """Whether sample ``i`` is the record under key ``__order__[i]`` (format 3), not key ``i``."""
        return self.format_version >= 3

    def identity(self, manifest_sha256: bytes) -> str:
        """The pack version's identity: its ``pack_id`` (format 2 and 3), or, for
        format 1, ``sha256:`` and the digest of its stored manifest bytes."""
        if self.format_version >= 2 and self.pack_id is not None:
            return self.pack_id
        return "sha256:" + manifest_sha256.hex()

    @property
    def version_pack_id(self) -> str | None:
        """The ``pack_id`` a format 2 or 3 pack is opened by; None for format 1."""
        return self.pack_id if self.format_version >= 2 else None

    @property
    def shard_place(self) -> tuple[Any, Any] | None:
        """A shard's place in its split, ``(index, num_shards)`` of its ``shard``
        field, as read (not checked: a forged field may hold anything); None
        when it has none (a single pack, or a shard packed before the field)."""
        return shard_place(self)

    @property
    def source_record(self) -> SourceRecord | None:
        """``source`` as a ``SourceRecord`` (None: not recorded, or not an object)."""
        return SourceRecord.of(self.source)

    @property
    def invalid_fields(self) -> list[str]:
        """The informational fields present but not of their documented type, sorted."""
        return sorted(key for key in _INFORMATIONAL if key in self.extra)

    @property
    def shown(self) -> Shown:
        """The informational fields as a reader shows them: ``INVALID`` for one of the wrong type."""
        return Shown(**{key: INVALID if key in self.extra else getattr(self, key) for key in _INFORMATIONAL})

    @property
    def skipped_items(self) -> list[dict[str, Any]]:
        """The skipped source files a format-1 manifest lists (``skipped``); [] otherwise."""
        return list(self.skipped or [])

    @property
    def field_specs(self) -> tuple[FieldSpec, ...] | None:
        """The fields of each sample of a format-4 pack (``format.fields.FieldSpec``s, in the
        order of the record's payloads); None for a pack of one image per sample (a
        ``fields`` entry in an older version's manifest is kept, never acted on)."""
        if self.format_version < FIELDS_FORMAT_VERSION or self.fields is None:
            return None
        return tuple(FieldSpec(f["name"], f["kind"]) for f in self.fields)

    @property
    def layout_name(self) -> str | None:
        """Format 4: the layout the samples came from (``"voc"``, ``"coco"``, ``"dataset"``...)."""
        return self.layout.get("name") if self.layout is not None else None

    @property
    def layout_info(self) -> dict[str, Any]:
        """Format 4: what the layout recorded (``{"split": ...}``, COCO categories...); {} if none."""
        info = self.layout.get("info") if self.layout is not None else None
        return info if isinstance(info, dict) else {}

    @property
    def sample_fields(self) -> list[dict[str, Any]]:
        """The fields of a sample (docs/design.md): ``fields``, or, absent, the one
        field of every pack of today, an image with its label."""
        if self.fields is not None:
            return list(self.fields)
        return [{"name": "image", "kind": "image", "store": self.store}, {"name": "label", "kind": "class"}]

    # -- the writer's constructors -----------------------------------------------------
    @classmethod
    def new_pack(
        cls,
        *,
        count: int,
        classes: list[str],
        class_to_idx: dict[str, int],
        store: str,
        pack_id: str,
        encodings: dict[str, int],
        payload_bytes: int,
        source: dict[str, Any],
        fingerprint: dict[str, Any],
        skipped_count: int,
        params: dict[str, Any],
        created_by: str,
        created_at: str,
        extra: Mapping[str, Any] | None = None,
    ) -> Manifest:
        """The manifest of a freshly written pack (format ``FORMAT_VERSION``), or shard
        (its ``shard`` field in ``extra``). ``extra``: fields a caller adds
        (``pack(manifest_extra=...)``); ValueError when one would replace a field
        this constructor sets. With ``fields`` in ``extra`` (samples of several
        fields), format ``FIELDS_FORMAT_VERSION``: ``binding_id`` is the
        ``pack_id``, ``next_record`` the count (the writer adds the identity
        ``__order__``)."""
        several = extra is not None and "fields" in extra
        made = cls(
            format_version=FIELDS_FORMAT_VERSION if several else FORMAT_VERSION,
            binding_id=pack_id if several else None,
            next_record=count if several else None,
            count=count,
            classes=classes,
            class_to_idx=class_to_idx,
            store=store,
            pack_id=pack_id,
            encodings=encodings,
            payload_bytes=payload_bytes,
            checksum="crc32",
            source=source,
            fingerprint=fingerprint,
            skipped_count=skipped_count,
            params=params,
            created_by=created_by,
            created_at=created_at,
        )
        clash = sorted(set(extra or {}) & set(made.to_object()))
        if clash:
            raise ValueError(f"manifest_extra must not replace the manifest fields {clash}")
        return made.with_extra(extra)

    def updated(
        self,
        *,
        count: int,
        classes: list[str],
        class_to_idx: dict[str, int],
        pack_id: str,
        next_record: int,
        record_classes: list[str] | None,
        encodings: dict[str, int],
        payload_bytes: int,
        skipped_count: int,
        source: dict[str, Any],
        fingerprint: dict[str, Any],
        params: dict[str, Any],
        updated_at: str,
        extra: Mapping[str, Any] | None = None,
    ) -> Manifest:
        """The manifest of the version ``pack --update`` writes of this pack: format
        ``UPDATED_FORMAT_VERSION``, a new ``pack_id``, the records still bound to
        this version's ``binding``; the other fields kept, but format 1's
        ``skipped`` (now in ``__skipped__``). ``record_classes``: None when
        header labels are class indices. ``extra``: added last, as given."""
        binding = self.binding
        if binding is None:
            raise ValueError("pack --update writes over format 2 and 3 packs only")
        return self._replaced(
            # A pack of several fields stays format 4 (format 3's rules, and its fields).
            format_version=max(UPDATED_FORMAT_VERSION, self.format_version),
            count=count,
            classes=classes,
            class_to_idx=class_to_idx,
            pack_id=pack_id,
            binding_id=binding.hex(),
            next_record=next_record,
            record_classes=record_classes,
            encodings=encodings,
            payload_bytes=payload_bytes,
            skipped_count=skipped_count,
            source=source,
            fingerprint=fingerprint,
            params=params,
            updated_at=updated_at,
            skipped=None,
        ).with_extra(extra)

    def described(
        self,
        *,
        source: dict[str, Any],
        fingerprint: dict[str, Any],
        params: dict[str, Any],
        extra: Mapping[str, Any] | None = None,
    ) -> Manifest:
        """This manifest with another description of its source (``pack --update``
        that finds the same samples): ``source``, ``fingerprint``, ``params``, then ``extra``."""
        return self._replaced(source=source, fingerprint=fingerprint, params=params).with_extra(extra)

    def _replaced(self, **changes: Any) -> Manifest:
        # A field set anew replaces its value of the wrong type kept in ``extra``
        # (as ``dict.update`` replaced it when the manifest was a dict).
        extra = {k: v for k, v in self.extra.items() if k not in changes}
        return dataclasses.replace(self, **changes, extra=extra)

    def with_extra(self, extra: Mapping[str, Any] | None) -> Manifest:
        """This manifest with the JSON fields ``extra`` set (known ones to their
        attribute, when of their type), as ``dict.update`` would set them."""
        if not extra:
            return self
        return Manifest._from_object({**self.to_object(), **extra})

    def as_stored(self, key: str) -> Any:
        """The JSON value stored under ``key`` (None: absent), of whatever type: for the
        messages that show a forged or mistyped field as it was read."""
        return self._object.get(key)

    def differs_from(self, extra: Mapping[str, Any] | None) -> bool:
        """Whether setting the JSON fields ``extra`` would change this manifest."""
        obj = self._object
        return any(obj.get(k) != v for k, v in (extra or {}).items())


@dataclass(frozen=True)
class Shown:
    """A manifest's informational fields as a reader shows them: the value, None
    when absent, ``INVALID`` when not of the type FORMAT.md gives it."""

    encodings: Any = None
    payload_bytes: Any = None
    checksum: Any = None
    source: Any = None
    created_by: Any = None
    created_at: Any = None
    updated_at: Any = None
    params: Any = None
    fingerprint: Any = None
    shard: Any = None
    skipped: Any = None
    skipped_count: Any = None


@dataclass(frozen=True)
class ShardPlace:
    """A shard's ``shard`` manifest field (FORMAT.md): where the shard sits in its split.
    ``ShardPlace.of(obj)`` checks every member's type (``problem`` says the first that
    is wrong; its members are then not to be used)."""

    split: str = ""
    prefix: str = ""
    index: int = 0
    num_shards: int = 0
    first_source: int = 0
    sources: int = 0
    total_sources: int = 0
    sources_sha256: str = ""
    problem: str | None = None

    @classmethod
    def of(cls, obj: Any) -> ShardPlace:
        """The place ``obj`` (the field's JSON value) records, or one whose ``problem`` says why not."""
        if not isinstance(obj, Mapping):
            return cls(problem=f"the `shard` field is not an object ({reprlib.repr(obj)})")
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name == "problem":
                continue
            value = obj.get(f.name)
            # type() rather than isinstance: True is no shard index, and a count must be one.
            ok = (type(value) is int and value >= 0) if f.type in ("int", int) else isinstance(value, str)
            if not ok:
                what = "a non-negative integer" if f.type in ("int", int) else "a string"
                return cls(problem=f"shard.{f.name}={reprlib.repr(value)} is not {what}")
            values[f.name] = value
        return cls(**values)


#: The layouts a pack's ``source`` records (``write.sources.SourceList.layout``).
SOURCE_LAYOUTS = ("imagefolder", "flat", "list")
#: The layout of an imported pack starts with this (``lmdbfolder import``: ``legacy-<recipe>``).
IMPORTED_LAYOUT_PREFIX = "legacy-"
#: Bounds of a recorded ``source`` (read from a file: a forged one may hold anything).
MAX_RECORDED_MATCH = 4096
MAX_RECORDED_EXTENSIONS = 1000


@dataclass(frozen=True)
class SourceRecord:
    """A manifest's ``source`` (or an index's): how the sample list was made
    (``SourceList.describe``), what ``pack --update``, ``verify``, ``export`` and the
    dataset read back. The rules of a valid record are here, once (``problem``);
    a field of another type than a writer records is None.

    ``SourceRecord.of(obj)`` is None when no source object is recorded.
    """

    layout: str | None = None
    root: str | None = None
    list_file: str | None = None
    extensions: tuple[str, ...] | None = None
    match: str | None = None
    is_valid_file: str | None = None
    #: Why the record is not one lmdbfolder writes (None: it is, or it records no layout).
    problem: str | None = None

    @classmethod
    def of(cls, obj: Any) -> SourceRecord | None:
        """The record of the JSON object ``obj``; None when it is not an object."""
        if not isinstance(obj, Mapping):
            return None
        layout, exts, match, valid = (
            obj.get("layout"),
            obj.get("extensions"),
            obj.get("match"),
            obj.get("is_valid_file"),
        )
        root, list_file = obj.get("root"), obj.get("list_file")
        exts_ok = exts is None or (
            isinstance(exts, list)
            and len(exts) <= MAX_RECORDED_EXTENSIONS
            and all(isinstance(e, str) and 0 < len(e) <= 100 for e in exts)
        )
        problems = []
        if "layout" in obj and layout not in SOURCE_LAYOUTS:
            problems.append(f"layout {_short(layout)}")
        if not exts_ok:
            problems.append("extensions")
        if match is not None and not (isinstance(match, str) and len(match) <= MAX_RECORDED_MATCH):
            problems.append("match")
        if valid is not None and not (isinstance(valid, str) and 0 < len(valid) <= 1000):
            problems.append("is_valid_file")
        if list_file is not None and not isinstance(list_file, str):
            problems.append("list_file")
        return cls(
            layout=layout if isinstance(layout, str) else None,
            root=root if isinstance(root, str) else None,
            list_file=list_file if isinstance(list_file, str) else None,
            extensions=tuple(exts) if exts_ok and exts is not None else None,
            match=match if isinstance(match, str) else None,
            is_valid_file=valid if isinstance(valid, str) else None,
            problem="; ".join(problems) or None,
        )

    @property
    def recorded(self) -> bool:
        """Whether it records a layout (a pack made before the layout was recorded does not)."""
        return self.layout is not None or self.problem is not None


def shard_place(meta: Mapping[str, Any]) -> tuple[Any, Any] | None:
    """``(index, num_shards)`` of the ``shard`` field of a manifest (a ``Manifest``, or
    its JSON object), as read; None when it has no such object (``Manifest.shard_place``)."""
    place = meta.shard if isinstance(meta, Manifest) else meta.get("shard")
    if not isinstance(place, dict):
        return None
    return place.get("index"), place.get("num_shards")


def _check_manifest(obj: Any, where: str) -> None:
    """Raise unless ``obj`` (a parsed manifest) is one a reader may open: FORMAT.md's rules."""
    if not isinstance(obj, dict) or obj.get("format") != FORMAT_NAME:
        raise NotAPackError(where, f"its manifest does not say format={FORMAT_NAME!r}")
    version = obj.get("format_version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise FormatVersionError(where, version, FORMAT_VERSION, READABLE_VERSIONS)
    _check_meta_fields(obj, where)

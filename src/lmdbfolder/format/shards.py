"""A sharded pack: shard names and the index (``index.json``)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Mapping

from lmdbfolder.errors import FormatVersionError, NotAPackError
from lmdbfolder.format.layout import _OFFSET, FORMAT_VERSION, MAX_INDEX_FILE_BYTES, READABLE_VERSIONS
from lmdbfolder.format.manifest import (
    _INFORMATIONAL,
    _PACK_ID,
    INVALID,
    JsonView,
    Shown,
    SourceRecord,
    _check_meta_fields,
    _short,
    loads_json,
)

# -- sharded packs ---------------------------------------------------------------
SHARD_INDEX_FORMAT = "lmdbfolder-shards"
#: Version of the index file's layout (independent of FORMAT_VERSION, which
#: every shard carries itself).
SHARD_INDEX_VERSION = 1
#: Optional manifest field of a shard: where it sits in the split (FORMAT.md).
SHARD_FIELD = "shard"
_SHARD_DIGITS = 5
_SHARD_NAME = re.compile(r"^(?P<prefix>[^/\\]+)-(?P<index>[0-9]{5,})-of-(?P<total>[0-9]{5,})\.lmdb$")
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
#: The longest file name most file systems take (a longer one is ENAMETOOLONG at first use).
_MAX_NAME_BYTES = 255


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
    if m is None or m.group("prefix") in (".", "..") or not name.isprintable():
        return None  # a name from an index (anyone's, at a URL) becomes a folder name here
    if len(name.encode("utf-8", "surrogateescape")) > _MAX_NAME_BYTES:
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
    entry: ShardEntry, meta: bytes | memoryview, labels: bytes | memoryview, paths: bytes | memoryview
) -> bool:
    """Whether a shard's stored manifest and tables are those its index ``entry`` names.

    Entries that carry ``shard_identity`` are checked by it (cheap); entries of
    indexes written before it existed carry only ``tables_sha256``, checked
    over the whole tables. ``verify`` checks ``tables_sha256`` in any case.
    """
    if entry.manifest_sha256 is not None:
        sizes = None if entry.tables_bytes is None else list(entry.tables_bytes)
        found = shard_identity(meta, labels, paths)
        return (entry.manifest_sha256, sizes) == (found["manifest_sha256"], found["tables_bytes"])
    return tables_digest(meta, labels, paths) == entry.tables_sha256


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


#: The informational fields of an index that a manifest has too (``ShardIndex.shown``).
_SHOWN = ("encodings", "payload_bytes", "checksum", "source", "created_by", "created_at")


@dataclass(frozen=True)
class ShardEntry(JsonView):
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

    Read-only ``Mapping`` of its JSON object (``entry["name"]``), as the
    index's entries were before they were typed; the package's code uses the
    attributes.
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

    def _json_object(self) -> dict[str, Any]:
        return self.to_dict()

    def replaced(self, **changes: Any) -> ShardEntry:
        """This entry with the attributes ``changes`` set (a value of its JSON
        field kept in ``extra`` is dropped: the new one replaces it)."""
        keys = {"bytes" if name == "data_bytes" else name for name in changes}
        extra = {k: v for k, v in self.extra.items() if k not in keys}
        return dataclasses.replace(self, **changes, extra=extra)

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


@dataclass(frozen=True, eq=False)  # equal as mappings: to an equal index, or to its JSON object
class ShardIndex(JsonView):
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

    Read-only ``Mapping`` of its JSON object, for code that indexed the index
    dict (``ShardedReader.meta["shards"]``); the package's own code uses the
    attributes. Do not mutate what it holds.
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

    def _json_object(self) -> dict[str, Any]:
        return self.to_dict()

    def with_shards(self, shards: list[ShardEntry]) -> ShardIndex:
        """This index with the entries ``shards`` (the same shards, their fields updated)."""
        return dataclasses.replace(self, shards=shards)

    format: ClassVar[str] = SHARD_INDEX_FORMAT
    index_version: ClassVar[int] = SHARD_INDEX_VERSION

    @property
    def shown(self) -> Shown:
        """The informational fields an index shares with a manifest, as a reader shows
        them: ``INVALID`` for one of the wrong type (kept in ``extra``)."""
        return Shown(**{key: INVALID if key in self.extra else getattr(self, key) for key in _SHOWN})

    @property
    def names(self) -> list[str]:
        """The shards' directory names, in global order."""
        return [entry.name for entry in self.shards]

    @property
    def source_record(self) -> SourceRecord | None:
        """``source`` (the shards' common one) as a ``SourceRecord`` (None: not recorded)."""
        return SourceRecord.of(self.source)

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

"""Convert the LMDBs that the popular recipes produce into lmdbfolder packs, safely.

Two layouts are recognised:

* **pickled samples** (Efficient-PyTorch ``folder2lmdb`` and its many forks):
  keys ``str(index)``, each value ``pickle((image_bytes, label))``, plus a
  ``__len__`` key and often ``__keys__`` (the pickled list of keys);
* **BasicSR-style image LMDBs**: keys are image names, values are either
  encoded images (PNG/JPEG bytes) or raw ``uint8`` arrays, with a
  ``meta_info.txt`` (``name (H,W,C) compression``) or ``meta_info.pkl``
  (``{"keys": [...], "resolution": ["C_H_W", ...]}``) next to ``data.mdb``.

Pickle is only ever read through ``safe_loads``: first a scan of its opcodes
(``pickletools.genops``, which builds nothing) that refuses every global
(class or function), a pickle larger than its cap, nesting deeper than
``MAX_PICKLE_DEPTH``, more than ``MAX_PICKLE_MEMO`` memo entries, and one
that expands through shared references into more objects than its bytes
could hold (a "billion laughs"); then ``RestrictedUnpickler``, which builds
plain tuples, lists, dicts, str, bytes, int, float, bool and None and again
refuses every global. A malicious file cannot run code or exhaust memory: it
fails with ``UnsafePickleError`` instead. Messages name types, never the
repr of what a pickle holds.

The old LMDB is read through ``PageFile`` (every page checked), like a pack:
a damaged or truncated recipe LMDB is a clear error, never a crash.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import pickletools
import re
import reprlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from PIL import Image

from lmdbfolder.encodings import RAW, sniff
from lmdbfolder.errors import NotAPackError, OptionError, SourceError, UnsafePickleError, os_hint
from lmdbfolder.format import DATA_FILE, IMPORTED_LAYOUT_PREFIX, encode_record
from lmdbfolder.pagefile import P_LEAF, PageDamage, PageFile, open_regular, read_regular
from lmdbfolder.write.options import PackOptions
from lmdbfolder.write.records import Loaded, Skipped, load_bytes
from lmdbfolder.write.sources import SourceList
from lmdbfolder.write.writer import PackResult, pack_sources

__all__ = [
    "RestrictedUnpickler",
    "safe_loads",
    "check_pickle",
    "MAX_PICKLE_BYTES",
    "MAX_PICKLE_DEPTH",
    "MAX_PICKLE_MEMO",
    "MAX_IMPORT_CLASSES",
    "LegacyLayout",
    "detect_legacy",
    "import_legacy",
    "basicsr_pair_samples",
    "import_basicsr_pair",
]

CHANNEL_ORDERS = ("bgr", "rgb")
_PLAIN = (tuple, list, dict, str, bytes, bytearray, int, float, bool, type(None))
#: The largest pickle read (a sample's value, ``__keys__``, ``meta_info.pkl``).
MAX_PICKLE_BYTES = 1 << 30
#: Deepest nesting of containers in a pickle.
MAX_PICKLE_DEPTH = 32
#: Most memo entries in one pickle.
MAX_PICKLE_MEMO = 1 << 24
#: Most classes an import makes (labels 0 .. MAX_IMPORT_CLASSES - 1): the class
#: list is built from the largest label, so one huge label must not build a huge list.
MAX_IMPORT_CLASSES = 1 << 20
_MAX_LABEL = (1 << 31) - 1
#: Opcodes that name or call a class or function: never needed for plain data.
_GLOBALS = frozenset(
    {"GLOBAL", "STACK_GLOBAL", "REDUCE", "BUILD", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX", "EXT1", "EXT2", "EXT4"}
)
_PERSISTENT = frozenset({"PERSID", "BINPERSID"})
_MEMO_PUT = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"})
_MEMO_GET = frozenset({"GET", "BINGET", "LONG_BINGET"})
#: Opcodes that add to the container below their items (it keeps its identity).
_EXTEND = frozenset({"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS"})
_MARK = pickletools.markobject


def _short(value: Any) -> str:
    """A short description of something read from an untrusted file: its type, or a cut repr of a scalar."""
    if isinstance(value, (bytes, str)):
        return reprlib.repr(value[:64])
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value) if abs(value) < 10**18 else "a very large integer"
    return f"a {type(value).__name__}"


def check_pickle(data: bytes | memoryview, *, where: str, max_bytes: int = MAX_PICKLE_BYTES) -> None:
    """Refuse a pickle before anything is built from it (see the module docstring).

    Raises UnsafePickleError for a global or persistent id, a size, depth,
    memo count or expansion beyond the bounds, and SourceError for bytes that
    are not a pickle. Costs about a microsecond per opcode.
    """
    if len(data) > max_bytes:
        raise UnsafePickleError(where, f"the pickle is {len(data):,} bytes, more than the {max_bytes:,} allowed")
    # Every stack entry is a mutable [objects, depth]: a container keeps its
    # entry while it is extended, and the memo holds the same entry, so an
    # object fetched from the memo brings everything it holds.
    max_objects = 1024 + 4 * len(data)
    stack: list[Any] = []
    memo: dict[Any, list[int]] = {}
    names: list[str] = []
    try:
        for op, arg, _pos in pickletools.genops(bytes(data)):
            name = op.name
            if isinstance(arg, str):
                names = (names + [arg])[-2:]
            _refuse_globals(name, arg, names, where)
            if name in _MEMO_PUT:
                if not stack or stack[-1] is _MARK:
                    raise ValueError("memo put with nothing on the stack")
                memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1]
                if len(memo) > MAX_PICKLE_MEMO:
                    raise UnsafePickleError(where, f"the pickle has more than {MAX_PICKLE_MEMO:,} memo entries")
                continue
            if name in _MEMO_GET:
                if arg not in memo:
                    raise ValueError(f"memo key {arg} was never stored")
                stack.append(memo[arg])
                continue
            if name == "MARK":
                stack.append(_MARK)
                continue
            entry = _apply_op(op, stack)
            if entry is not None:
                _check_size(entry, max_objects, where)
    except UnsafePickleError:
        raise
    except Exception as exc:  # genops raises ValueError (and others) for malformed input
        raise SourceError(where, f"not a readable pickle ({type(exc).__name__}: {str(exc)[:200]})") from None


def _refuse_globals(name: str, arg: Any, names: list[str], where: str) -> None:
    """UnsafePickleError for an opcode that imports a global or asks for a persistent id
    (``names``: the last two strings pushed, which a STACK_GLOBAL names)."""
    if name not in _GLOBALS and name not in _PERSISTENT:
        return
    if name in _PERSISTENT:
        raise UnsafePickleError(where, "the pickle uses persistent ids; refused")
    what = arg if name == "GLOBAL" and isinstance(arg, str) else ".".join(names) if names else "a global"
    raise UnsafePickleError(
        where,
        f"the pickle asks for {str(what).replace(' ', '.')[:120]}; refused (loading it could run code)",
    )


def _apply_op(op: Any, stack: list[Any]) -> list[int] | None:
    """Apply one opcode (not a memo, mark or global one) to the stack of ``[objects, depth]``
    entries; the entry it leaves on top, to hold to the bounds (None for a DUP). Raises
    ValueError for a stack the opcode cannot work on (a malformed pickle)."""
    name = op.name
    before = op.stack_before
    items: list[list[int]] = []
    if _MARK in before:
        while stack and stack[-1] is not _MARK:
            items.append(stack.pop())
        if not stack:
            raise ValueError("no mark on the stack")
        stack.pop()
        below = before.index(_MARK)
    else:
        below = len(before)
    under = [stack.pop() for _ in range(below)] if len(stack) >= below else None
    if under is None or any(entry is _MARK for entry in under):
        raise ValueError(f"{name} finds too few items on the stack")
    if name in _EXTEND:
        container = under[-1]
        items += under[:-1]
        container[0] += sum(entry[0] for entry in items)
        container[1] = max([container[1]] + [1 + entry[1] for entry in items])
        stack.append(container)
        return container
    if name == "DUP":
        stack += [under[0], under[0]]
        return None
    items += under
    entry = [1 + sum(e[0] for e in items), 1 + max((e[1] for e in items), default=0)]
    stack += [entry] * len(op.stack_after)
    return entry


def _check_size(entry: list[int], max_objects: int, where: str) -> None:
    """UnsafePickleError for an object that expands beyond ``max_objects`` or ``MAX_PICKLE_DEPTH``."""
    if entry[0] > max_objects:
        raise UnsafePickleError(
            where, f"the pickle expands into more than {max_objects:,} objects (shared references); refused"
        )
    if entry[1] > MAX_PICKLE_DEPTH:
        raise UnsafePickleError(where, f"the pickle is nested more than {MAX_PICKLE_DEPTH} levels deep")


class RestrictedUnpickler(pickle.Unpickler):
    """An Unpickler that refuses every global, so it can only build plain data.

    Every way a pickle runs code (``REDUCE``, ``BUILD``, ``INST``, ``OBJ``,
    ``NEWOBJ``) needs a class or function from ``find_class`` first; refusing
    all of them leaves only the built-in containers and scalars.
    """

    def __init__(self, file: Any, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        raise UnsafePickleError(self.where, f"the pickle asks for {module}.{name}; refused (loading it could run code)")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(self.where, "the pickle uses persistent ids; refused")


def safe_loads(data: bytes | memoryview, *, where: str, max_bytes: int = MAX_PICKLE_BYTES) -> Any:
    """Unpickle ``data``: ``check_pickle`` first, then RestrictedUnpickler; errors name ``where``."""
    check_pickle(data, where=where, max_bytes=max_bytes)
    try:
        obj = RestrictedUnpickler(io.BytesIO(bytes(data)), where).load()
    except UnsafePickleError:
        raise
    except Exception as exc:  # malformed pickles raise many types
        raise SourceError(where, f"not a readable pickle ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(obj, _PLAIN):
        raise UnsafePickleError(where, f"unexpected {type(obj).__name__} in a pickle")
    return obj


@dataclass
class LegacyLayout:
    """What ``detect_legacy`` found: the kind, and the samples in order."""

    kind: str  # "pickled" or "basicsr"
    keys: list[bytes]
    names: list[str]
    labels: list[int]
    shapes: list[tuple[int, int, int] | None]


def _open_old(path: str) -> PageFile:
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, DATA_FILE)):
        raise NotAPackError(path, "no data.mdb here; pass the LMDB directory made by the recipe")
    try:
        return PageFile(os.path.join(path, DATA_FILE))
    except PageDamage as exc:
        if exc.kind == "truncated":
            raise NotAPackError(
                path,
                f"its {DATA_FILE} is truncated ({exc.why.removeprefix('it is truncated: ')})",
                "copy it again in full (an interrupted copy or download?)",
            ) from None
        raise NotAPackError(path, f"it cannot be read as an LMDB: {exc.why}") from None
    except OSError as exc:
        raise NotAPackError(path, f"cannot read {DATA_FILE} ({exc.strerror})", os_hint(exc)) from None


_DAMAGED = "the recipe LMDB is damaged: copy it again from a good copy, or repack from the source images"


def _get(pf: PageFile, key: bytes, path: str) -> memoryview | None:
    """The old LMDB's value under ``key``; SourceError when the pages on the way are damaged."""
    try:
        return pf.get(key)
    except PageDamage as exc:
        raise SourceError(path, f"cannot read key {_short(key)}: {exc.why}", _DAMAGED) from None


def _pickle_at(pf: PageFile, key: bytes, path: str, max_bytes: int = MAX_PICKLE_BYTES) -> Any:
    """Unpickle the value under ``key`` (None if absent), its size checked before it is read."""
    value = _get(pf, key, path)
    if value is None:
        return None
    return safe_loads(value, where=f"{path} key {key.decode(errors='replace')[:64]}", max_bytes=max_bytes)


def _all_keys(pf: PageFile, path: str) -> list[bytes]:
    try:
        return [key for _pgno, _depth, kind, nodes in pf.pages() if kind == P_LEAF for _off, key, _lohi, _fl in nodes]
    except PageDamage as exc:
        raise SourceError(path, f"cannot list its keys: {exc.why}", _DAMAGED) from None


def detect_legacy(path: str) -> LegacyLayout:
    """Recognise the layout of the recipe LMDB at ``path`` and list its samples."""
    path = os.path.abspath(path)
    if os.path.exists(os.path.join(path, "meta_info.txt")) or os.path.exists(os.path.join(path, "meta_info.pkl")):
        return _basicsr_layout(path)
    pf = _open_old(path)
    try:
        if _get(pf, b"__meta__", path) is not None:
            raise SourceError(path, "is already an lmdbfolder pack", "use it directly; nothing to import")
        keys = _pickle_at(pf, b"__keys__", path)
        if keys is not None:
            if not isinstance(keys, list) or not all(isinstance(k, (bytes, str)) for k in keys):
                raise SourceError(path, "__keys__ is not a list of keys")
            ordered = [k.encode() if isinstance(k, str) else bytes(k) for k in keys]
        else:
            numeric = [k for k in _all_keys(pf, path) if k.isdigit()]
            ordered = sorted(numeric, key=int)
        if not ordered:
            raise SourceError(
                path,
                "not a recognised recipe LMDB: no __keys__, no numeric keys, no meta_info.txt/.pkl",
                "lmdbfolder import reads folder2lmdb-style (pickled (bytes, label)) and BasicSR-style LMDBs",
            )
        _refuse_twice(ordered, path)
        length_blob = _get(pf, b"__len__", path)
        if length_blob is not None:
            length = _parse_length(length_blob, path)
            if length != len(ordered):
                raise SourceError(path, f"__len__ says {length} samples but {len(ordered)} keys were found")
    finally:
        pf.close()
    return LegacyLayout(
        "pickled", ordered, [k.decode("utf-8", "surrogateescape") for k in ordered], [], [None] * len(ordered)
    )


def _refuse_twice(keys: list[bytes], path: str) -> None:
    """A key listed twice would be imported twice (every epoch would see it twice): refused,
    as a list file naming a path twice is."""
    first: dict[bytes, int] = {}
    for i, key in enumerate(keys):
        if key in first:
            raise SourceError(
                path,
                f"key {_short(key)} is listed twice (samples {first[key]} and {i}); a sample must appear once",
                "the recipe's list of keys (__keys__ or meta_info) is damaged: fix it, or repack from the images",
            )
        first[key] = i


def _parse_length(blob: bytes | memoryview, path: str) -> int:
    if len(blob) > 1024:
        raise SourceError(path, f"__len__ is {len(blob):,} bytes, too long for a sample count")
    raw = bytes(blob)
    if raw.strip().isdigit():
        return int(raw)
    value = safe_loads(raw, where=f"{path} key __len__")
    if isinstance(value, (bytes, str)) and str(value if isinstance(value, str) else value.decode()).isdigit():
        return int(value)
    if type(value) is int:
        return value
    raise SourceError(path, f"__len__ holds {_short(value)}, not a sample count")


# At most 9 digits a dimension: a hostile meta_info's 5,000-digit one would make int() raise.
_META_LINE = re.compile(r"^(?P<name>.+?)\s+\((?P<shape>\s*\d{1,9}\s*(?:,\s*\d{1,9}\s*){1,2})\)(?:\s+\S+)?\s*$")


def _basicsr_layout(path: str) -> LegacyLayout:
    try:
        return _read_basicsr_layout(path)
    except OSError as exc:  # a FIFO or a device named meta_info.*, permissions
        raise SourceError(exc.filename or path, f"cannot read it ({exc.strerror or exc})", os_hint(exc)) from None


def _read_basicsr_layout(path: str) -> LegacyLayout:
    txt = os.path.join(path, "meta_info.txt")
    names: list[str] = []
    shapes: list[tuple[int, int, int] | None] = []
    if os.path.exists(txt):
        with open(open_regular(txt), encoding="utf-8", errors="surrogateescape") as f:  # no FIFO, no device
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                m = _META_LINE.match(line.strip())
                if m is None:
                    raise SourceError(
                        f"{txt}:{lineno}", f"expected `name (H,W,C) [compression]`: {_short(line.strip())}"
                    )
                dims = [int(x) for x in m["shape"].split(",")]
                h, w, c = (dims + [1])[:3]
                names.append(m["name"])
                shapes.append((h, w, c))
    else:
        pkl = os.path.join(path, "meta_info.pkl")
        try:
            blob = read_regular(pkl, MAX_PICKLE_BYTES)  # no FIFO, no device, bounded
        except OSError as exc:
            if exc.errno == errno.EFBIG:
                raise UnsafePickleError(pkl, f"it is larger than the {MAX_PICKLE_BYTES:,} bytes allowed") from None
            raise
        meta = safe_loads(blob, where=pkl)
        if not isinstance(meta, dict) or not isinstance(meta.get("keys"), list):
            raise SourceError(f"{path}/meta_info.pkl", "expected a dict with a 'keys' list")
        resolutions = meta.get("resolution")
        for i, key in enumerate(meta["keys"]):
            names.append(key.decode() if isinstance(key, bytes) else str(key))
            res = resolutions[i] if isinstance(resolutions, list) and i < len(resolutions) else resolutions
            shapes.append(_parse_chw(res, path))
    if not names:
        raise SourceError(path, "meta_info lists no images")
    # BasicSR keys are the names without their extension; some variants keep it.
    pf = _open_old(path)
    try:
        keys = []
        for name in names:
            stem = os.path.splitext(name)[0].encode("utf-8", "surrogateescape")
            full = name.encode("utf-8", "surrogateescape")
            keys.append(stem if _get(pf, stem, path) is not None else full)
    finally:
        pf.close()
    _refuse_twice(keys, path)
    return LegacyLayout("basicsr", keys, names, [], shapes)


def _parse_chw(res: Any, path: str) -> tuple[int, int, int] | None:
    if res is None:
        return None
    if isinstance(res, str) and re.fullmatch(r"\d{1,9}_\d{1,9}_\d{1,9}", res):
        c, h, w = (int(x) for x in res.split("_"))
        return h, w, c
    raise SourceError(f"{path}/meta_info.pkl", f"resolution {_short(res)} is not 'C_H_W'")


def _class_names(given: Sequence[str] | None, n_classes: int, old: str) -> list[str]:
    """The class names of an import: ``given`` (checked against the labels), or ``"0"``, ``"1"``, ..."""
    if given is None:
        return [str(i) for i in range(n_classes)]
    if isinstance(given, str):
        raise OptionError("classes must be a list of class names (label i is classes[i]), not one string")
    names = [str(n) for n in given]
    bad = [n for n in names if not n or n != n.strip() or "\n" in n or "\x00" in n]
    if bad:
        raise OptionError(f"class names must be non-empty, without surrounding blanks or newlines: {bad[0]!r}")
    seen: set[str] = set()
    for n in names:
        if n in seen:
            raise OptionError(f"the class name {n!r} is given twice")
        seen.add(n)
    if len(names) < n_classes:
        raise OptionError(
            f"{old} has labels 0..{n_classes - 1} ({n_classes:,} classes) but {len(names):,} class "
            f"name{'s were' if len(names) != 1 else ' was'} given",
            "give one name per label, in label order (line i of --classes FILE names label i)",
        )
    return names


def import_legacy(
    old: str | os.PathLike[str],
    new: str | os.PathLike[str],
    *,
    channel_order: str = "bgr",
    classes: Sequence[str] | None = None,
    overwrite: bool = False,
    restart: bool = False,
    progress: bool | None = None,
) -> PackResult:
    """Convert a recipe LMDB at ``old`` into a new lmdbfolder pack at ``new``.

    Args:
        old: the recipe's LMDB directory.
        new: the pack to create (same rules as ``pack``: resumable, atomic).
        channel_order: channel order of raw arrays in BasicSR-style LMDBs
            (``"bgr"``, OpenCV's, by default; ``"rgb"``). Packs are always RGB.
        classes: the class names, in label order (label ``i`` is
            ``classes[i]``; ``import --classes FILE``, one name a line). A
            recipe LMDB stores only the labels, so without it the classes are
            named ``"0"``, ``"1"``, ...; at least as many names as labels.
        overwrite, restart, progress: as for ``pack``.

    Pickled values are read with RestrictedUnpickler: a pickle that names
    any class or function is refused with UnsafePickleError. Each encoded
    image is checked as ``pack``'s default check checks a file: a value that is
    not an image, or a JPEG/PNG cut short, is skipped (``result.skipped``, and
    ``new/skipped.txt``).

    Example:
        >>> import_legacy("train_recipe.lmdb", "train.lmdb")  # doctest: +SKIP
    """
    if channel_order not in CHANNEL_ORDERS:
        raise ValueError(f"channel_order must be one of {CHANNEL_ORDERS}, got {channel_order!r}")
    old = os.path.abspath(os.fspath(old))
    layout = detect_legacy(old)
    pf = _open_old(old)
    try:
        loader: Callable[[int], Loaded | Skipped]
        if layout.kind == "pickled":
            labels, loader = _pickled_loader(pf, layout, old)
            n_classes = max(labels) + 1 if labels and max(labels) >= 0 else 0
            if n_classes > MAX_IMPORT_CLASSES:
                raise SourceError(
                    old,
                    f"its labels go up to {n_classes - 1:,}: "
                    f"more than the {MAX_IMPORT_CLASSES:,} classes an import makes",
                    "the labels are probably damaged; check the recipe LMDB (or repack from the source images)",
                )
            classes = _class_names(classes, n_classes, old)
            store = "encoded"
        else:
            if classes is not None:
                raise OptionError(
                    f"{old} holds images without labels (a BasicSR-style LMDB), so it has no classes to name",
                    "leave out --classes",
                )
            labels = [-1] * len(layout.keys)
            classes = []
            store = _basicsr_store(pf, layout, old)
            loader = _basicsr_loader(pf, layout, store, channel_order, old)
        sources = SourceList(
            old,
            IMPORTED_LAYOUT_PREFIX + layout.kind,
            layout.names,
            labels,
            classes,
            {c: i for i, c in enumerate(classes)},
        )
        options = PackOptions(
            store=store,
            check="none",
            workers=1,  # one read transaction on the old LMDB, used from this thread only
            overwrite=overwrite,
            restart=restart,
            progress=progress,
        )
        return pack_sources(sources, new, options, loader=loader, mean_size=_mean_value_size(pf, layout.keys, old))
    finally:
        pf.close()


def _mean_value_size(pf: PageFile, keys: list[bytes], path: str) -> float:
    sample = [_get(pf, k, path) for k in keys[:: max(1, len(keys) // 200)]]
    sizes = [len(v) for v in sample if v is not None]
    return sum(sizes) / len(sizes) if sizes else 0.0


def _pickled_sample(value: bytes | memoryview, where: str) -> tuple[bytes, int]:
    if bytes(value[:1]) != b"\x80":
        raise SourceError(
            where,
            "the value is not a pickle (pyarrow-serialised recipes need pyarrow < 2.0 to read)",
            "repack from the source images with `lmdbfolder pack`",
        )
    obj = safe_loads(value, where=where)
    if isinstance(obj, dict):
        obj = (obj.get("image", obj.get("img")), obj.get("label", obj.get("target")))
    if not (isinstance(obj, (tuple, list)) and len(obj) == 2 and isinstance(obj[0], (bytes, bytearray))):
        raise SourceError(where, f"expected a pickled (image_bytes, label) pair, found {type(obj).__name__}")
    image, label = obj
    if label is None:
        label = -1
    if type(label) is not int:
        raise SourceError(where, f"its label is {_short(label)}, not an integer")
    if not (label == -1 or 0 <= label <= _MAX_LABEL):
        raise SourceError(where, f"its label {_short(label)} is not a class index (0..{_MAX_LABEL}) or -1 (none)")
    return bytes(image), label


def _pickled_loader(
    pf: PageFile, layout: LegacyLayout, old: str
) -> tuple[list[int], Callable[[int], Loaded | Skipped]]:
    # Labels must be known before packing (they are part of the sample list),
    # so every value is unpickled once here; images are re-read by the loader.
    labels = []
    for key in layout.keys:
        value = _get(pf, key, old)
        if value is None:
            raise SourceError(old, f"key {_short(key)} is listed but missing")
        labels.append(_pickled_sample(value, f"{old} key {key.decode(errors='replace')[:64]}")[1])

    def load(i: int) -> Loaded | Skipped:
        key = layout.keys[i]
        value = _get(pf, key, old)
        if value is None:
            return Skipped("the key vanished from the old LMDB")
        image, label = _pickled_sample(value, f"{old} key {key.decode(errors='replace')[:64]}")
        if not image:
            return Skipped("empty image bytes")
        return load_bytes(image, label, check="header", max_pixels=Image.MAX_IMAGE_PIXELS)

    return labels, load


def _basicsr_store(pf: PageFile, layout: LegacyLayout, old: str) -> str:
    first = _get(pf, layout.keys[0], old)
    if first is None:
        raise SourceError(layout.names[0], "is listed in meta_info but missing from the LMDB")
    return "encoded" if sniff(first).recognised else "raw"


def _basicsr_loader(
    pf: PageFile, layout: LegacyLayout, store: str, channel_order: str, old: str
) -> Callable[[int], Loaded | Skipped]:
    import numpy as np

    def load(i: int) -> Loaded | Skipped:
        value = _get(pf, layout.keys[i], old)
        if value is None:
            return Skipped("listed in meta_info but missing from the LMDB")
        info = sniff(value)
        if info.recognised != (store == "encoded"):
            return Skipped(f"mixes encoded images and raw arrays; this pack stores {store} values")
        if info.recognised:
            return load_bytes(value, -1, check="header", max_pixels=Image.MAX_IMAGE_PIXELS)
        shape = layout.shapes[i]
        if shape is None:
            return Skipped("raw array without a shape in meta_info")
        h, w, c = shape
        if len(value) != h * w * c or c not in (1, 3, 4):
            return Skipped(f"{len(value)} bytes do not match the shape {h}x{w}x{c} from meta_info")
        pixels = np.frombuffer(value, dtype=np.uint8).reshape(h, w, c)
        if c == 1:
            pixels = np.repeat(pixels, 3, axis=2)
        elif c == 4:
            pixels = pixels[:, :, :3]
        if channel_order == "bgr" and c != 1:
            pixels = pixels[:, :, ::-1]
        rgb = np.ascontiguousarray(pixels).tobytes()
        record = encode_record(rgb, label=-1, encoding=RAW.name, width=w, height=h, channels=3)
        return Loaded(record, RAW.name, len(value))

    return load


# -- a pair of BasicSR LMDBs ------------------------------------------------------------------------
@dataclass
class _PairReader:
    """``FieldSamples.read`` of a BasicSR LMDB pair: the LQ and GT values of pair ``i`` (encoded
    images), the GT checked to be ``scale`` times the LQ. Each LMDB is opened once, on first use."""

    lq: str
    gt: str
    lq_keys: list[bytes]
    gt_keys: list[bytes]
    field_paths: list[tuple[str, ...]]
    scale: int
    _files: tuple[PageFile, PageFile] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_files": None}  # an open LMDB does not travel to another process

    def __call__(self, i: int) -> list[bytes]:
        from lmdbfolder.write.fields import SampleError
        from lmdbfolder.write.layouts import check_pair_scale

        if self._files is None:
            self._files = (_open_old(self.lq), _open_old(self.gt))
        paths = self.field_paths[i]
        out = []
        for pf, key, old, rel in zip(self._files, (self.lq_keys[i], self.gt_keys[i]), (self.lq, self.gt), paths):
            value = _get(pf, key, old)
            if value is None:
                raise SampleError(f"{rel} is listed in meta_info but missing from the LMDB", paths)
            if not sniff(value).recognised:
                raise SampleError(
                    f"{rel} is a raw array, not an encoded image (an old BasicSR LMDB): repack it with "
                    "BasicSR's scripts/data_preparation/create_lmdb.py, which stores PNG bytes",
                    paths,
                )
            out.append(bytes(value))
        check_pair_scale(out[0], out[1], self.scale, paths)
        return out


def basicsr_pair_samples(lq: str | os.PathLike[str], gt: str | os.PathLike[str], *, scale: int | None = None) -> Any:
    """The (LQ, GT) samples of a pair of BasicSR LMDBs, as ``PairedImageDataset`` with
    ``io_backend: lmdb`` pairs them (basicsr/data/data_util.py ``paired_paths_from_lmdb``): the
    keys both ``meta_info.txt`` files list, sorted. BasicSR refuses LMDBs whose key sets differ;
    here a key only one of them holds is skipped and listed. ``scale`` (the GT size over the LQ
    size) defaults to the one the two ``meta_info`` files' shapes agree on.

    Returns a ``write.fields.FieldSamples`` of layout ``pairs`` (fields ``lq``, ``gt``), for
    ``write.fields.pack_field_samples``; its ``root`` is the folder holding both LMDBs."""
    from lmdbfolder.format import NO_LABEL
    from lmdbfolder.write.fields import FieldSamples
    from lmdbfolder.write.layouts import PAIR_FIELDS, check_scale

    lq_dir, gt_dir = os.path.abspath(os.fspath(lq)), os.path.abspath(os.fspath(gt))
    found = []
    for path in (lq_dir, gt_dir):
        layout = detect_legacy(path)
        if layout.kind != "basicsr":
            raise SourceError(
                path, "is not a BasicSR LMDB (no meta_info.txt beside data.mdb)", "pass the LQ and GT LMDB folders"
            )
        found.append(layout)
    lq_layout, gt_layout = found
    lq_by_key = {k: j for j, k in enumerate(lq_layout.keys)}
    gt_by_key = {k: j for j, k in enumerate(gt_layout.keys)}
    common = sorted(set(lq_by_key) & set(gt_by_key))  # paired_paths_from_lmdb: sorted(keys)
    skipped = [
        (f"{os.path.basename(lq_dir)}/{lq_layout.names[lq_by_key[k]]}", f"an LQ image without its GT (not in {gt_dir})")
        for k in lq_layout.keys
        if k not in gt_by_key
    ] + [
        (f"{os.path.basename(gt_dir)}/{gt_layout.names[gt_by_key[k]]}", f"a GT image without its LQ (not in {lq_dir})")
        for k in gt_layout.keys
        if k not in lq_by_key
    ]
    if scale is None:
        ratios = set()
        for k in common:
            a, b = lq_layout.shapes[lq_by_key[k]], gt_layout.shapes[gt_by_key[k]]
            if a is not None and b is not None and a[0] and b[0] % a[0] == 0:
                ratios.add(b[0] // a[0])
        if len(ratios) != 1:
            raise OptionError(
                f"the scale of {gt_dir} over {lq_dir} cannot be read from their meta_info shapes "
                f"({'they disagree' if ratios else 'none fits'})",
                "pass it: --scale N",
            )
        scale = ratios.pop()
    s = check_scale(scale)
    lq_names = [lq_layout.names[lq_by_key[k]] for k in common]
    gt_names = [gt_layout.names[gt_by_key[k]] for k in common]
    field_paths: list[tuple[str, ...]] = [
        (f"{os.path.basename(lq_dir)}/{a}", f"{os.path.basename(gt_dir)}/{b}") for a, b in zip(lq_names, gt_names)
    ]
    reader = _PairReader(
        lq_dir,
        gt_dir,
        [lq_layout.keys[lq_by_key[k]] for k in common],
        [gt_layout.keys[gt_by_key[k]] for k in common],
        field_paths,
        s,
    )
    if lq_dir == gt_dir:
        raise OptionError(f"the LQ and GT LMDBs are the same folder {lq_dir}", "pass the LQ LMDB, then the GT LMDB")
    return FieldSamples(
        layout="pairs",
        root=os.path.commonpath([lq_dir, gt_dir]),
        fields=PAIR_FIELDS,
        relpaths=[p[0] for p in field_paths],
        field_paths=field_paths,
        labels=[NO_LABEL] * len(field_paths),
        classes=[],
        read=reader,
        skipped=skipped,
        layout_info={
            "scale": s,
            "source": "basicsr-lmdb",
            "lq": os.path.basename(lq_dir),
            "gt": os.path.basename(gt_dir),
        },
    )


def import_basicsr_pair(
    lq: str | os.PathLike[str],
    gt: str | os.PathLike[str],
    new: str | os.PathLike[str],
    *,
    scale: int | None = None,
    overwrite: bool = False,
    restart: bool = False,
    progress: bool | None = None,
) -> PackResult:
    """Import a pair of BasicSR LMDBs (LQ and GT, the same keys; ``meta_info.txt`` beside each
    ``data.mdb``) into one new pack of layout ``pairs`` at ``new``: fields ``lq`` and ``gt``, the
    encoded images' bytes unchanged, in ``PairedImageDataset``'s order (``basicsr_pair_samples``).

    Example:
        >>> import_basicsr_pair("DIV2K_train_LR_bicubic_X4_sub.lmdb", "DIV2K_train_HR_sub.lmdb",
        ...                     "div2k-x4.lmdb")  # doctest: +SKIP
    """
    from lmdbfolder.write.fields import pack_field_samples

    samples = basicsr_pair_samples(lq, gt, scale=scale)
    # one reader: the old LMDBs are read through one PageFile each, from the writer's thread
    options = PackOptions(workers=1, overwrite=overwrite, restart=restart, progress=progress)
    result = pack_field_samples(samples, new, options)
    if not isinstance(result, PackResult):  # no shards asked for: one pack
        raise TypeError(f"pack_field_samples made {type(result).__name__}, not one pack")
    return result

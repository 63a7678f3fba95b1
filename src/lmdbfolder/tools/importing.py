"""Convert the LMDBs that the popular recipes produce into lmdbfolder packs, safely.

Two layouts are recognised:

* **pickled samples** (Efficient-PyTorch ``folder2lmdb`` and its many forks):
  keys ``str(index)``, each value ``pickle((image_bytes, label))``, plus a
  ``__len__`` key and often ``__keys__`` (the pickled list of keys);
* **BasicSR-style image LMDBs**: keys are image names, values are either
  encoded images (PNG/JPEG bytes) or raw ``uint8`` arrays, with a
  ``meta_info.txt`` (``name (H,W,C) compression``) or ``meta_info.pkl``
  (``{"keys": [...], "resolution": ["C_H_W", ...]}``) next to ``data.mdb``.

Pickle is only ever read through ``RestrictedUnpickler``, which builds plain
tuples, lists, dicts, str, bytes, int, float, bool and None, and refuses
every global (class or function) a pickle names, so a malicious file cannot
run code: it fails with ``UnsafePickleError`` instead.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from dataclasses import dataclass
from typing import Any, Callable

import lmdb

from lmdbfolder.codecs import sniff
from lmdbfolder.errors import NotAPackError, SourceError, UnsafePickleError
from lmdbfolder.format import DATA_FILE, encode_record
from lmdbfolder.write.options import PackOptions
from lmdbfolder.write.records import Loaded, Skipped
from lmdbfolder.write.sources import SourceList
from lmdbfolder.write.writer import PackResult, pack_sources

__all__ = [
    "RestrictedUnpickler",
    "safe_loads",
    "LegacyLayout",
    "detect_legacy",
    "import_legacy",
]

CHANNEL_ORDERS = ("bgr", "rgb")
_PLAIN = (tuple, list, dict, str, bytes, bytearray, int, float, bool, type(None))


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


def safe_loads(data: bytes | memoryview, *, where: str) -> Any:
    """Unpickle ``data`` with RestrictedUnpickler; errors name ``where``."""
    try:
        obj = RestrictedUnpickler(io.BytesIO(bytes(data)), where).load()
    except UnsafePickleError:
        raise
    except Exception as exc:  # malformed pickles raise many types
        raise SourceError(where, f"not a readable pickle ({type(exc).__name__}: {exc})") from None
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


def _open_old(path: str) -> lmdb.Environment:
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, DATA_FILE)):
        raise NotAPackError(path, "no data.mdb here; pass the LMDB directory made by the recipe")
    try:
        return lmdb.open(path, readonly=True, lock=False, subdir=True, readahead=True)
    except lmdb.Error as exc:
        raise NotAPackError(path, f"LMDB cannot open it: {exc}") from None


def detect_legacy(path: str) -> LegacyLayout:
    """Recognise the layout of the recipe LMDB at ``path`` and list its samples."""
    path = os.path.abspath(path)
    if os.path.exists(os.path.join(path, "meta_info.txt")) or os.path.exists(os.path.join(path, "meta_info.pkl")):
        return _basicsr_layout(path)
    env = _open_old(path)
    try:
        with env.begin() as txn:
            if txn.get(b"__meta__") is not None:
                raise SourceError(path, "is already an lmdbfolder pack", "use it directly; nothing to import")
            keys_blob = txn.get(b"__keys__")
            if keys_blob is not None:
                keys = safe_loads(keys_blob, where=f"{path} key __keys__")
                if not isinstance(keys, list) or not all(isinstance(k, (bytes, str)) for k in keys):
                    raise SourceError(path, "__keys__ is not a list of keys")
                ordered = [k.encode() if isinstance(k, str) else bytes(k) for k in keys]
            else:
                numeric = [bytes(k) for k in txn.cursor().iternext(values=False) if bytes(k).isdigit()]
                ordered = sorted(numeric, key=int)
            if not ordered:
                raise SourceError(
                    path,
                    "not a recognised recipe LMDB: no __keys__, no numeric keys, no meta_info.txt/.pkl",
                    "lmdbfolder import reads folder2lmdb-style (pickled (bytes, label)) and BasicSR-style LMDBs",
                )
            length_blob = txn.get(b"__len__")
            if length_blob is not None:
                length = _parse_length(length_blob, path)
                if length != len(ordered):
                    raise SourceError(path, f"__len__ says {length} samples but {len(ordered)} keys were found")
    finally:
        env.close()
    return LegacyLayout(
        "pickled", ordered, [k.decode("utf-8", "surrogateescape") for k in ordered], [], [None] * len(ordered)
    )


def _parse_length(blob: bytes, path: str) -> int:
    raw = bytes(blob)
    if raw.strip().isdigit():
        return int(raw)
    value = safe_loads(raw, where=f"{path} key __len__")
    if isinstance(value, (bytes, str)) and str(value if isinstance(value, str) else value.decode()).isdigit():
        return int(value)
    if isinstance(value, int):
        return value
    raise SourceError(path, f"__len__ holds {value!r}, not a sample count")


_META_LINE = re.compile(r"^(?P<name>.+?)\s+\((?P<shape>\s*\d+\s*(?:,\s*\d+\s*){1,2})\)(?:\s+\S+)?\s*$")


def _basicsr_layout(path: str) -> LegacyLayout:
    txt = os.path.join(path, "meta_info.txt")
    names: list[str] = []
    shapes: list[tuple[int, int, int] | None] = []
    if os.path.exists(txt):
        with open(txt, encoding="utf-8", errors="surrogateescape") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                m = _META_LINE.match(line.strip())
                if m is None:
                    raise SourceError(f"{txt}:{lineno}", f"expected `name (H,W,C) [compression]`: {line.strip()!r}")
                dims = [int(x) for x in m["shape"].split(",")]
                h, w, c = (dims + [1])[:3]
                names.append(m["name"])
                shapes.append((h, w, c))
    else:
        with open(os.path.join(path, "meta_info.pkl"), "rb") as f:
            meta = safe_loads(f.read(), where=f"{path}/meta_info.pkl")
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
    env = _open_old(path)
    try:
        with env.begin() as txn:
            keys = []
            for name in names:
                stem = os.path.splitext(name)[0].encode("utf-8", "surrogateescape")
                full = name.encode("utf-8", "surrogateescape")
                keys.append(stem if txn.get(stem) is not None else full)
    finally:
        env.close()
    return LegacyLayout("basicsr", keys, names, [], shapes)


def _parse_chw(res: Any, path: str) -> tuple[int, int, int] | None:
    if res is None:
        return None
    if isinstance(res, str) and re.fullmatch(r"\d+_\d+_\d+", res):
        c, h, w = (int(x) for x in res.split("_"))
        return h, w, c
    raise SourceError(f"{path}/meta_info.pkl", f"resolution {res!r} is not 'C_H_W'")


def import_legacy(
    old: str | os.PathLike[str],
    new: str | os.PathLike[str],
    *,
    channel_order: str = "bgr",
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
        overwrite, restart, progress: as for ``pack``.

    Pickled values are read with RestrictedUnpickler: a pickle that names
    any class or function is refused with UnsafePickleError.

    Example:
        >>> import_legacy("train_recipe.lmdb", "train.lmdb")  # doctest: +SKIP
    """
    if channel_order not in CHANNEL_ORDERS:
        raise ValueError(f"channel_order must be one of {CHANNEL_ORDERS}, got {channel_order!r}")
    old = os.path.abspath(os.fspath(old))
    layout = detect_legacy(old)
    env = _open_old(old)
    try:
        loader: Callable[[int], Loaded | Skipped]
        if layout.kind == "pickled":
            labels, loader = _pickled_loader(env, layout, old)
            n_classes = max(labels) + 1 if labels and max(labels) >= 0 else 0
            classes = [str(i) for i in range(n_classes)]
            store = "encoded"
        else:
            labels = [-1] * len(layout.keys)
            classes = []
            store = _basicsr_store(env, layout)
            loader = _basicsr_loader(env, layout, store, channel_order)
        sources = SourceList(
            old, "legacy-" + layout.kind, layout.names, labels, classes, {c: i for i, c in enumerate(classes)}
        )
        options = PackOptions(
            store=store,
            check="none",
            workers=1,  # one read transaction on the old LMDB, used from this thread only
            overwrite=overwrite,
            restart=restart,
            progress=progress,
        )
        return pack_sources(sources, new, options, loader=loader, mean_size=_mean_value_size(env, layout.keys))
    finally:
        env.close()


def _mean_value_size(env: lmdb.Environment, keys: list[bytes]) -> float:
    with env.begin() as txn:
        sample = [txn.get(k) for k in keys[:: max(1, len(keys) // 200)]]
    sizes = [len(v) for v in sample if v is not None]
    return sum(sizes) / len(sizes) if sizes else 0.0


def _pickled_sample(value: bytes, where: str) -> tuple[bytes, int]:
    if not value.startswith(b"\x80"):
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
    if not isinstance(label, int):
        raise SourceError(where, f"label {label!r} is not an integer")
    return bytes(image), label


def _pickled_loader(
    env: lmdb.Environment, layout: LegacyLayout, old: str
) -> tuple[list[int], Callable[[int], Loaded | Skipped]]:
    # Labels must be known before packing (they are part of the sample list),
    # so every value is unpickled once here; images are re-read by the loader.
    labels = []
    with env.begin() as txn:
        for key in layout.keys:
            value = txn.get(key)
            if value is None:
                raise SourceError(old, f"key {key!r} is listed but missing")
            labels.append(_pickled_sample(value, f"{old} key {key.decode(errors='replace')}")[1])
    txn = env.begin()

    def load(i: int) -> Loaded | Skipped:
        key = layout.keys[i]
        value = txn.get(key)
        if value is None:
            return Skipped("the key vanished from the old LMDB")
        image, label = _pickled_sample(value, f"{old} key {key.decode(errors='replace')}")
        if not image:
            return Skipped("empty image bytes")
        info = sniff(image)
        record = encode_record(
            image, label=label, encoding=info.encoding, width=info.width, height=info.height, channels=info.channels
        )
        return Loaded(record, info.encoding, len(image))

    return labels, load


def _basicsr_store(env: lmdb.Environment, layout: LegacyLayout) -> str:
    with env.begin() as txn:
        first = txn.get(layout.keys[0])
    if first is None:
        raise SourceError(layout.names[0], "is listed in meta_info but missing from the LMDB")
    return "encoded" if sniff(first).encoding != "other" else "raw"


def _basicsr_loader(
    env: lmdb.Environment, layout: LegacyLayout, store: str, channel_order: str
) -> Callable[[int], Loaded | Skipped]:
    import numpy as np

    txn = env.begin()

    def load(i: int) -> Loaded | Skipped:
        value = txn.get(layout.keys[i])
        if value is None:
            return Skipped("listed in meta_info but missing from the LMDB")
        info = sniff(value)
        if (info.encoding != "other") != (store == "encoded"):
            return Skipped(f"mixes encoded images and raw arrays; this pack stores {store} values")
        if info.encoding != "other":
            record = encode_record(
                value, label=-1, encoding=info.encoding, width=info.width, height=info.height, channels=info.channels
            )
            return Loaded(record, info.encoding, len(value))
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
        return Loaded(encode_record(rgb, label=-1, encoding="raw", width=w, height=h, channels=3), "raw", len(value))

    return load

"""``pack_dataset``: pack a dataset object (not a folder) into a classification pack.

A dataset is read through an adapter, one per kind of dataset, that says
before anything is written what ``pack_sources`` needs (the stored path and
the label of every sample, the class names) and gives sample ``i``'s encoded
image bytes while packing (``_Adapter``):

* ``_HuggingFace``: a Hugging Face ``datasets.Dataset`` (map-style) with an
  ``Image`` feature and a ``ClassLabel`` feature (or no label: an unlabelled
  pack). The bytes that the dataset holds are stored unchanged (the image
  column is read with ``Image(decode=False)``, never decoded and encoded
  again); an image held only as a local file path is read from that file. The
  classes are the ``ClassLabel`` names, in label order (unused ones kept). The
  stored path is the image's ``path`` when it is a relative path (the file name
  ``export --format huggingface`` wrote, or the one in a Hub dataset), else
  ``<index>.<ext>`` (8 digits, the extension of the encoding).
* ``_Samples``: a dataset with torchvision's ``samples`` list of ``(file path,
  class index)`` and ``classes`` (``ImageFolder``, ``DatasetFolder``): the files'
  bytes, unchanged, at their paths relative to ``dataset.root``.
* ``_Items``: any other map-style dataset (``len`` and ``dataset[i]``) whose
  items are ``(image, label)``: the image a file path (its bytes, unchanged) or
  a PIL image (stored as a lossless PNG: the original bytes are gone); the label
  an ``int``. Every item is read once before packing (the sample list: its
  label, and the encoding its stored name ``<index>.<ext>`` ends in) and once to
  pack it; the classes are ``classes=``, else ``dataset.classes``, else ``"0"``,
  ``"1"``, ...

Samples of several fields (torchvision's ``VOCSegmentation``, ``Cityscapes``,
``CocoDetection``, and any map-style dataset whose items are several values)
are adapters of the same entry point (``write.dataset_fields``), packed by
``pack_field_samples`` into a pack of several fields; a dataset no adapter
takes is refused with what each one needs.

The pack is written by ``pack_sources`` with a loader (as ``import_legacy``
does): resumable, atomic, each image checked as ``pack`` checks a file
(``check``), the undecodable ones skipped and reported. Nothing here imports
``datasets`` or ``torch``: the dataset object is used through its own methods.
"""

from __future__ import annotations

import dataclasses
import io
import os
from typing import Any, Callable, Sequence

from PIL import Image

from lmdbfolder.encodings import encoding_of, sniff
from lmdbfolder.errors import OptionError, SourceError
from lmdbfolder.format import NO_LABEL, SKIPPED_REPORT
from lmdbfolder.write.dataset_fields import field_samples_of
from lmdbfolder.write.fields import pack_field_samples
from lmdbfolder.write.options import PackOptions, pack_options
from lmdbfolder.write.records import Loaded, Skipped, load_bytes
from lmdbfolder.write.shards import ShardedPackResult
from lmdbfolder.write.sources import SourceList
from lmdbfolder.write.writer import PackResult, pack_sources, warn_skipped

__all__ = ["pack_dataset", "KINDS"]

#: The kinds of dataset ``pack_dataset`` takes, in the order they are tried.
KINDS = ("huggingface", "samples", "items")
#: File extension of each stored encoding, for samples without a usable path.
#: Rows read at a time when the labels and paths of a Hugging Face dataset are listed.
_BATCH = 1000


@dataclasses.dataclass
class _Adapter:
    """What ``pack_sources`` needs from a dataset: the sample list up front, and the bytes of
    sample ``i`` (``read(i)``: encoded image bytes, or None with the reason in ``why``)."""

    kind: str
    root: str
    relpaths: list[str]
    labels: list[int]
    classes: list[str]
    read: Callable[[int], bytes]
    #: the expected bytes per sample (sizes the map), from a few samples
    mean_size: float = 0.0


def _safe_relpath(path: Any) -> str | None:
    """``path`` when it is a plain relative path (no empty, ``.`` or ``..`` step, no NUL), with ``/``."""
    if not isinstance(path, str) or not path or "\0" in path or os.path.isabs(path) or path.startswith("\\"):
        return None
    rel = path.replace("\\", "/")
    if any(part in ("", ".", "..") for part in rel.split("/")):
        return None
    return rel


def _numbered(index: int, head: bytes | memoryview | None) -> str:
    """``<index>.<ext>``: the name of a sample without a usable path (the extension of its encoding)."""
    info = sniff(head) if head else None
    ext = (encoding_of(info.encoding).extension or info.encoding) if info is not None and info.recognised else "bin"
    return f"{index:08d}.{ext}"


def _class_names(given: Any, n_labels: int, where: str) -> list[str]:
    if given is None:
        return [str(i) for i in range(n_labels)]
    names = list(given)
    if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise OptionError(f"{where}: the class names must be distinct strings", "pass classes=[...] of names")
    if len(names) < n_labels:
        raise OptionError(
            f"{where}: the labels go up to {n_labels - 1} but only {len(names)} class names were given",
            "pass classes=[...] naming every class, in label order",
        )
    return names


# -- Hugging Face datasets -------------------------------------------------------------------------
def _is_huggingface(dataset: Any) -> bool:
    return hasattr(dataset, "features") and hasattr(dataset, "cast_column") and hasattr(dataset, "with_format")


def _feature_named(features: Any, kind: str, given: str | None, what: str) -> str | None:
    """The column of the one feature of type ``kind`` (``Image``, ``ClassLabel``), or ``given``."""
    if given is not None:
        if given not in features:
            raise OptionError(f"the dataset has no column {given!r} (columns: {', '.join(features)})")
        if type(features[given]).__name__ != kind:
            raise OptionError(
                f"the column {given!r} is a {type(features[given]).__name__}, not a {kind}",
                f"name the {what} column ({kind})",
            )
        return given
    found = [name for name, feature in features.items() if type(feature).__name__ == kind]
    if len(found) > 1:
        raise OptionError(
            f"the dataset has {len(found)} {kind} columns ({', '.join(found)})",
            f"say which holds the {what}: pack_dataset(..., {'image' if kind == 'Image' else 'label'}=NAME)",
        )
    return found[0] if found else None


def _huggingface(dataset: Any, image: str | None, label: str | None) -> _Adapter:
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise OptionError(
            "pack_dataset takes a map-style Hugging Face Dataset, not an IterableDataset (streaming)",
            "load it without streaming=True, or pick a split: load_dataset(...)['train']",
        )
    features = dataset.features
    image_col = _feature_named(features, "Image", image, "images")
    if image_col is None:
        raise OptionError(
            "the dataset has no Image column (features: "
            + ", ".join(f"{k}: {type(v).__name__}" for k, v in features.items())
            + ")",
            "cast the image column first: dataset.cast_column(NAME, datasets.Image())",
        )
    label_col = _feature_named(features, "ClassLabel", label, "labels")
    # Image(decode=False) gives {"bytes", "path"}: the stored bytes, never decoded.
    raw = dataset.cast_column(image_col, dataclasses.replace(features[image_col], decode=False))
    columns = [image_col] + ([label_col] if label_col else [])
    raw = raw.select_columns(columns)
    relpaths: list[str] = []
    labels: list[int] = []
    sizes: list[int] = []
    index = 0
    for batch in raw.with_format("arrow").iter(batch_size=_BATCH):
        images = batch.column(image_col).combine_chunks()
        paths = images.field("path").to_pylist()
        blobs = images.field("bytes")
        for k, path in enumerate(paths):
            rel = _safe_relpath(path)
            blob = blobs[k]
            if rel is None:
                head = blob.as_buffer()[:64] if blob.is_valid else _file_head(path)
                rel = _numbered(index, head)
            relpaths.append(rel)
            if blob.is_valid and len(sizes) < 1000:
                sizes.append(len(blob.as_buffer()))
            index += 1
        if label_col:
            for value in batch.column(label_col).to_pylist():
                labels.append(NO_LABEL if value is None or value < 0 else int(value))
    if not label_col:
        labels = [NO_LABEL] * len(relpaths)
    classes = list(features[label_col].names) if label_col else []
    image_only = raw.select_columns([image_col])

    def read(i: int) -> bytes:
        value = image_only[i][image_col]
        if value is None:
            raise _NoImage("the dataset holds no image for this row (None)")
        if value.get("bytes") is not None:
            return bytes(value["bytes"])
        path = value.get("path")
        if isinstance(path, str) and os.path.isfile(path):
            with open(path, "rb") as f:
                return f.read()
        raise _NoImage(f"the dataset holds neither the bytes nor a readable file ({path!r})")

    name = getattr(getattr(dataset, "info", None), "dataset_name", None) or "a Hugging Face dataset"
    return _Adapter("huggingface", str(name), relpaths, labels, classes, read, _mean(sizes))


def _file_head(path: Any) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(64)
    except (OSError, TypeError):
        return None


def _mean(sizes: Sequence[int]) -> float:
    return sum(sizes) / len(sizes) if sizes else 0.0


class _NoImage(Exception):
    """A sample without image bytes: skipped and reported as the reason given."""


# -- torchvision-like datasets ----------------------------------------------------------------------
def _is_samples(dataset: Any) -> bool:
    samples = getattr(dataset, "samples", None)
    return (
        isinstance(samples, Sequence)
        and isinstance(getattr(dataset, "classes", None), Sequence)
        and all(isinstance(s, tuple) and len(s) == 2 and isinstance(s[0], (str, os.PathLike)) for s in samples[:1])
    )


def _samples(dataset: Any, classes: Sequence[str] | None) -> _Adapter:
    files = [os.fspath(path) for path, _ in dataset.samples]
    labels = [int(label) for _, label in dataset.samples]
    root = os.fspath(getattr(dataset, "root", None) or (os.path.commonpath(files) if files else ""))
    names = _class_names(classes if classes is not None else dataset.classes, max(labels, default=-1) + 1, root)
    relpaths = [os.path.relpath(f, root).replace(os.sep, "/") if root else os.path.basename(f) for f in files]
    relpaths = [r if _safe_relpath(r) else os.path.basename(f) for r, f in zip(relpaths, files)]

    def read(i: int) -> bytes:
        with open(files[i], "rb") as f:
            return f.read()

    sizes = [os.stat(f).st_size for f in files[:: max(1, len(files) // 200)] if os.path.isfile(f)]
    return _Adapter("samples", root, relpaths, labels, names, read, _mean(sizes))


def _item_bytes(item: Any, where: str) -> bytes:
    if isinstance(item, (str, os.PathLike)):
        with open(item, "rb") as f:
            return f.read()
    if isinstance(item, Image.Image):
        out = io.BytesIO()
        item.save(out, "PNG")  # lossless: the pixels as the dataset gave them
        return out.getvalue()
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    raise SourceError(
        where,
        f"its image is a {type(item).__name__}; pack_dataset takes a file path, a PIL image or encoded bytes",
        "give the dataset no transform (the images as loaded), or pack the image files themselves",
    )


def _items(dataset: Any, classes: Sequence[str] | None) -> _Adapter:
    n = len(dataset)
    where = f"{type(dataset).__name__} dataset"

    def item(i: int) -> tuple[Any, int]:
        got = dataset[i]
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            raise SourceError(
                f"{where}, item {i}",
                f"it is a {type(got).__name__}, not an (image, label) pair",
                "pack_dataset takes datasets whose items are (image, label); samples of several fields come later",
            )
        image, label = got
        if isinstance(label, bool) or not hasattr(label, "__index__"):
            raise SourceError(f"{where}, item {i}", f"its label is a {type(label).__name__}, not an int")
        label = int(label.__index__())
        if label < 0 and label != NO_LABEL:
            raise SourceError(f"{where}, item {i}", f"its label {label} is not a class index (0..) or -1 (none)")
        return image, label

    # The sample list comes before packing: every item is read once to list its label and the
    # encoding its name ends in, and once more to pack it.
    labels: list[int] = []
    relpaths: list[str] = []
    sizes: list[int] = []
    for i in range(n):
        image, label = item(i)
        data = _item_bytes(image, f"{where}, item {i}")
        labels.append(label)
        relpaths.append(_numbered(i, data[:64]))
        if len(sizes) < 1000:
            sizes.append(len(data))
    own = getattr(dataset, "classes", None)
    names = _class_names(classes if classes is not None else own, max(labels, default=-1) + 1, where)

    def read(i: int) -> bytes:
        return _item_bytes(item(i)[0], f"{where}, item {i}")

    return _Adapter("items", where, relpaths, labels, names, read, _mean(sizes))


def _adapter(dataset: Any, image: str | None, label: str | None, classes: Sequence[str] | None) -> _Adapter:
    if _is_huggingface(dataset):
        if classes is not None:
            raise OptionError(
                "a Hugging Face dataset's classes are its ClassLabel names",
                "leave out classes=, or cast the label column: dataset.cast_column(NAME, ClassLabel(names=[...]))",
            )
        return _huggingface(dataset, image, label)
    if image is not None or label is not None:
        raise OptionError("image= and label= name the columns of a Hugging Face dataset", "leave them out")
    if _is_samples(dataset):
        return _samples(dataset, classes)
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        return _items(dataset, classes)
    raise OptionError(
        f"pack_dataset cannot read a {type(dataset).__name__}: it takes a Hugging Face Dataset (an Image and a "
        "ClassLabel column), a dataset with torchvision's samples and classes (ImageFolder), or a map-style "
        "dataset (len and [i]) of (image path or PIL image, int label) items",
        "for an iterable dataset, write its images to a folder and use pack",
    )


def pack_dataset(
    dataset: Any,
    dst: str | os.PathLike[str],
    options: PackOptions | None = None,
    *,
    image: str | None = None,
    label: str | None = None,
    classes: Sequence[str] | None = None,
    shards: int | None = None,
    shard_size: int | str | None = None,
    **fields: Any,
) -> PackResult | ShardedPackResult:
    """Pack the samples of a dataset object into a new pack at ``dst`` (or update one).

    Datasets of several fields (torchvision's ``VOCSegmentation``, ``Cityscapes`` with
    ``target_type="semantic"``, ``CocoDetection``: the files they name, bytes kept; any
    map-style dataset whose items are tuples, lists or dicts of PIL images, arrays, tensors
    and JSON values: as they come) make a pack of several fields, read back with
    ``lmdbfolder.torch.LMDBDataset`` (docs/fields.md). Datasets of ``(image, label)``
    items make a classification pack.

    ``update=True`` brings the pack at ``dst`` of a dataset of several fields up to date in place
    (``pack_field_samples``'s update: samples added, removed, changed; single or sharded;
    ``result.changes``). torchvision's three datasets list the same samples, under the same root
    and layout details, as ``lmdbfolder pack SRC --layout voc|cityscapes|coco`` lists their
    files, so either may update the other's pack, and an update reads only the samples whose
    files (size, modification time) or COCO entry and annotations changed. A pack of
    ``CocoDetection`` records no annotation file name (the dataset does not know it): its
    updates take any annotation file. Any other dataset of several values (layout
    ``dataset``) has nothing to compare without reading: its update reads every item again
    and keeps the records that come out the same (an item is its index: the items after
    one removed from the middle are changed). A dataset of ``(image, label)`` items refuses
    ``update=True`` (pack it again with ``overwrite=True``, or pack its image folder with
    ``pack`` and update that).

    Args:
        dataset: a Hugging Face ``datasets.Dataset`` with an ``Image`` and a
            ``ClassLabel`` column (the bytes it holds are stored unchanged, the
            classes are the ClassLabel names), a dataset with torchvision's
            ``samples`` and ``classes`` (``ImageFolder``: the files' bytes), or a
            map-style dataset whose items are ``(image path or PIL image, int
            label)`` (a PIL image is stored as a lossless PNG). See the module
            docstring for what each kind gives.
        dst: the pack directory to create (``pack``'s rules: never overwritten
            without ``overwrite=True``, resumable when interrupted, atomic).
        options: a ``PackOptions``, or its fields as keywords (``check``,
            ``strict``, ``workers``, ``overwrite``, ``restart``, ``progress``,
            ``update`` for a dataset of several fields...).
            Images are stored as the dataset holds them: ``store="raw"`` and
            ``resize`` are refused. ``workers`` defaults to 1 (the dataset is
            read from this thread; more reads it from that many threads).
        image, label: a Hugging Face dataset's image and label columns, when it
            has more than one ``Image`` or ``ClassLabel`` column. A dataset
            without a ``ClassLabel`` column makes an unlabelled pack.
        classes: the class names of a dataset that has none (label ``i`` is
            ``classes[i]``); default: ``dataset.classes``, else ``"0"``, ``"1"``...
        shards, shard_size: a dataset of several fields only: write a sharded pack
            (``pack_field_samples``); a ``ShardedPackResult``.

    Returns:
        ``pack``'s PackResult; samples whose image cannot be read or fails the
        check are skipped and reported (``result.skipped``, ``dst/skipped.txt``).

    Example:
        >>> import datasets, lmdbfolder
        >>> ds = datasets.load_dataset("hf-export-folder", split="train")  # doctest: +SKIP
        >>> lmdbfolder.pack_dataset(ds, "train.lmdb")  # doctest: +SKIP
    """
    opts = pack_options(options, fields)
    if opts.store != "encoded" or opts.resize is not None:
        raise OptionError(
            "pack_dataset stores the images as the dataset holds them: store='raw' and resize are not supported",
            "pack the dataset as it is, then read it at the size you need (or pack the image files with pack)",
        )
    several = None if _is_huggingface(dataset) else field_samples_of(dataset)
    if opts.update and several is None:
        # A classification pack of a dataset object records no stamps of its samples, and its
        # stored paths may be numbers: an update could not tell a sample changed from one moved.
        raise OptionError(
            "pack_dataset updates packs of datasets of several fields only; a dataset of (image, label) "
            "items (ImageFolder, a Hugging Face dataset...) makes a new pack",
            "pack it again with overwrite=True; or pack the image folder itself with lmdbfolder.pack(folder, dst) "
            "and keep that pack up to date with lmdbfolder.pack(folder, dst, update=True)",
        )
    if several is not None:
        if classes is not None or image is not None or label is not None:
            raise OptionError("classes=, image= and label= are for datasets of (image, label) items", "leave them out")
        if several.layout == "dataset" and opts.workers is None:
            opts = opts.replace(workers=1)  # the dataset's own __getitem__ may not be thread-safe
        return pack_field_samples(several, dst, opts, shards=shards, shard_size=shard_size)
    if shards is not None or shard_size is not None:
        raise OptionError(
            "shards and shard_size are for datasets of several fields here",
            "pack the image files with lmdbfolder.pack_sharded",
        )
    if opts.workers is None:
        opts = opts.replace(workers=1)
    adapter = _adapter(dataset, image, label, classes)
    check = opts.check if opts.check in ("header", "decode", "none") else "header"

    def load(i: int) -> Loaded | Skipped:
        try:
            data = adapter.read(i)
        except _NoImage as exc:
            return Skipped(str(exc))
        except OSError as exc:
            return Skipped(f"cannot read it: {exc.strerror or exc}")
        if not data:
            return Skipped("empty image bytes")
        return load_bytes(data, adapter.labels[i], check=check, max_pixels=Image.MAX_IMAGE_PIXELS)

    sources = SourceList(
        adapter.root,
        f"dataset-{adapter.kind}",
        adapter.relpaths,
        adapter.labels,
        adapter.classes,
        {name: i for i, name in enumerate(adapter.classes)},
    )
    result = pack_sources(sources, dst, opts, loader=load, mean_size=adapter.mean_size)
    if not result.already_packed:
        warn_skipped(result.skipped, os.path.join(result.path, SKIPPED_REPORT))
    return result

"""``export``: leave the format freely, as files, as WebDataset tar shards or as a Hugging Face dataset.

* ``format="files"`` writes the tree the pack came from, the file bytes
  exactly as packed, at the same relative paths: an ImageFolder tree
  (``OUT/<class>/...``, every class folder made, also empty ones), a flat
  folder, or for a list-file pack the files plus the list (``OUT/<list
  name>``, ``path label`` lines: the class names when the list used names,
  else the indices). Packing the export again gives the same samples.
  Only packs that hold the original bytes can be exported this way: a
  ``--store raw`` pack (decoded pixels) or a ``--max-size`` pack (images
  above the limit re-encoded) is refused, because the files would not be
  the originals; ``format="webdataset"`` takes them.
* ``format="webdataset"`` writes ``OUT/shard-000000.tar``, ... of about
  ``shard_size`` bytes each, in WebDataset's convention: the members of a
  sample are adjacent and named ``<key>.<ext>``, where ``__key__`` is the
  sample's path without its extension (a dot left in the file name's stem
  becomes ``_``, since WebDataset splits the name at the first dot; a key
  that is then taken gets ``_<index>``, and ``_<index>_<k>`` if that is
  taken too). Members: the image (``.jpg``, ``.png``, ... by its encoding,
  the stored bytes; raw pixels as a lossless ``.png``) and ``.cls`` (the
  class index as text; none for unlabelled samples). ``OUT/classes.txt``
  names the classes, one per line, line = index. (This is the layout of the
  ``webdataset`` library; Hugging Face ``datasets`` does not load it as a
  classification dataset, its class names and mixed encodings: use ``huggingface``.)
  A pack of several fields gives a member a field, in field order, after the
  same key: ``<key>.<field>.<ext>`` (``JPEGImages/2012_000001.image.jpg``,
  ``JPEGImages/2012_000001.mask.png``), the stored bytes unchanged (a mask's
  palette and bit depth kept); ``<ext>`` is the image's by its encoding,
  ``json`` for a ``json`` field, ``npy`` for an ``array`` field. Field names
  are ``[a-z][a-z0-9_]*``, never a dot, so WebDataset's sample holds the keys
  ``<field>.<ext>`` (``image.jpg``, ``mask.png``) and ``datasets.load_dataset(
  "webdataset", data_files=...)`` gives a column each. ``classes.txt`` is
  written only when the pack has classes.
* ``format="huggingface"`` writes a folder that Hugging Face ``datasets``
  loads as it is (``load_dataset(OUT)``): Parquet files of about
  ``shard_size`` bytes (``OUT/data/<split>-00000-of-0000N.parquet``) with the
  features ``image`` (the stored bytes) and ``label`` (a ``ClassLabel`` of the
  pack's classes), and a dataset card ``OUT/README.md`` declaring them; see
  ``lmdbfolder.tools.huggingface``. ``split`` names the split (``train``).
  A pack of several fields gives a column a field, named as the field (an
  ``Image`` for image and mask fields, a JSON string, the ``.npy`` bytes).

A pack of several fields is written back as ``files`` in its layout
(``FIELD_LAYOUTS``: VOC, ADE20K, Cityscapes, COCO, pairs, table); the
``dataset`` layout (``pack_dataset`` of any dataset of several values) came
from no files and is refused, naming ``webdataset`` and ``huggingface``.

``OUT`` must not exist (or be an empty directory): nothing is overwritten.
The export is written to ``OUT.partial`` and renamed to ``OUT`` when
complete; an interrupted export leaves ``OUT.partial``, which the next run
refuses until it is removed.

Stored paths are names read from a pack, which anyone may have written, and
nothing is ever written outside ``OUT``. ``files``: every path is checked
before anything is written, and a pack holding one that cannot be written
back as it is (a ``..`` step, a NUL, a name longer than the file system
takes, a path stored twice, a path that is both a file and a folder; for a
list-file pack, one its list file cannot hold: a line break, white space at
an end, a leading ``#``) is refused, naming the records (``--format
webdataset`` takes it); absolute paths of a list file are written below ``OUT`` without their leading ``/``,
and the list file is renamed (``list-1.txt``, ...) when a sample holds its
name. ``webdataset``: keys never hold a ``..`` step, an empty or ``.``
component, a leading ``/`` or a NUL (``webdataset_key``), so no member of a
shard leads outside the folder it is extracted into.
"""

from __future__ import annotations

import datetime as _dt
import io
import json
import os
import re
import shutil
import tarfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, BinaryIO

from lmdbfolder import packdir
from lmdbfolder.encodings import ENCODINGS, encoding_of
from lmdbfolder.errors import OptionError, OutputExistsError, SourceError
from lmdbfolder.format import NO_LABEL, PARTIAL_SUFFIX, FieldSpec, Manifest, ShardIndex
from lmdbfolder.progress import Progress
from lmdbfolder.read.fields import samples_manifest, split_record
from lmdbfolder.read.opening import open_pack
from lmdbfolder.read.reader import Reader
from lmdbfolder.text import plural, printable
from lmdbfolder.tools import huggingface
from lmdbfolder.write.shards import parse_size

__all__ = ["ExportResult", "export", "FORMATS", "DEFAULT_SHARD_SIZE", "webdataset_key", "EXTENSIONS"]

FORMATS = ("files", "webdataset", "huggingface")
DEFAULT_SHARD_SIZE = "1GB"
#: WebDataset member extension of each stored encoding (``pnm`` and ``other``: the file's own),
#: as each ``Encoding`` says (``raw`` pixels become PNG files).
EXTENSIONS = {enc.name: enc.extension for enc in ENCODINGS.values() if enc.extension}


@dataclass
class ExportResult:
    """What ``export`` wrote."""

    path: str
    format: str
    samples: int
    bytes: int
    seconds: float
    list_file: str | None = None
    shards: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary (``lmdbfolder export --json``)."""
        out = asdict(self)
        out["seconds"] = round(self.seconds, 3)
        return out


def export(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    format: str = "files",
    shard_size: int | str = DEFAULT_SHARD_SIZE,
    progress: bool | None = None,
    split: str = huggingface.DEFAULT_SPLIT,
) -> ExportResult:
    """Write the samples of the pack at ``path`` into the new directory ``out``; see the module docstring.

    Example:
        >>> export("train.lmdb", "train-files")  # doctest: +SKIP
        >>> export("train.lmdb", "train-wds", format="webdataset", shard_size="500MB")  # doctest: +SKIP
        >>> export("val.lmdb", "val-hf", format="huggingface", split="validation")  # doctest: +SKIP
    """
    if format not in FORMATS:
        raise OptionError(f"format must be one of {FORMATS}, got {format!r}")
    limit = parse_size(shard_size) if format != "files" else 0
    if format == "huggingface":
        huggingface.check_split(split)
    start = time.perf_counter()
    out = os.path.abspath(os.fspath(out))
    found = packdir.require_pack(path)
    if packdir.overlap(out, found.path):
        raise OptionError(f"cannot export into {out}: it overlaps the pack {found.path}", "choose another OUT")
    _check_new(out)
    tmp = out + PARTIAL_SUFFIX
    if os.path.lexists(tmp):
        raise OutputExistsError(
            tmp, "is in the way (an interrupted export?)", f"remove it (`rm -r {tmp}`) and run the export again"
        )
    with open_pack(found.path) as reader:
        meta = reader.meta
        params = _params(reader)
        samples_meta = samples_manifest(reader)
        specs = samples_meta.field_specs if samples_meta is not None else None
        # Refused before anything is written: a layout of several fields the files export does not know.
        layout: str | None = None
        if samples_meta is not None and format == "files":
            layout = _files_layout(found.path, samples_meta.layout_name)
        if format == "files":
            _refuse_changed_bytes(found.path, meta.store, params)
        os.makedirs(tmp)
        shards: list[str] = []
        try:
            if samples_meta is not None and layout is not None:  # format files
                count, nbytes = _write_fields(reader, samples_meta, layout, tmp, progress)
                list_file = None
            elif format == "files":
                count, nbytes, list_file = _write_files(reader, tmp, out, progress)
            elif format == "huggingface":
                count, nbytes, shards = huggingface.write_huggingface(
                    reader, tmp, limit, progress, split, found.path, _member, specs
                )
                list_file = None
            else:
                count, nbytes, shards = _write_webdataset(reader, tmp, limit, progress, specs)
                list_file = None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # made by this call
            raise
    if os.path.isdir(out):
        os.rmdir(out)  # empty (checked above); the rename needs the name free on every platform
    os.rename(tmp, out)
    return ExportResult(
        out,
        format,
        count,
        nbytes,
        time.perf_counter() - start,
        None if list_file is None else os.path.join(out, list_file),
        [os.path.join(out, name) for name in shards],
    )


def _check_new(out: str) -> None:
    if os.path.islink(out) or (os.path.lexists(out) and not os.path.isdir(out)):
        raise OutputExistsError(out, "exists and is not a directory", "choose a new output path")
    if os.path.isdir(out) and os.listdir(out):
        raise OutputExistsError(
            out, "exists and is not empty; export never overwrites", "choose a new output path, or empty it yourself"
        )


def _params(reader: Any) -> dict[str, Any]:
    """The writing options of a pack (of its first shard, for a sharded pack); {} when invalid."""
    if isinstance(reader, Reader):
        params = reader.meta.params
    else:
        with Reader(reader.shards[0]) as first:
            params = first.meta.params
    return dict(params or {})  # None: absent, or not of its type


def _refuse_changed_bytes(path: str, store: str, params: dict[str, Any]) -> None:
    if store == "raw":
        raise OptionError(
            f"{path} stores decoded pixels (--store raw), not the files it was packed from, so they cannot be "
            "written back byte for byte",
            "use --format webdataset (raw samples become lossless PNGs), or export from the original files",
        )
    if params.get("max_size") is not None:
        raise OptionError(
            f"{path} was packed with --max-size {params['max_size']}: images above that size were re-encoded, "
            "so the files would not be the originals",
            "use --format webdataset (it takes the stored images as they are), or export from the original files",
        )


def _target(root: str, relpath: str, index: int) -> str:
    """Where sample ``index`` (stored path ``relpath``) goes below ``root``; never outside it."""
    rel = relpath.lstrip("/\\") if os.path.isabs(relpath) else relpath
    target = os.path.normpath(os.path.join(root, rel))
    if not target.startswith(root + os.sep):
        raise SourceError(
            relpath,
            f"the stored path of record {index} leads outside the export folder",
            "export as --format webdataset, whose keys are made from the paths",
        )
    return target


#: A file name longer than this many bytes is refused by the usual file systems (NAME_MAX).
NAME_MAX = 255
#: A path longer than this many bytes is refused by the system (PATH_MAX).
PATH_MAX = 4096


def _unwritable(paths: list[str], class_folders: list[str], listed: bool = False) -> list[tuple[int, str, str]]:
    """``(index, path, why)`` of every stored path (and class folder: index -1) that
    cannot be written back below ``OUT`` as it is: checked before anything is
    written (``files`` export). ``listed``: the paths also go into a list file,
    whose lines must read back as the same path (``read_list_file``)."""
    problems: list[tuple[int, str, str]] = []
    files: dict[str, int] = {}
    folders: dict[str, int] = {}
    for name in class_folders:
        if "\0" in name or name in ("", ".", "..") or "/" in name or len(os.fsencode(name)) > NAME_MAX:
            problems.append((-1, name, "a class name that is not a folder name"))
        folders.setdefault(name, -1)
    for i, path in enumerate(paths):
        rel = path.lstrip("/\\") if os.path.isabs(path) else path
        parts = rel.split("/")
        why = None
        if "\0" in path:
            why = "it holds a NUL character"
        elif not rel or any(p in ("", ".", "..") for p in parts):
            why = "it has an empty, '.' or '..' component (it would not name the same file, or lead outside)"
        elif len(os.fsencode(rel)) > PATH_MAX or any(len(os.fsencode(p)) > NAME_MAX for p in parts):
            why = f"it is longer than the file system takes ({NAME_MAX} bytes a name, {PATH_MAX} a path)"
        elif listed and ("\n" in rel or "\r" in rel or rel != rel.strip() or rel[:1] in ("#", "\ufeff")):
            # Else a line of the list file, read back, is another path: or several, or a comment.
            why = "a list file line cannot hold it (a line break, white space at an end, or a leading '#')"
        elif rel in files:
            why = f"record {files[rel]} has the same path"
        elif rel in folders:
            why = f"it is also a folder of record {folders[rel]}'s path"
        if why is None:
            for k in range(1, len(parts)):
                folder = "/".join(parts[:k])
                if folder in files:
                    why = f"its folder {folder!r} is record {files[folder]}'s file"
                    break
                folders.setdefault(folder, i)
        if why is not None:
            problems.append((i, path, why))
        else:
            files[rel] = i
    return problems


def _list_name(recorded: Any, taken: set[str]) -> str:
    """The export's list file name: the recorded list's own name when it is a plain file
    name, else ``list.txt``; renamed (``list-1.txt``, ...) when a sample holds that name."""
    name = os.path.basename(recorded) if isinstance(recorded, str) else ""
    if (
        not name
        or name in (".", "..")
        or "\0" in name
        or len(os.fsencode(name)) > NAME_MAX - 8
        or any(c in name for c in "/\\")
    ):
        name = "list.txt"
    stem, ext = os.path.splitext(name)
    k = 0
    while name in taken:
        k += 1
        name = f"{stem}-{k}{ext}"
    return name


def _write_files(reader: Any, tmp: str, out: str, progress: bool | None) -> tuple[int, int, str | None]:
    meta = reader.meta
    source = meta.source_record
    layout = source.layout if source is not None else None
    classes = list(meta.classes)
    paths = reader.paths()
    labels = reader.labels
    bad = _unwritable(paths, classes if layout == "imagefolder" else [], listed=layout == "list")
    if bad:
        shown = "; ".join(
            (f"record {i} ({printable(p, 120)!s})" if i >= 0 else f"class {printable(p, 120)!s}") + f": {why}"
            for i, p, why in bad[:5]
        )
        raise SourceError(
            printable(bad[0][1], 200),
            f"{plural(len(bad), 'stored path')} cannot be written back as files below the export folder: {shown}"
            + ("; ..." if len(bad) > 5 else ""),
            "export as --format webdataset, whose member names are made from the paths and always safe",
        )
    if layout == "imagefolder":
        for name in classes:  # also the classes kept without images (--allow-empty); checked above
            os.makedirs(_target(tmp, name, -1), exist_ok=True)
    nbytes = 0
    made: set[str] = set()
    with Progress(len(paths), "export", enabled=progress) as bar:
        for i, relpath in enumerate(paths):
            target = _target(tmp, relpath, i)
            folder = os.path.dirname(target)
            if folder not in made:
                os.makedirs(folder, exist_ok=True)
                made.add(folder)
            payload = reader.get(i).payload
            with open(target, "xb") as f:  # "x": a path twice in one pack must not overwrite
                f.write(payload)
            nbytes += len(payload)
            bar.update(1, len(payload))
    if layout != "list":
        return len(paths), nbytes, None
    top_level = {(p.lstrip("/\\") if os.path.isabs(p) else p).split("/")[0] for p in paths}
    name = _list_name(source.list_file if source is not None else None, top_level)
    by_name = classes != [str(i) for i in range(len(classes))]
    with open(os.path.join(tmp, name), "x", encoding="utf-8", errors="surrogateescape") as f:
        for relpath, label in zip(paths, labels):
            rel = relpath.lstrip("/\\") if os.path.isabs(relpath) else relpath
            f.write(f"{rel} {classes[label] if by_name else label}\n")
    return len(paths), nbytes, name


#: The layouts of packs of several fields that ``export`` writes back (their other files' paths
#: follow from the first file's, by the layout's own naming).
FIELD_LAYOUTS = ("voc", "ade20k", "cityscapes", "coco", "pairs", "table")
#: The image column of an exported table (``layout_info["image_column"]`` when the pack has one).
TABLE_IMAGE_COLUMN = "image"


def _files_layout(path: str, layout: str | None) -> str:
    """The layout of a pack of several fields when ``files`` export writes it back, else an
    OptionError (raised before anything is written) saying what does: the ``dataset`` layout (the
    items of a Python dataset) came from no files, and nothing reads a folder of its fields back
    as that dataset."""
    if layout is not None and layout in FIELD_LAYOUTS:
        return layout
    what = (
        "are the items of a Python dataset (pack_dataset), which came from no files"
        if layout in (None, "dataset")
        else f"come from the layout {printable(str(layout), 40)!s}, whose files export does not know"
    )
    raise OptionError(
        f"{path}: its samples of several fields {what}, so --format files has nothing to write back "
        "(it writes the files of the layouts " + ", ".join(FIELD_LAYOUTS) + ")",
        "use --format webdataset (a tar member each field, <key>.<field>.<ext>) or --format huggingface "
        "(a Parquet column each field), or read it with lmdbfolder.torch.LMDBDataset",
    )


def _gt_path(relpath: str, info: dict[str, Any]) -> str | None:
    """The GT path of a pair whose LQ is stored as ``relpath``: BasicSR names the LQ
    ``filename_tmpl.format(basename) + ext`` after the GT ``basename + ext``, so the GT is
    ``gt_dir/basename + ext`` (None: the LQ name does not follow the template)."""
    lq_dir, gt_dir = str(info.get("lq_dir") or ""), str(info.get("gt_dir") or "")
    if info.get("source") == "basicsr-lmdb":  # imported from two LMDBs: a pair's files have one name
        lq_dir, gt_dir = str(info.get("lq") or ""), str(info.get("gt") or "")
    tmpl = str(info.get("filename_tmpl") or "{}")
    if not lq_dir or not gt_dir or tmpl.count("{}") != 1 or not relpath.startswith(lq_dir + "/"):
        return None
    name = relpath[len(lq_dir) + 1 :]
    stem, dot, ext = name.rpartition(".")
    if not dot:
        stem, ext = name, ""
    before, after = tmpl.split("{}")
    if "/" in name or not stem.startswith(before) or not stem.endswith(after) or len(stem) <= len(before + after):
        return None
    base = stem[len(before) : len(stem) - len(after)]
    return f"{gt_dir}/{base}{dot}{ext}"


#: The mask folder of each Cityscapes ``mode`` a pack records (the layout's, then torchvision's).
CITYSCAPES_FOLDERS = {"fine": "gtFine", "coarse": "gtCoarse", "gtFine": "gtFine", "gtCoarse": "gtCoarse"}


def _voc_year_folder(info: dict[str, Any]) -> str:
    """The ``VOC<year>`` folder a VOC pack is exported into: the one it was packed from
    (``year_folder``; older packs of a ``VOCSegmentation`` record ``year``), else ``VOC2012``."""
    folder = str(info.get("year_folder") or "")
    if re.fullmatch(r"VOC\d{4}", folder):
        return folder
    year = str(info.get("year") or "")
    return f"VOC{year}" if re.fullmatch(r"\d{4}", year) else "VOC2012"


def _partner(layout: str, relpath: str, info: dict[str, Any], mask_ext: str) -> str | None:
    """The stored path of the mask beside the image ``relpath`` in ``layout`` (None: not of its naming)."""
    parts = relpath.split("/")
    stem, _, _ = parts[-1].rpartition(".")
    if layout == "voc" and len(parts) == 2 and parts[0] == "JPEGImages" and stem:
        return f"SegmentationClass/{stem}{mask_ext}"
    if layout == "ade20k" and len(parts) >= 3 and parts[0] == "images" and stem:
        return "/".join(["annotations", *parts[1:-1], stem + mask_ext])
    suffix = "_leftImg8bit.png"
    if layout == "cityscapes" and len(parts) >= 4 and parts[0] == "leftImg8bit" and parts[-1].endswith(suffix):
        # The mask folder: packs record the layout's "fine"/"coarse" (older packs of a
        # Cityscapes object its folder name, "gtFine").
        mode = CITYSCAPES_FOLDERS.get(str(info.get("mode") or "fine"), "gtFine")
        name = parts[-1][: -len(suffix)] + f"_{mode}_labelIds{mask_ext}"
        return "/".join([mode, *parts[1:-1], name])
    return None


def _write_fields(reader: Any, meta: Manifest, layout: str, tmp: str, progress: bool | None) -> tuple[int, int]:
    """Export a pack of several fields as the files of its ``layout`` (``_files_layout``): VOC's
    ``VOCdevkit/VOC<year>`` tree with its split file, ADE20K's and Cityscapes' image and
    annotation trees, COCO's images and an ``annotations.json``; torchvision's datasets read
    them as they read the originals."""
    from lmdbfolder.read.fields import SampleSchema

    info = meta.layout_info
    schema = SampleSchema.of(meta, reader.path)
    base = tmp
    if layout == "voc":
        base = os.path.join(tmp, "VOCdevkit", _voc_year_folder(info))
    paths = reader.paths()
    nbytes = 0
    stems: list[str] = []
    images: list[Any] = []
    annotations: list[Any] = []
    rows: list[dict[str, Any]] = []  # table: one JSON object a sample
    written: set[str] = set()  # table: the images written (several rows may name one)
    column = str(info.get("image_column") or TABLE_IMAGE_COLUMN)
    if layout == "table":
        base = os.path.join(tmp, "images")
    with Progress(len(paths), "export", enabled=progress) as bar:
        for i, relpath in enumerate(paths):
            record = reader.get(i)
            parts = schema.split(record.payload, i)
            files = [(relpath, parts[0])]
            if layout == "coco":
                images.append(schema.value(1, parts[1], i))
                annotations.extend(schema.value(2, parts[2], i))
            elif layout == "pairs":
                gt = _gt_path(relpath, info)
                if gt is None:
                    raise SourceError(
                        relpath,
                        f"the stored LQ path of record {i} does not follow the pack's gt_dir, lq_dir and "
                        "filename_tmpl, so its GT's name is not known",
                        "read the pack with lmdbfolder.torch.LMDBDataset",
                    )
                files.append((gt, parts[1]))
            elif layout == "table":
                files = [] if relpath in written else [(relpath, parts[0])]
                written.add(relpath)
                rows.append({column: relpath, **schema.value(1, parts[1], i)})
            else:
                ext = "." + (encoding_of(sniff_encoding(parts[1])).extension or "png")
                mask = _partner(layout, relpath, info, ext)
                if mask is None:
                    raise SourceError(
                        relpath,
                        f"the stored path of record {i} does not follow the {layout} layout's naming, so its "
                        "mask's path is not known",
                        "read the pack with lmdbfolder.torch.LMDBDataset",
                    )
                files.append((mask, parts[1]))
                stems.append(relpath.rsplit("/", 1)[-1].rpartition(".")[0])
            for rel, data in files:
                target = _target(base, rel, i)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "xb") as f:  # "x": a path twice in one pack must not overwrite
                    f.write(data)
                nbytes += len(data)
            bar.update(1, sum(len(d) for _, d in files))
    if layout == "voc":
        split = os.path.join(
            base, "ImageSets", "Segmentation", f"{printable(str(info.get('split') or 'train'), 40)}.txt"
        )
        _target(base, os.path.relpath(split, base), -1)
        os.makedirs(os.path.dirname(split), exist_ok=True)
        with open(split, "x", encoding="utf-8", errors="surrogateescape") as f:
            f.writelines(f"{stem}\n" for stem in stems)
    elif layout == "coco":
        categories = info.get("categories")
        if not isinstance(categories, list):
            ids = sorted({a.get("category_id") for a in annotations if isinstance(a, dict)}, key=str)
            categories = [{"id": c, "name": str(c)} for c in ids]
        doc = {"images": images, "annotations": annotations, "categories": categories}
        with open(_target(tmp, "annotations.json", -1), "x", encoding="utf-8") as f:
            json.dump(doc, f, ensure_ascii=False)
    elif layout == "table":
        stem = os.path.splitext(os.path.basename(str(info.get("table") or "table.jsonl")))[0] or "table"
        with open(_target(tmp, f"{printable(stem, 100)}.jsonl", -1), "x", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    return len(paths), nbytes


def sniff_encoding(data: bytes | memoryview) -> str:
    """The encoding a field's bytes have (``encodings.sniff``), for their file extension."""
    from lmdbfolder.encodings import sniff

    return sniff(data).encoding


def webdataset_key(relpath: str) -> str:
    """The WebDataset ``__key__`` of a sample: its path without the extension,
    dots left in the file name's stem replaced by ``_`` (WebDataset splits a
    member name at the first dot of its last component).

    A key never leads outside the folder a shard is extracted into: empty and
    ``.`` components are left out, a ``..`` component becomes ``__``, a NUL
    becomes ``_``, and no key starts with ``/`` (the stored paths are a pack's,
    and anyone may have written it)."""
    rel = relpath.replace("\0", "_").replace("\\", "/")
    parts = ["__" if p == ".." else p for p in rel.split("/") if p not in ("", ".")] or ["_"]
    name = parts[-1]
    stem = os.path.splitext(name)[0] or name
    stem = stem.replace(".", "_") or "_"
    return "/".join([*parts[:-1], stem])


def _unique_key(relpath: str, index: int, keys: set[str]) -> str:
    """``webdataset_key(relpath)``, or when another sample has it ``<key>_<index>`` (and
    ``_<index>_<k>`` when that is taken too); added to ``keys``."""
    key = webdataset_key(relpath)
    if key in keys:
        # `_<index>` may itself be a key already (the key of x.2.jpg is x_2): then more.
        base, k = f"{key}_{index}", 0
        key = base
        while key in keys:
            k += 1
            key = f"{base}_{k}"
    keys.add(key)
    return key


def _field_ext(spec: FieldSpec, data: memoryview, relpath: str, first: bool) -> str:
    """The extension of a field's tar member: ``json``, ``npy``, or an image's by the encoding
    its bytes have (``jpg``, ``png``...; a PNM or another image: the stored path's own for the
    first field, ``pnm`` or ``bin`` for the others)."""
    if spec.kind == "json":
        return "json"
    if spec.kind == "array":
        return "npy"
    ext = _extension(sniff_encoding(data), relpath if first else None)
    return "bin" if ext == "other" else ext


def _extension(encoding: str, relpath: str | None) -> str:
    """A member's extension for bytes of ``encoding``: the encoding's own (``jpg``, ``png``...),
    else the stored path's when ``relpath`` is given, else the encoding's name (``pnm``); ``bin``
    where that is not a plain one (empty, not ASCII letters and digits, over 10 characters)."""
    ext = encoding_of(encoding).extension
    if not ext:
        ext = os.path.splitext(relpath)[1].lstrip(".").lower() if relpath is not None else encoding
    return ext if ext.isascii() and ext.isalnum() and len(ext) <= 10 else "bin"


def _sample_members(
    record: Any, relpath: str, key: str, index: int, specs: tuple[FieldSpec, ...] | None
) -> tuple[list[tuple[str, bytes]], int]:
    """The tar members of one sample (name, bytes) and its image (or field) bytes: ``<key>.<ext>``
    for one image a sample, ``<key>.<field>.<ext>`` a field for several (field names are
    ``[a-z][a-z0-9_]*``: no dot, so WebDataset's sample keys are ``<field>.<ext>``); then
    ``<key>.cls`` for a labelled sample."""
    if specs is None:
        data, ext = _member(record, relpath)
        members = [(f"{key}.{ext}", data)]
        size = len(data)
    else:
        parts = split_record(record.payload, len(specs), index)
        members = [
            (f"{key}.{spec.name}.{_field_ext(spec, part, relpath, k == 0)}", bytes(part))
            for k, (spec, part) in enumerate(zip(specs, parts))
        ]
        size = sum(len(part) for part in parts)
    if record.label != NO_LABEL:
        members.append((f"{key}.cls", str(record.label).encode("ascii")))
    return members, size


def _write_webdataset(
    reader: Any, tmp: str, limit: int, progress: bool | None, specs: tuple[FieldSpec, ...] | None = None
) -> tuple[int, int, list[str]]:
    classes = list(reader.meta.classes)
    if specs is None or classes:  # a pack of several fields without classes has no classes.txt
        with open(os.path.join(tmp, "classes.txt"), "w", encoding="utf-8", errors="surrogateescape") as f:
            f.writelines(f"{name}\n" for name in classes)
    paths = reader.paths()
    shards: list[str] = []
    keys: set[str] = set()
    current: tarfile.TarFile | None = None
    handle: BinaryIO | None = None
    written = 0
    nbytes = 0
    mtime = _created(reader.meta)
    try:
        with Progress(len(paths), "export", enabled=progress) as bar:
            for i, relpath in enumerate(paths):
                record = reader.get(i)
                key = _unique_key(relpath, i, keys)
                members, data_bytes = _sample_members(record, relpath, key, i, specs)
                size = sum(len(d) + 1024 for _, d in members)  # a header block each, and padding
                if current is None or (written and written + size > limit):
                    if current is not None and handle is not None:
                        current.close()
                        handle.close()
                    name = f"shard-{len(shards):06d}.tar"
                    shards.append(name)
                    handle = open(os.path.join(tmp, name), "xb")  # noqa: SIM115 - closed when the shard is full
                    current = tarfile.open(fileobj=handle, mode="w", format=tarfile.PAX_FORMAT)  # noqa: SIM115
                    written = 0
                for member_name, blob in members:  # adjacent: WebDataset groups a sample's members in order
                    info = tarfile.TarInfo(member_name)
                    info.size = len(blob)
                    info.mtime = mtime
                    info.mode = 0o644
                    current.addfile(info, io.BytesIO(blob))
                written += size
                nbytes += data_bytes
                bar.update(1, data_bytes)
    finally:
        if current is not None:
            current.close()
        if handle is not None:
            handle.close()
    return len(paths), nbytes, shards


def _member(record: Any, relpath: str) -> tuple[bytes, str]:
    """The bytes and the extension of a sample's image member."""
    enc = encoding_of(record.encoding)
    if enc.stores_pixels:
        return bytes(enc.file_bytes(record.payload, record.width, record.height)), str(enc.extension)
    return bytes(record.payload), _extension(record.encoding, relpath)


def _created(meta: Manifest | ShardIndex) -> int:
    """The pack's creation time as a Unix time, for the tar members (so an export is reproducible)."""
    text = meta.created_at
    if text is not None:
        try:
            return int(_dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=_dt.timezone.utc).timestamp())
        except ValueError:
            pass
    return 0

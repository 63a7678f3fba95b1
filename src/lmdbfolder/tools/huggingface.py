"""``export(format="huggingface")``: a folder that Hugging Face ``datasets`` loads as it is.

``datasets.load_dataset(OUT)`` gives a dataset whose features are ``image``
(``datasets.Image``) and, for a labelled pack, ``label`` (``datasets.ClassLabel``
with the pack's class names, in label order: empty classes kept), sample ``i``
of the pack as row ``i``. It is the layout that ``Dataset.push_to_hub`` writes
and the Hub serves:

* ``OUT/data/<split>-00000-of-0000N.parquet``: Parquet files of about
  ``shard_size`` bytes each, in row groups of 100 rows (the Hub's for image
  datasets). ``image`` is a struct ``{bytes, path}``: the stored bytes unchanged
  (a ``--store raw`` pack's pixels as a lossless PNG, as the WebDataset export
  does) and the sample's stored path (its extension names the encoding; an
  unreadable name is written with its undecodable bytes escaped). ``label`` is an
  int64 class index. The features are also in each file's schema metadata (the
  ``huggingface`` key, as ``datasets`` writes them), so ``load_dataset("parquet",
  data_files=...)`` on the files alone gives the same features.
* ``OUT/README.md``: the dataset card, whose YAML header declares the features
  (``dataset_info``: the class names under ``class_label``) and the files of the
  split (``configs``), which ``load_dataset`` reads first.

A pack of several fields (``pack --layout voc|...``, ``pack_dataset`` of a segmentation,
detection or any dataset of several values) gives one column a field, named as the field, in
field order: an ``image`` or ``mask`` field is a ``datasets.Image`` (the stored bytes unchanged,
a mask's palette and bit depth kept; the first field's ``path`` is the sample's stored path, the
others' none), a ``json`` field a string of its JSON text (``json.loads(row["annotations"])``:
a string loads in every ``datasets`` version, and a COCO annotation list is not of one Arrow
type from sample to sample), an ``array`` field the bytes of its ``.npy`` file
(``numpy.load(io.BytesIO(row["f1"]))``); a ``label`` column only when the pack has labels.

pyarrow writes the files (it comes with ``datasets``; ``pip install
"lmdbfolder[huggingface]"`` installs it alone). A class name that is not valid
Unicode (a folder name with undecodable bytes) is refused: Arrow and YAML strings
cannot hold it; the error says which.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Sequence

from lmdbfolder.errors import MissingDependencyError, OptionError, SourceError
from lmdbfolder.format import NO_LABEL, FieldSpec
from lmdbfolder.progress import Progress
from lmdbfolder.read.fields import split_record
from lmdbfolder.text import printable

__all__ = ["DEFAULT_SPLIT", "ROW_GROUP", "check_split", "write_huggingface", "card", "columns", "features"]

DEFAULT_SPLIT = "train"
#: Rows per Parquet row group: ``datasets``' own for image datasets (a group is read whole).
ROW_GROUP = 100
#: A split name as ``datasets`` accepts it (``datasets.splits``: ``^\w+(\.\w+)*$``).
_SPLIT_NAME = re.compile(r"\w+(\.\w+)*", re.ASCII)
_DATA = "data"


def check_split(split: str) -> str:
    """``split`` when ``datasets`` takes it as a split name, else an OptionError saying what does."""
    if not isinstance(split, str) or not _SPLIT_NAME.fullmatch(split):
        raise OptionError(
            f"split must be a name of letters, digits and '_' (dots between words allowed), got {split!r}",
            "e.g. --split train, --split validation, --split test",
        )
    return split


def _pyarrow() -> tuple[Any, Any]:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as exc:
        raise MissingDependencyError("export --format huggingface", "huggingface", "pyarrow") from exc
    return pyarrow, pyarrow.parquet


def _check_names(classes: list[str], where: str) -> None:
    for i, name in enumerate(classes):
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise SourceError(
                where,
                f"class {i} ({printable(name, 120)!s}) is not valid Unicode (a folder name with undecodable "
                "bytes): a Hugging Face ClassLabel cannot hold it",
                "rename the class folder to a UTF-8 name and pack again, or export --format webdataset",
            ) from None


def _path_text(relpath: str) -> str:
    """The stored path as an Arrow string: undecodable bytes (surrogate escapes) become ``\\xNN``."""
    try:
        relpath.encode("utf-8")
        return relpath
    except UnicodeEncodeError:
        return os.fsencode(relpath).decode("utf-8", "backslashreplace")


#: The ``datasets`` feature (``Features.to_dict()`` form) and the card's ``dtype`` of each field kind.
_FEATURE = {
    "image": ({"_type": "Image"}, "image"),
    "mask": ({"_type": "Image"}, "image"),
    "json": ({"dtype": "string", "_type": "Value"}, "string"),
    "array": ({"dtype": "binary", "_type": "Value"}, "binary"),
}


def columns(classes: list[str] | None, fields: Sequence[FieldSpec] | None = None) -> list[tuple[str, str]]:
    """``(column name, kind)`` of the export's columns: ``image`` (one image a sample) or one a
    field, then ``label`` (kind ``label``) when ``classes`` is not None (``label_`` when a field
    has that name)."""
    out = [("image", "image")] if fields is None else [(f.name, f.kind) for f in fields]
    if classes is not None:
        taken = {name for name, _ in out}
        out.append(("label" if "label" not in taken else "label_", "label"))
    return out


def features(classes: list[str] | None, fields: Sequence[FieldSpec] | None = None) -> dict[str, Any]:
    """The ``datasets`` features, as ``Features.to_dict()`` writes them (schema metadata)."""
    out: dict[str, Any] = {}
    for name, kind in columns(classes, fields):
        if kind == "label":
            out[name] = {"names": list(classes or ()), "_type": "ClassLabel"}
        else:
            out[name] = dict(_FEATURE[kind][0])
    return out


def _yaml_string(text: str) -> str:
    """``text`` as a YAML double-quoted scalar: quotes and backslashes escaped, and every
    character YAML does not allow raw in a stream (controls, DEL, C1, U+FFFE/F) as ``\\uXXXX``."""
    out = ['"']
    for ch in text:
        code = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif 0x20 <= code <= 0x7E or 0xA0 <= code <= 0xD7FF or 0xE000 <= code <= 0xFFFD or code >= 0x10000:
            out.append(ch)
        else:
            out.append(f"\\u{code:04x}")
    out.append('"')
    return "".join(out)


def card(
    classes: list[str] | None, split: str, count: int, source: str, fields: Sequence[FieldSpec] | None = None
) -> str:
    """The dataset card ``README.md``: a YAML header that ``load_dataset`` reads (features with the
    class names, the split's files), and a few lines for people."""
    lines = ["---", "dataset_info:", "  features:"]
    said = []
    for name, kind in columns(classes, fields):
        lines.append(f"  - name: {name}")
        if kind == "label":
            lines += ["    dtype:", "      class_label:", "        names:"]
            lines += [f"          {_yaml_string(str(i))}: {_yaml_string(c)}" for i, c in enumerate(classes or ())]
            said.append(f"`{name}` (a `ClassLabel` of {len(classes or ())} classes)")
        else:
            lines.append(f"    dtype: {_FEATURE[kind][1]}")
            said.append(f"`{name}` ({_SAID[kind]})")
    lines += ["configs:", "- config_name: default", "  data_files:", f"  - split: {split}"]
    lines += [f"    path: {_DATA}/{split}-*.parquet", "---", ""]
    if fields is None:
        labelled = f"and {said[1]}" if classes is not None else "(no labels)"
        what = f"features `image` (the stored image bytes, unchanged) {labelled}"
    else:
        what = "features " + ", ".join(said) + ("" if classes is not None else "; no labels")
    lines += [
        f"Exported by lmdbfolder from the pack `{os.path.basename(source)}`: {count:,} samples in the split "
        f"`{split}`, {what}.",
        "",
        "```python",
        "from datasets import load_dataset",
        'ds = load_dataset("path/to/this/folder")',
        "```",
        "",
    ]
    return "\n".join(lines)


#: How the card names each column's content (packs of several fields).
_SAID = {
    "image": "an image: the stored bytes, unchanged",
    "mask": "an image: the stored mask bytes, unchanged",
    "json": "a JSON text",
    "array": "the bytes of a .npy array",
}


def _json_text(data: memoryview, where: str) -> str:
    """A ``json`` field's text as an Arrow string: its bytes as they are, or (a lone surrogate,
    which UTF-8 cannot hold) the same value written with ``\\uXXXX`` escapes."""
    raw = bytes(data)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        try:
            value = json.loads(raw.decode("utf-8", "surrogatepass"))
        except (ValueError, RecursionError) as exc:
            raise SourceError(where, f"its JSON is not valid UTF-8 JSON ({exc})", "verify the pack") from None
        return json.dumps(value, separators=(",", ":"), ensure_ascii=True)


def write_huggingface(
    reader: Any,
    tmp: str,
    limit: int,
    progress: bool | None,
    split: str,
    source: str,
    member: Any,
    fields: Sequence[FieldSpec] | None = None,
) -> tuple[int, int, list[str]]:
    """Write the split's Parquet files and the card into ``tmp``; returns (samples, image bytes,
    file names relative to ``tmp``). ``member(record, relpath)`` gives a sample's image bytes;
    ``fields``: the pack's fields, when its samples have several (a column each, their bytes)."""
    pa, pq = _pyarrow()
    classes = list(reader.meta.classes)
    paths = reader.paths()
    labels = reader.labels
    labelled = bool(classes) or any(label != NO_LABEL for label in labels)
    _check_names(classes, source)
    names = classes if labelled else None
    cols = columns(names, fields)
    feats = features(names, fields)
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    arrow = {"image": image_type, "mask": image_type, "json": pa.string(), "array": pa.binary(), "label": pa.int64()}
    schema = pa.schema(
        [pa.field(name, arrow[kind]) for name, kind in cols],
        metadata={"huggingface": json.dumps({"info": {"features": feats}})},
    )
    os.makedirs(os.path.join(tmp, _DATA))
    files: list[str] = []
    writer: Any = None
    written = 0
    nbytes = 0
    rows: list[list[Any]] = [[] for _ in cols]
    pending = 0  # the field bytes of the rows not yet written
    pending_paths = 0  # and the bytes of their image paths

    def column(kind: str, values: list[Any]) -> Any:
        if kind in ("image", "mask"):
            return pa.StructArray.from_arrays(
                [pa.array([v[0] for v in values], pa.binary()), pa.array([v[1] for v in values], pa.string())],
                names=["bytes", "path"],
            )
        return pa.array(values, arrow[kind])

    def flush() -> None:
        nonlocal written, pending, pending_paths
        if not rows[0]:
            return
        arrays = [column(kind, values) for (_, kind), values in zip(cols, rows)]
        writer.write_table(pa.Table.from_arrays(arrays, schema=schema), row_group_size=ROW_GROUP)
        written += pending + pending_paths
        pending = pending_paths = 0
        for values in rows:
            values.clear()

    def open_next() -> Any:
        name = os.path.join(_DATA, f"{split}-{len(files):05d}.parquet")
        files.append(name)
        return pq.ParquetWriter(os.path.join(tmp, name), schema)

    try:
        with Progress(len(paths), "export", enabled=progress) as bar:
            for i, relpath in enumerate(paths):
                record = reader.get(i)
                path = _path_text(relpath)
                if fields is None:
                    data, _ext = member(record, relpath)
                    row: list[Any] = [(data, path)]
                    size = len(data)
                else:
                    row, size = _field_row(record.payload, fields, path, i, relpath)
                if labelled:
                    row.append(record.label if record.label != NO_LABEL else None)
                if writer is None:
                    writer = open_next()
                    written = 0
                for values, value in zip(rows, row):
                    values.append(value)
                pending += size
                pending_paths += len(path)
                if len(rows[0]) >= ROW_GROUP or written + pending >= limit:
                    flush()
                    if written >= limit:  # this file is full: the next sample starts another
                        writer.close()
                        writer = None
                nbytes += size
                bar.update(1, size)
            if writer is None and not files:  # an empty pack: one empty file, so that the split exists
                writer = open_next()
            if writer is not None:
                flush()
    finally:
        if writer is not None:
            writer.close()
    # The Hub's names (<split>-00000-of-00003.parquet), known once the last file is written.
    final = [os.path.join(_DATA, f"{split}-{k:05d}-of-{len(files):05d}.parquet") for k in range(len(files))]
    for old, new in zip(files, final):
        os.rename(os.path.join(tmp, old), os.path.join(tmp, new))
    with open(os.path.join(tmp, "README.md"), "x", encoding="utf-8") as f:
        f.write(card(names, split, len(paths), source, fields))
    return len(paths), nbytes, final


def _field_row(
    payload: memoryview, fields: Sequence[FieldSpec], path: str, index: int, relpath: str
) -> tuple[list[Any], int]:
    """The column values of a sample of several fields (its record's ``payload``), and their bytes."""
    parts = split_record(payload, len(fields), index)
    row: list[Any] = []
    for k, (spec, data) in enumerate(zip(fields, parts)):
        if spec.kind in ("image", "mask"):
            row.append((bytes(data), path if k == 0 else None))
        elif spec.kind == "json":
            row.append(_json_text(data, f"{printable(relpath, 200)}, field {spec.name!r}"))
        else:
            row.append(bytes(data))
    return row, sum(len(d) for d in parts)

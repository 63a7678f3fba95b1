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

pyarrow writes the files (it comes with ``datasets``; ``pip install
"lmdbfolder[huggingface]"`` installs it alone). A class name that is not valid
Unicode (a folder name with undecodable bytes) is refused: Arrow and YAML strings
cannot hold it; the error says which.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from lmdbfolder.errors import MissingDependencyError, OptionError, SourceError
from lmdbfolder.format import NO_LABEL
from lmdbfolder.progress import Progress
from lmdbfolder.text import printable

__all__ = ["DEFAULT_SPLIT", "ROW_GROUP", "check_split", "write_huggingface", "card"]

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


def features(classes: list[str] | None) -> dict[str, Any]:
    """The ``datasets`` features, as ``Features.to_dict()`` writes them (schema metadata)."""
    out: dict[str, Any] = {"image": {"_type": "Image"}}
    if classes is not None:
        out["label"] = {"names": list(classes), "_type": "ClassLabel"}
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


def card(classes: list[str] | None, split: str, count: int, source: str) -> str:
    """The dataset card ``README.md``: a YAML header that ``load_dataset`` reads (features with the
    class names, the split's files), and a few lines for people."""
    lines = ["---", "dataset_info:", "  features:", "  - name: image", "    dtype: image"]
    if classes is not None:
        lines += ["  - name: label", "    dtype:", "      class_label:", "        names:"]
        lines += [f"          {_yaml_string(str(i))}: {_yaml_string(name)}" for i, name in enumerate(classes)]
    lines += ["configs:", "- config_name: default", "  data_files:", f"  - split: {split}"]
    lines += [f"    path: {_DATA}/{split}-*.parquet", "---", ""]
    labelled = f"and `label` (a `ClassLabel` of {len(classes)} classes)" if classes is not None else "(no labels)"
    lines += [
        f"Exported by lmdbfolder from the pack `{os.path.basename(source)}`: {count:,} samples in the split "
        f"`{split}`, features `image` (the stored image bytes, unchanged) {labelled}.",
        "",
        "```python",
        "from datasets import load_dataset",
        'ds = load_dataset("path/to/this/folder")',
        "```",
        "",
    ]
    return "\n".join(lines)


def write_huggingface(
    reader: Any,
    tmp: str,
    limit: int,
    progress: bool | None,
    split: str,
    source: str,
    member: Any,
) -> tuple[int, int, list[str]]:
    """Write the split's Parquet files and the card into ``tmp``; returns (samples, image bytes,
    file names relative to ``tmp``). ``member(record, relpath)`` gives a sample's image bytes."""
    pa, pq = _pyarrow()
    classes = list(reader.meta.classes)
    paths = reader.paths()
    labels = reader.labels
    labelled = bool(classes) or any(label != NO_LABEL for label in labels)
    _check_names(classes, source)
    names = classes if labelled else None
    feats = features(names)
    fields = [pa.field("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())]))]
    if labelled:
        fields.append(pa.field("label", pa.int64()))
    schema = pa.schema(fields, metadata={"huggingface": json.dumps({"info": {"features": feats}})})
    os.makedirs(os.path.join(tmp, _DATA))
    files: list[str] = []
    writer: Any = None
    written = 0
    nbytes = 0
    rows: dict[str, list[Any]] = {"bytes": [], "path": [], "label": []}

    def flush() -> None:
        nonlocal written
        if not rows["bytes"]:
            return
        image = pa.StructArray.from_arrays(
            [pa.array(rows["bytes"], pa.binary()), pa.array(rows["path"], pa.string())], names=["bytes", "path"]
        )
        columns = [image] + ([pa.array(rows["label"], pa.int64())] if labelled else [])
        writer.write_table(pa.Table.from_arrays(columns, schema=schema), row_group_size=ROW_GROUP)
        written += sum(len(b) for b in rows["bytes"]) + sum(len(p) for p in rows["path"])
        for column in rows.values():
            column.clear()

    def open_next() -> Any:
        name = os.path.join(_DATA, f"{split}-{len(files):05d}.parquet")
        files.append(name)
        return pq.ParquetWriter(os.path.join(tmp, name), schema)

    try:
        with Progress(len(paths), "export", enabled=progress) as bar:
            for i, relpath in enumerate(paths):
                record = reader.get(i)
                data, _ext = member(record, relpath)
                if writer is None:
                    writer = open_next()
                    written = 0
                rows["bytes"].append(data)
                rows["path"].append(_path_text(relpath))
                rows["label"].append(record.label if record.label != NO_LABEL else None)
                if len(rows["bytes"]) >= ROW_GROUP or written + sum(map(len, rows["bytes"])) >= limit:
                    flush()
                    if written >= limit:  # this file is full: the next sample starts another
                        writer.close()
                        writer = None
                nbytes += len(data)
                bar.update(1, len(data))
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
        f.write(card(names, split, len(paths), source))
    return len(paths), nbytes, final

"""Images + a table of per-image values: a JSON Lines or CSV file beside an image tree.

Each row names one image (the column ``image_column``, by default the first of ``image``,
``file_name``, ``filename``, ``file``, ``path``, ``image_path``, ``img`` that the table has), by
its path relative to the source folder; the row's other columns become the sample's ``meta``
field, a JSON object in the table's column order: ids, captions, numbers. JSON Lines values keep
their JSON types; CSV values are the strings the file holds (``"007"`` stays ``"007"``). Samples
are in the table's row order; a row may name an image another row names too (five captions of
one image are five samples). A row naming a missing file, or a path outside the source folder, is
skipped and listed with its line.

Fields: ``image`` (the file's bytes), ``meta`` (json).
"""

from __future__ import annotations

import csv
import io
import json
import os
from typing import Any, Iterator

from lmdbfolder.errors import OptionError, SourceError
from lmdbfolder.format.fields import FieldSpec
from lmdbfolder.write.fields import FieldSamples
from lmdbfolder.write.layouts._common import (
    file_samples,
    json_payload,
    read_text,
    require_dir,
    resolve_name,
    unsafe_name,
)

__all__ = ["scan_table", "TABLE_FIELDS", "IMAGE_COLUMNS", "MAX_TABLE_LINE", "MAX_TABLE_COLUMNS"]

TABLE_FIELDS = (FieldSpec("image", "image"), FieldSpec("meta", "json"))
#: The columns that name the image file when --image-column is not given (the first one found).
IMAGE_COLUMNS = ("image", "file_name", "filename", "file", "path", "image_path", "img")
#: A table line (a JSON Lines object, a CSV row) longer than this is refused.
MAX_TABLE_LINE = 1 << 20
#: A table of more columns than this is refused.
MAX_TABLE_COLUMNS = 1000
_JSONL = (".jsonl", ".ndjson", ".jsonlines")
_HINT_JSONL = (
    'each line of a JSON Lines file must be one JSON object naming its image, e.g. {"image": "a/1.jpg", "id": 7}'
)
_HINT_CSV = "the first line of the CSV names the columns; each row has one value per column"


def scan_table(src: str, annotations: str | os.PathLike[str] | None, image_column: str | None = None) -> FieldSamples:
    """The samples of the table ``annotations`` (JSON Lines or CSV) over the images of ``src``."""
    if annotations is None:
        raise OptionError("the table layout needs the table: --annotations FILE (a .jsonl or .csv file)")
    table = os.path.abspath(os.fspath(annotations))
    require_dir(src, "images folder", "pass the folder the table's image paths are relative to as SRC")
    root = os.path.abspath(src)
    kind = _kind(table)
    text = read_text(table, "table")
    rows = _jsonl_rows(text, table) if kind == "jsonl" else _csv_rows(text, table)
    name = os.path.basename(table)
    field_paths: list[tuple[str, ...]] = []
    values: list[tuple[bytes, ...]] = []
    skipped: list[tuple[str, str]] = []
    column = image_column
    total = 0
    for lineno, row in rows:
        if column is None:
            column = next((c for c in IMAGE_COLUMNS if c in row), None)
            if column is None:
                raise SourceError(
                    f"{table}:{lineno}",
                    f"no column names the image file (looked for {', '.join(IMAGE_COLUMNS)}; found "
                    f"{', '.join(map(str, list(row)[:20]))})",
                    "name the column with --image-column NAME",
                )
        where = f"{name}:{lineno}"
        if column not in row:
            skipped.append((where, f"the row has no {column!r} column"))
            continue
        path = row[column]
        problem = unsafe_name(path)
        if problem is not None:
            skipped.append((where, f"{problem}: {str(path)[:200]!r}"))
            continue
        rel = resolve_name(root, str(path))
        full = os.path.join(root, rel)
        if not os.path.isfile(full):
            skipped.append((rel, f"named by {where} but missing from {root}"))
            continue
        meta = json_payload({k: v for k, v in row.items() if k != column}, f"the row at {where}")
        if isinstance(meta, str):
            skipped.append((rel, meta))
            continue
        field_paths.append((rel, ""))
        values.append((meta,))
        total += os.path.getsize(full) + len(meta)
    if column is None:
        raise SourceError(table, "the table holds no row", "each row names an image and its values")
    return file_samples(
        "table", root, TABLE_FIELDS, field_paths, skipped, {"table": name, "image_column": column}, total, values=values
    )


def _kind(path: str) -> str:
    lower = path.lower()
    if lower.endswith(_JSONL):
        return "jsonl"
    if lower.endswith(".csv"):
        return "csv"
    raise OptionError(
        f"{path}: the table must be JSON Lines ({', '.join(_JSONL)}) or CSV (.csv); the ending says which"
    )


def _jsonl_rows(text: str, path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        if len(line) > MAX_TABLE_LINE:
            raise SourceError(f"{path}:{lineno}", f"the line is longer than {MAX_TABLE_LINE:,} characters", _HINT_JSONL)
        try:
            row = json.loads(line, parse_constant=_refuse_constant)
        except json.JSONDecodeError as exc:
            raise SourceError(
                f"{path}:{lineno}", f"is not valid JSON (column {exc.colno}: {exc.msg})", _HINT_JSONL
            ) from None
        except (ValueError, RecursionError) as exc:
            raise SourceError(
                f"{path}:{lineno}", f"cannot be read as JSON ({exc or 'nested too deep'})", _HINT_JSONL
            ) from None
        if not isinstance(row, dict):
            raise SourceError(f"{path}:{lineno}", f"holds a {type(row).__name__}, not a JSON object", _HINT_JSONL)
        if len(row) > MAX_TABLE_COLUMNS:
            raise SourceError(
                f"{path}:{lineno}", f"has {len(row):,} keys, more than {MAX_TABLE_COLUMNS:,}", _HINT_JSONL
            )
        yield lineno, row


def _refuse_constant(token: str) -> Any:
    raise ValueError(f"{token} is not a JSON number")


def _csv_rows(text: str, path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader, None)
        if header is None:
            raise SourceError(path, "the CSV file is empty", _HINT_CSV)
        if len(header) > MAX_TABLE_COLUMNS:
            raise SourceError(f"{path}:1", f"has {len(header):,} columns, more than {MAX_TABLE_COLUMNS:,}", _HINT_CSV)
        seen: set[str] = set()
        for column in header:
            if column in seen:
                raise SourceError(f"{path}:1", f"names the column {column[:100]!r} twice", _HINT_CSV)
            seen.add(column)
        for row in reader:
            lineno = reader.line_num
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            if len(row) != len(header):
                raise SourceError(
                    f"{path}:{lineno}", f"has {len(row)} values but the header names {len(header)} columns", _HINT_CSV
                )
            yield lineno, dict(zip(header, row))
    except csv.Error as exc:
        raise SourceError(f"{path}:{reader.line_num}", f"cannot be read as CSV ({exc})", _HINT_CSV) from None

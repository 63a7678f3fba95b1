"""Pack samples of several named fields (an image and its mask, an image pair, an image and its
annotations): the sample list (``FieldSamples``), the checks of each field and the writer
(``pack_field_samples``).

The list is built before anything is written (by ``write.layouts`` for folders on disk, by
``write.from_dataset`` for dataset objects); ``read(i)`` gives sample ``i``'s payloads in field
order, each of its field's kind (FORMAT.md, "Several fields per sample"):

* ``image``, ``mask``: the source file's bytes, unchanged (a mask's palette and mode are kept
  because its bytes are). Both must decode; a mask in a lossy encoding (JPEG, lossy WebP) is
  packed but reported (``PackResult.lossy_masks`` is not a thing: a ``LossyMaskWarning``).
* ``json``: compact UTF-8 JSON (``encode_json``), at most ``MAX_JSON_FIELD_BYTES``.
* ``array``: the ``.npy`` bytes of a numpy array (``encode_array``: never pickled), bounded in
  dimensions and size.

The records are written by ``pack_sources`` with a loader (resumable, atomic, skipped samples
listed with their files), one record per sample holding every field (``format.encode_fields``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Sequence

from lmdbfolder.format.fields import FIELD_KINDS, FieldSpec
from lmdbfolder.write.options import PackOptions
from lmdbfolder.write.writer import PackResult

__all__ = ["FIELD_KINDS", "FieldSpec", "SampleError", "FieldSamples", "pack_field_samples"]


class SampleError(Exception):
    """A sample that cannot be packed (``FieldSamples.read(i)`` raises it): it is skipped and
    listed with its files (``paths``, relative to the source root) and ``why``."""

    def __init__(self, why: str, paths: Sequence[str] = ()) -> None:
        super().__init__(why)
        self.why = why
        self.paths = tuple(paths)


@dataclasses.dataclass
class FieldSamples:
    """The samples of several fields a pack will hold, listed before anything is written."""

    #: where the samples come from: ``"voc"``, ``"ade20k"``, ``"cityscapes"``, ``"coco"``,
    #: ``"pairs"``, ``"table"``, ``"dataset"``... (recorded in the manifest's ``layout``)
    layout: str
    #: the source root (messages, update)
    root: str
    fields: tuple[FieldSpec, ...]
    #: per sample: the stored path ('/'-separated, relative to root) of its first field's file
    relpaths: list[str]
    #: per sample: each field's file relpath ('' for a field that is not a file)
    field_paths: list[tuple[str, ...]]
    #: per sample: class index, or NO_LABEL
    labels: list[int]
    classes: list[str]
    #: sample i's payloads, in field order; may raise SampleError
    read: Callable[[int], list[bytes]]
    #: (file path(s), why) of samples left out while listing (missing partners ...)
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    #: JSON-able, kept in the manifest (e.g. {"split": "train"}, {"scale": 4}, COCO categories)
    layout_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: the expected bytes per sample (sizes the map); 0: measured from a few samples
    mean_size: float = 0.0


def pack_field_samples(
    samples: FieldSamples,
    dst: str | os.PathLike[str],
    options: PackOptions | None = None,
    **settings: Any,
) -> PackResult:
    """Pack ``samples`` into a new pack of several fields at ``dst`` (``pack``'s rules)."""
    raise NotImplementedError

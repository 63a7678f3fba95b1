"""``contact_sheet``: a PNG grid of a pack's samples, to check a pack by eye.

What the recipes tell people to do by hand after converting ("spot-check a
few keys"), in one command: ``lmdbfolder show DST``. Each tile is one sample,
decoded exactly as ImageFolder loads it (``Reader.image``), shrunk to fit a
square of ``size`` pixels (aspect ratio kept, centred), with a caption: its
index and class name. Three selections:

* ``per_class=K`` (the default, K=4, fewer for many classes): a row per class, its first, middle
  and last samples evenly spread (so a class that is wrong somewhere in the
  middle shows it);
* ``random=N``: N samples drawn at random (``seed``);
* ``indices=[...]``: exactly those samples, in that order.

A sample that does not decode (or whose record is damaged) becomes a red
tile saying so, instead of stopping the sheet.

The sheet is written to a temporary file beside ``out`` and renamed over it
when complete. ``out`` may be an earlier sheet (a PNG file), never a path
inside the pack nor any other file: nothing we did not make is overwritten.
A sheet of more than ``MAX_SHEET_PIXELS`` is refused before it is drawn.
"""

from __future__ import annotations

import math
import os
import random as _random
import tempfile
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from PIL import Image, ImageDraw, ImageFont

from lmdbfolder import packdir
from lmdbfolder.errors import CorruptRecordError, DecodeError, OptionError, OutputExistsError
from lmdbfolder.format import NO_LABEL, PARTIAL_SUFFIX
from lmdbfolder.read.opening import open_pack
from lmdbfolder.text import printable

__all__ = [
    "SheetResult",
    "contact_sheet",
    "choose_samples",
    "MAX_TILES",
    "MAX_SHEET_PIXELS",
    "DEFAULT_PER_CLASS",
    "PAD",
    "CAPTION",
]

#: The most tiles one sheet holds (a 1,000-class pack shows one sample per class).
MAX_TILES = 1024
#: The most pixels of one sheet (3 bytes each in memory): 1,024 tiles of 128 px take 20 million.
MAX_SHEET_PIXELS = 200_000_000
#: The first bytes of every PNG file: an existing ``out`` that starts otherwise is not a sheet.
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DEFAULT_PER_CLASS = 4
#: Pixels between tiles, and the height of the caption strip under each tile.
PAD = 4
CAPTION = 14
_BACKGROUND = (24, 24, 24)
_TEXT = (230, 230, 230)
_BROKEN = (160, 20, 20)


@dataclass
class SheetResult:
    """What ``contact_sheet`` drew: the PNG, its size, and where each sample's thumbnail lies."""

    path: str
    width: int
    height: int
    columns: int
    rows: int
    size: int
    indices: list[int]
    #: ``(left, top, right, bottom)`` of each sample's thumbnail in the sheet (pixels of the image, not the cell).
    boxes: list[tuple[int, int, int, int]] = field(default_factory=list)
    undecodable: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (``lmdbfolder show --json``)."""
        return asdict(self)


def choose_samples(
    labels: Sequence[int],
    num_classes: int,
    *,
    per_class: int | None = None,
    random: int | None = None,
    indices: Sequence[int] | None = None,
    seed: int = 0,
) -> tuple[list[int], int]:
    """The sample indices to show and the number of columns of the grid.

    At most one of ``per_class``, ``random`` and ``indices``; none means
    ``per_class=DEFAULT_PER_CLASS``, fewer when the classes would pass
    ``MAX_TILES`` (one each for 1,000 classes), or 16 random samples for an
    unlabelled pack or one of more classes than a sheet holds.
    """
    n = len(labels)
    if sum(x is not None for x in (per_class, random, indices)) > 1:
        raise OptionError("choose one of per_class, random and indices")
    if indices is not None:
        chosen = []
        for i in indices:
            if not -n <= i < n:
                raise OptionError(f"index {i} is out of range: the pack holds {n:,} samples (0..{n - 1})")
            chosen.append(i % n)
        if not chosen:
            raise OptionError("give at least one index")
        return _checked(chosen), _columns(len(chosen))
    if per_class is None and random is None:
        present = len(set(labels))  # the rows: classes kept without images have none
        if num_classes == 0 or all(label == NO_LABEL for label in labels) or present > MAX_TILES:
            random = 16
        else:
            per_class = max(1, min(DEFAULT_PER_CLASS, MAX_TILES // max(1, present)))
    if random is not None:
        if random < 1:
            raise OptionError(f"random must be at least 1, got {random}")
        picked = sorted(_random.Random(seed).sample(range(n), min(random, n)))
        return _checked(picked), _columns(len(picked))
    per_class = DEFAULT_PER_CLASS if per_class is None else per_class
    if per_class < 1:
        raise OptionError(f"per_class must be at least 1, got {per_class}")
    by_class: dict[int, list[int]] = {}
    for i, label in enumerate(labels):
        by_class.setdefault(label, []).append(i)
    rows = []
    for label in sorted(by_class):
        members = by_class[label]
        k = min(per_class, len(members))
        # Evenly spread over the class: first, ..., last.
        rows.append([members[round(j * (len(members) - 1) / max(1, k - 1))] for j in range(k)])
    width = max(len(r) for r in rows)
    chosen = []
    for row in rows:  # a row per class; short classes leave their row's end empty
        chosen.extend(row + [-1] * (width - len(row)))
    return _checked(chosen), width


def _columns(n: int) -> int:
    return max(1, math.ceil(math.sqrt(n)))


def _checked(chosen: list[int]) -> list[int]:
    tiles = len(chosen)
    if tiles > MAX_TILES:
        raise OptionError(
            f"that is {tiles:,} tiles; one sheet holds at most {MAX_TILES:,}",
            "show fewer samples (--per-class 1, --random N or --indices I ...)",
        )
    return chosen


def _check_output(out: str, pack_path: str) -> None:
    """Refuse an ``out`` inside the pack, or that exists and is not an earlier sheet (a PNG file)."""
    if packdir.overlap(out, pack_path):
        raise OptionError(
            f"cannot write the sheet {out}: it is inside the pack {pack_path} (or is the pack)",
            "choose an -o outside the pack",
        )
    if not os.path.lexists(out):
        return
    if os.path.islink(out) or not os.path.isfile(out):
        raise OutputExistsError(out, "exists and is not a file; show never writes over it", "choose another -o")
    try:
        with open(out, "rb") as f:
            head = f.read(len(_PNG_SIGNATURE))
    except OSError as exc:
        raise OutputExistsError(out, f"exists and cannot be read ({exc.strerror})", "choose another -o") from None
    if head != _PNG_SIGNATURE:
        raise OutputExistsError(
            out,
            "exists and is not a PNG image (an earlier sheet); show never writes over other files",
            "choose another -o, or remove the file yourself",
        )


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _font() -> Any:
    try:
        return ImageFont.load_default(size=CAPTION - 3)
    except TypeError:  # Pillow < 10.1 has only the bitmap font
        return ImageFont.load_default()


def _fit(text: str, draw: ImageDraw.ImageDraw, font: Any, width: int) -> str:
    """``text`` shortened with an ellipsis until it fits ``width`` pixels.

    The longest prefix that fits is found by bisection, from at most ``width``
    characters: a class name read from a pack may be any length, and measuring
    it one character shorter at a time took time quadratic in its length.
    """
    text = text[: max(1, width)]  # a caption of more characters than pixels never fits
    if draw.textlength(text, font=font) <= width:
        return text
    lo, hi = 0, len(text) - 1  # the longest prefix that fits with "..." is text[:lo]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if draw.textlength(text[:mid] + "...", font=font) <= width:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo] + "..."


def contact_sheet(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    per_class: int | None = None,
    random: int | None = None,
    indices: Sequence[int] | None = None,
    size: int = 128,
    seed: int = 0,
) -> SheetResult:
    """Draw samples of the pack at ``path`` as a PNG grid at ``out``; see the module docstring.

    ``size``: the side of each tile's square, in pixels. Returns a
    SheetResult with the sheet's size and every thumbnail's box.

    Example:
        >>> contact_sheet("train.lmdb", "sheet.png", per_class=2)  # doctest: +SKIP
    """
    if size < 16:
        raise OptionError(f"size must be at least 16 pixels, got {size}")
    out = os.path.abspath(os.fspath(out))
    found = packdir.require_pack(path)
    _check_output(out, found.path)
    with open_pack(found.path) as reader:
        classes = reader.classes
        overlay = _Overlay.of(reader)
        chosen, columns = choose_samples(
            reader.labels, len(classes), per_class=per_class, random=random, indices=indices, seed=seed
        )
        rows = max(1, math.ceil(len(chosen) / columns))
        cell_w, cell_h = size + PAD, size + CAPTION + PAD
        width, height = PAD + columns * cell_w, PAD + rows * cell_h
        if width * height > MAX_SHEET_PIXELS:
            raise OptionError(
                f"a sheet of {len(chosen):,} tiles of {size:,} pixels would be {width:,}x{height:,} pixels; "
                f"one sheet holds at most {MAX_SHEET_PIXELS:,} pixels",
                "choose a smaller --size (tile size) or show fewer samples",
            )
        sheet = Image.new("RGB", (PAD + columns * cell_w, PAD + rows * cell_h), _BACKGROUND)
        draw = ImageDraw.Draw(sheet)
        font = _font()
        boxes: list[tuple[int, int, int, int]] = []
        shown: list[int] = []
        broken: list[int] = []
        for k, index in enumerate(chosen):
            if index < 0:
                continue  # the empty end of a short class's row
            x, y = PAD + (k % columns) * cell_w, PAD + (k // columns) * cell_h
            label = reader.labels[index]
            name = classes[label] if 0 <= label < len(classes) else ""
            box = _draw_tile(reader, index, sheet, draw, font, (x, y), size, broken, overlay)
            caption = _fit(printable(f"{index} {name}".strip(), None), draw, font, size)
            draw.text((x, y + size + 1), caption, fill=_TEXT, font=font)
            boxes.append(box)
            shown.append(index)
    _save_png(sheet, out)
    return SheetResult(out, sheet.width, sheet.height, columns, rows, size, shown, boxes, broken)


def _draw_tile(
    reader: Any,
    index: int,
    sheet: Image.Image,
    draw: ImageDraw.ImageDraw,
    font: Any,
    at: tuple[int, int],
    size: int,
    broken: list[int],
    overlay: _Overlay | None = None,
) -> tuple[int, int, int, int]:
    """Draw sample ``index`` in the tile at ``at`` (its thumbnail, centred; a red tile that
    says why for a sample that does not decode, appended to ``broken``); the box drawn.
    A sample of several fields is drawn by ``overlay`` (its mask over its image, its boxes)."""
    x, y = at
    try:
        image = reader.image(index) if overlay is None else overlay.image(reader, index)
    except (DecodeError, CorruptRecordError) as exc:  # undecodable, or a damaged record
        broken.append(index)
        draw.rectangle((x, y, x + size - 1, y + size - 1), fill=_BROKEN)
        why = "damaged" if isinstance(exc, CorruptRecordError) else "cannot decode"
        draw.text((x + 3, y + 3), why, fill=_TEXT, font=font)
        return (x, y, x + size, y + size)
    image.thumbnail((size, size), Image.Resampling.BILINEAR, reducing_gap=None)
    left, top = x + (size - image.width) // 2, y + (size - image.height) // 2
    sheet.paste(image, (left, top))
    return (left, top, left + image.width, top + image.height)


class _Overlay:
    """How a sample of several fields is drawn (decided once per pack): its first image, its
    mask blended over it (each class value its own colour, 255, VOC's border, in white), and
    COCO's boxes outlined in their category's colour."""

    def __init__(self, schema: Any) -> None:
        self.schema = schema
        kinds = [f.kind for f in schema.fields]
        self.image_at = kinds.index("image") if "image" in kinds else None
        self.mask_at = kinds.index("mask") if "mask" in kinds else None
        self.boxes_at = 2 if schema.layout == "coco" else None

    @classmethod
    def of(cls, reader: Any) -> _Overlay | None:
        """The overlay of a pack of several fields; None for one image per record."""
        from lmdbfolder.read.fields import SampleSchema, samples_manifest

        meta = samples_manifest(reader)
        if meta is None:
            return None
        return cls(SampleSchema.of(meta, reader.path))

    def image(self, reader: Any, index: int) -> Image.Image:
        """Sample ``index`` drawn as one RGB image; CorruptRecordError for a field that cannot be read."""
        import numpy as np

        from lmdbfolder.read.fields import decode_image

        record = reader.get(index)
        parts = self.schema.split(record.payload, index)
        at = self.image_at if self.image_at is not None else self.mask_at
        if at is None:
            raise CorruptRecordError(index, "the sample has no image to show")
        try:
            image = decode_image(parts[at], rgb=True)
            if self.mask_at is not None and self.mask_at != at:
                mask = np.asarray(decode_image(parts[self.mask_at], rgb=False)).astype(np.int64)
                if mask.ndim == 2 and mask.shape == (image.height, image.width):
                    colours = _colours(mask)
                    shown = (mask != 0)[..., None]
                    pixels = np.asarray(image, dtype=np.float32)
                    image = Image.fromarray(np.where(shown, 0.45 * pixels + 0.55 * colours, pixels).astype(np.uint8))
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
            raise DecodeError(index, None, f"{type(exc).__name__}: {exc}") from None
        if self.boxes_at is not None:
            annotations = self.schema.value(self.boxes_at, parts[self.boxes_at], index)
            draw = ImageDraw.Draw(image)
            for ann in annotations if isinstance(annotations, list) else []:
                box = ann.get("bbox") if isinstance(ann, dict) else None
                if isinstance(box, list) and len(box) == 4 and all(isinstance(v, (int, float)) for v in box):
                    x, y, w, h = box
                    colour = tuple(
                        int(c)
                        for c in _colours(np.array([[zlib.crc32(str(ann.get("category_id")).encode()) % 997 + 1]]))[
                            0, 0
                        ]
                    )
                    draw.rectangle(
                        (x, y, x + max(w, 0), y + max(h, 0)), outline=colour, width=max(1, image.width // 128)
                    )
        return image


def _colours(values: Any) -> Any:
    """An RGB colour per class value (golden-ratio hues, bright); 255 (an ignored border) white."""
    import colorsys

    import numpy as np

    out = np.zeros((*values.shape, 3), dtype=np.float32)
    for v in np.unique(values).tolist()[:4096]:
        rgb = (1.0, 1.0, 1.0) if v == 255 else colorsys.hsv_to_rgb((v * 0.618034) % 1.0, 0.85, 1.0)
        out[values == v] = np.array(rgb, dtype=np.float32) * 255
    return out


def _save_png(sheet: Image.Image, out: str) -> None:
    """Write ``sheet`` to ``out`` as a PNG, whole or not at all (a temporary file, renamed)."""
    folder = os.path.dirname(out)
    os.makedirs(folder, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(out)[:100]}.", suffix=PARTIAL_SUFFIX, dir=folder)
    except OSError as exc:  # name the sheet asked for, not the temporary name
        raise OSError(exc.errno, exc.strerror, out) from None
    try:
        with os.fdopen(fd, "wb") as f:
            sheet.save(f, "PNG")
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, out)
    except BaseException:
        os.unlink(tmp)  # made by this call
        raise

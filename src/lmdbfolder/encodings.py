"""The stored encodings, each in one place: how it is recognised, encoded, checked and decoded.

A pack stores every image as the original file's bytes (``jpeg``, ``png``,
``webp``, ``gif``, ...) or as decoded pixels (``raw``); the record header names
which, by the numeric id the format defines (``lmdbfolder.format.ENCODINGS``,
FORMAT.md). Everything that depends on that name lives in one ``Encoding``
object per kind, looked up once per record with ``encoding_of`` (MosaicML's
``mds/encodings.py``, FFCV's ``Field``); no other module compares encoding
names. An ``Encoding`` owns its name and its id in the record header
(``id``); for the write side how its header gives the size (``sniff``),
whether the header is one this module can vouch for without Pillow
(``clean_header``), whether a file is cut short (``truncation``), which Pillow
plugin opens it (``pillow_formats``), and how pixels are encoded to it
(``encode``: the raw pixels of ``store="raw"``, the JPEG or WebP of a
pack-time resize, ``RESIZE_FORMATS``); for the read side ImageFolder's RGB
conversion (``decode_rgb``), the pixels a fast decoder or the memory map gives
(``pixels``), the DCT scales it decodes at, and the crop region decode
(``region``); for export the file it becomes (``file_bytes``, ``extension``).

The payload is the truth, the record header is a claim: a pack may come from
anyone, and a CRC-32 proves nothing about who wrote it. ``Encoding.check``
holds a record header's claim (size, components) against what the payload's
own header says, and applies Pillow's decompression-bomb limits to the
payload's size (``check_bomb``), before any crop box is drawn from the claim
or any pixel is allocated; ``Encoding.pixels`` checks the decoded image's size
against the claim again (``PayloadMismatch``). The read plan
(``lmdbfolder.read.plan``) asks both on every decode path.

``sniff`` reads only the first bytes of a file (magic numbers and the header
fields that give the size) in pure Python: it never decodes pixels and never
raises, so the writer can record the format and shape of every image at
almost no cost. ``decode_rgb`` is the read side: it reproduces
torchvision's default loader (``Image.open(f).convert("RGB")``) exactly.

Nothing here imports a decoder library: the read side passes its resolved
decoder (``lmdbfolder.read.decoders.Decoder``) and the compiled region
decoder in as arguments.
"""

from __future__ import annotations

import io
import struct
import warnings
from typing import Any, Callable, NamedTuple, TypeVar

import numpy as np
from PIL import Image

from lmdbfolder.errors import BOMB_HINT, FORGED_HINT
from lmdbfolder.format import ENCODINGS as _HEADER_IDS

__all__ = [
    "ImageInfo",
    "PayloadMismatch",
    "check_bomb",
    "decode_hint",
    "Encoding",
    "ENCODINGS",
    "encoding_of",
    "encoding_by_id",
    "JPEG",
    "PNG",
    "WEBP",
    "RAW",
    "OTHER",
    "RESIZE_FORMATS",
    "DEFAULT_RESIZE_FORMAT",
    "sniff",
    "clean_header",
    "vouch_jpeg",
    "truncation",
    "decode_rgb",
    "raw_rgb",
    "END_SEARCH_WINDOW",
]


class ImageInfo(NamedTuple):
    """Format and shape read from an image's header; 0 means unknown."""

    encoding: str
    width: int
    height: int
    channels: int

    @property
    def recognised(self) -> bool:
        """Whether ``sniff`` recognised the format (else it is ``other``: Pillow's to identify)."""
        return self.encoding != _OTHER_NAME


_OTHER_NAME = "other"
_UNKNOWN = ImageInfo(_OTHER_NAME, 0, 0, 0)
#: The record header's id of each encoding name: the format defines the ids (FORMAT.md).
_ID_OF: dict[str, int] = {name: i for i, name in _HEADER_IDS.items()}
# SOFn markers that carry the frame size (not DHT=C4, JPG=C8, DAC=CC).
_JPEG_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_JPEG_STANDALONE = frozenset({0x01, 0xD8, *range(0xD0, 0xD8)})
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
#: How many bytes at the end of a file ``truncation`` looks at first. Real files
#: may carry data after their end marker (camera trailers, padding); the rest
#: of the file is searched only when the marker is not among these bytes.
END_SEARCH_WINDOW = 8192
_JPEG_EOI = b"\xff\xd9"
_PNG_IEND = b"IEND\xaeB`\x82"  # the chunk type and its (constant) CRC-32
#: The compiled region decoder's signature: ``(payload, left, top, width, height,
#: out[, image_width, image_height]) -> (x0, w0)``, the columns it decoded.
RegionFn = Callable[..., tuple[int, int]]
#: Decoded pixels: an ``H x W x 3`` array or a PIL image (``Encoding.expect``).
_Pixels = TypeVar("_Pixels", np.ndarray, Image.Image)


class PayloadMismatch(ValueError):
    """A record header's claim (encoding, size, components) that its payload contradicts.

    Readers wrap it in an error naming the record (``DecodeError``); ``verify``
    reports it as a problem of kind ``"header"``.
    """


def check_bomb(width: int, height: int, *, error_only: bool = False) -> None:
    """Pillow's decompression-bomb rule for an image of ``width`` x ``height``, as
    ``Image.open`` applies it (so ImageFolder on the same file): above
    ``Image.MAX_IMAGE_PIXELS`` a ``DecompressionBombWarning`` (not with
    ``error_only``), above twice it a ``DecompressionBombError``; no limit when
    it is None. The limit is read at each call, so a program that changes it
    (as for ImageFolder) is obeyed.

    ``Encoding.check`` raises the error before anything is drawn or allocated;
    the warning comes with the decode, once: from Pillow's open where Pillow
    decodes, from here where a fast decoder does (``Jpeg.pixels``, ``Jpeg.region``).
    """
    limit = Image.MAX_IMAGE_PIXELS
    if limit is None:
        return
    pixels = max(1, width) * max(1, height)
    if pixels > 2 * limit:
        raise Image.DecompressionBombError(
            f"Image size ({pixels} pixels) exceeds limit of {2 * limit} pixels, could be decompression bomb DOS attack."
        )
    if pixels > limit and not error_only:
        warnings.warn(
            f"Image size ({pixels} pixels) exceeds limit of {limit} pixels, could be decompression bomb DOS attack.",
            Image.DecompressionBombWarning,
            stacklevel=2,
        )


def decode_hint(exc: BaseException) -> str | None:
    """What to do about a record that failed to decode with ``exc``, where this module
    knows better than ``DecodeError``'s default hint: a header its payload denies,
    an image over Pillow's bomb limit."""
    if isinstance(exc, PayloadMismatch):
        return FORGED_HINT
    if isinstance(exc, Image.DecompressionBombError):
        return BOMB_HINT
    return None


def _pillow_info(payload: bytes | memoryview) -> tuple[int, int, int]:
    """``(width, height, bands)`` as Pillow's open reads them (headers only; its own
    bomb check included, as in ImageFolder's loader)."""
    with Image.open(io.BytesIO(payload)) as img:
        return img.size[0], img.size[1], len(img.getbands())


def _scaled_sizes(width: int, height: int, denom: int) -> set[tuple[int, int]]:
    """The ``(height, width)`` an image of this size decodes to at DCT scale ``1/s``
    for each ``s <= denom`` (libjpeg rounds up; Pillow's draft may pick a smaller ``s``)."""
    return {(-(-height // s), -(-width // s)) for s in (1, 2, 4, 8) if s <= max(1, denom)}


class Encoding:
    """One stored encoding. The base class is an image file Pillow decodes (GIF,
    BMP, TIFF, PNM, anything unrecognised): no header of ours, no end marker,
    no fast decoder, the crop left to torchvision's own transform."""

    name = _OTHER_NAME
    #: The file's first bytes, for ``sniff`` (empty: not recognised by magic).
    magic: tuple[bytes, ...] = ()
    #: Decoded pixels rather than an image file (no file to hand a loader, nothing to decode).
    stores_pixels = False
    #: The Pillow plugins that open this kind, tried first when the writer checks a
    #: header (empty: let Pillow identify the file). Only a plugin that Pillow would
    #: choose anyway (no other one accepts the magic bytes).
    pillow_formats: tuple[str, ...] = ()
    #: The extension of this kind's file when exported (None: the source file's own).
    extension: str | None = None
    #: Whether a pack-time resize may re-encode images to this kind (``pack --format``).
    resize_target = False

    @property
    def id(self) -> int:
        """This encoding's id in the record header (``lmdbfolder.format.ENCODINGS``)."""
        return _ID_OF[self.name]

    def encode(self, image: Image.Image, quality: int = 90) -> bytes | memoryview:
        """The payload of a record of this kind holding ``image`` (an RGB PIL image;
        ``quality`` for the lossy kinds). Raises ``NotImplementedError`` for a kind
        the writer never produces from pixels (it stores those files as they are)."""
        raise NotImplementedError(f"the writer does not encode images as {self.name}")

    def file_bytes(self, payload: bytes | memoryview, width: int, height: int) -> bytes | memoryview:
        """The record as an image file of this kind's ``extension`` (export): the stored
        file itself for the encoded kinds."""
        return payload

    def sniff(self, data: bytes | memoryview, head: bytes) -> ImageInfo:
        """The size and components the header gives (``head``: the first 64 bytes). May raise
        ``struct.error``/``IndexError``/``ValueError`` on damage (``sniff`` catches them)."""
        return ImageInfo(self.name, 0, 0, 0)

    def check(self, payload: bytes | memoryview, width: int, height: int, channels: int) -> None:
        """Hold a record header's claim against the payload, before anything is drawn
        from the claim or allocated for it.

        The size is the payload's own (here as Pillow's open reads it: these kinds
        are decoded whole by Pillow, and the open applies its bomb limits); a
        claimed size (0: unknown) must be it. Raises ``PayloadMismatch`` when it is
        not, ``Image.DecompressionBombError`` above Pillow's limit, and whatever
        Pillow raises for a file it cannot open (as ImageFolder's loader would).
        """
        if width <= 0 and height <= 0:
            return  # nothing claimed: the box is drawn from the decoded image
        found_w, found_h, _ = _pillow_info(payload)
        self._same_size(width, height, found_w, found_h)

    def _same_size(self, width: int, height: int, found_w: int, found_h: int) -> None:
        if (width, height) != (found_w, found_h):
            raise PayloadMismatch(
                f"the record header says {width}x{height}, the {self.name} payload's own header "
                f"says {found_w}x{found_h}: the header is wrong (damaged, or a forged pack)"
            )

    def expect(self, pixels: _Pixels, width: int, height: int, denom: int = 1) -> _Pixels:
        """``pixels`` (decoded: ``H x W x 3`` or a PIL image) when their size is the claimed
        ``width`` x ``height`` (at DCT scale ``1/denom``, or a finer one); else
        ``PayloadMismatch``. A claim of 0 (unknown size) accepts any size."""
        shape = (pixels.height, pixels.width) if isinstance(pixels, Image.Image) else pixels.shape[:2]
        if width > 0 and height > 0 and shape != (height, width) and shape not in _scaled_sizes(width, height, denom):
            raise PayloadMismatch(
                f"the record header says {width}x{height}, the {self.name} payload decodes to "
                f"{shape[1]}x{shape[0]}"
                + (f" at 1/{denom} scale" if denom > 1 else "")
                + ": the header is wrong (damaged, or a forged pack)"
            )
        return pixels

    def clean_header(self, data: bytes | memoryview, info: ImageInfo) -> bool:
        """Whether this parser vouches for the header as Pillow's open would (see ``clean_header``)."""
        return False

    def truncation(self, data: bytes | memoryview, data_start: int | None = None) -> str | None:
        """Why the file is cut short, or None (see ``truncation``)."""
        return None

    def decode_rgb(self, payload: bytes | memoryview, width: int, height: int) -> Image.Image:
        """ImageFolder's RGB image of the payload: ``Image.open(...).convert("RGB")``."""
        img = Image.open(io.BytesIO(payload))
        return img.convert("RGB")

    def fusable(self, channels: int) -> bool:
        """Whether the fused crop crops and resizes this kind itself; else the image is
        decoded whole by Pillow and cropped as torchvision's own transform does."""
        return False

    def scales(self, channels: int, decoder: Any) -> tuple[int, ...]:
        """The DCT scale denominators this record decodes at with ``decoder``."""
        return (1,)

    def pixels(
        self,
        payload: bytes | memoryview,
        width: int,
        height: int,
        channels: int,
        decoder: Any,
        denom: int,
        buffer: np.ndarray | None,
    ) -> np.ndarray:
        """RGB pixels, ``H x W x 3`` uint8, at ``1/denom`` scale where this kind decodes
        scaled (``buffer``: a reusable flat uint8 buffer the decoder may write into). Their
        size is checked against the claim (``expect``)."""
        return self.expect(np.asarray(self.decode_rgb(payload, width, height)), width, height)

    def regionable(self, payload: bytes | memoryview, channels: int) -> bool:
        """Whether the compiled region decoder may decode this record (``region``; the
        native batch): else it is decoded whole."""
        return False

    def region(
        self,
        payload: bytes | memoryview,
        box: tuple[int, int, int, int],
        width: int,
        channels: int,
        helper: RegionFn,
        buffer: np.ndarray,
        height: int = 0,
    ) -> tuple[np.ndarray, tuple[int, int, int, int]] | None:
        """Only the rows of ``box`` (``top, left, height, width``), decoded by ``helper``:
        ``(pixels, inner box)``, or None when this record must be decoded whole
        (``width`` x ``height``: the claimed size, which the helper holds libjpeg's to;
        a ``height`` of 0 skips that)."""
        return None

    def __repr__(self) -> str:
        return f"<encoding {self.name}>"


class _Parsed(Encoding):
    """A kind whose header this module parses (``sniff``): the claim is checked against
    the parse, components included (the writer records them from it)."""

    def recognises(self, head: bytes) -> bool:
        """Whether the file's first bytes (``head``) are this kind's magic."""
        return any(head.startswith(m) for m in self.magic)

    def check(self, payload: bytes | memoryview, width: int, height: int, channels: int) -> None:
        """As ``Encoding.check``, from this module's parse of the payload's header (a few
        microseconds; Pillow's open only when the parse cannot walk it): the payload
        must be of this kind, a claimed size (0x0: unknown) its size, claimed
        components (0: unknown) its components, and its size within Pillow's bomb
        limits (``check_bomb``)."""
        head = bytes(payload[:64])
        if self.recognises(head):
            try:
                found = self.sniff(payload, head)
            except (struct.error, IndexError, ValueError):
                found = _UNKNOWN
            # The usual case, in a few comparisons: an honest header, an image under the limit.
            limit = Image.MAX_IMAGE_PIXELS
            if (
                found.width > 0
                and found.height > 0
                and found.width == width
                and found.height == height
                and found.channels == channels
                and (limit is None or width * height <= 2 * limit)
            ):
                return
        self._check_slowly(payload, head, width, height, channels)

    def _check_slowly(self, payload: bytes | memoryview, head: bytes, width: int, height: int, channels: int) -> None:
        if not self.recognises(head):
            raise PayloadMismatch(
                f"the record header says {self.name}, the payload is not a {self.name} file (its first bytes): "
                "the header is wrong (damaged, or a forged pack)"
            )
        try:
            found = self.sniff(payload, head)
        except (struct.error, IndexError, ValueError):
            found = ImageInfo(self.name, 0, 0, 0)
        if found.width <= 0 or found.height <= 0:
            # A header our parser cannot walk: the size is Pillow's (which raises,
            # as ImageFolder's loader would, for a file it cannot open).
            found_w, found_h, bands = _pillow_info(payload)
            found = ImageInfo(self.name, found_w, found_h, found.channels or bands)
        check_bomb(found.width, found.height, error_only=True)  # the warning comes with the decode
        if width > 0 or height > 0:
            self._same_size(width, height, found.width, found.height)
        if channels > 0 and channels != found.channels:
            raise PayloadMismatch(
                f"the record header says {channels} colour components, the {self.name} payload's own header "
                f"says {found.channels}: the header is wrong (damaged, or a forged pack)"
            )


class Jpeg(_Parsed):
    """JPEG files: 1 (grey) and 3 (YCbCr) components go to the fast decoders, the
    fused crop and the region decoder; CMYK/YCCK (4) is Pillow's conversion."""

    name = "jpeg"
    magic = (b"\xff\xd8\xff",)
    pillow_formats = ("JPEG",)
    extension = "jpg"
    resize_target = True

    def encode(self, image: Image.Image, quality: int = 90) -> bytes | memoryview:
        out = io.BytesIO()
        image.save(out, "JPEG", quality=quality)
        return out.getbuffer()

    def recognises(self, head: bytes) -> bool:
        return head[:3] == b"\xff\xd8\xff"

    def sniff(self, data: bytes | memoryview, head: bytes) -> ImageInfo:
        return _sniff_jpeg(data)

    def clean_header(self, data: bytes | memoryview, info: ImageInfo) -> bool:
        return _walk_clean_jpeg(data, info) is not None

    def truncation(self, data: bytes | memoryview, data_start: int | None = None) -> str | None:
        start = _jpeg_data_start(data) if data_start is None else data_start
        if _holds_near_end(data, _JPEG_EOI, start):
            return None
        return "the JPEG has no end-of-image marker (FFD9) after its image data"

    def fusable(self, channels: int) -> bool:
        return channels in (1, 3)

    def scales(self, channels: int, decoder: Any) -> tuple[int, ...]:
        return decoder.scales if channels in (1, 3) else (1,)

    def pixels(
        self,
        payload: bytes | memoryview,
        width: int,
        height: int,
        channels: int,
        decoder: Any,
        denom: int,
        buffer: np.ndarray | None,
    ) -> np.ndarray:
        if channels not in (1, 3):
            return self.expect(np.asarray(self.decode_rgb(payload, width, height)), width, height)
        if decoder.name != "pillow":
            check_bomb(width, height)  # Pillow's warning, which its open would give (the error was ``check``'s)
        if denom not in decoder.scales:
            denom = 1
        if buffer is None:
            return self.expect(np.asarray(decoder.decode_jpeg(payload, denom)), width, height, denom)
        size = (width, height) if width > 0 and height > 0 else None
        return self.expect(decoder.decode_into(payload, denom, buffer, size), width, height, denom)

    def region(
        self,
        payload: bytes | memoryview,
        box: tuple[int, int, int, int],
        width: int,
        channels: int,
        helper: RegionFn,
        buffer: np.ndarray,
        height: int = 0,
    ) -> tuple[np.ndarray, tuple[int, int, int, int]] | None:
        if not self.regionable(payload, channels):
            return None
        top, left, rows, cols = box
        need = 3 * width * rows  # the region's rows are at most the image's width
        if buffer.size < need:
            return None
        try:
            # The helper also holds libjpeg's image size to the claim (the box was drawn from it).
            x0, w0 = helper(payload, left, top, cols, rows, buffer, width, height)
        except ValueError:
            return None  # damaged, or a kind libjpeg refuses: the caller decodes it whole
        check_bomb(width, height)  # Pillow's warning, as in ``pixels``
        offset = left - x0
        return buffer[: 3 * w0 * rows].reshape(rows, w0, 3), (offset, 0, offset + cols, rows)

    def regionable(self, payload: bytes | memoryview, channels: int) -> bool:
        # Only a file that ends with its end-of-image marker: a truncated one is
        # decoded whole, so it fails (or is decoded past) as in ImageFolder.
        return channels in (1, 3) and self.ends_with_eoi(payload)

    @staticmethod
    def ends_with_eoi(payload: bytes | memoryview, slack: int = 0) -> bool:
        """Whether the end-of-image marker is among the last ``2 + slack`` bytes (0: the
        very last two). In entropy-coded data FF is only followed by 00 or a restart
        marker, so FF D9 there is the real marker."""
        if slack == 0:
            return bytes(payload[-2:]) == _JPEG_EOI
        return _JPEG_EOI in bytes(payload[-(2 + slack) :])


class Png(_Parsed):
    """PNG files: the header check and the IEND end marker are ours; decoding is Pillow's."""

    name = "png"
    magic = (b"\x89PNG\r\n\x1a\n",)
    pillow_formats = ("PNG",)
    extension = "png"

    def encode(self, image: Image.Image, quality: int = 90) -> bytes | memoryview:
        # Lossless: ``quality`` does not apply.
        out = io.BytesIO()
        image.save(out, "PNG")
        return out.getvalue()

    def sniff(self, data: bytes | memoryview, head: bytes) -> ImageInfo:
        width, height = struct.unpack_from(">II", head, 16)
        return ImageInfo("png", width, height, _PNG_CHANNELS.get(head[25], 0))

    def clean_header(self, data: bytes | memoryview, info: ImageInfo) -> bool:
        return _clean_png(data, info)

    def truncation(self, data: bytes | memoryview, data_start: int | None = None) -> str | None:
        if _holds_near_end(data, _PNG_IEND, 8):
            return None
        return "the PNG has no IEND chunk"


class Webp(_Parsed):
    """WebP files (packs re-encoded with ``--format webp``): Pillow decodes them, the
    fused crop crops and resizes them itself."""

    name = "webp"
    extension = "webp"
    resize_target = True

    def encode(self, image: Image.Image, quality: int = 90) -> bytes | memoryview:
        out = io.BytesIO()
        image.save(out, "WEBP", quality=quality, method=4)
        return out.getbuffer()

    def recognises(self, head: bytes) -> bool:
        return head[:4] == b"RIFF" and head[8:12] == b"WEBP"

    def sniff(self, data: bytes | memoryview, head: bytes) -> ImageInfo:
        return _sniff_webp(head)

    def fusable(self, channels: int) -> bool:
        return True


class Raw(Encoding):
    """Decoded RGB pixels (``--store raw``): ``height x width x 3`` bytes, no decoding."""

    name = "raw"
    stores_pixels = True
    extension = "png"  # exported as a PNG file (``file_bytes``)

    def encode(self, image: Image.Image, quality: int = 90) -> bytes | memoryview:
        """The image's RGB pixels, row-major ``height x width x 3`` (``quality`` does not apply)."""
        return (image if image.mode == "RGB" else image.convert("RGB")).tobytes()

    def file_bytes(self, payload: bytes | memoryview, width: int, height: int) -> bytes | memoryview:
        """The pixels as a PNG file (lossless)."""
        return PNG.encode(self.decode_rgb(payload, width, height))

    def check(self, payload: bytes | memoryview, width: int, height: int, channels: int) -> None:
        """The pixels are the payload: the claim must describe exactly its bytes (RGB)."""
        if channels != 3:
            raise PayloadMismatch(f"raw pixels are RGB (3 components), the record header says {channels}")
        self._check(payload, width, height)

    def decode_rgb(self, payload: bytes | memoryview, width: int, height: int) -> Image.Image:
        # A copy: the image never points into the memory map. The size is checked
        # first because Pillow allocates width x height pixels before it notices short data.
        self._check(payload, width, height)
        return Image.frombytes("RGB", (width, height), payload)

    def fusable(self, channels: int) -> bool:
        return True

    def pixels(
        self,
        payload: bytes | memoryview,
        width: int,
        height: int,
        channels: int,
        decoder: Any,
        denom: int,
        buffer: np.ndarray | None,
    ) -> np.ndarray:
        self._check(payload, width, height)
        return np.frombuffer(payload, np.uint8).reshape(height, width, 3)  # a view of the map

    @staticmethod
    def _check(payload: bytes | memoryview, width: int, height: int) -> None:
        if width * height * 3 != len(payload):
            raise PayloadMismatch(f"raw pixels: {width}x{height}x3 is not the {len(payload):,} bytes stored")


class _Named(Encoding):
    """An image file recognised by its magic, decoded by Pillow."""

    def __init__(
        self,
        name: str,
        magic: tuple[bytes, ...],
        sniffer: Callable[[bytes], ImageInfo],
        extension: str | None = None,
    ) -> None:
        self.name = name
        self.magic = magic
        self._sniff = sniffer
        self.extension = extension

    def sniff(self, data: bytes | memoryview, head: bytes) -> ImageInfo:
        return self._sniff(head)


def _gif(head: bytes) -> ImageInfo:
    width, height = struct.unpack_from("<HH", head, 6)
    return ImageInfo("gif", width, height, 1)


JPEG, PNG, WEBP, RAW, OTHER = Jpeg(), Png(), Webp(), Raw(), Encoding()
#: Every encoding a record header may name, by name; others decode as ``OTHER``.
ENCODINGS: dict[str, Encoding] = {
    e.name: e
    for e in (
        JPEG,
        PNG,
        WEBP,
        RAW,
        _Named("bmp", (b"BM",), lambda head: _sniff_bmp(head), "bmp"),
        _Named("tiff", (b"II*\x00", b"MM\x00*"), lambda head: ImageInfo("tiff", 0, 0, 0), "tiff"),
        _Named("gif", (b"GIF87a", b"GIF89a"), _gif, "gif"),
        _Named("pnm", (), lambda head: _sniff_pnm(head)),
        OTHER,
    )
}
_BY_MAGIC = [(m, e) for e in ENCODINGS.values() for m in e.magic]
_BY_ID: dict[int, Encoding] = {_ID_OF[name]: enc for name, enc in ENCODINGS.items()}
#: The encodings a pack-time resize may re-encode to (``Resize.format``, ``pack --format``).
RESIZE_FORMATS: tuple[str, ...] = tuple(e.name for e in ENCODINGS.values() if e.resize_target)
#: What a pack-time resize encodes to unless told otherwise.
DEFAULT_RESIZE_FORMAT: str = JPEG.name


def encoding_of(name: str) -> Encoding:
    """The ``Encoding`` a record header names (unknown names decode as an image file)."""
    return ENCODINGS.get(name, OTHER)


def encoding_by_id(encoding_id: int) -> Encoding | None:
    """The ``Encoding`` of a record header's encoding id, or None for an id the format
    does not define."""
    return _BY_ID.get(encoding_id)


def _recognise(head: bytes) -> Encoding | None:
    for magic, enc in _BY_MAGIC:
        if head.startswith(magic):
            return enc
    if WEBP.recognises(head):
        return WEBP
    if head[:1] == b"P" and head[1:2] in b"123456" and head[2:3].isspace():
        return ENCODINGS["pnm"]
    return None


def sniff(data: bytes | memoryview) -> ImageInfo:
    """Return the encoding and, where the header gives them, width, height, channels.

    ``channels`` counts the components as stored (1 for grey or palette
    images, 3 for RGB/YCbCr, 4 for RGBA or CMYK). Unknown or damaged input
    gives ``ImageInfo("other", 0, 0, 0)``; this function never raises.
    """
    head = bytes(data[:64])
    try:
        enc = _recognise(head)
        if enc is not None:
            return enc.sniff(data, head)
    except (struct.error, IndexError, ValueError):
        pass
    return _UNKNOWN


def truncation(data: bytes | memoryview, encoding: str, *, data_start: int | None = None) -> str | None:
    """Why the encoded JPEG or PNG ``data`` is cut short, or None if it has its end marker.

    A JPEG must hold an end-of-image marker (FFD9) after the header segments
    (an EXIF thumbnail carries its own, earlier one; entropy-coded data cannot
    contain FFD9, byte stuffing prevents it); a PNG must hold its IEND chunk.
    Data after the marker is allowed. For a whole file this looks at the last
    ``END_SEARCH_WINDOW`` bytes only; other encodings give None. ``data_start``:
    where a JPEG's scan data starts, when the caller has walked its header
    already (``vouch_jpeg``). Never raises.
    """
    try:
        return encoding_of(encoding).truncation(data, data_start)
    except (struct.error, IndexError, ValueError):
        return None


def clean_header(data: bytes | memoryview, info: ImageInfo) -> bool:
    """Whether the JPEG or PNG ``data`` has a header this parser can vouch for, as
    Pillow's open would: every marker segment (chunk) up to the image data well
    formed and of a kind Pillow opens without parsing further, the frame (IHDR)
    one Pillow decodes, and the size of ``info``.

    False means "not vouched for" (other formats, unusual segments, damage),
    never "bad": the writer then asks Pillow itself, so what is skipped, and
    why, stays Pillow's call. This is what makes the default header check cost
    a few microseconds per file instead of Pillow's tens. Never raises.
    """
    try:
        return encoding_of(info.encoding).clean_header(data, info)
    except (struct.error, IndexError, ValueError):
        return False


def vouch_jpeg(data: bytes | memoryview) -> tuple[ImageInfo, int] | None:
    """``sniff``, ``clean_header`` and the scan-data offset of ``truncation`` in one
    walk of the JPEG's marker segments: ``(info, data_start)`` when the header
    is one ``clean_header`` vouches for, else None (then ask the three
    separately). The writer's default check spent a third of its time
    walking the same segments three times. Never raises.
    """
    try:
        if bytes(data[:3]) != b"\xff\xd8\xff":
            return None
        return _walk_clean_jpeg(data, None)
    except (struct.error, IndexError, ValueError):
        return None


def raw_rgb(data: bytes | memoryview) -> tuple[bytes, int, int]:
    """Decode an encoded image to RGB bytes (height x width x 3) as the loader would."""
    with Image.open(io.BytesIO(data)) as img:
        rgb = img.convert("RGB")
    return rgb.tobytes(), rgb.width, rgb.height


def decode_rgb(payload: bytes | memoryview, encoding: str, width: int, height: int) -> Image.Image:
    """Return the RGB ``PIL.Image`` for a stored payload.

    Encoded images go through ``Image.open(...).convert("RGB")``, which is what
    ``torchvision.datasets.folder.pil_loader`` does, so grayscale, CMYK,
    palette and alpha images come out pixel-identical to ImageFolder. Raw
    payloads are copied into a new image, so the result never points into the
    memory map; their size is checked first (ValueError), because Pillow
    allocates ``width x height`` pixels before it notices short data.
    """
    return encoding_of(encoding).decode_rgb(payload, width, height)


# -- the parsers ----------------------------------------------------------------------
def _sniff_jpeg(data: bytes | memoryview) -> ImageInfo:
    # Walk the marker segments up to the first SOF; APPn/EXIF segments are skipped
    # by their length, so this touches a few hundred bytes of a typical JPEG.
    n = len(data)
    i = 2
    while i + 3 < n:
        if data[i] != 0xFF:
            return ImageInfo("jpeg", 0, 0, 0)
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in _JPEG_STANDALONE:
            i += 2
            continue
        if marker == 0xD9 or marker == 0xDA:  # end of image / start of scan before any SOF
            break
        (seglen,) = struct.unpack_from(">H", data, i + 2)
        if marker in _JPEG_SOF:
            height, width = struct.unpack_from(">HH", data, i + 5)
            return ImageInfo("jpeg", width, height, data[i + 9])
        i += 2 + seglen
    return ImageInfo("jpeg", 0, 0, 0)


def _holds_near_end(data: bytes | memoryview, needle: bytes, start: int) -> bool:
    # The end marker is almost always within the last bytes: look there first,
    # then (files with long trailers, and truncated files) at the rest.
    n = len(data)
    low = max(start, n - END_SEARCH_WINDOW)
    if needle in bytes(data[low:]):
        return True
    if low <= start:
        return False
    return needle in bytes(data[start : low + len(needle) - 1])


def _jpeg_data_start(data: bytes | memoryview) -> int:
    """Offset of the first scan's entropy-coded data (after the SOS header), or 2
    when the marker segments cannot be walked."""
    n = len(data)
    i = 2
    while i + 3 < n:
        if data[i] != 0xFF:
            return 2
        marker = data[i + 1]
        if marker == 0xFF:
            i += 1
            continue
        if marker in _JPEG_STANDALONE:
            i += 2
            continue
        if marker == 0xD9:
            return 2
        (seglen,) = struct.unpack_from(">H", data, i + 2)
        if marker == 0xDA:
            return min(n, i + 2 + seglen)
        i += 2 + seglen
    return 2


# -- the header check without Pillow -------------------------------------------------
# JPEG marker segments Pillow's JPEG plugin handles at open without surprises:
# APPn (but the MPF and Adobe blocks it parses further), COM, DQT, DHT, DRI.
_JPEG_PLAIN = frozenset({*range(0xE0, 0xF0), 0xFE, 0xC4, 0xDD})
#: (bit depth, colour type) pairs Pillow's PNG plugin opens (PngImagePlugin._MODES).
_PNG_MODES = frozenset(
    {
        (1, 0),
        (2, 0),
        (4, 0),
        (8, 0),
        (16, 0),
        (8, 2),
        (16, 2),
        (1, 3),
        (2, 3),
        (4, 3),
        (8, 3),
        (8, 4),
        (16, 4),
        (8, 6),
        (16, 6),
    }
)
#: PNG chunks before IDAT that Pillow only stores (or checks trivially) at open.
_PNG_PLAIN = frozenset({b"PLTE", b"gAMA", b"cHRM", b"sRGB", b"pHYs", b"tEXt", b"tIME", b"bKGD", b"sBIT"})


def _walk_clean_jpeg(data: bytes | memoryview, info: ImageInfo | None) -> tuple[ImageInfo, int] | None:
    # With ``info``, the frame must have its size; without, the frame gives it.
    # A clean header has no standalone markers before the scan, so the first
    # SOF here is the one ``sniff`` finds and the scan starts where
    # ``_jpeg_data_start`` says.
    n = len(data)
    i = 2
    frame: ImageInfo | None = None
    while i + 3 < n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:
            i += 1
            continue
        (seglen,) = struct.unpack_from(">H", data, i + 2)
        if seglen < 2 or i + 2 + seglen > n:
            return None
        if marker == 0xDA:  # start of scan: Pillow stops reading the header here
            return (frame, i + 2 + seglen) if frame is not None and seglen >= 6 else None
        if marker in _JPEG_SOF:
            if frame is not None or marker not in (0xC0, 0xC1, 0xC2):  # one frame; baseline/extended/progressive
                return None
            precision, height, width, components = struct.unpack_from(">BHHB", data, i + 4)
            if precision != 8 or components not in (1, 3, 4) or seglen != 8 + 3 * components:
                return None
            frame = ImageInfo("jpeg", width, height, components)
            if (info is not None and frame != info) or not width or not height:
                return None
        elif marker == 0xDB:
            if not _clean_dqt(data, i + 4, i + 2 + seglen):
                return None
        elif marker not in _JPEG_PLAIN:
            return None
        elif marker == 0xE2 and bytes(data[i + 4 : i + 7]) == b"MP\x00":
            return None  # Pillow parses the MPF index at open
        elif marker == 0xEE and bytes(data[i + 4 : i + 9]) == b"Adobe":
            return None  # Pillow reads the Adobe transform flags
        elif marker == 0xE0 and bytes(data[i + 4 : i + 9]) == b"JFIF\x00" and seglen < 16:
            return None  # Pillow reads the version and density from it
        i += 2 + seglen
    return None


def _clean_dqt(data: bytes | memoryview, start: int, end: int) -> bool:
    i = start
    while i < end:
        precision = data[i] >> 4
        if precision > 1 or data[i] & 0x0F > 3:
            return False
        i += 1 + (128 if precision else 64)
    return i == end


def _clean_png(data: bytes | memoryview, info: ImageInfo) -> bool:
    import zlib

    n = len(data)
    i = 8
    first = True
    while i + 12 <= n:
        (length,) = struct.unpack_from(">I", data, i)
        kind = bytes(data[i + 4 : i + 8])
        if i + 12 + length > n:
            return False
        (crc,) = struct.unpack_from(">I", data, i + 8 + length)
        if zlib.crc32(data[i + 4 : i + 8 + length]) & 0xFFFFFFFF != crc:
            return False  # Pillow refuses a broken chunk ("broken PNG file")
        if first:
            if kind != b"IHDR" or length != 13:
                return False
            width, height, depth, colour, compression, filtering, interlace = struct.unpack_from(
                ">IIBBBBB", data, i + 8
            )
            if (depth, colour) not in _PNG_MODES or compression or filtering or interlace > 1:
                return False
            if (width, height) != (info.width, info.height) or not width or not height:
                return False
            first = False
        elif kind == b"IDAT":
            return True
        elif kind not in _PNG_PLAIN:
            return False
        i += 12 + length
    return False


def _sniff_webp(head: bytes) -> ImageInfo:
    chunk = head[12:16]
    if chunk == b"VP8 " and head[23:26] == b"\x9d\x01\x2a":
        width, height = struct.unpack_from("<HH", head, 26)
        return ImageInfo("webp", width & 0x3FFF, height & 0x3FFF, 3)
    if chunk == b"VP8L" and head[20] == 0x2F:
        (bits,) = struct.unpack_from("<I", head, 21)
        width = (bits & 0x3FFF) + 1
        height = ((bits >> 14) & 0x3FFF) + 1
        return ImageInfo("webp", width, height, 4 if bits >> 28 & 1 else 3)
    if chunk == b"VP8X":
        flags = head[20]
        width = int.from_bytes(head[24:27], "little") + 1
        height = int.from_bytes(head[27:30], "little") + 1
        return ImageInfo("webp", width, height, 4 if flags & 0x10 else 3)
    return ImageInfo("webp", 0, 0, 0)


def _sniff_bmp(head: bytes) -> ImageInfo:
    (dib_size,) = struct.unpack_from("<I", head, 14)
    if dib_size == 12:
        width, height, _, bpp = struct.unpack_from("<HHHH", head, 18)
    elif dib_size >= 40:
        width, height, _, bpp = struct.unpack_from("<iiHH", head, 18)
    else:
        return ImageInfo("bmp", 0, 0, 0)
    channels = {32: 4, 24: 3, 16: 3}.get(bpp, 1)
    return ImageInfo("bmp", abs(width), abs(height), channels)


def _sniff_pnm(head: bytes) -> ImageInfo:
    kind = head[1:2]
    tokens: list[bytes] = []
    for line in head[2:].split(b"\n"):
        line = line.split(b"#", 1)[0]
        tokens.extend(line.split())
        if len(tokens) >= 2:
            break
    channels = 3 if kind in (b"3", b"6") else 1
    if len(tokens) >= 2:
        return ImageInfo("pnm", int(tokens[0]), int(tokens[1]), channels)
    return ImageInfo("pnm", 0, 0, channels)

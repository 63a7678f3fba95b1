"""Identify encoded images cheaply, and turn stored payloads back into RGB images.

``sniff`` reads only the first bytes of a file (magic numbers and the header
fields that give the size) in pure Python: it never decodes pixels and never
raises, so the writer can record the format and shape of every image at
almost no cost. ``decode_rgb`` is the read side: it reproduces
torchvision's default loader (``Image.open(f).convert("RGB")``) exactly.
"""

from __future__ import annotations

import io
import struct
from typing import NamedTuple

from PIL import Image

__all__ = [
    "ImageInfo",
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


_UNKNOWN = ImageInfo("other", 0, 0, 0)
# SOFn markers that carry the frame size (not DHT=C4, JPG=C8, DAC=CC).
_JPEG_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_JPEG_STANDALONE = frozenset({0x01, 0xD8, *range(0xD0, 0xD8)})
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}


def sniff(data: bytes | memoryview) -> ImageInfo:
    """Return the encoding and, where the header gives them, width, height, channels.

    ``channels`` counts the components as stored (1 for grey or palette
    images, 3 for RGB/YCbCr, 4 for RGBA or CMYK). Unknown or damaged input
    gives ``ImageInfo("other", 0, 0, 0)``; this function never raises.
    """
    head = bytes(data[:64])
    try:
        if head[:3] == b"\xff\xd8\xff":
            return _sniff_jpeg(data)
        if head[:8] == b"\x89PNG\r\n\x1a\n":
            width, height = struct.unpack_from(">II", head, 16)
            return ImageInfo("png", width, height, _PNG_CHANNELS.get(head[25], 0))
        if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
            return _sniff_webp(head)
        if head[:2] == b"BM":
            return _sniff_bmp(head)
        if head[:4] in (b"II*\x00", b"MM\x00*"):
            return ImageInfo("tiff", 0, 0, 0)
        if head[:6] in (b"GIF87a", b"GIF89a"):
            width, height = struct.unpack_from("<HH", head, 6)
            return ImageInfo("gif", width, height, 1)
        if head[:1] == b"P" and head[1:2] in b"123456" and head[2:3].isspace():
            return _sniff_pnm(head)
    except (struct.error, IndexError, ValueError):
        pass
    return _UNKNOWN


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


#: How many bytes at the end of a file ``truncation`` looks at first. Real files
#: may carry data after their end marker (camera trailers, padding); the rest
#: of the file is searched only when the marker is not among these bytes.
END_SEARCH_WINDOW = 8192
_JPEG_EOI = b"\xff\xd9"
_PNG_IEND = b"IEND\xaeB`\x82"  # the chunk type and its (constant) CRC-32


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
        if encoding == "jpeg":
            start = _jpeg_data_start(data) if data_start is None else data_start
            if _holds_near_end(data, _JPEG_EOI, start):
                return None
            return "the JPEG has no end-of-image marker (FFD9) after its image data"
        if encoding == "png":
            if _holds_near_end(data, _PNG_IEND, 8):
                return None
            return "the PNG has no IEND chunk"
    except (struct.error, IndexError, ValueError):
        return None
    return None


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
        if info.encoding == "jpeg":
            return _clean_jpeg(data, info)
        if info.encoding == "png":
            return _clean_png(data, info)
    except (struct.error, IndexError, ValueError):
        return False
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


def _clean_jpeg(data: bytes | memoryview, info: ImageInfo) -> bool:
    return _walk_clean_jpeg(data, info) is not None


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
    if encoding == "raw":
        if width * height * 3 != len(payload):
            raise ValueError(f"raw pixels: {width}x{height}x3 is not the {len(payload):,} bytes stored")
        return Image.frombytes("RGB", (width, height), payload)
    img = Image.open(io.BytesIO(payload))
    return img.convert("RGB")

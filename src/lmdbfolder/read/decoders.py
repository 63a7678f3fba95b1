"""JPEG decoder registry: Pillow by default, faster libraries when installed.

Every decoder turns a stored JPEG payload into RGB pixels in the same
orientation as Pillow (EXIF orientation is ignored, as ImageFolder ignores
it), optionally at a reduced DCT scale (1/2, 1/4, 1/8: libjpeg scales while
it decodes, which skips most of the inverse DCT and colour conversion work).

=============  ==========================  =======================================
name           needs                       notes
=============  ==========================  =======================================
``pillow``     (core)                      default; exactly ImageFolder's loader
``simplejpeg`` ``pip install simplejpeg``  libjpeg-turbo, bundled in the wheel
``turbojpeg``  ``pip install PyTurboJPEG``  needs the system libturbojpeg
                                           (``apt-get install libturbojpeg0``)
``opencv``     ``opencv-python-headless``  decodes to RGB directly
``torchvision`` torchvision                ``torchvision.io.decode_jpeg``; no DCT
                                           scaling (always full size)
=============  ==========================  =======================================

``decoder="auto"`` (``LMDBFolder``'s default) picks the fastest installed
decoder whose pixels are identical to Pillow's: each candidate decodes a set
of probe JPEGs (4:2:0, 4:2:2, 4:4:4, greyscale, progressive, restart
markers, odd sizes) once per process and must match Pillow bit for bit, else
the next one is tried, down to Pillow itself. All of them wrap
libjpeg-turbo with the same IDCT and upsampling, so on a usual install the
fastest one passes; the check is what makes "the same pixels" a fact here
rather than an assumption. ``lmdbfolder.read.capabilities`` asks these
questions, once per process (``get_decoder``, ``resolve_decoder_name``).

Only baseline/progressive JPEGs with 1 or 3 components go to a fast decoder;
everything else (PNG, WebP, CMYK JPEGs, raw payloads, ...) goes through
Pillow, so the colour conversion of odd images stays ImageFolder's. The
optional libraries are imported when a decoder is first used, never by
``import lmdbfolder``. Fast decoders read the payload straight from the
LMDB memory map (no copy); Pillow reads it through ``io.BytesIO``.
"""

from __future__ import annotations

import io
import warnings
from typing import Callable, Union

import numpy as np
from PIL import Image

from lmdbfolder.encodings import encoding_of, sniff
from lmdbfolder.errors import DecoderUnavailableError

__all__ = [
    "DECODER_NAMES",
    "FAST_ORDER",
    "DCT_SCALES",
    "Decoder",
    "Decoded",
    "check_decoder_name",
    "make_decoder",
    "probe_jpegs",
    "decodes_like_pillow",
    "decode_payload",
    "scale_for_size",
    "size_hint_scale",
    "to_pil",
]

#: What a decoder returns: an HxWx3 uint8 RGB array, or an RGB PIL image.
Decoded = Union[np.ndarray, Image.Image]

#: The DCT scale denominators libjpeg decodes at cheaply.
DCT_SCALES = (1, 2, 4, 8)
#: Registered decoder names.
DECODER_NAMES = ("pillow", "simplejpeg", "turbojpeg", "opencv", "torchvision")
#: Preference order of ``decoder="auto"`` (fastest first, as measured on
#: ImageNet-like JPEGs; see docs/design.md).
FAST_ORDER = ("simplejpeg", "opencv", "turbojpeg", "torchvision", "pillow")

_INSTALL_HINTS = {
    "simplejpeg": "pip install simplejpeg",
    "turbojpeg": "pip install PyTurboJPEG, and install libturbojpeg (Debian/Ubuntu: apt-get install libturbojpeg0)",
    "opencv": "pip install opencv-python-headless",
    "torchvision": "pip install torchvision",
}


class Decoder:
    """A named JPEG decoder.

    ``decode_jpeg(payload, denom)`` returns RGB pixels of a 1- or
    3-component JPEG, scaled by ``1/denom`` (``denom`` in ``DCT_SCALES``;
    decoders without scaling support ignore it: check ``scales``).
    """

    def __init__(
        self,
        name: str,
        fn: Callable[[memoryview | bytes, int], Decoded],
        scales: tuple[int, ...],
        into: Callable[[memoryview | bytes, int, np.ndarray, tuple[int, int] | None], np.ndarray] | None = None,
    ) -> None:
        self.name = name
        self.scales = scales
        if name == "pillow":
            self.decode_jpeg = fn
            self._into = into
        else:
            # A JPEG the library refuses (libjpeg-turbo's strict mode stops at
            # damage that Pillow decodes past, with a warning; Pillow's
            # LOAD_TRUNCATED_IMAGES) goes to Pillow, so the outcome is always
            # ImageFolder's: the same pixels, or Pillow's error.
            self.decode_jpeg = _or_pillow(fn)
            self._into = None if into is None else _or_pillow_into(into)

    def decode_into(
        self, payload: memoryview | bytes, denom: int, buffer: np.ndarray, size: tuple[int, int] | None = None
    ) -> np.ndarray:
        """Decode into ``buffer`` (a flat uint8 array, reused between calls) when the
        library can; returns an HxWx3 array (a view of ``buffer``, or a new one).

        Reusing one buffer spares a fresh allocation, and its page faults, per
        image. ``size`` is the image's ``(width, height)`` when the caller knows
        it (the record header says), which spares parsing the JPEG header twice.
        """
        if self._into is not None:
            return self._into(payload, denom, buffer, size)
        return np.asarray(self.decode_jpeg(payload, denom))

    def __repr__(self) -> str:
        return f"Decoder({self.name!r}, scales={self.scales})"


def _or_pillow(fn: Callable[[memoryview | bytes, int], Decoded]) -> Callable[[memoryview | bytes, int], Decoded]:
    def decode(payload: memoryview | bytes, denom: int) -> Decoded:
        try:
            return fn(payload, denom)
        except Exception:  # libraries raise many exception types for bad data
            return _pillow_jpeg(payload, denom)

    return decode


def _or_pillow_into(
    fn: Callable[[memoryview | bytes, int, np.ndarray, tuple[int, int] | None], np.ndarray],
) -> Callable[[memoryview | bytes, int, np.ndarray, tuple[int, int] | None], np.ndarray]:
    def decode(payload: memoryview | bytes, denom: int, buffer: np.ndarray, size: tuple[int, int] | None) -> np.ndarray:
        try:
            return fn(payload, denom, buffer, size)
        except Exception:  # libraries raise many exception types for bad data
            return np.asarray(_pillow_jpeg(payload, denom))

    return decode


def _pillow_jpeg(payload: memoryview | bytes, denom: int) -> Image.Image:
    img = Image.open(io.BytesIO(payload))
    if denom > 1:
        # draft() picks the largest scale that keeps the image at least this big.
        width, height = img.size
        img.draft("RGB", (max(1, width // denom), max(1, height // denom)))
    return img.convert("RGB")


def _make_pillow() -> Decoder:
    return Decoder("pillow", _pillow_jpeg, DCT_SCALES)


def _make_simplejpeg() -> Decoder:
    import simplejpeg

    decode = simplejpeg.decode_jpeg

    header = simplejpeg.decode_jpeg_header

    def fn(payload: memoryview | bytes, denom: int) -> np.ndarray:
        if denom == 1:
            return decode(payload, "RGB")
        # simplejpeg picks the smallest of libjpeg's M/8 factors that gives at
        # least this size; asking for exactly ceil(size / denom) selects 1/denom.
        width, height = _jpeg_size(payload)
        return decode(payload, "RGB", min_width=-(-width // denom), min_height=-(-height // denom))

    def into(payload: memoryview | bytes, denom: int, buffer: np.ndarray, size: tuple[int, int] | None) -> np.ndarray:
        if size is None:
            height, width = header(payload)[:2]
        else:
            width, height = size
        need = 3 * -(-width // denom) * -(-height // denom)
        if buffer.size < need:
            return fn(payload, denom)  # an unusually large image: a buffer of its own
        if denom == 1:
            return decode(payload, "RGB", buffer=buffer)
        return decode(payload, "RGB", min_width=-(-width // denom), min_height=-(-height // denom), buffer=buffer)

    return Decoder("simplejpeg", fn, DCT_SCALES, into)


def _make_turbojpeg() -> Decoder:
    import turbojpeg

    try:
        tj = turbojpeg.TurboJPEG()
    except (OSError, RuntimeError) as exc:
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DecoderUnavailableError("turbojpeg", f"PyTurboJPEG cannot load libturbojpeg: {why}") from None
    rgb = turbojpeg.TJPF_RGB

    def fn(payload: memoryview | bytes, denom: int) -> np.ndarray:
        if denom == 1:
            return tj.decode(payload, pixel_format=rgb)
        return tj.decode(payload, pixel_format=rgb, scaling_factor=(1, denom))

    return Decoder("turbojpeg", fn, DCT_SCALES)


def _make_opencv() -> Decoder:
    import cv2

    base = cv2.IMREAD_IGNORE_ORIENTATION
    rgb_flag = getattr(cv2, "IMREAD_COLOR_RGB", None)  # OpenCV >= 4.10
    reduced = {2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4, 8: cv2.IMREAD_REDUCED_COLOR_8}
    if rgb_flag is not None:
        flags = {1: base | rgb_flag, **{d: base | rgb_flag | (f & ~cv2.IMREAD_COLOR) for d, f in reduced.items()}}
    else:
        flags = {1: base | cv2.IMREAD_COLOR, **{d: base | f for d, f in reduced.items()}}
    imdecode, frombuffer = cv2.imdecode, np.frombuffer

    def fn(payload: memoryview | bytes, denom: int) -> np.ndarray:
        out = imdecode(frombuffer(payload, np.uint8), flags[denom])
        if out is None:
            raise ValueError("OpenCV could not decode the JPEG")
        if rgb_flag is None:
            out = cv2.cvtColor(out, cv2.COLOR_BGR2RGB)
        return out

    return Decoder("opencv", fn, DCT_SCALES)


def _make_torchvision() -> Decoder:
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    def fn(payload: memoryview | bytes, denom: int) -> np.ndarray:
        with warnings.catch_warnings():
            # torch.frombuffer warns about read-only buffers (the LMDB map is
            # one; the decoder only reads it); torchvision >= 0.29 warns that
            # its decoders are deprecated in favour of torchcodec.
            warnings.simplefilter("ignore")
            chw = decode_jpeg(torch.frombuffer(payload, dtype=torch.uint8), mode=ImageReadMode.RGB)
        return chw.permute(1, 2, 0).numpy()

    return Decoder("torchvision", fn, (1,))


_FACTORIES: dict[str, Callable[[], Decoder]] = {
    "pillow": _make_pillow,
    "simplejpeg": _make_simplejpeg,
    "turbojpeg": _make_turbojpeg,
    "opencv": _make_opencv,
    "torchvision": _make_torchvision,
}


def check_decoder_name(name: str) -> str:
    """``name`` if it is ``"auto"`` or a registered decoder, else ValueError naming the choices."""
    if name != "auto" and name not in _FACTORIES:
        raise ValueError(f"unknown decoder {name!r}; choose one of {', '.join(DECODER_NAMES)} or 'auto'")
    return name


def make_decoder(name: str) -> Decoder:
    """A new ``Decoder`` for the registered ``name``; DecoderUnavailableError (with the
    install command as its hint) when its library is missing.

    This imports the library each time it is called: ask
    ``lmdbfolder.read.capabilities.get_decoder`` instead, which makes each decoder
    once per process.
    """
    try:
        return _FACTORIES[check_decoder_name(name)]()
    except ImportError as exc:
        raise DecoderUnavailableError(name, f"{exc}", _INSTALL_HINTS.get(name)) from None


def probe_jpegs() -> list[tuple[bytes, np.ndarray]]:
    """Small JPEGs of every common kind and Pillow's RGB pixels of each: 4:2:0 at an
    odd size, 4:4:4, 4:2:2, progressive, restart markers, greyscale.

    Made anew at each call (they cost a few milliseconds):
    ``Capabilities.probe_jpegs`` keeps one set per process.
    """
    out: list[tuple[bytes, np.ndarray]] = []
    rng = np.random.default_rng(20261201)
    yy, xx = np.mgrid[0:45, 0:61]
    # A smooth gradient plus noise: chroma detail that upsampling has to get right.
    base = np.stack([xx * 4, yy * 5, (xx + yy) * 2], axis=-1) + rng.integers(0, 60, (45, 61, 3))
    rgb = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    cases = [
        (rgb, {"quality": 90}),  # 4:2:0, odd size
        (rgb, {"quality": 95, "subsampling": 0}),  # 4:4:4
        (rgb, {"quality": 85, "subsampling": 1}),  # 4:2:2
        (rgb, {"quality": 80, "progressive": True}),
        (rgb.crop((0, 0, 33, 17)), {"quality": 75, "restart_marker_blocks": 1}),
        (rgb.convert("L"), {"quality": 90}),
    ]
    for img, options in cases:
        buf = io.BytesIO()
        img.save(buf, "JPEG", **options)
        data = buf.getvalue()
        out.append((data, np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))))
    return out


def decodes_like_pillow(decoder: Decoder, probes: list[tuple[bytes, np.ndarray]]) -> bool:
    """Whether ``decoder`` gives exactly Pillow's RGB pixels on every probe JPEG."""
    try:
        return all(np.array_equal(np.asarray(decoder.decode_jpeg(data, 1)), expected) for data, expected in probes)
    except Exception:  # a decoder that fails on a valid JPEG does not match either
        return False


def scale_for_size(width: int, height: int, need_width: int, need_height: int, scales: tuple[int, ...]) -> int:
    """The largest denominator in ``scales`` whose DCT-scaled image is still
    at least ``need_width`` x ``need_height`` (1 when the size is unknown).

    libjpeg's scaled size is ``ceil(size / denom)``.
    """
    if width <= 0 or height <= 0:
        return 1
    best = 1
    for denom in scales:
        if denom > best and -(-width // denom) >= need_width and -(-height // denom) >= need_height:
            best = denom
    return best


def _jpeg_size(payload: memoryview | bytes) -> tuple[int, int]:
    info = sniff(payload)
    return info.width, info.height


def decode_payload(
    payload: memoryview | bytes,
    encoding: str,
    width: int,
    height: int,
    channels: int,
    decoder: Decoder,
    *,
    denom: int = 1,
) -> Decoded:
    """Decode one stored payload to RGB, with ``decoder`` where it applies.

    JPEGs with 1 or 3 components go to ``decoder`` (at ``1/denom`` scale
    when it supports that); raw payloads become an array view; every other
    image goes through Pillow's ``convert("RGB")``, exactly like ImageFolder
    (``lmdbfolder.encodings``: what each encoding does).
    """
    return encoding_of(encoding).pixels(payload, width, height, channels, decoder, denom, None)


def to_pil(pixels: Decoded) -> Image.Image:
    """An RGB ``PIL.Image`` for decoded pixels (arrays are copied into a new image)."""
    if isinstance(pixels, Image.Image):
        return pixels
    if not pixels.flags.c_contiguous:
        pixels = np.ascontiguousarray(pixels)
    return Image.fromarray(pixels, "RGB")


def size_hint_scale(width: int, height: int, size_hint: int, scales: tuple[int, ...]) -> int:
    """Denominator that keeps the shorter side of the decoded image at least ``size_hint`` pixels."""
    if size_hint <= 0:
        return 1
    return scale_for_size(
        width, height, size_hint if width <= height else 1, size_hint if height < width else 1, scales
    )

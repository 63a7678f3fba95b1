"""The read plan: how a record's bytes become pixels, decided once, executed by one piece of code.

Every way ``LMDBFolder`` turns a stored image into a training sample — one
sample (``__getitem__``), a whole batch (``__getitems__``), the fused
``RandomResizedCrop`` with PIL or tensor output, the GPU path's CPU fallback —
goes through a ``ReadPlan``. Its decisions are made when it is built, from one
capabilities snapshot (``lmdbfolder.read.capabilities``), once per dataset,
transform and process:

* the JPEG decoder (``decoder="auto"``: the fastest that gives Pillow's pixels);
* whether crops are decoded by region (the compiled helper, where it
  reproduces Pillow here, and never for the ``pillow`` decoder);
* the resize: Pillow's bilinear arithmetic in the compiled module (with the
  installed Pillow's pass order) where it applies, else Pillow; OpenCV for
  ``resize="opencv"``; the compiled bilinear of ``resize="native"``;
* the output: the crop size, and at each ``run`` whether the batch is planar
  (``N x 3 x H x W``, the tensors' layout) or ``N x H x W x 3`` (a PIL image's).

What stays per image is only what the image itself decides: its encoding
(``lmdbfolder.encodings``: each encoding owns its decode and region decode), its
crop box and flip (drawn by the caller, with torchvision's random numbers), and
whether a damaged file has to be decoded whole.

The payload is the truth, the record header a claim (a pack may have been
written by anyone, with valid checksums): ``claim`` holds the header's size and
components against the payload's own header, and Pillow's decompression-bomb
limits against the payload's size, before the caller draws a crop box from the
size or anything is allocated for it; ``image`` and ``pixels`` ask it
themselves; and every decode checks the decoded size against the claim again
(``Encoding.expect``; the region decoder holds libjpeg's size to it). A header
that lies raises ``encodings.PayloadMismatch``, which the dataset reports naming
the record. A record's bytes pass through ``run`` like this::

    claim (header vs payload header, bomb limits)  -> the caller draws the box
    CropJob (payload view, encoding, header size, box, DCT scale, flip)
      -> encoding.region   (rows of the box only; the compiled helper)
         or encoding.pixels (the whole image: decoder, raw view, or Pillow)
      -> resize            (exact compiled / Pillow / OpenCV; mirrored for the flip)
      -> out[k]            (planes of the batch array, or H x W x 3)

``run`` with ``threads > 1`` splits a batch over a thread pool: the decoders,
the compiled helper and OpenCV release the GIL. With ``resize="native"`` a
batch's JPEGs are made in C instead (``start`` -> ``NativeRun``: decode, resize,
flip and planes in one call per image, on threads of the batch's own that
never hold the GIL), and only the other images take the thread pool.
"""

from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import numpy as np
from PIL import Image

from lmdbfolder.encodings import Encoding, check_bomb, encoding_of
from lmdbfolder.read import crops
from lmdbfolder.read.capabilities import Capabilities, current
from lmdbfolder.read.crops import (
    Box,
    crop_scale,
    native_resize_into,
    opencv_resize_into,
    resize_region,
    scaled_box,
    thread_buffer,
)
from lmdbfolder.read.decoders import Decoder, size_hint_scale, to_pil

__all__ = ["CropSpec", "CropJob", "BatchItemError", "ReadPlan", "NativeRun"]


@dataclass(frozen=True)
class CropSpec:
    """The crop a plan makes: output ``size`` = ``(height, width)``, the resize
    backend (``"pil"`` or ``"opencv"``), Pillow's resampling constant, and whether
    JPEGs may be decoded at a reduced DCT scale (``reduce``)."""

    size: tuple[int, int]
    resize: str = "pil"
    resample: int = Image.Resampling.BILINEAR
    reduce: bool = False


class CropJob(NamedTuple):
    """One image of a batch: the stored payload, its encoding and header fields, the
    crop box in full-size pixels ``(top, left, height, width)``, the DCT scale to
    decode at, and whether to flip it horizontally. (A tuple: one is made per image.)"""

    payload: memoryview | bytes
    encoding: Encoding
    width: int
    height: int
    channels: int
    box: Box
    denom: int
    flip: bool


class BatchItemError(Exception):
    """Image ``position`` of the batch could not be made (the cause is chained)."""

    def __init__(self, position: int, cause: BaseException) -> None:
        super().__init__(f"batch item {position}: {type(cause).__name__}: {cause}")
        self.position = position
        self.cause = cause


class ReadPlan:
    """How records are decoded (and cropped) in this process, decided at construction.

    Args:
        decoder: the resolved JPEG decoder.
        crop: the crop to make (None: whole images only, ``image``).
        size_hint: decode whole JPEGs at the smallest DCT scale that keeps the
            shorter side at least this many pixels (``image``).
        threads: threads that share one ``run``.
        caps: the capabilities to decide from (default: this process's).

    Holds a thread pool and per-thread scratch buffers, made lazily in the
    process that uses them; never pickled (build a plan in each process).
    """

    def __init__(
        self,
        decoder: Decoder,
        *,
        crop: CropSpec | None = None,
        size_hint: int | None = None,
        threads: int = 1,
        caps: Capabilities | None = None,
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        caps = current() if caps is None else caps
        self.decoder = decoder
        self.crop = crop
        self.size_hint = size_hint
        self.threads = threads
        #: The compiled region decoder, or None: crops are decoded whole.
        self.regions = None if decoder.name == "pillow" else caps.region_decoder()
        exact = None
        self.cv2: Any = None
        #: The compiled module for ``resize="native"`` (its resize and ``Batch``), or None.
        self.native: Any = None
        if crop is not None:
            if crop.resample == Image.Resampling.BILINEAR:
                exact = caps.exact_resize()
            if crop.resize == "opencv":
                self.cv2 = caps.cv2()
                if self.cv2 is None:
                    raise ImportError("resize='opencv' needs OpenCV: pip install opencv-python-headless")
            elif crop.resize == "native":
                self.native = caps.native_resize()
                if self.native is None:
                    raise ImportError(crops.NATIVE_MISSING)
            elif exact is None:
                self.cv2 = caps.cv2()  # for flips and planes only: a numpy copy without it
        #: ``(compiled resize, Pillow's pass order)``, or None: Pillow resizes.
        self.exact = exact
        # The images the crop resizes itself go to OpenCV with resize="opencv"; the
        # others are resized as torchvision's own transform does, by Pillow's arithmetic.
        backend = crop.resize if crop is not None else "pil"
        self._resize_fusable = {"opencv": self._opencv, "native": self._native}.get(backend, self._pillow)
        self._pid = os.getpid()
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a ReadPlan holds this process's libraries and threads: build one in each process")

    # -- planning a crop -----------------------------------------------------------------------
    @staticmethod
    def claim(payload: memoryview | bytes, encoding: str, width: int, height: int, channels: int) -> Encoding:
        """The record's ``Encoding``, once its header's claim is found true of the payload
        (``Encoding.check``): call it before drawing a crop box from ``width`` x ``height``.

        Raises ``encodings.PayloadMismatch`` for a header the payload contradicts,
        ``PIL.Image.DecompressionBombError`` above Pillow's limit (and warns as
        Pillow does between the limit and twice it), and what Pillow raises for a
        file it cannot open, where its open is asked; nothing is decoded.
        """
        enc = encoding_of(encoding)
        enc.check(payload, width, height, channels)
        return enc

    def job(
        self,
        payload: memoryview | bytes,
        encoding: Encoding | str,
        width: int,
        height: int,
        channels: int,
        box: Box,
        flip: bool,
    ) -> CropJob:
        """The job for one stored image and its crop ``box`` (``encoding``: what ``claim``
        returned, before the box was drawn): the DCT scale it is decoded at is chosen
        here (the largest that keeps the crop at least the output's size, with ``reduce``)."""
        enc = encoding if isinstance(encoding, Encoding) else encoding_of(encoding)
        denom = 1
        crop = self.crop
        if crop is not None and crop.reduce:
            denom = crop_scale(box[2], box[3], crop.size[0], crop.size[1], enc.scales(channels, self.decoder))
        return CropJob(payload, enc, width, height, channels, box, denom, flip)

    # -- the executor -------------------------------------------------------------------------------
    def run(self, jobs: Sequence[CropJob], out: np.ndarray, *, planar: bool = True) -> None:
        """Make image ``k`` of ``jobs`` into ``out[k]``: ``N x 3 x H x W`` uint8 with
        ``planar``, else ``N x H x W x 3`` (C-contiguous; ``H x W`` the crop's size).

        Raises BatchItemError naming the first image that failed; nothing is
        written into ``out`` after it returns (every thread has finished).
        """
        n = len(jobs)
        if n != len(out):
            raise ValueError(f"{n} jobs for an output of {len(out)} images")
        if self.crop is None:
            raise ValueError("this plan makes no crop (crop=None)")
        started = self.start(out) if planar and n else None
        if started is not None:
            for k, job in enumerate(jobs):
                started.add(k, job)
            started.finish(jobs)
            return
        self._run(jobs, out, range(n), planar)

    def start(self, out: np.ndarray) -> NativeRun | None:
        """With ``resize="native"`` (and the region decoder): a run into the planar batch
        ``out`` whose threads start now, so the caller can ``add`` each job as soon as it
        has made it and ``finish`` when all are added (``run``'s result, for jobs made
        over time); else None."""
        if self.native is None or self.regions is None or not len(out):
            return None
        return NativeRun(self, out)

    def _run(self, jobs: Sequence[CropJob], out: np.ndarray, which: Sequence[int], planar: bool) -> None:
        """Make images ``which`` (in order) of ``jobs`` the Python way, on the plan's threads."""
        n = len(which)
        workers = min(self.threads, n)
        if workers <= 1:
            self._chunk(jobs, out, which, planar)
            return
        # Images taken one at a time by whichever thread is free, not one fixed share per
        # thread: a crop's cost varies several-fold with its size, and fixed halves left
        # one thread waiting for the other at the end of every batch (a claim costs ~1 us).
        claims = itertools.count()
        pool = self._get_pool()
        futures = [pool.submit(self._claim, jobs, out, which, claims, planar) for _ in range(1, workers)]
        error: BaseException | None = None
        try:
            self._claim(jobs, out, which, claims, planar)
        except BatchItemError as exc:
            error = exc
        finally:
            # Every thread has finished before this returns or raises, even on an interrupt
            # (Ctrl-C here): ``out`` is a reused batch buffer, never written after.
            failures = [future.exception() for future in futures]
        for failed in failures:
            if failed is not None and (error is None or getattr(failed, "position", n) < getattr(error, "position", n)):
                error = failed
        if error is not None:
            raise error

    def _get_pool(self) -> ThreadPoolExecutor:
        if os.getpid() != self._pid or self._pool is None:
            # A forked child inherits the object but not the parent's threads.
            self._pid = os.getpid()
            self._local = threading.local()
            self._pool = ThreadPoolExecutor(max_workers=self.threads - 1, thread_name_prefix="lmdbfolder-batch")
        return self._pool

    def _claim(self, jobs: Sequence[CropJob], out: np.ndarray, which: Sequence[int], claims: Any, planar: bool) -> None:
        # The next image until none is left (``next`` on a count is atomic). Every image
        # is made even after an error elsewhere, so the error raised is the first
        # image's that fails, as with one thread.
        n, local, one = len(which), self._local, self._one
        error: BatchItemError | None = None
        for at in claims:
            if at >= n:
                break
            k = which[at]
            try:
                one(jobs[k], out[k], local, planar)
            except Exception as exc:  # decoders raise many exception types for bad data
                if error is None:
                    error = BatchItemError(k, exc)
                    error.__cause__ = exc
        if error is not None:
            raise error

    def _chunk(self, jobs: Sequence[CropJob], out: np.ndarray, which: Sequence[int], planar: bool) -> None:
        local = self._local
        one = self._one
        for k in which:
            try:
                one(jobs[k], out[k], local, planar)
            except Exception as exc:  # decoders raise many exception types for bad data
                raise BatchItemError(k, exc) from exc

    def _one(self, job: CropJob, dst: np.ndarray, local: threading.local, planar: bool) -> None:
        enc = job.encoding
        box: tuple[float, float, float, float]
        if enc.fusable(job.channels):
            region = None
            if self.regions is not None and job.denom == 1:
                need = 3 * job.width * job.box[2]
                region = enc.region(
                    job.payload,
                    job.box,
                    job.width,
                    job.channels,
                    self.regions,
                    thread_buffer(local, "region", need),
                    job.height,
                )
            if region is not None:
                pixels, box = region
            else:
                pixels = self._decode(job, local)
                box = scaled_box(job.box, (job.width, job.height), (pixels.shape[1], pixels.shape[0]))
            self._resize_fusable(pixels, box, dst, job.flip, local, planar)
            return
        else:
            # Kinds the fused crop leaves to torchvision's own transform: the whole
            # image in ImageFolder's conversion (its size checked against the claim the
            # box was drawn from), cropped and resized as Pillow does.
            pixels = enc.expect(np.asarray(enc.decode_rgb(job.payload, job.width, job.height)), job.width, job.height)
            top, left, height, width = job.box
            box = (left, top, left + width, top + height)
        self._pillow(pixels, box, dst, job.flip, local, planar)

    def _decode(self, job: CropJob, local: threading.local) -> np.ndarray:
        buf = thread_buffer(local, "buf", 3 * job.width * job.height)
        return job.encoding.pixels(job.payload, job.width, job.height, job.channels, self.decoder, job.denom, buf)

    def _pillow(
        self,
        pixels: np.ndarray,
        box: tuple[float, float, float, float],
        dst: np.ndarray,
        flip: bool,
        local: threading.local,
        planar: bool,
    ) -> None:
        out_h, out_w = self.crop.size  # type: ignore[union-attr]
        if self.exact is not None:
            fn, order = self.exact
            if crops.exact_resize_into(fn, order, pixels, box, (out_w, out_h), dst, planar=planar, flip=flip):
                return  # Pillow's resize, exactly, straight into the output
        img = resize_region(pixels, box, (out_w, out_h), resample=self.crop.resample)  # type: ignore[union-attr]
        arr = np.frombuffer(img.tobytes(), np.uint8).reshape(out_h, out_w, 3)
        # torchvision flips a PIL image with a transpose: the same pixels as a mirrored array
        self._place(arr[:, ::-1] if flip else arr, dst, planar, local)

    def _opencv(
        self,
        pixels: np.ndarray,
        box: tuple[float, float, float, float],
        dst: np.ndarray,
        flip: bool,
        local: threading.local,
        planar: bool,
    ) -> None:
        out_h, out_w = self.crop.size  # type: ignore[union-attr]
        cv2 = self.cv2
        if not planar:
            opencv_resize_into(cv2, pixels, box, (out_w, out_h), dst)
            if flip:
                cv2.flip(dst, 1, dst=dst)
            return
        work = getattr(local, "work", None)
        if work is None or work.shape[:2] != (out_h, out_w):
            work = local.work = np.empty((out_h, out_w, 3), np.uint8)
        opencv_resize_into(cv2, pixels, box, (out_w, out_h), work)
        if flip:
            cv2.flip(work, 1, dst=work)
        cv2.split(work, [dst[0], dst[1], dst[2]])  # in place, ~6x faster than a transposing copy

    def _native(
        self,
        pixels: np.ndarray,
        box: tuple[float, float, float, float],
        dst: np.ndarray,
        flip: bool,
        local: threading.local,
        planar: bool,
    ) -> None:
        out_h, out_w = self.crop.size  # type: ignore[union-attr]
        work = None
        if not planar:
            work = getattr(local, "native_work", None)
            if work is None or work.shape != (3, out_h, out_w):
                work = local.native_work = np.empty((3, out_h, out_w), np.uint8)
        native_resize_into(
            self.native.resize_native, pixels, box, (out_w, out_h), dst, planar=planar, flip=flip, work=work
        )

    def _place(self, hwc: np.ndarray, dst: np.ndarray, planar: bool, local: threading.local) -> None:
        """Copy an ``H x W x 3`` image (possibly a mirrored view) into ``dst``."""
        if not planar:
            np.copyto(dst, hwc)
            return
        cv2 = self.cv2
        if cv2 is None:
            np.copyto(dst, hwc.transpose(2, 0, 1))
            return
        if not hwc.flags.c_contiguous:
            work = getattr(local, "work", None)
            if work is None or work.shape != hwc.shape:
                work = local.work = np.empty(hwc.shape, np.uint8)
            np.copyto(work, hwc)
            hwc = work
        cv2.split(hwc, [dst[0], dst[1], dst[2]])

    def map(self, fn: Any, items: Sequence[Any]) -> list[Any]:
        """``[fn(item) for item in items]``, shared by the plan's threads (``fn`` should
        release the GIL for most of its time: decoders, Pillow, the compiled helpers do).
        Raises BatchItemError naming the first item that failed, once every thread has
        finished."""
        n = len(items)
        out: list[Any] = [None] * n
        errors: dict[int, BaseException] = {}
        claims = itertools.count()

        def work() -> None:
            for k in claims:
                if k >= n:
                    return
                try:
                    out[k] = fn(items[k])
                except Exception as exc:  # decoders raise many exception types for bad data
                    errors[k] = exc

        workers = min(self.threads, n)
        if workers <= 1:
            work()
        else:
            pool = self._get_pool()
            futures = [pool.submit(work) for _ in range(1, workers)]
            try:
                work()
            finally:
                for future in futures:  # every thread has finished before this returns or raises
                    future.exception()
        if errors:
            first = min(errors)
            raise BatchItemError(first, errors[first]) from errors[first]
        return out

    def covering(
        self, payload: memoryview | bytes, enc: Encoding, width: int, height: int, channels: int, box: Box
    ) -> tuple[np.ndarray, int, int]:
        """The pixels that hold ``box`` (``top, left, height, width`` in full-size pixels)
        of a claimed record (``enc``: what ``claim`` returned): ``(pixels, top, left)``,
        ``pixels`` an ``H x W x 3`` uint8 array whose first pixel is the full image's
        pixel (``top``, ``left``). Only the box's rows are decoded where the region
        decoder takes the record (the multi-crop's one decode for all its views), else
        the whole image (at full scale). The array may be this thread's scratch buffer:
        use it before the thread's next call."""
        local = self._local
        if self.regions is not None and enc.fusable(channels):
            region = enc.region(
                payload, box, width, channels, self.regions, thread_buffer(local, "region", 3 * width * box[2]), height
            )
            if region is not None:
                pixels, inner = region
                return pixels, box[0], box[1] - inner[0]
        if enc.fusable(channels):
            buf = thread_buffer(local, "buf", 3 * width * height)
            return enc.pixels(payload, width, height, channels, self.decoder, 1, buf), 0, 0
        return enc.expect(np.asarray(enc.decode_rgb(payload, width, height)), width, height), 0, 0

    # -- whole images ---------------------------------------------------------------------------
    def pixels(
        self, payload: memoryview | bytes, encoding: str, width: int, height: int, channels: int, denom: int = 1
    ) -> np.ndarray:
        """The whole image as ``H x W x 3`` uint8 RGB (a new array, or a view of the
        map for raw records): the decoder for the JPEGs it takes, at ``1/denom``
        scale; ImageFolder's conversion (Pillow) for every other image. The header
        is checked first (``claim``)."""
        enc = self.claim(payload, encoding, width, height, channels)
        return enc.pixels(payload, width, height, channels, self.decoder, denom, None)

    def image(self, payload: memoryview | bytes, encoding: str, width: int, height: int, channels: int) -> Image.Image:
        """The whole image as an RGB ``PIL.Image``, as ImageFolder's loader gives it
        (with the ``pillow`` decoder: exactly its ``Image.open(f).convert("RGB")``;
        with ``size_hint``: decoded at a reduced DCT scale). The header is checked
        first (``claim``), so an image is never sized from a claim its payload denies."""
        enc = self.claim(payload, encoding, width, height, channels)
        if self.size_hint is None and self.decoder.name == "pillow":
            return enc.expect(enc.decode_rgb(payload, width, height), width, height)
        denom = 1
        if self.size_hint is not None:
            denom = size_hint_scale(width, height, self.size_hint, enc.scales(channels, self.decoder))
        return to_pil(enc.pixels(payload, width, height, channels, self.decoder, denom, None))

    def describe(self) -> dict[str, Any]:
        """What was decided, for ``repr`` and troubleshooting."""
        resize = "none"
        if self.crop is not None:
            resize = self.crop.resize if self.crop.resize != "pil" else ("exact" if self.exact else "pillow")
        return {
            "decoder": self.decoder.name,
            "regions": self.regions is not None,
            "resize": resize,
            "threads": self.threads,
        }


#: The most threads one ``_crops.Batch`` takes (it refuses more): a dataset's ``threads``
#: may be larger (it also sizes the Python pool), so a native batch is capped here.
NATIVE_MAX_THREADS = 256


class NativeRun:
    """One batch of ``resize="native"`` (``ReadPlan.start``): every JPEG the region decoder
    takes is made in C by the batch's own threads, none holding the GIL
    (``_crops.Batch``), from the moment it is added; the others (other kinds, DCT-scaled,
    cut short, or what libjpeg warned about) are made the usual way by ``finish``."""

    def __init__(self, plan: ReadPlan, out: np.ndarray) -> None:
        out_h, out_w = plan.crop.size  # type: ignore[union-attr]
        self.plan = plan
        self.out = out
        self.batch = plan.native.Batch(out, out_h, out_w, len(out), min(plan.threads, len(out), NATIVE_MAX_THREADS))
        self.rest: list[int] = []

    def add(self, k: int, job: CropJob) -> None:
        """Queue image ``k`` (its slot of ``out``): a thread of the batch may start on it at once."""
        enc = job.encoding
        if job.denom == 1 and enc.regionable(job.payload, job.channels):
            top, left, height, width = job.box
            check_bomb(job.width, job.height)  # Pillow's warning, as the other paths give it
            self.batch.add(k, job.payload, left, top, width, height, job.width, job.height, job.flip)
        else:
            self.rest.append(k)

    def close(self) -> None:
        """End the batch's threads (what was added is made) without making the rest: for
        a caller that stops with an error of its own."""
        self.batch.finish()

    def finish(self, jobs: Sequence[CropJob]) -> None:
        """Wait for the batch's threads (this one joins them), then make what they did not
        take; raises BatchItemError naming the first image that failed, as ``run``."""
        failed = self.batch.finish()
        rest = sorted(self.rest + [k for k, _ in failed]) if failed else self.rest
        if rest:
            self.plan._run(jobs, self.out, rest, True)

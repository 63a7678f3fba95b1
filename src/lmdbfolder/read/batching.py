"""Decode, crop, resize and flip a whole batch into one preallocated array.

The batch fast path of ``LMDBFolder`` (``lmdbfolder.torch``): once the crop
boxes and flips of a batch are planned (with torchvision's random numbers, in
``lmdbfolder.fused``), every image is decoded, resized and flipped in a
per-thread buffer and split into its slot of one ``N x 3 x H x W`` uint8
array (contiguous, as the per-sample tensors are). Nothing per sample is
allocated (decoders that can decode into a reused buffer, simplejpeg's, get
one per thread), no tensor is made per sample, and the DataLoader's collate
step has nothing left to copy.

The expensive calls (libjpeg-turbo's decode, OpenCV's resize and flip)
release the GIL, so ``threads > 1`` decodes one batch on several cores from
one process: FFCV's model, with no per-batch transfer between processes.
Only the Python glue between those calls (a few microseconds per image)
runs one thread at a time.
"""

from __future__ import annotations

import io
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, Sequence

import numpy as np
from PIL import Image

from lmdbfolder.read.crops import (
    Box,
    fusable,
    opencv_resize_into,
    resize_exact_into,
    resize_region,
    scaled_box,
    thread_buffer,
)
from lmdbfolder.read.decoders import Decoder
from lmdbfolder.read.regions import decode_crop

__all__ = ["CropJob", "BatchItemError", "BatchDecoder"]


class CropJob(NamedTuple):
    """One image of a batch: the stored payload and its header fields, the crop box
    in full-size pixels ``(top, left, height, width)``, the DCT scale to decode at,
    and whether to flip it horizontally. (A tuple: one is made per image.)"""

    payload: memoryview | bytes
    encoding: str
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


class BatchDecoder:
    """Makes batches with one decoder, a resize backend and ``threads`` threads.

    Holds a thread pool and per-thread scratch buffers, created lazily in the
    process that uses it (a forked child makes its own); never pickled.
    """

    def __init__(self, decoder: Decoder, *, threads: int = 1, resize: str = "opencv", resample: int = 2) -> None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.decoder = decoder
        self.threads = threads
        self.resize = resize
        self.resample = resample
        self._pid = os.getpid()
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()

    def run(self, jobs: Sequence[CropJob], out: np.ndarray) -> None:
        """Fill ``out[k]`` (``N x 3 x H x W`` uint8, C-contiguous) with image ``k``.

        Raises BatchItemError naming the first image that failed.
        """
        n = len(jobs)
        if n != len(out):
            raise ValueError(f"{n} jobs for an output of {len(out)} images")
        workers = min(self.threads, n)
        if workers <= 1:
            self._chunk(jobs, out, 0, n)
            return
        bounds = [n * k // workers for k in range(workers + 1)]
        pool = self._get_pool()
        futures = [pool.submit(self._chunk, jobs, out, bounds[k], bounds[k + 1]) for k in range(1, workers)]
        error: BaseException | None = None
        try:
            self._chunk(jobs, out, bounds[0], bounds[1])
        except BatchItemError as exc:
            error = exc
        for future in futures:  # wait for every chunk: ``out`` must not be written after we return
            failed = future.exception()
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

    def _work(self, height: int, width: int) -> np.ndarray:
        """This thread's ``height x width x 3`` buffer for one resized image."""
        work = getattr(self._local, "work", None)
        if work is None or work.shape[:2] != (height, width):
            work = self._local.work = np.empty((height, width, 3), np.uint8)
        return work

    def _chunk(self, jobs: Sequence[CropJob], out: np.ndarray, lo: int, hi: int) -> None:
        for k in range(lo, hi):
            try:
                self._one(jobs[k], out[k])
            except Exception as exc:  # decoders raise many exception types for bad data
                raise BatchItemError(k, exc) from exc

    def _one(self, job: CropJob, dst: np.ndarray) -> None:
        box: tuple[float, float, float, float]
        region = decode_crop(job.payload, job.encoding, job.channels, job.box, job.width, job.denom, self.decoder.name)
        if region is not None:
            pixels, box = region
        else:
            pixels = self._decode(job)
            box = scaled_box(job.box, (job.width, job.height), (pixels.shape[1], pixels.shape[0]))
        height, width = dst.shape[1], dst.shape[2]
        work = self._work(height, width)
        # Images the fused crop leaves to torchvision's own transform (not
        # ``fusable``) are resized by Pillow, as that transform does.
        if self.resize == "opencv" and fusable(job.encoding, job.channels):
            opencv_resize_into(pixels, box, (width, height), work)
            if job.flip:
                _flip_in_place(work)
        elif self.resample == Image.Resampling.BILINEAR and resize_exact_into(
            pixels, box, (width, height), dst, planar=True, flip=job.flip
        ):
            return  # Pillow's resize, exactly, straight into the batch's planes
        else:
            img = resize_region(pixels, box, (width, height), resample=self.resample, backend="pil")
            arr = np.frombuffer(img.tobytes(), np.uint8).reshape(height, width, 3)
            if not job.flip:
                _to_planes(arr, dst)
                return
            # torchvision flips a PIL image with a transpose: the same pixels as a mirrored array
            _flip_into(arr, work)
        _to_planes(work, dst)

    def _decode(self, job: CropJob) -> np.ndarray:
        if job.encoding == "jpeg" and job.channels in (1, 3):
            denom = job.denom if job.denom in self.decoder.scales else 1
            buf = thread_buffer(self._local, "buf", 3 * job.width * job.height)
            return self.decoder.decode_into(job.payload, denom, buf, (job.width, job.height))
        if job.encoding == "raw":
            return np.frombuffer(job.payload, np.uint8).reshape(job.height, job.width, 3)
        with Image.open(io.BytesIO(job.payload)) as img:
            return np.asarray(img.convert("RGB"))  # exactly ImageFolder's conversion


def _flip_in_place(img: np.ndarray) -> None:
    cv2 = _cv2_or_none()
    if cv2 is None:
        img[...] = img[:, ::-1].copy()
        return
    cv2.flip(img, 1, dst=img)


def _flip_into(src: np.ndarray, dst: np.ndarray) -> None:
    cv2 = _cv2_or_none()
    if cv2 is None:
        dst[...] = src[:, ::-1]
        return
    cv2.flip(src, 1, dst=dst)


def _to_planes(hwc: np.ndarray, chw: np.ndarray) -> None:
    """Copy an ``H x W x 3`` image into the ``3 x H x W`` slot ``chw``."""
    cv2 = _cv2_or_none()
    if cv2 is None:
        np.copyto(chw, hwc.transpose(2, 0, 1))
        return
    cv2.split(hwc, [chw[0], chw[1], chw[2]])  # in place, ~6x faster than a transposing copy


_CV2: list[Any] = []


def _cv2_or_none() -> Any:
    if not _CV2:
        try:
            from lmdbfolder.read.crops import _cv2

            _CV2.append(_cv2())
        except ImportError:
            _CV2.append(None)
    return _CV2[0]

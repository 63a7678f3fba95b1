"""Decode and augment on the GPU: DataLoader workers ship record bytes, the training process decodes the batch.

When every CPU core is busy decoding JPEGs, the decode and the augmentation
can move to the GPU. The pieces:

* ``RecordBytes``: a map-style Dataset over a pack whose workers only read
  records (a B+tree lookup, the header held against the payload's own header
  and Pillow's bomb limits, ``ReadPlan.claim``, and one copy of the bytes per
  record: microseconds) and, when given a ``plan``, draw each sample's crop box and flip from the
  header sizes, exactly as torchvision's transforms would in that worker.
  ``__getitems__`` returns a whole ``RecordBatch`` (one byte buffer, one
  header table), so ``collate_records`` has nothing left to do and a batch
  crosses from the worker in two shared-memory tensors.
* ``DeviceRandomResizedCrop``: called on a ``RecordBatch`` in the training
  process, it decodes the JPEGs on its device (torchvision's batched
  ``decode_jpeg(list, device=...)``, nvJPEG on CUDA), crops, resizes and flips
  them in a few batched operations and returns a uint8 NCHW batch, or a
  normalised float batch, on that device. The same code runs with
  ``device="cpu"`` (libjpeg-turbo), which is how the default test suite checks it.

Equality with the CPU path (``LMDBFolder`` + torchvision's
``RandomResizedCrop`` + ``RandomHorizontalFlip`` + ``PILToTensor``):

* Crop boxes and flips come from torchvision's own ``get_params`` and
  ``torch.rand(1) < p``, drawn per sample in batch order, so for the same seed
  they are the same boxes and consume the same random numbers (in the workers
  when planned there, else in the training process).
* The resize reproduces Pillow's bilinear (antialiased) resampling exactly:
  the same filter coefficients (computed in float64 like Pillow's C code and
  rounded to its 22-bit fixed point), a horizontal pass rounded to uint8, then
  a vertical pass. Both passes are batched matrix products in float64, whose
  integer sums are exact, so on identical decoded pixels the output is
  bit-identical to Pillow's. On CPU torchvision's libjpeg-turbo decodes the
  same pixels as Pillow, so the whole batch equals the CPU path's.
* On CUDA the decoded pixels differ: torchvision creates nvJPEG with its
  default flags, which upsample 4:2:0 chroma by repetition, not libjpeg's
  "fancy" (triangle) upsampling; the crop geometry is unchanged.

Records the device decoder cannot take go through Pillow for that sample
(exactly ImageFolder's RGB conversion), counted per reason in ``stats``:
not a JPEG (PNG, WebP, ...), CMYK/YCCK JPEGs, JPEGs whose header was not
readable, JPEGs without an end-of-image marker (truncated: Pillow decides,
as for ImageFolder, honouring ``ImageFile.LOAD_TRUNCATED_IMAGES``), and JPEGs
the device decoder refused. Raw packs (``--store raw``) skip decoding. A record
that Pillow cannot decode either raises ``DecodeError`` naming its index and path.

What torchvision 0.29.1 (the pinned version) offers, checked there:

* ``torchvision.io.decode_jpeg(list_of_uint8_cpu_tensors, mode=RGB,
  device="cuda")`` decodes a list in one call: baseline JPEGs batched on the
  A100/H100 hardware JPEG decoder (``NVJPEG_BACKEND_HARDWARE``) where there is
  one, others (progressive) one by one with nvJPEG's hybrid backend (Huffman
  decoding on the CPU). The call does not return partial results: one bad
  image fails the whole list, so a failed batch is retried image by image.
* Every call warns that torchvision's decoders are deprecated since 0.29 in
  favour of TorchCodec (>= 0.16). torchcodec is not installed in the pinned
  environment (nor required by it); this module uses torchvision's decoder and
  silences that one warning around its calls.
* With ``device="cpu"`` the same list call loops over libjpeg-turbo; its RGB
  output (grayscale and CMYK JPEGs too) equals Pillow's.

This module imports torch and torchvision; nothing in lmdbfolder imports it
except the bench.
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass
from typing import Any, Sequence, cast

import numpy as np
import torch
import torch.utils.data
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg

from lmdbfolder.encodings import JPEG, decode_hint, encoding_of
from lmdbfolder.errors import DecodeError
from lmdbfolder.read.capabilities import current
from lmdbfolder.read.opening import open_pack
from lmdbfolder.read.plan import ReadPlan
from lmdbfolder.read.reader import Record
from lmdbfolder.torch.crop import RandomResizedCrop as _FusedCrop

__all__ = [
    "RecordBatch",
    "RecordBytes",
    "collate_records",
    "DeviceRandomResizedCrop",
    "STAT_KEYS",
    "sync_device",
]

# Columns of RecordBatch.meta.
_INDEX, _LABEL, _WIDTH, _HEIGHT, _CHANNELS, _PACK, _PLANNED, _TOP, _LEFT, _BOX_H, _BOX_W, _FLIP, _ENDS = range(13)
_NCOLS = 13

#: The counters of ``DeviceRandomResizedCrop.stats``: ``device`` (decoded by
#: the device decoder), ``raw`` (raw pixels, nothing to decode), and the
#: samples that went through Pillow, by reason.
STAT_KEYS = (
    "device",
    "raw",
    "cpu_not_jpeg",
    "cpu_cmyk",
    "cpu_no_header",
    "cpu_truncated",
    "cpu_refused",
)
_FIXED = float(1 << 22)  # Pillow's PRECISION_BITS for 8-bit resampling: 32 - 8 - 2
_HALF = float(1 << 21)
_DEPRECATION = "The image decoding and encoding capabilities of TorchVision are deprecated"


@dataclass
class RecordBatch:
    """Stored bytes and header fields of a batch of records (what the workers ship).

    Attributes:
        data: every payload, concatenated (uint8, 1-D).
        offsets: payload ``k`` is ``data[offsets[k]:offsets[k + 1]]`` (int64, n + 1).
        meta: one int64 row per sample: index, label, width, height,
            channels, pack (an index into ``packs``), then the planned crop:
            planned (1 yes, 0 no, -1 image size unreadable), top, left,
            height, width, flip; last, whether the payload ends with a JPEG
            end-of-image marker (1/0).
        encodings: the stored encoding of each sample (``"jpeg"``, ``"png"``, ``"raw"``, ...).
        packs: the pack directories the samples come from (for error messages).
    """

    data: torch.Tensor
    offsets: torch.Tensor
    meta: torch.Tensor
    encodings: list[str]
    packs: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.encodings)

    @property
    def index(self) -> torch.Tensor:
        """Sample index of each record in its pack."""
        return self.meta[:, _INDEX]

    @property
    def label(self) -> torch.Tensor:
        """Class index of each sample (-1 for unlabelled packs): the batch's targets."""
        return self.meta[:, _LABEL]

    @property
    def planned(self) -> bool:
        """Whether the workers drew the crop boxes (``RecordBytes(plan=...)``)."""
        return bool(len(self)) and bool((self.meta[:, _PLANNED] != 0).all())

    def payload(self, k: int) -> torch.Tensor:
        """The stored bytes of sample ``k`` (a view into ``data``)."""
        return self.data[int(self.offsets[k]) : int(self.offsets[k + 1])]

    def pin_memory(self) -> RecordBatch:
        """A copy in page-locked memory (the DataLoader calls this with ``pin_memory=True``)."""
        return RecordBatch(self.data.pin_memory(), self.offsets, self.meta, self.encodings, self.packs)


def collate_records(items: RecordBatch | Sequence[RecordBatch]) -> RecordBatch:
    """The DataLoader's ``collate_fn`` for ``RecordBytes``.

    ``RecordBytes.__getitems__`` already returns the whole batch, which is
    passed through; a list of single-sample batches (``__getitem__``, e.g.
    under a ``ConcatDataset``) is concatenated.
    """
    if isinstance(items, RecordBatch):
        return items
    items = list(items)
    if len(items) == 1:
        return items[0]
    packs: list[str] = []
    metas = []
    for item in items:
        ids = []
        for pack in item.packs:  # renumber each item's packs into the merged list
            if pack not in packs:
                packs.append(pack)
            ids.append(packs.index(pack))
        meta = item.meta.clone()
        meta[:, _PACK] = torch.tensor(ids, dtype=torch.int64)[meta[:, _PACK]]
        metas.append(meta)
    sizes = torch.tensor([0] + [len(item.data) for item in items], dtype=torch.int64)
    starts = torch.cumsum(sizes, 0)
    offsets = torch.cat([items[0].offsets[:1]] + [item.offsets[1:] + start for item, start in zip(items, starts)])
    return RecordBatch(
        torch.cat([item.data for item in items]),
        offsets,
        torch.cat(metas),
        [e for item in items for e in item.encodings],
        tuple(packs),
    )


class RecordBytes(torch.utils.data.Dataset):
    """A pack's records as bytes plus header, for decoding on the GPU (no decode in the workers).

    Args:
        root: the pack directory (single or sharded), as for ``LMDBFolder``.
        plan: a ``DeviceRandomResizedCrop``: the workers draw each sample's
            crop box and flip with it (torchvision's RNG use, per sample),
            so the training process only decodes. Without it the boxes are
            drawn by the transform in the training process.
        readahead, verify_checksums, prefetch: as for ``LMDBFolder``.

    Use it with the standard DataLoader and ``collate_fn=collate_records``;
    each batch is a ``RecordBatch``. Fork- and spawn-safe: the pack is opened
    lazily in each process and the dataset pickles without handles.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> from lmdbfolder.gpu import DeviceRandomResizedCrop, RecordBytes, collate_records
        >>> crop = DeviceRandomResizedCrop(224, device="cuda")
        >>> ds = RecordBytes("train.lmdb", plan=crop)  # doctest: +SKIP
        >>> loader = DataLoader(ds, batch_size=256, shuffle=True, num_workers=4,
        ...                     collate_fn=collate_records, pin_memory=True)  # doctest: +SKIP
        >>> for batch in loader:  # doctest: +SKIP
        ...     images, targets = crop(batch)  # uint8 NCHW on the GPU
    """

    def __init__(
        self,
        root: Any,
        plan: DeviceRandomResizedCrop | None = None,
        *,
        readahead: bool = True,
        verify_checksums: bool = True,
        prefetch: bool = False,
    ) -> None:
        self.reader = open_pack(root, readahead=readahead, verify_checksums=verify_checksums)
        self.root = self.reader.path
        self.plan = plan
        self.prefetch = prefetch
        self.classes: list[str] = self.reader.classes
        self.class_to_idx: dict[str, int] = self.reader.class_to_idx
        self._targets: list[int] | None = None

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, index: int) -> RecordBatch:
        return self._batch([self.reader.get(index)])

    def __getitems__(self, indices: Sequence[int]) -> RecordBatch:
        """The whole batch (the DataLoader calls this): records fetched together, bytes copied once."""
        return self._batch(self.reader.get_many(indices, prefetch=self.prefetch))

    @property
    def targets(self) -> list[int]:
        """Class index of every sample, in index order."""
        if self._targets is None:
            self._targets = self.reader.labels.tolist()
        return self._targets

    def _batch(self, records: list[Record]) -> RecordBatch:
        n = len(records)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([len(r.payload) for r in records], out=offsets[1:])
        data = torch.empty(int(offsets[-1]), dtype=torch.uint8)
        buf = data.numpy()
        meta = np.zeros((n, _NCOLS), dtype=np.int64)
        plan = self.plan
        for k, rec in enumerate(records):
            # The header is a claim: held against the payload (and Pillow's bomb limits)
            # before a box is drawn from it here or the device decodes by it.
            try:
                ReadPlan.claim(rec.payload, rec.encoding, rec.width, rec.height, rec.channels)
            except Exception as exc:  # Pillow raises many exception types for bad data
                hint = decode_hint(exc)
                path = self.reader.path_of(rec.index)
                raise DecodeError(rec.index, path, f"{type(exc).__name__}: {exc}", hint) from exc
            buf[offsets[k] : offsets[k + 1]] = np.frombuffer(rec.payload, dtype=np.uint8)
            row = meta[k]
            row[:_PACK] = (rec.index, rec.label, rec.width, rec.height, rec.channels)
            # Trailing padding after the end-of-image marker is allowed here.
            row[_ENDS] = JPEG.ends_with_eoi(rec.payload, slack=30)
            if plan is not None:
                width, height = rec.width, rec.height
                if width <= 0 or height <= 0:
                    width, height = _probe_size(rec.payload)
                if width > 0 and height > 0:
                    row[_PLANNED:_ENDS] = (1, *plan.draw(width, height))
                else:
                    row[_PLANNED] = -1
        return RecordBatch(
            data, torch.from_numpy(offsets), torch.from_numpy(meta), [r.encoding for r in records], (self.root,)
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_targets"] = None
        return state

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root!r}, count={len(self)}, plan={self.plan!r})"


def _probe_size(payload: memoryview | bytes) -> tuple[int, int]:
    # The header gave no size: Pillow reads it from the file's header without decoding.
    try:
        with Image.open(io.BytesIO(payload)) as img:
            return img.size
    except Exception:  # any unreadable file: the training side raises DecodeError for it
        return 0, 0


def _pair(size: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(size, int):
        return size, size
    size = tuple(int(s) for s in size)
    if len(size) == 1:
        return size[0], size[0]
    if len(size) != 2:
        raise ValueError(f"size must be an int or (height, width), got {size!r}")
    return size[0], size[1]


class DeviceRandomResizedCrop:
    """Decode a ``RecordBatch`` on ``device``, then RandomResizedCrop and flip it: one batch out.

    Equivalent to ``T.Compose([T.RandomResizedCrop(size, scale, ratio),
    T.RandomHorizontalFlip(flip), T.PILToTensor()])`` applied to each
    sample's ``LMDBFolder`` image, then stacked (see the module docstring for
    what is identical and what differs on CUDA).

    Args:
        size: output size, an int or ``(height, width)``.
        scale, ratio: as in torchvision's ``RandomResizedCrop`` (bilinear,
            antialiased, as torchvision does on PIL images).
        flip: probability of a horizontal flip (torchvision's
            ``RandomHorizontalFlip(p)``), or None for no flip (no random
            number drawn).
        device: where to decode and transform (``"cuda"``, ``"cuda:1"``, ``"cpu"``).
        output: ``"uint8"`` (NCHW, 0..255) or ``"float"`` (``ToTensor``'s
            scaling to 0..1, then ``(x - mean) / std`` when given).
        mean, std: per-channel normalisation for ``output="float"``.
        dtype: the floating type of ``output="float"``.
        chunk_bytes: the working memory of one resize step; larger batches
            are resized in chunks of about this size.

    Attributes:
        stats: how many samples took each path (``STAT_KEYS``), over all calls.
    """

    def __init__(
        self,
        size: int | Sequence[int],
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0),
        *,
        flip: float | None = 0.5,
        device: str | torch.device = "cuda",
        output: str = "uint8",
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        dtype: torch.dtype = torch.float32,
        chunk_bytes: int = 512 << 20,
    ) -> None:
        if output not in ("uint8", "float"):
            raise ValueError(f"output must be 'uint8' or 'float', got {output!r}")
        if (mean is None) != (std is None):
            raise ValueError("give both mean and std, or neither")
        if output == "uint8" and mean is not None:
            raise ValueError("mean/std normalise a float batch: pass output='float' with them")
        if flip is not None and not 0.0 <= flip <= 1.0:
            raise ValueError(f"flip must be a probability in [0, 1] or None, got {flip}")
        self.size = _pair(size)
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.flip = flip
        self.device = torch.device(device)
        self.output = output
        self.mean = None if mean is None else tuple(float(m) for m in mean)
        self.std = None if std is None else tuple(float(s) for s in std)
        self.dtype = dtype
        self.chunk_bytes = max(1, int(chunk_bytes))
        self.stats: dict[str, int] = dict.fromkeys(STAT_KEYS, 0)
        self._sampler = _FusedCrop(self.size, scale=self.scale, ratio=self.ratio)
        self._norm: tuple[torch.Tensor, torch.Tensor] | None = None
        # Decided once per process, at first use (see ``_decisions``).
        self._draw: Any = None
        self._vertical_first: Any = None
        self._cpu: ReadPlan | None = None

    # -- planning (runs in the DataLoader workers with RecordBytes(plan=...)) ----------
    def draw(self, width: int, height: int) -> tuple[int, int, int, int, int]:
        """``(top, left, height, width, flip)`` for an image of this size, drawn
        with the global torch RNG exactly as torchvision's RandomResizedCrop
        then RandomHorizontalFlip draw them."""
        if self._draw is None:
            self._draw = self._sampler.drawer()
        top, left, h, w = self._draw(width, height)
        flipped = 0
        if self.flip is not None:
            flipped = int(bool(torch.rand(1) < self.flip))
        return top, left, h, w, flipped

    # -- the training-side transform ------------------------------------------------------
    def __call__(self, batch: RecordBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(images, targets)`` on the device: images NCHW (uint8, or float with ``output="float"``)."""
        images = self.decode_crop(batch)
        targets = batch.label.to(self.device, non_blocking=True)
        return images, targets

    def decode_crop(self, batch: RecordBatch) -> torch.Tensor:
        """Decode, crop, resize and flip every sample of ``batch``; returns the image batch."""
        n = len(batch)
        meta = batch.meta.tolist()
        offsets = batch.offsets.tolist()
        payloads = torch.split(batch.data, [offsets[k + 1] - offsets[k] for k in range(n)])  # views, one call
        pixels: list[torch.Tensor | None] = [None] * n
        to_device: list[int] = []
        for k in range(n):
            row = meta[k]
            enc, width, height, channels = encoding_of(batch.encodings[k]), row[_WIDTH], row[_HEIGHT], row[_CHANNELS]
            if enc.stores_pixels and width > 0 and height > 0 and len(payloads[k]) == width * height * 3:
                pixels[k] = payloads[k].view(height, width, 3).permute(2, 0, 1).to(self.device, non_blocking=True)
                self.stats["raw"] += 1
            elif enc.fusable(channels) and enc is JPEG and width > 0 and height > 0 and row[_ENDS]:
                to_device.append(k)
            else:
                pixels[k] = self._cpu_decode(batch, k, _cpu_reason(enc, channels, width, height))
        if to_device:
            decoded = self._device_decode([payloads[k] for k in to_device])
            for k, img in zip(to_device, decoded):
                row = meta[k]
                if img is None or tuple(img.shape) != (3, row[_HEIGHT], row[_WIDTH]):
                    pixels[k] = self._cpu_decode(batch, k, "cpu_refused")
                else:
                    pixels[k] = img
                    self.stats["device"] += 1
        ready = cast("list[torch.Tensor]", pixels)  # every branch above set its sample (or raised)
        boxes: list[tuple[int, int, int, int]] = []
        flips: list[int] = []
        for k in range(n):
            img = ready[k]
            row = meta[k]
            if row[_PLANNED] == 1:
                top, left, h, w, flipped = row[_TOP], row[_LEFT], row[_BOX_H], row[_BOX_W], row[_FLIP]
            else:
                # Drawn here, in batch order: the same numbers torchvision's
                # transforms would draw for these samples in this process.
                top, left, h, w, flipped = self.draw(img.shape[2], img.shape[1])
            if top < 0 or left < 0 or h < 1 or w < 1 or top + h > img.shape[1] or left + w > img.shape[2]:
                raise DecodeError(
                    row[_INDEX],
                    self._path_of(batch, k),
                    f"the planned crop {(top, left, h, w)} does not fit the decoded "
                    f"{img.shape[2]}x{img.shape[1]} image (the record header gave {row[_WIDTH]}x{row[_HEIGHT]})",
                )
            boxes.append((top, left, h, w))
            flips.append(flipped)
        return self._finish(self._resize(ready, boxes, flips))

    def _finish(self, images: torch.Tensor) -> torch.Tensor:
        if self.output == "uint8":
            return images
        out = images.to(self.dtype).div_(255)  # ToTensor's scaling
        if self.mean is not None and self.std is not None:
            if self._norm is None or self._norm[0].device != out.device or self._norm[0].dtype != out.dtype:
                mean = torch.tensor(self.mean, dtype=out.dtype, device=out.device).view(1, -1, 1, 1)
                std = torch.tensor(self.std, dtype=out.dtype, device=out.device).view(1, -1, 1, 1)
                self._norm = (mean, std)
            out.sub_(self._norm[0]).div_(self._norm[1])  # Normalize's arithmetic
        return out

    # -- decoding ------------------------------------------------------------------------------
    def _device_decode(self, payloads: list[torch.Tensor]) -> list[torch.Tensor | None]:
        # One call for the batch; it fails whole if one image is bad, so then
        # retry one by one and leave None where the decoder refuses.
        try:
            return list(self._decode_jpegs(payloads))
        except Exception:  # torchvision raises RuntimeError; anything else is a refusal too
            pass
        out: list[torch.Tensor | None] = []
        for p in payloads:
            try:
                out.append(self._decode_jpegs([p])[0])
            except Exception:
                out.append(None)
        return out

    def _decode_jpegs(self, payloads: list[torch.Tensor]) -> list[torch.Tensor]:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_DEPRECATION)
            return decode_jpeg(payloads, mode=ImageReadMode.RGB, device=self.device)

    def _cpu_decode(self, batch: RecordBatch, k: int, reason: str) -> torch.Tensor:
        self.stats[reason] += 1
        row = batch.meta[k].tolist()
        payload = batch.payload(k).numpy()
        if self._cpu is None:
            # ImageFolder's conversion (Pillow), through the one CPU read path.
            self._cpu = ReadPlan(current().decoder("pillow"))
        try:
            img = self._cpu.image(payload.data, batch.encodings[k], row[_WIDTH], row[_HEIGHT], row[_CHANNELS])
            arr = np.array(img)  # a writable copy: torch refuses to wrap Pillow's read-only buffer silently
        except Exception as exc:  # Pillow raises many exception types for bad data
            why = f"{type(exc).__name__}: {exc}"
            raise DecodeError(row[_INDEX], self._path_of(batch, k), why, decode_hint(exc)) from exc
        return torch.from_numpy(arr).permute(2, 0, 1).to(self.device, non_blocking=True)

    @staticmethod
    def _path_of(batch: RecordBatch, k: int) -> str | None:
        # Only on the error path: open the pack briefly to name the file.
        row = batch.meta[k].tolist()
        try:
            with open_pack(batch.packs[row[_PACK]]) as reader:
                return reader.path_of(row[_INDEX])
        except Exception:  # the message still names the index
            return None

    # -- crop + resize + flip, batched ---------------------------------------------------------
    def _resize(
        self, pixels: list[torch.Tensor], boxes: list[tuple[int, int, int, int]], flips: list[int]
    ) -> torch.Tensor:
        out_h, out_w = self.size
        n = len(pixels)
        out = torch.empty((n, 3, out_h, out_w), dtype=torch.uint8, device=self.device)
        if self._vertical_first is None:
            self._vertical_first = _pass_rule(current().pillow_pass_order())
        vertical_first = self._vertical_first
        groups: dict[bool, list[int]] = {False: [], True: []}
        for k, (_top, _left, h, w) in enumerate(boxes):
            groups[vertical_first(h, w, out_h, out_w)].append(k)
        for vfirst, members in groups.items():
            start = 0
            while start < len(members):
                # Grow the chunk while its padded float64 crops fit in chunk_bytes.
                end = start + 1
                max_h, max_w = boxes[members[start]][2], boxes[members[start]][3]
                while end < len(members):
                    h, w = max(max_h, boxes[members[end]][2]), max(max_w, boxes[members[end]][3])
                    if (end + 1 - start) * _bytes_per_crop(h, w, out_w) > self.chunk_bytes:
                        break
                    max_h, max_w, end = h, w, end + 1
                chunk = members[start:end]
                res = self._resize_chunk(
                    [pixels[k] for k in chunk],
                    [boxes[k] for k in chunk],
                    [flips[k] for k in chunk],
                    max_h,
                    max_w,
                    vfirst,
                )
                if len(chunk) == n:
                    out.copy_(res)
                else:
                    out[torch.tensor(chunk, device=self.device)] = res
                start = end
        return out

    def _resize_chunk(
        self,
        pixels: list[torch.Tensor],
        boxes: list[tuple[int, int, int, int]],
        flips: list[int],
        max_h: int,
        max_w: int,
        vertical_first: bool,
    ) -> torch.Tensor:
        out_h, out_w = self.size
        m = len(pixels)
        dev = self.device
        crops = _gather_crops(pixels, boxes, max_h, max_w, dev)  # (m, 3, max_h, max_w) float64
        horiz = _pillow_weights([b[3] for b in boxes], out_w, max_w, dev)  # (m, out_w, max_w)
        flipped = [j for j, f in enumerate(flips) if f]
        if flipped:
            # A horizontal flip after the resize reverses the output columns: reverse the weights' rows.
            idx = torch.tensor(flipped, device=dev)
            horiz[idx] = horiz[idx].flip(1)
        vert = _pillow_weights([b[2] for b in boxes], out_h, max_h, dev)  # (m, out_h, max_h)
        # Two passes, each rounded to uint8 as Pillow's are, in Pillow's order.
        horiz_t = horiz.transpose(1, 2).unsqueeze(1)  # (m, 1, max_w, out_w)
        vert = vert.unsqueeze(1)  # (m, 1, out_h, max_h)
        if vertical_first:
            tmp = _round_fixed(torch.matmul(vert, crops))  # (m, 3, out_h, max_w)
            return _round_fixed(torch.matmul(tmp, horiz_t)).to(torch.uint8)
        tmp = _round_fixed(torch.bmm(crops.view(m, 3 * max_h, max_w), horiz_t.squeeze(1)))  # (m, 3 max_h, out_w)
        return _round_fixed(torch.matmul(vert, tmp.view(m, 3, max_h, out_w))).to(torch.uint8)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_norm"] = None  # device tensors stay in their process
        state["_draw"] = state["_vertical_first"] = state["_cpu"] = None  # decided again in each process
        return state

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(size={self.size}, scale={self.scale}, ratio={self.ratio}, flip={self.flip}, "
            f"device={str(self.device)!r}, output={self.output!r})"
        )


def _cpu_reason(enc: Any, channels: int, width: int, height: int) -> str:
    """The ``stats`` key of a record the device decoder does not take."""
    if enc is not JPEG:
        return "cpu_not_jpeg"
    if channels == 4:
        return "cpu_cmyk"
    if not enc.fusable(channels) or width <= 0 or height <= 0:
        return "cpu_no_header"
    return "cpu_truncated"


def _bytes_per_crop(height: int, width: int, out_w: int) -> int:
    # Peak working memory per sample of a resize chunk: the gather index and its
    # masked copy (int32 at most 2 x 4 bytes), the float64 crop and the float64
    # horizontal pass.
    return 3 * height * (width * (8 + 8) + out_w * 8)


def _gather_crops(
    pixels: list[torch.Tensor], boxes: list[tuple[int, int, int, int]], max_h: int, max_w: int, device: torch.device
) -> torch.Tensor:
    """Every box's crop, zero-padded to ``max_h`` x ``max_w``, as one float64 tensor.

    One concatenation and one gather for the whole chunk, rather than a copy
    kernel per sample: on a GPU the per-sample launches would cost more than
    the arithmetic.
    """
    m = len(pixels)
    flat = torch.cat([img.reshape(-1) for img in pixels] + [torch.zeros(1, dtype=torch.uint8, device=device)])
    sizes = [img.shape[1] * img.shape[2] for img in pixels]
    starts = [0]
    for size in sizes[:-1]:
        starts.append(starts[-1] + 3 * size)
    # Per sample: start in flat, plane size, row length, box (one small copy to the device).
    # int32 indices where they fit: half the memory and faster arithmetic than int64.
    itype = torch.int32 if flat.numel() < 2**31 else torch.int64
    table = torch.tensor(
        [
            [st, size, img.shape[2], top, left, h, w]
            for st, size, img, (top, left, h, w) in zip(starts, sizes, pixels, boxes)
        ],
        dtype=itype,
    ).to(device, non_blocking=True)
    start, plane, row, top, left, height, width = (table[:, i].view(m, 1, 1, 1) for i in range(7))
    chan = torch.arange(3, dtype=itype, device=device).view(1, 3, 1, 1)
    y = torch.arange(max_h, dtype=itype, device=device).view(1, 1, max_h, 1)
    x = torch.arange(max_w, dtype=itype, device=device).view(1, 1, 1, max_w)
    # Row offsets first (small), then one full-size sum; padding points at the zero appended to flat.
    rows = torch.where(
        y < height, start + chan * plane + (top + y) * row, torch.full((), -1, dtype=itype, device=device)
    )
    index = torch.where(
        (rows >= 0) & (x < width), rows + (left + x), torch.full((), flat.numel() - 1, dtype=itype, device=device)
    )
    return flat[index].to(torch.float64)


def _vertical_first_new(in_h: int, in_w: int, out_h: int, out_w: int) -> bool:
    # Pillow >= 11's ImagingResampleInner: the vertical pass runs first when the
    # height shrinks by more than twice as many pixels as the width does.
    return in_h - out_h > 0 and in_h - out_h > (in_w - out_w) * 2


def _vertical_first_never(in_h: int, in_w: int, out_h: int, out_w: int) -> bool:
    return False  # older Pillow: always the horizontal pass first


def _pass_rule(order: int | None) -> Any:
    # Pillow's order (``Capabilities.pillow_pass_order``); where neither known order
    # is Pillow's, the horizontal pass first (pixels then differ, as on CUDA).
    return _vertical_first_new if order == 1 else _vertical_first_never


def _round_fixed(acc: torch.Tensor) -> torch.Tensor:
    """Pillow's ``clip8``: round a 22-bit fixed-point sum to 0..255 (exact in float64)."""
    return torch.floor((acc + _HALF) * (1.0 / _FIXED)).clamp_(0.0, 255.0)


def _pillow_weights(lengths: list[int], out_size: int, pad: int, device: torch.device) -> torch.Tensor:
    """Pillow's bilinear resampling weights for crops of ``lengths`` pixels
    resized to ``out_size``, as 22-bit fixed-point integers in float64:
    ``(len(lengths), out_size, pad)``, zero past each crop.

    The arithmetic is Pillow's ``precompute_coeffs`` + ``normalize_coeffs_8bpc``
    (Resample.c) operation for operation in IEEE float64, so the coefficients
    are Pillow's to the bit.
    """
    f64 = torch.float64
    length = torch.tensor(lengths, dtype=f64, device=device)[:, None]  # (m, 1)
    scale = length / out_size
    filterscale = torch.clamp(scale, min=1.0)
    support = filterscale * 1.0  # the bilinear filter's support is 1
    ksize = int(math.ceil(max(max(lengths) / out_size, 1.0))) * 2 + 1
    center = (torch.arange(out_size, dtype=f64, device=device)[None, :] + 0.5) * scale  # (m, out)
    ss = 1.0 / filterscale
    xmin = torch.trunc(center - support + 0.5).clamp_(min=0.0)
    xmax = torch.minimum(torch.trunc(center + support + 0.5), length)
    count = xmax - xmin
    taps = torch.arange(ksize, dtype=f64, device=device)
    x = taps[None, None, :] + xmin[:, :, None]  # (m, out, ksize): source pixel of each tap
    arg = (x - center[:, :, None] + 0.5) * ss[:, :, None]
    weight = torch.clamp(1.0 - torch.abs(arg), min=0.0)  # bilinear_filter
    weight = torch.where(taps[None, None, :] < count[:, :, None], weight, torch.zeros((), dtype=f64, device=device))
    total = weight[:, :, 0].clone()
    for t in range(1, ksize):  # summed in Pillow's order, so the rounding matches
        total = total + weight[:, :, t]
    normed = torch.where(total[:, :, None] != 0.0, weight / total[:, :, None], weight)
    fixed = torch.trunc(0.5 + normed * _FIXED)
    # Spread the taps over the padded source axis: tap t of output o sits at xmin[o] + t.
    rel = torch.arange(pad, dtype=f64, device=device)[None, None, :] - xmin[:, :, None]  # (m, out, pad)
    inside = (rel >= 0) & (rel < count[:, :, None])
    dense = torch.gather(fixed, 2, rel.clamp(0, ksize - 1).long())
    return torch.where(inside, dense, torch.zeros((), dtype=f64, device=device))


# -- benchmarks (``lmdbfolder bench --device``) ------------------------------------------------------
def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

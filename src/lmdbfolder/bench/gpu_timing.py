"""Timing the GPU batch path (``lmdbfolder.gpu``) for ``lmdbfolder bench --device``.

Per-batch wall time, and GPU time from CUDA events on CUDA; one epoch through
a shuffling DataLoader, and the transform alone on batches read beforehand.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np
import torch

from lmdbfolder.bench.timing import Measurement
from lmdbfolder.gpu import DeviceRandomResizedCrop, RecordBatch, RecordBytes, collate_records, sync_device

__all__ = ["time_device_path", "time_device_transform"]


class _BatchTimer:
    """Time each transform call: CUDA events on a GPU (device time), the wall clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.wall: list[float] = []
        self.events: list[tuple[Any, Any]] = []

    def run(self, fn: Any, batch: RecordBatch) -> Any:
        start_wall = time.perf_counter()
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn(batch)
            end.record()
            self.events.append((start, end))
        else:
            result = fn(batch)
        self.wall.append(time.perf_counter() - start_wall)
        return result

    def summary(self) -> dict[str, float | None]:
        sync_device(self.device)
        device_ms = [s.elapsed_time(e) for s, e in self.events]
        return {
            "transform_ms_per_batch": round(float(np.median(self.wall)) * 1e3, 3) if self.wall else None,
            "gpu_ms_per_batch": round(float(np.median(device_ms)), 3) if device_ms else None,
        }


def time_device_path(
    pack: str,
    *,
    device: str,
    workers: int,
    batch_size: int = 64,
    size: int = 224,
    indices: Sequence[int] | None = None,
    contestant: str | None = None,
    multiprocessing_context: str | None = None,
) -> tuple[Any, dict[str, Any]]:
    """One epoch of the GPU batch path through a shuffling DataLoader (as ``time_loader`` times the CPU path).

    Workers ship bytes and planned boxes (``RecordBytes(plan=...)``); the
    training process decodes + crops + flips each batch on ``device``.
    Returns ``(Measurement, details)``; ``details`` holds the median
    transform time per batch (wall clock, and GPU time from CUDA events on
    CUDA) and the transform's ``stats``.
    """
    from torch.utils.data import DataLoader, Subset

    dev = torch.device(device)
    crop = DeviceRandomResizedCrop(size, device=dev)
    dataset: Any = RecordBytes(pack, plan=crop)
    if indices is not None:
        dataset = Subset(dataset, list(indices))
    _warm_up(crop, pack, batch_size)
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        multiprocessing_context=multiprocessing_context if workers > 0 else None,
        collate_fn=collate_records,
        pin_memory=dev.type == "cuda",
        generator=torch.Generator().manual_seed(0),
    )
    timer = _BatchTimer(dev)
    images = 0
    start = time.perf_counter()
    for batch in loader:
        out, _targets = timer.run(crop, batch)
        images += len(out)
    sync_device(dev)
    seconds = time.perf_counter() - start
    del loader
    name = contestant or f"device decode ({device})"
    details = dict(timer.summary(), stats=dict(crop.stats), batch_size=batch_size)
    return Measurement(name, "train pipeline", workers, images, 0, seconds), details


def time_device_transform(
    pack: str,
    *,
    device: str,
    batch_size: int = 64,
    size: int = 224,
    indices: Sequence[int] | None = None,
    contestant: str | None = None,
) -> tuple[Any, dict[str, Any]]:
    """The device transform alone (decode + crop + flip) on batches read beforehand: its ceiling without a loader."""
    dev = torch.device(device)
    crop = DeviceRandomResizedCrop(size, device=dev)
    dataset = RecordBytes(pack, plan=crop)
    order = list(indices) if indices is not None else list(range(len(dataset)))
    batches = [dataset.__getitems__(order[k : k + batch_size]) for k in range(0, len(order), batch_size)]
    if dev.type == "cuda":
        batches = [b.pin_memory() for b in batches]
    _warm_up(crop, pack, batch_size)
    timer = _BatchTimer(dev)
    images = 0
    start = time.perf_counter()
    for batch in batches:
        images += len(timer.run(crop.decode_crop, batch))
    sync_device(dev)
    seconds = time.perf_counter() - start
    dataset.reader.close()
    name = contestant or f"device decode ({device})"
    details = dict(timer.summary(), stats=dict(crop.stats), batch_size=batch_size)
    return Measurement(name, "decode+augment", 1, images, 0, seconds), details


def _warm_up(crop: DeviceRandomResizedCrop, pack: str, batch_size: int) -> None:
    # The first call initialises nvJPEG, cuBLAS and the caching allocator:
    # seconds on a GPU, which is not what a training epoch pays per batch.
    ds = RecordBytes(pack, plan=crop)
    try:
        saved = dict(crop.stats)
        crop.decode_crop(ds.__getitems__(list(range(min(len(ds), batch_size)))))
        sync_device(crop.device)
        crop.stats.update(saved)
    finally:
        ds.reader.close()

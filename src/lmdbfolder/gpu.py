"""Decode and augment on the GPU (DataLoader workers ship record bytes, the training
process decodes the batch): the public path of ``lmdbfolder.torch.gpu`` (see there).

Example:
    >>> from lmdbfolder.gpu import DeviceRandomResizedCrop, RecordBytes, collate_records  # doctest: +SKIP
"""

from __future__ import annotations

from lmdbfolder.torch.gpu import (
    STAT_KEYS,
    DeviceRandomResizedCrop,
    RecordBatch,
    RecordBytes,
    collate_records,
    sync_device,
)

__all__ = [
    "RecordBatch",
    "RecordBytes",
    "collate_records",
    "DeviceRandomResizedCrop",
    "STAT_KEYS",
    "sync_device",
]

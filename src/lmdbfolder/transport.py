"""Batch memory that is reused, and its trip from a DataLoader worker to the main
process: the public path of ``lmdbfolder.torch.transport`` (see there)."""

from __future__ import annotations

from lmdbfolder.torch.transport import MAX_BUFFERS, BatchPool, PooledBatch, pool

__all__ = ["BatchPool", "PooledBatch", "pool", "MAX_BUFFERS"]

"""An exact distributed sampler (every sample once per epoch across all ranks,
resumable mid-epoch): the public path of ``lmdbfolder.torch.sampler`` (see there)."""

from __future__ import annotations

from lmdbfolder.torch.sampler import ORDERS, ExactDistributedSampler

__all__ = ["ExactDistributedSampler", "ORDERS"]

"""Replayable augmentation, public path: ``lmdbfolder.replay`` is ``lmdbfolder.torch.replay`` (see there)."""

from __future__ import annotations

from lmdbfolder.torch.replay import EpochCell, Replay, derive, stream

__all__ = ["derive", "EpochCell", "Replay", "stream"]

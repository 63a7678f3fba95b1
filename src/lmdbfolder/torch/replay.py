"""Augmentation that replays: sample ``i`` of epoch ``e`` draws its random numbers from ``(seed, e, i)`` only.

Without a seed a dataset's transforms draw from torch's global generator in
whatever state the process left it: which worker made the sample, how many
samples it made before, the batch size and whether a job was resumed decide a
sample's crop and flip. ``LMDBFolder(..., seed=S)`` makes them a function of
``(S, epoch, index)``:

* **Per sample**, ``Replay.seeded(index)`` seeds torch's default CPU generator
  with ``derive(S, epoch, index)`` while the sample is made, then puts the
  generator's state back (a training loop in the same process keeps its own
  numbers). Every transform that draws from torch's global generator is
  covered: torchvision's transforms v1 and v2 (``RandomResizedCrop``, flips,
  ``ColorJitter``, ``RandAugment``, ``TrivialAugmentWide``, ``RandomErasing``...),
  lmdbfolder's fused crop and its batch path (which then draws each sample's box
  and flip from its own stream, not in bulk).
* Python's ``random`` module is seeded per sample too (``random.seed``; the
  state is not put back: saving it costs 60 us a sample): torchvision v1's
  ``RandomChoice`` and ``RandomOrder`` draw from it.
* **Not covered**: numpy's global generator (albumentations, imgaug, and
  transforms that call ``np.random``: seeding it costs ~250 us a sample, more
  than the sample), and transforms that hold a generator of their own (a
  ``torch.Generator`` or ``np.random.Generator`` made once in ``__init__``):
  their numbers depend on how many samples the process made before.
* **The epoch** is part of the stream: ``ExactDistributedSampler.set_epoch``
  and ``load_state_dict`` pass it to their dataset; otherwise call
  ``dataset.set_epoch(e)`` before each epoch (as with the sampler). The epoch
  lives in memory shared with the DataLoader's worker processes (``EpochCell``),
  so persistent workers see it too.

The seed of a sample is ``derive(seed, epoch, index)``: SHA-256 of the three
numbers, 63 bits of it (the same on every machine and in every process).
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import random
from typing import Any, Iterator

import torch

from lmdbfolder.errors import OptionError

__all__ = ["derive", "EpochCell", "Replay", "stream"]


def derive(seed: int, epoch: int, index: int) -> int:
    """The seed of sample ``index`` in ``epoch`` of a dataset seeded with ``seed``."""
    digest = hashlib.sha256(f"lmdbfolder-replay/{seed}/{epoch}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class EpochCell:
    """The current epoch, in memory shared with the DataLoader workers started after it was made.

    A ``multiprocessing`` shared integer: the main process's ``set`` is seen by
    forked and spawned workers alike, persistent ones included. Pickled for
    anything but starting a process (``copy.deepcopy``, Ray), it becomes a plain
    number again.
    """

    def __init__(self, epoch: int = 0) -> None:
        self._shared: Any = multiprocessing.RawValue("q", epoch)

    def get(self) -> int:
        """The epoch."""
        return int(self._shared.value)

    def set(self, epoch: int) -> None:
        """Make ``epoch`` the current one (in every process sharing this cell)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise OptionError(f"the epoch must be a whole number of at least 0, got {epoch!r}")
        self._shared.value = epoch

    def __getstate__(self) -> dict[str, Any]:
        from multiprocessing.context import get_spawning_popen

        if get_spawning_popen() is not None:  # starting a worker process: share the memory
            return {"shared": self._shared}
        return {"epoch": self.get()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._shared = state["shared"] if "shared" in state else multiprocessing.RawValue("q", state["epoch"])


class Replay:
    """The per-sample random streams of a dataset with ``seed=S`` (see the module docs)."""

    __slots__ = ("seed", "epoch")

    def __init__(self, seed: int) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise OptionError(f"seed must be a whole number of at least 0 (or None: no replay), got {seed!r}")
        self.seed = seed
        self.epoch = EpochCell()

    def sample_seed(self, index: int) -> int:
        """The seed of sample ``index`` in the current epoch."""
        return derive(self.seed, self.epoch.get(), index)

    @contextlib.contextmanager
    def seeded(self, index: int) -> Iterator[None]:
        """Torch's default CPU generator (and Python's ``random``) seeded for sample ``index``
        while the block runs; the torch generator's state is put back after it."""
        with stream(self.sample_seed(index)):
            yield

    def __repr__(self) -> str:
        return f"Replay(seed={self.seed}, epoch={self.epoch.get()})"


@contextlib.contextmanager
def kept_state() -> Iterator[torch.Generator]:
    """Torch's default CPU generator, its state put back when the block ends (the batch path
    seeds it once per sample inside)."""
    generator = torch.default_generator
    state = generator.get_state()
    try:
        yield generator
    finally:
        generator.set_state(state)


@contextlib.contextmanager
def stream(seed: int) -> Iterator[None]:
    """Draw from torch's default CPU generator (and Python's ``random``) seeded with ``seed``."""
    generator = torch.default_generator
    state = generator.get_state()
    generator.manual_seed(seed)
    random.seed(seed)
    try:
        yield
    finally:
        generator.set_state(state)

"""PyTorch integration: ``LMDBFolder``, a drop-in for ``torchvision.datasets.ImageFolder``.

This is the only module that imports torch. It is safe with DataLoader
workers under fork, spawn and forkserver, with ``persistent_workers`` and
over many epochs: the pack is opened lazily in each worker process (see
``lmdbfolder.reader``), and the dataset pickles without any open handle.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch.utils.data

from lmdbfolder.codecs import decode_rgb
from lmdbfolder.errors import DecodeError
from lmdbfolder.reader import Reader

__all__ = ["LMDBFolder"]


class LMDBFolder(torch.utils.data.Dataset):
    """A packed image dataset with the interface of ``torchvision.datasets.ImageFolder``.

    Args:
        root: the pack directory written by ``lmdbfolder pack`` (a single
            pack, or a sharded pack: its shards are opened lazily in each
            process; ``reader.shard_offsets`` says where each shard starts).
        transform: applied to the RGB ``PIL.Image`` (as in ImageFolder).
        target_transform: applied to the integer target.
        readahead: kernel readahead on the memory map (see ``Reader``).
        verify_checksums: check each record's CRC-32 as it is read.

    Attributes:
        classes: class names sorted as ImageFolder sorts them.
        class_to_idx: class name -> index.
        targets: the class index of every sample (-1 for unlabelled packs).
        samples: ``(relative path, class index)`` for every sample; ``imgs``
            is the same list. Paths are relative to the packed source folder.

    ``len()`` and every attribute come from the pack's metadata: nothing is
    scanned. ``targets``/``samples`` are built on first access and are not
    sent to worker processes.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> from torchvision import transforms as T
        >>> from lmdbfolder.torch import LMDBFolder
        >>> tf = T.Compose([T.RandomResizedCrop(224), T.ToTensor()])
        >>> ds = LMDBFolder("train.lmdb", transform=tf)  # doctest: +SKIP
        >>> loader = DataLoader(ds, batch_size=256, shuffle=True, num_workers=8)  # doctest: +SKIP
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        transform: Callable[..., Any] | None = None,
        target_transform: Callable[..., Any] | None = None,
        *,
        readahead: bool = True,
        verify_checksums: bool = False,
    ) -> None:
        self.reader = Reader(root, readahead=readahead, verify_checksums=verify_checksums)
        self.root = self.reader.path
        self.transform = transform
        self.target_transform = target_transform
        self.classes: list[str] = self.reader.classes
        self.class_to_idx: dict[str, int] = self.reader.class_to_idx
        self._targets: list[int] | None = None
        self._samples: list[tuple[str, int]] | None = None

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        rec = self.reader.get(index)
        try:
            sample: Any = decode_rgb(rec.payload, rec.encoding, rec.width, rec.height)
        except Exception as exc:  # Pillow raises many exception types for bad data
            raise DecodeError(rec.index, self.reader.path_of(rec.index), f"{type(exc).__name__}: {exc}") from exc
        target: Any = rec.label
        if self.transform is not None:
            sample = self.transform(sample)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return sample, target

    @property
    def targets(self) -> list[int]:
        """Class index of every sample, in index order."""
        if self._targets is None:
            self._targets = self.reader.labels.tolist()
        return self._targets

    @property
    def samples(self) -> list[tuple[str, int]]:
        """``(relative path, class index)`` of every sample, in index order."""
        if self._samples is None:
            self._samples = list(zip(self.reader.paths(), self.targets))
        return self._samples

    @property
    def imgs(self) -> list[tuple[str, int]]:
        """Alias of ``samples``, as in ImageFolder."""
        return self.samples

    def __getstate__(self) -> dict[str, Any]:
        # Workers need neither list; rebuilding them on demand keeps a
        # million-entry list out of every worker's memory.
        state = self.__dict__.copy()
        state["_targets"] = None
        state["_samples"] = None
        return state

    def __repr__(self) -> str:
        lines = [
            f"Dataset {type(self).__name__}",
            f"    Number of datapoints: {len(self)}",
            f"    Root location: {self.root}",
        ]
        if self.transform is not None:
            lines.append(f"    Transform: {self.transform!r}".replace("\n", "\n    "))
        if self.target_transform is not None:
            lines.append(f"    Target transform: {self.target_transform!r}")
        return "\n".join(lines)

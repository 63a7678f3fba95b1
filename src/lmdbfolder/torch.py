"""PyTorch integration: ``LMDBFolder``, a drop-in for ``torchvision.datasets.ImageFolder``.

This is the only module that imports torch. It is safe with DataLoader
workers under fork, spawn and forkserver, with ``persistent_workers`` and
over many epochs: the pack is opened lazily in each worker process (see
``lmdbfolder.read.reader``), and the dataset pickles without any open handle.
A worker that finds another pack at the path than the one the dataset was
made from (replaced by ``pack --overwrite``) raises instead of mixing them.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Sequence

import torch.utils.data

from lmdbfolder.codecs import decode_rgb
from lmdbfolder.errors import DecodeError
from lmdbfolder.read.decoders import (
    Decoder,
    decode_payload,
    get_decoder,
    resolve_decoder_name,
    size_hint_scale,
    to_pil,
)
from lmdbfolder.read.opening import open_pack
from lmdbfolder.read.reader import Record

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
        verify_checksums: check each record's CRC-32 as it is read (default:
            about 0.3 % of a JPEG decode; format-2 packs also bind it to the
            index, so no record is ever returned in another's place).
        decoder: JPEG decoder (``lmdbfolder.read.decoders``): ``"pillow"`` (default,
            exactly ImageFolder's loader), ``"simplejpeg"``, ``"turbojpeg"``,
            ``"opencv"``, ``"torchvision"``, or ``"auto"`` (fastest installed).
            All return the same RGB pixels as Pillow; non-JPEG images always go
            through Pillow.
        size_hint: the training resolution. JPEGs are decoded at the smallest
            DCT scale (1/2, 1/4, 1/8) that keeps the shorter side at least
            ``size_hint`` pixels. Put ``lmdbfolder.fused.RandomResizedCrop``
            first in ``transform`` instead to choose the scale per sampled crop.
        prefetch: when the DataLoader asks for a whole batch (``__getitems__``),
            ask the kernel to start reading all of its records before decoding
            (``Reader.get_many``; ``madvise(WILLNEED)``).

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
        verify_checksums: bool = True,
        decoder: str = "pillow",
        size_hint: int | None = None,
        prefetch: bool = True,
    ) -> None:
        self.decoder = resolve_decoder_name(decoder)
        get_decoder(self.decoder)  # fail now (with an install hint), not in a worker
        if size_hint is not None and size_hint < 1:
            raise ValueError(f"size_hint must be a positive number of pixels, got {size_hint}")
        self.size_hint = size_hint
        self.prefetch = prefetch
        self._decoder: Decoder | None = None
        self._split: tuple[Any, Any, Any] | None = None
        self.reader = open_pack(root, readahead=readahead, verify_checksums=verify_checksums)
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
        return self._sample(self.reader.get(index))

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[Any, Any]]:
        """A whole batch (the DataLoader calls this): the records are fetched
        together, prefetched from disk at once, then decoded one by one."""
        return [self._sample(rec) for rec in self.reader.get_many(indices, prefetch=self.prefetch)]

    def _sample(self, rec: Record) -> tuple[Any, Any]:
        crop, rest = self._fused_split()
        try:
            if crop is not None:
                sample: Any = crop.decode_record(
                    rec.payload, rec.encoding, rec.width, rec.height, rec.channels, self._get_decoder()
                )
            elif self.decoder == "pillow" and self.size_hint is None:
                sample = decode_rgb(rec.payload, rec.encoding, rec.width, rec.height)
            else:
                decoder = self._get_decoder()
                denom = 1
                if self.size_hint is not None:
                    denom = size_hint_scale(rec.width, rec.height, self.size_hint, decoder.scales)
                sample = to_pil(
                    decode_payload(rec.payload, rec.encoding, rec.width, rec.height, rec.channels, decoder, denom=denom)
                )
        except Exception as exc:  # decoders raise many exception types for bad data
            raise DecodeError(rec.index, self.reader.path_of(rec.index), f"{type(exc).__name__}: {exc}") from exc
        target: Any = rec.label
        if rest is not None:
            sample = rest(sample)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return sample, target

    def _get_decoder(self) -> Decoder:
        if self._decoder is None:
            self._decoder = get_decoder(self.decoder)
        return self._decoder

    def _fused_split(self) -> tuple[Any, Any]:
        # (fused crop or None, the transforms after it); recomputed only when
        # ``transform`` is replaced. A fused crop exists only if its module was
        # imported, so torchvision is never imported here for nothing.
        split = self._split
        if split is None or split[0] is not self.transform:
            crop, rest = None, self.transform
            fused = sys.modules.get("lmdbfolder.fused")
            if fused is not None and self.transform is not None:
                crop, rest = fused.split_fused(self.transform)
            split = self._split = (self.transform, crop, rest)
        return split[1], split[2]

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
        state["_decoder"] = None  # decoders hold library handles; made again per process
        state["_split"] = None
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

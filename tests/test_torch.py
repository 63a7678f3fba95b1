"""LMDBFolder against torchvision's ImageFolder, and through real DataLoader workers."""

from __future__ import annotations

import hashlib
import pickle
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader
from torchvision import transforms as T
from torchvision.datasets import ImageFolder

from lmdbfolder.torch import LMDBFolder
from lmdbfolder.write.writer import pack


@pytest.mark.parametrize("store", ["encoded", "raw"])
def test_identical_to_imagefolder(odd_tree: Path, tmp_path: Path, store: str) -> None:
    pack(odd_tree, tmp_path / "p", store=store, progress=False)
    ours = LMDBFolder(tmp_path / "p")
    theirs = ImageFolder(str(odd_tree))
    assert len(ours) == len(theirs)
    assert ours.classes == theirs.classes
    assert ours.class_to_idx == theirs.class_to_idx
    assert ours.targets == theirs.targets
    assert ours.samples == theirs.samples  # paths under the packed folder, as ImageFolder's
    assert ours.imgs == ours.samples
    for i in range(len(theirs)):
        a, ta = ours[i]
        b, tb = theirs[i]
        assert ta == tb
        assert a.mode == b.mode == "RGB"
        assert a.size == b.size
        assert a.tobytes() == b.tobytes(), theirs.samples[i][0]


def test_transforms_are_applied(small_pack: Path) -> None:
    ds = LMDBFolder(small_pack, transform=T.PILToTensor(), target_transform=lambda t: t + 100)
    x, y = ds[0]
    assert isinstance(x, torch.Tensor) and x.dtype == torch.uint8 and x.shape[0] == 3
    assert y == 100
    assert "Number of datapoints: 12" in repr(ds)


def test_pickled_dataset_is_small_and_carries_no_lists(small_pack: Path) -> None:
    ds = LMDBFolder(small_pack)
    _ = ds.samples, ds.targets, ds[0]
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._samples is None and clone._targets is None
    assert clone.targets == ds.targets
    assert clone[3][1] == ds[3][1]


def _digests(loader: DataLoader) -> Counter:
    seen: Counter = Counter()
    for images, targets in loader:
        for img, t in zip(images, targets):
            seen[(hashlib.sha1(img.numpy().tobytes()).hexdigest(), int(t))] += 1
    return seen


@pytest.mark.parametrize("context", ["fork", "spawn"])
@pytest.mark.parametrize("parent_reads_first", [False, True])
def test_dataloader_workers_see_every_sample_once_per_epoch(
    small_pack: Path, context: str, parent_reads_first: bool
) -> None:
    transform = T.Compose([T.Resize((8, 8)), T.PILToTensor()])
    ds = LMDBFolder(small_pack, transform=transform)
    expected = Counter((hashlib.sha1(ds[i][0].numpy().tobytes()).hexdigest(), ds.targets[i]) for i in range(len(ds)))
    assert len(expected) == len(ds)  # every image is distinct
    fresh = LMDBFolder(small_pack, transform=transform)
    if parent_reads_first:
        fresh[0]  # the parent now holds the environment open when the workers start
    loader = DataLoader(
        fresh,
        batch_size=5,
        shuffle=True,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context=context,
    )
    for _epoch in range(2):
        assert _digests(loader) == expected


@pytest.mark.parametrize("workers", [0, 4])
def test_dataloader_worker_counts(small_pack: Path, workers: int) -> None:
    ds = LMDBFolder(small_pack, transform=T.Compose([T.Resize((8, 8)), T.PILToTensor()]))
    loader = DataLoader(ds, batch_size=3, num_workers=workers)
    for _ in range(2):
        targets = [int(t) for _, ts in loader for t in ts]
        assert targets == ds.targets


def test_flat_pack_targets_are_minus_one(small_tree: Path, tmp_path: Path) -> None:
    pack(small_tree, tmp_path / "flat", layout="flat", progress=False)
    ds = LMDBFolder(tmp_path / "flat")
    assert ds.classes == [] and set(ds.targets) == {-1}
    assert ds[0][1] == -1

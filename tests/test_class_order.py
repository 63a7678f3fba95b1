"""``class_order="timm"``: classes numbered as timm's folder dataset numbers them.

timm's ``ImageDataset`` sorts class folders with ``natural_key`` (lower-cased,
digit runs compared as integers: ``cat, class2, class10, Dog``); torchvision's
ImageFolder, and a pack, with ``sorted`` (``Dog, a_1, a_10, ...``). A model
trained through one and evaluated through the other scores as if its labels
were shuffled. Checked against a reimplementation of timm's rule, and against
timm itself where it is installed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import DataLoader
from torchvision import transforms as T
from torchvision.datasets import ImageFolder

from conftest import image_bytes, write
from lmdbfolder import fused
from lmdbfolder.errors import OptionError
from lmdbfolder.read.class_order import natural_key
from lmdbfolder.torch import LMDBDatasetFolder, LMDBFolder
from lmdbfolder.write.shards import pack_sharded
from lmdbfolder.write.writer import pack

NAMES = ["cat", "class2", "class10", "Dog", "a_1", "a_10", "a_2"]


def timms_rule(names: list[str]) -> dict[str, int]:
    """timm's ``find_images_and_targets``: ``sorted(set(labels), key=natural_key)``, written anew."""

    def key(s: str) -> list[object]:
        return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", s.lower())]

    return {c: i for i, c in enumerate(sorted(names, key=key))}


@pytest.fixture
def named(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A tree whose class names sort differently in the two orders; its pack and a sharded pack."""
    rng = np.random.default_rng(3)
    tree = tmp_path / "tree"
    for c, name in enumerate(NAMES):
        for k in range(2):
            data, ext = image_bytes("rgb_jpeg", rng, w=24 + c, h=20 + k)
            write(tree / name / f"{k}{ext}", data)
    pack(tree, tmp_path / "pack", progress=False)
    pack_sharded(tree, tmp_path / "sharded", shards=3, progress=False)
    return tree, tmp_path / "pack", tmp_path / "sharded"


def test_the_rule_is_timms() -> None:
    assert sorted(NAMES, key=natural_key) == ["a_1", "a_2", "a_10", "cat", "class2", "class10", "Dog"]
    assert timms_rule(NAMES) == {c: i for i, c in enumerate(sorted(NAMES, key=natural_key))}


def _expected_samples(tree: Path, order: dict[str, int]) -> list[tuple[str, int]]:
    # ImageFolder's samples (paths, in its order) with timm's class numbers.
    theirs = ImageFolder(str(tree))
    return [(p, order[theirs.classes[t]]) for p, t in theirs.samples]


@pytest.mark.parametrize("which", ["pack", "sharded"])
def test_every_label_follows_timms_order(named: tuple[Path, Path, Path], which: str) -> None:
    tree, packed, sharded = named
    root = packed if which == "pack" else sharded
    order = timms_rule(NAMES)
    ds = LMDBFolder(root, class_order="timm")
    assert ds.class_to_idx == order
    assert ds.classes == sorted(order, key=order.__getitem__)
    expected = _expected_samples(tree, order)
    assert ds.samples == expected
    assert ds.targets == [t for _, t in expected]
    assert [ds[i][1] for i in range(len(ds))] == ds.targets  # one sample at a time
    assert [t for _, t in ds.__getitems__(list(range(len(ds))))] == ds.targets  # a batch
    # the batch fast path (fused crop into one tensor), through DataLoader workers
    ds.transform = T.Compose([fused.RandomResizedCrop(16, output="tensor")])
    batches = DataLoader(ds, batch_size=4, num_workers=1)
    assert [int(t) for _, targets in batches for t in targets] == ds.targets
    ds.transform = None

    # a find_classes override starting from super() gets timm's numbers
    class Keep(LMDBFolder):
        def find_classes(self, directory: str | os.PathLike[str]) -> tuple[list[str], dict[str, int]]:
            classes, class_to_idx = super().find_classes(directory)
            return classes, class_to_idx

    assert Keep(root, class_order="timm").class_to_idx == order
    assert "Class order: timm" in repr(ds)
    # DatasetFolder's order, same keyword
    assert LMDBDatasetFolder(root, None, class_order="timm").targets == ds.targets


def test_the_default_is_torchvisions_sorted_order(named: tuple[Path, Path, Path]) -> None:
    tree, packed, _ = named
    theirs, ours = ImageFolder(str(tree)), LMDBFolder(packed)
    assert ours.class_to_idx == theirs.class_to_idx == {c: i for i, c in enumerate(sorted(NAMES))}
    assert ours.samples == theirs.samples
    assert LMDBFolder(packed, class_order="sorted").targets == theirs.targets


def test_an_unknown_order_is_refused(named: tuple[Path, Path, Path]) -> None:
    _, packed, _ = named
    for bad in ("natural", "TIMM", None, 1):
        with pytest.raises(OptionError, match=r"class_order must be one of 'sorted', 'timm'"):
            LMDBFolder(packed, class_order=bad)  # type: ignore[arg-type]


def test_timms_own_dataset_agrees(named: tuple[Path, Path, Path]) -> None:
    timm_data = pytest.importorskip("timm.data")
    tree, packed, sharded = named
    theirs = timm_data.ImageDataset(str(tree))
    reader = theirs.reader
    for root in (packed, sharded):
        ours = LMDBFolder(root, class_order="timm")
        assert ours.class_to_idx == reader.class_to_idx
        # per sample (timm's sample order is its own natural path order: compare by path)
        assert dict(ours.samples) == {p: t for p, t in reader.samples}
        assert sorted(ours.filenames()) == sorted(reader.filename(i) for i in range(len(reader)))
        by_path = {p: i for i, (p, _) in enumerate(ours.samples)}
        for i in range(len(theirs)):
            _, target = theirs[i]
            assert ours[by_path[reader.samples[i][0]]][1] == target

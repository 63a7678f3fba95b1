"""torchvision's own dataset test cases for DatasetFolder and ImageFolder, run on the pack classes.

torchvision tests a dataset class through a harness (``test/datasets_utils.py``
in pytorch/vision) that reads the class's signature: every positional
parameter with a default becomes an entry of the config, and the dataset is
built as ``DATASET_CLASS(*dataset_args, **config)``, where ``dataset_args``
is ``(root, loader)`` for DatasetFolder. A drop-in must therefore have the
same signature, down to which parameters have defaults: with a default for
``loader``, the config holds ``loader=None`` next to the positional loader
and every case fails with "got multiple values for argument 'loader'".

Here the harness's rules are applied to ``LMDBDatasetFolder`` and
``LMDBFolder`` (the tree torchvision's cases make, packed first; the pack is
the root) and its cases are run: not found, smoke, repr, feature types,
number of examples, transforms, classes, is_valid_file, allow_empty; for
every config of the DatasetFolder case (extensions jpg+png, jpg, png). Then
the behaviours a subclass relies on: ``find_classes(directory)`` gets the
pack, and ``self.loader(self.samples[i][0])`` reads the pack.
"""

from __future__ import annotations

import inspect
import os
import pathlib
import shutil
from pathlib import Path
from typing import Any, Iterator
from unittest import mock

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import transforms as T
from torchvision.datasets import DatasetFolder, ImageFolder, VisionDataset
from torchvision.datasets.folder import default_loader, pil_loader

from lmdbfolder.errors import NoSamplesError
from lmdbfolder.torch import LMDBDatasetFolder, LMDBFolder, PackLoader
from lmdbfolder.write.shards import pack_sharded
from lmdbfolder.write.writer import pack

SPECIAL = {"transform", "target_transform", "transforms", "download"}
EXTENSIONS = ("jpg", "png")


def harness_defaults(cls: type) -> tuple[dict[str, Any], set[str]]:
    """The config torchvision's harness derives from ``cls.__init__``: the positional
    parameters that have defaults (following ``**kwargs`` up the base classes), less
    the transforms, which it passes separately; and which of those the class takes."""
    found: list[dict[str, Any]] = []
    for klass in cls.__mro__:
        if klass is VisionDataset:
            break
        spec = inspect.getfullargspec(klass.__init__)  # type: ignore[misc]
        if not spec.defaults:
            continue
        named = spec.args[len(spec.args) - len(spec.defaults) :]
        found.append(dict(zip(named, spec.defaults)))
        if not spec.varkw:
            break
    merged: dict[str, Any] = {}
    for d in reversed(found):
        merged.update(d)
    special = {k for k in merged if k in SPECIAL}
    return {k: v for k, v in merged.items() if k not in SPECIAL}, special


def save_image(path: Path, rng: np.random.Generator) -> None:
    h, w = (int(x) for x in rng.integers(3, 11, size=2))
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)


def datasetfolder_data(root: Path, config: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """DatasetFolderTestCase's fake data: class ``a`` of .jpg, ``b`` of .png (1 or 2 each, for the
    extensions the config asks for), and an empty class folder when ``make_empty_class``."""
    extensions = config["extensions"] or {e for e in EXTENSIONS if config["is_valid_file"](f"foo.{e}")}
    total, classes = 0, []
    for ext, cls in zip(EXTENSIONS, "ab"):
        if ext not in extensions:
            continue
        n = int(rng.integers(1, 3))
        for i in range(n):
            save_image(root / cls / f"{cls}_{i}.{ext}", rng)
        total += n
        classes.append(cls)
    if config.pop("make_empty_class", False):
        (root / "empty_class").mkdir(parents=True)
        classes.append("empty_class")
    root.mkdir(parents=True, exist_ok=True)
    return {"num_examples": total, "classes": classes}


def imagefolder_data(root: Path, config: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """ImageFolderTestCase's fake data: classes ``a`` and ``b`` of 1 or 2 PNGs each."""
    total = 0
    for cls in ("a", "b"):
        n = int(rng.integers(1, 3))
        for i in range(n):
            save_image(root / cls / f"{cls}_{i}.png", rng)
        total += n
    return {"num_examples": total, "classes": ["a", "b"]}


class Case:
    """One of torchvision's test cases, with a pack's class in place of torchvision's."""

    def __init__(self, cls: type, tmp: Path, *, loader_arg: bool, default_config: dict[str, Any]) -> None:
        self.cls = cls
        self.tmp = tmp
        self.loader_arg = loader_arg
        self.default_config = default_config
        self.defaults, self.special = harness_defaults(cls)
        self.made = 0

    def create(self, config: dict[str, Any] | None = None, *, inject: bool = True, **kwargs: Any) -> Any:
        """``create_dataset``: the config completed from the signature's defaults, the fake
        tree packed (the pack is the root), the class called as the harness calls it."""
        special = {k: v for k, v in kwargs.items() if k in SPECIAL}
        complete = dict(self.defaults)
        complete.update(self.default_config)
        complete.update(config or {})
        complete.update({k: v for k, v in kwargs.items() if k not in SPECIAL})
        self.made += 1
        tree, packed = self.tmp / f"tree{self.made}", self.tmp / f"pack{self.made}"
        info = None
        if inject:
            rng = np.random.default_rng(self.made)
            make = datasetfolder_data if self.loader_arg else imagefolder_data
            info = make(tree, complete, rng)
            pack(tree, packed, allow_empty=complete.get("allow_empty", False), progress=False)
        args = (packed, pil_loader) if self.loader_arg else (packed,)
        return self.cls(*args, **complete, **special), info

    def configs(self) -> Iterator[dict[str, Any]]:
        if not self.loader_arg:
            yield {}
            return
        yield {"extensions": EXTENSIONS}
        for ext in EXTENSIONS:
            yield {"extensions": (ext,)}


def datasetfolder_case(tmp_path: Path) -> Case:
    return Case(LMDBDatasetFolder, tmp_path, loader_arg=True, default_config={"extensions": EXTENSIONS})


@pytest.fixture(params=["DatasetFolder", "ImageFolder"])
def case(request: pytest.FixtureRequest, tmp_path: Path) -> Case:
    if request.param == "DatasetFolder":
        return datasetfolder_case(tmp_path)
    return Case(LMDBFolder, tmp_path, loader_arg=False, default_config={})


def test_signatures_are_torchvisions() -> None:
    """The parameters torchvision's classes have, in their order, of their kind, with their defaults;
    the pack's own options after them, keyword-only."""

    def params(cls: type) -> list[tuple[str, Any, Any]]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(cls.__init__).parameters.values()]  # type: ignore[misc]

    for ours, theirs in ((LMDBDatasetFolder, DatasetFolder), (LMDBFolder, ImageFolder)):
        mine, tv = params(ours), params(theirs)
        assert mine[: len(tv)] == tv, ours.__name__
        extra = mine[len(tv) :]
        assert extra and all(kind is inspect.Parameter.KEYWORD_ONLY for _, kind, _ in extra)
        assert all(default is not inspect.Parameter.empty for _, _, default in extra)
    # what the harness reads from them: the same config keys, the same special ones
    assert harness_defaults(LMDBDatasetFolder) == harness_defaults(DatasetFolder)
    assert harness_defaults(LMDBFolder) == harness_defaults(ImageFolder)


def test_not_found_or_corrupted(case: Case) -> None:
    with pytest.raises((FileNotFoundError, RuntimeError)):
        case.create(inject=False)
    (case.tmp / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="Couldn't find any class folder"):
        pack(case.tmp / "empty", case.tmp / "empty.lmdb", progress=False)  # what a tree without classes gives


def test_smoke_str_feature_types_num_examples(case: Case) -> None:
    for config in case.configs():
        ds, info = case.create(config)
        assert isinstance(ds, VisionDataset) and isinstance(str(ds), str)
        image, target = ds[0]
        assert isinstance(image, Image.Image) and isinstance(target, int)
        assert len(ds) == info["num_examples"]


def test_transforms(case: Case) -> None:
    assert case.special == {"transform", "target_transform"}
    for config in case.configs():
        for kwarg in sorted(case.special):
            spy = mock.Mock(wraps=lambda *args: args[0] if len(args) == 1 else args)
            ds, _ = case.create(config, **{kwarg: spy})
            ds[0]
            spy.assert_called()


def test_classes(case: Case) -> None:
    for config in case.configs():
        ds, info = case.create(config)
        assert ds.classes == info["classes"]


def test_is_valid_file(tmp_path: Path) -> None:  # DatasetFolderTestCase's own case
    case = datasetfolder_case(tmp_path)
    for config in case.configs():
        extensions = config.pop("extensions")
        ds, info = case.create(
            config, extensions=None, is_valid_file=lambda file, exts=extensions: pathlib.Path(file).suffix[1:] in exts
        )
        assert len(ds) == info["num_examples"]


def test_allow_empty(tmp_path: Path) -> None:  # DatasetFolderTestCase's own case
    case = datasetfolder_case(tmp_path)
    config = {"extensions": EXTENSIONS, "make_empty_class": True, "allow_empty": True}
    ds, info = case.create(dict(config))
    assert "empty_class" in ds.classes and ds.classes == info["classes"]
    # packing the tree with the empty class refuses it as ImageFolder does: FileNotFoundError, its words
    with pytest.raises(FileNotFoundError, match="Found no valid file") as refused:
        case.create(dict(config, allow_empty=False))
    assert "Found no valid file for the classes empty_class. Supported extensions are: " in str(refused.value)
    theirs = pytest.raises(FileNotFoundError, match="Found no valid file")
    with theirs:
        DatasetFolder(str(case.tmp / f"tree{case.made}"), pil_loader, EXTENSIONS)  # the oracle, same tree
    # a pack that kept the empty class (--allow-empty), read without allow_empty: the same error
    pack(case.tmp / f"tree{case.made}", case.tmp / "kept", allow_empty=True, progress=False)
    with pytest.raises(FileNotFoundError, match="Found no valid file for the classes empty_class"):
        LMDBDatasetFolder(case.tmp / "kept", pil_loader, EXTENSIONS)


# -- find_classes(directory): directory is the pack ------------------------------------------------------------
class ScanningImageFolder(ImageFolder):
    """A find_classes that lists class folders in ``directory`` (not torchvision's own function)."""

    def find_classes(self, directory: Any) -> tuple[list[str], dict[str, int]]:
        classes = sorted(e.name for e in os.scandir(directory) if e.is_dir())
        return classes, {c: i for i, c in enumerate(classes)}


class ScanningLMDBFolder(LMDBFolder):
    find_classes = ScanningImageFolder.find_classes  # type: ignore[assignment]


class PackClassesLMDBFolder(LMDBFolder):
    """The documented way: start from the pack's classes."""

    def find_classes(self, directory: Any) -> tuple[list[str], dict[str, int]]:
        classes, _ = super().find_classes(directory)
        kept = [c for c in classes if c != "a"]
        return kept, {c: i for i, c in enumerate(kept)}


def make_tree(root: Path, per_class: int = 15) -> Path:
    rng = np.random.default_rng(3)
    for cls in ("a", "b"):
        for i in range(per_class):
            save_image(root / cls / f"{i}.png", rng)
    return root


def test_a_find_classes_that_scans_directory_finds_no_class_in_a_pack(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "tree")
    theirs = ScanningImageFolder(str(tree))
    assert len(theirs.classes) == 2 and len(theirs) == 30
    pack(tree, tmp_path / "p", progress=False)
    with pytest.raises(FileNotFoundError, match="Couldn't find any class folder") as info:
        ScanningLMDBFolder(tmp_path / "p")  # was: 0 classes, 0 samples, no error
    assert isinstance(info.value, NoSamplesError)
    assert "super().find_classes(directory)" in str(info.value) and str(tree) in str(info.value)
    ours = PackClassesLMDBFolder(tmp_path / "p")
    assert ours.classes == ["b"] and len(ours) == 15 and set(ours.targets) == {0}
    # a sharded pack holds folders (its shards): they are no classes of it, and that is an error too
    pack_sharded(tree, tmp_path / "sharded", shards=2, progress=False)
    with pytest.raises(FileNotFoundError, match="Found no valid file for the classes"):
        ScanningLMDBFolder(tmp_path / "sharded")


# -- __getitem__ overrides written for ImageFolder: self.loader(self.samples[i][0]) --------------------------
class CopiedGetitem(LMDBFolder):
    """DatasetFolder.__getitem__'s body, with the index added (a common subclass)."""

    def __getitem__(self, index: int) -> tuple[Any, Any, int]:
        path, target = self.samples[index]
        sample = self.loader(path)
        if self.transform is not None:
            sample = self.transform(sample)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return sample, target, index


def test_a_getitem_override_that_calls_the_loader_reads_the_pack(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "tree", per_class=4)
    pack(tree, tmp_path / "p", progress=False)
    tf = T.Compose([T.Resize((5, 5)), T.PILToTensor()])
    theirs = [(ImageFolder(str(tree), tf)[i], i) for i in range(8)]
    shutil.rmtree(tree)  # the tree is gone: only the pack is left
    ds = CopiedGetitem(tmp_path / "p", transform=tf)
    for (image, target), i in theirs:
        got = ds[i]
        assert torch.equal(got[0], image) and got[1:] == (target, i)
    for context in ("fork", "spawn"):
        loader = DataLoader(ds, batch_size=3, num_workers=1, multiprocessing_context=context)
        images = torch.cat([batch[0] for batch in loader])
        assert torch.equal(images, torch.stack([image for (image, _), _ in theirs]))
    assert isinstance(ds.loader, PackLoader) and ds.loader.__wrapped__ is default_loader


def test_the_loader_attribute_on_other_paths(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "tree", per_class=2)
    pack(tree, tmp_path / "p", progress=False)
    raw = LMDBFolder(tmp_path / "p", loader=lambda p: Path(p).read_bytes())
    expected = (tree / "a" / "0.png").read_bytes()
    shutil.rmtree(tree)
    assert raw.loader(raw.samples[0][0]) == expected  # a custom loader gets the stored bytes' file
    own = tmp_path / "mine.png"
    save_image(own, np.random.default_rng(0))
    assert raw.loader(str(own)) == own.read_bytes()  # a file that is no sample: read as it is
    ds = LMDBFolder(tmp_path / "p")
    with pytest.raises(FileNotFoundError, match=r"super\(\).__getitem__\(index\)") as info:
        ds.loader(str(tmp_path / "elsewhere" / "x.png"))
    assert "is no sample of the pack" in str(info.value)
    ds.loader = pil_loader  # assignable, as ImageFolder's attribute
    assert ds.loader.__wrapped__ is pil_loader and ds[0][0].size == ds.loader(ds.samples[0][0]).size

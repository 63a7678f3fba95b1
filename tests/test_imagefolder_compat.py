"""LMDBFolder against torchvision's ImageFolder and DatasetFolder, behaviour by behaviour.

The behaviours are those torchvision's own test cases check for ImageFolder
and DatasetFolder (smoke, classes, transforms, the v2 wrapper, not found,
allow_empty, is_valid_file, extensions), plus the rest of their documented
surface (loader, samples/imgs/targets and assigning them, find_classes and
make_dataset overrides, argument order). Each test builds the same fake tree,
runs torchvision's class on it as the oracle and LMDBFolder on a pack of it.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import DataLoader
from torchvision import transforms as T
from torchvision.datasets import DatasetFolder, ImageFolder, VisionDataset, wrap_dataset_for_transforms_v2
from torchvision.datasets.folder import default_loader, pil_loader
from torchvision.datasets.vision import StandardTransform
from torchvision.transforms import v2

from conftest import image_bytes, write
from lmdbfolder import fused
from lmdbfolder.cli import main
from lmdbfolder.errors import (
    DecodeError,
    NoSamplesError,
    NotAPackError,
    OptionError,
    OutputExistsError,
    PackNotFoundError,
)
from lmdbfolder.read.opening import open_pack
from lmdbfolder.torch import LMDBDatasetFolder, LMDBFolder
from lmdbfolder.write.shards import pack_sharded
from lmdbfolder.write.writer import pack


# -- fake data, as torchvision's test cases make it ---------------------------------------------
def make_image_tree(root: Path, counts: dict[str, int] | None = None, seed: int = 0) -> Path:
    """ImageFolderTestCase's tree: classes ``a`` and ``b`` of small PNGs named ``<class>_<i>.png``."""
    rng = np.random.default_rng(seed)
    for c, n in (counts or {"a": 2, "b": 3}).items():
        for i in range(n):
            data, _ = image_bytes("rgba_png" if i % 2 else "rgb_jpeg", rng, w=5 + i, h=4 + len(c))
            # PNG and JPEG bytes both under .png: Pillow goes by content, as ImageFolder does
            write(root / c / f"{c}_{i}.png", data)
    return root


def make_mixed_tree(root: Path, *, empty_class: bool = False, seed: int = 1) -> Path:
    """DatasetFolderTestCase's tree: class ``a`` holds .jpg files, class ``b`` .png files."""
    rng = np.random.default_rng(seed)
    for c, kind in (("a", "rgb_jpeg"), ("b", "gray_png")):
        for i in range(3):
            data, ext = image_bytes(kind, rng, w=6 + i, h=5)
            write(root / c / f"{c}_{i}{ext.replace('.jpeg', '.jpg')}", data)
    write(root / "a" / "notes.txt", b"not an image")
    if empty_class:
        (root / "empty_class").mkdir()
    return root


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return make_image_tree(tmp_path / "tree")


@pytest.fixture
def packed(tree: Path, tmp_path: Path) -> Path:
    pack(tree, tmp_path / "tree.lmdb", progress=False)
    return tmp_path / "tree.lmdb"


@pytest.fixture
def mixed(tmp_path: Path) -> Path:
    return make_mixed_tree(tmp_path / "mixed")


@pytest.fixture
def mixed_pack(mixed: Path, tmp_path: Path) -> Path:
    # Everything DatasetFolder could be asked for, so that read-time filters have work to do.
    pack(mixed, tmp_path / "mixed.lmdb", extensions=(".jpg", ".png", ".txt"), check="none", progress=False)
    return tmp_path / "mixed.lmdb"


def assert_same_dataset(ours: Any, theirs: Any) -> None:
    """Same length, samples, targets, and the same item at every index (pixels, tensors or values)."""
    assert len(ours) == len(theirs)
    assert ours.samples == theirs.samples
    assert list(ours.targets) == [t for _, t in theirs.samples]
    assert ours.classes == theirs.classes and ours.class_to_idx == theirs.class_to_idx
    for i in range(len(theirs)):
        assert_same_item(ours[i], theirs[i])


def assert_same_item(a: Any, b: Any) -> None:
    assert type(a) is type(b) or (isinstance(a, Image.Image) and isinstance(b, Image.Image))
    if isinstance(a, tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_item(x, y)
    elif isinstance(a, Image.Image):
        assert (a.mode, a.size, a.tobytes()) == (b.mode, b.size, b.tobytes())
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    else:
        assert a == b


# -- smoke: what every torchvision dataset test checks ----------------------------------------------
def test_smoke_is_a_vision_dataset_with_imagefolder_features(packed: Path, tree: Path) -> None:
    ds = LMDBFolder(packed)
    assert isinstance(ds, VisionDataset) and isinstance(ds, ImageFolder) and isinstance(ds, DatasetFolder)
    assert isinstance(LMDBDatasetFolder(packed, pil_loader), DatasetFolder)
    img, target = ds[0]
    assert isinstance(img, Image.Image) and type(target) is int
    assert len(ds) == len(ImageFolder(str(tree)))
    text = str(ds)
    assert text.startswith("Dataset LMDBFolder\n    Number of datapoints: 5\n    Root location: ")
    assert f"Source root: {tree}" in text  # extra_repr
    assert all("    " + line in text for line in ds.extra_repr().splitlines())


def test_classes(packed: Path, tree: Path) -> None:
    theirs = ImageFolder(str(tree))
    ours = LMDBFolder(packed)
    assert ours.classes == theirs.classes == ["a", "b"]
    assert ours.class_to_idx == theirs.class_to_idx
    for c in ours.classes:
        assert ours.classes[ours.class_to_idx[c]] == c


def test_everything_matches_imagefolder(packed: Path, tree: Path) -> None:
    assert_same_dataset(LMDBFolder(packed), ImageFolder(str(tree)))


# -- transforms -------------------------------------------------------------------------------------
def test_transforms_are_called_and_combined_as_in_imagefolder(packed: Path, tree: Path) -> None:
    for kwarg in ("transform", "target_transform"):
        spy = mock.Mock(wraps=lambda x: x)
        LMDBFolder(packed, **{kwarg: spy})[0]
        spy.assert_called_once()
    tf, ttf = T.Compose([T.Resize((3, 4)), T.PILToTensor()]), (lambda t: t + 10)
    ours = LMDBFolder(packed, tf, ttf)  # ImageFolder's positional order
    theirs = ImageFolder(str(tree), tf, ttf)
    assert isinstance(ours.transforms, StandardTransform)
    assert ours.transforms.transform is tf and ours.transforms.target_transform is ttf
    assert repr(ours.transforms) == repr(theirs.transforms) and repr(ours.transforms) in repr(ours)
    for i in range(len(theirs)):
        assert_same_item(ours[i], theirs[i])


def test_fused_crop_is_recognised_in_both_composes(packed: Path, tree: Path) -> None:
    for compose, to_tensor in ((T.Compose, T.PILToTensor()), (v2.Compose, v2.PILToTensor())):
        # reduce=False with the Pillow resize: pixel-identical to the unfused crop (fused.py)
        crop = fused.RandomResizedCrop(4, reduce=False, resize="pil")
        tf = compose([crop, to_tensor])
        ours = LMDBFolder(packed, transform=tf)
        plan = ours._plan()
        assert plan.crop is crop and type(plan.rest) is compose and plan.rest.transforms == [to_tensor]
        with mock.patch.object(plan.read, "run", wraps=plan.read.run) as spy:
            torch.manual_seed(3)
            fused_out = [ours[i][0] for i in range(len(ours))]
        assert spy.call_count == len(ours)  # decoded by the fused crop, not decoded and then cropped
        torch.manual_seed(3)
        oracle = [ImageFolder(str(tree), transform=tf)[i][0] for i in range(len(ours))]
        for a, b in zip(fused_out, oracle):
            assert torch.equal(a, b)


def test_a_transform_changed_in_place_is_applied_as_it_is_now(packed: Path, tree: Path) -> None:
    # Training scripts change the transform between epochs in place (progressive
    # resizing: ``tf.transforms[0].size = (s, s)``); ImageFolder applies it as it is now.
    for first in (T.RandomResizedCrop(3), fused.RandomResizedCrop(3, reduce=False, resize="pil")):
        tf = T.Compose([first, T.RandomHorizontalFlip(0.0), T.PILToTensor()])
        ours, theirs = LMDBFolder(packed, transform=tf), ImageFolder(str(tree), transform=tf)
        assert_same_draws(ours, theirs)
        first.size = (4, 5)
        assert_same_draws(ours, theirs)
        first.scale, first.ratio = (0.5, 0.6), (0.5, 0.5)
        assert_same_draws(ours, theirs)
        tf.transforms[1].p = 1.0
        assert_same_draws(ours, theirs)
        tf.transforms[1] = T.RandomVerticalFlip(1.0)
        assert_same_draws(ours, theirs)
        tf.transforms.append(T.ConvertImageDtype(torch.float32))
        assert_same_draws(ours, theirs)


def assert_same_draws(ours: LMDBFolder, theirs: ImageFolder) -> None:
    """Every sample the same, one by one and as one batch, from the same random numbers."""
    torch.manual_seed(5)
    want = [theirs[i][0] for i in range(len(theirs))]
    torch.manual_seed(5)
    one_by_one = [ours[i][0] for i in range(len(ours))]
    torch.manual_seed(5)
    batched = [image for image, _ in ours.__getitems__(list(range(len(ours))))]
    for a, b, c in zip(one_by_one, batched, want):
        assert_same_item(a, c)
        assert_same_item(b, c)


# -- the v2 wrapper -----------------------------------------------------------------------------------
def test_transforms_v2_wrapper(packed: Path, tree: Path) -> None:
    tf = v2.Compose([v2.ToImage(), v2.Resize((7, 9))])
    ours = wrap_dataset_for_transforms_v2(LMDBFolder(packed, transform=tf))
    theirs = wrap_dataset_for_transforms_v2(ImageFolder(str(tree), transform=tf))
    assert isinstance(ours, LMDBFolder)
    assert len(ours) == len(theirs)
    for i in range(len(theirs)):
        assert_same_item(ours[i], theirs[i])
    # and through spawned workers, as torchvision's check_transforms_v2_wrapper_spawn
    loader = DataLoader(ours, batch_size=2, num_workers=2, multiprocessing_context="spawn")
    images = [img for batch, _ in loader for img in batch]
    assert all(tuple(img.shape) == (3, 7, 9) for img in images) and len(images) == len(theirs)


# -- not found -------------------------------------------------------------------------------------------
def test_not_found_is_a_file_not_found_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError):  # the oracle: an empty root
        ImageFolder(str(tmp_path / "empty"))
    for missing in (tmp_path / "missing", tmp_path / "empty"):
        with pytest.raises(FileNotFoundError) as info:
            LMDBFolder(missing)
        assert isinstance(info.value, NotAPackError) and isinstance(info.value, PackNotFoundError)
        assert info.value.filename == str(missing) and info.value.errno == 2
        clone = pickle.loads(pickle.dumps(info.value))
        assert isinstance(clone, FileNotFoundError) and clone.filename == str(missing) and str(clone) == str(info.value)


def test_an_image_folder_is_pointed_at_the_pack_command(tree: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        LMDBFolder(tree)
    assert "this is an image folder" in str(info.value)
    assert f"lmdbfolder pack {tree} {tree}.lmdb" in str(info.value)


def test_home_is_expanded_everywhere(tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    pack("~/tree", "~/home.lmdb", progress=False)
    assert (tmp_path / "home.lmdb" / "data.mdb").is_file()
    ds = LMDBFolder("~/home.lmdb", source_root="~/moved")
    assert ds.root == str(tmp_path / "home.lmdb")
    assert ds.samples[0][0] == str(tmp_path / "moved" / "a" / "a_0.png")
    pack_sharded("~/tree", "~/sharded", shards=2, progress=False)
    assert len(LMDBFolder("~/sharded")) == 5


def test_a_path_root_stays_a_path(tree: Path, packed: Path, tmp_path: Path) -> None:
    # ImageFolder keeps the root it was given: a pathlib.Path stays one (code joins it with /).
    assert isinstance(ImageFolder(tree).root, Path)
    pack_sharded(tree, tmp_path / "sharded", shards=2, progress=False)
    for where in (packed, tmp_path / "sharded"):
        ours = LMDBFolder(Path(where))
        assert isinstance(ours.root, Path) and ours.root == where.absolute()
        assert isinstance(LMDBDatasetFolder(Path(where), pil_loader).root, Path)
        assert isinstance(LMDBFolder(str(where)).root, str)
        assert ours.classes == ImageFolder(tree).classes and len(ours) == len(ImageFolder(tree))
        again = pickle.loads(pickle.dumps(ours))
        assert again.root == ours.root and again[0][1] == ours[0][1]
        assert f"Root location: {ours.root}" in repr(ours)
        assert LMDBFolder.make_dataset(ours.root, ours.class_to_idx) == ours.samples


def test_sample_paths_are_relative_to_source_root_not_root(tree: Path, packed: Path) -> None:
    # As documented: the pack is not the folder the samples' paths start with, so
    # relpath(path, root) climbs out of the pack; relpath(path, source_root) and
    # filenames() give what ImageFolder's relpath(path, root) gives.
    theirs, ours = ImageFolder(str(tree)), LMDBFolder(packed)
    expected = [os.path.relpath(p, theirs.root) for p, _ in theirs.samples]
    assert [os.path.relpath(p, ours.source_root) for p, _ in ours.samples] == expected
    assert ours.filenames() == expected == [ours.filename(i) for i in range(len(ours))]
    assert os.path.relpath(ours.samples[0][0], ours.root).startswith("..")


# -- allow_empty ----------------------------------------------------------------------------------------
def test_allow_empty(tmp_path: Path) -> None:
    src = make_mixed_tree(tmp_path / "src", empty_class=True)
    theirs = ImageFolder(str(src), allow_empty=True)
    with pytest.raises(FileNotFoundError, match="Found no valid file"):
        ImageFolder(str(src))
    with pytest.raises(FileNotFoundError, match="Found no valid file for the classes empty_class"):
        pack(src, tmp_path / "p", progress=False)  # refused at pack time, as ImageFolder refuses
    pack(src, tmp_path / "p", allow_empty=True, progress=False)
    assert_same_dataset(LMDBFolder(tmp_path / "p", allow_empty=True), theirs)
    assert "empty_class" in LMDBFolder(tmp_path / "p", allow_empty=True).classes
    with pytest.raises(FileNotFoundError, match="Found no valid file for the classes empty_class") as info:
        LMDBFolder(tmp_path / "p")
    assert isinstance(info.value, NoSamplesError) and "allow_empty=True" in str(info.value)


# -- is_valid_file ---------------------------------------------------------------------------------------
def test_is_valid_file_at_read_time(packed: Path, tree: Path) -> None:
    def has_1(path: str) -> bool:
        return "_1" in path

    assert_same_dataset(LMDBFolder(packed, is_valid_file=has_1), ImageFolder(str(tree), is_valid_file=has_1))
    seen: list[str] = []
    LMDBFolder(packed, is_valid_file=lambda p: seen.append(p) or True)
    assert seen == [p for p, _ in ImageFolder(str(tree)).samples]  # called with ImageFolder's paths
    # one class left empty: ImageFolder's error, and its allow_empty
    only_b = LMDBFolder(packed, is_valid_file=lambda p: "/b/" in p, allow_empty=True)
    assert_same_dataset(only_b, ImageFolder(str(tree), is_valid_file=lambda p: "/b/" in p, allow_empty=True))
    with pytest.raises(FileNotFoundError, match="Found no valid file for the classes a"):
        LMDBFolder(packed, is_valid_file=lambda p: "/b/" in p)
    with pytest.raises(ValueError, match="extensions and is_valid_file"):
        LMDBFolder(packed, is_valid_file=has_1, extensions=(".png",))


def test_is_valid_file_at_pack_time(tree: Path, tmp_path: Path) -> None:
    def odd(path: str) -> bool:
        return path.endswith(("_1.png", "_0.png")) and "b_0" not in path

    pack(tree, tmp_path / "p", is_valid_file=odd, progress=False)
    assert_same_dataset(LMDBFolder(tmp_path / "p"), ImageFolder(str(tree), is_valid_file=odd))
    source = open_pack(tmp_path / "p").meta["source"]
    assert source["is_valid_file"].endswith("test_is_valid_file_at_pack_time.<locals>.odd")
    with pytest.raises(OptionError, match="extensions or is_valid_file, not both"):
        pack(tree, tmp_path / "q", is_valid_file=odd, extensions=(".png",), progress=False)


# -- extensions ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extensions", [("jpg", "png"), (".jpg", ".png"), "png"])
def test_extensions_at_read_time(mixed_pack: Path, mixed: Path, extensions: Any) -> None:
    theirs = DatasetFolder(str(mixed), pil_loader, extensions, allow_empty=True)
    ours = LMDBDatasetFolder(mixed_pack, pil_loader, extensions, allow_empty=True)  # DatasetFolder's order
    assert_same_dataset(ours, theirs)
    assert ours.extensions == tuple(e.lower() for e in ((extensions,) if isinstance(extensions, str) else extensions))


def test_a_filtered_out_class_is_empty_as_in_datasetfolder(mixed_pack: Path, mixed: Path) -> None:
    with pytest.raises(FileNotFoundError, match="Found no valid file for the classes b"):
        DatasetFolder(str(mixed), pil_loader, ("jpg",), allow_empty=False)  # oracle
    with pytest.raises(FileNotFoundError, match="Found no valid file for the classes b. Supported extensions are: jpg"):
        LMDBFolder(mixed_pack, extensions=("jpg",))


@pytest.mark.parametrize("extensions", [(".png",), (".jpg", ".png")])
def test_extensions_at_pack_time(mixed: Path, tmp_path: Path, extensions: tuple[str, ...]) -> None:
    pack(mixed, tmp_path / "p", extensions=extensions, allow_empty=True, progress=False)
    ours = LMDBFolder(tmp_path / "p", allow_empty=True)
    theirs = DatasetFolder(str(mixed), pil_loader, extensions, allow_empty=True)
    assert_same_dataset(ours, theirs)
    assert ours.extensions == extensions
    with open_pack(tmp_path / "p") as r:
        assert r.meta["source"]["extensions"] == list(extensions)
        assert r.meta["fingerprint"]["extensions"] == sorted(extensions)


def test_extensions_and_match_on_the_command_line(mixed: Path, tmp_path: Path) -> None:
    dst = tmp_path / "cli"
    assert main(["pack", str(mixed), str(dst), "--extensions", "jpg,.PNG", "--match", "_[01]\\.", "--no-progress"]) == 0
    with open_pack(dst) as r:
        assert r.paths() == ["a/a_0.jpg", "a/a_1.jpg", "b/b_0.png", "b/b_1.png"]
        assert r.meta["source"]["extensions"] == [".jpg", ".png"] and r.meta["source"]["match"] == "_[01]\\."
    info = json.loads(_run_json(["info", str(dst), "--json"]))
    assert info["count"] == 4
    assert main(["pack", str(mixed), str(tmp_path / "bad"), "--match", "(", "--no-progress"]) == 2


def _run_json(argv: list[str]) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


def test_other_extensions_do_not_resume_a_pack(mixed: Path, tmp_path: Path) -> None:
    os.symlink(mixed / "nowhere.jpg", mixed / "b" / "zz_broken.png")
    out = tmp_path / "p"
    with pytest.raises(Exception, match="broken symbolic link"):
        pack(mixed, out, extensions=(".png", ".jpg"), commit_every=1, strict=True, progress=False)
    with pytest.raises(OutputExistsError, match="extensions was"):
        pack(mixed, out, extensions=(".png",), allow_empty=True, progress=False)
    os.remove(mixed / "b" / "zz_broken.png")
    with pytest.raises(OutputExistsError, match="the list of source files"):
        pack(mixed, out, extensions=(".jpg", ".png"), progress=False)  # same filter, one file fewer
    assert pack(mixed, out, extensions=(".jpg", ".png"), restart=True, progress=False).count == 6


# -- loader --------------------------------------------------------------------------------------------
def copied_pil_loader(path: str) -> Image.Image:
    """pil_loader as many projects copy it: it opens the path itself."""
    with open(path, "rb") as f:
        return Image.open(f).convert("RGB")


def gray_loader(path: str) -> Image.Image:
    return Image.open(path).convert("L")


@pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities of TorchVision:DeprecationWarning")
def test_loaders_get_a_path_to_the_stored_bytes(packed: Path, tree: Path) -> None:
    from torchvision.io import ImageReadMode, decode_image, read_image

    for loader in (
        pil_loader,
        default_loader,
        copied_pil_loader,
        gray_loader,
        lambda p: Image.open(p),  # lazy: its pixels are read after the loader returned
        lambda p: decode_image(p, mode=ImageReadMode.RGB),
        read_image,
        lambda p: Path(p).read_bytes(),  # the packed bytes are the file's bytes
    ):
        assert_same_dataset(LMDBFolder(packed, loader=loader), ImageFolder(str(tree), loader=loader))
    # the original path, for loaders that look at the name; as ImageFolder's identity loader
    ours = LMDBFolder(packed, loader=lambda p: p.source)
    assert [ours[i] for i in range(len(ours))] == ImageFolder(str(tree), loader=lambda p: p).samples
    # the attribute: the loader given (default_loader when none), bound to the pack
    assert LMDBFolder(packed).loader.__wrapped__ is default_loader
    assert LMDBFolder(packed, loader=gray_loader).loader.__wrapped__ is gray_loader


def test_opencv_loader_reads_the_path(packed: Path, tree: Path) -> None:
    cv2 = pytest.importorskip("cv2")

    def loader(p: str) -> Any:
        return cv2.imread(p, cv2.IMREAD_UNCHANGED)

    ours, theirs = LMDBFolder(packed, loader=loader), ImageFolder(str(tree), loader=loader)
    for i in range(len(theirs)):
        assert np.array_equal(ours[i][0], theirs[i][0])


def test_a_loader_needs_stored_files(tree: Path, tmp_path: Path) -> None:
    pack(tree, tmp_path / "raw", store="raw", progress=False)
    with pytest.raises(OptionError, match="stores decoded pixels"):
        LMDBFolder(tmp_path / "raw", loader=gray_loader)
    assert_same_dataset(LMDBFolder(tmp_path / "raw", loader=pil_loader), ImageFolder(str(tree)))


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_an_error_in_a_dataloader_worker_keeps_its_type(mixed_pack: Path, mixed: Path, context: str) -> None:
    # torch re-raises a worker's error in the main process as a new one of its type,
    # made from the text alone (a RuntimeError when that fails): ImageFolder's
    # UnidentifiedImageError stays one; so must ours (``except DecodeError`` in the loop).
    theirs = ImageFolder(str(mixed), is_valid_file=lambda p: True)
    ours = LMDBFolder(mixed_pack)
    bad = ours.filenames().index(os.path.join("a", "notes.txt"))
    assert theirs.samples[bad] == ours.samples[bad]
    for ds, error in ((theirs, UnidentifiedImageError), (ours, DecodeError)):
        for batch_size in (None, 2):  # ds[i], and a batch (__getitems__)
            loader = DataLoader(
                ds, batch_size=batch_size, sampler=[0, bad], num_workers=1, multiprocessing_context=context
            )
            with pytest.raises(error) as info:
                list(loader)
            assert "notes.txt" in str(info.value) and "worker process 0" in str(info.value)
    clone = pickle.loads(pickle.dumps(info.value))
    assert type(clone) is DecodeError and str(clone) == str(info.value)


def test_a_failing_loader_says_which_record(packed: Path) -> None:
    def broken(path: str) -> Any:
        raise RuntimeError("cannot")

    with pytest.raises(RuntimeError, match="cannot") as info:
        LMDBFolder(packed, loader=broken)[3]
    if hasattr(info.value, "__notes__"):
        assert "record 3" in info.value.__notes__[0] and "b_1.png" in info.value.__notes__[0]


# -- argument order ---------------------------------------------------------------------------------------
def test_positional_orders(mixed_pack: Path, mixed: Path) -> None:
    tf, ttf = T.PILToTensor(), (lambda t: -t)
    args = (gray_loader, ("png",), tf, ttf, None, True)
    assert_same_dataset(LMDBDatasetFolder(mixed_pack, *args), DatasetFolder(str(mixed), *args))
    valid = (lambda p: p.endswith(".jpg")), True
    assert_same_dataset(
        LMDBFolder(mixed_pack, tf, ttf, gray_loader, *valid), ImageFolder(str(mixed), tf, ttf, gray_loader, *valid)
    )
    with pytest.raises(TypeError, match="use LMDBDatasetFolder"):
        LMDBFolder(mixed_pack, pil_loader)  # DatasetFolder's order given to the ImageFolder drop-in
    with pytest.raises(TypeError, match="use LMDBDatasetFolder"):
        LMDBFolder(mixed_pack, None, (".png",))


# -- samples, imgs, targets, and assigning them -------------------------------------------------------------
def test_samples_imgs_targets_and_filenames(packed: Path, tree: Path) -> None:
    ours, theirs = LMDBFolder(packed), ImageFolder(str(tree))
    assert ours.samples == theirs.samples and ours.imgs == theirs.imgs and ours.targets == theirs.targets
    assert ours.filenames() == [os.path.relpath(p, tree) for p, _ in theirs.samples]
    assert ours.filenames(basename=True) == [os.path.basename(p) for p, _ in theirs.samples]
    assert ours.filenames(absolute=True) == [p for p, _ in theirs.samples]
    assert ours.filename(-1) == "b/b_2.png" and ours.filename(0, absolute=True) == theirs.samples[0][0]
    moved = LMDBFolder(packed, source_root="/elsewhere")
    assert moved.samples[0] == ("/elsewhere/a/a_0.png", 0) and moved.filenames() == ours.filenames()


def test_assigning_samples_restricts_the_dataset_as_in_imagefolder(packed: Path, tree: Path) -> None:
    ours, theirs = LMDBFolder(packed), ImageFolder(str(tree))
    for ds in (ours, theirs):
        ds.samples = [s for s in ds.samples if not s[0].endswith("_1.png")]
    assert len(ours) == len(theirs) == 3
    assert ours.samples == theirs.samples
    for i in range(-len(theirs), len(theirs)):
        assert_same_item(ours[i], theirs[i])
    with pytest.raises(IndexError):
        ours[3]
    # ImageFolder leaves `targets` and `imgs` as they were; here they follow the samples
    assert ours.targets == [t for _, t in theirs.samples] and ours.imgs == ours.samples
    assert _same_batch(ours, [2, 0])
    # reordered and relabelled: what each sample is loaded with comes from samples
    for ds in (ours, theirs):
        ds.samples = [(p, 7) for p, _ in reversed(ds.samples)]
    for i in range(len(theirs)):
        assert_same_item(ours[i], theirs[i])
    assert ours.targets == [7, 7, 7]
    with pytest.raises(ValueError, match="is not a sample of the pack"):
        ours.samples = [(str(tree / "a" / "nope.png"), 0)]
    with pytest.raises(TypeError, match="assign a new list"):
        ours.samples.append(ours.samples[0])


def _same_batch(ds: Any, indices: list[int]) -> bool:
    batch = ds.__getitems__(indices)
    for got, i in zip(batch, indices):
        assert_same_item(got, ds[i])
    return True


def test_assigning_targets_is_what_imagefolder_does(packed: Path, tree: Path) -> None:
    ours, theirs = LMDBFolder(packed), ImageFolder(str(tree))
    for ds in (ours, theirs):
        ds.targets = [1] * len(ds)
    assert ours.targets == theirs.targets == [1] * 5
    assert [ours[i][1] for i in range(5)] == [theirs[i][1] for i in range(5)] == [0, 0, 1, 1, 1]
    ours.samples = ours.samples[:2]  # a new sample list: targets follow it again
    assert ours.targets == [0, 0]


def test_subsets_and_relabels_reach_the_workers(packed: Path) -> None:
    ds = LMDBFolder(packed, transform=T.Compose([T.Resize((4, 4)), T.PILToTensor()]))
    ds.samples = [(p, 10 + t) for p, t in ds.samples if not p.endswith("_0.png")]
    _ = ds.samples, ds.targets
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._samples is None and clone._targets is None
    assert len(pickle.dumps(ds)) < 4000
    expected = [ds[i] for i in range(len(ds))]
    loader = DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context="fork")
    got = [(img, int(t)) for images, targets in loader for img, t in zip(images, targets)]
    assert [t for _, t in got] == [t for _, t in expected] == [10, 11, 11]
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(got, expected))


# -- find_classes and make_dataset, overridden as for ImageFolder ----------------------------------------------
class FirstClassOnlyImageFolder(ImageFolder):
    def find_classes(self, directory: Any) -> tuple[list[str], dict[str, int]]:
        classes, _ = super().find_classes(directory)
        return classes[1:], {c: 5 + i for i, c in enumerate(classes[1:])}


class FirstClassOnlyLMDBFolder(LMDBFolder):
    def find_classes(self, directory: Any) -> tuple[list[str], dict[str, int]]:
        classes, _ = super().find_classes(directory)
        return classes[1:], {c: 5 + i for i, c in enumerate(classes[1:])}


class EveryOtherImageFolder(ImageFolder):
    @staticmethod
    def make_dataset(directory: Any, class_to_idx: Any, extensions: Any = None, is_valid_file: Any = None,
                     allow_empty: bool = False) -> list[tuple[str, int]]:  # fmt: skip
        samples = ImageFolder.make_dataset(directory, class_to_idx, extensions, is_valid_file, allow_empty)
        return samples[::2]


class EveryOtherLMDBFolder(LMDBFolder):
    @staticmethod
    def make_dataset(directory: Any, class_to_idx: Any, extensions: Any = None, is_valid_file: Any = None,
                     allow_empty: bool = False) -> list[tuple[str, int]]:  # fmt: skip
        samples = LMDBFolder.make_dataset(directory, class_to_idx, extensions, is_valid_file, allow_empty)
        return samples[::2]


def test_find_classes_override(packed: Path, tree: Path) -> None:
    ours, theirs = FirstClassOnlyLMDBFolder(packed), FirstClassOnlyImageFolder(str(tree))
    assert ours.classes == ["b"] and ours.class_to_idx == {"b": 5}
    assert_same_dataset(ours, theirs)


def test_make_dataset_override_and_the_static_function(packed: Path, tree: Path) -> None:
    assert_same_dataset(EveryOtherLMDBFolder(packed), EveryOtherImageFolder(str(tree)))
    mapping = {"b": 0, "a": 1}
    assert LMDBFolder.make_dataset(packed, mapping) == ImageFolder.make_dataset(str(tree), mapping, (".png",))
    assert LMDBFolder.make_dataset(
        packed, mapping, is_valid_file=lambda p: "_2" in p, allow_empty=True
    ) == ImageFolder.make_dataset(str(tree), mapping, is_valid_file=lambda p: "_2" in p, allow_empty=True)
    with pytest.raises(ValueError):
        LMDBFolder.make_dataset(packed, None)  # type: ignore[arg-type]


# -- subclasses that override __getitem__, under a batched DataLoader ------------------------------------------------
class ForceZero(LMDBFolder):
    """Every sample gets label 0."""

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        img, _ = super().__getitem__(index)
        return img, 0


class WithIndex(LMDBFolder):
    """Samples are (image, target, index)."""

    def __getitem__(self, index: int) -> tuple[Any, Any, int]:
        img, target = super().__getitem__(index)
        return img, target, index


@pytest.mark.parametrize("context", ["fork", "spawn"])
@pytest.mark.parametrize("cls", [ForceZero, WithIndex])
def test_getitem_overrides_hold_under_a_batched_dataloader(tmp_path: Path, cls: type, context: str) -> None:
    src = make_image_tree(tmp_path / "src", {"a": 6, "b": 5, "c": 6})
    pack(src, tmp_path / "p", progress=False)
    ds = cls(tmp_path / "p", transform=T.Compose([T.Resize((4, 4)), T.PILToTensor()]))
    expected = [ds[i] for i in range(len(ds))]
    assert _same_batch(ds, [3, 1])
    loader = DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context=context)
    got: list[tuple[Any, ...]] = []
    for batch in loader:
        assert len(batch) == len(expected[0])
        got.extend(zip(*batch))
    assert len(got) == len(expected) == 17
    for g, e in zip(got, expected):
        assert torch.equal(g[0], e[0])
        assert [int(x) for x in g[1:]] == list(e[1:])
    if cls is ForceZero:
        assert {int(g[1]) for g in got} == {0} and set(ds.targets) == {0, 1, 2}
    else:
        assert [int(g[2]) for g in got] == list(range(17))


def test_the_plain_class_reads_batches_at_once(packed: Path) -> None:
    ds = LMDBFolder(packed)
    with mock.patch.object(ds.reader, "get_many", wraps=ds.reader.get_many) as spy:
        batch = ds.__getitems__([4, 0, 2])
    spy.assert_called_once()
    for got, i in zip(batch, [4, 0, 2]):
        assert_same_item(got, ds[i])


# -- sharded packs -----------------------------------------------------------------------------------------------
def test_sharded_pack_selection_keeps_shard_offsets(tree: Path, tmp_path: Path) -> None:
    pack_sharded(tree, tmp_path / "s", shards=2, progress=False)
    ds = LMDBFolder(tmp_path / "s", is_valid_file=lambda p: not p.endswith("a_0.png"))
    theirs = ImageFolder(str(tree), is_valid_file=lambda p: not p.endswith("a_0.png"))
    assert_same_dataset(ds, theirs)
    assert ds.reader.shard_offsets == [0, 2, 5] and ds.shard_offsets == [0, 1, 4]
    ds.samples = list(reversed(ds.samples))
    assert ds.shard_offsets == [0, 4]


def test_verify_against_the_source_uses_the_packs_filters(mixed: Path, tmp_path: Path) -> None:
    from lmdbfolder.tools.verify import verify

    pack(mixed, tmp_path / "png", extensions=(".png",), match="_[12]", allow_empty=True, progress=False)
    report = verify(tmp_path / "png", against=mixed, progress=False)
    assert report.ok, report.problems
    pack(mixed, tmp_path / "cb", is_valid_file=lambda p: p.endswith("_0.jpg"), allow_empty=True, progress=False)
    report = verify(tmp_path / "cb", against=mixed, progress=False)
    assert report.ok, report.problems

"""The path a custom ``loader`` gets (``lmdbfolder.read.stored_file``): it names that
sample's bytes for as long as anything returned from it lives, never another
sample's, and ends in the original file's extension.

What users' code does with it: ``loader=Image.open`` (lazy), then a writer that
copies the image's bytes by its ``.filename`` (LitData ``optimize``, MosaicML
``MDSWriter``, Hugging Face ``datasets``) reads that file after other samples
were loaded, maybe in a DataLoader worker; a loader that branches on the
extension; no file or descriptor may be left once the objects are gone.
"""

from __future__ import annotations

import gc
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from torch.utils.data import DataLoader

from conftest import image_bytes, write
from lmdbfolder.read import stored_file
from lmdbfolder.torch import LMDBFolder
from lmdbfolder.write.writer import pack

KINDS = ["rgb_jpeg", "rgba_png", "gray_jpeg", "palette_png", "exif_jpeg", "gray_png"]


@pytest.fixture
def mixed(tmp_path: Path) -> tuple[Path, Path]:
    """A tree of JPEGs and PNGs in 3 classes, and its pack."""
    rng = np.random.default_rng(5)
    tree = tmp_path / "tree"
    for k in range(18):
        data, ext = image_bytes(KINDS[k % len(KINDS)], rng, w=20 + k, h=14 + k % 5)
        write(tree / f"c{k % 3}" / f"img{k:02d}{ext}", data)
    pack(tree, tmp_path / "pack", progress=False)
    return tree, tmp_path / "pack"


def _original(ds: LMDBFolder, i: int) -> bytes:
    return Path(ds.samples[i][0]).read_bytes()


def _filename_bytes(img: Any) -> bytes:
    # What LitData's and MosaicML's JPEG writers do with a lazily opened image.
    with Image.open(img.filename) as again, open(again.filename, "rb") as f:
        return f.read()


def _lent_files() -> list[str]:
    return sorted(n for n in os.listdir(stored_file.folder()) if not n.startswith("."))


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0


def test_a_lazy_image_keeps_its_own_bytes_after_other_samples(mixed: tuple[Path, Path]) -> None:
    tree, packed = mixed
    ds = LMDBFolder(packed, loader=Image.open)
    images = [ds[i][0] for i in range(len(ds))]  # every sample loaded before any is read back
    for i, img in enumerate(images):
        original = _original(ds, i)
        assert _filename_bytes(img) == original, ds.samples[i][0]
        assert os.path.splitext(img.filename)[1] == os.path.splitext(ds.samples[i][0])[1]
        assert img.filename.source == ds.samples[i][0]
        assert np.array_equal(np.asarray(img), np.asarray(Image.open(ds.samples[i][0])))  # pixels read late
    # no two live samples share a name, and none is a descriptor path of this process
    names = [img.filename for img in images]
    assert len(set(names)) == len(names)
    assert not any(n.startswith("/proc/") for n in names)


def test_the_path_ends_in_the_original_extension(mixed: tuple[Path, Path]) -> None:
    # A loader that branches on the extension takes the branch the original file takes.
    def loader(path: str) -> str:
        return "png" if path.lower().endswith(".png") else "jpeg" if path.lower().endswith((".jpg", ".jpeg")) else "?"

    _, packed = mixed
    ds = LMDBFolder(packed, loader=loader)
    assert [ds[i][0] for i in range(len(ds))] == [loader(p) for p, _ in ds.samples]
    assert "png" in [ds[i][0] for i in range(len(ds))]


def test_what_the_transform_keeps_holds_the_file(mixed: tuple[Path, Path]) -> None:
    # The loader's own result is dropped by the transform, which keeps the path and the
    # image inside its result: the file lives while that result does.
    _, packed = mixed
    ds = LMDBFolder(packed, loader=Image.open, transform=lambda img: {"image": img, "name": img.filename})
    first = ds[0][0]
    for i in range(1, len(ds)):
        ds[i]
    gc.collect()
    assert _filename_bytes(first["image"]) == _original(ds, 0)
    # a loader returning a tuple holding the image
    ds = LMDBFolder(packed, loader=lambda p: (Image.open(p), p))
    img, name = ds[1][0]
    for i in range(len(ds)):
        ds[i]
    gc.collect()
    assert Path(name).read_bytes() == _original(ds, 1)
    # ds.loader(path) of a samples path, as a __getitem__ copied from DatasetFolder calls it
    img = ds.loader(ds.samples[2][0])[0]
    for i in range(len(ds)):
        ds[i]
    gc.collect()
    assert _filename_bytes(img) == _original(ds, 2)


def test_no_file_or_descriptor_is_left_once_the_samples_are_gone(mixed: tuple[Path, Path]) -> None:
    _, packed = mixed
    ds = LMDBFolder(packed, loader=Image.open, transform=lambda img: img)
    ds[0]  # the process's folder exists from here on
    gc.collect()
    files, fds = _lent_files(), _open_fds()
    kept = [ds[i][0] for i in range(len(ds))]
    assert len(_lent_files()) == len(files) + len(ds)  # each live image holds its file
    for img in kept[::2]:
        img.load()  # Pillow closes the file once the pixels are read: the name still holds
    del kept, img
    gc.collect()
    assert _lent_files() == files
    assert _open_fds() == fds
    # a loader that reads eagerly holds nothing after the sample returns
    ds = LMDBFolder(packed, loader=lambda p: Path(p).read_bytes())
    assert [ds[i][0] for i in range(len(ds))] == [_original(ds, i) for i in range(len(ds))]
    assert _lent_files() == files
    assert _open_fds() == fds
    # a loader that fails leaves nothing either
    ds = LMDBFolder(packed, loader=lambda p: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        ds[0]
    assert _lent_files() == files


def test_the_folder_is_private_and_only_files_there_are_written(mixed: tuple[Path, Path]) -> None:
    _, packed = mixed
    ds = LMDBFolder(packed, loader=Image.open)
    img = ds[0][0]
    place = stored_file.folder()
    assert os.path.dirname(img.filename) == place
    assert os.stat(place).st_mode & 0o777 == 0o700
    assert os.path.basename(place).startswith(f"lmdbfolder-files-{os.getpid()}-")


def _to_bytes(batch: list[Any]) -> list[tuple[bytes, str, int]]:
    # In the worker: each sample's file read back after the whole batch was loaded
    # (the image itself does not travel: Pillow pickles pixels without its file name).
    return [(_filename_bytes(img), img.filename.source, target) for img, target in batch]


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_read_each_samples_own_bytes(mixed: tuple[Path, Path], context: str) -> None:
    _, packed = mixed
    base = os.path.dirname(stored_file.folder())
    before = set(os.listdir(base))
    ds = LMDBFolder(packed, loader=Image.open)
    loader = DataLoader(ds, batch_size=5, num_workers=2, multiprocessing_context=context, collate_fn=_to_bytes)
    seen = [item for batch in loader for item in batch]
    assert len(seen) == len(ds)
    for (data, source, target), (path, label) in zip(seen, ds.samples):
        assert (source, target) == (path, label)
        assert data == Path(path).read_bytes()
    del loader
    gc.collect()
    # the workers are gone, and so are their folders
    left = [n for n in set(os.listdir(base)) - before if n.startswith("lmdbfolder-files-")]
    dead = [n for n in left if not _alive(int(n.split("-")[2]))]
    assert dead == []


def _as_list(batch: list[Any]) -> list[Any]:
    return batch


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_an_image_from_a_worker_names_a_file_of_the_main_process(mixed: tuple[Path, Path], context: str) -> None:
    # Pillow pickles a lazily opened image with its pixels and its .filename: in the
    # main process that name must hold the sample's bytes too (a writer fed from a
    # DataLoader reads it there), for as long as the image lives there.
    _, packed = mixed
    ds = LMDBFolder(packed, loader=Image.open)
    ds[0]
    gc.collect()
    files = _lent_files()
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=context, collate_fn=_as_list)
    images = [img for batch in loader for img, _ in batch]
    del loader
    gc.collect()
    assert len(_lent_files()) == len(files) + len(ds)
    for i, img in enumerate(images):
        assert os.path.dirname(img.filename) == stored_file.folder()
        assert _filename_bytes(img) == _original(ds, i)
        assert img.filename.source == ds.samples[i][0]
    del images, img
    gc.collect()
    assert _lent_files() == files


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def test_threads_get_their_own_files(mixed: tuple[Path, Path]) -> None:
    _, packed = mixed
    ds = LMDBFolder(packed, loader=Image.open)
    gate = threading.Barrier(4)

    def load(i: int) -> tuple[int, Any]:
        if i < 4:
            gate.wait()
        return i, ds[i][0]

    with ThreadPoolExecutor(4) as pool:
        loaded = list(pool.map(load, list(range(len(ds))) * 2))
    for i, img in loaded:
        assert _filename_bytes(img) == _original(ds, i)


def test_a_killed_processs_folder_is_removed_by_the_next_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A folder whose owner lock nobody holds is left by a killed process: the next
    # folder made removes it; a folder whose owner lives stays.
    if stored_file.fcntl is None:
        pytest.skip("needs flock")
    monkeypatch.setattr(stored_file, "_base", lambda: str(tmp_path))
    stale = tmp_path / "lmdbfolder-files-999999999-abc"
    stale.mkdir(mode=0o700)
    (stale / ".owner").write_bytes(b"")
    (stale / "0.jpg").write_bytes(b"x")
    other = tmp_path / "not-ours"
    other.mkdir()
    (other / ".owner").write_bytes(b"")
    monkeypatch.setattr(stored_file, "_current", None)
    made = stored_file._folder()
    try:
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["not-ours", os.path.basename(made.path)])
        made_again = stored_file._make_folder()  # the first one's owner (this process) lives: it stays
        assert os.path.isdir(made.path)
        made_again.remove()
    finally:
        made.remove()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["not-ours"]


def test_hugging_face_datasets_from_list_gets_the_original_bytes(mixed: tuple[Path, Path]) -> None:
    datasets = pytest.importorskip("datasets")
    _, packed = mixed
    ds = LMDBFolder(packed, loader=Image.open)
    rows = [{"image": img, "label": label} for img, label in (ds[i] for i in range(len(ds)))]
    hf = datasets.Dataset.from_list(rows)
    assert hf["label"] == ds.targets
    hf = hf.cast_column("image", datasets.Image(decode=False))
    for i, row in enumerate(hf):
        data = row["image"]["bytes"]
        if data is None:  # a path kept, as for ImageFolder's files
            data = Path(row["image"]["path"]).read_bytes()
        assert data == _original(ds, i)


def test_litdatas_jpeg_writer_copies_the_original_bytes(mixed: tuple[Path, Path]) -> None:
    # LitData's `optimize` stores a lazily opened JPEG by reading its `.filename` (its
    # JPEGSerializer); with /proc/self/fd/N it re-encoded every one (lossy, EXIF lost).
    from litdata.streaming.serializers import JPEGSerializer
    from PIL.JpegImagePlugin import JpegImageFile

    _, packed = mixed
    ds = LMDBFolder(packed, loader=Image.open)
    images = [ds[i][0] for i in range(len(ds))]  # every sample loaded before any is written
    jpegs = [(i, img) for i, img in enumerate(images) if isinstance(img, JpegImageFile)]
    assert len(jpegs) == 9
    for i, img in jpegs:
        data, _ = JPEGSerializer().serialize(img)
        assert data == _original(ds, i), ds.samples[i][0]

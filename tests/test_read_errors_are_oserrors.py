"""A sample that cannot be read is an OSError, as it is for ImageFolder.

ImageFolder raises ``OSError`` for an image it cannot load (Pillow's
``UnidentifiedImageError``, "image file is truncated", a file that is gone), so
training code skips bad images with ``except OSError``: in a ``__getitem__``
override, or around the loop. The same code must skip the same samples over a
pack: ``DecodeError`` and ``CorruptRecordError`` are OSErrors too. Each test runs
that code over ImageFolder (the oracle) and over LMDBFolder, on a tree with a
truncated JPEG, a truncated PNG, a zero-byte file, garbage under ``.png`` and a
file that is gone (in the pack: a record whose payload has a flipped byte).
"""

from __future__ import annotations

import copy
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torchvision import transforms as T
from torchvision.datasets import ImageFolder

from conftest import forge_record, image_bytes, photo_jpeg, write
from lmdbfolder.cli import EXIT_CODES, main
from lmdbfolder.errors import CorruptRecordError, DecodeError, LmdbFolderError
from lmdbfolder.torch import BatchSamples, LMDBFolder
from lmdbfolder.write.writer import pack

W, H = 24, 16  # every good image: the same size, so a batch of them collates
TO_TENSOR = T.PILToTensor()
#: A transform the batch fast path takes (a crop, then PILToTensor); this crop is the whole image.
WHOLE_CROP = T.Compose([T.RandomResizedCrop((H, W), scale=(1.0, 1.0), ratio=(W / H, W / H)), T.PILToTensor()])
CORRUPT = 10  # the index of b/b5_gone.jpg: the record with a flipped byte


class SafeImageFolder(ImageFolder):
    """The usual way to skip bad images: on an OSError, the next sample instead."""

    def __getitem__(self, index: int) -> Any:
        try:
            return super().__getitem__(index)
        except OSError:
            return self[(index + 1) % len(self)]


class SafeLMDBFolder(LMDBFolder):
    """SafeImageFolder's body, unchanged, over a pack."""

    def __getitem__(self, index: int) -> Any:
        try:
            return super().__getitem__(index)
        except OSError:
            return self[(index + 1) % len(self)]


def _flip_payload_byte(pack_dir: Path, payload: bytes) -> None:
    """Flip one byte inside a record's payload (stored verbatim) in data.mdb: its CRC no longer matches."""
    data = pack_dir / "data.mdb"
    blob = data.read_bytes()
    probe = payload[-40:-8]  # scan data: no other record holds it
    at = blob.find(probe)
    assert at > 0 and blob.find(probe, at + 1) < 0
    with open(data, "r+b") as f:
        f.seek(at + 5)
        byte = f.read(1)[0]
        f.seek(at + 5)
        f.write(bytes([byte ^ 0x10]))


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[int]]:
    """(tree, pack, indices of the bad samples): the same samples, the same bad ones in both."""
    root = tmp_path_factory.mktemp("damaged")
    tree = root / "tree"
    rng = np.random.default_rng(3)
    cut_jpeg = photo_jpeg(W, H, seed=1)
    png = image_bytes("rgba_png", rng, W, H)[0]
    gone = photo_jpeg(W, H, seed=4)
    files = {
        "a/a0.jpg": photo_jpeg(W, H, seed=2),
        "a/a1_cut.jpg": cut_jpeg[: len(cut_jpeg) * 2 // 3],
        "a/a2_zero.jpg": photo_jpeg(W, H, seed=5),  # emptied in the tree after packing (below)
        "a/a3.png": png,
        "a/a4.jpg": photo_jpeg(W, H, seed=6),
        "b/b0_garbage.png": rng.integers(0, 256, 300, dtype=np.uint8).tobytes(),
        "b/b1.jpg": photo_jpeg(W, H, seed=3),
        "b/b2.png": image_bytes("gray_png", rng, W, H)[0],
        "b/b3_cut.png": png[: len(png) // 2],
        "b/b4.jpg": photo_jpeg(W, H, seed=7),
        "b/b5_gone.jpg": gone,  # a broken link in the tree, a flipped byte in the pack (below)
        "b/b6.png": image_bytes("palette_png", rng, W, H)[0],
    }
    for name, data in files.items():
        write(tree / name, data)
    # check="none" lets the damaged files in, as ImageFolder would read them.
    pack(tree, root / "pack", check="none", progress=False)
    # A zero-byte file is never packed: its record is forged empty, with valid checksums.
    (tree / "a" / "a2_zero.jpg").write_bytes(b"")
    forge_record(root / "pack", 2, payload=b"")
    # A file ImageFolder cannot open (FileNotFoundError), a record that fails its checksum.
    (tree / "b" / "b5_gone.jpg").unlink()
    os.symlink(tree / "nowhere.jpg", tree / "b" / "b5_gone.jpg")
    _flip_payload_byte(root / "pack", gone)
    return tree, root / "pack", [1, 2, 5, 8, CORRUPT]


def _loader(ds: Any, batch_size: int | None, workers: int, context: str | None) -> DataLoader:
    return DataLoader(
        ds,
        batch_size=batch_size,
        num_workers=workers,
        multiprocessing_context=context if workers else None,
    )


def _flatten(batches: list[Any], batch_size: int | None) -> list[tuple[torch.Tensor, int]]:
    if batch_size is None:
        return [(x, int(y)) for x, y in batches]
    return [(x, int(y)) for images, targets in batches for x, y in zip(images, targets)]


def test_the_bad_samples_are_oserrors_in_both(damaged: tuple[Path, Path, list[int]]) -> None:
    tree, pack_dir, bad = damaged
    theirs, ours = ImageFolder(str(tree)), LMDBFolder(pack_dir)
    assert ours.samples == theirs.samples
    for i in range(len(theirs)):
        if i not in bad:
            assert ours[i][0].tobytes() == theirs[i][0].tobytes()
            continue
        with pytest.raises(OSError):
            theirs[i]
        with pytest.raises(OSError) as info:
            ours[i]
        expected = CorruptRecordError if i == CORRUPT else DecodeError
        assert type(info.value) is expected and info.value.errno is None
        assert info.value.index == i and info.value.path == ours.filenames()[i]
        assert ours.filenames()[i] in str(info.value) and "hint: " in str(info.value)


@pytest.mark.parametrize(
    ("workers", "context"), [(0, None), (2, "fork"), (2, "spawn")], ids=["in-process", "fork", "spawn"]
)
def test_except_oserror_skips_the_same_samples_as_imagefolder(
    damaged: tuple[Path, Path, list[int]], workers: int, context: str | None
) -> None:
    tree, pack_dir, bad = damaged
    theirs = SafeImageFolder(str(tree), transform=TO_TENSOR)
    ours = SafeLMDBFolder(pack_dir, transform=TO_TENSOR)
    expected = [theirs[i] for i in range(len(theirs))]
    assert [target for _, target in expected] == [0] * 5 + [1] * 7
    for i in range(len(ours)):
        got = ours[i]
        assert torch.equal(got[0], expected[i][0]) and got[1] == expected[i][1]
    for batch_size in (None, 3):  # one by one, and batches (__getitems__ calls the override)
        got = _flatten(list(_loader(ours, batch_size, workers, context)), batch_size)
        want = _flatten(list(_loader(theirs, batch_size, workers if context == "fork" else 0, context)), batch_size)
        assert len(got) == len(want) == len(expected)
        for (x, y), (a, b), (e, t) in zip(got, want, expected):
            assert torch.equal(x, a) and torch.equal(x, e) and y == b == t


@pytest.mark.parametrize(
    ("workers", "context"), [(0, None), (2, "fork"), (2, "spawn")], ids=["in-process", "fork", "spawn"]
)
def test_except_oserror_around_the_loop_on_the_batched_path(
    damaged: tuple[Path, Path, list[int]], workers: int, context: str | None
) -> None:
    # No override: the DataLoader asks LMDBFolder for whole batches (the fast path),
    # and a batch holding a bad sample raises; the loop skips that batch, as over ImageFolder.
    tree, pack_dir, bad = damaged
    theirs = ImageFolder(str(tree), transform=WHOLE_CROP)
    ours = LMDBFolder(pack_dir, transform=WHOLE_CROP)
    assert isinstance(ours.__getitems__([0, 3]), BatchSamples)

    def run(ds: Any, n_workers: int) -> tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]], list[str]]:
        failed, batches, errors = [], [], []
        it = iter(_loader(ds, 2, n_workers, context))
        for k in range(len(it)):
            try:
                images, targets = next(it)
            except OSError as exc:
                failed.append(k)
                errors.append(type(exc).__name__)
                continue
            batches.append((images, targets))
        return failed, batches, errors

    their_failed, their_batches, _ = run(theirs, workers if context == "fork" else 0)
    failed, batches, errors = run(ours, workers)
    assert failed == their_failed == sorted({i // 2 for i in bad})
    assert errors == ["DecodeError"] * 4 + ["CorruptRecordError"]
    assert len(batches) == len(their_batches) == 1
    for (x, y), (a, b) in zip(batches, their_batches):
        assert torch.equal(x, a) and torch.equal(y, b)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_worker_error_arrives_as_its_type_and_an_oserror(damaged: tuple[Path, Path, list[int]], context: str) -> None:
    _, pack_dir, _ = damaged
    ds = LMDBFolder(pack_dir)
    for index, error in ((CORRUPT, CorruptRecordError), (5, DecodeError)):
        loader = DataLoader(ds, batch_size=None, sampler=[index], num_workers=1, multiprocessing_context=context)
        with pytest.raises(OSError) as info:
            list(loader)
        assert type(info.value) is error and isinstance(info.value, LmdbFolderError)
        assert "worker process 0" in str(info.value) and ds.filenames()[index] in str(info.value)
        assert info.value.index is None and info.value.path is None  # only the text crossed: read, not raised
        clone = pickle.loads(pickle.dumps(info.value))
        assert type(clone) is error and str(clone) == str(info.value)


def test_pickling_and_oserror_construction_keep_the_error() -> None:
    # OSError's own constructor reads (errno, strerror, filename) from 2 to 5 arguments and
    # maps an errno to a subclass; ours take their own arguments, which must not be read so.
    corrupt = CorruptRecordError(2, "record CRC-32 is 00000000, header says 00000001", kind="checksum")
    corrupt.locate("a/x.jpg", "/packs/p")
    decode = DecodeError(13, "b/y.png", "UnidentifiedImageError: cannot identify image file", "a hint")
    bare = DecodeError(5, None, "why")
    texts = {
        corrupt: "record 2 (a/x.jpg) in /packs/p is corrupt: record CRC-32 is 00000000, header says 00000001",
        decode: "record 13 (b/y.png) cannot be decoded: UnidentifiedImageError: cannot identify image file",
        bare: "record 5 cannot be decoded: why",
    }
    for error, message in texts.items():
        assert isinstance(error, OSError) and isinstance(error, LmdbFolderError)
        assert (error.errno, error.strerror, error.filename, error.filename2) == (None, None, None, None)
        assert error.message == message and error.args == (message,)
        assert str(error) == f"{message}\n  hint: {error.hint}"
        for clone in (pickle.loads(pickle.dumps(error, protocol)) for protocol in (2, pickle.HIGHEST_PROTOCOL)):
            assert type(clone) is type(error) and clone.__dict__ == error.__dict__ and str(clone) == str(error)
            assert isinstance(clone, OSError) and clone.errno is None
        assert copy.copy(error).__dict__ == error.__dict__
    assert (corrupt.index, corrupt.path, corrupt.pack, corrupt.kind) == (2, "a/x.jpg", "/packs/p", "checksum")
    assert (decode.index, decode.path, decode.hint) == (13, "b/y.png", "a hint")
    assert bare.hint == DecodeError.hint
    # torch's DataLoader makes one from a worker's text alone (errors._FromText).
    made = CorruptRecordError(message="Caught CorruptRecordError in DataLoader worker process 0.")
    assert type(made) is CorruptRecordError and isinstance(made, OSError) and made.errno is None
    assert str(made) == "Caught CorruptRecordError in DataLoader worker process 0."


def test_cli_exit_codes_on_the_damaged_pack_are_unchanged(
    damaged: tuple[Path, Path, list[int]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, pack_dir, _ = damaged
    assert main(["verify", str(pack_dir), "--decode"]) == EXIT_CODES["problems found"]
    err = capsys.readouterr().err
    assert f"checksum: record {CORRUPT} (b/b5_gone.jpg)" in err and "decode: record 5 (b/b0_garbage.png)" in err
    # Reading the corrupt record ends in lmdbfolder's message and exit code, never the
    # "the system refused" of an OSError from the operating system.
    assert main(["export", str(pack_dir), str(tmp_path / "out")]) == EXIT_CODES["other error"]
    err = capsys.readouterr().err
    assert f"record {CORRUPT} (b/b5_gone.jpg)" in err and "is corrupt" in err and "hint: run `lmdbfolder verify`" in err
    assert "the system refused" not in err
    assert not (tmp_path / "out").exists()


def test_an_error_made_from_a_workers_text_has_every_attribute_of_its_kind() -> None:
    # torch's DataLoader rebuilds a worker's error from its text alone (errors._FromText):
    # code that reads ``error.kind`` or ``error.index`` got an AttributeError instead.
    from lmdbfolder import errors

    made_normally = [
        errors.NotAPackError("/p", "why"),
        errors.PackNotFoundError("/p", "why"),
        errors.NoSamplesError("/src", ["a"], "why"),
        errors.FormatVersionError("/p", 9, 2),
        errors.PackChangedError("/p", "why"),
        errors.CorruptRecordError(3, "why", "a/x.jpg", "/p", kind="checksum"),
        errors.SourceError("/src", "why"),
        errors.SourceNotFoundError("/src", "why"),
        errors.ListFileError("/list", 4, "a.jpg x", "why"),
        errors.UnsafePickleError("/old", "why"),
        errors.OutputExistsError("/p"),
        errors.DecodeError(3, "a/x.jpg", "why"),
        errors.PackError("why"),
        errors.DecoderUnavailableError("simplejpeg", "why"),
        errors.OptionError("why"),
        errors.MissingDependencyError("this", "fast"),
        errors.RemoteError("s3://b/p", "why", kind="missing"),
    ]
    for error in made_normally:
        cls = type(error)
        made = cls(message=f"Caught {cls.__name__} in DataLoader worker process 0.")
        assert type(made) is cls and str(made).startswith("Caught")
        for name in vars(error):
            assert hasattr(made, name), f"{cls.__name__}.{name}"
    assert errors.RemoteError(message="t").kind == "other" and errors.RemoteError(message="t").url == ""
    assert errors.NotAPackError(message="t").why == "" and errors.NotAPackError("/p", "why").why == "why"
    assert errors.DecodeError(message="t").index is None and errors.CorruptRecordError(message="t").path is None

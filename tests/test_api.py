"""The public API, pinned; and the core's promise not to import torch."""

from __future__ import annotations

import subprocess
import sys

import lmdbfolder
import lmdbfolder.torch


def test_public_api_snapshot() -> None:
    assert sorted(lmdbfolder.__all__) == [
        "CopyResult",
        "CorruptRecordError",
        "DecodeError",
        "DecoderUnavailableError",
        "FormatVersionError",
        "IMG_EXTENSIONS",
        "ListFileError",
        "LmdbFolderError",
        "NotAPackError",
        "OutputExistsError",
        "PackError",
        "PackResult",
        "Problem",
        "Reader",
        "Record",
        "ShardedPackResult",
        "ShardedReader",
        "SourceError",
        "SourceList",
        "UnsafePickleError",
        "VerifyReport",
        "__version__",
        "copy_pack",
        "import_legacy",
        "pack",
        "pack_info",
        "pack_sharded",
        "pack_sources",
        "scan",
        "verify",
        "write_index",
    ]
    assert lmdbfolder.torch.__all__ == ["LMDBFolder"]
    for name in lmdbfolder.__all__:
        assert hasattr(lmdbfolder, name)


def test_core_import_does_not_import_torch_or_tqdm() -> None:
    code = (
        "import sys, lmdbfolder, lmdbfolder.cli, lmdbfolder.shards, lmdbfolder.sharded\n"
        "import lmdbfolder.copying, lmdbfolder.ray\n"
        "print(sorted(m for m in ('torch', 'torchvision', 'tqdm', 'ray', 'torchdata') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_public_functions_have_docstrings() -> None:
    for name in lmdbfolder.__all__:
        obj = getattr(lmdbfolder, name)
        if callable(obj):
            assert obj.__doc__ and obj.__doc__.strip(), name


def test_py_typed_is_shipped() -> None:
    from importlib.resources import files

    assert files("lmdbfolder").joinpath("py.typed").is_file()


def test_new_modules_declare_their_api() -> None:
    import lmdbfolder.copying
    import lmdbfolder.ray
    import lmdbfolder.sampler
    import lmdbfolder.sharded
    import lmdbfolder.shards

    assert lmdbfolder.sampler.__all__ == ["ExactDistributedSampler", "ORDERS"]
    assert lmdbfolder.ray.__all__ == ["pack_ray"]
    for module in (lmdbfolder.shards, lmdbfolder.sharded, lmdbfolder.copying, lmdbfolder.ray, lmdbfolder.sampler):
        for name in module.__all__:
            obj = getattr(module, name)
            if callable(obj):
                assert obj.__doc__ and obj.__doc__.strip(), f"{module.__name__}.{name}"

"""The public API, pinned; and the core's promise not to import torch."""

from __future__ import annotations

import subprocess
import sys

import lmdbfolder
import lmdbfolder.torch


def test_public_api_snapshot() -> None:
    assert sorted(lmdbfolder.__all__) == [
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
        "SourceError",
        "SourceList",
        "VerifyReport",
        "__version__",
        "pack",
        "pack_info",
        "pack_sources",
        "scan",
        "verify",
    ]
    assert lmdbfolder.torch.__all__ == ["LMDBFolder"]
    for name in lmdbfolder.__all__:
        assert hasattr(lmdbfolder, name)


def test_core_import_does_not_import_torch_or_tqdm() -> None:
    code = (
        "import sys, lmdbfolder, lmdbfolder.cli\n"
        "print(sorted(m for m in ('torch', 'torchvision', 'tqdm') if m in sys.modules))"
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

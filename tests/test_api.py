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
        "NoSamplesError",
        "NotAPackError",
        "OptionError",
        "OutputExistsError",
        "PackChangedError",
        "PackError",
        "PackNotFoundError",
        "PackOptions",
        "PackResult",
        "Problem",
        "Reader",
        "Record",
        "RemoteError",
        "Resize",
        "ShardedPackResult",
        "ShardedReader",
        "SkippedFilesWarning",
        "SlowPathWarning",
        "SourceError",
        "SourceList",
        "SourceNotFoundError",
        "UnsafePickleError",
        "VerifyReport",
        "__version__",
        "copy_pack",
        "import_legacy",
        "open_pack",
        "pack",
        "pack_dataset",
        "pack_info",
        "pack_shard",
        "pack_sharded",
        "pack_sources",
        "scan",
        "verify",
        "warm",
        "write_index",
    ]
    assert lmdbfolder.torch.__all__ == [
        "LMDBFolder",
        "LMDBDatasetFolder",
        "LMDBDataset",
        "PackLoader",
        "BatchSamples",
        "collate",
        "ReadOptions",
    ]
    for name in lmdbfolder.__all__:
        assert hasattr(lmdbfolder, name)


def test_core_import_does_not_import_torch_or_tqdm() -> None:
    code = (
        "import sys, lmdbfolder, lmdbfolder.cli, lmdbfolder.write.shards, lmdbfolder.read.sharded\n"
        "import lmdbfolder.tools.copy, lmdbfolder.write.ray, lmdbfolder.read.staging, lmdbfolder.remote\n"
        "import lmdbfolder.tools.export, lmdbfolder.write.from_dataset, lmdbfolder.write.dataset_fields\n"
        "import lmdbfolder.read.fields\n"
        "print(sorted(m for m in ('torch', 'torchvision', 'tqdm', 'ray', 'torchdata', 'fsspec', 's3fs', 'botocore',"
        " 'pyarrow', 'datasets') if m in sys.modules))"
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
    import lmdbfolder.packdir
    import lmdbfolder.read.sharded
    import lmdbfolder.sampler
    import lmdbfolder.tools.copy
    import lmdbfolder.tools.huggingface
    import lmdbfolder.write.from_dataset
    import lmdbfolder.write.options
    import lmdbfolder.write.ray
    import lmdbfolder.write.shards

    assert lmdbfolder.sampler.__all__ == ["ExactDistributedSampler", "ORDERS"]
    assert lmdbfolder.write.ray.__all__ == ["pack_ray"]
    modules = (
        lmdbfolder.write.shards,
        lmdbfolder.write.options,
        lmdbfolder.read.sharded,
        lmdbfolder.tools.copy,
        lmdbfolder.packdir,
        lmdbfolder.write.ray,
        lmdbfolder.sampler,
        lmdbfolder.write.from_dataset,
        lmdbfolder.tools.huggingface,
    )
    for module in modules:
        for name in module.__all__:
            obj = getattr(module, name)
            if callable(obj):
                assert obj.__doc__ and obj.__doc__.strip(), f"{module.__name__}.{name}"


def test_fused_api() -> None:
    import lmdbfolder.fused

    assert lmdbfolder.fused.__all__ == [
        "RandomResizedCrop",
        "MultiCrop",
        "PairedRandomCrop",
        "View",
        "fast_path",
        "split_fused",
        "split_exact",
        "batch_recipe",
        "BatchRecipe",
        "TransformPlan",
        "plan_key",
    ]
    for name in ("MultiCrop", "View", "fast_path"):
        assert getattr(lmdbfolder.fused, name).__doc__
    for preset in ("dino", "swav", "simclr"):
        assert getattr(lmdbfolder.fused.MultiCrop, preset).__doc__

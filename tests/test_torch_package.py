"""The PyTorch layer as a package (lmdbfolder/torch/): its public paths, and the
dataset's settings as one value (``ReadOptions``)."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchvision")

import lmdbfolder.torch  # noqa: E402
from lmdbfolder.errors import OptionError  # noqa: E402
from lmdbfolder.torch import LMDBDatasetFolder, LMDBFolder, ReadOptions  # noqa: E402
from lmdbfolder.torch.options import FIELDS  # noqa: E402

PACKAGE = Path(lmdbfolder.torch.__file__).parent


# -- the public paths ----------------------------------------------------------------------------
def test_public_paths_name_the_package_objects() -> None:
    import lmdbfolder.fused
    import lmdbfolder.gpu
    import lmdbfolder.sampler
    import lmdbfolder.transport
    from lmdbfolder.torch import (
        batches,
        crop,
        dataset,
        gpu,
        joint,
        loader,
        multicrop,
        options,
        plan,
        sampler,
        transport,
    )

    assert lmdbfolder.torch.LMDBFolder is dataset.LMDBFolder
    assert lmdbfolder.torch.collate is batches.collate and callable(lmdbfolder.torch.collate)
    assert lmdbfolder.torch.PackLoader is loader.PackLoader
    assert lmdbfolder.torch.ReadOptions is options.ReadOptions
    assert lmdbfolder.fused.RandomResizedCrop is crop.RandomResizedCrop
    assert lmdbfolder.fused.TransformPlan is plan.TransformPlan
    for public, home in ((lmdbfolder.gpu, gpu), (lmdbfolder.transport, transport), (lmdbfolder.sampler, sampler)):
        for name in public.__all__:
            assert getattr(public, name) is getattr(home, name), f"{public.__name__}.{name}"
    for name in lmdbfolder.fused.__all__:
        homes = {"RandomResizedCrop": crop, "MultiCrop": multicrop, "View": multicrop, "PairedRandomCrop": joint}
        home = homes.get(name, plan)
        assert getattr(lmdbfolder.fused, name) is getattr(home, name)
    for name in lmdbfolder.torch.__all__:
        assert getattr(lmdbfolder.torch, name).__doc__, name
        assert name in dir(lmdbfolder.torch)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        lmdbfolder.torch.nothing  # noqa: B018


def test_the_sampler_and_transport_need_no_torchvision() -> None:
    code = (
        "import sys, lmdbfolder.sampler, lmdbfolder.transport, lmdbfolder.torch\n"
        "print(sorted(m for m in ('torchvision',) if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_no_function_of_the_layer_is_long_or_takes_many_arguments() -> None:
    # The dataset's settings are one value (ReadOptions), not a parameter each.
    # The sampler mirrors torch's DistributedSampler's arguments and adds its own.
    allowed = {("sampler.py", "__init__")}
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (path.name, node.name) not in allowed:
                args = node.args
                named = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in ("self", "cls")]
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                assert lines <= 80, f"{path.name}: {node.name} is {lines} lines long"
                assert len(named) <= 10, f"{path.name}: {node.name} takes {len(named)} arguments"


# -- ReadOptions -----------------------------------------------------------------------------------
BAD_SETTINGS: list[tuple[dict[str, object], str]] = [
    ({"threads": 0}, "threads must be a whole number of at least 1, got 0"),
    ({"threads": True}, "threads must be a whole number"),
    ({"torch_threads": 0}, "torch_threads must be None or at least 1"),
    ({"size_hint": 0}, "size_hint must be a positive number of pixels, got 0"),
    ({"decoder": "nope"}, "unknown decoder 'nope'"),
    ({"decoder": 3}, "decoder must be a decoder's name"),
    ({"cache_limit": 0}, "cache_limit must be None or a positive number of bytes"),
    ({"source_root": 3}, "source_root must be a path"),
]


def test_read_options_are_checked_when_made() -> None:
    for settings, message in BAD_SETTINGS:
        with pytest.raises(OptionError, match=message):
            ReadOptions(**settings)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=message):  # an OptionError is a ValueError, as before
            ReadOptions().replace(**settings)


def test_read_options_are_one_frozen_value() -> None:
    fast = ReadOptions(decoder="pillow", threads=2)
    with pytest.raises(AttributeError):
        fast.threads = 3  # type: ignore[misc]
    assert fast.replace(threads=3) == ReadOptions(decoder="pillow", threads=3)
    assert fast.replace() is fast


# -- the dataset classes take them -----------------------------------------------------------------
def test_the_signatures_are_torchvisions(small_pack: Path) -> None:
    from torchvision.datasets import DatasetFolder, ImageFolder

    for ours, theirs in ((LMDBFolder, ImageFolder), (LMDBDatasetFolder, DatasetFolder)):
        mine = inspect.signature(ours.__init__).parameters
        tv = inspect.signature(theirs.__init__).parameters
        positional = [n for n, p in mine.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert positional == [n for n, p in tv.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
        # then, keyword-only: extensions (LMDBFolder), options, and ReadOptions' fields as **settings
        extra = [n for n, p in mine.items() if p.kind is p.KEYWORD_ONLY]
        assert extra[-len(FIELDS) - 1 :] == ["options", *FIELDS]
        assert [mine[n].default for n in FIELDS] == [getattr(ReadOptions(), n) for n in FIELDS]


def test_settings_as_keywords_or_as_one_value(small_pack: Path) -> None:
    ds = LMDBFolder(small_pack, decoder="pillow", threads=2, size_hint=32)
    assert ds.options == ReadOptions(decoder="pillow", threads=2, size_hint=32)
    assert (ds.threads, ds.size_hint, ds.prefetch, ds.torch_threads) == (2, 32, False, 1)
    fast = ReadOptions(decoder="pillow", threads=4, prefetch=True)
    both = LMDBDatasetFolder(small_pack, None, options=fast, threads=1)
    assert both.options == fast.replace(threads=1)  # a keyword replaces the field of options
    x, y = both[0]
    assert y == LMDBFolder(small_pack, options=fast)[0][1]


def test_assigning_a_setting_checks_it(small_pack: Path) -> None:
    ds = LMDBFolder(small_pack, decoder="pillow")
    ds.threads = 3
    assert ds.options.threads == 3
    with pytest.raises(OptionError, match="threads must be"):
        ds.threads = 0
    assert ds.threads == 3
    ds.decoder = "pillow"
    assert ds.options.decoder == "pillow"


def test_an_unknown_keyword_is_a_type_error_naming_it(small_pack: Path) -> None:
    for cls, args in ((LMDBFolder, (small_pack,)), (LMDBDatasetFolder, (small_pack, None))):
        with pytest.raises(
            TypeError,
            match=rf"{cls.__name__}.__init__\(\) got an unexpected keyword argument 'thread'.*did you mean threads",
        ):
            cls(*args, thread=2)
        with pytest.raises(TypeError, match="options must be a lmdbfolder.torch.ReadOptions, got dict"):
            cls(*args, options={"threads": 2})

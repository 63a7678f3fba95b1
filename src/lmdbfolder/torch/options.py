"""How a dataset reads its pack: ``ReadOptions``, lmdbfolder's own settings of
``LMDBFolder`` and ``LMDBDatasetFolder`` as one value.

The dataset classes keep torchvision's arguments (``root``, ``loader``,
``extensions``, ``transform``, ``target_transform``, ``is_valid_file``,
``allow_empty``) and take everything else as one ``ReadOptions`` (``options=``)
or as the same names given as keywords (``LMDBFolder(pack, decoder="simplejpeg",
threads=2)``); ``read_options`` merges the two. The value is checked when it is
made (``__post_init__``), so a bad setting fails where it is written, in the
user's process, not in a DataLoader worker; it is frozen, so a dataset's
settings change only through the dataset (``ds.threads = 4`` makes a new one,
checked the same way).

This module imports neither torch nor torchvision.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, TypeVar

from lmdbfolder.errors import OptionError
from lmdbfolder.read.class_order import check_class_order
from lmdbfolder.read.decoders import check_decoder_name

__all__ = ["ReadOptions", "read_options", "shows_settings"]


@dataclass(frozen=True)
class ReadOptions:
    """lmdbfolder's settings of a dataset (``LMDBFolder(root, ..., options=ReadOptions(...))``,
    or the same names as keywords: ``LMDBFolder(root, threads=2)``).

    Fields (see ``LMDBDatasetFolder`` for each in full):
        source_root: the folder that ``samples`` paths start with (None: the
            folder the pack was made from, as its manifest records).
        readahead: kernel readahead on the memory map.
        verify_checksums: check each record's CRC-32 as it is read.
        decoder: the JPEG decoder's name (``"auto"``, ``"pillow"``,
            ``"simplejpeg"``, ``"turbojpeg"``, ``"opencv"``, ``"torchvision"``);
            whether its library is installed is checked by the dataset.
        size_hint: the training resolution for DCT-scaled decoding (None: off).
        prefetch: ask the kernel for a whole batch's records at once.
        threads: threads that make one batch on the batch fast path.
        torch_threads: torch's intra-op threads while a sample is made in the
            main process (None: leave torch's setting alone).
        cache_dir: for a URL ``root``: the local folder shards are staged into.
        cache_limit: for a URL ``root``: bytes of staged shards to keep at most.
        class_order: ``"sorted"`` (torchvision's class numbers) or ``"timm"``
            (timm's folder dataset's natural order).
        seed: replayable augmentation (``lmdbfolder.replay``; None: off).

    Invalid values raise ``OptionError`` (a ``ValueError``) naming the field.

    Example:
        >>> from lmdbfolder.torch import LMDBFolder, ReadOptions
        >>> fast = ReadOptions(decoder="simplejpeg", threads=4, torch_threads=None)
        >>> ds = LMDBFolder("train.lmdb", options=fast)  # doctest: +SKIP
        >>> val = LMDBFolder("val.lmdb", options=fast, threads=1)  # doctest: +SKIP
    """

    source_root: str | os.PathLike[str] | None = None
    readahead: bool = True
    verify_checksums: bool = True
    decoder: str = "auto"
    size_hint: int | None = None
    prefetch: bool = False
    threads: int = 1
    torch_threads: int | None = 1
    cache_dir: str | os.PathLike[str] | None = None
    cache_limit: int | None = None
    class_order: str = "sorted"
    seed: int | None = None

    def __post_init__(self) -> None:
        if not _whole(self.threads, 1):
            raise OptionError(f"threads must be a whole number of at least 1, got {self.threads!r}")
        if self.torch_threads is not None and not _whole(self.torch_threads, 1):
            raise OptionError(f"torch_threads must be None or at least 1, got {self.torch_threads!r}")
        if self.size_hint is not None and not _whole(self.size_hint, 1):
            raise OptionError(
                f"size_hint must be a positive number of pixels, got {self.size_hint!r}",
                "pass the training resolution (e.g. size_hint=224), or None for full-size decodes",
            )
        if not isinstance(self.decoder, str):
            raise OptionError(f"decoder must be a decoder's name (a str), got {type(self.decoder).__name__}")
        try:
            check_decoder_name(self.decoder)
        except ValueError as exc:
            raise OptionError(str(exc), "`lmdbfolder doctor` lists the decoders installed here") from None
        if self.cache_limit is not None and not _whole(self.cache_limit, 1):
            raise OptionError(f"cache_limit must be None or a positive number of bytes, got {self.cache_limit!r}")
        check_class_order(self.class_order)
        if self.seed is not None and not _whole(self.seed, 0):
            raise OptionError(
                f"seed must be a whole number of at least 0, got {self.seed!r}",
                "pass seed=None for torchvision's own random numbers",
            )
        for name in ("source_root", "cache_dir"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise OptionError(f"{name} must be a path (str or os.PathLike) or None, got {type(value).__name__}")

    def replace(self, **changes: Any) -> ReadOptions:
        """A copy with ``changes`` (checked like the constructor)."""
        return dataclasses.replace(self, **changes) if changes else self


def _whole(value: Any, least: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= least


FIELDS = tuple(f.name for f in dataclasses.fields(ReadOptions))


def read_options(options: ReadOptions | None, settings: Mapping[str, Any], caller: str) -> ReadOptions:
    """``options`` (default: ``ReadOptions()``) with the keyword ``settings`` replaced:
    how the dataset classes take their settings, as one value, as keywords, or both.

    An unknown keyword is the TypeError Python raises for one (``caller`` names
    the class), with the nearest field and every field.
    """
    base = ReadOptions() if options is None else options
    if not isinstance(base, ReadOptions):
        raise TypeError(f"{caller}() options must be a lmdbfolder.torch.ReadOptions, got {type(base).__name__}")
    for name in settings:
        if name not in FIELDS:
            near = difflib.get_close_matches(name, FIELDS, n=1, cutoff=0.6)
            guess = f"; did you mean {near[0]}?" if near else ""
            raise TypeError(
                f"{caller}() got an unexpected keyword argument {name!r}{guess} "
                f"(lmdbfolder's settings are ReadOptions' fields: {', '.join(FIELDS)})"
            )
    return base.replace(**settings)


_F = TypeVar("_F", bound=Callable[..., Any])


def shows_settings(init: _F) -> _F:
    """``init``, whose signature (``inspect.signature``, ``help``) shows ReadOptions'
    fields, keyword-only with their defaults, in place of its ``**settings``.

    That is what it accepts, and what the dataset classes showed before their
    settings became one value. Harnesses that read the signature, such as
    torchvision's dataset test cases (which follow a ``**kwargs`` up the base
    classes and would find another class's parameters), see the same
    parameters as before (tests/test_torchvision_cases.py).
    """
    signature = inspect.signature(init)
    kept = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    fields = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for f in dataclasses.fields(ReadOptions)
    ]
    init.__signature__ = signature.replace(parameters=kept + fields)  # type: ignore[attr-defined]
    return init

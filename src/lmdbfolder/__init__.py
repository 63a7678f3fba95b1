"""lmdbfolder: pack image datasets into LMDB; read them from PyTorch as an ImageFolder.

The core (this package) needs only lmdb, numpy and Pillow. The PyTorch
Dataset lives in ``lmdbfolder.torch`` (the ``torch`` extra: ``pip install ".[torch]"``).

The package is layered (docs/design.md, "Module boundaries"): the format and
the pack directory at the bottom (``format``, ``errors``, ``encodings``,
``packfile``, ``packdir``), the read side (``lmdbfolder.read``) and the
write side (``lmdbfolder.write``) above it, sharing only that core, the tools
(``lmdbfolder.tools``: info, verify, show, export, copy, warm, import) above
both, then the PyTorch layer (``torch``, ``fused``, ``sampler``, ``gpu``), the
benchmarks (``lmdbfolder.bench``) and the command line (``lmdbfolder.cli``,
one module per command).

Example:
    >>> import lmdbfolder
    >>> lmdbfolder.pack("imagenet/train", "train.lmdb")  # doctest: +SKIP
    >>> report = lmdbfolder.verify("train.lmdb")  # doctest: +SKIP
    >>> from lmdbfolder.torch import LMDBFolder
    >>> ds = LMDBFolder("train.lmdb")  # doctest: +SKIP
    >>> lmdbfolder.pack_sharded("imagenet/train", "train-sharded", shard_size="4GB")  # doctest: +SKIP
    >>> lmdbfolder.pack_dataset(hf_dataset, "train.lmdb")  # a Hugging Face dataset  # doctest: +SKIP
"""

from lmdbfolder._version import __version__
from lmdbfolder.errors import (
    CorruptRecordError,
    DecodeError,
    DecoderUnavailableError,
    FormatVersionError,
    ListFileError,
    LmdbFolderError,
    NoSamplesError,
    NotAPackError,
    OptionError,
    OutputExistsError,
    PackChangedError,
    PackError,
    PackNotFoundError,
    RemoteError,
    SkippedFilesWarning,
    SlowPathWarning,
    SourceError,
    SourceNotFoundError,
    UnsafePickleError,
)
from lmdbfolder.read.opening import open_pack
from lmdbfolder.read.reader import Reader, Record
from lmdbfolder.read.sharded import ShardedReader
from lmdbfolder.tools.cache import warm
from lmdbfolder.tools.copy import CopyResult, copy_pack
from lmdbfolder.tools.importing import import_legacy
from lmdbfolder.tools.info import pack_info
from lmdbfolder.tools.verify import Problem, VerifyReport, verify
from lmdbfolder.write.from_dataset import pack_dataset
from lmdbfolder.write.options import PackOptions, Resize
from lmdbfolder.write.shards import ShardedPackResult, pack_shard, pack_sharded, write_index
from lmdbfolder.write.sources import IMG_EXTENSIONS, SourceList, scan
from lmdbfolder.write.writer import PackResult, pack, pack_sources

__all__ = [
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
    "PackChangedError",
    "OptionError",
    "OutputExistsError",
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

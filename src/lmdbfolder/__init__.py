"""lmdbfolder: pack image datasets into LMDB; read them from PyTorch as an ImageFolder.

The core (this package) needs only lmdb, numpy and Pillow. The PyTorch
Dataset lives in ``lmdbfolder.torch`` (``pip install lmdbfolder[torch]``).

Example:
    >>> import lmdbfolder
    >>> lmdbfolder.pack("imagenet/train", "train.lmdb")  # doctest: +SKIP
    >>> report = lmdbfolder.verify("train.lmdb")  # doctest: +SKIP
    >>> from lmdbfolder.torch import LMDBFolder
    >>> ds = LMDBFolder("train.lmdb")  # doctest: +SKIP
    >>> lmdbfolder.pack_sharded("imagenet/train", "train-sharded", shard_size="4GB")  # doctest: +SKIP
"""

from lmdbfolder._version import __version__
from lmdbfolder.copying import CopyResult, copy_pack
from lmdbfolder.errors import (
    CorruptRecordError,
    DecodeError,
    DecoderUnavailableError,
    FormatVersionError,
    ListFileError,
    LmdbFolderError,
    NotAPackError,
    OutputExistsError,
    PackError,
    SourceError,
    UnsafePickleError,
)
from lmdbfolder.legacy import import_legacy
from lmdbfolder.reader import Reader, Record, pack_info
from lmdbfolder.shards import ShardedPackResult, ShardedReader, pack_sharded, write_index
from lmdbfolder.sources import IMG_EXTENSIONS, SourceList, scan
from lmdbfolder.verify import Problem, VerifyReport, verify
from lmdbfolder.writer import PackResult, pack, pack_sources

__all__ = [
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

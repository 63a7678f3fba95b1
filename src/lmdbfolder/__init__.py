"""lmdbfolder: pack image datasets into LMDB; read them from PyTorch as an ImageFolder.

The core (this package) needs only lmdb, numpy and Pillow. The PyTorch
Dataset lives in ``lmdbfolder.torch`` (``pip install lmdbfolder[torch]``).

Example:
    >>> import lmdbfolder
    >>> lmdbfolder.pack("imagenet/train", "train.lmdb")  # doctest: +SKIP
    >>> report = lmdbfolder.verify("train.lmdb")  # doctest: +SKIP
    >>> from lmdbfolder.torch import LMDBFolder
    >>> ds = LMDBFolder("train.lmdb")  # doctest: +SKIP
"""

from lmdbfolder._version import __version__
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
)
from lmdbfolder.reader import Reader, Record, pack_info
from lmdbfolder.sources import IMG_EXTENSIONS, SourceList, scan
from lmdbfolder.verify import Problem, VerifyReport, verify
from lmdbfolder.writer import PackResult, pack, pack_sources

__all__ = [
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

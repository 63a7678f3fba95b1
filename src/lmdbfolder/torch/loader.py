"""``PackLoader``: a dataset's ``loader``, bound to the pack; and which loaders the
dataset replaces by its own decode (torchvision's ``default_loader``/``pil_loader``).
"""

from __future__ import annotations

import errno
import os
from typing import Any, Callable, Protocol

from lmdbfolder.errors import MissingDependencyError, OptionError

try:
    from torchvision import get_image_backend
    from torchvision.datasets.folder import default_loader, pil_loader
except ImportError as exc:  # a core-only install: say what to install
    raise MissingDependencyError("lmdbfolder.torch (LMDBFolder)", "torch", "torch and torchvision") from exc

from lmdbfolder.encodings import decode_rgb, encoding_of
from lmdbfolder.read.opening import AnyReader
from lmdbfolder.read.selection import sample_path
from lmdbfolder.read.stored_file import StoredFile, lend

__all__ = ["PackLoader"]


class PackDataset(Protocol):
    """What a ``PackLoader`` needs of its dataset (an ``LMDBDatasetFolder``; a
    protocol, so that this module does not import the dataset's, which imports it)."""

    reader: AnyReader
    root: str
    source_root: str

    def _pack_index_of(self, path: Any) -> int | None: ...


class PackLoader:
    """``LMDBFolder.loader``: the given loader, bound to the pack (see that property).

    Called with a path from ``samples``, it loads the sample from the pack:
    torchvision's ``default_loader``/``pil_loader`` give ``pil_loader``'s RGB
    image of the stored bytes, any other loader is called with a path to a
    file holding them (``StoredFile``: ``.source`` is the original path).
    """

    __slots__ = ("_dataset", "__wrapped__")

    def __init__(self, dataset: PackDataset, loader: Callable[[str], Any]) -> None:
        self._dataset = dataset
        self.__wrapped__ = loader

    def __call__(self, path: Any) -> Any:
        ds, loader = self._dataset, self.__wrapped__
        if isinstance(path, StoredFile):  # a file of stored bytes already: the loader reads it
            return loader(path)
        index = ds._pack_index_of(path)
        if index is None:
            if isinstance(path, (str, os.PathLike)) and os.path.exists(path):
                return loader(path)  # type: ignore[arg-type]  # a file of the user's own, not a sample of the pack
            raise FileNotFoundError(
                errno.ENOENT,
                f"{os.fspath(path) if isinstance(path, (str, os.PathLike)) else path!r} is no sample of the pack "
                f"{ds.root} (whose samples' paths start with {ds.source_root}) and no such file exists. "
                "LMDBFolder reads its samples from the pack: in a __getitem__ override, "
                "`sample, target = super().__getitem__(index)` gives sample `index` (transform applied), "
                "`self.loader(self.samples[index][0])` its image",
                os.fspath(path) if isinstance(path, (str, os.PathLike)) else None,
            )
        rec = ds.reader.get(index)
        if _decodes_itself(loader):
            return decode_rgb(rec.payload, rec.encoding, rec.width, rec.height)
        if encoding_of(rec.encoding).stores_pixels:
            raise OptionError(_RAW_LOADER, _RAW_LOADER_HINT)
        with lend(rec.payload, sample_path(ds.source_root, ds.reader.path_of(index)), index) as lease:
            loaded = loader(lease.path)
            lease.hold(loaded)
            return loaded

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackLoader):
            return self._dataset is other._dataset and self.__wrapped__ == other.__wrapped__
        return NotImplemented

    def __hash__(self) -> int:
        return hash((id(self._dataset), self.__wrapped__))

    def __repr__(self) -> str:
        return f"PackLoader({self.__wrapped__!r} on {self._dataset.root})"


_RAW_LOADER = "loader= needs a pack that stores the image files, and this pack stores decoded pixels (--store raw)"
_RAW_LOADER_HINT = (
    "leave loader unset (the pixels need no loading) and do the rest in transform, or repack with --store encoded"
)


def _decodes_itself(loader: Any) -> bool:
    # torchvision's own loaders are pil_loader underneath (with the PIL backend): the
    # stored image is decoded here instead, to the same pixels, without a file.
    return loader is None or loader is pil_loader or (loader is default_loader and get_image_backend() == "PIL")

"""PyTorch integration: ``LMDBFolder``, a drop-in for ``torchvision.datasets.ImageFolder``
(and ``LMDBDatasetFolder``, the same with ``DatasetFolder``'s argument order).

This package is the only part of lmdbfolder that imports torch. Its modules,
one job each (docs/design.md, "Module boundaries"):

* ``dataset``: the two dataset classes (torchvision's ``ImageFolder`` /
  ``DatasetFolder`` subclasses: the adapter from a pack, a ``Selection`` and a plan);
* ``fields``: ``LMDBDataset``, the dataset of a pack of several fields (image + mask,
  COCO annotations, pairs), whose items are torchvision's datasets' items;
* ``options``: ``ReadOptions``, lmdbfolder's own settings of a dataset as one value;
* ``loader``: ``PackLoader``, the dataset's ``loader`` bound to the pack;
* ``batches``: the fast path's batch (``Sample``, ``BatchSamples``) and ``collate``;
* ``plan``: ``TransformPlan``, how a transform is applied to a record, decided once;
* ``crop``: the fused ``RandomResizedCrop`` and its box drawing (torchvision's random numbers);
* ``transport``: batch memory and its trip from a DataLoader worker;
* ``gpu``: the GPU batch path; ``sampler``: ``ExactDistributedSampler``.

The public paths of ``crop`` (with ``plan``), ``transport``, ``gpu`` and ``sampler``
stay ``lmdbfolder.fused``, ``lmdbfolder.transport``, ``lmdbfolder.gpu`` and
``lmdbfolder.sampler``: modules that only re-export them.

The names below are imported when first used (``from lmdbfolder.torch import
LMDBFolder``), so that ``lmdbfolder.sampler`` and ``lmdbfolder.transport``,
which live in this package, need torch but not torchvision. Without torch the
import raises ``MissingDependencyError`` saying what to install.

How each of ImageFolder's attributes and arguments maps onto a pack is in
docs/switching-from-imagefolder.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmdbfolder.torch.batches import BatchSamples, collate
    from lmdbfolder.torch.dataset import LMDBDatasetFolder, LMDBFolder
    from lmdbfolder.torch.fields import LMDBDataset
    from lmdbfolder.torch.loader import PackLoader
    from lmdbfolder.torch.options import ReadOptions

__all__ = ["LMDBFolder", "LMDBDatasetFolder", "LMDBDataset", "PackLoader", "BatchSamples", "collate", "ReadOptions"]

# Where each public name lives (PEP 562: looked up on first use).
_HOMES = {
    "LMDBFolder": "lmdbfolder.torch.dataset",
    "LMDBDatasetFolder": "lmdbfolder.torch.dataset",
    "LMDBDataset": "lmdbfolder.torch.fields",
    "PackLoader": "lmdbfolder.torch.loader",
    "BatchSamples": "lmdbfolder.torch.batches",
    "collate": "lmdbfolder.torch.batches",
    "ReadOptions": "lmdbfolder.torch.options",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # found once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

"""The fused transforms, public path: ``lmdbfolder.fused.RandomResizedCrop``, ``MultiCrop``, ``PairedRandomCrop``.

A ``RandomResizedCrop`` that ``LMDBFolder`` fuses with JPEG decoding: a
subclass of torchvision's with the same arguments and the same behaviour on a
PIL image, whose crop an ``LMDBFolder`` draws from the record header and
decodes at a reduced DCT scale (the details are in ``lmdbfolder.torch.crop``,
where it is made; how a dataset applies it, ``TransformPlan``, is in
``lmdbfolder.torch.plan``). ``MultiCrop`` (``lmdbfolder.torch.multicrop``) is the
self-supervised multi-crop augmentation (DINO, SwAV, SimCLR presets), all of a
sample's views from one region decode; ``fast_path`` says whether a transform
gets a fast path, or why not.

``PairedRandomCrop`` is BasicSR's ``paired_random_crop`` + ``augment`` for an LQ/GT pair,
which ``LMDBDataset`` fuses with decoding (``lmdbfolder.torch.joint``; docs/fields-fast.md).

Example:
    >>> from torchvision import transforms as T
    >>> from lmdbfolder import fused
    >>> tf = T.Compose([fused.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.PILToTensor()])
"""

from __future__ import annotations

from lmdbfolder.torch.crop import RandomResizedCrop
from lmdbfolder.torch.joint import PairedRandomCrop
from lmdbfolder.torch.multicrop import MultiCrop, View
from lmdbfolder.torch.plan import (
    BatchRecipe,
    TransformPlan,
    batch_recipe,
    fast_path,
    plan_key,
    split_exact,
    split_fused,
)

__all__ = [
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

"""The fused transforms, public path: ``lmdbfolder.fused.RandomResizedCrop``, ``PairedRandomCrop``.

A ``RandomResizedCrop`` that ``LMDBFolder`` fuses with JPEG decoding: a
subclass of torchvision's with the same arguments and the same behaviour on a
PIL image, whose crop an ``LMDBFolder`` draws from the record header and
decodes at a reduced DCT scale (the details are in ``lmdbfolder.torch.crop``,
where it is made; how a dataset applies it, ``TransformPlan``, is in
``lmdbfolder.torch.plan``).

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
from lmdbfolder.torch.plan import BatchRecipe, TransformPlan, batch_recipe, plan_key, split_exact, split_fused

__all__ = [
    "RandomResizedCrop",
    "PairedRandomCrop",
    "split_fused",
    "split_exact",
    "batch_recipe",
    "BatchRecipe",
    "TransformPlan",
    "plan_key",
]

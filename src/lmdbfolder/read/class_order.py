"""How a dataset numbers its classes: torchvision's sorted order, or timm's natural order.

torchvision's ``ImageFolder`` (and a pack, which records its classes that way)
numbers the class folders in ``sorted()`` order: ``Dog, cat, class10, class2``.
timm's folder dataset (``timm.data.ImageDataset``, ``create_dataset("", root)``)
numbers them in *natural* order (``timm.utils.misc.natural_key``: lower-cased,
runs of digits compared as integers): ``cat, class2, class10, Dog``. A
checkpoint trained through one numbering scores as if its labels were shuffled
through the other, silently, wherever the two orders differ.

``LMDBFolder(pack, class_order="timm")`` renumbers a pack's classes at read
time with timm's rule (``ordered_classes``); the packed labels stay as they are.
"""

from __future__ import annotations

import re
from typing import Mapping

from lmdbfolder.errors import OptionError

__all__ = ["CLASS_ORDERS", "check_class_order", "natural_key", "ordered_classes"]

#: The values of ``class_order``: ``"sorted"`` (torchvision's ``ImageFolder``: the
#: pack's own numbering) and ``"timm"`` (timm's folder dataset: natural order).
CLASS_ORDERS = ("sorted", "timm")

_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> list[int | str]:
    """timm's ``natural_key``: ``name`` lower-cased and split into text and digit runs,
    the digit runs as integers (so ``class2`` sorts before ``class10``)."""
    return [int(s) if s.isdigit() else s for s in _DIGITS.split(name.lower())]


def check_class_order(order: object) -> str:
    """``order`` if it is one of ``CLASS_ORDERS``, else an ``OptionError`` listing them."""
    if isinstance(order, str) and order in CLASS_ORDERS:
        return order
    raise OptionError(
        f"class_order must be one of {', '.join(repr(o) for o in CLASS_ORDERS)}, got {order!r}",
        "'sorted' numbers classes as torchvision's ImageFolder does (the default), "
        "'timm' as timm's folder dataset (timm.data.ImageDataset) does",
    )


def ordered_classes(
    classes: list[str], class_to_idx: Mapping[str, int], order: str
) -> tuple[list[str], dict[str, int]]:
    """``(classes, class_to_idx)`` numbered in ``order``: as given for ``"sorted"``
    (the pack's numbering, which is ImageFolder's), 0..C-1 in timm's natural order
    for ``"timm"``.

    Two names that timm's key cannot tell apart (``Dog`` and ``dog``, ``a1`` and
    ``a01``) are left in sorted order here; timm's own order for them depends on
    set iteration (it differs from run to run).
    """
    if check_class_order(order) == "sorted":
        return list(classes), dict(class_to_idx)
    names = sorted(classes, key=lambda c: (natural_key(c), c))
    return names, {c: i for i, c in enumerate(names)}

"""A batch of the fast path and its collate: ``Sample``, ``BatchSamples``, ``collate``.

Importing this module registers ``Sample`` with torch's ``default_collate``
(``default_collate_fn_map``), so that a DataLoader left with its default
``collate_fn`` takes a fast-path batch without a copy too.
"""

from __future__ import annotations

from typing import Any

from lmdbfolder.errors import MissingDependencyError

try:
    import torch
    import torch.utils.data
    from torch.utils.data._utils.collate import default_collate_fn_map
except ImportError as exc:  # a core-only install: say what to install
    raise MissingDependencyError("lmdbfolder.torch (LMDBFolder)", "torch", "torch and torchvision") from exc

from lmdbfolder.torch import transport

__all__ = ["Sample", "BatchSamples", "collate"]


class Sample(tuple):  # type: ignore[type-arg]
    """One ``(image, target)`` of a ``BatchSamples``: a tuple, whose type tells torch's
    ``default_collate`` (through ``default_collate_fn_map``) that its batch can be
    taken whole, as ``collate`` takes it."""

    __slots__ = ()


class BatchSamples(list):  # type: ignore[type-arg]
    """A batch made by the fast path: a list of ``(image, target)`` like any other
    (each image a view of one batch tensor, each pair a ``Sample``), which
    ``collate``, and torch's ``default_collate`` too, turn into ``[images, targets]``
    without copying ``images``. ``images`` may also be a list of batch tensors (a
    multi-crop's views, one tensor per view): each sample's image is then the list of
    its views, and the collated batch ``[views, targets]``."""

    images: Any
    targets: list[Any]

    def __init__(self, images: Any, targets: list[Any]) -> None:
        # A list of batch tensors (a multi-crop's views, one tensor per view): each
        # sample's image is the list of its views.
        per_sample = [list(views) for views in zip(*images)] if isinstance(images, list) else images
        made = [Sample(pair) for pair in zip(per_sample, targets)]
        super().__init__(made)
        self.images = images
        self.targets = targets
        self._made = made

    def intact(self) -> bool:
        """Whether the list still holds exactly the samples it was made with (then
        ``images`` is the batch)."""
        made = self._made
        return len(self) == len(made) and all(a is b for a, b in zip(self, made))

    @classmethod
    def of(cls, samples: list[tuple[Any, Any]]) -> BatchSamples:
        """A batch of samples made one by one (stacked here once)."""
        return cls(torch.stack([x for x, _ in samples]), [t for _, t in samples])


def collate(batch: Any) -> Any:
    """``collate_fn`` for a DataLoader over an ``LMDBFolder``: a batch from the fast
    path becomes ``[images, targets]`` as is (no copy; in a DataLoader worker the
    images are sent to the main process by reference, see ``lmdbfolder.transport``);
    anything else goes through torch's ``default_collate``.

    Since the fast path's samples are ``Sample`` s, which torch's ``default_collate``
    hands to this function, leaving ``collate_fn`` unset does the same.

    Example:
        >>> loader = DataLoader(ds, batch_size=256, shuffle=True, collate_fn=collate)  # doctest: +SKIP
    """
    if isinstance(batch, BatchSamples) and batch.intact():
        targets = batch.targets
        if all(type(t) is int for t in targets):
            collated = torch.tensor(targets, dtype=torch.int64)
        else:
            # A tuple, as torch's collate hands each field of a batch of tuples on
            # (a batch of strings stays that tuple, as ImageFolder's does).
            collated = torch.utils.data.default_collate(tuple(targets))  # type: ignore[arg-type]
        images = batch.images
        pool = transport.pool()
        buffer = pool.buffer_of_many(images) if isinstance(images, list) else pool.buffer_of(images)
        if buffer is not None:
            return transport.PooledBatch(images, collated, buffer, pool)
        return [images, collated]
    return torch.utils.data.default_collate(batch)


def _collate_samples(batch: Any, *, collate_fn_map: Any = None) -> Any:
    """torch's ``default_collate`` for a batch whose first element is a ``Sample``:
    the fast path's batch whole (``collate``), else what it does with tuples."""
    if isinstance(batch, BatchSamples) and batch.intact():
        return collate(batch)
    from torch.utils.data._utils.collate import collate as torch_collate

    size = len(batch[0])
    if any(len(elem) != size for elem in batch):
        raise RuntimeError("each element in list of batch should be of equal size")
    return [torch_collate(list(samples), collate_fn_map=collate_fn_map) for samples in zip(*batch)]


# torch's documented way to extend default_collate (see its docstring): so that a
# DataLoader left with its default collate_fn gets the batch without a copy too.
default_collate_fn_map[Sample] = _collate_samples

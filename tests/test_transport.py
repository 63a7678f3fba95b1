"""How the batch fast path's batches are allocated and reach the main process (lmdbfolder.transport).

A DataLoader worker's batch must reach the main process without fresh shared
memory per batch and without a second pass over the pixels (torch's default
collate included), and no batch, view, slice or ``.numpy()`` of one that the
user still holds may ever be overwritten by a later batch: the oracle is the
same loader run again with the same seeds, each batch cloned as it arrives.
"""

from __future__ import annotations

import multiprocessing
import random
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, default_collate
from torchvision import transforms as T

from conftest import photo_jpeg, write
from lmdbfolder import fused, pack
from lmdbfolder.torch import BatchSamples, LMDBFolder, collate, crop, transport

SIZE = 24


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("transport")
    for k in range(40):
        w, h = [(161, 121), (121, 161), (90, 70), (64, 64)][k % 4]
        write(root / "src" / f"c{k % 4}" / f"{k:02d}.jpg", photo_jpeg(w, h, seed=k))
    pack(root / "src", root / "p", progress=False)
    return root / "p"


def _dataset(path: Path, threads: int = 1) -> LMDBFolder:
    transform = T.Compose([fused.RandomResizedCrop(SIZE, output="tensor"), T.RandomHorizontalFlip()])
    return LMDBFolder(path, transform=transform, threads=threads)


def _loader(ds: LMDBFolder, workers: int, context: str | None, collate_fn: Callable[..., Any] | None) -> DataLoader:
    kwargs: dict[str, Any] = {}
    if workers:
        kwargs = {"multiprocessing_context": context, "persistent_workers": True, "prefetch_factor": 2}
    if collate_fn is not None:
        kwargs["collate_fn"] = collate_fn
    return DataLoader(
        ds, batch_size=4, shuffle=True, num_workers=workers, generator=torch.Generator().manual_seed(5), **kwargs
    )


def _epochs(loader: DataLoader, epochs: int = 2) -> Any:
    for _ in range(epochs):
        yield from loader


def _reference(ds: LMDBFolder, workers: int, context: str | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batches of the same loader, each cloned as it arrives and then dropped."""
    torch.manual_seed(9)  # the boxes' numbers without workers (the workers' follow the loader's generator)
    return [(x.clone(), y.clone()) for x, y in _epochs(_loader(ds, workers, context, collate))]


def raw_collate(batch: BatchSamples) -> list[Any]:
    """A user's collate_fn that sends the pooled tensor itself (not lmdbfolder's collate)."""
    return [batch.images, torch.tensor(batch.targets)]


@pytest.mark.parametrize(
    ("context", "how"), [("fork", "collate"), ("fork", "default"), ("fork", "user"), ("spawn", "default")]
)
def test_held_batches_are_never_overwritten_across_processes(photos: Path, context: str, how: str) -> None:
    ds = _dataset(photos)
    want = _reference(ds, 2, "fork")  # the workers' seeds follow the loader's generator, whatever the context
    collate_fn = {"collate": collate, "default": None, "user": raw_collate}[how]
    held: list[Any] = []
    got = 0
    for k, (images, targets) in enumerate(_epochs(_loader(ds, 2, context, collate_fn))):
        assert images.dtype == torch.uint8 and images.shape[1:] == (3, SIZE, SIZE)
        # Keep every batch in some form (more than a pool holds): the whole tensor,
        # only a slice of it, only a numpy view, only one sample's view, or a numpy
        # view taken before the tensor is moved to shared memory (as torch allows).
        kept = _keep(images, k % 5)
        held.append((k, kept, targets))
        got += 1
    assert got == len(want) == 20
    for k, kept, targets in held:
        x, y = want[k]
        assert torch.equal(targets, y)
        expected = [x, x[1:3], x.numpy(), x[0], x.numpy()][k % 5]
        if isinstance(kept, np.ndarray):
            assert np.array_equal(kept, expected), f"batch {k} changed after it was delivered"
        else:
            assert torch.equal(kept, expected), f"batch {k} changed after it was delivered"


def _keep(images: torch.Tensor, how: int) -> Any:
    """What a user keeps of a batch: the tensor, a slice, a numpy view, one sample's
    view, or a numpy view taken before ``share_memory_()`` (which moves the tensor's
    storage into shared memory: the numpy view must still see the batch, as with torch)."""
    if how == 4:
        arr = images.numpy()
        images.share_memory_()
        return arr
    return [images, images[1:3], images.numpy(), images[0]][how]


def copy_collate(batch: BatchSamples) -> list[Any]:
    """A collate_fn that copies the batch in the worker (the reference)."""
    return [batch.images.clone(), torch.tensor(batch.targets)]


def test_batches_of_other_sizes_take_other_buffers(photos: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 40 images in batches of 7: the last batch of every epoch has 5. With room for
    # 2 buffers, a worker makes room for a new size by closing a free buffer of the
    # other, and the main process must let go of it too.
    monkeypatch.setattr(transport, "MAX_BUFFERS", 2)  # inherited by the forked workers
    ds = _dataset(photos)

    def batches(collate_fn: Any, hold: bool) -> list[torch.Tensor]:
        loader = DataLoader(
            ds,
            batch_size=7,
            shuffle=True,
            num_workers=2,
            multiprocessing_context="fork",
            persistent_workers=True,
            collate_fn=collate_fn,
            generator=torch.Generator().manual_seed(2),
        )
        out = [x if hold else x.clone() for x, _ in _epochs(loader, epochs=4)]
        if not hold:  # buffers were closed and replaced: the main process holds only the live ones
            assert all(len(maps) <= 2 for maps in transport._MAPPED.values())
        return out

    want = batches(copy_collate, hold=True)
    assert [len(x) for x in want] == [7, 7, 7, 7, 7, 5] * 4
    for got in (batches(collate, hold=False), batches(collate, hold=True)):
        for k, (x, ref) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(x, ref), f"batch {k} differs"


def test_held_batches_are_never_overwritten_in_threads_mode(photos: Path) -> None:
    ds = _dataset(photos, threads=2)
    want = _reference(ds, 0, None)
    torch.manual_seed(9)
    held = [(x, x[2], x.numpy()) for x, _ in _epochs(_loader(ds, 0, None, None))]
    for (x, one, arr), (ref, _) in zip(held, want, strict=True):
        assert torch.equal(x, ref) and torch.equal(one, ref[2]) and np.array_equal(arr, ref.numpy())


@pytest.mark.parametrize("threads", [1, 2])
def test_a_numpy_view_outlives_share_memory_in_the_main_process(photos: Path, threads: int) -> None:
    # share_memory_() gives the tensor a new storage; the numpy view taken before it
    # still points at the pooled buffer, which must not be reused while it lives.
    # (Only the first batches are kept: a batch that found no free buffer is torch's
    # own tensor, whose numpy view share_memory_() leaves dangling in torch itself.)
    ds = _dataset(photos, threads=threads)
    want = _reference(ds, 0, None)
    torch.manual_seed(9)
    held = []
    for k, (x, _) in enumerate(_epochs(_loader(ds, 0, None, None))):
        if k < transport.MAX_BUFFERS - 2:
            held.append(_keep(x, 4))
    assert len(held) == transport.MAX_BUFFERS - 2
    for k, (arr, (ref, _)) in enumerate(zip(held, want)):
        assert np.array_equal(arr, ref.numpy()), f"batch {k} changed after share_memory_()"


def _child_checks(images: torch.Tensor, go: Any, result: Any) -> None:
    before = images.clone()
    go.wait(60)
    result.put(bool(torch.equal(images, before)))


@pytest.mark.skipif(not hasattr(__import__("os"), "memfd_create"), reason="pooled worker batches need memfd_create")
def test_a_process_forked_while_a_batch_is_held_keeps_it(photos: Path) -> None:
    # A child forked while the parent holds a worker's batch shares that memory: the
    # parent dropping the batch must not let the worker write into it again.
    ctx = multiprocessing.get_context("fork")
    ds = _dataset(photos)
    batches = iter(_epochs(_loader(ds, 2, "fork", collate), epochs=3))
    images, _ = next(batches)
    go, result = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_child_checks, args=(images, go, result))
    child.start()
    try:
        del images
        for _ in batches:  # the rest of three epochs: every buffer is reused many times
            pass
    finally:
        go.set()
        same = result.get(timeout=60)
        child.join(60)
    assert same, "the forked child's batch changed after the parent dropped it"


def test_threads_mode_reuses_a_buffer_once_the_batch_is_dropped(photos: Path) -> None:
    ds = _dataset(photos, threads=2)
    pool = transport.pool()
    before = pool.overflow
    pointers = set()
    for images, _ in _epochs(_loader(ds, 0, None, collate), epochs=3):
        pointers.add(images.data_ptr())
        del images
    assert len(pointers) <= 2 and pool.overflow == before  # the loop's previous batch, and this one


class _Counter:
    """Counts torch.UntypedStorage._new_shared calls in forked workers (a shared int)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = multiprocessing.get_context("fork").Value("i", 0)
        real = torch.UntypedStorage._new_shared.__func__  # type: ignore[attr-defined]

        def counted(cls: Any, *args: Any, **kwargs: Any) -> Any:
            with self.calls.get_lock():
                self.calls.value += 1
            return real(cls, *args, **kwargs)

        monkeypatch.setattr(torch.UntypedStorage, "_new_shared", classmethod(counted))


@pytest.mark.skipif(not hasattr(__import__("os"), "memfd_create"), reason="pooled worker batches need memfd_create")
@pytest.mark.parametrize("collate_fn", [collate, None], ids=["collate", "default_collate"])
def test_worker_batches_need_no_fresh_shared_memory(
    photos: Path, collate_fn: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    counter = _Counter(monkeypatch)
    ds = _dataset(photos)
    loader = _loader(ds, 2, "fork", collate_fn)
    batches = 0
    for images, _targets in _epochs(loader, epochs=3):
        assert not images.is_shared()  # our mapping of the worker's buffer, not torch's shared memory
        batches += 1
    assert batches == 30
    assert counter.calls.value == 0, f"{counter.calls.value} batches were put in new shared memory"
    # and the main process mapped each worker's few buffers once
    mapped = [len(maps) for maps in transport._MAPPED.values()]
    assert sum(mapped) <= 2 * transport.MAX_BUFFERS


@pytest.mark.skipif(not hasattr(__import__("os"), "memfd_create"), reason="pooled worker batches need memfd_create")
def test_the_main_process_lets_go_of_exited_workers_buffers(photos: Path) -> None:
    # Without persistent_workers every epoch starts new workers: the buffers of the
    # ones that exited must not stay mapped in the main process epoch after epoch.
    ds = _dataset(photos)
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="fork", collate_fn=collate)
    tokens = set()
    for _ in range(4):
        for _images, _ in loader:
            pass
        tokens |= set(transport._MAPPED)
    assert len(tokens) == 8  # two new workers per epoch
    assert len(transport._MAPPED) <= 4  # this epoch's, and at most the last one's


def test_default_collate_takes_the_batch_whole(photos: Path) -> None:
    ds = _dataset(photos)
    batch = ds.__getitems__([3, 1, 4, 1, 5])
    assert isinstance(batch, BatchSamples)
    images, targets = default_collate(batch)
    assert images is batch.images  # no copy
    assert targets.tolist() == batch.targets and targets.dtype == torch.int64
    ours = collate(batch)
    assert ours[0] is batch.images and torch.equal(ours[1], targets)


def test_default_collate_of_a_changed_batch_stacks_what_it_holds(photos: Path) -> None:
    ds = _dataset(photos)
    batch = ds.__getitems__([0, 1, 2])
    other = ds.__getitems__([5])
    batch[1] = other[0]
    images, targets = default_collate(batch)
    assert images is not batch.images
    assert torch.equal(images[1], other.images[0]) and torch.equal(images[0], batch.images[0])
    assert targets.tolist() == [batch.targets[0], other.targets[0], batch.targets[2]]
    # a batch assembled from samples of several batches, by a user's sampler wrapper
    mixed = [batch[0], other[0]]
    images, targets = default_collate(mixed)
    assert torch.equal(images[1], other.images[0])
    with pytest.raises(RuntimeError, match="equal size"):
        default_collate([batch[0], (1, 2, 3)])


def test_default_collate_in_workers_equals_collate(photos: Path) -> None:
    ds = _dataset(photos)
    a = [(x.clone(), y) for x, y in _loader(ds, 2, "fork", None)]
    b = [(x.clone(), y) for x, y in _loader(ds, 2, "fork", collate)]
    assert len(a) == len(b) == 10
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_a_batch_sent_twice_is_sent_as_a_copy(photos: Path) -> None:
    # Only a DataLoader worker's result queue sends pooled batches; if one is pickled
    # twice (a user's own queue), the second is a copy, never a second reference.
    from multiprocessing.reduction import ForkingPickler

    pool = transport.BatchPool(shared=True)
    if not pool.shared:
        pytest.skip("needs memfd_create")
    images = pool.take((2, 3, 4, 4))
    images.fill_(7)
    buffer = pool.buffer_of(images)
    assert buffer is not None
    batch = transport.PooledBatch(images, torch.tensor([1, 2]), buffer, pool)
    first = ForkingPickler.dumps(batch)
    second = ForkingPickler.dumps(batch)
    assert len(second) < len(first) + 10_000  # a fresh torch tensor reference, not the buffer's fd
    import pickle

    copy = pickle.loads(second)
    assert copy[0].data_ptr() != images.data_ptr() and torch.equal(copy[0], images)
    received = pickle.loads(first)  # this process receiving its own batch: maps the buffer
    assert torch.equal(received[0], images) and received[1].tolist() == [1, 2]
    assert not buffer.free()
    del received
    del batch, images
    assert buffer.free()


def test_bulk_boxes_equal_the_per_sample_draws(photos: Path, capabilities: Any) -> None:
    assert crop._batch_boxes_ok()
    ds = _dataset(photos)
    order = list(range(len(ds))) * 2
    torch.manual_seed(3)
    bulk = ds.__getitems__(order)
    after_bulk = torch.rand(1)
    capabilities(**{"torchvision.batch_boxes": False})
    ds = _dataset(photos)
    assert ds._plan()._draw_many is None
    torch.manual_seed(3)
    each = ds.__getitems__(order)
    assert torch.equal(torch.rand(1), after_bulk)
    assert torch.equal(bulk.images, each.images) and bulk.targets == each.targets


def test_bulk_boxes_step_aside_for_another_default_dtype(photos: Path) -> None:
    ds = _dataset(photos)
    order = list(range(12))
    torch.manual_seed(4)
    want = ds.__getitems__(order).images.clone()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # torch.empty(1) draws 64-bit numbers then
    try:
        torch.manual_seed(4)
        float64 = [ds[i][0] for i in order]
        torch.manual_seed(4)
        batch = ds.__getitems__(order)
    finally:
        torch.set_default_dtype(previous)
    for k, x in enumerate(float64):
        assert torch.equal(batch.images[k], x)
    assert not torch.equal(batch.images, want)  # other numbers were drawn, as sample by sample


# -- a multi-crop's view batches: one pooled buffer for all of a batch's views ---------------------------
def _views_dataset(path: Path, threads: int = 1) -> LMDBFolder:
    """Two normalized float views and a uint8 one (their tensors of two dtypes in one buffer)."""
    jitter = (0.4, 0.4, 0.2, 0.1)
    views = [
        fused.View(SIZE, jitter=jitter, grayscale=0.2, blur=0.5),
        fused.View(SIZE, jitter=jitter, solarize=0.2),
        fused.View(13, scale=(0.05, 0.4), jitter=jitter, mean=None, std=None),
    ]
    return LMDBFolder(path, transform=fused.MultiCrop(views), threads=threads)


def _seed_views() -> None:
    """The views draw from torch's, Python's and numpy's generators (without workers)."""
    torch.manual_seed(9)
    random.seed(9)
    np.random.seed(9)


def _views_reference(ds: LMDBFolder, workers: int, context: str | None) -> list[tuple[list[torch.Tensor], Any]]:
    _seed_views()
    return [([v.clone() for v in views], y.clone()) for views, y in _epochs(_loader(ds, workers, context, collate))]


def _keep_views(views: list[torch.Tensor], how: int) -> Any:
    """What a user keeps of a batch of views: all of them, one view's batch, a slice of
    one, a numpy view of the uint8 one, or one sample's float view."""
    return [views, views[1], views[0][1:3], views[2].numpy(), views[0][3]][how]


@pytest.mark.parametrize(("context", "how"), [("fork", "collate"), ("fork", "default"), ("spawn", "default")])
def test_held_view_batches_are_never_overwritten_across_processes(photos: Path, context: str, how: str) -> None:
    ds = _views_dataset(photos)
    want = _views_reference(ds, 2, "fork")
    held = []
    for k, (views, targets) in enumerate(_epochs(_loader(ds, 2, context, collate if how == "collate" else None))):
        assert [v.dtype for v in views] == [torch.float32, torch.float32, torch.uint8]
        assert [tuple(v.shape[1:]) for v in views] == [(3, SIZE, SIZE), (3, SIZE, SIZE), (3, 13, 13)]
        held.append((k, _keep_views(views, k % 5), targets))
    assert len(held) == len(want) == 20
    for k, kept, targets in held:
        x, y = want[k]
        assert torch.equal(targets, y)
        expected = _keep_views(x, k % 5)
        if isinstance(kept, list):
            assert all(torch.equal(a, b) for a, b in zip(kept, expected, strict=True)), f"batch {k} changed"
        elif isinstance(kept, np.ndarray):
            assert np.array_equal(kept, expected), f"batch {k} changed after it was delivered"
        else:
            assert torch.equal(kept, expected), f"batch {k} changed after it was delivered"


@pytest.mark.skipif(not hasattr(__import__("os"), "memfd_create"), reason="pooled worker batches need memfd_create")
def test_worker_view_batches_need_no_fresh_shared_memory(photos: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counter = _Counter(monkeypatch)
    ds = _views_dataset(photos)
    batches = 0
    for views, _targets in _epochs(_loader(ds, 2, "fork", None), epochs=3):
        # Our mapping of the worker's buffer: a tensor torch's queue sent is in shared memory of its own.
        assert not any(v.is_shared() for v in views)
        assert len({v.untyped_storage().data_ptr() for v in views}) == 1  # one buffer for all the views
        batches += 1
    assert batches == 30
    assert counter.calls.value == 0, f"{counter.calls.value} batches were put in new shared memory"
    assert sum(len(maps) for maps in transport._MAPPED.values()) <= 2 * transport.MAX_BUFFERS


def test_held_view_batches_are_never_overwritten_in_threads_mode(photos: Path) -> None:
    ds = _views_dataset(photos, threads=2)
    want = _views_reference(ds, 0, None)
    _seed_views()
    held = [(views, views[0][2], views[2].numpy()) for views, _ in _epochs(_loader(ds, 0, None, None))]
    for (views, one, arr), (ref, _) in zip(held, want, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(views, ref, strict=True))
        assert torch.equal(one, ref[0][2]) and np.array_equal(arr, ref[2].numpy())


def test_threads_mode_reuses_a_view_buffer_once_the_batch_is_dropped(photos: Path) -> None:
    ds = _views_dataset(photos, threads=2)
    pool = transport.pool()
    before = pool.overflow
    pointers = set()
    for views, _ in _epochs(_loader(ds, 0, None, collate), epochs=3):
        pointers.add(views[0].data_ptr())
        assert views[1].data_ptr() % 64 == 0 and views[2].data_ptr() % 64 == 0
        del views
    assert len(pointers) <= 2 and pool.overflow == before


def test_a_view_batch_is_free_only_when_no_view_is_alive() -> None:
    import pickle
    from multiprocessing.reduction import ForkingPickler

    pool = transport.BatchPool(shared=True)
    if not pool.shared:
        pytest.skip("needs memfd_create")
    specs = [(torch.float32, (2, 3, 5, 5)), (torch.uint8, (2, 3, 3, 3)), (torch.float32, (2, 3, 2, 2))]
    views = pool.take_many(specs)
    for k in range(len(views)):
        views[k].fill_(k + 1)
    buffer = pool.buffer_of_many(views)
    assert buffer is not None and pool.buffer_of_many(views[:2]) is None and pool.buffer_of_many(views[::-1]) is None
    batch = transport.PooledBatch(views, torch.tensor([1, 2]), buffer, pool)
    received = pickle.loads(ForkingPickler.dumps(batch))
    got = received[0]
    assert [(v.dtype, tuple(v.shape)) for v in got] == [(d, s) for d, s in specs]
    assert all(torch.equal(a, b) for a, b in zip(got, views)) and received[1].tolist() == [1, 2]
    one = got[2][1]  # one sample's view of the last batch keeps the whole buffer
    del received, got, batch, views
    assert not buffer.free()
    del one
    assert buffer.free()

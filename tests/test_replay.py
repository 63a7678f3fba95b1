"""Replayable augmentation (``LMDBFolder(..., seed=S)``, lmdbfolder.replay).

Sample ``i`` of epoch ``e`` must get the same pixels whatever made it: one
sample at a time or in batches of any size, in the main process, in 1 or 3
DataLoader workers (fork and spawn), with ``threads=2``, resumed mid-epoch from a
StatefulDataLoader checkpoint, or on another number of ranks. The oracle is the
dataset itself, one sample at a time; and the same torchvision transform over
ImageFolder, run under the same per-sample seed.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader
from torchvision import transforms as T
from torchvision.datasets import ImageFolder
from torchvision.transforms import v2

from conftest import photo_jpeg, run_ranks, write
from lmdbfolder import fused, pack
from lmdbfolder.replay import EpochCell, derive, stream
from lmdbfolder.sampler import ExactDistributedSampler
from lmdbfolder.torch import LMDBFolder, collate

SEED = 1234
N = 30


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("replay")
    for k in range(N):
        w, h = [(161, 121), (121, 161), (90, 70), (97, 64)][k % 4]
        write(root / "src" / f"c{k % 3}" / f"{k:02d}.jpg", photo_jpeg(w, h, seed=k))
    pack(root / "src", root / "p", progress=False)
    return root


def fast() -> Any:
    """The batch fast path (fused crop + flip): drawn in bulk without a seed."""
    return T.Compose([fused.RandomResizedCrop(24, output="tensor"), T.RandomHorizontalFlip()])


def v2_pipeline() -> Any:
    """A per-sample torchvision v2 pipeline with several random steps."""
    return v2.Compose(
        [
            v2.RandomResizedCrop(24, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.ColorJitter(0.3, 0.3, 0.3, 0.05),
            v2.RandomGrayscale(0.3),
            v2.PILToTensor(),
        ]
    )


def fingerprint(sample: Any) -> tuple[int, int]:
    image, target = sample
    return zlib.crc32(image.contiguous().numpy().tobytes()), int(target)


def reference(ds: LMDBFolder, epoch: int) -> dict[int, tuple[int, int]]:
    ds.set_epoch(epoch)
    return {i: fingerprint(ds[i]) for i in range(len(ds))}


def through_loader(ds: LMDBFolder, order: list[int], batch_size: int, workers: int, ctx: str | None = None) -> dict:
    kwargs: dict[str, Any] = {"multiprocessing_context": ctx} if workers else {}
    loader = DataLoader(ds, batch_size=batch_size, sampler=order, num_workers=workers, collate_fn=collate, **kwargs)
    got, k = {}, 0
    for images, targets in loader:
        for image, target in zip(images, targets):
            got[order[k]] = fingerprint((image, target))
            k += 1
    return got


@pytest.mark.parametrize("make", [fast, v2_pipeline], ids=["fast-path", "v2"])
def test_the_same_pixels_whatever_makes_them(tree: Path, make: Any) -> None:
    ds = LMDBFolder(tree / "p", transform=make(), seed=SEED)
    want = reference(ds, 2)
    order = torch.randperm(N, generator=torch.Generator().manual_seed(0)).tolist()
    for batch_size, workers in [(8, 0), (32, 0), (8, 1), (8, 3), (32, 3)]:
        assert through_loader(ds, order, batch_size, workers, "fork") == want, (batch_size, workers)
    threaded = LMDBFolder(tree / "p", transform=make(), seed=SEED, threads=2)
    threaded.set_epoch(2)
    assert through_loader(threaded, order, 8, 0) == want
    # another epoch draws other numbers, and the same again when it comes back
    other = reference(ds, 3)
    assert other != want and reference(ds, 3) == other


def test_spawned_workers_see_the_epoch(tree: Path) -> None:
    ds = LMDBFolder(tree / "p", transform=fast(), seed=SEED)
    want = reference(ds, 5)
    order = list(range(N))
    loader = DataLoader(
        ds,
        batch_size=8,
        sampler=order,
        num_workers=2,
        collate_fn=collate,
        multiprocessing_context="spawn",
        persistent_workers=True,
    )
    for epoch in (5, 6):
        ds.set_epoch(epoch)  # persistent workers: the epoch reaches them through shared memory
        got = {}
        k = 0
        for images, targets in loader:
            for image, target in zip(images, targets):
                got[order[k]] = fingerprint((image, target))
                k += 1
        assert got == (want if epoch == 5 else reference(LMDBFolder(tree / "p", transform=fast(), seed=SEED), 6))


def test_a_seeded_sample_is_torchvisions_under_the_same_seed(tree: Path) -> None:
    # The stream is torch's generator seeded with derive(seed, epoch, index): the unfused
    # torchvision transform over ImageFolder, run under that seed, gives the same pixels.
    transform = T.Compose([T.RandomResizedCrop(24), T.RandomHorizontalFlip(), T.PILToTensor()])
    ours = LMDBFolder(tree / "p", transform=transform, seed=SEED)
    theirs = ImageFolder(tree / "src", transform=transform)
    ours.set_epoch(4)
    for i in range(N):
        with stream(derive(SEED, 4, i)):
            image, target = theirs[i]
        torch.manual_seed(1000 + i)  # whatever state the process is in
        mine, label = ours[i]
        assert torch.equal(mine, image) and label == target


def test_without_a_seed_nothing_changes(tree: Path) -> None:
    ds = LMDBFolder(tree / "p", transform=fast())
    assert ds.seed is None and ds.state_dict() == {}
    ds.set_epoch(3)  # a no-op, so a sampler may call it on any dataset
    torch.manual_seed(7)
    a = [fingerprint(ds[i]) for i in range(5)]
    torch.manual_seed(7)
    assert [fingerprint(ds[i]) for i in range(5)] == a
    with pytest.raises(ValueError, match="seed"):
        LMDBFolder(tree / "p", seed=-1)


def test_the_training_loops_generator_is_left_alone(tree: Path) -> None:
    ds = LMDBFolder(tree / "p", transform=fast(), seed=SEED)
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    ds[0], ds.__getitems__([1, 2, 3])
    assert torch.equal(torch.rand(3), expected)


def test_the_sampler_tells_the_dataset_its_epoch(tree: Path) -> None:
    ds = LMDBFolder(tree / "p", transform=fast(), seed=SEED)
    sampler = ExactDistributedSampler(ds, 2, 0, seed=3)
    sampler.set_epoch(7)
    assert ds.epoch == 7
    resumed = LMDBFolder(tree / "p", transform=fast(), seed=SEED)
    ExactDistributedSampler(resumed, 2, 0, seed=3).load_state_dict(sampler.state_dict())
    assert resumed.epoch == 7
    cell = EpochCell(4)
    import copy

    assert copy.deepcopy(cell).get() == 4  # pickled outside a process start: a plain number


def test_a_checkpointed_run_resumes_with_the_same_batches(tree: Path) -> None:
    def run(stop_after: int | None, state: Any = None) -> tuple[list[Any], Any]:
        ds = LMDBFolder(tree / "p", transform=v2_pipeline(), seed=SEED)
        sampler = ExactDistributedSampler(ds, 1, 0, seed=5)
        loader = StatefulDataLoader(ds, batch_size=4, sampler=sampler, num_workers=2, collate_fn=collate)
        sampler.set_epoch(1)
        if state is not None:
            loader.load_state_dict(state)
        batches = []
        for k, (images, targets) in enumerate(loader):
            batches.append((images.clone(), targets.clone()))
            if stop_after is not None and k + 1 == stop_after:
                return batches, loader.state_dict()
        return batches, None

    full, _ = run(None)
    head, state = run(3)
    tail, _ = run(None, state)
    assert len(head) + len(tail) == len(full) == 8
    for (a, y), (b, z) in zip(head + tail, full, strict=True):
        assert torch.equal(a, b) and torch.equal(y, z)


@pytest.mark.parametrize("new_ranks", [3, 1])
def test_a_two_rank_epoch_resumed_on_other_ranks_keeps_every_samples_pixels(tree: Path, new_ranks: int) -> None:
    # Two ranks stop after 2 batches of 4; new_ranks ranks resume from rank 1's state:
    # every sample not yet seen is seen once more, with the pixels the uninterrupted
    # 2-rank run gave it.
    def rank_run(ranks: int, rank: int, state: Any, steps: int | None) -> tuple[dict, Any]:
        ds = LMDBFolder(tree / "p", transform=fast(), seed=SEED)
        sampler = ExactDistributedSampler(ds, ranks, rank, seed=9)
        sampler.set_epoch(2)
        if state is not None:
            sampler.load_state_dict(state)
        order = list(iter(sampler))[:steps]
        return through_loader(ds, order, 4, 1, "fork"), sampler

    uninterrupted: dict = {}
    for rank in range(2):
        uninterrupted.update(rank_run(2, rank, None, None)[0])
    seen: dict = {}
    state = None
    for rank in range(2):
        got, sampler = rank_run(2, rank, None, 8)
        seen.update(got)
        sampler._position = 8  # as a loader that consumed 8 indices would have left it
        state = sampler.state_dict()
    resumed: list[int] = []
    for rank in range(new_ranks):
        got, _ = rank_run(new_ranks, rank, state, None)
        resumed += list(got)
        for i, fp in got.items():
            assert fp == uninterrupted[i], f"sample {i} got other pixels after the resume"
    assert sorted(set(resumed) | set(seen)) == list(range(N))
    assert not set(resumed) & set(seen), "a sample seen before the checkpoint was seen again"


def _ranks(world: int, spec: dict[str, Any], tmp_path: Path) -> None:
    """Run ``_elastic_worker.py`` as ``world`` gloo ranks, like torchrun."""
    script = Path(__file__).resolve().parent / "_elastic_worker.py"
    run_ranks(script, world, spec, tmp_path / f"spec-{spec['phase']}-{world}.json", timeout=300)


@pytest.mark.long("2 gloo ranks, then 3 and 1, each with a DataLoader worker: about a minute")
def test_real_ranks_resume_elastically_with_the_same_pixels(tree: Path, tmp_path: Path) -> None:
    # 2 gloo ranks, checkpointed after 2 batches of 4 (StatefulDataLoader, a worker
    # process each), resumed on 3 ranks and on 1: every sample the 2 ranks had not
    # consumed is read once more (plus the stated padding), with the uninterrupted
    # 2-rank run's pixels.
    import json

    spec: dict[str, Any] = {"pack": str(tree / "p"), "seed": SEED, "epoch": 2, "stop": 2, "dir": str(tmp_path)}
    _ranks(2, {**spec, "phase": "first"}, tmp_path)
    first = [json.loads((tmp_path / f"first-2-{r}.json").read_text()) for r in range(2)]
    full = {int(i): c for part in first for i, c in part["full"].items()}
    head = {int(i): c for part in first for i, c in part["head"].items()}
    assert len(full) == N and len(head) == 16 and all(full[i] == c for i, c in head.items())
    for world in (3, 1):
        _ranks(world, {**spec, "phase": "resume", "from_rank": 1}, tmp_path)
        parts = [json.loads((tmp_path / f"resume-{world}-{r}.json").read_text()) for r in range(world)]
        assert len({p["count"] for p in parts}) == 1  # the ranks move in lockstep
        rest: dict[int, int] = {}
        read = 0
        for p in parts:
            rest.update({int(i): c for i, c in p["rest"].items()})
            read += p["count"]
        assert set(rest) == set(range(N)) - set(head), f"{world} ranks: not exactly the samples left"
        assert read == len(rest) + parts[0]["padded"], "only the stated padding is read twice"
        assert all(full[i] == c for i, c in rest.items()), f"{world} ranks: a sample got other pixels"

"""ExactDistributedSampler without torch.distributed: the partition, the remainder
policy, the shard-aware order, resume through state_dict and StatefulDataLoader."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from lmdbfolder.sampler import ExactDistributedSampler
from lmdbfolder.write.shards import pack_sharded, plan_split

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # inside torchdata 0.11


def _offsets(n: int, shards: int) -> list[int]:
    return [lo for lo, _ in plan_split(n, shards)] + [n]


@pytest.mark.parametrize("n", [1, 7, 55, 64])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 9])
@pytest.mark.parametrize("drop_last", [False, True])
def test_random_order_is_torchs_distributed_sampler(n: int, world: int, drop_last: bool) -> None:
    if drop_last and n < world:
        return  # no sample per rank: refused, see test_bad_arguments
    data = list(range(n))
    for shuffle in (True, False):
        for rank in range(world):
            theirs = DistributedSampler(data, world, rank, shuffle=shuffle, seed=3, drop_last=drop_last)
            ours = ExactDistributedSampler(data, world, rank, shuffle=shuffle, seed=3, drop_last=drop_last)
            for epoch in (0, 5):
                theirs.set_epoch(epoch)
                ours.set_epoch(epoch)
                assert list(ours) == list(theirs)
                assert len(ours) == len(theirs)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 300),
    world=st.integers(1, 8),
    drop_last=st.booleans(),
    order=st.sampled_from(["random", "shards"]),
    shards=st.integers(1, 12),
    epoch=st.integers(0, 3),
)
def test_ranks_partition_each_epoch_with_the_reported_remainder(
    n: int, world: int, drop_last: bool, order: str, shards: int, epoch: int
) -> None:
    if drop_last and n < world:
        return
    offsets = _offsets(n, min(shards, n))
    samplers = [
        ExactDistributedSampler(range(n), world, r, seed=1, drop_last=drop_last, order=order, shard_offsets=offsets)
        for r in range(world)
    ]
    for s in samplers:
        s.set_epoch(epoch)
    parts = [list(s) for s in samplers]
    assert {len(p) for p in parts} == {samplers[0].num_samples}
    seen = Counter(i for p in parts for i in p)
    assert set(seen) <= set(range(n))
    s0 = samplers[0]
    if drop_last:
        assert max(seen.values()) == 1 and n - len(seen) == s0.num_dropped and s0.num_padded == 0
    else:
        assert len(seen) == n and sum(seen.values()) - n == s0.num_padded and s0.num_dropped == 0
    assert sum(seen.values()) == s0.total_size


def test_epochs_differ_and_describe_says_the_policy() -> None:
    s = ExactDistributedSampler(range(10), 4, 0, seed=0)
    assert s.indices(epoch=0) != s.indices(epoch=1)
    assert s.describe() == "10 samples on 4 ranks: 3 per rank, 2 samples repeated each epoch (drop_last=False)"
    d = ExactDistributedSampler(range(10), 4, 0, drop_last=True)
    assert d.describe() == "10 samples on 4 ranks: 2 per rank, 2 samples left out each epoch (drop_last=True)"
    assert "every sample exactly once" in ExactDistributedSampler(range(8), 4, 1).describe()


def test_shard_aware_order_reads_few_shards_at_a_time() -> None:
    n, shards, world = 1200, 24, 3
    offsets = _offsets(n, shards)
    for k in (1, 2, 4):
        for rank in range(world):
            s = ExactDistributedSampler(
                range(n), world, rank, seed=5, order="shards", shard_offsets=offsets, shards_at_once=k
            )
            order = s.indices(epoch=2)
            assert len(set(order)) == len(order) == n // world
            for start in range(0, len(order), s.window):
                window = order[start : start + s.window]
                touched = {next(j for j in range(shards) if offsets[j] <= i < offsets[j + 1]) for i in window}
                assert len(touched) <= k + 1
            assert order != sorted(order)  # shuffled inside the windows
    # blocks move between epochs, so a rank does not see the same shards every epoch
    s = ExactDistributedSampler(range(n), world, 0, seed=5, order="shards", shard_offsets=offsets)
    assert set(s.indices(epoch=0)) != set(s.indices(epoch=1))


def test_shard_offsets_come_from_a_sharded_lmdbfolder(small_tree: Path, tmp_path: Path) -> None:
    from lmdbfolder.torch import LMDBFolder

    pack_sharded(small_tree, tmp_path / "sh", shards=3, progress=False)
    ds = LMDBFolder(tmp_path / "sh")
    s = ExactDistributedSampler(ds, 2, 0, order="shards")
    assert s.shard_offsets == ds.reader.shard_offsets and len(s.shard_offsets) == 4


def test_state_dict_resumes_at_the_next_index() -> None:
    s = ExactDistributedSampler(range(50), 3, 2, seed=9)
    s.set_epoch(4)
    it = iter(s)
    head = [next(it) for _ in range(6)]
    state = s.state_dict()
    assert (state["epoch"], state["position"]) == (4, 6)
    t = ExactDistributedSampler(range(50), 3, 2, seed=9)
    t.load_state_dict(state)
    t.set_epoch(4)  # the usual loop calls set_epoch again: the position is kept
    assert head + list(t) == s.indices(epoch=4)
    t.set_epoch(5)  # another epoch starts at its beginning
    assert list(t) == s.indices(epoch=5)
    assert t.state_dict()["position"] == t.num_samples


def test_state_from_other_settings_is_refused() -> None:
    state = ExactDistributedSampler(range(50), 4, 0).state_dict()
    with pytest.raises(ValueError, match="dataset_len 50 -> 51"):
        ExactDistributedSampler(range(51), 4, 0).load_state_dict(state)
    with pytest.raises(ValueError, match="not a state"):
        ExactDistributedSampler(range(50), 4, 0).load_state_dict({"epoch": 1})
    ExactDistributedSampler(range(50), 4, 3).load_state_dict(state)  # any rank's state fits every rank


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="initialise torch.distributed"):
        ExactDistributedSampler(range(5))
    with pytest.raises(ValueError, match="rank must be"):
        ExactDistributedSampler(range(5), 2, 2)
    with pytest.raises(ValueError, match="order"):
        ExactDistributedSampler(range(5), 1, 0, order="zigzag")
    with pytest.raises(ValueError, match="shard_offsets"):
        ExactDistributedSampler(range(5), 1, 0, shard_offsets=[0, 3])
    with pytest.raises(ValueError, match="cannot give each"):
        ExactDistributedSampler(range(3), 4, 0, drop_last=True)


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_exactly(workers: int) -> None:
    data = list(range(37))

    def loader(sampler: ExactDistributedSampler) -> StatefulDataLoader:
        return StatefulDataLoader(data, batch_size=4, sampler=sampler, num_workers=workers)

    full_sampler = ExactDistributedSampler(data, 2, 1, seed=2)
    full_sampler.set_epoch(3)
    full = [int(x) for batch in loader(full_sampler) for x in batch]
    first = ExactDistributedSampler(data, 2, 1, seed=2)
    first.set_epoch(3)
    dl = loader(first)
    head = []
    for b, batch in enumerate(dl):
        head += [int(x) for x in batch]
        if b == 1:
            break
    state = dl.state_dict()
    del dl
    second = ExactDistributedSampler(data, 2, 1, seed=2)
    dl = loader(second)
    dl.load_state_dict(state)
    second.set_epoch(3)
    assert head + [int(x) for batch in dl for x in batch] == full


@pytest.mark.parametrize("workers", [0, 2])
def test_a_checkpoint_at_the_end_of_an_epoch_resumes_with_the_next_epoch(workers: int) -> None:
    # The usual end-of-epoch checkpoint: {"loader": loader.state_dict(), "epoch": epoch + 1}.
    # StatefulDataLoader loads the sampler's state when iteration starts, after the
    # loop's set_epoch: the finished epoch must not take the next one's place.
    data = list(range(12))

    def run(sampler: ExactDistributedSampler, loader: StatefulDataLoader, epochs: range) -> list[list[int]]:
        out = []
        for epoch in epochs:
            sampler.set_epoch(epoch)
            out.append([int(x) for batch in loader for x in batch])
        return out

    first = ExactDistributedSampler(data, 2, 0, seed=1)
    dl = StatefulDataLoader(data, batch_size=2, sampler=first, num_workers=workers)
    run(first, dl, range(1))
    checkpoint = {"loader": dl.state_dict(), "epoch": 1}
    del dl
    second = ExactDistributedSampler(data, 2, 0, seed=1)
    dl = StatefulDataLoader(data, batch_size=2, sampler=second, num_workers=workers)
    dl.load_state_dict(checkpoint["loader"])
    assert run(second, dl, range(checkpoint["epoch"], 3)) == [first.indices(epoch=e) for e in (1, 2)]


def test_the_random_order_resumes_on_a_sharded_copy_of_the_pack() -> None:
    # The random order does not depend on the shards (nor on shards_at_once): a state
    # saved while reading a single pack resumes on a sharded copy of it, exactly.
    single = ExactDistributedSampler(range(50), 4, 1, seed=3)
    single.set_epoch(2)
    head = list(itertools.islice(iter(single), 5))
    sharded = ExactDistributedSampler(range(50), 4, 1, seed=3, shard_offsets=_offsets(50, 5), shards_at_once=3)
    sharded.load_state_dict(single.state_dict())
    assert head + list(sharded) == single.indices(epoch=2)
    # The shard-aware orders do depend on them: refused.
    state = ExactDistributedSampler(range(50), 4, 1, order="shards").state_dict()
    with pytest.raises(ValueError, match="window 100 -> 20"):
        ExactDistributedSampler(range(50), 4, 1, order="shards", shard_offsets=_offsets(50, 5)).load_state_dict(state)


def test_the_plain_dataloader_recipe_resumes_at_every_step() -> None:
    # docs/distributed.md's recipe for a plain DataLoader, at every step of an epoch whose last
    # batch is short (7 indices per rank, batches of 2), the end included.
    from torch.utils.data import DataLoader

    data = list(range(14))
    s = ExactDistributedSampler(data, 2, 0, seed=1)
    s.set_epoch(1)
    batches = [[int(x) for x in b] for b in DataLoader(data, batch_size=2, sampler=s)]
    for steps_done in range(len(batches) + 1):
        t = ExactDistributedSampler(data, 2, 0, seed=1)
        position = min(steps_done * 2, len(t))
        t.load_state_dict({**t.state_dict(), "epoch": 1, "position": position})
        assert [int(x) for b in DataLoader(data, batch_size=2, sampler=t) for x in b] == sum(batches[steps_done:], [])
    with pytest.raises(ValueError, match=r"position 8 .*0\.\.7\)"):
        t.load_state_dict({**t.state_dict(), "position": 8})


def _run_job(
    n: int, ranks: int, state: dict[str, Any] | None, steps: int | None, **settings: Any
) -> tuple[list[list[int]], dict[str, Any] | None]:
    """Every rank of a job of ``ranks`` ranks, from ``state`` (None: the epoch's start),
    for ``steps`` indices each (None: to the end): what each rank used, and the state
    rank 0 would save then (ranks move in lockstep: any rank's fits)."""
    used, saved = [], None
    for rank in range(ranks):
        s = ExactDistributedSampler(range(n), ranks, rank, **settings)
        s.set_epoch(3)
        if state is not None:
            s.load_state_dict(state)
        it = iter(s)
        used.append(list(itertools.islice(it, steps)) if steps is not None else list(it))
        if rank == 0:
            saved = s.state_dict()
    return used, saved


@pytest.mark.parametrize("order", ["random", "shards", "nodes"])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("n", "jobs"), [(50, (2, 3)), (50, (2, 1)), (61, (2, 3, 1)), (37, (4, 3, 2)), (12, (2, 5))])
def test_an_epoch_resumes_on_another_number_of_ranks(order: str, drop_last: bool, n: int, jobs: tuple) -> None:
    # A job of jobs[0] ranks stops part way, the next job (another number of ranks)
    # resumes from one rank's state, and so on; the last runs to the end of the epoch.
    # Together they use every sample of the epoch exactly once (plus the stated padding,
    # or less the stated dropped samples).
    offsets = _offsets(n, 5)
    settings: dict[str, Any] = {"seed": 4, "drop_last": drop_last, "order": order, "shard_offsets": offsets}
    if order == "nodes":
        settings["nodes"] = 1
    state = None
    counts: Counter[int] = Counter()
    for k, ranks in enumerate(jobs):
        last = k == len(jobs) - 1
        steps = None if last else 3 + k
        used, state = _run_job(n, ranks, state, steps, **settings)
        assert len({len(u) for u in used}) == 1, "the ranks of a job must take the same number of steps"
        for u in used:
            counts.update(u)
    first = ExactDistributedSampler(range(n), jobs[0], 0, **settings)
    seen = set(counts)
    repeats = sum(counts.values()) - len(seen)
    # what the first job padded or dropped, and what each resume padded or dropped, is stated
    if drop_last:
        assert repeats == 0, "a sample was used twice"
        assert n - len(seen) <= first.num_dropped + sum(_stated(n, jobs, settings, "resume_dropped"))
    else:
        assert seen == set(range(n)), f"samples never used: {sorted(set(range(n)) - seen)}"
        assert repeats <= first.num_padded + sum(_stated(n, jobs, settings, "resume_padded"))


def _stated(n: int, jobs: tuple, settings: dict[str, Any], what: str) -> list[int]:
    """resume_padded / resume_dropped of each resumed job, as its samplers state them."""
    out, state = [], None
    for k, ranks in enumerate(jobs):
        s = ExactDistributedSampler(range(n), ranks, 0, **settings)
        s.set_epoch(3)
        if state is not None:
            s.load_state_dict(state)
            out.append(getattr(s, what))
            assert "resumed after" in s.describe()
        list(itertools.islice(iter(s), 3 + k))
        state = s.state_dict()
    return out


def test_an_elastic_resume_continues_the_interrupted_order() -> None:
    # 2 ranks stop after 4 indices each; on 1 rank the rest of the epoch is exactly
    # the 2-rank job's remaining indices, in the order the two ranks would have used them.
    n = 40
    two = [ExactDistributedSampler(range(n), 2, r, seed=7) for r in range(2)]
    for s in two:
        s.set_epoch(1)
    parts = [s.indices() for s in two]
    one = ExactDistributedSampler(range(n), 1, 0, seed=7)
    one.load_state_dict({**two[1].state_dict(), "position": 4})
    assert list(one) == [parts[r][k] for k in range(4, 20) for r in range(2)]
    assert one.state_dict()["earlier_jobs"] == [{"num_replicas": 2, "nodes": 1, "position": 4}]
    # the next epoch is the 1-rank job's own
    one.set_epoch(2)
    assert list(one) == one.indices(epoch=2)


def test_a_resumed_job_saves_a_state_that_resumes_again() -> None:
    # 2 ranks -> 3 ranks (checkpointed after 2 steps) -> 3 ranks again: the last job
    # continues the 3-rank split exactly where it was.
    n = 50
    first = ExactDistributedSampler(range(n), 2, 0, seed=1)
    first.set_epoch(0)
    list(itertools.islice(iter(first), 6))
    three = [ExactDistributedSampler(range(n), 3, r, seed=1) for r in range(3)]
    for s in three:
        s.load_state_dict(first.state_dict())
    full = [list(s) for s in three]
    again = ExactDistributedSampler(range(n), 3, 1, seed=1)
    again.load_state_dict({**three[2].state_dict(), "position": 2})
    assert list(again) == full[1][2:]
    with pytest.raises(ValueError, match="earlier_jobs"):
        again.load_state_dict({**three[2].state_dict(), "earlier_jobs": [{"num_replicas": 0}]})

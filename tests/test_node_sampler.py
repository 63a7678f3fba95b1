"""ExactDistributedSampler(order="nodes"): each node's ranks read their own part of the shards,
every sample still exactly once per epoch (or the stated padding/drop), resumable mid-epoch."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

pytest.importorskip("torch")

from lmdbfolder.sampler import ExactDistributedSampler  # noqa: E402


class Sized:
    def __init__(self, offsets: list[int]) -> None:
        self.shard_offsets = offsets

    def __len__(self) -> int:
        return self.shard_offsets[-1]


def offsets_of(sizes: list[int]) -> list[int]:
    return [0, *itertools.accumulate(sizes)]


def samplers(sizes: list[int], world: int, nodes: int, **kw: object) -> list[ExactDistributedSampler]:
    ds = Sized(offsets_of(sizes))
    return [ExactDistributedSampler(ds, world, r, order="nodes", nodes=nodes, **kw) for r in range(world)]


@pytest.mark.parametrize("sizes", [[10, 10, 10, 10], [7, 13, 9, 11, 15], [3, 1, 2], [55]])
@pytest.mark.parametrize(("world", "nodes"), [(1, 1), (2, 2), (4, 2), (6, 3), (6, 2)])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_sample_exactly_once_per_epoch(
    sizes: list[int], world: int, nodes: int, drop_last: bool, shuffle: bool
) -> None:
    n = sum(sizes)
    if drop_last and n < world:
        pytest.skip("fewer samples than ranks")
    ranks = samplers(sizes, world, nodes, drop_last=drop_last, shuffle=shuffle, seed=3)
    for epoch in range(3):
        seen: Counter[int] = Counter()
        for s in ranks:
            s.set_epoch(epoch)
            got = list(s)
            assert len(got) == s.num_samples == len(s)
            seen.update(got)
        s = ranks[0]
        assert set(seen) <= set(range(n))
        if drop_last:
            assert len(seen) == n - s.num_dropped and max(seen.values()) == 1
        else:
            assert set(seen) == set(range(n))
            assert sum(seen.values()) - n == s.num_padded


def shards_read(s: ExactDistributedSampler, epoch: int) -> set[int]:
    return {k for k, _ in s.shard_schedule(s.indices(epoch))}


def test_each_node_reads_only_its_share_of_the_shards() -> None:
    # 8 equal shards, 2 nodes x 2 ranks: a node reads exactly 4 shards per epoch, the two
    # nodes disjoint, and the shards move between nodes from epoch to epoch
    ranks = samplers([10] * 8, 4, 2, seed=0)
    assignments = []
    for epoch in range(6):
        node0 = shards_read(ranks[0], epoch) | shards_read(ranks[1], epoch)
        node1 = shards_read(ranks[2], epoch) | shards_read(ranks[3], epoch)
        assert len(node0) == len(node1) == 4 and not node0 & node1
        # both ranks of a node read the same shards
        assert shards_read(ranks[0], epoch) == shards_read(ranks[1], epoch)
        assignments.append(frozenset(node0))
    assert len(set(assignments)) > 1


def test_unequal_shards_share_at_most_one_shard_per_boundary() -> None:
    ranks = samplers([7, 13, 9, 11, 15, 5, 12, 8], 4, 2, seed=1)
    for epoch in range(5):
        node0 = shards_read(ranks[0], epoch) | shards_read(ranks[1], epoch)
        node1 = shards_read(ranks[2], epoch) | shards_read(ranks[3], epoch)
        assert len(node0 & node1) <= 1 and len(node0 | node1) == 8


def test_the_ranks_of_a_node_move_through_the_same_window() -> None:
    # shards_at_once=1 with equal shards: each window is one shard; both ranks of a node
    # finish a shard's samples before either starts the next one
    ranks = samplers([12] * 4, 4, 2, seed=5, shards_at_once=1)
    offsets = offsets_of([12] * 4)
    for r in (0, 1):
        shard_seq = [max(k for k in range(4) if offsets[k] <= i) for i in ranks[r].indices(0)]
        assert shard_seq == sorted(shard_seq, key=shard_seq.index)  # contiguous runs
        assert len(set(shard_seq[:6])) == 1  # the first window is one shard


def test_resume_mid_epoch_continues_exactly() -> None:
    a = samplers([9, 14, 11, 6], 4, 2, seed=2)[3]
    a.set_epoch(1)
    it = iter(a)
    first = [next(it) for _ in range(5)]
    state = a.state_dict()
    assert state["nodes"] == 2 and state["order"] == "nodes"
    b = samplers([9, 14, 11, 6], 4, 2, seed=2)[3]
    b.load_state_dict(state)
    b.set_epoch(1)
    assert first + list(b) == a.indices(1)
    # On as many ranks split into other nodes the epoch resumes elastically (issue 36):
    # the rest of it, every sample the old job had not used, once (no padding here).
    old = samplers([9, 14, 11, 6], 4, 2, seed=2)
    for s in old:
        s.set_epoch(1)
    used = {i for s in old for i in s.indices(1)[:5]}
    rest = []
    for c in samplers([9, 14, 11, 6], 4, 4, seed=2):
        c.load_state_dict(state)
        rest += list(c)
    assert sorted(rest) == sorted(set(range(40)) - used)


def test_states_saved_before_nodes_existed_still_load() -> None:
    s = ExactDistributedSampler(Sized(offsets_of([5, 5])), 2, 0, order="shards")
    state = s.state_dict()
    del state["nodes"]
    ExactDistributedSampler(Sized(offsets_of([5, 5])), 2, 0, order="shards").load_state_dict(state)


def test_settings_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    ds = Sized(offsets_of([5, 5]))
    with pytest.raises(ValueError, match="divide"):
        ExactDistributedSampler(ds, 4, 0, order="nodes", nodes=3)
    with pytest.raises(ValueError, match="order='nodes'"):
        ExactDistributedSampler(ds, 4, 0, order="random", nodes=2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        ExactDistributedSampler(ds, 4, 0, order="nodes")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: 2 ranks per node
    assert ExactDistributedSampler(ds, 4, 0, order="nodes").nodes == 2


def test_shard_schedule_lists_first_use_order_and_last_use() -> None:
    s = ExactDistributedSampler(Sized(offsets_of([3, 3, 3])), 1, 0, shuffle=False)
    assert s.shard_schedule([4, 0, 5, 1, 7], 0) == [(1, 2), (0, 3), (2, 4)]
    assert s.shard_schedule([4, 0, 5, 1, 7], 2) == [(1, 2), (0, 3), (2, 4)]
    assert s.shard_schedule([4, 0, 5, 1, 7], 3) == [(0, 3), (2, 4)]
    assert s.shard_schedule([], 0) == []

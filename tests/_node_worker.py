"""One rank of the node-local staging test in tests/test_staging.py (not collected by pytest).

Run as ``python _node_worker.py SPEC.json`` with RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT and the S3 variables set (each node's ranks reach the server
through their node's own proxy). Ranks ``2k`` and ``2k + 1`` are node ``k``
and share its cache folder. For each epoch every rank reads its part through
LMDBFolder (a pack in object storage), ExactDistributedSampler(order="nodes")
and a DataLoader with a worker process; rank 0 gathers the indices, counts
them, and records per node how many shards it read and how many landed in
its cache during the epoch (its downloads).
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from lmdbfolder.sampler import ExactDistributedSampler
from lmdbfolder.torch import LMDBFolder


class Indexed(Dataset):
    """(index, target) of each sample, read (and so staged) through LMDBFolder."""

    def __init__(self, ds: LMDBFolder) -> None:
        self.ds = ds
        self.reader = ds.reader  # the sampler finds the shards and the staging cache here

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> tuple[int, int]:
        _, target = self.ds[i]
        return i, target


def collate(batch: list[Any]) -> list[Any]:
    return batch


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    per_node = world // spec["nodes"]
    node = rank // per_node
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    ds = Indexed(LMDBFolder(spec["url"], cache_dir=spec["caches"][node]))
    staging = ds.reader.staging
    sampler = ExactDistributedSampler(ds, world, rank, seed=11, order="nodes", nodes=spec["nodes"], shards_at_once=1)
    loader = DataLoader(ds, batch_size=5, sampler=sampler, num_workers=1, collate_fn=collate)
    rows = []
    for epoch in range(spec["epochs"]):
        sampler.set_epoch(epoch)
        dist.barrier()
        before = set(staging.staged())
        dist.barrier()  # every rank of the node counted before any downloads
        got = [i for batch in loader for i, _ in batch]
        read = {k for k, _ in sampler.shard_schedule(sampler.indices())}
        dist.barrier()
        after = set(staging.staged())
        everything: list[Any] = [None] * world
        dist.all_gather_object(
            everything, {"node": node, "indices": got, "read": sorted(read), "new": sorted(after - before)}
        )
        if rank == 0:
            counts = Counter(i for part in everything for i in part["indices"])
            read_by = [set() for _ in range(spec["nodes"])]
            new_by = [set() for _ in range(spec["nodes"])]
            for part in everything:
                read_by[part["node"]].update(part["read"])
                new_by[part["node"]].update(part["new"])
            n = len(ds)
            rows.append(
                {
                    "epoch": epoch,
                    "seen": sum(counts.values()),
                    "missing": sum(1 for i in range(n) if i not in counts),
                    "duplicated": sum(c - 1 for c in counts.values() if c > 1),
                    "read": [len(r) for r in read_by],
                    "downloaded": [len(d) for d in new_by],
                }
            )
        dist.barrier()
    if rank == 0:
        with open(spec["result"], "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

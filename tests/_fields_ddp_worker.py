"""One rank of the distributed test of packs of several fields in tests/test_fields_update.py (not
collected by pytest). Run as ``python _fields_ddp_worker.py SPEC.json`` with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set, like torchrun does.

For each sampler order and epoch of the spec it reads this rank's part of the epoch through
``LMDBDataset(pack, transforms=..., seed=...)``, ``ExactDistributedSampler`` and a DataLoader
with a worker process, then gathers every rank's (index, CRC-32 of each transformed field) on
rank 0 over gloo, which writes one JSON line per (order, epoch) to the result file."""

from __future__ import annotations

import json
import sys
import zlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torchvision import tv_tensors
from torchvision.transforms import v2

from lmdbfolder.sampler import ExactDistributedSampler
from lmdbfolder.torch import LMDBDataset

#: How the DataLoader starts its worker. Not fork: each epoch's DataLoader would fork while the
#: previous one's queue feeder thread may still be tearing down its Python thread state, and
#: CPython 3.11's child then waits forever in PyOS_AfterFork_Child for the lock that thread held
#: (two hung runs of this test; a stack of the hung worker shows _PyThreadState_DeleteExcept).
#: The forkserver's process has no other threads. Fork and spawn are tested elsewhere.
CONTEXT = "forkserver"


def pipeline() -> v2.Compose:
    """The seeded joint pipeline of the test (the test builds the same one)."""
    return v2.Compose(
        [
            v2.RandomResizedCrop(12, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.ToImage(),
            v2.ToDtype({tv_tensors.Image: torch.float32, "others": None}, scale=True),
        ]
    )


def crcs(item: Any) -> list[int]:
    """CRC-32 of each field's tensor bytes."""
    return [zlib.crc32(t.contiguous().numpy().tobytes()) for t in item]


class Indexed(Dataset):
    """(index, CRCs of the transformed fields) of each sample."""

    def __init__(self, ds: LMDBDataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> tuple[int, list[int]]:
        return i, crcs(self.ds[i])


def main(spec_file: str) -> None:
    with open(spec_file) as f:
        spec = json.loads(f.read())
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    ds = LMDBDataset(spec["pack"], transforms=pipeline(), seed=spec["seed"])
    lines = []
    for order in spec["orders"]:
        for epoch in spec["epochs"]:
            sampler = ExactDistributedSampler(ds, seed=0, order=order, shards_at_once=1)
            sampler.set_epoch(epoch)
            ds.set_epoch(epoch)
            loader = DataLoader(
                Indexed(ds),
                batch_size=2,
                sampler=sampler,
                num_workers=1,
                collate_fn=list,
                multiprocessing_context=CONTEXT,
            )
            mine = [[i, c] for batch in loader for i, c in batch]
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            if rank == 0:
                lines.append({"order": order, "epoch": epoch, "ranks": gathered, "padded": sampler.num_padded})
    if rank == 0:
        with open(spec["out"], "w") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

"""One rank of the exactness test in tests/test_distributed.py (not collected by pytest).

Run as ``python _ddp_worker.py SPEC.json`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set, like torchrun does. For every configuration in the spec and every
epoch it reads the whole epoch through LMDBFolder, ExactDistributedSampler and a
StatefulDataLoader with real worker processes:

* uninterrupted, and
* interrupted after a few batches (the loader's state_dict saved through
  torch.save, the loader and its workers torn down), then resumed in a new
  sampler and loader from that state;

then gathers every rank's samples on rank 0 over gloo, which counts them and
appends one JSON line per (configuration, epoch) to the result file.
"""

from __future__ import annotations

import gc
import io
import json
import os
import sys
import threading
import zlib
from collections import Counter
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lmdbfolder.sampler import ExactDistributedSampler
from lmdbfolder.torch import LMDBFolder


class Indexed(Dataset):
    """(index, CRC-32 of the decoded pixels, target) of each sample, read through LMDBFolder."""

    def __init__(self, root: str) -> None:
        self.ds = LMDBFolder(root)

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> tuple[int, int, int]:
        image, target = self.ds[i]
        return i, zlib.crc32(image.tobytes()), target


def _settle_threads() -> None:
    # The queues of the loader torn down just before still have feeder threads
    # on their way out. Forking while a Python thread is being deleted can hang
    # the child inside CPython's after-fork handler (seen once in a few hundred
    # worker starts here: PyOS_AfterFork_Child -> _PyThreadState_DeleteExcept
    # waiting on a lock). Let them finish before the next loader forks.
    for thread in threading.enumerate():
        if thread is not threading.current_thread():
            thread.join(timeout=5)


def _loader(ds: Indexed, sampler: ExactDistributedSampler, cfg: dict[str, Any]) -> StatefulDataLoader:
    workers = cfg["workers"]
    if workers and cfg.get("context") == "fork":
        gc.collect()  # tears down a loader that is no longer referenced, and its queues
        _settle_threads()
    return StatefulDataLoader(
        ds,
        batch_size=cfg["batch"],
        sampler=sampler,
        num_workers=workers,
        multiprocessing_context=cfg.get("context") if workers else None,
    )


def _flat(batch: Any) -> list[tuple[int, int]]:
    index, crc, _target = batch
    return list(zip(index.tolist(), crc.tolist()))


def _sampler(ds: Indexed, cfg: dict[str, Any], world: int, rank: int) -> ExactDistributedSampler:
    return ExactDistributedSampler(
        ds, world, rank, shuffle=True, seed=cfg["seed"], drop_last=cfg["drop_last"], order=cfg["order"]
    )


def run_config(ds: Indexed, cfg: dict[str, Any], world: int, rank: int) -> list[dict[str, Any]]:
    rows = []
    for epoch in range(cfg["epochs"]):
        sampler = _sampler(ds, cfg, world, rank)
        sampler.set_epoch(epoch)
        full = [item for batch in _loader(ds, sampler, cfg) for item in _flat(batch)]
        if epoch != cfg["epochs"] - 1:  # interrupt and resume in the last epoch only
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, {"full": full, "resumed": None, "planned": sampler.indices()})
            if rank == 0:
                rows.append(_count(cfg, epoch, world, sampler, gathered))
            continue

        # interrupted after `stop` batches, resumed from a checkpoint in fresh objects
        first = _sampler(ds, cfg, world, rank)
        first.set_epoch(epoch)
        loader = _loader(ds, first, cfg)
        head: list[tuple[int, int]] = []
        stop = cfg["stop_after"]
        for b, batch in enumerate(loader):
            head.extend(_flat(batch))
            if b + 1 == stop:
                break
        buffer = io.BytesIO()
        torch.save({"loader": loader.state_dict(), "epoch": epoch}, buffer)
        del loader
        buffer.seek(0)
        checkpoint = torch.load(buffer, weights_only=False)
        second = _sampler(ds, cfg, world, rank)
        loader = _loader(ds, second, cfg)
        loader.load_state_dict(checkpoint["loader"])
        second.set_epoch(checkpoint["epoch"])
        tail = [item for batch in loader for item in _flat(batch)]
        gathered = [None] * world
        dist.all_gather_object(gathered, {"full": full, "resumed": head + tail, "planned": sampler.indices()})
        if rank == 0:
            rows.append(_count(cfg, epoch, world, sampler, gathered))
    return rows


def _count(
    cfg: dict[str, Any], epoch: int, world: int, sampler: ExactDistributedSampler, gathered: list[Any]
) -> dict[str, Any]:
    n = sampler.dataset_len
    expected_crc = EXPECTED_CRC
    seen = Counter(i for g in gathered for i, _ in g["full"])
    wrong_pixels = sum(1 for g in gathered for i, crc in g["full"] if expected_crc[i] != crc)
    return {
        "world": world,
        "workers": cfg["workers"],
        "context": cfg.get("context") or "-",
        "order": cfg["order"],
        "remainder": sampler.remainder,
        "epoch": epoch,
        "dataset": n,
        "seen": sum(seen.values()),
        "missing": sum(1 for i in range(n) if seen[i] == 0),
        "duplicated": sum(c - 1 for c in seen.values() if c > 1),
        "reported_padded": sampler.num_padded,
        "reported_dropped": sampler.num_dropped,
        "per_rank": sorted({len(g["full"]) for g in gathered}),
        "num_samples": sampler.num_samples,
        "wrong_pixels": wrong_pixels,
        "resumed": gathered[0]["resumed"] is not None,
        "resume_equal": all(g["resumed"] in (None, g["full"]) for g in gathered),
        "as_planned": all([i for i, _ in g["full"]] == g["planned"] for g in gathered),
    }


EXPECTED_CRC: dict[int, int] = {}


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=240))
    try:
        ds = Indexed(spec["pack"])
        if rank == 0:
            EXPECTED_CRC.update({i: ds[i][1] for i in range(len(ds))})
        rows = [row for cfg in spec["configs"] for row in run_config(ds, cfg, world, rank)]
        if rank == 0:
            with open(spec["out"], "a") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

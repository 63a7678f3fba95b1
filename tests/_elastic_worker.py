"""One rank of the elastic-resume test in tests/test_replay.py (not collected by pytest).

Run as ``python _elastic_worker.py SPEC.json`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set, like torchrun does. ``spec["phase"]``:

* ``"first"``: the interrupted job. Each rank reads its whole epoch through a seeded
  LMDBFolder, ExactDistributedSampler and a StatefulDataLoader with a worker process
  (the uninterrupted run), then again, stopping after ``stop`` batches and saving the
  loader's state with ``torch.save`` (one file per rank).
* ``"resume"``: the job that comes back on WORLD_SIZE ranks. Every rank loads the
  state that rank ``spec["from_rank"]`` of the first job saved and reads the rest.

Each rank writes ``{index: CRC-32 of its pixels}`` of what it read as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader
from torchvision import transforms as T

from lmdbfolder import fused
from lmdbfolder.sampler import ExactDistributedSampler
from lmdbfolder.torch import LMDBFolder, collate


def _loader(spec: dict[str, Any]) -> tuple[StatefulDataLoader, ExactDistributedSampler]:
    transform = T.Compose([fused.RandomResizedCrop(24, output="tensor"), T.RandomHorizontalFlip()])
    ds = LMDBFolder(spec["pack"], transform=transform, seed=spec["seed"])
    sampler = ExactDistributedSampler(ds, seed=3)  # world size and rank from torch.distributed
    loader = StatefulDataLoader(
        ds, batch_size=4, sampler=sampler, num_workers=1, collate_fn=collate, multiprocessing_context="fork"
    )
    return loader, sampler


def _read(loader: StatefulDataLoader, stop: int | None = None) -> list[list[int]]:
    out = []
    for b, (images, _targets) in enumerate(loader):
        out.append([zlib.crc32(image.contiguous().numpy().tobytes()) for image in images])
        if stop is not None and b + 1 == stop:
            break
    return out


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=240))
    try:
        result: dict[str, Any] = {}
        if spec["phase"] == "first":
            loader, sampler = _loader(spec)
            sampler.set_epoch(spec["epoch"])
            order = sampler.indices()
            crcs = [c for batch in _read(loader) for c in batch]
            result["full"] = dict(zip(order, crcs))
            loader, sampler = _loader(spec)
            sampler.set_epoch(spec["epoch"])
            head = [c for batch in _read(loader, spec["stop"]) for c in batch]
            result["head"] = dict(zip(order, head))
            torch.save(loader.state_dict(), os.path.join(spec["dir"], f"state-{rank}.pt"))
        else:
            loader, sampler = _loader(spec)
            state = torch.load(os.path.join(spec["dir"], f"state-{spec['from_rank']}.pt"), weights_only=False)
            sampler.set_epoch(spec["epoch"])
            loader.load_state_dict(state)
            batches = _read(loader)
            plan = sampler._resumed_plan()  # the indices this rank was given, in order
            crcs = [c for batch in batches for c in batch]
            result["rest"] = dict(zip(plan, crcs))
            result["count"] = len(crcs)
            result["padded"] = sampler.resume_padded
        with open(os.path.join(spec["dir"], f"{spec['phase']}-{dist.get_world_size()}-{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

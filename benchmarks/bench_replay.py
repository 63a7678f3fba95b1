"""What replayable augmentation (``LMDBFolder(..., seed=S)``) costs per sample.

Usage:
    python benchmarks/bench_replay.py PACK [--rounds 5] [--images 2000] [--size 224]

For each pipeline, the same DataLoader loop (``batch_size=64``, ``num_workers=0``,
``collate_fn=collate``, one process, torch on one thread) is run with and without
``seed=``, alternated, each run in a fresh interpreter:

* ``fast``: lmdbfolder's batch path, ``fused.RandomResizedCrop(SIZE, output="tensor")``
  + ``RandomHorizontalFlip()`` (seeded: every sample's box and flip drawn from its
  own stream instead of one bulk draw);
* ``default``: torchvision's ``RandomResizedCrop(SIZE)`` + ``RandomHorizontalFlip()``
  + ``PILToTensor()``, sample by sample (seeded: each sample under its own seed).

Reports CPU us per sample (the run's own process time over the images) beside
img/s, and seeded / unseeded per pipeline. A run during which other processes
used more than ``--max-other`` cores (from /proc/stat, less the run's own CPU) is
retried, then dropped; each cell is the median of the kept runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, os, sys, time
import torch
torch.set_num_threads(1)
from torch.utils.data import DataLoader
from torchvision import transforms as T
from lmdbfolder import fused
from lmdbfolder.torch import LMDBFolder, collate
pack, kind, seeded, images, size = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4]), int(sys.argv[5])
if kind == "fast":
    tf = T.Compose([fused.RandomResizedCrop(size, output="tensor"), T.RandomHorizontalFlip()])
else:
    tf = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.PILToTensor()])
ds = LMDBFolder(pack, transform=tf, seed=0 if seeded else None)
order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(1)).tolist()
order = (order * (images // len(order) + 2))[: images + 256]
loader = DataLoader(ds, batch_size=64, sampler=order, num_workers=0, collate_fn=collate)
it = iter(loader)
for _ in range(4):  # warm-up: page cache, decoders, buffers
    next(it)
n = 0
t0, c0 = time.perf_counter(), time.process_time()
for images_, _ in it:
    n += len(images_)
    if n >= images:
        break
t1, c1 = time.perf_counter(), time.process_time()
print(json.dumps({"n": n, "wall": t1 - t0, "cpu": c1 - c0}))
"""


def _busy() -> tuple[float, float]:
    with open("/proc/stat") as f:
        fields = [float(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def run_once(pack: str, kind: str, seeded: bool, images: int, size: int) -> dict:
    """One run in a fresh interpreter, with the cores other processes used meanwhile."""
    ticks = os.sysconf("SC_CLK_TCK")
    before = os.times()
    b0, _ = _busy()
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", CHILD, pack, kind, "1" if seeded else "0", str(images), str(size)],
        capture_output=True,
        text=True,
        check=True,
    )
    elapsed = time.perf_counter() - t0
    b1, _ = _busy()
    after = os.times()
    own = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    # /proc/stat counts every process's ticks: less the child's own (its whole life)
    row["other_cores"] = max(0.0, ((b1 - b0) / ticks - own) / elapsed)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pack")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--max-other", type=float, default=0.3, help="cores other processes may use during a run")
    args = parser.parse_args()
    results: dict[tuple[str, bool], list[dict]] = {}
    dropped = 0
    for _ in range(args.rounds):
        for kind in ("fast", "default"):
            for seeded in (False, True):
                for _attempt in range(3):
                    row = run_once(args.pack, kind, seeded, args.images, args.size)
                    if row["other_cores"] <= args.max_other:
                        results.setdefault((kind, seeded), []).append(row)
                        break
                    dropped += 1
    print(f"{'pipeline':<9} {'seed':<5} {'img/s':>8} {'CPU us/img':>11} {'other cores':>12} runs")
    summary = {}
    for (kind, seeded), rows in sorted(results.items()):
        us = statistics.median(r["cpu"] / r["n"] * 1e6 for r in rows)
        rate = statistics.median(r["n"] / r["wall"] for r in rows)
        other = max(r["other_cores"] for r in rows)
        summary[(kind, seeded)] = us
        print(f"{kind:<9} {'yes' if seeded else 'no':<5} {rate:>8.0f} {us:>11.1f} {other:>12.2f} {len(rows)}")
    for kind in ("fast", "default"):
        if (kind, True) in summary and (kind, False) in summary:
            ratio = summary[(kind, True)] / summary[(kind, False)]
            print(f"{kind}: seeded / unseeded CPU per sample = {ratio:.3f} ({(ratio - 1) * 100:+.1f} %)")
    print(f"runs dropped for contention: {dropped}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

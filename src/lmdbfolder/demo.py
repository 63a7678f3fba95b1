"""``lmdbfolder demo``: the whole job on a built-in dataset, end to end.

Generates an ImageNet-like folder of real JPEGs, packs it, verifies it,
checks that ``LMDBFolder`` returns exactly what ``ImageFolder`` returns, and
times both (raw reads and the training pipeline through a DataLoader).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Sequence

from lmdbfolder.bench import Measurement, ratio, time_loader, time_raw_files, time_raw_pack, train_transform
from lmdbfolder.synthetic import SyntheticSpec, make_imagefolder
from lmdbfolder.verify import verify
from lmdbfolder.writer import pack

__all__ = ["run_demo", "format_table"]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Plain-text table with right-aligned numeric columns."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _say(as_json: bool, text: str) -> None:
    print(text, file=sys.stderr if as_json else sys.stdout, flush=True)


def run_demo(workdir: str, *, classes: int, per_class: int, workers: Sequence[int], as_json: bool = False) -> int:
    """Run the demo in ``workdir``; print a table (or JSON); return an exit code."""
    src = os.path.join(workdir, "images")
    dst = os.path.join(workdir, "images.lmdb")
    bars = None if not as_json else False  # bars on a terminal only
    n = make_imagefolder(src, SyntheticSpec(classes=classes, per_class=per_class), progress=bars)
    _say(as_json, f"1. generated {n:,} JPEGs ({classes} classes) in {src}")

    result = pack(src, dst, overwrite=True, progress=bars)
    _say(
        as_json,
        f"2. packed them into {dst}: {result.input_bytes / 1e6:,.1f} MB in {result.seconds:.2f} s "
        f"({result.images_per_second:,.0f} img/s, {result.mb_per_second:,.0f} MB/s)",
    )

    report = verify(dst, decode=True, progress=False)
    _say(as_json, f"3. verified {report.checked:,} records (checksums and decoding): {'OK' if report.ok else 'FAILED'}")
    if not report.ok:
        for problem in report.problems:
            print(problem, file=sys.stderr)
        return 1

    try:
        from torchvision.datasets import ImageFolder

        from lmdbfolder.torch import LMDBFolder
    except ImportError:
        _say(as_json, "torch/torchvision are not installed: `pip install lmdbfolder[torch]` for the DataLoader part")
        return 0

    files_ds = ImageFolder(src)
    packed_ds = LMDBFolder(dst)
    same = _same_as_imagefolder(files_ds, packed_ds, limit=50)
    _say(
        as_json,
        f"4. LMDBFolder == ImageFolder (classes, targets, pixels of {min(50, n)} samples): {'yes' if same else 'NO'}",
    )
    if not same:
        return 1

    rows: list[Measurement] = []
    paths = [path for path, _ in files_ds.samples]
    # Alternate the contestants and keep each one's better run: the first pass
    # also warms the page cache for both.
    best: dict[tuple[str, str, int], Measurement] = {}
    for _ in range(2):
        for m in (time_raw_files(paths), time_raw_pack(dst)):
            _keep_best(best, m)
    for w in workers:
        for m in (
            time_loader(ImageFolder(src, transform=train_transform()), contestant="files", workers=w),
            time_loader(LMDBFolder(dst, transform=train_transform()), contestant="lmdbfolder", workers=w),
        ):
            _keep_best(best, m)
    rows = list(best.values())
    table = []
    for workload, w in dict.fromkeys((m.workload, m.workers) for m in rows):
        files = best[("files", workload, w)]
        packed = best[("lmdbfolder", workload, w)]
        table.append(
            [
                workload,
                w,
                f"{files.images_per_second:,.0f}",
                f"{packed.images_per_second:,.0f}",
                f"{ratio(packed, files):.2f}x",
            ]
        )
    if as_json:
        json.dump(
            {
                "images": n,
                "pack_seconds": result.seconds,
                "verified": report.ok,
                "same_as_imagefolder": same,
                "measurements": [dict(m.__dict__, images_per_second=m.images_per_second) for m in rows],
            },
            sys.stdout,
            indent=2,
        )
        print()
    else:
        print("5. images/s, page cache warm (ImageFolder vs LMDBFolder, same transforms):\n")
        print(format_table(["workload", "workers", "ImageFolder", "LMDBFolder", "ratio"], table))
        print(
            "\nraw read = bytes only, random order; train pipeline = decode + RandomResizedCrop(224) + flip + "
            "to tensor through a DataLoader (batch 64).\nOn a small warm dataset decoding dominates, so the "
            "pipeline numbers are close; packing pays off on cold caches, slow or network disks and "
            "million-image datasets."
        )
    return 0


def _keep_best(best: dict[tuple[str, str, int], Measurement], m: Measurement) -> None:
    key = (m.contestant, m.workload, m.workers)
    if key not in best or m.images_per_second > best[key].images_per_second:
        best[key] = m


def _same_as_imagefolder(files_ds: Any, packed_ds: Any, *, limit: int) -> bool:
    if files_ds.classes != packed_ds.classes or files_ds.class_to_idx != packed_ds.class_to_idx:
        return False
    if list(files_ds.targets) != list(packed_ds.targets) or len(files_ds) != len(packed_ds):
        return False
    step = max(1, len(files_ds) // limit)
    for i in range(0, len(files_ds), step):
        a, ta = files_ds[i]
        b, tb = packed_ds[i]
        if ta != tb or a.size != b.size or a.tobytes() != b.tobytes():
            return False
    return True

"""``lmdbfolder demo``: the whole job on a built-in dataset, end to end.

Generates an ImageNet-like folder of real JPEGs, packs it, verifies it,
checks that ``LMDBFolder`` returns exactly what ``ImageFolder`` returns, and
runs ``lmdbfolder bench`` on it (raw reads and the training pipeline, cold
and warm, LMDBFolder with its defaults and with the fused crop, a
``--max-size 256`` copy).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Sequence

from lmdbfolder.bench.synthetic import SyntheticSpec, make_imagefolder
from lmdbfolder.errors import install_hint
from lmdbfolder.tools.verify import verify
from lmdbfolder.write.writer import pack

__all__ = ["run_demo", "imagefolder_differences", "leave_out_skipped"]


def _say(as_json: bool, text: str) -> None:
    print(text, file=sys.stderr if as_json else sys.stdout, flush=True)


def run_demo(
    workdir: str,
    *,
    classes: int,
    per_class: int,
    workers: Sequence[int],
    as_json: bool = False,
    max_size: bool = True,
) -> int:
    """Run the demo in ``workdir``; print the ``lmdbfolder bench`` table (or JSON); return an exit code.

    ``max_size`` also measures a copy packed with ``--max-size 256``.
    """
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
    report = _verify_step(dst, as_json)
    if not report.ok:
        return 1
    same = _compare_step(src, dst, n, as_json)
    if same is None:
        return 0  # no torch: the DataLoader part is left out
    if not same:
        return 1
    bench = _bench_step(src, dst, workdir, workers, max_size, as_json)
    if as_json:
        summary = {
            "images": n,
            "pack_seconds": result.seconds,
            "verified": report.ok,
            "same_as_imagefolder": same,
            "bench": bench.as_dict(),
        }
        json.dump(summary, sys.stdout, indent=2)
        print()
    else:
        _print_report(bench)
    return 0


def _verify_step(dst: str, as_json: bool) -> Any:
    """Step 3: verify the pack, decoding every image; its problems go to stderr."""
    report = verify(dst, decode=True, progress=False)
    _say(as_json, f"3. verified {report.checked:,} records (checksums and decoding): {'OK' if report.ok else 'FAILED'}")
    if not report.ok:
        for problem in report.problems:
            print(problem, file=sys.stderr)
    return report


def _compare_step(src: str, dst: str, n: int, as_json: bool) -> bool | None:
    """Step 4: whether LMDBFolder gives ImageFolder's classes, targets and pixels; None
    when torch or torchvision is not installed (said, with what to install)."""
    try:
        from torchvision.datasets import ImageFolder

        from lmdbfolder.torch import LMDBFolder
    except ImportError:
        _say(as_json, f"torch/torchvision are not installed: the DataLoader part is left out; {install_hint('torch')}")
        return None

    files_ds = ImageFolder(src)
    packed_ds = LMDBFolder(dst)
    same = not imagefolder_differences(files_ds, packed_ds, limit=50)
    packed_ds.reader.close()  # an open map keeps its pages cached: the bench's cold runs need it closed
    _say(
        as_json,
        f"4. LMDBFolder == ImageFolder (classes, targets, pixels of {min(50, n)} samples): {'yes' if same else 'NO'}",
    )
    return same


def _bench_step(src: str, dst: str, workdir: str, workers: Sequence[int], max_size: bool, as_json: bool) -> Any:
    """Step 5: ``lmdbfolder bench`` of the files against the pack, each measurement said as it is made."""
    from lmdbfolder.bench.run import BenchConfig, run_bench

    _say(
        as_json,
        "5. benchmarking plain files against the pack (lmdbfolder bench; each measurement is printed as it is made)",
    )
    return run_bench(
        BenchConfig(
            src=src,
            packed=dst,
            workers=workers,
            limit=0,
            repeat=1,
            max_size=256 if max_size else None,
            workdir=os.path.join(workdir, "bench"),
            progress=False,
            say=lambda text: _say(as_json, text),
        )
    )


def _print_report(bench: Any) -> None:
    """The bench table, and what its rows mean."""
    from lmdbfolder.bench.run import format_report

    print()
    print(format_report(bench))
    print(
        "\nraw read = bytes only, random order; train pipeline = decode + RandomResizedCrop(224) + flip + "
        "to tensor through a DataLoader.\nOn a small warm dataset decoding dominates; packing pays off on "
        "cold caches, slow or network disks, million-image datasets, and with the fast settings.\n"
        "Run `lmdbfolder bench YOUR_TREE` for your own data (--json, chart)."
    )


def leave_out_skipped(files_ds: Any, packed_ds: Any) -> int:
    """Drop from the ImageFolder ``files_ds`` the samples that are not in the pack
    (files ``pack`` skipped: truncated, not images, ...), so that the two can be
    compared sample by sample; returns how many were dropped."""
    packed = set(packed_ds.filenames())
    keep = [(p, t) for p, t in files_ds.samples if os.path.relpath(p, files_ds.root) in packed]
    dropped = len(files_ds.samples) - len(keep)
    if dropped:
        files_ds.samples = files_ds.imgs = keep
        files_ds.targets = [t for _, t in keep]
    return dropped


def imagefolder_differences(files_ds: Any, packed_ds: Any, *, limit: int | None = None) -> list[str]:
    """What differs between torchvision's ImageFolder and an LMDBFolder of the same tree.

    Compares classes, class_to_idx, targets, sample paths and, for every
    sample (or ``limit`` evenly spaced ones), the target and the image's
    mode, size and pixels. An empty list means identical.
    """
    problems = []
    if files_ds.classes != packed_ds.classes or files_ds.class_to_idx != packed_ds.class_to_idx:
        problems.append("classes differ")
    if list(files_ds.targets) != list(packed_ds.targets) or len(files_ds) != len(packed_ds):
        problems.append("targets differ")
    elif packed_ds.filenames() != [os.path.relpath(p, files_ds.root) for p, _ in files_ds.samples]:
        problems.append("sample paths differ")
    if problems:
        return problems
    step = 1 if limit is None else max(1, len(files_ds) // limit)
    for i in range(0, len(files_ds), step):
        a, ta = files_ds[i]
        b, tb = packed_ds[i]
        if ta != tb or a.mode != b.mode or a.size != b.size or a.tobytes() != b.tobytes():
            problems.append(f"sample {i} ({files_ds.samples[i][0]}) differs")
    return problems

"""Pack throughput against the floor of reading the same files with `cat`.

Usage:
    python benchmarks/bench_pack.py [--tree DIR] [--classes 100 --per-class 100] [--repeat 3] [--compare]

Without --tree, an ImageNet-like synthetic tree (about 90 KB JPEGs, mostly
500x375) is generated once under benchmarks/results/. The page cache is
warmed first, then `find | xargs cat > /dev/null` and `lmdbfolder pack` are
run alternately; the medians and their ratio are printed (ratios measured in
one run are what to compare across machines).

--compare also packs, in the same alternation, with 64 MB batches and with
reader threads instead of processes (the writer's earlier designs), so the
effect of each is measured in one run. Every pack is preceded by a `cat`, so
each starts from the same state of the page cache.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import lmdbfolder.write.loop as loop
from lmdbfolder.bench.synthetic import SyntheticSpec, make_imagefolder
from lmdbfolder.tools.verify import verify
from lmdbfolder.write.writer import PackResult, pack

HERE = os.path.dirname(os.path.abspath(__file__))


def cat_all(tree: str) -> float:
    start = time.perf_counter()
    subprocess.run(f"find {tree!r} -type f -print0 | xargs -0 cat > /dev/null", shell=True, check=True)
    return time.perf_counter() - start


def _variants(compare: bool) -> dict[str, dict[str, Any]]:
    variants: dict[str, dict[str, Any]] = {"lmdbfolder pack": {}}
    if compare:
        variants["  with 64 MB batches"] = {"commit_bytes": 64 << 20}
        variants["  with reader threads"] = {"threads": True}
    return variants


def _pack_once(tree: str, dst: str, options: dict[str, Any]) -> PackResult:
    options = dict(options)
    threads = options.pop("threads", False)
    available = loop.processes_available
    if threads:  # what pack does where fork is unavailable
        loop.processes_available = lambda: False  # type: ignore[assignment]
    try:
        return pack(tree, dst, progress=False, **options)
    finally:
        loop.processes_available = available  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", help="ImageFolder tree to pack (default: generate a synthetic one)")
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--per-class", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--compare", action="store_true", help="also pack with 64 MB batches and with threads")
    parser.add_argument("--out", help="where to write packs (default: a temporary folder next to the tree)")
    args = parser.parse_args(argv)

    tree = args.tree
    if tree is None:
        tree = os.path.join(HERE, "results", f"tree-{args.classes}x{args.per_class}")
        make_imagefolder(tree, SyntheticSpec(classes=args.classes, per_class=args.per_class))
    workdir = tempfile.mkdtemp(dir=args.out or os.path.dirname(os.path.abspath(tree)))
    variants = _variants(args.compare)
    try:
        cat_all(tree)  # warm the page cache
        cats: list[float] = []
        times: dict[str, list[float]] = {name: [] for name in variants}
        result = report = None
        dst = os.path.join(workdir, "pack")
        for _ in range(args.repeat):
            for name, options in variants.items():
                # The same start for every pack: the previous pack deleted, then a cat.
                cats.append(cat_all(tree))
                result = _pack_once(tree, dst, options)
                times[name].append(result.seconds)
                if report is None:
                    report = verify(result.path, progress=False)
                shutil.rmtree(dst)
        if result is None or report is None:
            raise SystemExit("--repeat must be at least 1")
        mb = result.input_bytes / 1e6
        cat_s = statistics.median(cats)
        print(f"tree: {tree} ({result.count:,} files, {mb:,.0f} MB), page cache warm, median of {args.repeat}")
        rows = [("cat (find | xargs cat > /dev/null)", cat_s)]
        rows += [(name, statistics.median(t)) for name, t in times.items()]
        for name, secs in rows:
            ratio = "" if name.startswith("cat") else f"  {cat_s / secs:5.2f}x cat"
            print(f"{name + ':':<36}{secs:6.2f} s  {result.count / secs:8,.0f} files/s  {mb / secs:6,.0f} MB/s{ratio}")
        print(f"pack throughput / cat throughput:   {cat_s / statistics.median(times['lmdbfolder pack']):.2f}")
        print(f"verify: {'OK' if report.ok else 'FAILED'} ({report.checked:,} records)")
        print(f"all runs (s): cat {[round(x, 2) for x in cats]}")
        for name, t in times.items():
            print(f"  {name.strip()}: {[round(x, 2) for x in t]}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

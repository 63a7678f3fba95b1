"""Parallel reading pipeline against a single-threaded pack, page cache cold and warm.

Usage:
    python benchmarks/bench_pipeline.py --tree DIR [--repeat 2] [--workers 1 8]

For each cache state and worker count (alternating, in one run), the tree is
packed with `lmdbfolder.pack(..., workers=N)`. "Cold" evicts the source files
from the page cache first (os.sync, then posix_fadvise(DONTNEED) on every
file; this needs no root, and the script says so if the kernel refuses).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

from lmdbfolder.tools.cache import evict
from lmdbfolder.write.sources import scan
from lmdbfolder.write.writer import pack


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", required=True)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args(argv)
    sources = scan(args.tree)
    paths = [sources.abspath(i) for i in range(len(sources))]
    workdir = tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(args.tree)))
    times: dict[tuple[str, int], list[float]] = {}
    mb = 0.0
    try:
        for _ in range(args.repeat):
            for cache in ("cold", "warm"):
                for workers in args.workers:
                    if cache == "cold":
                        report = evict(paths)
                        if not report.supported or report.failed:
                            print(f"note: {report.describe()}")
                    elif cache == "warm":
                        for p in paths:
                            with open(p, "rb") as f:
                                f.read()
                    dst = os.path.join(workdir, "p")
                    start = time.perf_counter()
                    result = pack(args.tree, dst, workers=workers, progress=False)
                    times.setdefault((cache, workers), []).append(time.perf_counter() - start)
                    mb = result.input_bytes / 1e6
                    shutil.rmtree(dst)
        print(f"{len(paths):,} files, {mb:,.0f} MB; median of {args.repeat} runs per cell, alternating")
        print(f"{'cache':<6}{'workers':>8}{'seconds':>10}{'img/s':>9}{'MB/s':>8}{'vs 1 worker':>13}")
        for cache in ("cold", "warm"):
            base = statistics.median(times[(cache, args.workers[0])])
            for workers in args.workers:
                t = statistics.median(times[(cache, workers)])
                print(f"{cache:<6}{workers:>8}{t:>10.2f}{len(paths) / t:>9,.0f}{mb / t:>8,.0f}{base / t:>12.2f}x")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Pack throughput against the floor of reading the same files with `cat`.

Usage:
    python benchmarks/bench_pack.py [--tree DIR] [--classes 100 --per-class 100] [--repeat 3]

Without --tree, an ImageNet-like synthetic tree (about 90 KB JPEGs, mostly
500x375) is generated once under benchmarks/results/. The page cache is
warmed first, then `find | xargs cat > /dev/null` and `lmdbfolder pack` are
run alternately; the medians and their ratio are printed (ratios measured in
one run are what to compare across machines).
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

from lmdbfolder.synthetic import SyntheticSpec, make_imagefolder
from lmdbfolder.verify import verify
from lmdbfolder.writer import pack

HERE = os.path.dirname(os.path.abspath(__file__))


def cat_all(tree: str) -> float:
    start = time.perf_counter()
    subprocess.run(f"find {tree!r} -type f -print0 | xargs -0 cat > /dev/null", shell=True, check=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", help="ImageFolder tree to pack (default: generate a synthetic one)")
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--per-class", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", help="where to write packs (default: a temporary folder next to the tree)")
    args = parser.parse_args(argv)

    tree = args.tree
    if tree is None:
        tree = os.path.join(HERE, "results", f"tree-{args.classes}x{args.per_class}")
        make_imagefolder(tree, SyntheticSpec(classes=args.classes, per_class=args.per_class))
    workdir = tempfile.mkdtemp(dir=args.out or os.path.dirname(os.path.abspath(tree)))
    try:
        cat_all(tree)  # warm the page cache
        cats, packs = [], []
        result = None
        for k in range(args.repeat):
            cats.append(cat_all(tree))
            dst = os.path.join(workdir, f"pack{k}")
            result = pack(tree, dst, progress=False)
            packs.append(result.seconds)
            if k < args.repeat - 1:
                shutil.rmtree(dst)
        assert result is not None
        report = verify(result.path, progress=False)
        mb = result.input_bytes / 1e6
        cat_s, pack_s = statistics.median(cats), statistics.median(packs)
        print(f"tree: {tree} ({result.count:,} files, {mb:,.0f} MB), page cache warm, median of {args.repeat}")
        for name, secs in (("cat (find | xargs cat > /dev/null)", cat_s), ("lmdbfolder pack", pack_s)):
            print(f"{name + ':':<36}{secs:6.2f} s  {result.count / secs:8,.0f} files/s  {mb / secs:6,.0f} MB/s")
        print(f"pack throughput / cat throughput:   {cat_s / pack_s:.2f}")
        print(f"verify: {'OK' if report.ok else 'FAILED'} ({report.checked:,} records)")
        print(f"all runs (s): cat {[round(x, 2) for x in cats]}  pack {[round(x, 2) for x in packs]}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

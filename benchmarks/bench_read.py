"""`lmdbfolder bench` with the developers' settings; JSON, table and chart kept.

Usage:
    python benchmarks/bench_read.py TREE [PACKED] [--workers 0 1 2] [--limit 3000] [--repeat 3] [--max-size 256]

Runs the same code as the command (``lmdbfolder.bench.run``) and writes
``benchmarks/results/bench-<time>.{json,txt,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from lmdbfolder.bench.chart import chart_available, write_chart
from lmdbfolder.bench.run import BenchConfig, format_report, run_bench

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tree")
    parser.add_argument("packed", nargs="?")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--limit", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-size", type=int, default=256)
    args = parser.parse_args(argv)
    result = run_bench(
        BenchConfig(
            src=args.tree,
            packed=args.packed,
            workers=args.workers,
            limit=args.limit,
            repeat=args.repeat,
            max_size=args.max_size or None,
        )
    )
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    stem = os.path.join(HERE, "results", time.strftime("bench-%Y%m%d-%H%M%S"))
    report = format_report(result)
    print(report)
    with open(stem + ".txt", "w") as f:
        f.write(report + "\n")
    with open(stem + ".json", "w") as f:
        json.dump(result.as_dict(), f, indent=2)
    if chart_available():
        write_chart(result, stem + ".png")
    print(f"saved {stem}.{{txt,json{',png' if chart_available() else ''}}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

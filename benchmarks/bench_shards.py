"""A sharded pack on a local Ray cluster against a single-process pack of the same tree.

Usage:
    python benchmarks/bench_shards.py --tree DIR [--shards 4] [--cpus 2] [--repeat 2] [--out DIR]

The page cache is warmed first (`cat` of every file), a local Ray cluster is
started once (``ray.init(num_cpus=CPUS)``, timed separately: on a real
cluster it is already running), then these two are run alternately:

    single: lmdbfolder.pack(TREE, OUT/single)                  # lmdbfolder pack TREE OUT/single
    ray:    lmdbfolder.write.ray.pack_ray(TREE, OUT/ray, shards=N)   # lmdbfolder pack TREE OUT/ray --shards N --ray

and the medians and their ratio are printed. Finally the two packs are
compared sample for sample (payload bytes, label, encoding, original path). OUT is a new folder made
inside ``--out`` (default: the system's temporary folder), removed at the end
unless ``--keep``.
Ratios measured in one run are what to compare across machines.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workdir import scratch  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", required=True, help="ImageFolder tree to pack")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="CPUs of the local Ray cluster")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument(
        "--out", default=None, help="where the scratch folder (the two packs) is made; default: the system's temp"
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (its path is printed)")
    args = parser.parse_args(argv)
    with scratch(args.out, "bench-shards-", keep=args.keep) as out:
        return run(args, out)


def run(args: argparse.Namespace, out: str) -> int:
    """The whole benchmark in ``out``, a new folder of its own."""
    import ray

    from lmdbfolder import open_pack, pack
    from lmdbfolder.write.ray import pack_ray

    try:
        subprocess.run(f"find {args.tree!r} -type f -print0 | xargs -0 cat > /dev/null", shell=True, check=True)
        start = time.perf_counter()
        ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
        print(f"ray.init(num_cpus={args.cpus}): {time.perf_counter() - start:.1f} s (once; not in the times below)")
        times: dict[str, list[float]] = {"single": [], "ray": []}
        for r in range(args.repeat):
            for name in ("single", "ray"):
                dst = os.path.join(out, name)
                shutil.rmtree(dst, ignore_errors=True)
                start = time.perf_counter()
                if name == "single":
                    result = pack(args.tree, dst, progress=False)
                    count = result.count
                else:
                    sharded = pack_ray(args.tree, dst, shards=args.shards, progress=False)
                    count = sharded.count
                seconds = time.perf_counter() - start
                times[name].append(seconds)
                print(f"run {r + 1} {name:>6}: {count:,} images in {seconds:.2f} s ({count / seconds:,.0f} img/s)")
        single, sharded_s = statistics.median(times["single"]), statistics.median(times["ray"])
        print(
            f"median: single-process {single:.2f} s, Ray {args.shards} shards on {args.cpus} CPUs {sharded_s:.2f} s; "
            f"Ray / single = {sharded_s / single:.2f}x the time ({single / sharded_s:.2f}x the speed)"
        )
        with open_pack(os.path.join(out, "single")) as a, open_pack(os.path.join(out, "ray")) as b:
            same = len(a) == len(b) and a.paths() == b.paths() and list(a.labels) == list(b.labels)
            differing = 0
            for i in range(len(a)):
                ra, rb = a.get(i), b.get(i)
                if bytes(ra.payload) != bytes(rb.payload) or (ra.label, ra.encoding) != (rb.label, rb.encoding):
                    differing += 1
            print(
                f"equal sample for sample: {same and differing == 0} "
                f"({len(a):,} vs {len(b):,} samples, {differing} differing records, "
                f"shards {b.shard_offsets[1:]})"  # type: ignore[attr-defined]
            )
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

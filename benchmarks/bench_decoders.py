"""Single-core decode rate of every installed JPEG decoder, full size and DCT-scaled.

Usage:
    python benchmarks/bench_decoders.py [--tree DIR] [--samples 300] [--repeat 3]

Decoders are timed alternately on the same in-memory JPEGs (one thread;
``lmdbfolder.read.decoders`` does the decoding, as LMDBFolder does), best of
``--repeat``; ratios to Pillow are what to compare across machines.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time

import torch

from lmdbfolder.bench.synthetic import SyntheticSpec, make_imagefolder
from lmdbfolder.encodings import sniff
from lmdbfolder.read.capabilities import available_decoders, get_decoder
from lmdbfolder.read.decoders import decode_payload

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", help="folder of JPEGs (default: a generated ImageNet-like tree)")
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    tree = args.tree
    if tree is None:
        tree = os.path.join(HERE, "results", "tree-10x30")
        make_imagefolder(tree, SyntheticSpec(classes=10, per_class=30))
    paths = sorted(glob.glob(os.path.join(tree, "**", "*.jp*g"), recursive=True))
    paths = paths[:: max(1, len(paths) // args.samples)][: args.samples]
    blobs = []
    for p in paths:
        with open(p, "rb") as f:
            data = f.read()
        blobs.append((data, sniff(data)))
    names = [n for n, why in available_decoders().items() if why is None]
    best: dict[tuple[str, int], float] = {}
    for _ in range(args.repeat):
        for name in names:
            dec = get_decoder(name)
            for denom in (1, 2):
                if denom not in dec.scales:
                    continue
                start = time.perf_counter()
                for data, info in blobs:
                    decode_payload(data, "jpeg", info.width, info.height, info.channels, dec, denom=denom)
                rate = len(blobs) / (time.perf_counter() - start)
                best[(name, denom)] = max(best.get((name, denom), 0.0), rate)
    base = best[("pillow", 1)]
    mean_kb = sum(len(d) for d, _ in blobs) / len(blobs) / 1e3
    print(f"{len(blobs)} JPEGs from {tree} (mean {mean_kb:.0f} KB), one thread, best of {args.repeat}")
    for (name, denom), rate in sorted(best.items(), key=lambda kv: -kv[1]):
        print(f"{name:12s} scale 1/{denom}: {rate:7,.0f} img/s  {rate / base:5.2f}x pillow")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Per-record cost of ``Reader.get`` (lookup + header, with and without the CRC), and
what the CRC costs next to decoding the image.

Usage:
    python benchmarks/bench_read_cost.py [--work DIR] [--small 10000] [--large 2000] [--repeat 3]

Builds (once, under ``--work``) two packs of photo-like JPEGs: ``small``
(~4 KB records, stored in leaf pages or one overflow page) and ``large``
(~100 KB records, several overflow pages). For each, every record is read
once to warm the page cache, then all records are read in one random order,
best of ``--repeat`` rounds, in microseconds per record:

* ``get``: ``Reader(verify_checksums=False).get(i)``;
* ``get + crc``: ``Reader(verify_checksums=True).get(i)``.

Then the CRC-32 of a ~100 KB record alone (zlib-ng when installed, and the
standard zlib) against one Pillow decode of it (``Image.open().convert("RGB")``,
what LMDBFolder does by default): the share of the default per-sample time
that checking costs. Works on any lmdbfolder version (it uses only the
public Reader API). A timing benchmark: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import sys
import time
import zlib
from typing import Callable

import numpy as np
from PIL import Image

from lmdbfolder import Reader, pack


def _photo(rng: np.random.Generator, w: int, h: int) -> Image.Image:
    # Smooth gradients plus noise: JPEG sizes like a photograph's.
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([(x * 255 // max(w, 1)), (y * 255 // max(h, 1)), ((x + y) * 127 // max(w + h, 1))], axis=2)
    noise = rng.normal(0, 18, (h, w, 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))


def build(work: str, name: str, n: int, size: tuple[int, int], quality: int) -> str:
    """A pack of ``n`` JPEGs of ``size`` under ``work`` (reused if it exists)."""
    dst = os.path.join(work, f"{name}.lmdb")
    if os.path.isdir(dst):
        return dst
    src = os.path.join(work, f"src-{name}")
    rng = np.random.default_rng(0)
    tiles = [_photo(rng, *size) for _ in range(8)]
    for i in range(n):
        path = os.path.join(src, f"c{i % 10}", f"{i:06d}.jpg")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tiles[i % 8].rotate(i % 4 * 90, expand=True).save(path, "JPEG", quality=quality - i % 7)
    pack(src, dst, progress=False)
    return dst


def _best(fn: Callable[[int], object], order: list[int], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for i in order:
            fn(i)
        best = min(best, time.perf_counter() - start)
    return best / len(order) * 1e6


def bench_pack(path: str, repeat: int) -> dict[str, float]:
    """Microseconds per record of ``get`` and ``get + crc`` on the pack at ``path``."""
    plain = Reader(path, verify_checksums=False)
    checked = Reader(path, verify_checksums=True)
    order = list(range(len(plain)))
    mean = sum(len(plain.get(i).payload) for i in order) / len(order)  # also warms the page cache
    random.Random(0).shuffle(order)
    out = {"records": len(order), "mean_bytes": round(mean)}
    out["get"] = _best(plain.get, order, repeat)
    out["get + crc"] = _best(checked.get, order, repeat)
    plain.close()
    checked.close()
    return out


def crc_vs_decode(path: str, repeat: int) -> dict[str, float]:
    """Microseconds of one CRC-32 (zlib-ng, zlib) and one Pillow decode of a ~100 KB record."""
    with Reader(path) as r:
        payloads = [bytes(r.get(i).payload) for i in range(min(50, len(r)))]
    out: dict[str, float] = {"bytes": round(sum(map(len, payloads)) / len(payloads))}
    crcs: dict[str, Callable[[bytes], int]] = {"zlib": zlib.crc32}
    try:
        from zlib_ng import zlib_ng

        crcs["zlib-ng"] = zlib_ng.crc32
    except ImportError:
        pass
    idx = list(range(len(payloads)))
    for name, fn in crcs.items():
        out[f"crc32 {name}"] = _best(lambda i, fn=fn: fn(payloads[i]), idx * 20, repeat)
    out["pillow decode"] = _best(lambda i: Image.open(io.BytesIO(payloads[i])).convert("RGB"), idx, repeat)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cost"))
    parser.add_argument("--small", type=int, default=10000, help="records of the ~4 KB pack")
    parser.add_argument("--large", type=int, default=2000, help="records of the ~100 KB pack")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    small = build(args.work, f"small{args.small}", args.small, (96, 72), 90)
    large = build(args.work, f"large{args.large}", args.large, (500, 375), 95)
    print(f"lmdbfolder read cost, {sys.version.split()[0]}, best of {args.repeat}, microseconds per record")
    for name, path in (("small", small), ("large", large)):
        row = bench_pack(path, args.repeat)
        print(
            f"  {name:<5} {row['records']:>6} records of {row['mean_bytes']:>7,} B:  "
            f"get {row['get']:6.2f}   get + crc {row['get + crc']:6.2f}"
        )
    row = crc_vs_decode(large, args.repeat)
    decode = row["pillow decode"]
    print(f"  one {row['bytes']:,}-byte JPEG: Pillow decode {decode:,.0f} us")
    for key, value in row.items():
        if key.startswith("crc32"):
            print(f"    {key:<14} {value:7.2f} us = {100 * value / decode:.2f} % of the decode")
    return 0


if __name__ == "__main__":
    sys.exit(main())

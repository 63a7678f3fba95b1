"""The map-size model (``lmdbfolder.write.sizing``) against real packs.

Usage:
    python benchmarks/check_map_model.py [--synthetic N] [--tree DIR ...] [--store encoded|raw]
        [--max-size PX] [--work DIR]

For each tree (``--tree``, packed as given) and, with ``--synthetic N``, for
generated trees of N random-byte files of chosen sizes (tiny, just under and
just over the overflow threshold, 2-6 KB, just over a page, 10-40 KB, ~100
KB; packed with ``--check none``), it packs, then prints the estimate (and
its margin) next to what LMDB used: ``(last_pgno + 1) * psize``, and
``env.stat()``'s leaf, branch and overflow pages, whether the map grew, and
the old mean-based map (``1.5 x mean x N + 64 MB``, raw: 8x) for comparison.
The synthetic trees and the packs go to a new folder made inside ``--work``
(default: the system's temporary folder), removed at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Any

import lmdb
import numpy as np

from lmdbfolder.format import RECORD_HEADER
from lmdbfolder.write import loop as loop_mod
from lmdbfolder.write import sizing
from lmdbfolder.write import writer as writer_mod
from lmdbfolder.write.options import PackOptions, Resize
from lmdbfolder.write.sources import scan

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workdir import scratch  # noqa: E402

PSIZE = sizing.page_size()
OVERFLOW_AT = sizing.node_max(PSIZE) - 16 + 1 - RECORD_HEADER.size
OVER_A_PAGE = PSIZE - sizing.PAGE_HEADER + 1 - RECORD_HEADER.size


def synthetic(root: str, n: int) -> dict[str, str]:
    """Trees of random bytes with the sizes that matter for pages; returns name -> path."""
    rng = np.random.default_rng(0)
    kinds = {
        "tiny 10-900 B": rng.integers(10, 900, n),
        f"inline {OVERFLOW_AT - 1} B": np.full(n, OVERFLOW_AT - 1),
        f"overflow {OVERFLOW_AT} B": np.full(n, OVERFLOW_AT),
        "small 2-6 KB": rng.integers(2000, 6000, n),
        f"over a page {OVER_A_PAGE} B": np.full(n, OVER_A_PAGE),
        "medium 10-40 KB": rng.integers(10_000, 40_000, n),
        "large ~100 KB": np.clip(rng.normal(110_000, 40_000, max(1, n // 4)), 5000, None).astype(int),
    }
    out = {}
    for name, sizes in kinds.items():
        tree = os.path.join(root, "".join(c if c.isalnum() else "_" for c in name))
        if not os.path.isdir(tree):
            for i, size in enumerate(sizes):
                d = os.path.join(tree, f"c{i % 10}")
                os.makedirs(d, exist_ok=True)
                with open(os.path.join(d, f"f{i:07d}.jpg"), "wb") as f:
                    f.write(rng.bytes(int(size)))
        out[name] = tree
    return out


def measure(name: str, tree: str, dst: str, options: PackOptions) -> dict[str, Any]:
    grown: list[int] = []
    original = loop_mod._Partial.grow

    def grow(self: Any, map_size: int) -> None:
        grown.append(map_size)
        original(self, map_size)

    sources = scan(tree)
    records = sizing.sample_records(sources, options)
    est = sizing.estimate_pack(records, len(sources), PSIZE, tables=sizing.tables_bytes(sources))
    mean = sources.mean_file_size()
    old_map = int(mean * len(sources) * (8 if options.store == "raw" else 1) * 1.5) + (64 << 20)
    loop_mod._Partial.grow = grow  # type: ignore[method-assign]
    try:
        result = writer_mod.pack_sources(sources, dst, options.replace(overwrite=True, progress=False))
    finally:
        loop_mod._Partial.grow = original  # type: ignore[method-assign]
    env = lmdb.open(dst, readonly=True, lock=False)
    st, info = env.stat(), env.info()
    env.close()
    real = (info["last_pgno"] + 1) * st["psize"]
    shutil.rmtree(dst, ignore_errors=True)
    return {
        "name": name,
        "n": len(sources),
        "file_mb": mean * len(sources) / 1e6,
        "real_mb": real / 1e6,
        "est_mb": est.expected / 1e6,
        "margin_pct": 100 * est.margin / est.expected,
        "err_pct": 100 * (est.expected / real - 1),
        "leaf": st["leaf_pages"],
        "branch": st["branch_pages"],
        "overflow": st["overflow_pages"],
        "grew": len(grown),
        "compacted": result.compacted,
        "old_map_mb": old_map / 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--synthetic", type=int, default=0, help="files per synthetic tree (0: none)")
    parser.add_argument("--tree", action="append", default=[])
    parser.add_argument("--store", default="encoded", choices=["encoded", "raw"])
    parser.add_argument("--max-size", type=int, default=None, help="pack-time resize (longer side)")
    parser.add_argument(
        "--work", default=None, help="where the scratch folder (synthetic trees, packs) is made; default: system temp"
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (its path is printed)")
    args = parser.parse_args(argv)
    with scratch(args.work, "map-model-", keep=args.keep) as work:
        return run(args, work)


def run(args: argparse.Namespace, work: str) -> int:
    """Every tree asked for, packed in ``work``, a new folder of its own."""
    resize = Resize(args.max_size) if args.max_size else None
    jobs = [(name, tree, PackOptions(check="none")) for name, tree in synthetic(work, args.synthetic).items()]
    if not args.synthetic:
        jobs = []
    what = f"store={args.store}" + (f" max_size={args.max_size}" if resize else "")
    jobs += [
        (f"{os.path.basename(t.rstrip('/'))} {what}", t, PackOptions(store=args.store, resize=resize))
        for t in args.tree
    ]
    print(
        f"{'tree':34s} {'files':>9s} {'file MB':>9s} {'real MB':>9s} {'est MB':>9s} {'err':>7s} {'margin':>7s} "
        f"{'leaf':>6s} {'branch':>6s} {'overflow':>9s} {'grew':>4s} {'old map MB':>10s}"
    )
    for name, tree, opts in jobs:
        m = measure(name, tree, os.path.join(work, "pack.lmdb"), opts)
        print(
            f"{m['name']:34s} {m['n']:9,d} {m['file_mb']:9.1f} {m['real_mb']:9.1f} {m['est_mb']:9.1f} "
            f"{m['err_pct']:+6.2f}% {m['margin_pct']:6.2f}% {m['leaf']:6d} {m['branch']:6d} {m['overflow']:9d} "
            f"{m['grew']:4d} {m['old_map_mb']:10.1f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

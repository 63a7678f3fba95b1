"""Inject random corruptions into a copy of a pack and count how many `verify` detects.

Usage:
    python benchmarks/fault_report.py PACK [--records 200] [--seed 0]

Each chosen record gets one kind of damage: a flipped bit in the payload, a
flipped bit in the header, a truncated value, or a deleted record. The report
compares the indices verify names with the ones that were damaged.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile

import lmdb

from lmdbfolder.format import KEY, RECORD_HEADER
from lmdbfolder.read.reader import Reader
from lmdbfolder.tools.verify import verify

KINDS = ("payload bit", "header bit", "truncated", "deleted")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pack")
    parser.add_argument("--records", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp()
    try:
        copy = shutil.copytree(args.pack, f"{work}/pack")
        with Reader(copy) as r:
            count = len(r)
        victims = sorted(rng.sample(range(count), min(args.records, count)))
        injected: dict[int, str] = {}
        env = lmdb.open(copy, map_size=1 << 40)
        with env.begin(write=True) as txn:
            for i in victims:
                kind = rng.choice(KINDS)
                value = bytearray(txn.get(KEY.pack(i)))
                if kind == "payload bit":
                    pos = rng.randrange(RECORD_HEADER.size, len(value))
                    value[pos] ^= 1 << rng.randrange(8)
                elif kind == "header bit":
                    pos = rng.randrange(RECORD_HEADER.size)
                    value[pos] ^= 1 << rng.randrange(8)
                elif kind == "truncated":
                    del value[rng.randrange(1, len(value)) :]
                if kind == "deleted":
                    txn.delete(KEY.pack(i))
                else:
                    txn.put(KEY.pack(i), bytes(value))
                injected[i] = kind
        env.close()
        report = verify(copy, progress=False)
        found = set(report.bad_indices)
        by_kind = {k: [i for i, kk in injected.items() if kk == k] for k in KINDS}
        print(f"pack: {args.pack} ({count:,} records); damaged {len(injected)} records, seed {args.seed}")
        for kind, idx in by_kind.items():
            print(f"  {kind:<12} injected {len(idx):4d}  detected {len(set(idx) & found):4d}")
        print(f"detected {len(found & set(injected))} of {len(injected)}; false alarms {len(found - set(injected))}")
        return 0 if found == set(injected) else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

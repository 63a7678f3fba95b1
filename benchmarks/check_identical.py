"""Compare LMDBFolder with torchvision's ImageFolder on every sample of a tree.

Usage:
    python benchmarks/check_identical.py TREE PACK

Checks classes, class_to_idx, targets, the sample paths, and that every image
is pixel-identical (same mode, size and bytes). Exit code 1 on any difference.
Files that the pack skipped (truncated, not images: ImageFolder would fail on
them) are left out of the comparison, and counted.
"""

from __future__ import annotations

import sys
import time

from torchvision.datasets import ImageFolder

from lmdbfolder.bench.demo import imagefolder_differences, leave_out_skipped
from lmdbfolder.text import plural
from lmdbfolder.torch import LMDBFolder


def main(argv: list[str] | None = None) -> int:
    tree, packed = (argv if argv is not None else sys.argv[1:])[:2]
    start = time.perf_counter()
    theirs = ImageFolder(tree)
    ours = LMDBFolder(packed)
    left_out = leave_out_skipped(theirs, ours)
    problems = imagefolder_differences(theirs, ours)
    seconds = time.perf_counter() - start
    status = "identical" if not problems else f"{len(problems)} difference(s)"
    print(
        f"{len(theirs):,} samples, {len(theirs.classes)} classes compared pixel for pixel in {seconds:.0f} s: {status}"
        + (f" ({plural(left_out, 'source file')} that the pack skipped left out)" if left_out else "")
    )
    for p in problems[:20]:
        print("  " + p)
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())

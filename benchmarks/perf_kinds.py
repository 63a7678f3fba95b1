"""Where the CPU of a loader run goes, by kind of work, from a Linux ``perf`` profile.

Usage:
    perf record -F 1999 -D 7000 -o run.data -- \\
        python benchmarks/profile_batches.py PACK --mode fast --resize native --loader threads --batches 700
    python benchmarks/perf_kinds.py run.data [more.data ...]

cProfile sees one C call per batch with ``resize="native"`` and nothing of the
threads it starts; ``perf`` samples every thread and process of the run. ``-D
7000`` leaves out the first seconds (imports, the capability probes) and
``--batches 700`` makes the measured part long. Each sample is put in a kind by
the library (and, in lmdbfolder's compiled helper, the function) it was in:
the JPEG decode (libjpeg, and the region decoder around it), the resize with the
flip and the planes (the helper's native resize, or OpenCV's library, whose
symbols are stripped, so its resize, flip and split are one kind), Python, torch,
the checksum, libc (copies, allocation), the kernel. Prints each profile's
shares, largest first.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess

_SAMPLE = re.compile(r"\s+([\d.]+)%\s+(\S+)\s+\[([.k])\]\s+(.*)")
#: The compiled helper's functions that resize (the rest of it is the region decoder's).
_RESIZE = ("native_resize", "native_hpass", "native_vblend", "linear_taps", "resize_bilinear")


def kind(dso: str, symbol: str, kernel: bool) -> str:
    """The kind of work of a sample in ``symbol`` of the library ``dso``."""
    if kernel:
        return "kernel"
    if "libjpeg" in dso:
        return "decode (libjpeg)"
    if "_crops" in dso:
        return "resize+flip+planes (native)" if symbol.startswith(_RESIZE) else "decode (libjpeg)"
    if "cv2" in dso or "opencv" in dso:
        return "resize+flip+split (OpenCV)"
    if "zlib" in dso:
        return "crc32"
    if "libpython" in dso or (dso.endswith(".so") and "cpython" in dso):
        return "Python"
    if "torch" in dso or "c10" in dso:
        return "torch"
    if dso.startswith("libc.so") or dso.startswith("libc-"):
        return "libc (copies, malloc)"
    return "other"


def shares(path: str) -> dict[str, float]:
    """Each kind's share (percent) of the samples in the perf data file ``path``."""
    report = subprocess.run(
        ["perf", "report", "-i", path, "--stdio", "--sort", "dso,sym", "--percent-limit", "0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    total: collections.Counter[str] = collections.Counter()
    for line in report.splitlines():
        m = _SAMPLE.match(line)
        if m:
            total[kind(m.group(2), m.group(4).strip(), m.group(3) == "k")] += float(m.group(1))
    whole = sum(total.values()) or 1.0
    return {k: 100 * v / whole for k, v in total.most_common()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", nargs="+", help="perf.data files")
    args = parser.parse_args(argv)
    for path in args.data:
        print(f"{path}: " + ", ".join(f"{k} {v:.0f} %" for k, v in shares(path).items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

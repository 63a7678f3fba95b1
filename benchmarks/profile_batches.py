"""Where one process spends its time per image on LMDBFolder's batch path (cProfile, process time).

Usage:
    python benchmarks/profile_batches.py PACK [--mode default|fast] [--regions 0|1] [--batches 45]
        [--header-check on|off|both] [--rounds 5]

``default`` is ``LMDBFolder(PACK, transform=T.Compose([T.RandomResizedCrop(224),
T.RandomHorizontalFlip(), T.PILToTensor()]))`` (torchvision's own transform, fused
exactly); ``fast`` is lmdbfolder's fast settings (``fused.RandomResizedCrop(224,
resize="opencv", output="tensor")`` + flip, ``threads=1``). Batches of 64 in a
seeded random order go through ``__getitems__`` after 5 warm-up batches (run
``lmdbfolder warm PACK`` first for a warm page cache). ``--regions 0`` sets
``LMDBFOLDER_REGIONS=0`` (whole-image decoding), to see what region decoding
saves. Prints the CPU time per image (without and with the profiler), the functions that took most of it
(their own time, per image and as a share), and the time by kind: the decode,
the resize, pixel copies, checksums, and "other" (the Python glue around them,
the random draws).

``--header-check both`` measures what holding each record header against its
payload costs (issue 22: ``ReadPlan.claim`` before the box is drawn,
``Encoding.expect`` after the decode): the timed batches run ``--rounds``
times with the check and as often with it switched off (patched out in this
process), alternating, and it prints the CPU time per image of each (the
median round) and the difference; ``off`` profiles without the check.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pack")
    parser.add_argument("--mode", choices=["default", "fast"], default="default")
    parser.add_argument("--regions", choices=["0", "1"], default="1")
    parser.add_argument("--batches", type=int, default=45)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--header-check", choices=["on", "off", "both"], default="on")
    parser.add_argument("--rounds", type=int, default=5, help="with --header-check both: rounds of each")
    args = parser.parse_args(argv)
    os.environ["LMDBFOLDER_REGIONS"] = args.regions  # before the first decode in this process

    import torch
    from torchvision import transforms as T

    from lmdbfolder import fused
    from lmdbfolder.torch import LMDBFolder

    if args.mode == "default":
        tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.PILToTensor()])
        ds = LMDBFolder(args.pack, transform=tf)
    else:
        tf = T.Compose([fused.RandomResizedCrop(224, resize="opencv", output="tensor"), T.RandomHorizontalFlip()])
        ds = LMDBFolder(args.pack, transform=tf, threads=1)
    torch.manual_seed(0)
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0)).tolist()
    batches = [order[i : i + 64] for i in range(0, 64 * (args.batches + 5), 64)]
    batches = [b for b in batches if b]
    for b in batches[:5]:
        ds.__getitems__(b)
    timed = batches[5:]
    n = sum(len(b) for b in timed)
    if not n:
        parser.error(f"{args.pack} has too few samples for 5 warm-up batches of 64 and one timed batch")
    if args.header_check == "both":
        return _header_check_cost(ds, timed, n, args)
    if args.header_check == "off":
        _header_check(False)
    # Unprofiled first: cProfile's own cost per Python call inflates the glue it measures.
    start = time.process_time()
    for b in timed:
        ds.__getitems__(b)
    plain = time.process_time() - start
    prof = cProfile.Profile(time.process_time)
    start = time.process_time()
    prof.enable()
    for b in timed:
        ds.__getitems__(b)
    prof.disable()
    total = time.process_time() - start
    print(
        f"{args.pack}, {args.mode}, regions {args.regions}: {1e6 * plain / n:,.0f} us of CPU per image "
        f"({n} images; {1e6 * total / n:,.0f} us under the profiler)"
    )
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = sorted(((tt, fn, os.path.basename(file)) for (file, _, fn), (_, _, tt, _, _) in stats.items()), reverse=True)
    for tt, fn, file in rows[: args.top]:
        print(f"  {1e6 * tt / n:8,.0f} us  {100 * tt / total:5.1f} %  {fn}  ({file})")
    shares = {kind: 0.0 for kind in (*KINDS, "other")}
    for tt, fn, _file in rows:
        shares[kind_of(fn)] += tt
    print("  by kind (own time): " + ", ".join(f"{k} {1e6 * v / n:,.0f} us" for k, v in shares.items()))
    return 0


_ORIGINAL: dict[str, object] = {}


def _header_check(on: bool) -> None:
    """Switch the header-vs-payload check (``ReadPlan.claim``'s check, ``Encoding.expect``)
    on or off in this process, for ``--header-check``."""
    from lmdbfolder.codecs import Encoding, encoding_of
    from lmdbfolder.read.plan import ReadPlan

    if not _ORIGINAL:
        _ORIGINAL.update(claim=ReadPlan.__dict__["claim"], expect=Encoding.__dict__["expect"])
    if on:
        ReadPlan.claim = _ORIGINAL["claim"]  # type: ignore[method-assign]
        Encoding.expect = _ORIGINAL["expect"]  # type: ignore[method-assign]
    else:
        ReadPlan.claim = staticmethod(lambda payload, encoding, width, height, channels: encoding_of(encoding))  # type: ignore[method-assign,assignment]
        Encoding.expect = lambda self, pixels, width, height, denom=1: pixels  # type: ignore[method-assign,assignment,misc]


def _header_check_cost(ds: object, timed: list[list[int]], n: int, args: argparse.Namespace) -> int:
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):  # alternate, so drift hits both alike
            _header_check(on)
            start = time.process_time()
            for b in timed:
                ds.__getitems__(b)  # type: ignore[attr-defined]
            times[on].append(time.process_time() - start)
    _header_check(True)
    median = {on: sorted(t)[len(t) // 2] * 1e6 / n for on, t in times.items()}
    print(
        f"{args.pack}, {args.mode}, regions {args.regions}, {n} images x {args.rounds} rounds each: "
        f"header check on {median[True]:,.1f} us of CPU per image, off {median[False]:,.1f} us "
        f"(median rounds); the check costs {median[True] - median[False]:+,.1f} us per image "
        f"({100 * (median[True] / median[False] - 1):+.2f} %)"
    )
    print("  rounds, us per image: on " + ", ".join(f"{1e6 * t / n:,.0f}" for t in times[True]))
    print("                        off " + ", ".join(f"{1e6 * t / n:,.0f}" for t in times[False]))
    return 0


#: What the compiled and library calls on the read path are, by a piece of their profile name;
#: everything else (Python functions, small builtins, torch's RNG calls) is "other".
KINDS = {
    "decode": ("decode_region", "decode_jpeg", "imdecode", "'decode' of 'ImagingDecoder'", "'load' of"),
    "resize": ("resize_bilinear", "<resize>", "'resize' of 'ImagingCore'"),
    "copies": ("<split>", "<flip>", "'tobytes'", "frombuffer", "'copy' of"),
    "checksum": ("crc32", "checksum"),
}


def kind_of(function: str) -> str:
    """``decode``, ``resize``, ``copies``, ``checksum`` or ``other`` for a profile entry's name."""
    for kind, marks in KINDS.items():
        if any(mark in function for mark in marks):
            return kind
    return "other"


if __name__ == "__main__":
    raise SystemExit(main())

"""Where one process spends its time per image on LMDBFolder's batch path (cProfile, process time).

Usage:
    python benchmarks/profile_batches.py PACK [--mode default|fast] [--resize native|opencv|pil] [--regions 0|1]
        [--batches 45] [--header-check on|off|both] [--rounds 5]
    python benchmarks/profile_batches.py PACK --mode fast --loader threads|workers|workers-dc [--n 2]

``default`` is ``LMDBFolder(PACK, transform=T.Compose([T.RandomResizedCrop(224),
T.RandomHorizontalFlip(), T.PILToTensor()]))`` (torchvision's own transform, fused
exactly); ``fast`` is lmdbfolder's fast settings (``fused.RandomResizedCrop(224,
resize=RESIZE, output="tensor")`` + flip, ``threads=1``; ``--resize``, default
``native``). Batches of 64 in a
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

``--loader`` measures a mode through a real DataLoader instead (batches of 64,
shuffled, after 8 warm-up batches; no profiler): ``threads`` is
``num_workers=0`` with ``threads=N`` and ``collate_fn=collate``; ``workers`` is
``num_workers=N`` (persistent) with ``collate_fn=collate``; ``workers-dc`` the same
with torch's default collate. It prints the CPU time per image of the whole process
tree (main process and workers apart), minor page faults per image, and for
``threads`` the CPU of each thread: the main thread's excess over the others is the
work no other thread can share (the boxes' random numbers, reading the records),
the limit on how far threads scale. The CPU time of a mode less the one-process
``__getitems__`` time (the first form) is what moving the batches costs.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pack")
    parser.add_argument("--mode", choices=["default", "fast"], default="default")
    parser.add_argument("--regions", choices=["0", "1"], default="1")
    parser.add_argument("--resize", choices=["native", "opencv", "pil"], default="native", help="--mode fast's resize")
    parser.add_argument("--batches", type=int, default=45)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--header-check", choices=["on", "off", "both"], default="on")
    parser.add_argument("--rounds", type=int, default=5, help="with --header-check both: rounds of each")
    parser.add_argument("--loader", choices=["threads", "workers", "workers-dc"], help="measure through a DataLoader")
    parser.add_argument("--n", type=int, default=2, help="threads or workers for --loader (default 2)")
    args = parser.parse_args(argv)
    os.environ["LMDBFOLDER_REGIONS"] = args.regions  # before the first decode in this process
    if args.loader:
        return through_loader(args)

    import torch

    from lmdbfolder.torch import LMDBFolder

    ds = LMDBFolder(args.pack, transform=_transform(args.mode, args.resize), threads=1)
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
    from lmdbfolder.encodings import Encoding, encoding_of
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


def _transform(mode: str, resize: str = "native") -> object:
    from torchvision import transforms as T

    from lmdbfolder import fused

    if mode == "default":
        return T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.PILToTensor()])
    return T.Compose([fused.RandomResizedCrop(224, resize=resize, output="tensor"), T.RandomHorizontalFlip()])


def _stat(path: str) -> tuple[float, int]:
    """(CPU seconds, minor faults) of a /proc/.../stat file."""
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[7])


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except OSError:
                continue
    return out


def _threads() -> dict[str, float]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[tid] = _stat(f"/proc/self/task/{tid}/stat")[0]
        except OSError:
            continue
    return out


def through_loader(args: argparse.Namespace) -> int:
    """``--loader``: CPU per image of a mode through a DataLoader, by process and thread."""
    import torch
    from torch.utils.data import DataLoader

    from lmdbfolder.torch import LMDBFolder, collate

    kw: dict[str, object] = {"batch_size": 64, "shuffle": True, "drop_last": True}
    spent = {"getitems": 0.0, "run": 0.0}
    if args.loader == "threads":
        # The main thread's CPU inside __getitems__ and inside the parallel decode
        # (ReadPlan.run; NativeRun.finish for resize="native", whose C threads start
        # while the main thread still adds jobs): the difference is the work only the
        # main thread does.
        from lmdbfolder.read.plan import NativeRun, ReadPlan

        def timed(cls: type, name: str, key: str) -> None:
            real = getattr(cls, name)

            def wrapper(*a, **k):  # type: ignore[no-untyped-def]
                t0 = time.thread_time()
                try:
                    return real(*a, **k)
                finally:
                    spent[key] += time.thread_time() - t0

            setattr(cls, name, wrapper)

        timed(LMDBFolder, "__getitems__", "getitems")
        timed(ReadPlan, "run", "run")
        timed(NativeRun, "finish", "run")
        ds = LMDBFolder(args.pack, transform=_transform(args.mode, args.resize), threads=args.n)
        loader = DataLoader(ds, num_workers=0, collate_fn=collate, **kw)  # type: ignore[arg-type]
    else:
        ds = LMDBFolder(args.pack, transform=_transform(args.mode, args.resize))
        if args.loader == "workers":
            kw["collate_fn"] = collate
        loader = DataLoader(ds, num_workers=args.n, persistent_workers=True, **kw)  # type: ignore[arg-type]
    torch.manual_seed(0)

    def batches():  # type: ignore[no-untyped-def]
        while True:
            yield from loader

    it = batches()
    for _ in range(8):
        next(it)
    me = os.getpid()
    kids = _children(me)
    spent.update(getitems=0.0, run=0.0)
    main_thread0 = time.thread_time()
    main0, kids0, threads0 = _stat(f"/proc/{me}/stat"), [_stat(f"/proc/{k}/stat") for k in kids], _threads()
    n = 0
    for _ in range(args.batches):
        x, _y = next(it)
        n += len(x)
        del x, _y
    main1, kids1, threads1 = _stat(f"/proc/{me}/stat"), [_stat(f"/proc/{k}/stat") for k in kids], _threads()
    main_thread = time.thread_time() - main_thread0
    main_cpu, main_faults = main1[0] - main0[0], main1[1] - main0[1]
    kid_cpu = sum(b[0] - a[0] for a, b in zip(kids0, kids1))
    kid_faults = sum(b[1] - a[1] for a, b in zip(kids0, kids1))
    print(
        f"{args.pack}, {args.mode}, {args.loader} x{args.n}: {1e6 * (main_cpu + kid_cpu) / n:,.0f} us of CPU per image "
        f"(main process {1e6 * main_cpu / n:,.0f}, workers {1e6 * kid_cpu / n:,.0f}); minor faults per image: "
        f"main {main_faults / n:.1f}, workers {kid_faults / n:.1f} ({n} images)"
    )
    if args.loader == "threads":
        used = sorted(((threads1[t] - threads0.get(t, 0.0), t) for t in threads1), reverse=True)
        main_tid = str(me)
        per = {t: 1e6 * c / n for c, t in used if c > 0}
        # The native batch's threads live for one batch each: what they used is the
        # process's CPU less that of the threads still there.
        gone = 1e6 * main_cpu / n - sum(per.values())
        print(
            "  CPU per image by thread: "
            + ", ".join(f"{'main' if t == main_tid else 'thread'} {v:,.0f} us" for t, v in per.items())
            + (f", threads of the native batches {gone:,.0f} us" if gone > 0.05 * 1e6 * main_cpu / n else "")
        )
        serial = 1e6 * (spent["getitems"] - spent["run"]) / n
        outside = 1e6 * (main_thread - spent["getitems"]) / n
        print(
            f"  work only the main thread does, per image: {serial:,.0f} us in __getitems__ outside the threads' "
            f"part (records, boxes), {outside:,.0f} us in the DataLoader and collate"
        )
    sys.stdout.flush()
    os._exit(0)  # persistent workers: leave at once


#: What the compiled and library calls on the read path are, by a piece of their profile name;
#: everything else (Python functions, small builtins, torch's RNG calls) is "other".
KINDS = {
    # resize="native": the decode, resize, flip and planes of a batch's JPEGs in one C call
    # (perf, not cProfile, splits it: see benchmarks/README.md).
    "decode+resize (native batch)": ("'finish' of 'lmdbfolder.read._crops.Batch'", "'add' of 'lmdbfolder.read._crops"),
    "decode": ("decode_region", "decode_jpeg", "imdecode", "'decode' of 'ImagingDecoder'", "'load' of"),
    "resize": ("resize_bilinear", "<resize>", "'resize' of 'ImagingCore'"),
    "copies": ("<split>", "<flip>", "'tobytes'", "frombuffer", "'copy' of"),
    "checksum": ("crc32", "checksum"),
}


def kind_of(function: str) -> str:
    """The kind (``KINDS``: ``decode``, ``resize``, ...; or ``other``) of a profile entry's name."""
    for kind, marks in KINDS.items():
        if any(mark in function for mark in marks):
            return kind
    return "other"


if __name__ == "__main__":
    raise SystemExit(main())

"""``pack --update`` against a full pack of the changed tree, interrupted updates, no-op updates (issue 24).

Usage:
    python benchmarks/photolike.py make TREE --images 100000 --profile small
    python benchmarks/bench_update.py --tree TREE [--work DIR] [--keep] [--rounds 3] [--kills 50]
        [--oracle all|N] [--seed 0] [--json PATH]

Its scratch, ``WORK`` below, is a new folder made inside ``--work`` (default: the
system's temporary folder), about 4x the size of the tree's pack, and removed at
the end unless ``--keep``; nothing else under ``--work`` is touched.

What it does, in one run:

1. ``WORK/src`` is a copy of TREE made of hard links (TREE is never changed:
   every change below writes a new file and renames it into place, which
   breaks the link). It is packed once (``WORK/old``, the old version; each
   update runs on a copy of it).
2. 1 % of the files change: 0.5 % added (a fifth of them in one new class,
   ``0000-new``, which sorts before every other, so every label shifts),
   0.3 % removed, 0.2 % rewritten (another file's bytes under the same name).
3. ``--rounds`` rounds, the order alternating: a full pack of the changed
   tree (``lmdbfolder pack WORK/src WORK/fresh --overwrite``) and an update of
   a fresh copy of the old version (``lmdbfolder pack WORK/src WORK/upd
   --update``), each a subprocess, started once the disk is idle (``os.sync``:
   the copy of the old version is written back first) and the tree read again
   into the cache; the same for both.
   Reported: wall time (median), CPU time of the command (ms per changed file
   and per image), the CPU other processes used meanwhile, and the ratio
   update / full pack.
4. The result equals a fresh pack: ImageFolder (torchvision) of the changed
   tree against ``LMDBFolder(WORK/upd)``, every sample (``--oracle N``: N
   evenly spaced samples), classes, class_to_idx, samples, targets and pixels;
   and ``lmdbfolder verify`` of it.
5. ``--kills`` trials: an update of a fresh copy of the old version, in a
   child process that reports each file it reads and each step of the commit
   on a pipe; the parent sends SIGKILL right after the K-th report (K drawn at
   random over every report for half the trials, over the steps that are not
   a file read for the other half), so the kill lands anywhere from the first
   file to the removal of the staging folder. Then: the pack opens, ``verify`` says
   OK, and it holds the old version (or, killed after the commit, the new one);
   the same update run again gives the fresh pack's tables and payloads.
6. A no-op: ``--update`` of the unchanged tree, against the scan it needs
   (``scan`` + a ``stat`` of every file, in a subprocess).

Run the timed part (3 and 6) on a quiet machine; the CPU other processes used
during each timing is printed beside it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import random
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from workdir import scratch  # noqa: E402

PYTHON = sys.executable
ENV = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}


# -- measuring ------------------------------------------------------------------------
def _busy_seconds() -> float:
    """CPU seconds every process of the machine has used (user + system + ...), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(cmd: list[str]) -> dict[str, float]:
    """Run ``cmd``; its wall time, its CPU time and the CPU others used meanwhile."""
    busy, mine = _busy_seconds(), _children_cpu()
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=ENV, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    cpu = _children_cpu() - mine
    others = max(0.0, _busy_seconds() - busy - cpu)
    return {"wall_s": wall, "cpu_s": cpu, "others_cpu_s": others}


def lmdbfolder(*args: str) -> list[str]:
    return [PYTHON, "-m", "lmdbfolder", *args]


# -- the tree ---------------------------------------------------------------------------
def link_copy(tree: str, dst: str) -> None:
    """``cp -al``: a copy of ``tree`` made of hard links (``dst`` must not exist)."""
    subprocess.run(["cp", "-al", tree, dst], check=True)


def replace_file(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a new file and a rename (a hard link is never written through)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp-bench"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def change(src: str, seed: int) -> dict[str, int]:
    """Change 1 % of the files under ``src``: 0.5 % added (a fifth in a new first class),
    0.3 % removed, 0.2 % rewritten."""
    sys.path.insert(0, os.path.join(ROOT, "src"))
    from lmdbfolder.write.sources import scan

    files = list(scan(src).relpaths)
    rng = random.Random(seed)
    n = len(files)
    added, removed, rewritten = max(1, n * 5 // 1000), max(1, n * 3 // 1000), max(1, n * 2 // 1000)
    picks = rng.sample(range(n), removed + rewritten)
    gone, changed = picks[:removed], picks[removed:]
    for i in changed:
        other = files[rng.randrange(n)]
        with open(os.path.join(src, other), "rb") as f:
            replace_file(os.path.join(src, files[i]), f.read())
    new_class = added // 5
    for k in range(added):
        with open(os.path.join(src, files[rng.randrange(n)]), "rb") as f:
            data = f.read()
        if k < new_class:
            name = os.path.join("0000-new", f"new-{k:06d}.jpg")
        else:
            folder = os.path.dirname(files[rng.randrange(n)])
            name = os.path.join(folder, f"zz-added-{k:06d}.jpg")
        replace_file(os.path.join(src, name), data)
    for i in gone:
        os.remove(os.path.join(src, files[i]))
    return {"files": n, "added": added, "removed": removed, "rewritten": rewritten, "new_class_files": new_class}


def warm(path: str) -> None:
    """Read every file under ``path`` once (the timings are of a cached tree)."""
    for dirpath, _, names in os.walk(path):
        for name in names:
            with open(os.path.join(dirpath, name), "rb") as f:
                while f.read(1 << 20):
                    pass


def settle(src: str) -> None:
    """Before each timed command: the disk idle and the tree cached, the same for both.

    ``restore`` copies the whole old version (as large as the tree): without this,
    its writeback would still be running during the update that follows (charged to
    the update's fsync), and the copy would have pushed the tree out of the cache."""
    os.sync()
    warm(src)


def restore(saved: str, dst: str) -> None:
    """``dst`` becomes the old version again (a copy of ``saved``), no staging left."""
    for path in (dst, dst + ".update", dst + ".lock"):
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    shutil.copytree(saved, dst)


# -- checking ---------------------------------------------------------------------------
def fingerprint(path: str) -> dict[str, Any]:
    """What a reader sees of a pack: classes, labels, paths, and a digest of every record."""
    sys.path.insert(0, os.path.join(ROOT, "src"))
    from lmdbfolder import Reader

    with Reader(path) as r:
        h = hashlib.sha256()
        for rec in r:
            h.update(b"%d %s %d %d|" % (rec.label, rec.encoding.encode(), rec.width, rec.height))
            h.update(rec.payload)
        return {
            "classes": r.classes,
            "labels": hashlib.sha256(bytes(r.labels)).hexdigest(),
            "paths": hashlib.sha256("\n".join(r.paths()).encode("utf-8", "surrogateescape")).hexdigest(),
            "records": h.hexdigest(),
            "count": len(r),
            "pack_id": r.pack_id,
        }


def same_as(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a[k] == b[k] for k in ("classes", "labels", "paths", "records", "count"))


def imagefolder_oracle(src: str, pack: str, limit: int | None) -> dict[str, Any]:
    """ImageFolder of ``src`` against LMDBFolder of ``pack``: every (or ``limit`` evenly spaced) sample."""
    import numpy as np
    from torchvision.datasets import ImageFolder

    sys.path.insert(0, os.path.join(ROOT, "src"))
    from lmdbfolder.torch import LMDBFolder

    theirs, ours = ImageFolder(src), LMDBFolder(pack)
    assert ours.classes == theirs.classes and ours.class_to_idx == theirs.class_to_idx, "classes differ"
    assert [(os.path.relpath(p, src), t) for p, t in theirs.samples] == [
        (os.path.relpath(p, src), t) for p, t in ours.samples
    ], "samples differ"
    n = len(theirs)
    picks = range(n) if limit is None or limit >= n else [k * n // limit for k in range(limit)]
    for i in picks:
        (a, ta), (b, tb) = theirs[i], ours[i]
        assert ta == tb and np.array_equal(np.asarray(a), np.asarray(b)), f"sample {i} differs"
    return {"samples": n, "compared_pixels": len(picks)}


_CHILD = r"""
import os, sys
import lmdbfolder.write.update as update
from lmdbfolder import pack_sources, scan

out = os.fdopen(int(sys.argv[3]), "w", buffering=1)

def step(name, fn):
    def wrapped(*args, **kwargs):
        out.write(name + "\n")
        result = fn(*args, **kwargs)
        out.write(name + " done\n")
        return result
    return wrapped

for name in ("_plan", "_stage", "_apply", "_commit", "_write_report", "_compact_if_sparse"):
    setattr(update, name, step(name, getattr(update, name)))
sources = scan(sys.argv[1])
out.write("scanned\n")
pack_sources(sources, sys.argv[2], update=True, progress=False, on_progress=lambda done, total: out.write("read\n"))
out.write("finished\n")
"""


def count_events(src: str, saved: str, dst: str) -> list[str]:
    """The reports an uninterrupted update of the old version makes, in order."""
    restore(saved, dst)
    return _child_events(src, dst, None)


def _child_events(src: str, dst: str, kill_after: int | None) -> list[str]:
    """Run the update in a child reporting each step; SIGKILL it right after report ``kill_after``."""
    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen(
        [PYTHON, "-c", _CHILD, src, dst, str(write_fd)], env=ENV, pass_fds=(write_fd,), stdout=subprocess.DEVNULL
    )
    os.close(write_fd)
    events: list[str] = []
    with os.fdopen(read_fd) as reports:
        for line in reports:
            events.append(line.strip())
            if kill_after is not None and len(events) == kill_after:
                proc.send_signal(signal.SIGKILL)
                break
    proc.wait()
    return events


def kill_trials(
    src: str, saved: str, work: str, trials: int, old: dict[str, Any], new: dict[str, Any], seed: int
) -> dict[str, Any]:
    sys.path.insert(0, os.path.join(ROOT, "src"))
    from lmdbfolder import pack, verify

    dst = os.path.join(work, "killed")
    reports = count_events(src, saved, dst)
    total = len(reports)
    # Half the kills after any report (most are files read), half after a step of
    # the plan, the commit or the cleanup, so that every step is hit.
    steps = [k + 1 for k, name in enumerate(reports) if name != "read"]
    rng = random.Random(seed + 1)
    outcome = {"trials": trials, "events": total, "old_version": 0, "new_version": 0, "failures": []}
    for t in range(trials):
        restore(saved, dst)
        k = rng.randint(1, total) if t % 2 == 0 else rng.choice(steps)
        events = _child_events(src, dst, k)
        where = events[-1] if events else "start"
        found = fingerprint(dst)
        report = verify(dst, progress=False)
        if same_as(found, old) and found["pack_id"] == old["pack_id"]:
            outcome["old_version"] += 1
        elif same_as(found, new):
            outcome["new_version"] += 1
        else:
            outcome["failures"].append(f"trial {t} (after report {k}, {where}): neither the old nor the new version")
        if not report.ok:
            outcome["failures"].append(f"trial {t} (after report {k}, {where}): verify: {report.problems[:3]}")
        pack(src, dst, update=True, progress=False)
        if not same_as(fingerprint(dst), new):
            outcome["failures"].append(f"trial {t} (after report {k}, {where}): the rerun is not the fresh pack")
        print(f"  kill {t + 1}/{trials}: after report {k}/{total} ({where}): ok", flush=True)
    return outcome


def noop(src: str, dst: str, rounds: int) -> dict[str, Any]:
    """``--update`` of an unchanged tree against its scan (scan + stat of every file)."""
    scan_code = (
        "import os, sys\nfrom lmdbfolder import scan\ns = scan(sys.argv[1])\n"
        "for i in range(len(s)): os.stat(s.abspath(i))\n"
    )
    update_runs, scan_runs = [], []
    for r in range(rounds):
        order = [0, 1] if r % 2 == 0 else [1, 0]
        for which in order:
            if which == 0:
                update_runs.append(timed(lmdbfolder("pack", src, dst, "--update", "--no-progress")))
            else:
                scan_runs.append(timed([PYTHON, "-c", scan_code, src]))
    return {"update": update_runs, "scan": scan_runs}


def median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", required=True, help="an ImageFolder tree (photolike.py make ...); never changed")
    parser.add_argument(
        "--work",
        default=None,
        help="where the scratch folder (about 4x the size of the tree's pack) is made; default: the system's temp",
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (its path is printed)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--oracle", default="all", help="'all', or how many evenly spaced samples to compare")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="default: benchmarks/results/bench_update-DATE.json")
    args = parser.parse_args(argv)
    with scratch(args.work, "bench-update-", keep=args.keep) as work:
        return run(args, work)


def run(args: argparse.Namespace, work: str) -> int:
    """The whole benchmark in ``work``, a new folder of its own."""
    src, saved = os.path.join(work, "src"), os.path.join(work, "old")
    fresh, upd = os.path.join(work, "fresh"), os.path.join(work, "upd")
    print(f"copying {args.tree} (hard links) to {src}", flush=True)
    link_copy(os.path.abspath(args.tree), src)
    warm(src)
    first = timed(lmdbfolder("pack", src, saved, "--no-progress"))  # the old version, copied for each update
    print(f"packed the old version in {first['wall_s']:.1f} s", flush=True)
    changes = change(src, args.seed)
    print(f"changed the tree: {changes}", flush=True)
    warm(src)
    full_runs, update_runs = [], []
    for r in range(args.rounds):
        for which in [0, 1] if r % 2 == 0 else [1, 0]:
            if which == 0:
                settle(src)
                full_runs.append(timed(lmdbfolder("pack", src, fresh, "--overwrite", "--no-progress")))
                print(f"  round {r + 1}: full pack {full_runs[-1]['wall_s']:.2f} s", flush=True)
            else:
                restore(saved, upd)
                settle(src)
                update_runs.append(timed(lmdbfolder("pack", src, upd, "--update", "--no-progress")))
                print(f"  round {r + 1}: update {update_runs[-1]['wall_s']:.2f} s", flush=True)
    sys.path.insert(0, os.path.join(ROOT, "src"))
    from lmdbfolder import verify

    report = verify(upd, progress=False)
    limit = None if args.oracle == "all" else int(args.oracle)
    oracle = imagefolder_oracle(src, upd, limit)
    old, new = fingerprint(saved), fingerprint(fresh)
    equal = same_as(fingerprint(upd), new)
    print(f"verify: {'OK' if report.ok else report.problems[:3]}; equals the fresh pack: {equal}; oracle {oracle}")
    kills = kill_trials(src, saved, work, args.kills, old, new, args.seed) if args.kills else None
    quiet = noop(src, upd, args.rounds)

    changed_files = changes["added"] + changes["removed"] + changes["rewritten"]
    full_wall, update_wall = median(full_runs, "wall_s"), median(update_runs, "wall_s")
    result = {
        "tree": os.path.abspath(args.tree),
        "changes": changes,
        "full_pack": full_runs,
        "update": update_runs,
        "ratio_wall": update_wall / full_wall,
        "ratio_cpu": median(update_runs, "cpu_s") / median(full_runs, "cpu_s"),
        "update_cpu_ms_per_changed_file": 1000 * median(update_runs, "cpu_s") / changed_files,
        "full_cpu_ms_per_image": 1000 * median(full_runs, "cpu_s") / changes["files"],
        "verify_ok": report.ok,
        "equals_fresh_pack": equal,
        "oracle": oracle,
        "kills": kills,
        "noop": quiet,
        "noop_ratio_wall": median(quiet["update"], "wall_s") / median(quiet["scan"], "wall_s"),
    }
    print()
    print(f"files {changes['files']:,}; changed {changed_files:,} ({changes})")
    print(
        f"full pack of the changed tree: {full_wall:.2f} s wall, {median(full_runs, 'cpu_s'):.2f} s CPU "
        f"({result['full_cpu_ms_per_image']:.3f} ms/img); others' CPU {median(full_runs, 'others_cpu_s'):.2f} s"
    )
    print(
        f"update:                        {update_wall:.2f} s wall, {median(update_runs, 'cpu_s'):.2f} s CPU "
        f"({result['update_cpu_ms_per_changed_file']:.3f} ms/changed file); "
        f"others' CPU {median(update_runs, 'others_cpu_s'):.2f} s"
    )
    print(f"update / full pack: {result['ratio_wall']:.3f} (wall), {result['ratio_cpu']:.3f} (CPU)  [bound: 0.10]")
    if kills is not None:
        print(
            f"kill -9 trials: {kills['trials']} over {kills['events']} reports: {kills['old_version']} old version, "
            f"{kills['new_version']} new version, {len(kills['failures'])} failures {kills['failures'][:3]}"
        )
    noop_wall, scan_wall = median(quiet["update"], "wall_s"), median(quiet["scan"], "wall_s")
    print(f"no-op update: {noop_wall:.2f} s; scan + stat: {scan_wall:.2f} s (ratio {result['noop_ratio_wall']:.2f})")
    out = args.json or os.path.join(
        HERE, "results", f"bench_update-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    ok = report.ok and equal and (kills is None or not kills["failures"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

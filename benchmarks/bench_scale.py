"""Packs at ImageNet size: time, memory and disk at 10k / 100k / 1.28M small files (issue 12).

Usage:
    python benchmarks/bench_scale.py [--sizes 10k,100k,1.28M] [--src DIR ...] [--repeat 2]
        [--data DIR] [--keep] [--shards 8] [--skip STEP ...] [--json PATH]

For each size N it makes (once; resumable) a tree of N photo-like JPEGs of
2-6 KB in 1,000 classes (``photolike.py make --profile small``) under
``DATA/small-N`` (``--data``, default ``$TMPDIR/lmdbfolder-scale-data``;
kept for the next run), then, for every checkout given with ``--src`` (default:
this one), measures:

* pack: ``lmdbfolder pack TREE DST`` (a subprocess) after dropping the
  tree's pages from the page cache (cold) and with them cached (warm); peak
  Rss and Pss of the pack's whole process tree (the writer and its reader
  processes, summed from /proc/PID/smaps_rollup every ~50 ms), the disk peak
  (allocated bytes of DST and DST.partial, sampled alike) against the final
  pack, whether the map grew and whether it was compacted;
* tar: ``tar cf - TREE | cat >/dev/null``, cold and warm, in the same
  rounds (alternated with the packs). GNU tar does not read the files at all
  when its archive is /dev/null (``tar cf /dev/null TREE``): that variant is
  timed too, as "tar (metadata only)";
* open: ``LMDBFolder(DST)`` in a fresh process: time, tracemalloc peak
  (a copy of the path table would show here) and RSS growth;
* workers: private memory (Private_Clean + Private_Dirty of smaps_rollup)
  and Pss of each DataLoader worker under fork and spawn after reading some
  shuffled batches;
* read: random ``get`` (warm), and ``get_many`` of 256 random indices with
  and without prefetch, warm and cold, in us per record;
* sharded: the same tree packed with ``--shards S``: pack time and peak RSS,
  open time, and the first-open cost of each shard in a fresh process (what
  every DataLoader worker pays per shard).

Every lmdbfolder step runs as a subprocess with ``PYTHONPATH=SRC/src``, so a
"before" checkout (``git worktree add /tmp/scale-before COMMIT``) and "after"
are measured side by side in one run: ``--src /tmp/scale-before --src .``.
Cold means: ``sync``, then ``posix_fadvise(DONTNEED)`` on every file of the
tree (or of the pack), as ``lmdbfolder.tools.cache.evict`` does; no root
needed. The packs go to a new folder inside DATA, removed at the end unless
``--keep``. Output: a table per N on stdout and JSON in ``benchmarks/results/``.
Run it on a quiet machine; the numbers of a busy one are only directional.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from workdir import scratch  # noqa: E402

PYTHON = sys.executable
DEFAULT_DATA = os.path.join(tempfile.gettempdir(), "lmdbfolder-scale-data")
SIZES = {"10k": 10_000, "100k": 100_000, "1.28M": 1_281_167}


# -- page cache, /proc ----------------------------------------------------------------
def files_under(root: str) -> list[str]:
    """Every regular file under ``root``."""
    out = []
    for d, _, names in os.walk(root):
        out.extend(os.path.join(d, n) for n in names)
    return out


def evict(paths: list[str]) -> None:
    """Drop the files' clean, unmapped pages from the page cache (no root needed)."""
    os.sync()
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_FIELDS = ("Rss", "Pss", "Private_Clean", "Private_Dirty", "Anonymous")


def rollup(pid: int) -> dict[str, int]:
    """Rss, Pss, Private_Clean, Private_Dirty, Anonymous (bytes) of ``pid`` from smaps_rollup ({} if gone).

    Private_Clean includes pages of files mapped by this process alone (a
    reader's pages of data.mdb): reclaimable, unlike Anonymous memory."""
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and parts[0].rstrip(":") in _FIELDS:
                    out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    except OSError:
        return {}
    return out


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (from /proc/PID/task/TID/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
            except OSError:
                pass
    return out


def allocated(paths: list[str]) -> int:
    """Allocated bytes (st_blocks) of every file under the given paths."""
    total = 0
    for top in paths:
        for d, _, names in os.walk(top):
            for n in names:
                try:
                    total += os.lstat(os.path.join(d, n)).st_blocks * 512
                except OSError:
                    pass
    return total


class Sampler:
    """Samples a process tree's summed Rss/Pss and some directories' allocated bytes every ~50 ms."""

    def __init__(self, pid: int, dirs: list[str], period: float = 0.05) -> None:
        self.pid, self.dirs, self.period = pid, dirs, period
        self.peak = {
            "rss": 0,
            "pss": 0,
            "private": 0,
            "anonymous": 0,
            "writer_rss": 0,
            "reader_private": 0,
            "disk": 0,
            "processes": 0,
        }
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            pids = process_tree(self.pid)
            stats = [rollup(p) for p in pids]
            sums = {
                "rss": sum(s.get("Rss", 0) for s in stats),
                "pss": sum(s.get("Pss", 0) for s in stats),
                "private": sum(s.get("Private_Clean", 0) + s.get("Private_Dirty", 0) for s in stats),
                "anonymous": sum(s.get("Anonymous", 0) for s in stats),
                "writer_rss": stats[0].get("Rss", 0) if stats else 0,
                # the most private memory of one reader process (the writer's children)
                "reader_private": max(
                    (s.get("Private_Clean", 0) + s.get("Private_Dirty", 0) for s in stats[1:]), default=0
                ),
                "disk": allocated(self.dirs),
                "processes": len([s for s in stats if s]),
            }
            for k, v in sums.items():
                self.peak[k] = max(self.peak[k], v)
            self._stop.wait(self.period)


# -- running a step of a checkout -------------------------------------------------------
def env_for(src: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(src, "src")
    env.pop("LMDBFOLDER_PROGRESS", None)
    return env


def step(src: str, *args: str, timeout: float = 3600) -> Any:
    """Run ``bench_scale.py _step ARGS`` with ``src``'s lmdbfolder; returns its JSON output."""
    proc = subprocess.run(
        [PYTHON, os.path.abspath(__file__), "_step", *args],
        env=env_for(src),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"step {args} with {src} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


#: Runs ``lmdbfolder pack`` and counts the map growths: ``set_mapsize`` calls on the
#: writer's environment (the writer calls it only to grow the map, in every version).
PACK_LAUNCHER = """
import atexit, sys, lmdb
calls = [0]
real_open = lmdb.open
class Env:
    def __init__(self, env):
        self._env = env
    def set_mapsize(self, size):
        calls[0] += 1
        return self._env.set_mapsize(size)
    def __getattr__(self, name):
        return getattr(self._env, name)
def counting_open(*args, **kwargs):
    env = real_open(*args, **kwargs)
    return env if kwargs.get("readonly") else Env(env)
lmdb.open = counting_open
atexit.register(lambda: sys.stderr.write(f"\\nBENCH-SET-MAPSIZE {calls[0]}\\n"))
from lmdbfolder.cli import main
sys.exit(main(["pack", *sys.argv[1:]]))
"""


def timed_pack(src: str, tree: str, dst: str, extra: list[str]) -> dict[str, Any]:
    """``lmdbfolder pack TREE DST`` in a subprocess, sampled; returns time, peaks and the summary."""
    for d in (dst, dst + ".partial"):
        shutil.rmtree(d, ignore_errors=True)
    os.sync()
    cmd = [PYTHON, "-c", PACK_LAUNCHER, tree, dst, "--no-progress", "--json", *extra]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env_for(src), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with Sampler(proc.pid, [dst, dst + ".partial"]) as sampler:
        out, err = proc.communicate()
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"pack with {src} failed ({proc.returncode}):\n{err[-3000:]}")
    summary = json.loads(out[out.index("{") :])
    grew = [line.split()[1] for line in err.splitlines() if line.startswith("BENCH-SET-MAPSIZE")]
    return {
        "seconds": seconds,
        "peak_rss": sampler.peak["rss"],
        "peak_pss": sampler.peak["pss"],
        "peak_private": sampler.peak["private"],
        "peak_anonymous": sampler.peak["anonymous"],
        "peak_writer_rss": sampler.peak["writer_rss"],
        "peak_reader_private": sampler.peak["reader_private"],
        "processes": sampler.peak["processes"],
        "disk_peak": sampler.peak["disk"],
        "pack_bytes": allocated([dst]),
        "compacted": summary.get("compacted"),
        "count": summary.get("count"),
        "map_growths": int(grew[0]) if grew else None,
    }


def timed_shell(command: str) -> float:
    os.sync()
    start = time.perf_counter()
    subprocess.run(command, shell=True, check=True)
    return time.perf_counter() - start


# -- the steps (run in a subprocess, with the checkout's lmdbfolder) ---------------------
def _self_rss() -> int:
    return rollup(os.getpid()).get("Rss", 0)


def step_open(dst: str) -> dict[str, Any]:
    """LMDBFolder(DST) in this fresh process: seconds, tracemalloc peak, RSS growth."""
    import tracemalloc

    import lmdbfolder.torch  # noqa: F401  (imports are not part of the open)
    from lmdbfolder.torch import LMDBFolder

    rss0 = _self_rss()
    tracemalloc.start()
    start = time.perf_counter()
    ds = LMDBFolder(dst)
    seconds = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"seconds": seconds, "tracemalloc_peak": peak, "rss_delta": _self_rss() - rss0, "count": len(ds)}


def _collate(batch: list[Any]) -> int:
    return len(batch)


def step_workers(dst: str, context: str, workers: str, batches: str) -> dict[str, Any]:
    """Private memory of DataLoader workers after reading ``batches`` shuffled batches of 64."""
    import torch.utils.data

    from lmdbfolder.torch import LMDBFolder

    ds = LMDBFolder(dst)
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=64,
        shuffle=True,
        num_workers=int(workers),
        multiprocessing_context=context,
        collate_fn=_collate,
        persistent_workers=True,
        prefetch_factor=2,
    )
    it = iter(loader)
    n = min(int(batches), len(loader) - 4)
    for _ in range(max(1, n)):
        next(it)
    pids = [w.pid for w in it._workers]  # type: ignore[attr-defined]  # a benchmark may look inside
    stats = [rollup(p) for p in pids]
    main = rollup(os.getpid())
    del it
    return {
        "private": [s.get("Private_Clean", 0) + s.get("Private_Dirty", 0) for s in stats],
        "private_dirty": [s.get("Private_Dirty", 0) for s in stats],
        "anonymous": [s.get("Anonymous", 0) for s in stats],
        "pss": [s.get("Pss", 0) for s in stats],
        "rss": [s.get("Rss", 0) for s in stats],
        "main_rss": main.get("Rss", 0),
        "batches": n,
    }


def step_read(dst: str, mode: str, count: str) -> dict[str, Any]:
    """Random reads, us per record: ``get`` or ``get_many`` (prefetch on/off) of 256 indices."""
    import random

    from lmdbfolder import open_pack

    reader = open_pack(dst)
    n = len(reader)
    rng = random.Random(0)
    k = int(count)
    if mode == "get":
        idx = [rng.randrange(n) for _ in range(k)]
        for i in idx[: min(k, 2000)]:
            reader.get(i).payload[-1]
        start = time.perf_counter()
        for i in idx:
            reader.get(i).payload[-1]  # touch the record
        seconds = time.perf_counter() - start
        return {"us_per_record": 1e6 * seconds / k}
    prefetch = mode.endswith("prefetch")
    batches = [[rng.randrange(n) for _ in range(256)] for _ in range(max(1, k // 256))]
    start = time.perf_counter()
    for b in batches:
        for rec in reader.get_many(b, prefetch=prefetch):
            rec.payload[-1]
    seconds = time.perf_counter() - start
    return {"us_per_record": 1e6 * seconds / (256 * len(batches))}


def step_shard_open(dst: str) -> dict[str, Any]:
    """A fresh process: open_pack time, then each shard's first-open cost (reading one record)."""
    from lmdbfolder import open_pack

    start = time.perf_counter()
    reader = open_pack(dst)
    open_seconds = time.perf_counter() - start
    per = []
    for k in range(reader.num_shards):
        start = time.perf_counter()
        reader.get(reader.shard_offsets[k]).payload[-1]
        per.append(time.perf_counter() - start)
    return {"open_seconds": open_seconds, "shard_first_open": per}


STEPS: dict[str, Callable[..., dict[str, Any]]] = {
    "open": step_open,
    "workers": step_workers,
    "read": step_read,
    "shard_open": step_shard_open,
}


# -- the driver ---------------------------------------------------------------------------
def make_tree(root: str, n: int) -> None:
    sys.path.insert(0, HERE)
    import photolike

    spec = photolike.PhotoSpec(images=n, classes=1000, profile="small")
    start = time.perf_counter()
    written = photolike.make_tree(root, spec)
    if written:
        print(f"tree {root}: {written:,} files written in {time.perf_counter() - start:.0f} s", file=sys.stderr)


def label_of(src: str) -> str:
    try:
        rev = subprocess.run(
            ["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", src, "status", "--porcelain", "src"], capture_output=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        rev, dirty = "?", ""
    return f"{os.path.basename(os.path.abspath(src))}@{rev}{'+' if dirty.strip() else ''}"


def run_size(args: argparse.Namespace, n: int, srcs: list[str], work: str) -> dict[str, Any]:
    """Every step at ``n`` images: the tree is kept under ``--data`` for the next run, the packs
    go to ``work`` (this run's own folder)."""
    tree = os.path.join(args.data, f"small-{n}")
    make_tree(tree, n)
    tree_files = files_under(tree)
    labels = {src: label_of(src) for src in srcs}
    res: dict[str, Any] = {"n": n, "tree": tree, "tree_bytes": sum(os.path.getsize(p) for p in tree_files)}
    res["tree_allocated"] = allocated([tree])
    tar = {"tar_cold": [], "tar_warm": [], "tar_null_cold": [], "tar_null_warm": []}
    packs: dict[str, dict[str, list[Any]]] = {labels[s]: {"cold": [], "warm": []} for s in srcs}
    skip = set(args.skip)
    dsts = {src: os.path.join(work, f"{i}-{n}.lmdb") for i, src in enumerate(srcs)}
    tar_read = f"tar cf - -C {os.path.dirname(tree)!r} {os.path.basename(tree)!r} | cat > /dev/null"
    tar_null = f"tar cf /dev/null -C {os.path.dirname(tree)!r} {os.path.basename(tree)!r}"
    for r in range(args.repeat):
        order = srcs if r % 2 == 0 else srcs[::-1]
        if "tar" not in skip:
            evict(tree_files)
            tar["tar_cold"].append(timed_shell(tar_read))
            tar["tar_warm"].append(timed_shell(tar_read))
            evict(tree_files)
            tar["tar_null_cold"].append(timed_shell(tar_null))
            tar["tar_null_warm"].append(timed_shell(tar_null))
        if "pack" not in skip:
            for src in order:
                evict(tree_files)
                packs[labels[src]]["cold"].append(timed_pack(src, tree, dsts[src], args.pack_args))
                shutil.rmtree(dsts[src], ignore_errors=True)
                subprocess.run(tar_read, shell=True, check=True)  # warm the tree again
                packs[labels[src]]["warm"].append(timed_pack(src, tree, dsts[src], args.pack_args))
                if r < args.repeat - 1:
                    shutil.rmtree(dsts[src], ignore_errors=True)
        print(f"N={n:,}: round {r + 1}/{args.repeat} done", file=sys.stderr)
    res["tar"] = tar
    res["pack"] = packs
    res["steps"] = {}
    for src in srcs:
        label, dst = labels[src], dsts[src]
        out: dict[str, Any] = {}
        if not os.path.isdir(dst):
            timed_pack(src, tree, dst, args.pack_args)
        if "open" not in skip:
            out["open"] = [step(src, "open", dst) for _ in range(3)]
        if "workers" not in skip:
            for ctx in ("fork", "spawn"):
                out[f"workers_{ctx}"] = step(src, "workers", dst, ctx, str(args.workers), str(args.batches))
        if "read" not in skip:
            out["read_get_warm"] = step(src, "read", dst, "get", str(args.reads))
            for mode in ("get_many", "get_many_prefetch"):
                step(src, "read", dst, mode, str(args.reads))  # warm-up
                out[f"read_{mode}_warm"] = step(src, "read", dst, mode, str(args.reads))
            for mode in ("get_many", "get_many_prefetch", "get_many", "get_many_prefetch"):
                evict(files_under(dst))
                out.setdefault(f"read_{mode}_cold", []).append(step(src, "read", dst, mode, str(args.cold_reads)))
        shutil.rmtree(dst, ignore_errors=True)
        if "sharded" not in skip:
            sdst = dst[: -len(".lmdb")] + f"-sh{args.shards}"
            out["sharded_pack"] = timed_pack(src, tree, sdst, [*args.pack_args, "--shards", str(args.shards)])
            out["sharded_open"] = [step(src, "shard_open", sdst) for _ in range(3)]
            if "workers" not in skip:
                out["sharded_workers_spawn"] = step(src, "workers", sdst, "spawn", str(args.workers), str(args.batches))
            shutil.rmtree(sdst, ignore_errors=True)
        res["steps"][label] = out
    return res


# -- the report ----------------------------------------------------------------------------
def _mb(x: float) -> str:
    return f"{x / 1e6:,.0f} MB"


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def table(res: dict[str, Any]) -> str:
    n = res["n"]
    labels = list(res["steps"]) or list(res["pack"])
    rows: list[tuple[str, list[str]]] = []
    tar = res["tar"]
    tar_cold, tar_warm = _med(tar["tar_cold"]), _med(tar["tar_warm"])

    def add(name: str, fn: Callable[[str], str]) -> None:
        cells = []
        for label in labels:
            try:
                cells.append(fn(label))
            except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError):
                cells.append("-")
        rows.append((name, cells))

    for mode, ref in (("cold", tar_cold), ("warm", tar_warm)):
        add(
            f"pack {mode} (s, x tar|cat)",
            lambda lb, mode=mode, ref=ref: (
                f"{_med([p['seconds'] for p in res['pack'][lb][mode]]):.1f} "
                f"({_med([p['seconds'] for p in res['pack'][lb][mode]]) / ref:.2f}x)"
            ),
        )
    add(
        "pack peak Rss / Pss",
        lambda lb: "{} / {}".format(
            *(_mb(max(p[k] for m in ("cold", "warm") for p in res["pack"][lb][m])) for k in ("peak_rss", "peak_pss"))
        ),
    )
    add(
        "pack writer Rss / reader private",
        lambda lb: "{} / {}".format(
            _mb(max(p["peak_writer_rss"] for m in ("cold", "warm") for p in res["pack"][lb][m])),
            _mb(max(p["peak_reader_private"] for m in ("cold", "warm") for p in res["pack"][lb][m])),
        ),
    )
    add(
        "pack disk peak / final",
        lambda lb: "{} / {} ({:.2f}x)".format(
            _mb(max(p["disk_peak"] for p in res["pack"][lb]["warm"])),
            _mb(res["pack"][lb]["warm"][-1]["pack_bytes"]),
            max(p["disk_peak"] for p in res["pack"][lb]["warm"]) / res["pack"][lb]["warm"][-1]["pack_bytes"],
        ),
    )
    add(
        "map growths / compacted",
        lambda lb: "{} / {}".format(
            res["pack"][lb]["warm"][-1]["map_growths"], res["pack"][lb]["warm"][-1]["compacted"]
        ),
    )
    add("open (ms)", lambda lb: f"{1e3 * _med([o['seconds'] for o in res['steps'][lb]['open']]):.1f}")
    add(
        "open tracemalloc peak / RSS +",
        lambda lb: "{} / {}".format(
            _mb(_med([o["tracemalloc_peak"] for o in res["steps"][lb]["open"]])),
            _mb(_med([o["rss_delta"] for o in res["steps"][lb]["open"]])),
        ),
    )
    # Private_Dirty is the worker's own heap; Private_Clean is mostly pages of
    # data.mdb that only this worker has mapped (page cache, reclaimable).
    for ctx in ("fork", "spawn"):
        add(
            f"worker private dirty / all ({ctx})",
            lambda lb, ctx=ctx: (
                " ".join(
                    f"{d / 1e6:.0f}/{a / 1e6:.0f}"
                    for d, a in zip(
                        res["steps"][lb][f"workers_{ctx}"]["private_dirty"],
                        res["steps"][lb][f"workers_{ctx}"]["private"],
                    )
                )
                + " MB"
            ),
        )
    add("random get warm (us/rec)", lambda lb: f"{res['steps'][lb]['read_get_warm']['us_per_record']:.1f}")
    for temp in ("warm", "cold"):
        for mode in ("get_many", "get_many_prefetch"):

            def cell(lb: str, key: str = f"read_{mode}_{temp}") -> str:
                v = res["steps"][lb][key]
                v = v if isinstance(v, list) else [v]
                return f"{_med([x['us_per_record'] for x in v]):.1f}"

            add(f"{mode} 256 {temp} (us/rec)", cell)
    add(
        "sharded pack (s) / peak Rss",
        lambda lb: "{:.1f} / {}".format(
            res["steps"][lb]["sharded_pack"]["seconds"], _mb(res["steps"][lb]["sharded_pack"]["peak_rss"])
        ),
    )
    add(
        "sharded open (ms)",
        lambda lb: f"{1e3 * _med([o['open_seconds'] for o in res['steps'][lb]['sharded_open']]):.1f}",
    )
    add(
        "shard first open mean/max (ms)",
        lambda lb: "{:.2f} / {:.2f}".format(
            1e3 * _med([statistics.mean(o["shard_first_open"]) for o in res["steps"][lb]["sharded_open"]]),
            1e3 * _med([max(o["shard_first_open"]) for o in res["steps"][lb]["sharded_open"]]),
        ),
    )
    add(
        "sharded worker private dirty / all (spawn)",
        lambda lb: (
            " ".join(
                f"{d / 1e6:.0f}/{a / 1e6:.0f}"
                for d, a in zip(
                    res["steps"][lb]["sharded_workers_spawn"]["private_dirty"],
                    res["steps"][lb]["sharded_workers_spawn"]["private"],
                )
            )
            + " MB"
        ),
    )
    width = max(len(r[0]) for r in rows) + 2
    colw = [max(len(lb), *(len(r[1][i]) for r in rows)) + 2 for i, lb in enumerate(labels)]
    lines = [
        f"N = {n:,} files, {res['tree_bytes'] / 1e9:.2f} GB ({res['tree_allocated'] / 1e9:.2f} GB on disk); "
        f"tar|cat cold {tar_cold:.1f} s, warm {tar_warm:.1f} s; "
        f"tar to /dev/null (reads no file data) cold {_med(tar['tar_null_cold']):.1f} s, "
        f"warm {_med(tar['tar_null_warm']):.1f} s",
        "".ljust(width) + "".join(lb.rjust(w) for lb, w in zip(labels, colw)),
    ]
    for name, cells in rows:
        lines.append(name.ljust(width) + "".join(c.rjust(w) for c, w in zip(cells, colw)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_step":
        print(json.dumps(STEPS[argv[1]](*argv[2:])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10k,100k,1.28M", help=f"comma-separated, of {', '.join(SIZES)} or numbers")
    parser.add_argument(
        "--src", action="append", help="an lmdbfolder checkout to measure (repeatable; default: this one)"
    )
    parser.add_argument(
        "--data",
        default=DEFAULT_DATA,
        help=f"trees go here, kept for the next run (default {DEFAULT_DATA}); "
        "packs go to a new folder inside it, removed at the end",
    )
    parser.add_argument("--keep", action="store_true", help="keep the folder of packs (its path is printed)")
    parser.add_argument("--repeat", type=int, default=2, help="rounds of cold+warm pack and tar")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    parser.add_argument("--batches", type=int, default=100, help="batches read before measuring worker memory")
    parser.add_argument("--reads", type=int, default=100_000, help="random reads for the warm read steps")
    parser.add_argument("--cold-reads", type=int, default=5120, help="random reads for the cold read steps")
    parser.add_argument("--pack-args", default="", help="extra `lmdbfolder pack` arguments (one string)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["tar", "pack", "open", "workers", "read", "sharded"])
    parser.add_argument("--json", help="JSON output path (default: benchmarks/results/scale-<time>.json)")
    args = parser.parse_args(argv)
    args.pack_args = args.pack_args.split()
    srcs = [os.path.abspath(s) for s in (args.src or [os.path.dirname(HERE)])]
    sizes = [SIZES.get(s) or int(float(s)) for s in args.sizes.split(",")]
    results = {"started": _dt.datetime.now().isoformat(timespec="seconds"), "srcs": srcs, "sizes": []}
    path = args.json or os.path.join(HERE, "results", f"scale-{_dt.datetime.now():%Y%m%d-%H%M%S}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with scratch(args.data, "packs-", keep=args.keep) as work:
        for n in sizes:
            res = run_size(args, n, srcs, work)
            results["sizes"].append(res)
            print(table(res), flush=True)
            print(flush=True)
            with open(path, "w") as f:
                json.dump(results, f, indent=1)
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How far threads mode can scale on this machine, and how much of that it gets.

Usage:
    python benchmarks/bench_threads.py PACK [--n 2] [--rounds 3] [--images 3000] [--warmup 640] [--resize native]

Three ways to run the batch path of ``LMDBFolder(PACK)`` with lmdbfolder's fast
settings (``fused.RandomResizedCrop(224, resize=RESIZE, output="tensor")`` +
``RandomHorizontalFlip()``, ``DataLoader(batch_size=64, shuffle=True,
num_workers=0, collate_fn=collate)``: the threads-mode row of
``bench_peers.py``), alternated, each run in a fresh interpreter:

* ``one``: ``threads=1``, one process;
* ``threads``: ``threads=N``, one process (threads mode);
* ``procs``: N processes with ``threads=1`` (and torch on one thread, as in a
  DataLoader worker) at once. Each waits after its
  warm-up for a start time the driver gives, so their timed windows coincide;
  their img/s is every image over the longest window.

``procs / one`` is what N cores give this work when the N share no GIL and no
main thread: the most threads mode could reach here (the CPUs' shared caches
and memory bandwidth, and the VM, are in it). ``threads / one`` is what threads
mode gets; ``threads / procs`` the part of that ceiling it keeps. A run during
which other processes used more than ``--max-other`` cores (from /proc/stat,
less the runs' own CPU) is retried, then dropped, and so is a ``procs`` run
one of whose processes finished its warm-up after the common start (raise
``--settle``); each cell is the median of the kept runs. CPU ms per image is the runs' own CPU (all threads) per image.

Prints a table; writes JSON to benchmarks/results/ (and --json PATH).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "peers"))
sys.path.insert(0, HERE)
from bench_peers import wait_for_quiet  # noqa: E402
from contestants import SIZE, dataloader, epochs, machine_busy_seconds  # noqa: E402

KINDS = ("one", "threads", "procs")


def child(
    pack: str,
    threads: int,
    images: int,
    warmup: int,
    batch: int,
    seed: int,
    start_at: float,
    torch_threads: int,
    resize: str = "native",
) -> dict[str, Any]:
    """One timed run in this process: warm up, wait for ``start_at`` (epoch seconds;
    0: no wait), then time ``images`` images of whole batches."""
    import torch
    from torchvision import transforms as T

    from lmdbfolder import fused
    from lmdbfolder.torch import LMDBFolder, collate

    if torch_threads:
        torch.set_num_threads(torch_threads)
    torch.manual_seed(seed)
    tf = T.Compose([fused.RandomResizedCrop(SIZE, resize=resize, output="tensor"), T.RandomHorizontalFlip()])
    loader = dataloader(LMDBFolder(pack, transform=tf, threads=threads), 0, batch, collate_fn=collate)

    it = epochs(loader, pack)
    seen = 0
    while seen < warmup:
        seen += len(next(it)[0])
    late = max(0.0, time.time() - start_at) if start_at else 0.0
    time.sleep(max(0.0, start_at - time.time()))
    cpu0, (busy0, _) = time.process_time(), machine_busy_seconds()
    t0 = time.perf_counter()
    n = 0
    while n < images:
        x, _y = next(it)
        if x.dtype != torch.uint8 or tuple(x.shape[1:]) != (3, SIZE, SIZE):
            raise RuntimeError(f"a batch of {x.dtype} {tuple(x.shape)}, expected uint8 (B, 3, {SIZE}, {SIZE})")
        n += len(x)
    seconds = time.perf_counter() - t0
    busy1, _ = machine_busy_seconds()
    cpu = time.process_time() - cpu0
    return {"images": n, "seconds": seconds, "cpu": cpu, "busy": busy1 - busy0, "late": late}


def _launch(
    args: argparse.Namespace, threads: int, seed: int, start_at: float, torch_threads: int
) -> subprocess.Popen[bytes]:
    argv = [sys.executable, os.path.abspath(__file__), args.pack, "--child"]
    argv += ["--threads", str(threads), "--images", str(args.images), "--warmup", str(args.warmup)]
    argv += ["--batch", str(args.batch), "--seed", str(seed), "--start-at", repr(start_at)]
    argv += ["--torch-threads", str(torch_threads), "--resize", args.resize]
    env = dict(os.environ)
    src = os.path.join(REPO, "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.Popen(argv, stdout=subprocess.PIPE, env=env, cwd=REPO)


def _result(proc: subprocess.Popen[bytes], timeout: float) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=timeout)
    for line in reversed(out.decode(errors="replace").splitlines()):
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    raise RuntimeError(f"a run exited {proc.returncode} without a result (its stderr is above)")


def measure(args: argparse.Namespace, kind: str, seed: int) -> dict[str, Any]:
    """One run of ``kind``: img/s, CPU ms per image, and the cores other processes used."""
    n = args.n if kind == "procs" else 1
    threads = args.n if kind == "threads" else 1
    # Late enough for every child to import torch and warm up first (they wait for it).
    start_at = time.time() + args.settle if kind == "procs" else 0.0
    # The N processes run torch on one thread each, as DataLoader workers do: N
    # processes with torch's default (a thread per core) on N cores spin for each other.
    torch_threads = args.torch_threads or (1 if kind == "procs" else 0)
    procs = [_launch(args, threads, seed + i, start_at, torch_threads) for i in range(n)]
    runs = [_result(p, args.timeout) for p in procs]
    images = sum(r["images"] for r in runs)
    seconds = max(r["seconds"] for r in runs)
    cpu = sum(r["cpu"] for r in runs)
    # Each child's window saw all the children's CPU: what is left of its busy time
    # after theirs is the rest of the machine (the windows coincide).
    other = max(max(0.0, r["busy"] - cpu * r["seconds"] / seconds) / r["seconds"] for r in runs)
    return {
        "img_s": images / seconds,
        "cpu_ms_per_img": 1000 * cpu / images,
        "other_cores": other,
        # procs: how long after the common start the last warm-up ended (0: the windows
        # coincide); a late process measured partly alone, so such a run is retried.
        "late_s": max(r["late"] for r in runs),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the three kinds, alternated; print the table; write JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pack")
    parser.add_argument("--n", type=int, default=2, help="threads, and processes (default 2)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--images", type=int, default=3000, help="images timed per run (default 3000)")
    parser.add_argument("--warmup", type=int, default=640, help="images before timing starts (default 640)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-other", type=float, default=0.3, metavar="CORES")
    parser.add_argument("--retries", type=int, default=2, help="retries of a contended run (default 2)")
    parser.add_argument("--wait-quiet", type=float, default=120, metavar="S")
    parser.add_argument("--settle", type=float, default=30, help="procs: seconds from launch to the timed window")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="torch.set_num_threads in every run (default 0: leave it, but 1 in each of the N processes)",
    )
    parser.add_argument(
        "--resize",
        choices=("native", "opencv", "pil"),
        default="native",
        help="the fused crop's resize (default native: the fast settings)",
    )
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = child(
            args.pack,
            args.threads,
            args.images,
            args.warmup,
            args.batch,
            args.seed,
            args.start_at,
            args.torch_threads,
            args.resize,
        )
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    if args.n < 2:
        parser.error("--n must be at least 2")

    kept: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
    dropped: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
    for r in range(args.rounds):
        for kind in KINDS[r % 3 :] + KINDS[: r % 3]:
            for _attempt in range(1 + args.retries):
                wait_for_quiet(args.max_other, args.wait_quiet)
                res = measure(args, kind, seed=100 * r)
                contended = res["other_cores"] > args.max_other
                late = res["late_s"] > 0.1
                print(
                    f"round {r + 1}/{args.rounds}  {kind:8s} {res['img_s']:7,.0f} img/s  "
                    f"{res['cpu_ms_per_img']:.3f} CPU ms/img  others {res['other_cores']:.2f} cores"
                    + ("  (contended: retried)" if contended else "")
                    + (f"  (a process started {res['late_s']:.1f} s late: raise --settle; retried)" if late else ""),
                    file=sys.stderr,
                    flush=True,
                )
                (dropped if contended or late else kept)[kind].append(res)
                if not (contended or late):
                    break

    cells = {k: statistics.median(x["img_s"] for x in v) if v else None for k, v in kept.items()}
    cpu = {k: statistics.median(x["cpu_ms_per_img"] for x in v) if v else None for k, v in kept.items()}
    print(
        f"\n{os.cpu_count()} CPUs; N = {args.n}; batch {args.batch}; resize={args.resize!r}; "
        f"median of the uncontended runs of {args.rounds}"
    )
    print("| run | img/s | CPU ms/img | runs kept | x one |")
    print("|---|---|---|---|---|")
    labels = {"one": "threads=1", "threads": f"threads={args.n}", "procs": f"{args.n} processes, threads=1 each"}
    for k in KINDS:
        rate = "—" if cells[k] is None else f"{cells[k]:,.0f}"
        ms = "—" if cpu[k] is None else f"{cpu[k]:.3f}"
        ratio = "—" if cells[k] is None or not cells["one"] else f"{cells[k] / cells['one']:.2f}"
        print(f"| {labels[k]} | {rate} | {ms} | {len(kept[k])}/{args.rounds} | {ratio} |")
    if cells["threads"] and cells["procs"]:
        print(f"\nthreads mode keeps {cells['threads'] / cells['procs']:.1%} of what {args.n} processes get")
    results = {
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "pack": os.path.abspath(args.pack),
        "settings": {k: getattr(args, k) for k in ("n", "rounds", "images", "warmup", "batch", "max_other", "resize")},
        "cpus": os.cpu_count(),
        "median_img_s": cells,
        "median_cpu_ms_per_img": cpu,
        "kept": kept,
        "dropped": dropped,
    }
    out_dir = os.path.join(HERE, "results")
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, "threads-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S") + ".json")]
    paths += [args.json] if args.json else []
    for path in paths:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    print("JSON: " + " and ".join(paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""lmdbfolder against its peers (FFCV, DALI, SPDL, LitData, WebDataset) on one tree.

Usage:
    bash benchmarks/peers/install.sh                       # once: the peers venv
    python benchmarks/bench_peers.py --make-tree 10000     # the full run (issue 14)
    python benchmarks/bench_peers.py --tree DIR --rounds 1 --images 256 --warmup 128   # a smoke run

Same tree, same work for everyone: RandomResizedCrop(224) (torchvision's scale
and ratio) + horizontal flip -> uint8 CHW tensors, batch 64, shuffled; W
DataLoader workers (or the peer's own threads, see contestants.py) for each W in
--workers; page cache warm (every file of the format is read just before each
run); after --warmup images, --images images are timed; each (contestant,
workers) cell is the median of --rounds rounds, and the order of the
contestants rotates from round to round.

Each contestant runs in a subprocess of its own (benchmarks/peers/contestants.py)
with the interpreter it needs: the lmdbfolder rows with --lmdbfolder-python
(default: this interpreter), the peers with --peers-python (default: the venv
that install.sh makes, benchmarks/.peers-venv), and ImageFolder and the blog
recipe with the one --baseline-python names. Both get PYTHONPATH=<this
checkout>/src, so the lmdbfolder measured is this checkout's.

Formats (packs, .beton files, shards) are written once under --work and reused
by later runs (--rebuild writes them again); their write time and bytes per
image are in the table. A contestant that cannot run (not installed, not
supported by this lmdbfolder, failed) stays in the table with the reason.

The tree: --tree DIR uses an ImageFolder tree of JPEGs; --make-tree N makes
(or finishes) a photo-like tree of N images under --work with
benchmarks/photolike.py (real photos; see there), and prints its stats.

Results: a Markdown table on stdout, and JSON in benchmarks/results/ (and at
--json PATH).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RUNNER = os.path.join(HERE, "peers", "contestants.py")
DEFAULT_PEERS_VENV = os.path.join(HERE, ".peers-venv")
DEFAULT_WORK = os.path.join(HERE, ".peers-work")

sys.path.insert(0, os.path.join(HERE, "peers"))
from contestants import BY_NAME, CONTESTANTS, Contestant  # noqa: E402


def _interpreter(c: Contestant, args: argparse.Namespace) -> str:
    env = args.baseline_python if c.env == "baseline" else c.env
    return args.lmdbfolder_python if env == "lmdbfolder" else args.peers_python


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    src = os.path.join(REPO, "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TQDM_DISABLE", "1")
    return env


def _call(
    python: str, cmd: list[str], log: str, timeout: float, *, tree: str | None = None, work: str | None = None
) -> dict[str, Any]:
    """Run contestants.py in ``python``; return its RESULT, or {"ok": False, "error": ...}."""
    argv = [python, RUNNER, *cmd]
    if tree:
        argv += ["--tree", tree]
    if work:
        argv += ["--work", work]
    os.makedirs(os.path.dirname(log), exist_ok=True)
    with open(log, "ab") as f:
        f.write(("\n$ " + " ".join(argv) + "\n").encode())
        f.flush()
        try:
            proc = subprocess.run(
                argv, stdout=subprocess.PIPE, stderr=f, env=_child_env(), timeout=timeout, cwd=REPO, check=False
            )
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"timed out after {timeout:.0f} s (log: {log})"}
        except OSError as exc:
            return {"ok": False, "error": f"cannot start {python}: {exc}"}
        out = proc.stdout.decode(errors="replace")
        f.write(out.encode())
    for line in reversed(out.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    with open(log, "rb") as f:
        tail = f.read()[-4000:].decode(errors="replace").strip().splitlines()
    last = [ln for ln in tail if ln.strip()][-3:]
    return {"ok": False, "error": f"exit {proc.returncode}: " + " | ".join(last) + f" (log: {log})"}


def _install_reasons(peers_python: str) -> dict[str, str]:
    """Why install.sh could not install a peer, from its peers-install.json."""
    venv = os.path.dirname(os.path.dirname(os.path.abspath(peers_python)))
    path = os.path.join(venv, "peers-install.json")
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError):
        return {}
    return {k: v.get("detail", "") for k, v in report.items() if v.get("status") != "ok"}


_INSTALL_STEP = {"ffcv-full": "ffcv", "ffcv-256": "ffcv", "dali": "dali", "spdl": "spdl"}


def _warm(path: str) -> None:
    """Read every file under ``path`` once (page cache warm for the next run)."""
    files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    buf = bytearray(1 << 20)
    for p in files:
        try:
            with open(p, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
        except OSError:
            pass


def _busy() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def other_load(seconds: float = 1.0) -> float:
    """Cores the machine's processes used over the next ``seconds`` (this driver sleeps)."""
    b0, t0 = _busy(), time.perf_counter()
    time.sleep(seconds)
    return (_busy() - b0) / (time.perf_counter() - t0)


def wait_for_quiet(limit: float, patience: float) -> float:
    """Wait (up to ``patience`` seconds) until other processes use at most ``limit``
    cores over one second; return the seconds waited."""
    start = time.perf_counter()
    while other_load(1.0) > limit and time.perf_counter() - start < patience:
        pass
    return time.perf_counter() - start


def _fmt_rate(v: float | None) -> str:
    return "—" if v is None else f"{v:,.0f}"


def _fmt_ratio(v: float | None, base: float | None) -> str:
    return "—" if v is None or not base else f"{v / base:.2f}"


def _median(r: dict[str, Any], w: int, key: str) -> float | None:
    return ((r.get("cells", {}).get(str(w))) or {}).get(key)


def table(results: dict[str, Any], workers: list[int]) -> str:
    """The Markdown table of the issue, per worker count W: img/s, CPU ms per image,
    x ImageFolder and x FFCV of the same resolution (all medians of the uncontended
    runs of one alternated run, with how many were kept); the scaling from 1 to 2
    workers (or threads) when both were run; bytes/image and write time of the
    format, and the interpreter."""
    rows = results["contestants"]
    base = {w: _median(rows.get("imagefolder", {}), w, "median_img_s") for w in workers}
    scaling = 1 in workers and 2 in workers
    head = ["contender"]
    for w in workers:
        head += [f"W={w} img/s", "CPU ms/img", "× ImageFolder", "× FFCV", "runs kept"]
    if scaling:
        head.append("W=2 / W=1")
    head += ["bytes/img", "write s", "ran in"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    for c in CONTESTANTS:
        if c.name not in rows:
            continue
        r = rows[c.name]
        cells = [r["label"]]
        if r.get("error"):
            cells += ["—"] * (5 * len(workers) + scaling)
            notes.append(f"- {r['label']}: {r['error']}")
        else:
            for w in workers:
                cell = r["cells"].get(str(w)) or {}
                v = cell.get("median_img_s")
                cpu = cell.get("median_cpu_ms")
                vs = _median(rows.get(c.versus or "", {}), w, "median_img_s") if c.versus else None
                kept = f"{len(cell.get('runs', []))}/{cell.get('attempts', 0)}"
                cells += [_fmt_rate(v), "—" if cpu is None else f"{cpu:.3f}", _fmt_ratio(v, base[w])]
                cells += [_fmt_ratio(v, vs) if c.versus else "", kept]
                if cell.get("errors"):
                    notes.append(f"- {r['label']}, {w} workers: " + "; ".join(cell["errors"]))
                if cell.get("dropped"):
                    loads = ", ".join(f"{d['other_cores']:.2f}" for d in cell["dropped"])
                    count = len(cell["dropped"])
                    notes.append(f"- {r['label']}, W={w}: dropped {count} contended run(s) (other cores {loads})")
            if scaling:
                cells.append(_fmt_ratio(_median(r, 2, "median_img_s"), _median(r, 1, "median_img_s")))
        fmt = r.get("format") or {}
        bpi = fmt.get("bytes_per_image")
        cells.append("—" if bpi is None else f"{bpi / 1000:,.1f} KB")
        ws = fmt.get("write_s")
        cells.append("—" if ws is None else f"{ws:,.1f}")
        cells.append(r.get("interpreter_label", "—"))
        lines.append("| " + " | ".join(cells) + " |")
    out = "\n".join(lines)
    if notes:
        out += "\n\nNot measured / errors:\n" + "\n".join(notes)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the peers benchmark; print the table; write JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--tree", help="an existing ImageFolder tree of JPEGs")
    src.add_argument("--make-tree", type=int, metavar="N", help="make (or reuse) a photo-like tree of N images")
    parser.add_argument("--classes", type=int, default=100, help="classes of --make-tree (default 100)")
    parser.add_argument("--work", default=DEFAULT_WORK, help=f"where formats are written (default {DEFAULT_WORK})")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--images", type=int, default=3000, help="images timed per run (default 3000)")
    parser.add_argument("--warmup", type=int, default=640, help="images before timing starts (default 640)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[2, 1], help="W values (default 2 1: the W=2 / W=1 scaling)"
    )
    parser.add_argument(
        "--max-other",
        type=float,
        default=0.3,
        metavar="CORES",
        help="a run during which other processes used more CPU than this is retried, then dropped (default 0.3)",
    )
    parser.add_argument("--retries", type=int, default=2, help="retries of a contended run (default 2)")
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=120,
        metavar="S",
        help="before each run, wait up to S seconds for other processes to use less than --max-other (default 120)",
    )
    parser.add_argument("--only", nargs="+", metavar="NAME", help=f"contestants to run: {' '.join(BY_NAME)}")
    parser.add_argument("--skip", nargs="+", metavar="NAME", default=[])
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    parser.add_argument("--lmdbfolder-python", default=sys.executable)
    parser.add_argument("--peers-python", default=os.path.join(DEFAULT_PEERS_VENV, "bin", "python"))
    parser.add_argument(
        "--baseline-python",
        choices=("lmdbfolder", "peers"),
        default="lmdbfolder",
        help="which interpreter runs ImageFolder and the blog recipe (default lmdbfolder)",
    )
    parser.add_argument("--rebuild", action="store_true", help="write every format again")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per subprocess (default 900)")
    parser.add_argument(
        "--torch-threads", type=int, default=None, help="torch.set_num_threads in every run (default: leave it)"
    )
    args = parser.parse_args(argv)

    unknown = [n for n in (args.only or []) + args.skip if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown contestant(s) {unknown}; choose from {' '.join(BY_NAME)}")
    chosen = [c for c in CONTESTANTS if (not args.only or c.name in args.only) and c.name not in args.skip]
    work = os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)
    logs = os.path.join(work, "logs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))

    # The tree.
    tree_stats = None
    if args.make_tree:
        sys.path.insert(0, HERE)
        import photolike

        tree = os.path.join(work, f"photolike-{args.make_tree}-{args.classes}")
        photolike.make_tree(tree, photolike.PhotoSpec(images=args.make_tree, classes=args.classes))
        tree_stats = photolike.tree_stats(tree, sample=200)
        print(photolike.format_stats(tree_stats))
    else:
        tree = os.path.abspath(args.tree)
    # Formats depend on the tree: keep them per tree.
    fmt_root = os.path.join(work, "formats-" + os.path.basename(os.path.normpath(tree)))
    os.makedirs(fmt_root, exist_ok=True)

    results: dict[str, Any] = {
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "tree": tree,
        "tree_stats": tree_stats,
        "settings": {
            k: getattr(args, k)
            for k in (
                "rounds",
                "images",
                "warmup",
                "batch",
                "workers",
                "torch_threads",
                "baseline_python",
                "max_other",
                "retries",
            )
        },
        "interpreters": {"lmdbfolder": args.lmdbfolder_python, "peers": args.peers_python},
        "cpus": os.cpu_count(),
        "contestants": {},
    }
    rows = results["contestants"]
    reasons = _install_reasons(args.peers_python)

    # Probe and prepare, in table order.
    formats: dict[str, dict[str, Any]] = {}
    for c in chosen:
        python = _interpreter(c, args)
        env = args.baseline_python if c.env == "baseline" else c.env
        row: dict[str, Any] = {
            "label": c.label,
            "parallelism": c.parallelism,
            "interpreter": python,
            "interpreter_label": env + " venv",
            "cells": {},
        }
        rows[c.name] = row
        if not os.path.exists(python):
            row["error"] = f"not installed: no interpreter {python} (run benchmarks/peers/install.sh)"
            continue
        probe = _call(python, ["probe", c.name], os.path.join(logs, f"{c.name}.log"), 300)
        if not probe.get("ok"):
            step = _INSTALL_STEP.get(c.name, c.name)
            why = reasons.get(step) or probe.get("error", "?")
            row["error"] = ("" if probe.get("unavailable") and "not supported" in why else "not installed: ") + why
            continue
        row["versions"] = probe["versions"]
        if c.fmt not in formats:
            marker = os.path.join(fmt_root, c.fmt + ".json")
            out = os.path.join(fmt_root, c.fmt)
            if args.rebuild or not os.path.exists(marker):
                if os.path.exists(marker):
                    os.remove(marker)
                if os.path.isdir(out):
                    shutil.rmtree(out)
                print(f"preparing {c.fmt} ...", file=sys.stderr, flush=True)
                prep = _call(
                    python,
                    ["prepare", c.name],
                    os.path.join(logs, f"{c.name}.log"),
                    args.timeout,
                    tree=tree,
                    work=fmt_root,
                )
                if prep.get("ok"):
                    prep["bytes_per_image"] = prep["bytes"] / max(1, prep["count"])
                    prep["prepared_by"] = python
                    with open(marker, "w") as f:
                        json.dump(prep, f)
            else:
                with open(marker) as f:
                    prep = json.load(f)
                prep["reused"] = True
            formats[c.fmt] = prep
        prep = formats[c.fmt]
        row["format"] = {k: prep.get(k) for k in ("bytes", "count", "bytes_per_image", "write_s", "command", "reused")}
        if not prep.get("ok"):
            row["error"] = ("" if prep.get("unavailable") else "prepare failed: ") + prep.get("error", "?")

    runnable = [c for c in chosen if not rows[c.name].get("error")]
    print(
        f"tree {tree}; {len(runnable)} contestants; workers {args.workers}; {args.rounds} rounds of "
        f"{args.images} images after {args.warmup}",
        file=sys.stderr,
        flush=True,
    )
    print(f"before the run: other processes use {other_load(2.0):.2f} cores", file=sys.stderr, flush=True)
    raw: dict[tuple[str, int], list[dict[str, Any]]] = {}
    dropped: dict[tuple[str, int], list[dict[str, Any]]] = {}
    attempts: dict[tuple[str, int], int] = {}
    errors: dict[tuple[str, int], list[str]] = {}
    for r in range(args.rounds):
        k = r % max(1, len(runnable))
        order = runnable[k:] + runnable[:k]
        for c in order:
            for w in args.workers:
                path = tree if c.fmt == "tree" else os.path.join(fmt_root, c.fmt)
                cmd = [
                    "run",
                    c.name,
                    "--workers",
                    str(w),
                    "--images",
                    str(args.images),
                    "--warmup",
                    str(args.warmup),
                    "--batch",
                    str(args.batch),
                    "--seed",
                    str(r),
                ]
                if args.torch_threads is not None:
                    cmd += ["--torch-threads", str(args.torch_threads)]
                for attempt in range(1 + args.retries):
                    waited = wait_for_quiet(args.max_other, args.wait_quiet)
                    _warm(path)
                    res = _call(
                        _interpreter(c, args),
                        cmd,
                        os.path.join(logs, f"{c.name}.log"),
                        args.timeout,
                        tree=tree,
                        work=fmt_root,
                    )
                    attempts[(c.name, w)] = attempts.get((c.name, w), 0) + 1
                    if not res.get("ok"):
                        errors.setdefault((c.name, w), []).append(res.get("error", "?"))
                        msg = "FAILED: " + res.get("error", "?")
                        break
                    res["waited_s"] = waited
                    other = res.get("other_cores", 0.0)
                    msg = f"{res['img_s']:,.0f} img/s, {res['cpu_ms_per_img']:.3f} CPU ms/img, others {other:.2f} cores"
                    if other <= args.max_other:
                        raw.setdefault((c.name, w), []).append(res)
                        break
                    dropped.setdefault((c.name, w), []).append(res)
                    msg += " > " + f"{args.max_other} : " + ("retried" if attempt < args.retries else "dropped")
                    print(f"round {r + 1}/{args.rounds}  {c.name:<26} W={w}  {msg}", file=sys.stderr, flush=True)
                    msg = ""
                if msg:
                    print(f"round {r + 1}/{args.rounds}  {c.name:<26} W={w}  {msg}", file=sys.stderr, flush=True)

    for c in runnable:
        for w in args.workers:
            runs = raw.get((c.name, w), [])
            cell: dict[str, Any] = {"runs": runs, "attempts": attempts.get((c.name, w), 0)}
            if runs:
                cell["median_img_s"] = statistics.median(x["img_s"] for x in runs)
                cell["median_cpu_ms"] = statistics.median(x["cpu_ms_per_img"] for x in runs)
                cell["median_other_cores"] = statistics.median(x["other_cores"] for x in runs)
            if dropped.get((c.name, w)):
                cell["dropped"] = dropped[(c.name, w)]
            if errors.get((c.name, w)):
                cell["errors"] = errors[(c.name, w)]
            rows[c.name]["cells"][str(w)] = cell

    text = table(results, args.workers)
    print()
    print(
        f"{os.cpu_count()} CPUs; batch {args.batch}; RandomResizedCrop(224) + flip -> uint8 (N, 3, 224, 224); "
        f"median of the uncontended runs (other processes <= {args.max_other} cores) of {args.rounds} alternated "
        f"round(s), {args.images} images each after {args.warmup}; page cache warm; CPU = the run's process tree"
    )
    print(text)
    print("\nInterpreters: lmdbfolder venv = " + args.lmdbfolder_python + "; peers venv = " + args.peers_python)
    print("Parallelism per row: " + "; ".join(f"{c.name}: {c.parallelism}" for c in chosen))
    results["table"] = text
    results["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
    out_dir = os.path.join(HERE, "results")
    os.makedirs(out_dir, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    paths = [os.path.join(out_dir, f"peers-{stamp}.json")] + ([args.json] if args.json else [])
    for p in paths:
        with open(p, "w") as f:
            json.dump(results, f, indent=2)
    print(f"\nJSON: {' and '.join(paths)}; logs: {logs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

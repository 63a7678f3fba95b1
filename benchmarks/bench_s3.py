"""Object storage, measured against a local S3 API server (moto's, on 127.0.0.1, in its own process).

Two numbers from issue 25, each from the same run:

1. **Copy throughput**: ``lmdbfolder copy s3://... DST`` against the client
   library's own bulk download of the same objects (s3fs ``get(recursive=True)``),
   alternated ``--repeat`` times; median wall time of each, MB/s, the ratio
   (target: copy within 1.3x of the bulk download), and CPU ms per MB of this
   process (the client; the server's CPU is reported apart).
2. **Time to the first batch** of ``LMDBFolder("s3://...", cache_dir=...)``
   with a 2-worker DataLoader and ``ExactDistributedSampler(order="nodes",
   shards_at_once=1)``, against the time to download one shard (the same
   run); target: about one shard's time, far below the whole pack's.

The machine must be quiet for the wall times to mean anything: each row
records the CPU used by other processes during it (from /proc/stat, minus
this process and the server), as a share of all cores.

    python benchmarks/bench_s3.py                       # 8 shards of ~64 MB, 3 repeats
    python benchmarks/bench_s3.py --shards 4 --shard-mb 4 --repeat 1   # a smoke run

Its scratch (the pack, its copies, the cache) is a new folder made inside
``--workdir`` (default: the system's temporary folder), removed at the end
unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workdir import scratch  # noqa: E402

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def jiffies(pid: int | None = None) -> int:
    """CPU ticks used so far: the whole machine (busy only), or one process and its reaped children."""
    if pid is None:
        with open("/proc/stat") as f:
            values = [int(x) for x in f.readline().split()[1:]]
        return sum(values) - values[3] - values[4]  # minus idle and iowait
    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            with open(f"/proc/{p}/stat") as f:
                parts = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in parts[11:15])  # utime, stime, cutime, cstime
    return total


def descendants(pid: int) -> list[int]:
    """Processes started by ``pid`` (and theirs): the server may run in a child of its own."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found += kids
        frontier += kids
    return found


class Meter:
    """Wall time, this process's CPU, the server's CPU and the other processes' CPU of one measurement."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid

    def run(self, fn: Callable[[], Any]) -> dict[str, float]:
        hz = os.sysconf("SC_CLK_TCK")
        cores = os.cpu_count() or 1
        t_all, t_srv = jiffies(), jiffies(self.server_pid)
        cpu0, t0 = time.process_time(), time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        all_s = (jiffies() - t_all) / hz
        srv_s = (jiffies(self.server_pid) - t_srv) / hz
        own_s = cpu  # children (DataLoader workers) are not reaped yet: counted with the others, an overestimate
        other = max(0.0, all_s - srv_s - own_s)
        return {"wall_s": wall, "cpu_s": cpu, "server_cpu_s": srv_s, "other_cpu_pct": 100 * other / (wall * cores)}


def make_pack(root: Path, shards: int, shard_mb: float) -> Path:
    """A sharded pack of noise JPEGs (~100 KB each, incompressible): ``shards`` x ~``shard_mb`` MB."""
    from lmdbfolder.write.shards import pack_sharded

    rng = np.random.default_rng(0)
    per_shard = max(2, int(shard_mb * 1e6 / 100e3))
    tree = root / "tree"
    base = [Image.fromarray(rng.integers(0, 256, (200, 170, 3), dtype=np.uint8)) for _ in range(8)]
    for i in range(shards * per_shard):
        path = tree / f"c{i * 8 // (shards * per_shard)}" / f"{i:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        base[i % 8].rotate(i % 360).save(path, quality=95)
    out = root / "pack"
    pack_sharded(tree, out, shards=shards, progress=False)
    shutil.rmtree(tree)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--shard-mb", type=float, default=64.0, help="approximate size of each shard")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=8, help="lmdbfolder copy --jobs")
    ap.add_argument("--part-size", type=int, default=16 << 20, help="lmdbfolder copy --part-size, bytes")
    ap.add_argument(
        "--workdir", default=None, help="where the scratch folder (pack, copies) is made; default: the system's temp"
    )
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder (its path is printed)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    with scratch(args.workdir, "bench-s3-", keep=args.keep) as work:
        return run(args, Path(work))


def run(args: argparse.Namespace, work: Path) -> int:
    """The whole benchmark in ``work``, a new folder of its own."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )
    try:
        import s3fs

        from lmdbfolder import copy_pack
        from lmdbfolder.format import DATA_FILE
        from lmdbfolder.remote import Remote, download

        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        deadline = time.monotonic() + 60
        while True:  # the server answers when it is up (bounded)
            try:
                fs.mkdir("bench")
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        local = make_pack(work, args.shards, args.shard_mb)
        url = "s3://bench/train"
        copy_pack(local, url)
        index = json.loads((local / "index.json").read_text())
        total = sum((local / e["name"] / DATA_FILE).stat().st_size for e in index["shards"])
        meter = Meter(server.pid)
        rows: dict[str, list[dict[str, float]]] = {
            "bulk": [],
            "copy": [],
            "one_shard": [],
            "first_batch": [],
            "first_batch_local": [],
        }
        print(f"pack: {args.shards} shards, {total / 1e6:.1f} MB of data.mdb; server {endpoint} (pid {server.pid})")

        def bulk() -> None:
            out = work / "bulk"
            shutil.rmtree(out, ignore_errors=True)
            fs.get("bench/train", str(out), recursive=True)

        def copy() -> None:
            out = work / "copy"
            shutil.rmtree(out, ignore_errors=True)
            copy_pack(url, out, jobs=args.jobs, part_size=args.part_size)

        def one_shard() -> None:
            out = work / "one.mdb"
            if out.exists():
                out.unlink()
            name = index["shards"][0]["name"]
            download(Remote(f"{url}/{name}/{DATA_FILE}"), str(out), part_size=args.part_size, jobs=args.jobs)

        import torch.utils.data
        from torchvision import transforms as T

        from lmdbfolder.sampler import ExactDistributedSampler
        from lmdbfolder.torch import LMDBFolder

        def first_batch_of(root: Any, **kw: Any) -> Callable[[], None]:
            def run() -> None:
                cache = work / "cache"
                shutil.rmtree(cache, ignore_errors=True)
                tf = T.Compose([T.RandomResizedCrop(128), T.PILToTensor()])
                ds = LMDBFolder(root, transform=tf, **kw)
                sampler = ExactDistributedSampler(ds, 1, 0, seed=0, order="nodes", nodes=1, shards_at_once=1)
                loader = torch.utils.data.DataLoader(ds, batch_size=32, sampler=sampler, num_workers=2)
                batches = iter(loader)
                next(batches)
                del batches  # stops the workers (and the rest of the epoch)

            return run

        first_batch = first_batch_of(url, cache_dir=work / "cache")
        first_batch_local = first_batch_of(local)
        first_batch_local()  # imports, decoder probes: once, outside the measurements

        for r in range(args.repeat):
            order = [("bulk", bulk), ("copy", copy)]
            for name, fn in order if r % 2 == 0 else order[::-1]:
                rows[name].append(meter.run(fn))
            rows["one_shard"].append(meter.run(one_shard))
            rows["first_batch_local"].append(meter.run(first_batch_local))
            rows["first_batch"].append(meter.run(first_batch))

        def med(name: str, key: str) -> float:
            return statistics.median(row[key] for row in rows[name])

        print(f"{'what':<18}{'wall s':>9}{'MB/s':>9}{'CPU ms/MB':>11}{'server CPU s':>14}{'others CPU %':>14}")
        for name in ("bulk", "copy", "one_shard", "first_batch_local", "first_batch"):
            size = total if name in ("bulk", "copy") else total / args.shards
            wall = med(name, "wall_s")
            print(
                f"{name:<18}{wall:>9.2f}{size / 1e6 / wall:>9.1f}{1000 * med(name, 'cpu_s') / (size / 1e6):>11.2f}"
                f"{med(name, 'server_cpu_s'):>14.2f}{max(r['other_cpu_pct'] for r in rows[name]):>13.0f}%"
            )
        ratio_copy = med("copy", "wall_s") / med("bulk", "wall_s")
        # The loader's own start-up (worker processes, the first decodes) is the local pack's first batch.
        ratio_first = (med("first_batch", "wall_s") - med("first_batch_local", "wall_s")) / med("one_shard", "wall_s")
        whole = med("copy", "wall_s") / med("one_shard", "wall_s")
        print(f"copy / bulk download: {ratio_copy:.2f}x (target <= 1.3x)")
        print(
            f"first batch (minus the local pack's) / one shard's download: {ratio_first:.2f}x "
            f"(the whole pack takes {whole:.1f}x one shard's time)"
        )
        summary = {"rows": rows, "copy_over_bulk": ratio_copy, "first_batch_over_one_shard": ratio_first}
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=1))
    finally:
        server.terminate()
        server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())

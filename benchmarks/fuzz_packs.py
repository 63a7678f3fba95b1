"""Fuzz lmdbfolder's read paths with damaged copies of real packs (issue 15).

Usage:
    python benchmarks/fuzz_packs.py [--trials 1000] [--seed 0] [--jobs 2] [--json out.json]

It builds, under a temporary folder (``--work``), a small mixed JPEG/PNG pack
and a raw pack with ``lmdbfolder.pack``, and a recipe-style LMDB (pickled
``(image_bytes, label)`` values, ``__keys__``, ``__len__``). Each trial takes
one of them, damages a copy (seeded) in one way, and runs every read path on
it, each in its own forked child process so that signals, tracebacks and hangs
are seen (the children of the paths that need torch are forked by a separate
process that imported it, ``TorchRunner``: forking from a process with torch
imported costs 4x more):

* packs: ``reader`` (``Reader.get`` of every index, ``verify_checksums=True``),
  ``dataset`` (``LMDBFolder[i]``, checksums on), ``loader`` (a DataLoader with
  2 workers, batches of 4), ``verify`` (``lmdbfolder verify --json``),
  ``info`` (``lmdbfolder info --json``) and ``copy`` (``lmdbfolder copy``;
  it must end with a copy or a clear error, nothing else is compared);
* recipe LMDBs: ``import`` (``lmdbfolder import OLD NEW``), then the new pack read back.

Damage kinds: ``bitflip`` (one bit anywhere), ``byterange`` (1-512 bytes
overwritten, random or zero), ``btree`` (one bit of a branch/leaf page header,
node pointer, node size, flags, key size or key), ``ovsize`` (one bit of a
large value's size in its leaf node), ``ovpgno`` (one bit of its overflow
page number), ``ovheader`` (one bit of an overflow page header), ``tables``
(one bit inside the manifest, label, path or skipped table or ``__check__``;
``__keys__``/``__len__`` for recipes), ``meta`` (one bit of an LMDB meta
page), ``truncate``.

Outcomes per (trial, path): ``identical`` (ran through, equal to the
original), ``clear-error`` (an lmdbfolder error; for verify: problems
reported), ``exception`` (any other exception: a traceback, or a raw
``lmdb.Error`` without index or path), ``SIG*`` (killed by that signal),
``hang`` (past the time limit), ``wrong`` (a sample or its label differs from
the original with checksums on, no error), ``wrong-meta`` (classes, labels or
paths differ, no error), ``verify-ok-on-damage`` (verify says OK but some
record or table differs or fails to read), ``accepted-damage`` (import only:
the recipe has no checksums, so damaged image bytes are imported as they are).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import pickle
import random
import re
import resource
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import lmdb
import numpy as np
from PIL import Image

from lmdbfolder.errors import LmdbFolderError
from lmdbfolder.format import CHECK_KEY, LABELS_KEY, META_KEY, PATHS_KEY, SKIPPED_KEY
from lmdbfolder.pagefile import F_BIGDATA, P_BRANCH, PageFile
from lmdbfolder.write.writer import pack

PACKS = ("mixed", "raw", "recipe")
KINDS = ("bitflip", "byterange", "btree", "ovsize", "ovpgno", "ovheader", "tables", "meta", "truncate")
PACK_PATHS = ("reader", "dataset", "loader", "verify", "info", "copy")
#: The paths a verify OK vouches for: it must not be OK when one of them is not identical.
VOUCHED = ("reader", "dataset", "loader", "info")
PATHS = PACK_PATHS + ("import",)
TABLE_KEYS = [META_KEY, LABELS_KEY, PATHS_KEY, CHECK_KEY, SKIPPED_KEY]
OUTCOMES = (
    "identical",
    "clear-error",
    "exception",
    "hang",
    "wrong",
    "wrong-meta",
    "verify-ok-on-damage",
    "accepted-damage",
)
#: Outcomes that issue 15 says must never happen (signals are added by name).
FAILURES = ("wrong", "verify-ok-on-damage")
TIMEOUTS = {"reader": 30.0, "dataset": 30.0, "loader": 90.0, "verify": 30.0, "info": 30.0, "copy": 30.0, "import": 60.0}
_LMDBFOLDER_ERRORS: set[str] = set()
#: Wall seconds spent in children, per read path (for the report).
_SECONDS: dict[str, float] = {}


def _digest(data: bytes | memoryview) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _image_digest(img: Image.Image) -> str:
    """The DataLoader transform: a digest of the decoded image (mode, size, pixels)."""
    return _digest(f"{img.mode}{img.size}".encode() + img.tobytes())


# -- the packs ------------------------------------------------------------------
def _save(img: Image.Image, path: str, fmt: str, **kw: Any) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    img.save(path, fmt, **kw)


def build_sources(work: str, seed: int = 0) -> dict[str, str]:
    """Generate the source trees, pack them, write the recipe LMDB; returns pack name -> directory."""
    rng = np.random.default_rng(seed)
    mixed = os.path.join(work, "src-mixed")
    # Sizes from ~500 bytes (values stored in the leaf page) to ~40 KB (overflow pages).
    for i in range(36):
        w, h = int(rng.integers(8, 120)), int(rng.integers(8, 100))
        img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        if i % 3 == 2:
            _save(
                img.convert("P", palette=Image.Palette.ADAPTIVE, colors=16), f"{mixed}/cls{i % 3}/p{i:03d}.png", "PNG"
            )
        elif i % 2:
            _save(img, f"{mixed}/cls{i % 3}/j{i:03d}.jpg", "JPEG", quality=90)
        else:
            _save(img, f"{mixed}/cls{i % 3}/n{i:03d}.png", "PNG")
    raw = os.path.join(work, "src-raw")
    # Many records of one size (one overflow page each: a misdirected page
    # number finds another record of exactly the same length) plus small ones.
    for i in range(30):
        w, h = (40, 30) if i % 3 else (14, 10)
        img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        _save(img, f"{raw}/c{i % 2}/r{i:03d}.png", "PNG")
    packs = {"mixed": os.path.join(work, "mixed.lmdb"), "raw": os.path.join(work, "raw.lmdb")}
    pack(mixed, packs["mixed"], progress=False, commit_every=8)
    pack(raw, packs["raw"], store="raw", progress=False, commit_every=8)
    packs["recipe"] = _write_recipe(mixed, os.path.join(work, "recipe.lmdb"))
    return packs


def _write_recipe(src: str, dst: str) -> str:
    """An LMDB as folder2lmdb and its forks write it: str(index) -> pickle((bytes, label))."""
    classes = sorted(os.listdir(src))
    items = [
        (os.path.join(src, c, f), k) for k, c in enumerate(classes) for f in sorted(os.listdir(os.path.join(src, c)))
    ]
    env = lmdb.open(dst, map_size=1 << 26, subdir=True)
    keys = []
    with env.begin(write=True) as txn:
        for i, (path, label) in enumerate(items):
            with open(path, "rb") as f:
                txn.put(str(i).encode(), pickle.dumps((f.read(), label), protocol=4))
            keys.append(str(i).encode())
        txn.put(b"__keys__", pickle.dumps(keys, protocol=4))
        txn.put(b"__len__", pickle.dumps(len(keys), protocol=4))
    env.close()
    return dst


@dataclass
class Layout:
    """Where things are in an intact data.mdb: what the targeted damage aims at."""

    size: int
    psize: int
    pages: list[tuple[int, int, list[tuple[int, bytes, int, int]]]]  # (pgno, kind, nodes)
    big: list[tuple[int, int]]  # (node offset, key size) of F_BIGDATA nodes
    tables: list[tuple[int, int]]  # (offset, size) of the metadata values


def layout_of(data_mdb: str, table_keys: list[bytes]) -> Layout:
    """Walk an intact data.mdb (without LMDB) and note its pages, large values and tables."""
    with PageFile(data_mdb) as pf:
        pages = [(pgno, kind, nodes) for pgno, _depth, kind, nodes in pf.pages()]
        big = [
            (off, len(key))
            for _, kind, nodes in pages
            if kind != P_BRANCH
            for off, key, _, fl in nodes
            if fl & F_BIGDATA
        ]
        tables = [loc for loc in (pf.locate(k) for k in table_keys) if loc is not None and loc[1]]
        return Layout(pf.size, pf.psize, pages, big, tables)


def damage(kind: str, data: bytearray, lay: Layout, rng: random.Random) -> tuple[bytearray, str]:
    """Damage ``data`` (a data.mdb) in place in one way; returns it and what was done."""

    def flip(off: int, bit: int) -> str:
        data[off] ^= 1 << bit
        return f"bit {bit} of byte {off}"

    if kind == "bitflip":
        return data, flip(rng.randrange(len(data)), rng.randrange(8))
    if kind == "byterange":
        n = rng.choice((1, 2, 4, 8, 16, 64, 512))
        off = rng.randrange(len(data) - n)
        fill = bytes(n) if rng.random() < 0.5 else rng.randbytes(n)
        data[off : off + n] = fill
        return data, f"{n} bytes at {off} {'zeroed' if not any(fill) else 'randomised'}"
    if kind == "btree":
        branches = [p for p in lay.pages if p[1] == P_BRANCH]
        pgno, pkind, nodes = rng.choice(branches) if branches and rng.random() < 0.4 else rng.choice(lay.pages)
        base = pgno * lay.psize
        what = "branch" if pkind == P_BRANCH else "leaf"
        field = rng.choice(("pgno", "flags", "lower", "upper", "ptr", "node-size", "node-flags", "node-ksize", "key"))
        if field in ("pgno", "flags", "lower", "upper"):
            start, width = {"pgno": (0, 8), "flags": (10, 2), "lower": (12, 2), "upper": (14, 2)}[field]
            off = base + start + rng.randrange(width)
        elif field == "ptr":
            off = base + 16 + rng.randrange(2 * len(nodes))
        else:
            noff, key, _, _ = rng.choice(nodes)
            if field == "key" and not key:
                field = "node-ksize"
            spans = {"node-size": (0, 4), "node-flags": (4, 2), "node-ksize": (6, 2), "key": (8, len(key))}
            start, width = spans[field]
            off = noff + start + rng.randrange(width)
        return data, f"{what} page {pgno} {field}: " + flip(off, rng.randrange(8))
    if kind in ("ovsize", "ovpgno", "ovheader"):
        noff, ksize = rng.choice(lay.big)
        if kind == "ovsize":
            bit = rng.randrange(32)
            return data, f"size of node at {noff}: " + flip(noff + bit // 8, bit % 8)
        first = struct.unpack_from("<Q", data, noff + 8 + ksize)[0]
        if kind == "ovpgno":
            # Mostly bits that keep the number inside the file (another page).
            top = max(1, (len(data) // lay.psize).bit_length())
            bit = rng.randrange(top + 1) if rng.random() < 0.8 else rng.randrange(64)
            return data, f"overflow page number {first} of node at {noff}: " + flip(
                noff + 8 + ksize + bit // 8, bit % 8
            )
        off = first * lay.psize + rng.randrange(16)
        return data, f"header of overflow page {first}: " + flip(off, rng.randrange(8))
    if kind == "tables":
        off, size = rng.choice(lay.tables)
        return data, f"inside a table value ({size} bytes at {off}): " + flip(
            off + rng.randrange(size), rng.randrange(8)
        )
    if kind == "meta":
        page = rng.randrange(2)
        return data, f"meta page {page}: " + flip(page * lay.psize + rng.randrange(16 + 136), rng.randrange(8))
    if kind == "truncate":
        cut = rng.randrange(len(data))
        if rng.random() < 0.5:
            cut -= cut % lay.psize
        del data[cut:]
        return data, f"truncated to {cut} of {lay.size} bytes"
    raise ValueError(kind)


# -- the read paths (run in forked children) ---------------------------------------
def _error_entry(exc: BaseException) -> list[Any]:
    clear = isinstance(exc, LmdbFolderError)
    if not clear:  # DataLoader re-raises a worker's error as another type, naming the original
        m = re.search(r"Caught (\w+) in DataLoader worker", str(exc))
        clear = bool(m and m.group(1) in _LMDBFOLDER_ERRORS)
        m = re.search(r"killed by signal: ([\w -]+)", str(exc))
        if m:
            return ["signal", _signal_name(m.group(1).strip())]
    first = (str(exc).splitlines() or [""])[0][:300]
    return ["clear" if clear else "exception", type(exc).__name__, first]


def _signal_name(description: str) -> str:
    for sig in signal.Signals:
        if signal.strsignal(sig) == description:
            return sig.name
    return description


def path_reader(target: str, emit: Callable[[Any], None], _extra: str) -> None:
    from lmdbfolder.read.reader import Reader

    r = Reader(target, verify_checksums=True)
    emit(["meta", _digest(json.dumps([r.classes, r.class_to_idx, list(r.labels), r.paths()]).encode()), len(r)])
    for i in range(len(r)):
        try:
            rec = r.get(i)
            emit(["ok", i, _digest(rec.payload), rec.label, rec.encoding, rec.width, rec.height])
        except Exception as exc:
            emit(["err", i, *_error_entry(exc)])


def path_dataset(target: str, emit: Callable[[Any], None], _extra: str) -> None:
    from lmdbfolder.torch import LMDBFolder

    ds = LMDBFolder(target, verify_checksums=True)
    emit(["meta", _digest(json.dumps([ds.classes, ds.class_to_idx, ds.targets]).encode()), len(ds)])
    for i in range(len(ds)):
        try:
            img, target_ = ds[i]
            emit(["ok", i, _image_digest(img), target_])
        except Exception as exc:
            emit(["err", i, *_error_entry(exc)])


def path_loader(target: str, emit: Callable[[Any], None], _extra: str) -> None:
    import torch
    from torch.utils.data import DataLoader

    from lmdbfolder.torch import LMDBFolder

    ds = LMDBFolder(target, verify_checksums=True, transform=_image_digest)
    emit(["meta", _digest(json.dumps([ds.classes, ds.class_to_idx, ds.targets]).encode()), len(ds)])
    i = 0
    batches = iter(DataLoader(ds, batch_size=4, num_workers=2, timeout=60))
    while True:
        try:
            digests, targets = next(batches)
        except StopIteration:
            return
        except Exception as exc:
            # torch's SIGCHLD handler would raise again while we look; the error
            # seen first ("exited unexpectedly", a reset connection) names no
            # signal, the worker's exit status does.
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            workers = getattr(batches, "_workers", [])
            # An error a worker raised arrives as such; anything else (a reset
            # connection, "exited unexpectedly") may be a worker still dying.
            symptom = _error_entry(exc)[0] != "clear"
            dead: list[int] = []
            for _ in range(10 if symptom else 1):
                dead = [w.exitcode for w in workers if w.exitcode is not None and w.exitcode < 0]
                if dead:
                    break
                time.sleep(0.1)
            if dead:
                emit(["fatal", "signal", signal.Signals(-dead[0]).name, str(exc)[:200]])
                return
            raise
        for d, t in zip(digests, torch.as_tensor(targets).tolist()):
            emit(["ok", i, d, t])
            i += 1


def _cli(argv: list[str]) -> tuple[int, str, str]:
    from lmdbfolder.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def path_verify(target: str, emit: Callable[[Any], None], _extra: str) -> None:
    rc, out, err = _cli(["verify", target, "--json", "--no-progress"])
    report = json.loads(out) if rc in (0, 1) and out.strip() else {}
    emit(["verify", rc, bool(report.get("ok")), len(report.get("problems", [])), (err.splitlines() or [""])[0][:300]])


def path_info(target: str, emit: Callable[[Any], None], _extra: str) -> None:
    rc, out, err = _cli(["info", target, "--json"])
    digest = ""
    if rc == 0:
        info = json.loads(out)
        for volatile in ("path", "size_on_disk"):
            info.pop(volatile, None)
        # The image sizes are a sample of record headers read without their
        # checksum (info stays quick on a cold pack; verify is the check): a
        # damaged record it met is reported, and the sample is not compared.
        sizes = info.pop("image_sizes", None) or {}
        if sizes.get("unreadable"):
            rc, err = 1, f"info: {sizes['unreadable']} sampled record(s) unreadable"
        digest = _digest(json.dumps(info, sort_keys=True).encode())
    emit(["info", rc, digest, (err.splitlines() or [""])[0][:300]])


def path_copy(target: str, emit: Callable[[Any], None], new: str) -> None:
    rc, _out, err = _cli(["copy", target, new, "--json"])
    emit(["copy", rc, (err.splitlines() or [""])[0][:300]])


def path_import(target: str, emit: Callable[[Any], None], new: str) -> None:
    from lmdbfolder.read.reader import Reader

    rc, _out, err = _cli(["import", target, new, "--json", "--no-progress"])
    emit(["import", rc, (err.splitlines() or [""])[0][:300]])
    if rc == 0:
        with Reader(new, verify_checksums=True) as r:
            emit(["meta", _digest(json.dumps([r.classes, list(r.labels), r.paths()]).encode()), len(r)])
            for i in range(len(r)):
                rec = r.get(i)
                emit(["ok", i, _digest(rec.payload), rec.label, rec.encoding, rec.width, rec.height])


PATH_FUNCS: dict[str, Callable[[str, Callable[[Any], None], str], None]] = {
    "reader": path_reader,
    "dataset": path_dataset,
    "loader": path_loader,
    "verify": path_verify,
    "info": path_info,
    "copy": path_copy,
    "import": path_import,
}


# -- running children ------------------------------------------------------------
@dataclass
class Job:
    key: tuple[int, str]
    path: str
    target: str
    out: str
    extra: str = ""
    pid: int = 0
    started: float = 0.0


def _child(job: Job, mem_limit: int) -> None:
    os.setpgid(0, 0)  # its own process group: a hang is killed with its DataLoader workers
    if mem_limit:
        resource.setrlimit(resource.RLIMIT_AS, (mem_limit, mem_limit))
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)  # C-level messages (LMDB's assert text) are in the exit status anyway
    with open(job.out, "w", encoding="utf-8") as f:

        def emit(item: Any) -> None:
            f.write(json.dumps(item) + "\n")
            f.flush()

        try:
            if "torch" in sys.modules:  # the paths that need it run in the torch runner's children
                sys.modules["torch"].set_num_threads(1)
            PATH_FUNCS[job.path](job.target, emit, job.extra)
            emit(["done"])
        except BaseException as exc:  # everything a path can raise is an outcome to record
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # no second error from torch's handler
            emit(["fatal", *_error_entry(exc), traceback.format_exc(limit=3)[-600:]])
    os._exit(0)


def run_jobs(jobs: list[Job], n_jobs: int, mem_limit: int) -> dict[tuple[int, str], dict[str, Any]]:
    """Run every job in a forked child, ``n_jobs`` at a time; returns key -> {status, lines}."""
    results: dict[tuple[int, str], dict[str, Any]] = {}
    pending = list(reversed(jobs))
    running: dict[int, Job] = {}
    while pending or running:
        while pending and len(running) < n_jobs:
            job = pending.pop()
            job.started = time.monotonic()
            pid = os.fork()
            if pid == 0:
                try:
                    _child(job, mem_limit)
                finally:
                    os._exit(70)
            job.pid = pid
            running[pid] = job
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            for job in list(running.values()):
                if now - job.started > TIMEOUTS[job.path]:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(job.pid, signal.SIGKILL)
                    _, status = os.waitpid(job.pid, 0)
                    del running[job.pid]
                    results[job.key] = _collect(job, "hang")
            time.sleep(0.005)
            continue
        done = running.pop(pid, None)
        if done is None:
            continue
        job = done
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)  # leftover DataLoader workers
        if os.WIFSIGNALED(status):
            results[job.key] = _collect(job, signal.Signals(os.WTERMSIG(status)).name)
        else:
            results[job.key] = _collect(
                job, "exited" if os.WEXITSTATUS(status) == 0 else f"exit {os.WEXITSTATUS(status)}"
            )
    return results


def _collect(job: Job, status: str) -> dict[str, Any]:
    seconds = time.monotonic() - job.started
    _SECONDS[job.path] = _SECONDS.get(job.path, 0.0) + seconds
    lines = []
    with contextlib.suppress(OSError), open(job.out, encoding="utf-8") as f:
        for line in f:
            with contextlib.suppress(json.JSONDecodeError):
                lines.append(json.loads(line))
    return {"status": status, "lines": lines, "seconds": seconds, "path": job.path}


#: The paths that need torch: their children are forked by the torch runner.
TORCH_PATHS = ("dataset", "loader")


class TorchRunner:
    """A child process that imports torch once and forks the children of the
    paths that need it. Forking a process that has torch imported costs about
    4x more (its page tables: 22 ms against 5 ms here), so every other child
    is forked from the torch-free parent. Jobs go in, and results come back,
    as one JSON line per batch."""

    def __init__(self) -> None:
        req_r, req_w = os.pipe()
        res_r, res_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(req_w)
            os.close(res_r)
            code = 0
            try:
                self._serve(req_r, res_w)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        os.close(req_r)
        os.close(res_w)
        self.requests = os.fdopen(req_w, "w", encoding="utf-8")
        self.replies = os.fdopen(res_r, "r", encoding="utf-8")

    @staticmethod
    def _serve(req_r: int, res_w: int) -> None:
        import torch
        import torch.utils.data  # noqa: F401

        import lmdbfolder.torch  # noqa: F401

        torch.set_num_threads(1)
        mem_limit = _memory_limit()
        with os.fdopen(req_r, "r", encoding="utf-8") as requests, os.fdopen(res_w, "w", encoding="utf-8") as replies:
            for line in requests:
                jobs = [Job(tuple(j[0]), j[1], j[2], j[3], j[4]) for j in json.loads(line)]  # type: ignore[arg-type]
                results = run_jobs(jobs, 1, mem_limit)
                replies.write(json.dumps([[list(k), v] for k, v in results.items()]) + "\n")
                replies.flush()

    def submit(self, jobs: list[Job]) -> None:
        self.requests.write(json.dumps([[list(j.key), j.path, j.target, j.out, j.extra] for j in jobs]) + "\n")
        self.requests.flush()

    def collect(self) -> dict[tuple[int, str], dict[str, Any]]:
        line = self.replies.readline()
        if not line:
            raise RuntimeError("the torch runner process died")
        out = {}
        for key, result in json.loads(line):
            job_key = (int(key[0]), str(key[1]))
            path = str(result.get("path"))
            _SECONDS[path] = _SECONDS.get(path, 0.0) + result.get("seconds", 0.0)
            out[job_key] = result
        return out

    def close(self) -> None:
        self.requests.close()
        self.replies.close()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


_RUNNER: TorchRunner | None = None


def run_split(jobs: list[Job], n_jobs: int, mem_limit: int) -> dict[tuple[int, str], dict[str, Any]]:
    """``run_jobs``, with the torch paths' jobs run by the torch runner meanwhile."""
    heavy = [j for j in jobs if j.path in TORCH_PATHS]
    light = [j for j in jobs if j.path not in TORCH_PATHS]
    global _RUNNER
    if heavy and _RUNNER is None:
        _RUNNER = TorchRunner()
    if heavy and _RUNNER is not None:
        _RUNNER.submit(heavy)
    results = run_jobs(light, max(1, n_jobs - 1) if heavy else n_jobs, mem_limit)
    if heavy and _RUNNER is not None:
        results.update(_RUNNER.collect())
    return results


# -- classification -----------------------------------------------------------------
def _records(lines: list[list[Any]]) -> tuple[Any, dict[int, list[Any]], list[Any] | None]:
    meta = next((ln for ln in lines if ln[0] == "meta"), None)
    per = {ln[1]: ln for ln in lines if ln[0] in ("ok", "err")}
    fatal = next((ln for ln in lines if ln[0] == "fatal"), None)
    return meta, per, fatal


def classify(path: str, got: dict[str, Any], ref: dict[str, Any]) -> tuple[str, str]:
    """(outcome, detail) of one path on one damaged copy, against the intact original's result."""
    status, lines = got["status"], got["lines"]
    if status == "hang":
        return "hang", ""
    if status.startswith("SIG"):
        return status, f"after {sum(1 for ln in lines if ln[0] in ('ok', 'err'))} records"
    if status != "exited":
        return "exception", status
    meta, per, fatal = _records(lines)
    if path == "copy":
        entry = next((ln for ln in lines if ln[0] == "copy"), None)
        if entry is None:
            return _fatal(fatal)
        return ("identical", "") if entry[1] == 0 else ("clear-error", entry[2])
    if path in ("verify", "info"):
        entry = next((ln for ln in lines if ln[0] == path), None)
        if entry is None:
            return _fatal(fatal)
        ref_entry = next(ln for ln in ref["lines"] if ln[0] == entry[0])
        if path == "info":
            if entry[1] != 0:
                return "clear-error", entry[3]
            return ("identical", "") if entry[2] == ref_entry[2] else ("wrong-meta", "info output differs")
        rc, ok = entry[1], entry[2]
        if rc == 0 and ok:
            return "identical", ""  # the caller turns it into verify-ok-on-damage when reads differ
        # A result line means the CLI handled it: an lmdbfolder error or problems found.
        return "clear-error", (f"{entry[3]} problems" if rc == 1 else entry[4])
    if path == "import":
        entry = next((ln for ln in lines if ln[0] == "import"), None)
        if entry is None:
            return _fatal(fatal)
        if entry[1] != 0:
            return "clear-error", entry[2]
        if fatal is not None:
            return _fatal(fatal)
    ref_meta, ref_per, _ = _records(ref["lines"])
    worst, detail = "identical", ""
    rank = {"identical": 0, "clear-error": 1, "exception": 2, "wrong-meta": 3, "wrong": 4}

    def note(outcome: str, why: str) -> None:
        nonlocal worst, detail
        if rank.get(outcome, 9) > rank.get(worst, 9):  # signals rank highest
            worst, detail = outcome, why

    if meta is None:
        return _fatal(fatal)
    if meta[1:] != ref_meta[1:]:
        note("wrong-meta", "classes, labels or paths differ")
    for i, want in ref_per.items():
        have = per.get(i)
        if have is None:
            if fatal is not None:
                outcome, why = _fatal(fatal)
                note(outcome, why)
            continue
        if have[0] == "err":
            note("clear-error" if have[2] == "clear" else "exception", f"{have[3]}: {have[4] if len(have) > 4 else ''}")
        elif have[2:] != want[2:]:
            note("wrong", f"index {i} differs from the original")
    if path == "import" and worst == "wrong":
        return "accepted-damage", detail
    return worst, detail


def _fatal(fatal: list[Any] | None) -> tuple[str, str]:
    if fatal is None:
        return "exception", "no result"
    if fatal[1] == "signal":
        return fatal[2], "a DataLoader worker"
    return ("clear-error" if fatal[1] == "clear" else "exception"), f"{fatal[2]}: {fatal[3]}"


# -- the campaign ------------------------------------------------------------------
@dataclass
class Trial:
    n: int
    pack: str
    kind: str
    what: str = ""
    outcomes: dict[str, tuple[str, str]] = field(default_factory=dict)


def plan(trials: int, seed: int, kinds: tuple[str, ...] = KINDS) -> list[Trial]:
    """The seeded list of trials: packs and kinds in rotation, so every pair gets its share."""
    rng = random.Random(seed)
    weights = (("mixed", 5), ("raw", 4), ("recipe", 2))
    cycle = [p for p, w in weights for _ in range(w)]
    out = []
    for n in range(trials):
        out.append(Trial(n, cycle[rng.randrange(len(cycle))], kinds[n % len(kinds)]))
    return out


def campaign(
    trials: int = 200,
    seed: int = 0,
    jobs: int = 2,
    work: str | None = None,
    paths: tuple[str, ...] = PATHS,
    loader_every: int = 1,
    kinds: tuple[str, ...] = KINDS,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Build the packs, run ``trials`` damaged copies through ``paths``; returns the results as a dict."""
    from lmdbfolder import errors

    _LMDBFOLDER_ERRORS.update(errors.__all__)
    own = work is None
    work = work or tempfile.mkdtemp(prefix="lmdbfolder-fuzz-")
    start = time.perf_counter()
    try:
        packs = _in_child(build_sources, work, seed)
        datas = {}
        for name, p in packs.items():
            with open(os.path.join(p, "data.mdb"), "rb") as f:
                datas[name] = f.read()
        layouts = {
            name: layout_of(
                os.path.join(p, "data.mdb"),
                [b"__keys__", b"__len__"] if name == "recipe" else TABLE_KEYS,
            )
            for name, p in packs.items()
        }
        mem_limit = _memory_limit()
        # The intact originals, through the same paths: the reference results.
        ref_jobs = []
        for name, p in packs.items():
            for path in ("import",) if name == "recipe" else PACK_PATHS:
                if path in paths:
                    ref_jobs.append(
                        Job(
                            (-1, f"{name}/{path}"),
                            path,
                            p,
                            f"{work}/ref-{name}-{path}.jsonl",
                            f"{work}/ref-{name}-{path}-new.lmdb",
                        )
                    )
        refs = run_split(ref_jobs, jobs, mem_limit)
        for (_, key), res in refs.items():
            if res["status"] != "exited" or not any(ln[0] == "done" for ln in res["lines"]):
                raise RuntimeError(f"the intact {key} did not read cleanly: {res}")
        plans = plan(trials, seed, kinds)
        rng = random.Random(seed + 1)
        batch: list[Trial] = []
        for k, trial in enumerate(plans):
            batch.append(trial)
            if len(batch) < max(4, jobs * 2) and k + 1 < len(plans):
                continue
            _run_batch(batch, packs, datas, layouts, refs, work, rng, jobs, mem_limit, paths, loader_every)
            if log is not None:
                log(f"{k + 1}/{len(plans)} trials, {time.perf_counter() - start:.0f} s")
            batch = []
    finally:
        global _RUNNER
        if _RUNNER is not None:
            _RUNNER.close()
            _RUNNER = None
        if own:
            shutil.rmtree(work, ignore_errors=True)
    return {
        "seed": seed,
        "trials": len(plans),
        "seconds": round(time.perf_counter() - start, 1),
        "lmdb": lmdb.__version__,
        "child_seconds": {k: round(v, 1) for k, v in _SECONDS.items()},
        "results": [
            {"n": t.n, "pack": t.pack, "kind": t.kind, "damage": t.what, "outcomes": t.outcomes} for t in plans
        ],
    }


def _run_batch(
    batch: list[Trial],
    packs: dict[str, str],
    datas: dict[str, bytes],
    layouts: dict[str, Layout],
    refs: dict[tuple[int, str], dict[str, Any]],
    work: str,
    rng: random.Random,
    jobs: int,
    mem_limit: int,
    paths: tuple[str, ...],
    loader_every: int,
) -> None:
    todo = []
    for trial in batch:
        data, trial.what = damage(trial.kind, bytearray(datas[trial.pack]), layouts[trial.pack], rng)
        copy = os.path.join(work, f"t{trial.n}", os.path.basename(packs[trial.pack]))
        os.makedirs(copy)
        with open(os.path.join(copy, "data.mdb"), "wb") as f:
            f.write(data)
        for path in ("import",) if trial.pack == "recipe" else PACK_PATHS:
            if path not in paths or (path == "loader" and trial.n % loader_every):
                continue
            todo.append(
                Job(
                    (trial.n, path), path, copy, f"{work}/t{trial.n}/{path}.jsonl", f"{work}/t{trial.n}/{path}-new.lmdb"
                )
            )
    results = run_split(todo, jobs, mem_limit)
    for trial in batch:
        for path in PATHS:
            got = results.get((trial.n, path))
            if got is not None:
                ref = refs[(-1, f"{trial.pack}/{path}")]
                trial.outcomes[path] = classify(path, got, ref)
        # verify is judged by the readers it vouches for.
        said = trial.outcomes.get("verify")
        if said is not None and said[0] == "identical":
            broken = [p for p in VOUCHED if trial.outcomes.get(p, ("identical",))[0] != "identical"]
            if broken:
                trial.outcomes["verify"] = ("verify-ok-on-damage", f"verify OK but {', '.join(broken)}: not identical")
        shutil.rmtree(os.path.join(work, f"t{trial.n}"), ignore_errors=True)


def _in_child(fn: Callable[..., Any], *args: Any) -> Any:
    # Packing starts reader processes and threads; doing it in a child keeps
    # the parent, which forks every trial's children, free of them.
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 0
        try:
            os.write(w, json.dumps(fn(*args)).encode())
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    if status != 0:
        raise RuntimeError(f"building the packs failed (status {status})")
    return json.loads(data)


def _memory_limit() -> int:
    # Children may allocate what a damaged header asks for: cap them at 4 GiB
    # above what the parent (with torch imported) already maps.
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    return vm + (4 << 30)


# -- reports --------------------------------------------------------------------------
def table(result: dict[str, Any]) -> str:
    """Outcomes by damage kind (rows) for each read path, as text."""
    lines = []
    rows = result["results"]
    for path in PATHS:
        counts: dict[str, Counter[str]] = {}
        for r in rows:
            if path in r["outcomes"]:
                counts.setdefault(r["kind"], Counter())[r["outcomes"][path][0]] += 1
        if not counts:
            continue
        seen = sorted(
            {o for c in counts.values() for o in c}, key=lambda o: (OUTCOMES.index(o) if o in OUTCOMES else 99, o)
        )
        lines.append(f"\n{path}: trials by damage kind and outcome")
        lines.append(f"{'kind':<10} {'n':>4} " + " ".join(f"{o:>{max(len(o), 5)}}" for o in seen))
        total: Counter[str] = Counter()
        for kind in KINDS:
            if kind in counts:
                c = counts[kind]
                total.update(c)
                lines.append(f"{kind:<10} {sum(c.values()):>4} " + " ".join(f"{c[o]:>{max(len(o), 5)}}" for o in seen))
        lines.append(f"{'all':<10} {sum(total.values()):>4} " + " ".join(f"{total[o]:>{max(len(o), 5)}}" for o in seen))
    return "\n".join(lines)


def failures(result: dict[str, Any]) -> dict[str, int]:
    """Counts of what issue 15 forbids: signal deaths, wrong samples, verify OK on damage, hangs."""
    c: Counter[str] = Counter()
    for r in result["results"]:
        for path, (outcome, _) in r["outcomes"].items():
            if outcome.startswith("SIG"):
                c[f"signal ({path})"] += 1
                c["signal"] += 1
            elif outcome in ("wrong", "verify-ok-on-damage", "hang", "wrong-meta", "exception"):
                c[outcome] += 1
    return dict(c)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="children at a time")
    parser.add_argument("--paths", default=",".join(PATHS), help="comma-separated read paths to run")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated damage kinds")
    parser.add_argument("--loader-every", type=int, default=1, help="run the DataLoader path on every k-th trial")
    parser.add_argument("--work", help="folder for the packs and copies (default: a temporary one, removed)")
    parser.add_argument("--json", metavar="FILE", help="write every trial's outcomes as JSON")
    parser.add_argument("--examples", type=int, default=3, help="damage examples to print per failure kind")
    args = parser.parse_args(argv)
    # Imported once here, so that every forked child starts warm (torch: in
    # the torch runner only, see TorchRunner).
    import lmdbfolder.cli  # noqa: F401
    import lmdbfolder.tools.copy  # noqa: F401
    import lmdbfolder.tools.importing  # noqa: F401
    import lmdbfolder.tools.info  # noqa: F401
    import lmdbfolder.tools.verify  # noqa: F401

    result = campaign(
        args.trials,
        args.seed,
        args.jobs,
        args.work,
        tuple(args.paths.split(",")),
        args.loader_every,
        tuple(args.kinds.split(",")),
        log=lambda msg: print(msg, file=sys.stderr, flush=True),
    )
    head = f"lmdbfolder fuzz: {result['trials']} trials, seed {result['seed']}, lmdb {result['lmdb']}"
    print(f"{head}, {result['seconds']} s")
    print(table(result))
    print("\nforbidden outcomes:", json.dumps(failures(result)))
    print("wall seconds in children by path:", json.dumps(result["child_seconds"]))
    shown: Counter[str] = Counter()
    for r in result["results"]:
        for path, (outcome, detail) in r["outcomes"].items():
            forbidden = outcome.startswith("SIG") or outcome in FAILURES + ("hang", "exception")
            if forbidden and shown[outcome] < args.examples:
                shown[outcome] += 1
                print(f"  e.g. {outcome} in {path}: {r['pack']} {r['kind']}: {r['damage']} ({detail})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

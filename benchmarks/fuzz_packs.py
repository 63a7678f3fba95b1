"""Fuzz lmdbfolder's read paths with damaged copies of real packs (issue 15).

Usage:
    python benchmarks/fuzz_packs.py [--trials 1000] [--seed 0] [--jobs 2] [--json out.json]
    python benchmarks/fuzz_packs.py --forge-tables [--trials 1000] [--seed 0] [--json out.json]

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

Forged packs (issue 22), ``--forge``: anyone who writes a pack can make every
checksum valid, so each trial rewrites one record of a copy of a pack of every
kind the readers route differently (``build_forge_source``: RGB, greyscale,
CMYK and progressive JPEGs of up to 260 x 200 pixels, PNGs, WebP, GIF, BMP)
as a stranger's writer could, every CRC recomputed (bound to its index and the
pack): its header (``header-size``, ``header-channels``, ``header-encoding``),
its payload with the header kept (``payload-bitflip``, ``payload-marker``: a
bit in the marker segments, ``payload-bytes``, ``payload-truncate``,
``payload-splice``), a JPEG's frame size (``payload-sof``: with the header
changed to agree or not; ``payload-bomb``: a frame of up to 65535 x 65535),
or another record's payload (``payload-swap``, the header kept or made to
agree). The truth is then the payload: ImageFolder's loader on those bytes
(torchvision's ``pil_loader``, and its transforms with the same seeds) is the
oracle, and the paths are ``forged`` (in one child: ``LMDBFolder[i]`` plain,
``crop`` one sample at a time and ``batch`` a whole batch with torchvision's
``RandomResizedCrop`` + flip + ``PILToTensor``, default decoder and region
decoding), ``loader`` (plain images through 2 DataLoader workers) and
``verify`` (``verify --decode --json``). Each must give the oracle's sample or
a clear error; a sample where ImageFolder raises, or other pixels, is
``wrong``; ``verify`` must not say OK unless every path gave the oracle's
samples.

Outcomes per (trial, path): ``identical`` (ran through, equal to the
original), ``clear-error`` (an lmdbfolder error; for verify: problems
reported), ``exception`` (any other exception: a traceback, or a raw
``lmdb.Error`` without index or path), ``SIG*`` (killed by that signal),
``hang`` (past the time limit), ``wrong`` (a sample or its label differs from
the original with checksums on, no error), ``wrong-meta`` (classes, labels or
paths differ, no error), ``verify-ok-on-damage`` (verify says OK but some
record or table differs or fails to read), ``accepted-damage`` (import only:
the recipe has no checksums, so damaged image bytes are imported as they are).

Forged tables (issue 34), ``--forge-tables``: each trial copies a small pack
that one ``pack --update`` made format 3 (``__order__``, ``next_record``,
``record_classes``, ``__stats__``, ``__history__``) and forges one of its
tables, every checksum valid (``TABLE_FORGE_KINDS``: ``__order__`` naming a
key twice, two entries swapped, a key beyond ``next_record``; ``next_record``
in use or 0; ``record_classes`` permuted or short; a ``__history__`` that is
not ours: not a list, junk, deep, or tens of MB; staging files planted in
``DST.update``: junk bytes, a foreign LMDB, a symbolic link out of the pack,
a FIFO; ``DST/lock.mdb`` a symbolic link out of the pack); changes the source
(a file added, one removed, one rewritten), then runs ``pack --update``,
``verify`` and a read of every sample, in one forked child with a time limit.
The oracle is the source as ImageFolder sees it (``write.sources.scan``: its
classes, paths and labels, and every file's bytes). Outcomes per trial:
``correct`` (the update ran, verify says OK, every sample is the source's),
``clear-error`` (the update, verify or a read refused with an lmdbfolder
error), ``wrong`` (a sample, label, path or class differs with no error),
``verify-ok-on-damage`` (verify OK, a read then fails), ``write-outside`` (a
file outside the pack's folders changed, or appeared beside them),
``exception`` (a traceback), ``hang`` (past the time limit), ``SIG*``.
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
#: ``--forge``: ways to rewrite one record with valid checksums (see the module docstring).
FORGE_KINDS = (
    "header-size",
    "header-channels",
    "header-encoding",
    "payload-bitflip",
    "payload-marker",
    "payload-bytes",
    "payload-truncate",
    "payload-splice",
    "payload-sof",
    "payload-bomb",
    "payload-swap",
)
#: The forged mode's paths: the three sample paths run in one child (``forged``).
FORGED_SUBPATHS = ("plain", "crop", "batch")
FORGED_PATHS = (*FORGED_SUBPATHS, "loader", "verify")
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
TIMEOUTS = {
    "reader": 30.0,
    "dataset": 30.0,
    "loader": 90.0,
    "verify": 30.0,
    "info": 30.0,
    "copy": 30.0,
    "import": 60.0,
    "forged": 90.0,
    "fverify": 60.0,
    "floader": 90.0,
}
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


# -- forged packs (--forge) ----------------------------------------------------------
def _sof_offset(payload: bytes | bytearray) -> int | None:
    """Offset of a JPEG's first SOFn marker (walking the segments), or None."""
    i = 2
    while i + 9 < len(payload):
        if payload[i] != 0xFF:
            return None
        marker = payload[i + 1]
        if marker == 0xFF:
            i += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):
            i += 2
            continue
        if marker in (0xD9, 0xDA):
            return None
        if marker in (0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF):
            return i
        i += 2 + struct.unpack_from(">H", payload, i + 2)[0]
    return None


def _other_size(rng: random.Random, size: int) -> int:
    choices = [size + 1, size - 1, size + 2, size + 8, size * 2, size // 2, rng.randrange(1, 4096), 0]
    return max(0, min(65535, rng.choice(choices)))


def forge(kind: str, pack_dir: str, rng: random.Random) -> str:
    """Rewrite one record of the pack at ``pack_dir`` in one way (``FORGE_KINDS``), every
    checksum valid; returns what was done."""
    from lmdbfolder.encodings import sniff
    from lmdbfolder.format import ENCODINGS, KEY, decode_record, encode_record, pack_binding
    from lmdbfolder.read.reader import Reader

    with Reader(pack_dir) as r:
        binding = pack_binding(r.meta)
        records = [(i, r.get(i)) for i in range(len(r))]
        heads = {i: (rec.label, rec.encoding, rec.width, rec.height, rec.channels) for i, rec in records}
        payloads = {i: bytes(rec.payload) for i, rec in records}
    jpegs = [i for i, h in heads.items() if h[1] == "jpeg"]
    wants_jpeg = kind in ("payload-sof", "payload-bomb", "payload-marker")
    index = rng.choice(jpegs if wants_jpeg and jpegs else list(heads))
    label, encoding, width, height, channels = heads[index]
    payload = bytearray(payloads[index])
    what = f"record {index} ({encoding} {width}x{height}x{channels}, {len(payload)} bytes): "
    if kind == "header-size":
        which = rng.choice(("width", "height", "both"))
        if which in ("width", "both"):
            width = _other_size(rng, width)
        if which in ("height", "both"):
            height = _other_size(rng, height)
        what += f"header size -> {width}x{height}"
    elif kind == "header-channels":
        channels = rng.choice([c for c in (0, 1, 2, 3, 4, 5, 255) if c != channels])
        what += f"header channels -> {channels}"
    elif kind == "header-encoding":
        encoding = rng.choice([e for e in ENCODINGS.values() if e != encoding])
        what += f"header encoding -> {encoding}"
    elif kind in ("payload-bitflip", "payload-marker"):
        span = len(payload) if kind == "payload-bitflip" else min(len(payload), 700)
        flips = []
        for _ in range(rng.choice((1, 1, 2, 4, 8))):
            off, bit = rng.randrange(span), rng.randrange(8)
            payload[off] ^= 1 << bit
            flips.append(f"{off}.{bit}")
        what += f"payload bits flipped ({', '.join(flips)}), header kept"
    elif kind == "payload-bytes":
        n = min(len(payload), rng.choice((1, 2, 4, 16, 64)))
        off = rng.randrange(len(payload) - n + 1)
        payload[off : off + n] = bytes(n) if rng.random() < 0.3 else rng.randbytes(n)
        what += f"{n} payload bytes at {off} overwritten, header kept"
    elif kind == "payload-truncate":
        cut = rng.randrange(1, len(payload))
        del payload[cut:]
        what += f"payload cut to {cut} bytes, header kept"
    elif kind == "payload-splice":
        off = rng.randrange(len(payload))
        n = rng.choice((1, 2, 3, 16, 100))
        if rng.random() < 0.5:
            payload[off:off] = rng.randbytes(n)
            what += f"{n} random bytes inserted at {off}, header kept"
        else:
            del payload[off : off + n]
            what += f"{n} payload bytes removed at {off}, header kept"
    elif kind in ("payload-sof", "payload-bomb"):
        sof = _sof_offset(payload)
        if sof is None:
            what += "no SOF found: payload kept"
        else:
            if kind == "payload-bomb":
                new_w, new_h = rng.randrange(9000, 65536), rng.randrange(9000, 65536)
            else:
                new_w, new_h = _other_size(rng, width) or 1, _other_size(rng, height) or 1
            struct.pack_into(">HH", payload, sof + 5, new_h, new_w)
            agree = rng.random() < 0.5
            if agree:
                width, height = new_w, new_h
            what += f"SOF -> {new_w}x{new_h}, header {'made to agree' if agree else 'kept'}"
    elif kind == "payload-swap":
        other = rng.choice([i for i in heads if i != index] or [index])
        payload = bytearray(payloads[other])
        agree = rng.random() < 0.5
        if agree:
            info = sniff(payload)
            encoding, width, height, channels = info.encoding, info.width, info.height, info.channels
            encoding = heads[other][1] if info.encoding == "other" else encoding
        what += f"payload of record {other}, header {'made to agree' if agree else 'kept'}"
    else:
        raise ValueError(kind)
    value = encode_record(
        bytes(payload),
        label=label,
        encoding=encoding,
        width=width,
        height=height,
        channels=channels,
        binding=binding,
        index=index,
    )
    try:
        decode_record(value, index=index, verify=True, binding=binding)
    except LmdbFolderError as exc:  # a header the format itself refuses is fine; a bad checksum is not
        if getattr(exc, "kind", "") == "checksum":
            raise
    env = lmdb.open(pack_dir, subdir=True, map_size=1 << 28, lock=False)
    try:
        with env.begin(write=True) as txn:
            txn.put(KEY.pack(index), value)
    finally:
        env.close()
    return what


def build_forge_source(work: str, seed: int = 0) -> str:
    """The pack the forged mode rewrites: every kind a reader routes differently (RGB,
    greyscale, CMYK and progressive JPEGs large enough for region decoding, PNGs of
    three colour types, WebP, GIF, BMP); returns its directory."""
    rng = np.random.default_rng(seed)
    src = os.path.join(work, "src-forge")
    for i in range(30):
        w, h = int(rng.integers(40, 260)), int(rng.integers(30, 200))
        # A smooth field and noise: JPEG-like content with detail in every block.
        yy, xx = np.mgrid[0:h, 0:w]
        base = np.stack([xx * 255 // w, yy * 255 // h, (xx + yy) % 256], -1) + rng.integers(-30, 30, (h, w, 3))
        img = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
        kind = i % 10
        cls = f"c{i % 3}"
        if kind in (0, 1, 2):
            _save(img, f"{src}/{cls}/j{i:03d}.jpg", "JPEG", quality=int(rng.integers(60, 96)))
        elif kind == 3:
            _save(img.convert("L"), f"{src}/{cls}/g{i:03d}.jpg", "JPEG", quality=90)
        elif kind == 4:
            _save(img.convert("CMYK"), f"{src}/{cls}/k{i:03d}.jpg", "JPEG", quality=90)
        elif kind == 5:
            _save(img, f"{src}/{cls}/p{i:03d}.jpg", "JPEG", quality=85, progressive=True, subsampling=0)
        elif kind == 6:
            _save(img.convert("P", palette=Image.Palette.ADAPTIVE, colors=32), f"{src}/{cls}/q{i:03d}.png", "PNG")
        elif kind == 7:
            _save(img.convert("RGBA"), f"{src}/{cls}/a{i:03d}.png", "PNG")
        elif kind == 8:
            _save(img, f"{src}/{cls}/w{i:03d}.webp", "WEBP", quality=80)
        else:
            _save(img, f"{src}/{cls}/b{i:03d}.{'gif' if i % 20 == 9 else 'bmp'}", "GIF" if i % 20 == 9 else "BMP")
    out = os.path.join(work, "forge.lmdb")
    pack(src, out, progress=False, commit_every=8)
    return out


def _oracle_files(target: str, folder: str) -> list[tuple[str, int]]:
    """Each record's stored bytes as a file (what ImageFolder would read), with its label."""
    from lmdbfolder.read.reader import Reader

    out = []
    os.makedirs(folder, exist_ok=True)
    with Reader(target, verify_checksums=True) as r:
        for i in range(len(r)):
            rec = r.get(i)
            name = os.path.join(folder, f"{i:05d}.bin")
            with open(name, "wb") as f:
                f.write(rec.payload)
            out.append((name, r.labels[i]))
    return out


def _forged_transform() -> Any:
    from torchvision import transforms as T

    return T.Compose([T.RandomResizedCrop(24), T.RandomHorizontalFlip(), T.PILToTensor()])


def _tensor_digest(t: Any) -> str:
    return _digest(f"{tuple(t.shape)}".encode() + t.contiguous().numpy().tobytes())


def path_forged(target: str, emit: Callable[[Any], None], folder: str) -> None:
    """ImageFolder's loader on the stored bytes (the oracle) and LMDBFolder's plain,
    one-crop-at-a-time and batched paths, each record seeded alike."""
    import torch
    from torchvision.datasets.folder import pil_loader

    from lmdbfolder.torch import LMDBFolder

    files = _oracle_files(target, folder)
    tf = _forged_transform()
    n = len(files)

    def oracle(i: int, transform: Any) -> list[Any]:
        try:
            img = pil_loader(files[i][0])
            return ["ok", _image_digest(img) if transform is None else _tensor_digest(transform(img))]
        except Exception as exc:
            return ["raises", type(exc).__name__, str(exc)[:200]]

    for i in range(n):
        emit(["oracle", "plain", i, *oracle(i, None)])
        torch.manual_seed(1000 + i)
        emit(["oracle", "crop", i, *oracle(i, tf)])
    torch.manual_seed(7)
    for i in range(n):
        emit(["oracle", "batch", i, *oracle(i, tf)])
    plain = LMDBFolder(target, verify_checksums=True)
    cropped = LMDBFolder(target, verify_checksums=True, transform=tf)
    for i in range(n):
        try:
            emit(["ok", "plain", i, _image_digest(plain[i][0])])
        except Exception as exc:
            emit(["err", "plain", i, *_error_entry(exc)])
        torch.manual_seed(1000 + i)
        try:
            emit(["ok", "crop", i, _tensor_digest(cropped[i][0])])
        except Exception as exc:
            emit(["err", "crop", i, *_error_entry(exc)])
    torch.manual_seed(7)
    try:
        batch = cropped.__getitems__(list(range(n)))
        for i, (img, _label) in enumerate(batch):
            emit(["ok", "batch", i, _tensor_digest(img)])
    except Exception as exc:
        emit(["err", "batch", -1, *_error_entry(exc)])


def path_floader(target: str, emit: Callable[[Any], None], folder: str) -> None:
    """Plain images through 2 DataLoader workers, against ImageFolder's loader."""
    from torch.utils.data import DataLoader
    from torchvision.datasets.folder import pil_loader

    from lmdbfolder.torch import LMDBFolder

    files = _oracle_files(target, folder)
    for i, (name, _) in enumerate(files):
        try:
            emit(["oracle", "loader", i, "ok", _image_digest(pil_loader(name))])
        except Exception as exc:
            emit(["oracle", "loader", i, "raises", type(exc).__name__, str(exc)[:200]])
    ds = LMDBFolder(target, verify_checksums=True, transform=_image_digest)
    i = 0
    try:
        for digests, _targets in DataLoader(ds, batch_size=4, num_workers=2, timeout=60):
            for d in digests:
                emit(["ok", "loader", i, d])
                i += 1
    except Exception as exc:
        emit(["err", "loader", -1, *_error_entry(exc)])


def path_fverify(target: str, emit: Callable[[Any], None], _extra: str) -> None:
    rc, out, err = _cli(["verify", target, "--decode", "--json", "--no-progress"])
    report = json.loads(out) if rc in (0, 1) and out.strip() else {}
    emit(["verify", rc, bool(report.get("ok")), len(report.get("problems", [])), (err.splitlines() or [""])[0][:300]])


def classify_forged(sub: str, lines: list[list[Any]], status: str) -> tuple[str, str]:
    """(outcome, detail) of one forged path: the oracle's sample or a clear error."""
    if status == "hang":
        return "hang", ""
    if status.startswith("SIG"):
        return status, ""
    if status != "exited":
        return "exception", status
    fatal = next((ln for ln in lines if ln[0] == "fatal"), None)
    oracle = {ln[2]: ln[3:] for ln in lines if ln[0] == "oracle" and ln[1] == sub}
    ours = [ln for ln in lines if ln[0] in ("ok", "err") and ln[1] == sub]
    if not oracle:
        return _fatal(fatal)
    errors = [ln for ln in ours if ln[0] == "err"]
    if errors:
        kind = errors[0][3]
        if kind == "signal":
            return errors[0][4], "a DataLoader worker"
        outcome = "clear-error" if kind == "clear" else "exception"
        return outcome, f"{errors[0][4]}: {errors[0][5] if len(errors[0]) > 5 else ''}"
    got = {ln[2]: ln[3] for ln in ours}
    if len(got) < len(oracle):
        if fatal is not None:
            return _fatal(fatal)
        return "exception", f"{len(got)} of {len(oracle)} samples"
    for i, want in sorted(oracle.items()):
        if want[0] != "ok":
            return "wrong", f"index {i}: a sample where ImageFolder raises {want[1]}: {want[2][:100]}"
        if got[i] != want[1]:
            return "wrong", f"index {i}: other pixels than ImageFolder's"
    return "identical", ""


PATH_FUNCS.update(forged=path_forged, floader=path_floader, fverify=path_fverify)


def run_forged_trials(
    trials: list[Trial],
    data: bytes,
    work: str,
    rng: random.Random,
    jobs: int,
    mem_limit: int,
    loader_every: int,
) -> None:
    """Forge a copy of the pack (its ``data.mdb`` bytes) for each trial and run the forged paths on it."""
    todo = []
    for trial in trials:
        copy = os.path.join(work, f"t{trial.n}", "forge.lmdb")
        os.makedirs(copy)
        with open(os.path.join(copy, "data.mdb"), "wb") as f:
            f.write(data)
        trial.what = forge(trial.kind, copy, rng)
        base = f"{work}/t{trial.n}"
        todo.append(Job((trial.n, "forged"), "forged", copy, f"{base}/forged.jsonl", f"{base}/files"))
        todo.append(Job((trial.n, "fverify"), "fverify", copy, f"{base}/verify.jsonl"))
        if trial.n % loader_every == 0:
            todo.append(Job((trial.n, "floader"), "floader", copy, f"{base}/loader.jsonl", f"{base}/files-loader"))
    results = run_split(todo, jobs, mem_limit)
    for trial in trials:
        got = results[(trial.n, "forged")]
        for sub in FORGED_SUBPATHS:
            trial.outcomes[sub] = classify_forged(sub, got["lines"], got["status"])
        loader = results.get((trial.n, "floader"))
        if loader is not None:
            trial.outcomes["loader"] = classify_forged("loader", loader["lines"], loader["status"])
        said = results[(trial.n, "fverify")]
        entry = next((ln for ln in said["lines"] if ln[0] == "verify"), None)
        if said["status"] != "exited" or entry is None:
            status = said["status"]
            trial.outcomes["verify"] = (
                (status, "") if status.startswith("SIG") or status == "hang" else ("exception", "")
            )
        elif entry[1] == 0 and entry[2]:
            broken = [p for p in trial.outcomes if p != "verify" and trial.outcomes[p][0] != "identical"]
            trial.outcomes["verify"] = (
                ("verify-ok-on-damage", f"verify OK but {', '.join(broken)}: not ImageFolder's samples")
                if broken
                else ("identical", "")
            )
        else:
            trial.outcomes["verify"] = ("clear-error", f"{entry[3]} problems" if entry[1] == 1 else entry[4])
        shutil.rmtree(os.path.join(work, f"t{trial.n}"), ignore_errors=True)


def forged_campaign(
    trials: int = 1000,
    seed: int = 0,
    jobs: int = 2,
    work: str | None = None,
    loader_every: int = 10,
    kinds: tuple[str, ...] = FORGE_KINDS,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Build the mixed pack, forge ``trials`` copies of it, run the forged paths; returns the results."""
    from lmdbfolder import errors

    _LMDBFOLDER_ERRORS.update(errors.__all__)
    own = work is None
    work = work or tempfile.mkdtemp(prefix="lmdbfolder-forge-")
    start = time.perf_counter()
    plans = [Trial(n, "forge", kinds[n % len(kinds)]) for n in range(trials)]
    try:
        source = _in_child(build_forge_source, work, seed)
        with open(os.path.join(source, "data.mdb"), "rb") as f:
            data = f.read()
        mem_limit = _memory_limit()
        rng = random.Random(seed + 1)
        batch: list[Trial] = []
        for k, trial in enumerate(plans):
            batch.append(trial)
            if len(batch) < max(4, jobs * 2) and k + 1 < len(plans):
                continue
            run_forged_trials(batch, data, work, rng, jobs, mem_limit, loader_every)
            if log is not None:
                log(f"{k + 1}/{len(plans)} forged trials, {time.perf_counter() - start:.0f} s")
            batch = []
    finally:
        global _RUNNER
        if _RUNNER is not None:
            _RUNNER.close()
            _RUNNER = None
        if own:
            shutil.rmtree(work, ignore_errors=True)
    return {
        "mode": "forge",
        "seed": seed,
        "trials": len(plans),
        "seconds": round(time.perf_counter() - start, 1),
        "lmdb": lmdb.__version__,
        "child_seconds": {k: round(v, 1) for k, v in _SECONDS.items()},
        "results": [
            {"n": t.n, "pack": t.pack, "kind": t.kind, "damage": t.what, "outcomes": t.outcomes} for t in plans
        ],
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
TORCH_PATHS = ("dataset", "loader", "forged", "floader")


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

        # lmdbfolder.torch imports its modules on first use: load them here, once, not
        # in every forked child.
        from lmdbfolder.torch import LMDBFolder, collate  # noqa: F401

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


# -- forged tables (issue 34) ---------------------------------------------------------
#: ``--forge-tables``: the tables forged (see the module docstring).
TABLE_FORGE_KINDS = (
    "order-dup",
    "order-swap",
    "order-beyond",
    "next-record-used",
    "next-record-zero",
    "classes-permuted",
    "classes-short",
    "history-junk",
    "history-huge",
    "staging-junk",
    "staging-foreign",
    "staging-symlink",
    "staging-dir-symlink",
    "staging-fifo",
    "lock-symlink",
)
TABLE_OUTCOMES = ("correct", "clear-error", "wrong", "verify-ok-on-damage", "write-outside", "exception", "hang")
#: What ``--forge-tables`` forbids.
TABLE_FAILURES = ("wrong", "verify-ok-on-damage", "write-outside", "exception", "hang")
_VICTIM = b"a file outside the pack: nothing may change it\n"


def build_table_source(work: str, seed: int = 0) -> dict[str, str]:
    """A small ImageFolder tree and its pack, updated once (format 3: ``__order__``,
    ``next_record``, ``record_classes``); returns their folders."""
    rng = np.random.default_rng(seed)
    src = os.path.join(work, "src-tables")
    for c, cls in enumerate(("cat", "dog", "emu")):
        for k in range(5):
            h, w = 12 + c + k, 16 + 2 * k
            img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            _save(img, f"{src}/{cls}/img{k:02d}.jpg", "JPEG", quality=90)
    out = os.path.join(work, "tables.lmdb")
    pack(src, out, progress=False)
    _save(Image.new("RGB", (20, 14), (9, 99, 199)), f"{src}/aardvark/a0.jpg", "JPEG", quality=90)
    os.remove(f"{src}/cat/img01.jpg")
    pack(src, out, progress=False, update=True)
    return {"src": src, "pack": out}


def _put_tables(pack_dir: str, tables: dict[bytes, bytes]) -> None:
    """Replace tables of the pack (``__check__`` recomputed: every checksum valid)."""
    from lmdbfolder.format import TABLE_KEYS as CHECKED_KEYS
    from lmdbfolder.format import encode_check

    env = lmdb.open(pack_dir, subdir=True, map_size=1 << 30, lock=False)
    try:
        with env.begin(write=True) as txn:
            for key, blob in tables.items():
                txn.put(key, blob)
            present = {k: txn.get(k) for k in CHECKED_KEYS}
            txn.put(CHECK_KEY, encode_check({k: v for k, v in present.items() if v is not None}))
    finally:
        env.close()


def _table(pack_dir: str, key: bytes) -> bytes:
    env = lmdb.open(pack_dir, subdir=True, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            value = txn.get(key)
    finally:
        env.close()
    if value is None:
        raise RuntimeError(f"the pack has no {key!r}")
    return bytes(value)


def forge_tables(kind: str, trial: str, rng: random.Random) -> str:
    """Forge one table (or plant staging files) of the pack ``trial/p``; what was done."""
    from lmdbfolder.format import HISTORY_KEY, ORDER_KEY, encode_meta, encode_order

    dst = os.path.join(trial, "p")
    staging = dst + ".update"
    outside = os.path.join(trial, "outside")
    order = np.frombuffer(_table(dst, ORDER_KEY), dtype="<u8").copy()
    meta = json.loads(_table(dst, META_KEY))
    i, j = rng.sample(range(len(order)), 2)
    if kind == "order-dup":
        order[i] = order[j]
        _put_tables(dst, {ORDER_KEY: encode_order(order)})
        return f"__order__[{i}] = __order__[{j}]"
    if kind == "order-swap":
        order[i], order[j] = order[j], order[i]
        _put_tables(dst, {ORDER_KEY: encode_order(order)})
        return f"__order__[{i}] <-> [{j}]"
    if kind == "order-beyond":
        order[i] = meta["next_record"] + rng.randrange(4)
        _put_tables(dst, {ORDER_KEY: encode_order(order)})
        return f"__order__[{i}] = {int(order[i])} (next_record {meta['next_record']})"
    if kind in ("next-record-used", "next-record-zero", "classes-permuted", "classes-short"):
        if kind == "next-record-used":
            meta["next_record"] = int(rng.choice(list(order)))
        elif kind == "next-record-zero":
            meta["next_record"] = 0
        elif kind == "classes-permuted":
            classes = list(meta["record_classes"])
            while classes == meta["record_classes"]:
                rng.shuffle(classes)
            meta["record_classes"] = classes
        else:
            meta["record_classes"] = list(meta["record_classes"])[:-1]
        _put_tables(dst, {META_KEY: encode_meta(meta)})
        return f"manifest next_record={meta.get('next_record')} record_classes={meta.get('record_classes')}"
    if kind == "history-junk":
        blob = rng.choice(
            [b'{"event":"pack"}', b"123", b"[1,2,3]", b"[" * 40 + b"]" * 40, b"not json", b'[{"at":[[[[]]]]}]']
        )
        _put_tables(dst, {HISTORY_KEY: blob})
        return f"__history__ = {blob[:40]!r}"
    if kind == "history-huge":
        n = rng.randrange(1, 6) << 20
        blob = b'[{"event":"pack"},{"event":"update","junk":[' + b'"ab",' * n + b'0]},{"event":"update"}]'
        _put_tables(dst, {HISTORY_KEY: blob})
        return f"__history__ of {len(blob):,} bytes"
    if kind == "lock-symlink":
        os.symlink(os.path.join(outside, "victim"), os.path.join(dst, "lock.mdb"))
        return "DST/lock.mdb -> outside/victim"
    if kind == "staging-dir-symlink":
        os.symlink(outside, staging)
        return "DST.update -> outside/"
    os.mkdir(staging)
    data = os.path.join(staging, "data.mdb")
    if kind == "staging-junk":
        with open(data, "wb") as f:
            f.write(rng.randbytes(rng.choice([0, 100, 4096, 16384])))
        return "DST.update/data.mdb: junk"
    if kind == "staging-foreign":
        shutil.copyfile(os.path.join(dst, "data.mdb"), data)
        return "DST.update/data.mdb: the pack's own data.mdb"
    if kind == "staging-symlink":
        os.symlink(os.path.join(outside, "victim"), data)
        return "DST.update/data.mdb -> outside/victim"
    if kind == "staging-fifo":
        os.mkfifo(data)
        return "DST.update/data.mdb: a FIFO"
    raise ValueError(f"unknown table forgery {kind!r}")


def _change_source(src: str, rng: random.Random) -> str:
    """A file added, one removed and one rewritten (another size)."""
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs)
    gone, rewritten = rng.sample(files, 2)
    os.remove(gone)
    size = (rng.randrange(10, 40), rng.randrange(10, 40))
    _save(Image.new("RGB", size, (rng.randrange(256), 7, 77)), rewritten, "JPEG", quality=90)
    added = os.path.join(src, rng.choice(["cat", "dog", "emu", "zebra"]), f"new{rng.randrange(1000)}.jpg")
    _save(Image.new("RGB", (13, 11), (1, rng.randrange(256), 3)), added, "JPEG", quality=90)
    return f"-{os.path.relpath(gone, src)} ~{os.path.relpath(rewritten, src)} +{os.path.relpath(added, src)}"


def _file_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _file_digest(path: str) -> str:
    return _digest(_file_bytes(path))


def _outside_state(trial: str) -> tuple[Any, ...]:
    """What must not change: the files beside the pack's folders, and those in ``outside``."""
    outside = os.path.join(trial, "outside")
    files = {}
    for name in sorted(os.listdir(outside)):
        path = os.path.join(outside, name)
        files[name] = _file_digest(path) if os.path.isfile(path) and not os.path.islink(path) else "?"
    beside = sorted(n for n in os.listdir(trial) if n not in ("src", "p", "outside") and not n.startswith("p."))
    return tuple(sorted(files.items())), tuple(beside)


def table_trial(kind: str, seed: int, trial: str, source: dict[str, str]) -> list[str]:
    """One forged-table trial (in a forked child): forge, change the source, update, verify,
    read every sample; its [outcome, detail]."""
    from lmdbfolder import Reader
    from lmdbfolder.write.sources import scan

    rng = random.Random(seed)
    shutil.copytree(source["src"], os.path.join(trial, "src"))
    shutil.copytree(source["pack"], os.path.join(trial, "p"))
    os.mkdir(os.path.join(trial, "outside"))
    for name in ("victim", "skipped.txt"):
        with open(os.path.join(trial, "outside", name), "wb") as f:
            f.write(_VICTIM)
    forged = forge_tables(kind, trial, rng)
    changed = _change_source(os.path.join(trial, "src"), rng)
    detail = f"{forged}; source {changed}"
    before = _outside_state(trial)
    src, dst = os.path.join(trial, "src"), os.path.join(trial, "p")

    def outcome(name: str, why: str) -> list[str]:
        if _outside_state(trial) != before:
            return ["write-outside", f"{detail}: {why}; outside the pack: {_outside_state(trial)}"]
        return [name, f"{detail}: {why}"]

    rc, _, err = _cli(["pack", src, dst, "--update", "--no-progress", "--workers", "1"])
    if "Traceback" in err:
        return outcome("exception", "update: " + err.strip().splitlines()[-1][:300])
    if rc != 0:
        return outcome("clear-error", "update refused: " + (err.strip().splitlines() or ["?"])[0][:200])
    rc, out, err = _cli(["verify", dst, "--json", "--no-progress"])
    if "Traceback" in err:
        return outcome("exception", "verify: " + err.strip().splitlines()[-1][:300])
    verified = rc == 0
    sources = scan(src)
    try:
        with Reader(dst) as r:
            got = (list(r.classes), r.paths(), list(r.labels), [bytes(rec.payload) for rec in r])
    except LmdbFolderError as exc:
        if verified:
            return outcome("verify-ok-on-damage", f"verify OK, then a read: {exc.message[:200]}")
        return outcome("clear-error", f"read refused: {exc.message[:200]}")
    except Exception:
        return outcome("exception", "read: " + traceback.format_exc().strip().splitlines()[-1][:300])
    expected = (
        list(sources.classes),
        list(sources.relpaths),
        list(sources.labels),
        [_file_bytes(os.path.join(src, p)) for p in sources.relpaths],
    )
    if got != expected:
        what = [name for name, a, b in zip(("classes", "paths", "labels", "records"), got, expected) if a != b]
        return outcome("wrong", f"update exit 0, then {', '.join(what)} differ from the source (verify OK: {verified})")
    if not verified:
        return outcome("clear-error", "verify reports problems: " + out[:200])
    return outcome("correct", "")


def _run_table_trial(kind: str, seed: int, trial: str, source: dict[str, str], timeout: float) -> list[str]:
    """``table_trial`` in a forked child, killed past ``timeout`` seconds."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            resource.setrlimit(resource.RLIMIT_AS, (_memory_limit(),) * 2)
            result = table_trial(kind, seed, trial, source)
        except BaseException:
            result = ["exception", traceback.format_exc().strip().splitlines()[-1][:300]]
        os.write(w, json.dumps(result).encode())
        os._exit(0)
    os.close(w)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            return ["hang", f"past {timeout:.0f} s"]
        time.sleep(0.01)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    if os.WIFSIGNALED(status):
        return [f"SIG{signal.Signals(os.WTERMSIG(status)).name.removeprefix('SIG')}", "the child was killed"]
    return json.loads(data) if data else ["exception", f"no result (status {status})"]


def tables_campaign(
    trials: int,
    seed: int,
    work: str | None,
    kinds: tuple[str, ...] = TABLE_FORGE_KINDS,
    timeout: float = 60.0,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """``--forge-tables``: ``trials`` trials, the kinds in turn (seeded), one child at a time."""
    start = time.perf_counter()
    owned = work is None
    root = tempfile.mkdtemp(prefix="lmdbfolder-fuzz-tables-") if work is None else work
    os.makedirs(root, exist_ok=True)
    try:
        source = _in_child(build_table_source, root, seed)
        results = []
        for t in range(trials):
            kind = kinds[t % len(kinds)]
            trial = os.path.join(root, f"trial-{t:05d}")
            shutil.rmtree(trial, ignore_errors=True)
            os.mkdir(trial)
            outcome, detail = _run_table_trial(kind, seed * 1_000_003 + t, trial, source, timeout)
            results.append({"trial": t, "kind": kind, "outcome": outcome, "detail": detail})
            shutil.rmtree(trial, ignore_errors=True)
            if (t + 1) % 50 == 0:
                log(f"{t + 1}/{trials} trials")
    finally:
        if owned:
            shutil.rmtree(root, ignore_errors=True)
    return {
        "mode": "forge-tables",
        "trials": trials,
        "seed": seed,
        "lmdb": lmdb.version(),
        "seconds": round(time.perf_counter() - start, 1),
        "results": results,
    }


def tables_report(result: dict[str, Any], examples: int = 3) -> str:
    """Outcomes by forgery (rows), the forbidden ones counted, and a few examples of each."""
    counts: dict[str, Counter[str]] = {}
    for r in result["results"]:
        counts.setdefault(r["kind"], Counter())[r["outcome"]] += 1
    seen = sorted({o for c in counts.values() for o in c}, key=lambda o: (TABLE_OUTCOMES + (o,)).index(o))
    width = max(len(k) for k in TABLE_FORGE_KINDS)
    lines = [f"{'forgery':<{width}} {'n':>4} " + " ".join(f"{o:>{max(len(o), 5)}}" for o in seen)]
    total: Counter[str] = Counter()
    for kind in TABLE_FORGE_KINDS:
        if kind in counts:
            c = counts[kind]
            total.update(c)
            lines.append(f"{kind:<{width}} {sum(c.values()):>4} " + " ".join(f"{c[o]:>{max(len(o), 5)}}" for o in seen))
    lines.append(
        f"{'all':<{width}} {sum(total.values()):>4} " + " ".join(f"{total[o]:>{max(len(o), 5)}}" for o in seen)
    )
    forbidden = {o: n for o, n in total.items() if o in TABLE_FAILURES or o.startswith("SIG")}
    lines.append(f"\nforbidden outcomes: {json.dumps(forbidden)}")
    shown: Counter[str] = Counter()
    for r in result["results"]:
        o = r["outcome"]
        if (o in TABLE_FAILURES or o.startswith("SIG")) and shown[o] < examples:
            shown[o] += 1
            lines.append(f"  e.g. {o}: {r['kind']}: {r['detail']}")
    return "\n".join(lines)


# -- reports --------------------------------------------------------------------------
def table(result: dict[str, Any]) -> str:
    """Outcomes by damage kind (rows) for each read path, as text."""
    lines = []
    rows = result["results"]
    forged = result.get("mode") == "forge"
    kinds = FORGE_KINDS if forged else KINDS
    width = max(len(k) for k in kinds)
    for path in FORGED_PATHS if forged else PATHS:
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
        lines.append(f"{'kind':<{width}} {'n':>4} " + " ".join(f"{o:>{max(len(o), 5)}}" for o in seen))
        total: Counter[str] = Counter()
        for kind in kinds:
            if kind in counts:
                c = counts[kind]
                total.update(c)
                cells = " ".join(f"{c[o]:>{max(len(o), 5)}}" for o in seen)
                lines.append(f"{kind:<{width}} {sum(c.values()):>4} {cells}")
        cells = " ".join(f"{total[o]:>{max(len(o), 5)}}" for o in seen)
        lines.append(f"{'all':<{width}} {sum(total.values()):>4} {cells}")
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
    parser.add_argument(
        "--forge",
        action="store_true",
        help="forged packs (issue 22): rewrite one record per trial with valid checksums (kinds: "
        + ", ".join(FORGE_KINDS)
        + "); ImageFolder on the stored bytes is the oracle",
    )
    parser.add_argument(
        "--forge-tables",
        action="store_true",
        help="forged tables (issue 34): forge one table of an updated pack per trial, valid checksums (kinds: "
        + ", ".join(TABLE_FORGE_KINDS)
        + "), then pack --update, verify and a read of every sample against the source",
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a --forge-tables trial may take")
    args = parser.parse_args(argv)
    # Imported once here, so that every forked child starts warm (torch: in
    # the torch runner only, see TorchRunner).
    import lmdbfolder.cli  # noqa: F401
    import lmdbfolder.tools.copy  # noqa: F401
    import lmdbfolder.tools.importing  # noqa: F401
    import lmdbfolder.tools.info  # noqa: F401
    import lmdbfolder.tools.verify  # noqa: F401

    if args.forge_tables:
        kinds = TABLE_FORGE_KINDS if args.kinds == ",".join(KINDS) else tuple(args.kinds.split(","))
        unknown = [k for k in kinds if k not in TABLE_FORGE_KINDS]
        if unknown:
            parser.error(f"unknown table forgeries {unknown}; choose from {', '.join(TABLE_FORGE_KINDS)}")
        import lmdbfolder.write.update  # noqa: F401

        result = tables_campaign(
            args.trials,
            args.seed,
            args.work,
            kinds,
            args.timeout,
            log=lambda msg: print(msg, file=sys.stderr, flush=True),
        )
        print(
            f"lmdbfolder fuzz, forged tables: {result['trials']} trials, seed {result['seed']}, "
            f"lmdb {result['lmdb']}, {result['seconds']} s"
        )
        print(tables_report(result, args.examples))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return 0
    if args.forge:
        kinds = FORGE_KINDS if args.kinds == ",".join(KINDS) else tuple(args.kinds.split(","))
        unknown = [k for k in kinds if k not in FORGE_KINDS]
        if unknown:
            parser.error(f"unknown forge kinds {unknown}; choose from {', '.join(FORGE_KINDS)}")
        result = forged_campaign(
            args.trials,
            args.seed,
            args.jobs,
            args.work,
            args.loader_every,
            kinds,
            log=lambda msg: print(msg, file=sys.stderr, flush=True),
        )
        return _report(result, args)
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
    return _report(result, args)


def _report(result: dict[str, Any], args: argparse.Namespace) -> int:
    mode = ", forged packs" if result.get("mode") == "forge" else ""
    head = f"lmdbfolder fuzz{mode}: {result['trials']} trials, seed {result['seed']}, lmdb {result['lmdb']}"
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

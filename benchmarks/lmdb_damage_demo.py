"""Targeted damage that shows each root cause of issue 15, one line per (damage, read path).

Usage:
    python benchmarks/lmdb_damage_demo.py [--work DIR]

Builds the fuzz packs (``fuzz_packs.build_sources``), then damages copies in
chosen places and runs each read path in a child process, printing how it
ended (``exit 0`` with its last output line, or the signal):

* a large value's size in its leaf node (+8 MiB): py-lmdb's pre-touch of the
  value faults past the end of the file (SIGBUS), in ``txn.get`` and
  ``cursor.value`` alike, but not in ``cursor.set_key``, which does not touch
  the value; with a map of exactly the file's size it is SIGSEGV, or (when
  other mappings follow the map) a view of 8 MiB of foreign process memory;
* an overflow page number that names another record of the same length (raw
  pack): the other record comes back with a valid CRC and verify says OK;
* branch key sizes and keys: lookups miss records that a cursor walk (verify)
  still sees;
* leaf page flags and a branch with one child: lookups fail, the cursor walk
  aborts (LMDB ``assert``, SIGABRT) or passes;
* after the first error a read transaction answers every later read with
  BadTxnError; aborting it and beginning a new one recovers.

``Reader.get`` and ``lmdbfolder verify`` read through ``lmdbfolder.pagefile``
(issue 15's fix), so their lines show today's behaviour next to py-lmdb's;
each case is also given to ``PageFile`` directly and to py-lmdb 3's
pure-Python ``lmdb.verify``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fuzz_packs import build_sources  # noqa: E402

from lmdbfolder.pagefile import F_BIGDATA, P_BRANCH, P_LEAF, PageFile  # noqa: E402

READ_ALL = """
import sys
from lmdbfolder.read.reader import Reader
r = Reader(sys.argv[1], verify_checksums=True)
ok, errors = 0, {}
for i in range(len(r)):
    try:
        r.get(i)
        ok += 1
    except Exception as e:
        errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
print(f"{ok} of {len(r)} read, errors {errors}")
"""
VERIFY = """
import sys
from lmdbfolder.tools.verify import verify
rep = verify(sys.argv[1], progress=False)
print("OK" if rep.ok else f"{len(rep.problems)} problem(s): {rep.problems[0]}")
"""
CURSOR_WALK = """
import sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, lock=False)
with env.begin(buffers=True) as txn:
    print(sum(1 for _ in txn.cursor()), "pairs walked")
"""
PAGEFILE = """
import sys
from lmdbfolder.format import KEY
from lmdbfolder.pagefile import PageFile, PageDamage
from lmdbfolder.read.reader import Reader
n = int(sys.argv[2])
ok = missing = damage = 0
first = ""
with PageFile(sys.argv[1] + "/data.mdb") as pf:
    for i in range(n):
        try:
            if pf.get(KEY.pack(i)) is None:
                missing += 1
            else:
                ok += 1
        except PageDamage as e:
            damage += 1
            first = first or e.why
print(f"{ok} found, {missing} missing, {damage} PageDamage {first[:90]}")
"""


def run(code: str, *args: str) -> str:
    """How a child running ``code`` ended: its last output line, or the signal that killed it."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, timeout=120
    )
    if proc.returncode < 0:
        lines = [ln for ln in proc.stderr.splitlines() if "Assertion" in ln]
        return signal.Signals(-proc.returncode).name + (f" ({lines[0].split(': ', 1)[-1][:80]})" if lines else "")
    tail = (proc.stdout.strip().splitlines() or proc.stderr.strip().splitlines() or [""])[-1]
    return f"exit {proc.returncode}: {tail[:150]}"


def damaged(src: str, dst: str, edits: list[tuple[int, Callable[[int], int]]]) -> str:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "data.mdb"), "r+b") as f:
        for off, fn in edits:
            f.seek(off)
            b = f.read(1)[0]
            f.seek(off)
            f.write(bytes([fn(b)]))
    return dst


def structural(path: str) -> str:
    try:
        import lmdb.verify as lv
    except ImportError:
        return "(lmdb.verify needs py-lmdb >= 3.0)"
    try:
        errors = lv.verify(path)
    except lv.VerifyError as exc:
        return f"VerifyError: {exc}"
    return "[] (no problem)" if not errors else f"{len(errors)}: {errors[0][:100]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", help="folder for the packs (default: a temporary one, removed)")
    args = parser.parse_args(argv)
    work = args.work or tempfile.mkdtemp(prefix="lmdbfolder-demo-")
    os.makedirs(work, exist_ok=True)
    try:
        packs = build_sources(work)
        for name in ("mixed", "raw"):
            pf = PageFile(os.path.join(packs[name], "data.mdb"))
            pages = list(pf.pages())
            n = pf.entries - 5
            print(f"\n== {name} pack: {n} records, {pf.next_pgno} pages of {pf.psize}, depth {pf.depth}")
            for case, edits, paths in cases(name, pf, pages):
                d = damaged(packs[name], os.path.join(work, "d"), edits)
                print(f"\n-- {case}")
                for label, code, extra in paths:
                    print(f"   {label:<24} {run(code, d, *extra)}")
                print(f"   {'PageFile':<24} {run(PAGEFILE, d, str(n))}")
                print(f"   {'lmdb.verify':<24} {structural(d)}")
            pf.close()
        poisoned(packs["mixed"], work)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def cases(name: str, pf: PageFile, pages: list) -> list:
    """The targeted damages for pack ``name``: (title, byte edits, read paths)."""
    psize = pf.psize
    leaves = [p for p in pages if p[2] == P_LEAF]
    branches = [p for p in pages if p[2] == P_BRANCH]
    big = [(off, key) for _, _, _, nodes in leaves for off, key, _, fl in nodes if fl & F_BIGDATA and key[:1] == b"\0"]
    common = [("Reader.get (checksums)", READ_ALL, ()), ("lmdbfolder verify", VERIFY, ())]
    out = []
    if name == "mixed":
        off, key = big[0]
        index = int.from_bytes(key, "big")
        get = (
            "import sys, lmdb\nenv = lmdb.open(sys.argv[1], readonly=True, lock=False{})\n"
            f"txn = env.begin(buffers=True)\nk = ({index}).to_bytes(8, 'big')\n"
        )
        out.append(
            (
                f"record {index}: bit 23 of its size in the leaf node (+8 MiB, past the end of data.mdb)",
                [(off + 2, lambda b: b ^ 0x80)],
                common
                + [
                    ("txn.get, buffers=True", get.format("") + "print(len(txn.get(k)))", ()),
                    ("cursor.set_key", get.format("") + "c = txn.cursor(); print(c.set_key(k))", ()),
                    (
                        "cursor.set_key + value",
                        get.format("") + "c = txn.cursor(); c.set_key(k); print(len(c.value()))",
                        (),
                    ),
                    (
                        "txn.get, map = file size",
                        get.format(", map_size=4096")
                        + "import os; v = txn.get(k); n = os.path.getsize(sys.argv[1] + '/data.mdb')\n"
                        + "print(len(v), 'bytes returned; the map ends at byte', n, 'of the file')",
                        (),
                    ),
                ],
            )
        )
        root, _, _, rnodes = branches[0]
        noff = rnodes[2][0]
        out.append(
            (
                f"branch page {root} node 2: key size 8 -> 9",
                [(noff + 6, lambda b: b ^ 1)],
                common + [("cursor walk", CURSOR_WALK, ())],
            )
        )
        out.append(
            (
                f"branch page {root} node 2: key size 8 -> 0",
                [(noff + 6, lambda b: b ^ 8)],
                common + [("cursor walk", CURSOR_WALK, ())],
            )
        )
        out.append(
            (
                f"branch page {root} node 2: one bit of the key",
                [(noff + 8 + 7, lambda b: b ^ 0x40)],
                common + [("cursor walk", CURSOR_WALK, ())],
            )
        )
        leaf = leaves[1][0]
        for old_new, fn in (
            ("0x02 -> 0x03 (branch+leaf)", lambda b: b ^ 1),
            ("0x02 -> 0x01 (branch)", lambda b: b ^ 3),
            ("0x02 -> 0x06", lambda b: b ^ 4),
        ):
            out.append(
                (
                    f"leaf page {leaf} flags {old_new}",
                    [(leaf * psize + 10, fn)],
                    common + [("cursor walk", CURSOR_WALK, ())],
                )
            )
        out.append(
            (
                f"branch page {root}: lower = 18 (one child)",
                [(root * psize + 12, lambda b: 18)],
                common + [("cursor walk", CURSOR_WALK, ())],
            )
        )
    else:
        starts = {}
        for off, key in big:
            first = struct.unpack_from("<Q", pf._mm, off + 8 + len(key))[0]
            starts[first] = (off, key)
        for first, (off, key) in starts.items():
            for bit in range(8):
                other = starts.get(first ^ (1 << bit))
                if other is not None:
                    i, j = int.from_bytes(key, "big"), int.from_bytes(other[1], "big")
                    same = f"""
import sys
from lmdbfolder.read.reader import Reader
a, b = Reader(sys.argv[1], verify_checksums=True), Reader(sys.argv[2])
print("payload of", {i}, "== original payload of", {j}, ":", bytes(a.get({i}).payload) == bytes(b.get({j}).payload))
"""
                    edits = [(off + 8 + len(key) + bit // 8, lambda b, bit=bit: b ^ (1 << (bit % 8)))]
                    title = (
                        f"record {i}: bit {bit} of its overflow page number -> the pages of record {j} (same length)"
                    )
                    out.append(
                        (title, edits, common + [("same bytes as the other?", same, (pf.path.rsplit("/", 1)[0],))])
                    )
                    return out
    return out


def poisoned(src: str, work: str) -> None:
    """One bad page, then: reads in the same transaction, and with abort + begin after each error."""
    pf = PageFile(os.path.join(src, "data.mdb"))
    leaf = [p for p in pf.pages() if p[2] == P_LEAF][1][0]
    n = pf.entries - 5
    d = damaged(src, os.path.join(work, "d"), [(leaf * pf.psize + 10, lambda b: b ^ 1)])
    pf.close()
    code = f"""
import sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, lock=False, max_spare_txns=0)
for policy in ("keep the transaction", "abort + begin after an error"):
    txn = env.begin(buffers=True)
    ok, errors = 0, {{}}
    for i in range({n}):
        try:
            txn.get(i.to_bytes(8, "big"))
            ok += 1
        except lmdb.Error as e:
            errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
            if policy.startswith("abort"):
                txn.abort()
                txn = env.begin(buffers=True)
    txn.abort()
    print(f"{{policy}}: {{ok}} of {n} read, errors {{errors}}", flush=True)
"""
    proc = subprocess.run([sys.executable, "-c", code, d], capture_output=True, text=True, timeout=120)
    print("\n== one damaged leaf page (flags 0x02 -> 0x03), every record read with txn.get")
    print(textwrap.indent(proc.stdout.strip() or proc.stderr.strip(), "   "))


if __name__ == "__main__":
    sys.exit(main())

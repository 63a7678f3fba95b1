"""PageFile (lmdbfolder.pagefile), the one read primitive, against real LMDB files.

Each damage below is one that kills a py-lmdb reader (SIGBUS or SIGABRT, shown
in a child process) or makes it return another record; ``PageFile`` must
answer it with ``PageDamage`` in-process, must find exactly what LMDB finds
on an intact file, and its audit must pass every intact file LMDB writes.
"""

from __future__ import annotations

import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import lmdb
import numpy as np
import pytest
from PIL import Image

from lmdbfolder.format import KEY, META_KEY
from lmdbfolder.pagefile import F_BIGDATA, P_BRANCH, P_LEAF, PageDamage, PageFile, ovpages
from lmdbfolder.write.writer import pack


@pytest.fixture(scope="module")
def big_pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pack with values stored in leaf pages (small PNGs) and in overflow pages (up to ~40 KB)."""
    root = tmp_path_factory.mktemp("safe")
    rng = np.random.default_rng(4)
    for i in range(150):
        w, h = int(rng.integers(8, 130)), int(rng.integers(8, 100))
        path = root / "src" / f"c{i % 3}" / f"i{i:03d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
    pack(root / "src", root / "pack", progress=False, commit_every=16)
    return root / "pack"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst / "data.mdb"


def _layout(data: Path) -> tuple[PageFile, list, list]:
    pf = PageFile(data)
    pages = list(pf.pages())
    branches = [p for p in pages if p[2] == P_BRANCH]
    leaves = [p for p in pages if p[2] == P_LEAF]
    return pf, branches, leaves


def _big_record(leaves: list) -> tuple[int, int]:
    """(node offset, index) of the first record stored in overflow pages."""
    for _, _, _, nodes in leaves:
        for off, key, _, flags in nodes:
            if flags & F_BIGDATA and key[:1] == b"\0":
                return off, KEY.unpack(key)[0]
    raise AssertionError("no overflow record")


def _patch(path: Path, offset: int, fn) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([fn(byte)]))


def _lmdb_child(pack_dir: Path, code: str) -> int:
    """Exit status of a child that opens the pack with py-lmdb and runs ``code`` (txn bound)."""
    script = (
        "import sys, lmdb\n"
        "env = lmdb.open(sys.argv[1], readonly=True, lock=False)\n"
        "txn = env.begin(buffers=True)\n" + code
    )
    return subprocess.run([sys.executable, "-c", script, str(pack_dir)], capture_output=True, timeout=60).returncode


def test_finds_exactly_what_lmdb_finds(big_pack: Path) -> None:
    env = lmdb.open(str(big_pack), readonly=True, lock=False)
    try:
        with env.begin() as txn, PageFile(big_pack / "data.mdb") as pf:
            pairs = list(txn.cursor())
            assert len(pairs) == pf.entries == 157  # 150 records and 7 tables
            assert [(k, bytes(v)) for k, v in pf.items()] == pairs
            kinds = {flags & F_BIGDATA for _, _, kind, nodes in pf.pages() if kind == P_LEAF for *_, flags in nodes}
            assert kinds == {0, F_BIGDATA}  # both storage kinds are covered
            for key, value in pairs:
                assert bytes(pf.get(key)) == value
            for absent in (KEY.pack(150), KEY.pack(10**9), b"__zz__", b"\xff" * 9):
                assert pf.get(absent) is None and txn.get(absent) is None
    finally:
        env.close()


def test_empty_database(tmp_path: Path) -> None:
    env = lmdb.open(str(tmp_path), map_size=1 << 20)
    env.close()
    with PageFile(tmp_path / "data.mdb") as pf:
        assert pf.get(b"anything") is None and list(pf.pages()) == []


def test_flipped_overflow_size_is_damage_not_sigbus(big_pack: Path, tmp_path: Path) -> None:
    data = _copy(big_pack, tmp_path / "p")
    pf, _, leaves = _layout(data)
    off, index = _big_record(leaves)
    pf.close()
    _patch(data, off + 2, lambda b: b ^ 0x80)  # the size's bit 23: +8 MiB, past the end of the file
    rc = _lmdb_child(data.parent, f"txn.get(({index}).to_bytes(8, 'big'))\n")
    assert rc in (-signal.SIGBUS, -signal.SIGSEGV), rc  # py-lmdb touches every page of the value first
    with PageFile(data) as pf, pytest.raises(PageDamage, match="beyond the last page"):
        pf.get(KEY.pack(index))


def test_overflow_page_number_must_name_an_overflow_page(big_pack: Path, tmp_path: Path) -> None:
    data = _copy(big_pack, tmp_path / "p")
    pf, _, leaves = _layout(data)
    off, index = _big_record(leaves)
    key_size = 8
    first = struct.unpack_from("<Q", pf._mm, off + 8 + key_size)[0]
    leaf = leaves[0][0]
    pf.close()
    with open(data, "r+b") as f:  # point the record at a leaf page instead
        f.seek(off + 8 + key_size)
        f.write(struct.pack("<Q", leaf))
    with PageFile(data) as pf:
        with pytest.raises(PageDamage, match=f"page {leaf} is not the start of"):
            pf.get(KEY.pack(index))
        assert pf.get(KEY.pack(index + 1)) is not None or index + 1 >= 150  # other records still read
    assert first != leaf


def test_branch_with_one_child_is_damage_not_abort(big_pack: Path, tmp_path: Path) -> None:
    data = _copy(big_pack, tmp_path / "p")
    pf, branches, _ = _layout(data)
    root = branches[0][0]
    psize = pf.psize
    pf.close()
    _patch(data, root * psize + 12, lambda b: 18)  # lower = 18: one node
    assert _lmdb_child(data.parent, "txn.get(b'\\0' * 8)\n") == -signal.SIGABRT  # assert in mdb_page_search_root
    with PageFile(data) as pf, pytest.raises(PageDamage, match="fewer than 2"):
        pf.get(KEY.pack(0))


def test_unknown_page_flags_and_bad_bounds(big_pack: Path, tmp_path: Path) -> None:
    data = _copy(big_pack, tmp_path / "p")
    pf, _, leaves = _layout(data)
    psize = pf.psize
    leaf, _, _, nodes = leaves[1]
    index = KEY.unpack(nodes[0][1])[0]
    pf.close()
    _patch(data, leaf * psize + 10, lambda b: b ^ 0x03)  # leaf -> branch flags
    with PageFile(data) as pf:
        with pytest.raises(PageDamage):
            pf.get(KEY.pack(index))
        assert pf.get(KEY.pack(0)) is not None  # records on other pages are unaffected
    _patch(data, leaf * psize + 10, lambda b: b ^ 0x03)
    _patch(data, leaf * psize + 15, lambda b: 0xFF)  # upper far beyond the page
    with PageFile(data) as pf, pytest.raises(PageDamage, match="bad bounds"):
        pf.get(KEY.pack(index))


def test_truncated_and_foreign_files(big_pack: Path, tmp_path: Path) -> None:
    data = _copy(big_pack, tmp_path / "p")
    size = os.path.getsize(data)
    os.truncate(data, size // 2)
    with pytest.raises(PageDamage) as info:
        PageFile(data)
    assert info.value.kind == "truncated" and "truncated" in str(info.value)
    junk = tmp_path / "junk.mdb"
    junk.write_bytes(b"\x89PNG" + bytes(9000))
    with pytest.raises(PageDamage) as info:
        PageFile(junk)
    assert info.value.kind == "format"
    tiny = tmp_path / "tiny.mdb"
    tiny.write_bytes(b"x")
    with pytest.raises(PageDamage):
        PageFile(tiny)


def test_views_outlive_close(big_pack: Path) -> None:
    pf = PageFile(big_pack / "data.mdb")
    meta = pf.get(META_KEY)
    pf.close()
    assert bytes(meta[:1]) == b"{"  # the map stays while a view of it exists


def test_audit_passes_what_lmdb_writes(big_pack: Path, tmp_path: Path) -> None:
    with PageFile(big_pack / "data.mdb") as pf:
        assert pf.audit() == []
    env = lmdb.open(str(big_pack), readonly=True, lock=False)
    (tmp_path / "compact").mkdir()
    env.copy(str(tmp_path / "compact"), compact=True)  # LMDB's own compacting copy
    env.close()
    with PageFile(tmp_path / "compact" / "data.mdb") as pf:
        assert pf.audit() == []
    # A database with free pages in its free list (several transactions, deletes).
    rng = np.random.default_rng(1)
    env = lmdb.open(str(tmp_path / "free"), map_size=1 << 28)
    for r in range(4):
        with env.begin(write=True) as txn:
            for i in range(1500):
                txn.put(b"%06d" % i, rng.bytes(50 + (i * 7 * r) % 6000))
    with env.begin(write=True) as txn:
        for i in range(0, 1500, 3):
            txn.delete(b"%06d" % i)
    env.close()
    with PageFile(tmp_path / "free" / "data.mdb") as pf:
        assert pf.free_db.entries > 0 and pf.audit() == []


def test_audit_finds_what_lookups_miss(big_pack: Path, tmp_path: Path) -> None:
    # A separator key in a branch page: lookups go wrong, a walk does not notice.
    data = _copy(big_pack, tmp_path / "p")
    pf, branches, _ = _layout(data)
    root, _, _, nodes = branches[0]
    off = nodes[2][0]
    pf.close()
    _patch(data, off + 8 + 7, lambda b: b ^ 0x40)  # the key's last byte
    with PageFile(data) as pf:
        problems = pf.audit()
    assert any("separator" in p or "outside the range" in p for p in problems), problems


def test_audit_finds_leaked_and_doubly_used_pages(big_pack: Path, tmp_path: Path) -> None:
    data = _copy(big_pack, tmp_path / "p")
    pf, _, leaves = _layout(data)
    big = [(o, ovpages(lohi, pf.psize)) for _, _, _, nodes in leaves for o, _k, lohi, fl in nodes if fl & F_BIGDATA]
    (off, n), other = next((a, b) for a in big for b in big if a[0] != b[0] and a[1] == b[1])
    first = struct.unpack_from("<Q", pf._mm, off + 16)[0]
    other = other[0]
    pf.close()
    with open(data, "r+b") as f:  # a second node names the same overflow pages
        f.seek(other + 16)
        f.write(struct.pack("<Q", first))
    with PageFile(data) as pf:
        problems = pf.audit()
    assert any("more than once" in p for p in problems) and any("neither in use nor free" in p for p in problems)

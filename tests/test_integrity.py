"""Issue 15: a damaged or hostile pack never kills a reader, never passes verify,
never returns another sample; format 2's bindings; pack identity; the writer lock.

Each test damages a real pack (written by ``pack``) in one targeted place
that used to kill the process or mislead it (docs/integrity-research.md), and
reads it in this process: a signal would end the test run, so passing means
none was raised.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path
from typing import Callable, Iterator

import lmdb
import numpy as np
import pytest
from PIL import Image

from conftest import make_small_tree
from lmdbfolder.cli import EXIT_CODES, main
from lmdbfolder.encodings import decode_rgb
from lmdbfolder.errors import (
    CorruptRecordError,
    NotAPackError,
    OutputExistsError,
    PackChangedError,
    PackError,
    SourceError,
    UnsafePickleError,
)
from lmdbfolder.format import (
    CHECK_KEY,
    KEY,
    LABELS_KEY,
    META_KEY,
    PATHS_KEY,
    SKIPPED_KEY,
    checksum,
    decode_meta,
    decode_record,
    decode_skipped,
    encode_check,
    encode_meta,
    encode_record,
    pack_binding,
)
from lmdbfolder.pagefile import F_BIGDATA, P_BRANCH, P_LEAF, PageFile
from lmdbfolder.read.reader import Reader
from lmdbfolder.tools.copy import copy_pack
from lmdbfolder.tools.importing import import_legacy, safe_loads
from lmdbfolder.tools.info import pack_info
from lmdbfolder.tools.verify import NO_BINDING_NOTE, verify
from lmdbfolder.write.lock import lock_path, writer_lock
from lmdbfolder.write.writer import pack


# -- packs and damage ------------------------------------------------------------------
@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pack of PNGs from ~0.5 to ~40 KB: values in leaf pages and in overflow pages, 3 levels of tree."""
    root = tmp_path_factory.mktemp("mixed")
    rng = np.random.default_rng(5)
    for i in range(120):
        w, h = int(rng.integers(8, 120)), int(rng.integers(8, 100))
        path = root / "src" / f"c{i % 3}" / f"i{i:03d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
    pack(root / "src", root / "pack", progress=False, commit_every=16)
    return root / "pack"


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A raw pack of 20 same-shaped images: every record is one overflow page of the same length."""
    root = tmp_path_factory.mktemp("raw")
    rng = np.random.default_rng(6)
    for i in range(20):
        path = root / "src" / f"c{i % 2}" / f"r{i:03d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)).save(path)
    pack(root / "src", root / "pack", store="raw", progress=False)
    return root / "pack"


def copy_of(pack_dir: Path, dst: Path) -> Path:
    shutil.copytree(pack_dir, dst)
    return dst


def leaf_nodes(pack_dir: Path) -> list[tuple[int, bytes, int, int]]:
    """(file offset, key, lo|hi, flags) of every leaf node of the pack's main database."""
    with PageFile(pack_dir / "data.mdb") as pf:
        return [node for _, _, kind, nodes in pf.pages() if kind == P_LEAF for node in nodes]


def overflow_record(pack_dir: Path, skip: int = 0) -> tuple[int, int]:
    """(node offset, index) of a record stored in overflow pages."""
    found = [(off, KEY.unpack(key)[0]) for off, key, _, fl in leaf_nodes(pack_dir) if fl & F_BIGDATA and key[0] == 0]
    return found[skip]


def patch(pack_dir: Path, offset: int, data: bytes) -> None:
    with open(pack_dir / "data.mdb", "r+b") as f:
        f.seek(offset)
        f.write(data)


def flip(pack_dir: Path, offset: int, mask: int) -> None:
    with open(pack_dir / "data.mdb", "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


def edit(pack_dir: Path, fn) -> None:
    """A deliberate edit with py-lmdb (it keeps the tree sound), then __check__ made to match the tables."""
    env = lmdb.open(str(pack_dir), map_size=1 << 30)
    with env.begin(write=True) as txn:
        fn(txn)
    env.close()
    (pack_dir / "lock.mdb").unlink()


def recheck(txn) -> None:
    tables = {k: txn.get(k) for k in (META_KEY, LABELS_KEY, PATHS_KEY, SKIPPED_KEY)}
    txn.put(CHECK_KEY, encode_check(tables))


def read_all(pack_dir: Path) -> tuple[dict[int, bytes], dict[int, CorruptRecordError]]:
    ok, bad = {}, {}
    with Reader(pack_dir) as r:
        for i in range(len(r)):
            try:
                ok[i] = bytes(r.get(i).payload)
            except CorruptRecordError as exc:
                bad[i] = exc
    return ok, bad


# -- no signal, ever --------------------------------------------------------------------
def test_oversized_value_is_a_corrupt_record_not_sigbus(mixed: Path, tmp_path: Path) -> None:
    pack_dir = copy_of(mixed, tmp_path / "p")
    off, index = overflow_record(pack_dir)
    flip(pack_dir, off + 2, 0x80)  # bit 23 of the size: 8 MiB past the end of the file
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import lmdb; lmdb.open({str(pack_dir)!r}, readonly=True, lock=False)"
            f".begin().get(({index}).to_bytes(8, 'big'))",
        ],
        capture_output=True,
    )
    assert child.returncode in (-signal.SIGBUS, -signal.SIGSEGV)  # what py-lmdb does with it
    ok, bad = read_all(pack_dir)
    assert set(bad) == {index} and len(ok) == 119  # every other record of the process still reads
    error = bad[index]
    assert error.kind == "page" and error.index == index and error.pack == str(pack_dir)
    assert error.path is not None and error.path.endswith(".png") and "beyond the last page" in str(error)
    report = verify(pack_dir, progress=False)
    assert not report.ok and index in report.bad_indices
    assert main(["info", str(pack_dir)]) == 0
    with pytest.raises(PackError, match="is damaged, so it cannot be copied"):
        copy_pack(pack_dir, tmp_path / "copy")
    assert not (tmp_path / "copy").exists()


def test_damaged_page_flags_spare_other_records(mixed: Path, tmp_path: Path) -> None:
    pack_dir = copy_of(mixed, tmp_path / "p")
    with PageFile(pack_dir / "data.mdb") as pf:
        leaves = [(pgno, nodes) for pgno, _, kind, nodes in pf.pages() if kind == P_LEAF]
        psize = pf.psize
    pgno, nodes = leaves[1]
    flip(pack_dir, pgno * psize + 10, 0x03)  # leaf -> "branch|leaf": py-lmdb aborts or poisons its transaction
    on_page = {KEY.unpack(k)[0] for _, k, _, _ in nodes if k[0] == 0}
    ok, bad = read_all(pack_dir)
    assert set(bad) == on_page and len(ok) == 120 - len(on_page)
    assert set(verify(pack_dir, progress=False).bad_indices) >= on_page


def test_verify_looks_up_keys_as_readers_do(mixed: Path, tmp_path: Path) -> None:
    # One bit of a separator key: the cursor walk of the old verify saw every
    # record, lookups do not find some. verify must name each one.
    pack_dir = copy_of(mixed, tmp_path / "p")
    with PageFile(pack_dir / "data.mdb") as pf:
        branch = next(nodes for _, _, kind, nodes in pf.pages() if kind == P_BRANCH)
    flip(pack_dir, branch[2][0] + 8 + 7, 0x01)  # the last byte of node 2's key
    ok, bad = read_all(pack_dir)
    report = verify(pack_dir, progress=False)
    assert not report.ok and set(bad) <= set(report.bad_indices)
    assert any(p.kind == "structure" for p in report.problems)


# -- never another sample ---------------------------------------------------------------
def test_misdirected_record_fails_its_bound_checksum(raw: Path, tmp_path: Path) -> None:
    pack_dir = copy_of(raw, tmp_path / "p")
    (off1, i1), (off2, i2) = overflow_record(pack_dir, 0), overflow_record(pack_dir, 1)
    with open(pack_dir / "data.mdb", "rb") as f:
        f.seek(off2 + 16)
        other = f.read(8)
    patch(pack_dir, off1 + 16, other)  # record i1 now points at record i2's pages: same length, valid CRC
    with Reader(pack_dir, verify_checksums=False) as r:
        assert bytes(r.get(i1).payload) == bytes(r.get(i2).payload)  # what format 1 could not see
    ok, bad = read_all(pack_dir)
    assert set(bad) == {i1} and bad[i1].kind == "checksum"
    report = verify(pack_dir, progress=False)
    assert report.bad_indices == [i1]
    assert any("more than once" in p.message for p in report.problems)


def test_record_of_another_pack_fails_its_checksum(raw: Path, tmp_path: Path) -> None:
    a = copy_of(raw, tmp_path / "a")
    pack(raw.parent / "src", tmp_path / "b", store="raw", progress=False)  # same images, another pack_id
    env = lmdb.open(str(tmp_path / "b"), readonly=True, lock=False)
    with env.begin() as txn:
        foreign = txn.get(KEY.pack(3))
    env.close()
    edit(a, lambda txn: txn.put(KEY.pack(3), foreign))
    _ok, bad = read_all(a)
    assert set(bad) == {3} and bad[3].kind == "checksum"


def test_raw_sizes_are_checked_before_any_allocation(raw: Path) -> None:
    with Reader(raw) as r:
        meta = r.meta
    bound = dict(binding=pack_binding(meta), index=0)
    bomb = encode_record(b"x" * 12, label=0, encoding="raw", width=20000, height=20000, channels=3, **bound)
    with _peak_memory() as peak:
        with pytest.raises(CorruptRecordError, match="20000x20000x3"):
            decode_record(bomb, index=0, verify=True, binding=bound["binding"])
        with pytest.raises(ValueError, match="20000x20000"):
            decode_rgb(b"x" * 12, "raw", 20000, 20000)
    assert peak() < 16 << 20  # nothing of 1.2 GB was allocated (bytes counted, not seconds)


# -- the tables ---------------------------------------------------------------------------
def _flip_inside(pack_dir: Path, key: bytes, find: bytes) -> None:
    with PageFile(pack_dir / "data.mdb") as pf:
        off, size = pf.locate(key)  # type: ignore[misc]
        at = bytes(pf.view(off, size)).index(find)
    flip(pack_dir, off + at, 0x01)


@pytest.mark.parametrize("key, find", [(META_KEY, b"c1"), (LABELS_KEY, b"\x01\x00\x00\x00"), (PATHS_KEY, b"c2/")])
def test_damaged_tables_are_refused(mixed: Path, tmp_path: Path, key: bytes, find: bytes) -> None:
    pack_dir = copy_of(mixed, tmp_path / "p")
    _flip_inside(pack_dir, key, find)  # still valid JSON / labels / offsets: only the checksum can tell
    with pytest.raises(NotAPackError, match=f"{key.decode()} table is damaged") as info, Reader(pack_dir) as r:
        r.paths()
    assert "lmdbfolder verify" in info.value.hint
    if key == META_KEY:  # the manifest no longer parses (classes contradict class_to_idx): nothing to check against
        with pytest.raises(NotAPackError, match="__meta__ table is damaged"):
            verify(pack_dir, progress=False)
        return
    report = verify(pack_dir, progress=False)
    assert report.problems[0].kind == "checksum" and key.decode() in report.problems[0].message
    assert {p.kind for p in report.problems[1:]} <= {"label"}  # a label changed: those records disagree now


def test_contradicting_and_hostile_manifests(mixed: Path, tmp_path: Path) -> None:
    with Reader(mixed) as r:
        meta = dict(r.meta)
    cases = {
        "contradict each other": dict(meta, class_to_idx={"c0": 1, "c1": 0, "c2": 2}),
        "pack_id": dict(meta, pack_id="not hex"),
        "not a class index": None,  # the label table: below
    }
    for why, bad_meta in cases.items():
        pack_dir = copy_of(mixed, tmp_path / why.replace(" ", "-"))

        def change(txn, bad_meta=bad_meta) -> None:
            if bad_meta is None:
                labels = bytearray(txn.get(LABELS_KEY))
                labels[0:4] = struct.pack("<i", 7)
                txn.put(LABELS_KEY, bytes(labels))
            else:
                txn.put(META_KEY, encode_meta(bad_meta))
            recheck(txn)

        edit(pack_dir, change)
        with pytest.raises(NotAPackError, match=why):
            Reader(pack_dir)
        assert main(["info", str(pack_dir)]) == EXIT_CODES["not a pack"]
    with pytest.raises(NotAPackError, match="nested more than 16 levels"):
        decode_meta(b'{"a":' * 5000 + b"1" + b"}" * 5000, where="x")
    with pytest.raises(NotAPackError, match="more than the 16,777,216 allowed"):
        decode_meta(b'{"skipped":"' + b"x" * (17 << 20) + b'"}', where="x")
    with pytest.raises(NotAPackError, match="arrays and objects"):
        decode_meta(b'{"x":[' + b"[]," * (2 << 20) + b"[]]}", where="x")


def test_informational_fields_of_the_wrong_type_read_as_invalid(
    mixed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pack_dir = copy_of(mixed, tmp_path / "p")
    with Reader(mixed) as r:
        meta = dict(r.meta, encodings=[1, 2], payload_bytes="lots", source=7, created_at=[], params={"max_size": "x"})

    def change(txn) -> None:
        txn.put(META_KEY, encode_meta(meta))
        recheck(txn)

    edit(pack_dir, change)
    info = pack_info(pack_dir)
    assert info["encodings"] == info["payload_bytes"] == info["source"] == info["created_at"] == "invalid"
    assert main(["info", str(pack_dir)]) == 0
    assert "invalid" in capsys.readouterr().out
    report = verify(pack_dir, progress=False)
    assert {p.kind for p in report.problems} == {"manifest"} and len(report.problems) == 5
    assert len(read_all(pack_dir)[0]) == 120  # the samples are fine


# -- format 1 stays readable --------------------------------------------------------------
def write_v1(v2: Path, dst: Path) -> None:
    """The pack as the format-1 writer wrote it: unbound CRCs, skipped files in the
    manifest, no pack_id, no __check__ or __skipped__."""
    env = lmdb.open(str(v2), readonly=True, lock=False)
    with env.begin() as txn:
        meta = json.loads(txn.get(META_KEY))
        items = [(k, v) for k, v in txn.cursor() if not k.startswith(b"__")]
        skipped = decode_skipped(txn.get(SKIPPED_KEY), where="x")
        tables = {k: txn.get(k) for k in (LABELS_KEY, PATHS_KEY)}
    env.close()
    for key in ("pack_id", "skipped_count"):
        meta.pop(key)
    meta.update(format_version=1, skipped=skipped)
    out = lmdb.open(str(dst), map_size=1 << 28)
    with out.begin(write=True) as txn:
        for key, value in items:
            value = bytearray(value)
            struct.pack_into("<I", value, 28, checksum(value[32:], checksum(value[:28])))
            txn.put(key, bytes(value))
        for key, blob in tables.items():
            txn.put(key, blob)
        txn.put(META_KEY, encode_meta(meta))
    out.close()
    (dst / "lock.mdb").unlink()


def test_format_1_packs_stay_readable(mixed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    v1 = tmp_path / "v1"
    write_v1(mixed, v1)
    with Reader(mixed) as new, Reader(v1) as old:
        assert old.format_version == 1 and old.pack_id is None and old.identity.startswith("sha256:")
        assert [bytes(r.payload) for r in old] == [bytes(r.payload) for r in new]
        assert old.paths() == new.paths() and list(old.labels) == list(new.labels)
    report = verify(v1, progress=False)
    assert report.ok and report.notes == [NO_BINDING_NOTE]
    assert main(["verify", str(v1), "--no-progress"]) == 0
    assert "not bound to their index" in capsys.readouterr().err
    assert "not bound to their index" in pack_info(v1)["note"]
    copy_pack(v1, tmp_path / "v1-copy")
    assert verify(tmp_path / "v1-copy", progress=False).ok


# -- pack identity ----------------------------------------------------------------------
def image_size(img: Image.Image) -> tuple[int, int]:
    return img.size


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_replaced_pack_is_not_mixed_in(tmp_path: Path, context: str) -> None:
    from torch.utils.data import DataLoader

    from lmdbfolder.torch import LMDBFolder

    make_small_tree(tmp_path / "a", classes=2, per_class=10)
    make_small_tree(tmp_path / "b", classes=4, per_class=5)
    pack(tmp_path / "a", tmp_path / "p", progress=False)
    ds = LMDBFolder(tmp_path / "p", transform=image_size)
    assert main(["pack", str(tmp_path / "b"), str(tmp_path / "p"), "--overwrite", "--no-progress"]) == 0
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=context)
    with pytest.raises(PackChangedError, match="replaced since this dataset was opened"):
        list(loader)  # a worker's error, re-raised here with its type
    with pytest.raises(NotAPackError, match="replaced since this dataset was opened"):
        ds[0]  # this process opens its map now, too


# -- the writer lock and signals -----------------------------------------------------------
def test_a_second_pack_of_the_same_dst_is_refused(small_tree: Path, tmp_path: Path) -> None:
    dst = tmp_path / "p"
    with writer_lock(str(dst)):
        assert json.loads(Path(lock_path(str(dst))).read_text())["pid"] == os.getpid()
        with pytest.raises(
            OutputExistsError, match=f"being written by another lmdbfolder pack \\(pid {os.getpid()}"
        ) as info:
            pack(small_tree, dst, progress=False)
        assert "--restart" not in str(info.value) and "--overwrite" not in str(info.value)
        assert main(["pack", str(small_tree), str(dst), "--restart"]) == EXIT_CODES["output exists"]
    assert not os.path.exists(lock_path(str(dst)))
    Path(lock_path(str(dst))).write_text("left by a killed run")  # no holder: no obstacle
    pack(small_tree, dst, progress=False)
    assert not os.path.exists(lock_path(str(dst))) and verify(dst, progress=False).ok


def test_sigterm_in_an_at_fork_hook_is_not_lost(small_tree: Path, tmp_path: Path) -> None:
    # A Python signal handler that runs inside an at-fork hook raises there,
    # where CPython only prints "Exception ignored": the writer forks its
    # reader processes with SIGTERM blocked, so it is delivered after the fork.
    script = textwrap.dedent(
        """
        import os, signal, sys
        from lmdbfolder.cli import main
        sent = []
        def hook():
            if not sent:
                sent.append(1)
                os.kill(os.getpid(), signal.SIGTERM)
        os.register_at_fork(after_in_parent=hook)
        sys.exit(main(["pack", sys.argv[1], sys.argv[2], "--workers", "2", "--no-progress"]))
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, "-c", script, str(small_tree), str(tmp_path / "p")], capture_output=True, text=True, env=env
    )
    assert proc.returncode == EXIT_CODES["interrupted"], proc.stderr
    assert "interrupted" in proc.stderr and not (tmp_path / "p").exists()


# -- import -------------------------------------------------------------------------------
@contextlib.contextmanager
def _peak_memory() -> Iterator[Callable[[], int]]:
    """The most bytes Python held at once inside the block (``tracemalloc``): how a test
    says "nothing big was made" without a clock, which a busy machine slows."""
    tracemalloc.start()
    peak = [0]
    try:
        yield lambda: peak[0]
    finally:
        peak[0] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


def _billion_laughs(levels: int = 12) -> bytes:
    # [[x]*10]*10 ... : each level a list of ten references to the level below.
    out = bytearray(b"\x80\x04")
    out += b"]" + b"\x94"  # EMPTY_LIST, MEMOIZE -> memo 0
    out += b"(" + b"K\x01" * 10 + b"e"  # MARK, 10 ints, APPENDS
    for level in range(1, levels):
        out += b"]" + b"\x94" + b"(" + (b"h" + bytes([level - 1])) * 10 + b"e"  # a new list of 10 refs to the last
    out += b"."
    return bytes(out)


def _recipe(path: Path, items: dict[bytes, bytes]) -> None:
    env = lmdb.open(str(path), map_size=1 << 26)
    with env.begin(write=True) as txn:
        for key, value in items.items():
            txn.put(key, value)
    env.close()


def test_import_refuses_hostile_pickles_quickly(tmp_path: Path) -> None:
    bomb = _billion_laughs()
    assert len(bomb) < 300
    with _peak_memory() as peak, pytest.raises(UnsafePickleError, match="expands into more than") as info:
        safe_loads(bomb, where="k")
    assert peak() < 16 << 20 and len(str(info.value)) < 500  # 10**12 references were never made
    with pytest.raises(UnsafePickleError, match="nested more than"):
        safe_loads(pickle.dumps(eval("[" * 40 + "]" * 40)), where="k")
    png = (Path(__file__).parent / "test_integrity.py").read_bytes()[:10]
    for label, why in (
        (2**31 - 1, None),
        (-7, "not a class index"),
        (True, "not an integer"),
        ("cat", "not an integer"),
    ):
        old = tmp_path / f"old{label}"
        _recipe(old, {b"0": pickle.dumps((png, 0)), b"1": pickle.dumps((png, label)), b"__len__": b"2"})
        with _peak_memory() as peak, pytest.raises(SourceError, match=why or "more than the 1,048,576 classes") as info:
            import_legacy(old, tmp_path / f"new{label}", progress=False)
        assert peak() < 64 << 20 and len(str(info.value)) < 600  # no 2**31 class names were made


def test_import_of_a_truncated_or_damaged_recipe_is_an_error(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    items = {str(i).encode(): pickle.dumps((rng.bytes(9000 + 100 * i), i % 2)) for i in range(20)}
    items[b"__len__"] = pickle.dumps(20)
    _recipe(tmp_path / "old", items)
    shutil.copytree(tmp_path / "old", tmp_path / "cut")
    data = tmp_path / "cut" / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    with pytest.raises(NotAPackError, match="truncated"):
        import_legacy(tmp_path / "cut", tmp_path / "new", progress=False)
    shutil.copytree(tmp_path / "old", tmp_path / "big")
    off = next(o for o, k, _, fl in leaf_nodes(tmp_path / "big") if fl & F_BIGDATA)
    flip(tmp_path / "big", off + 2, 0x80)  # the SIGBUS of py-lmdb
    with pytest.raises(SourceError, match="cannot read key"):
        import_legacy(tmp_path / "big", tmp_path / "new", progress=False)


def test_reopening_the_file_does_not_parse_the_manifest_again(
    small_pack: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each worker opens each shard's file: the manifest's bytes, compared by
    # hash with those read at open, say it is the same pack.
    from lmdbfolder import packfile
    from lmdbfolder.read.reader import Reader

    reader = Reader(small_pack)
    parses: list[str] = []
    real = packfile.decode_meta
    monkeypatch.setattr(packfile, "decode_meta", lambda *a, **k: parses.append("parse") or real(*a, **k))
    assert reader.get(0).index == 0 and parses == []

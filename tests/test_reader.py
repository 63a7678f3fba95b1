"""Reader: errors for things that are not packs, indexing, pickling, fork safety."""

from __future__ import annotations

import os
import pickle
import traceback
from pathlib import Path

import lmdb
import pytest

from conftest import write
from lmdbfolder.errors import CorruptRecordError, FormatVersionError, NotAPackError
from lmdbfolder.format import KEY, META_KEY, encode_meta
from lmdbfolder.read.reader import Reader


def _rewrite(pack_dir: Path, key: bytes, value: bytes | None) -> None:
    env = lmdb.open(str(pack_dir), map_size=1 << 30)
    with env.begin(write=True) as txn:
        if value is None:
            txn.delete(key)
        else:
            txn.put(key, value)
    env.close()
    lock = pack_dir / "lock.mdb"
    if lock.exists():
        lock.unlink()


def test_not_a_pack_errors(tmp_path: Path) -> None:
    with pytest.raises(NotAPackError, match="no such file"):
        Reader(tmp_path / "missing")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(NotAPackError, match="holds no data.mdb") as info:
        Reader(tmp_path / "emptydir")
    assert "lmdbfolder pack" in str(info.value)
    write(tmp_path / "junk" / "data.mdb", b"this is not an lmdb file" * 500)
    with pytest.raises(NotAPackError, match="data.mdb is not an LMDB file"):
        Reader(tmp_path / "junk")
    write(tmp_path / "plainfile", b"x")
    with pytest.raises(NotAPackError, match="is a file"):
        Reader(tmp_path / "plainfile")


def test_foreign_lmdb_without_manifest(tmp_path: Path) -> None:
    env = lmdb.open(str(tmp_path / "recipe"), map_size=1 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"0", b"\x80\x04whatever")
        txn.put(b"__len__", b"1")
    env.close()
    with pytest.raises(NotAPackError, match="folder2lmdb-style LMDB") as info:
        Reader(tmp_path / "recipe")
    assert f"`lmdbfolder import {tmp_path / 'recipe'} NEW`" in info.value.hint
    env = lmdb.open(str(tmp_path / "other"), map_size=1 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"hello", b"world")
    env.close()
    with pytest.raises(NotAPackError, match="has no lmdbfolder manifest") as info:
        Reader(tmp_path / "other")
    assert "lmdbfolder import OLD NEW" in info.value.hint and "lmdbfolder pack" in info.value.hint


def test_wrong_format_version(small_pack: Path) -> None:
    with Reader(small_pack) as r:
        meta = dict(r.meta, format_version=99)
    _rewrite(small_pack, META_KEY, encode_meta(meta))
    with pytest.raises(
        FormatVersionError, match="format version 99, this lmdbfolder reads versions 1, 2, 3 and 4"
    ) as e:
        Reader(small_pack)
    assert "upgrade" in str(e.value)


def test_data_mdb_path_is_accepted(small_pack: Path) -> None:
    assert len(Reader(small_pack / "data.mdb")) == 12


def test_indexing(small_pack: Path) -> None:
    with Reader(small_pack) as r:
        assert len(r) == 12
        assert r.get(-1).index == 11
        assert r.get(-12).index == 0
        assert r.read_bytes(-1) == r.read_bytes(11)
        for bad in (12, -13, 1000):
            with pytest.raises(IndexError, match=rf"index {bad} is out of range for .* \(12 samples\)"):
                r.get(bad)
        with pytest.raises(TypeError, match="must be an integer"):
            r.get("3")  # type: ignore[arg-type]
        assert r.path_of(-1) == "class2/img3.jpg"
        assert [rec.index for rec in r] == list(range(12))
        assert r.image(0).mode == "RGB"


def test_payload_is_zero_copy(small_pack: Path) -> None:
    with Reader(small_pack) as r:
        assert isinstance(r.get(0).payload, memoryview)
        assert r.get(0).payload.readonly


def test_corrupt_record_names_index_and_path(small_pack: Path) -> None:
    env = lmdb.open(str(small_pack), map_size=1 << 30)
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(KEY.pack(4)))
        value[40] ^= 0xFF
        txn.put(KEY.pack(4), bytes(value))
    env.close()
    with Reader(small_pack, verify_checksums=False) as r:
        r.get(4)  # checksums off: the damage goes unnoticed
    with Reader(small_pack) as r:  # on by default
        with pytest.raises(CorruptRecordError, match=r"record 4 \(class1/img0.jpg\) in .* is corrupt: record CRC-32"):
            r.get(4)
        r.get(5)


def test_missing_record(small_pack: Path) -> None:
    _rewrite(small_pack, KEY.pack(2), None)
    with Reader(small_pack) as r, pytest.raises(CorruptRecordError, match="record 2 .* missing"):
        r.get(2)


def test_pickle_drops_handles(small_pack: Path) -> None:
    r = Reader(small_pack)
    before = r.read_bytes(3)
    clone = pickle.loads(pickle.dumps(r))
    assert clone.read_bytes(3) == before
    assert len(pickle.dumps(r)) < 10_000
    clone.close()
    assert r.read_bytes(3) == before  # the shared environment stays open for r
    r.close()


def test_two_readers_of_one_pack(small_pack: Path) -> None:
    # Each reader maps the file itself (no py-lmdb environment to share), so
    # closing one leaves the other, and views it returned, readable.
    a, b = Reader(small_pack), Reader(small_pack)
    view = a.get(2).payload
    assert a.read_bytes(0) == b.read_bytes(0)
    a.close()
    assert b.read_bytes(1) and bytes(view) == b.read_bytes(2)
    b.close()


def _in_child(fn) -> int:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if fn() else 3
        except BaseException:
            traceback.print_exc()
            code = 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.parametrize("parent_reads_first", [True, False])
def test_fork(small_pack: Path, parent_reads_first: bool) -> None:
    r = Reader(small_pack)
    expected = [bytes(Path(small_pack).parent.joinpath("small", p).read_bytes()) for p in r.paths()]
    if parent_reads_first:
        assert r.read_bytes(0) == expected[0]  # the parent now holds the environment open

    def child() -> bool:
        ok = all(r.read_bytes(i) == expected[i] for i in range(len(r)))
        other = Reader(small_pack)  # a second reader in the child shares the child's handle
        return ok and other.read_bytes(5) == expected[5]

    assert _in_child(child) == 0
    assert _in_child(child) == 0
    assert r.read_bytes(7) == expected[7]  # the parent's handle survived its children
    r.close()


def test_threads_read_concurrently(small_pack: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with Reader(small_pack) as r:
        expected = [r.read_bytes(i) for i in range(len(r))]
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda i: r.read_bytes(i % 12), range(400)))
        assert got == [expected[i % 12] for i in range(400)]


def test_truncated_data_file_is_refused_not_a_crash(small_tree: Path, tmp_path: Path) -> None:
    # Reading a page past the end of a cut-short data.mdb would kill the
    # process with SIGBUS; the reader checks the size against the meta page.
    from lmdbfolder.write.writer import pack

    pack(small_tree, tmp_path / "p", commit_every=2, progress=False)
    data = tmp_path / "p" / "data.mdb"
    size = data.stat().st_size
    os.truncate(data, size // 2)
    with pytest.raises(NotAPackError, match="data.mdb is truncated") as info:
        Reader(tmp_path / "p")
    assert str(tmp_path / "p") in str(info.value) and "lmdbfolder copy" in str(info.value)


def test_errors_survive_pickling() -> None:
    # Errors cross process boundaries (Ray tasks, DataLoader workers) pickled.
    from lmdbfolder.errors import OutputExistsError, SourceError

    errors = [
        NotAPackError("/p", "why", "do this"),
        FormatVersionError("/p", 9, 1),
        CorruptRecordError(3, "bad crc").locate("a/b.jpg", "/p"),
        SourceError("/src/x.jpg", "truncated", "fix it"),
        OutputExistsError("/out"),
    ]
    for error in errors:
        clone = pickle.loads(pickle.dumps(error))
        assert type(clone) is type(error)
        assert str(clone) == str(error) and clone.__dict__ == error.__dict__

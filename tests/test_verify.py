"""verify(): finds exactly the damaged records, and says which."""

from __future__ import annotations

import random
from pathlib import Path

import lmdb
import pytest

from lmdbfolder.format import (
    CHECK_KEY,
    KEY,
    LABELS_KEY,
    META_KEY,
    PATHS_KEY,
    SKIPPED_KEY,
    decode_meta,
    decode_record,
    encode_check,
    encode_labels,
    encode_record,
    pack_binding,
)
from lmdbfolder.tools.verify import verify
from lmdbfolder.write.writer import pack


def _edit(pack_dir: Path, edit) -> None:
    env = lmdb.open(str(pack_dir), map_size=1 << 30)
    with env.begin(write=True) as txn:
        edit(txn)
    env.close()
    (pack_dir / "lock.mdb").unlink()


def relabel(txn, index: int, label: int) -> bytes:
    """Record ``index`` well formed (valid CRC, bound to its index and pack) with another label."""
    header, payload = decode_record(txn.get(KEY.pack(index)))
    return encode_record(
        payload,
        label=label,
        encoding=header.encoding,
        width=header.width,
        height=header.height,
        channels=header.channels,
        binding=pack_binding(decode_meta(txn.get(META_KEY), where="x")),
        index=index,
    )


def retable(txn, key: bytes, blob: bytes) -> None:
    """Replace a table and its checksum in __check__ (a consistent, deliberate edit)."""
    txn.put(key, blob)
    tables = {k: txn.get(k) for k in (META_KEY, LABELS_KEY, PATHS_KEY, SKIPPED_KEY)}
    txn.put(CHECK_KEY, encode_check(tables))


def test_clean_pack_verifies(small_pack: Path) -> None:
    report = verify(small_pack, decode=True, progress=False)
    assert report.ok and report.checked == 12 and report.decoded
    assert report.as_dict()["ok"] is True


def test_flipped_bytes_are_found_exactly(small_tree: Path, tmp_path: Path) -> None:
    out = tmp_path / "p"
    pack(small_tree, out, progress=False)
    rng = random.Random(7)
    victims = sorted(rng.sample(range(12), 4))

    def flip(txn) -> None:
        for i in victims:
            value = bytearray(txn.get(KEY.pack(i)))
            pos = rng.randrange(32, len(value))  # somewhere in the payload
            value[pos] ^= 1 << rng.randrange(8)
            txn.put(KEY.pack(i), bytes(value))

    _edit(out, flip)
    report = verify(out, progress=False)
    assert not report.ok
    assert report.bad_indices == victims
    assert {p.kind for p in report.problems} == {"checksum"}
    assert all(p.path and p.path.startswith("class") for p in report.problems)


def test_missing_extra_and_mislabelled_records(small_pack: Path) -> None:
    def damage(txn) -> None:
        txn.delete(KEY.pack(3))
        txn.put(KEY.pack(40), encode_record(b"x", label=0, encoding="other"))
        txn.put(b"__surprise__", b"1")
        txn.put(KEY.pack(5), relabel(txn, 5, 2))  # no longer matching the label table
        txn.put(KEY.pack(6), b"short")

    _edit(small_pack, damage)
    report = verify(small_pack, progress=False)
    kinds = {(p.kind, p.index) for p in report.problems}
    assert ("missing", 3) in kinds
    assert ("extra", 40) in kinds
    assert ("extra", None) in kinds
    assert ("label", 5) in kinds
    assert ("header", 6) in kinds
    assert report.bad_indices == [3, 5, 6, 40]


def test_label_out_of_class_range(small_pack: Path) -> None:
    def damage(txn) -> None:
        txn.put(KEY.pack(0), relabel(txn, 0, 9))
        labels = [9] + [0] * 3 + [1] * 4 + [2] * 4
        retable(txn, LABELS_KEY, encode_labels(labels))

    _edit(small_pack, damage)
    report = verify(small_pack, progress=False)
    assert [(p.kind, p.index) for p in report.problems] == [("table", None), ("label", 0)]
    assert all("not a class index" in p.message for p in report.problems)


def test_a_table_problem_is_said_without_the_path_even_one_with_a_colon(small_pack: Path, tmp_path: Path) -> None:
    # The reason of a table problem was cut out of the error's message at its first ": ",
    # which a folder name may hold too: the problem then repeated the path and the words
    # "is not an lmdbfolder pack". The error carries its reason (``why``) instead.
    import shutil

    odd = tmp_path / "runs: 2024" / "p.lmdb"
    shutil.copytree(small_pack, odd)

    def damage(txn) -> None:
        txn.put(KEY.pack(0), relabel(txn, 0, 9))
        retable(txn, LABELS_KEY, encode_labels([9] + [0] * 3 + [1] * 4 + [2] * 4))

    _edit(odd, damage)
    report = verify(odd, progress=False)
    table = [p.message for p in report.problems if p.kind == "table"]
    assert len(table) == 1 and "not a class index" in table[0]
    assert "2024" not in table[0] and "is not an lmdbfolder pack" not in table[0]


@pytest.mark.parametrize("decode", [False, True])
def test_undecodable_image_needs_decode(small_tree: Path, tmp_path: Path, decode: bool) -> None:
    data = (small_tree / "class0" / "img1.jpg").read_bytes()
    (small_tree / "class0" / "img1.jpg").write_bytes(data[: len(data) // 2])  # truncated JPEG
    pack(small_tree, tmp_path / "p", check="none", progress=False)  # trust the input: it gets in
    report = verify(tmp_path / "p", decode=decode, progress=False)
    # The missing end marker shows without decoding; --decode also finds the decoder's error.
    found = [(p.kind, p.index, p.path) for p in report.problems]
    assert found == [("truncated", 1, "class0/img1.jpg")] + ([("decode", 1, "class0/img1.jpg")] if decode else [])


def test_verify_against_the_source(small_tree: Path, tmp_path: Path) -> None:
    out = tmp_path / "p"
    pack(small_tree, out, progress=False)
    assert verify(out, against=small_tree, progress=False).ok
    # same size, different bytes
    target = small_tree / "class1" / "img2.jpg"
    data = bytearray(target.read_bytes())
    data[-3] ^= 0xFF
    target.write_bytes(bytes(data))
    (small_tree / "class2" / "extra.jpg").write_bytes((small_tree / "class0" / "img0.jpg").read_bytes())
    report = verify(out, against=small_tree, progress=False)
    kinds = {(p.kind, p.index, p.message.split(" ")[0]) for p in report.problems}
    assert ("source", 6, "differs") in kinds
    assert any(p.message.startswith("class2/extra.jpg is in the source but not in the pack") for p in report.problems)


def test_verify_against_raw_pack_and_skips(small_tree: Path, tmp_path: Path) -> None:
    (small_tree / "class0" / "empty.jpg").write_bytes(b"")
    pack(small_tree, tmp_path / "raw", store="raw", progress=False)
    assert verify(tmp_path / "raw", against=small_tree, progress=False).ok  # the skipped file is not "missing"


def test_verify_against_a_sharded_pack(small_tree: Path, tmp_path: Path) -> None:
    from lmdbfolder.write.shards import pack_sharded

    (small_tree / "class2" / "empty.jpg").write_bytes(b"")
    pack_sharded(small_tree, tmp_path / "sh", shards=3, progress=False)
    assert verify(tmp_path / "sh", against=small_tree, progress=False).ok
    (small_tree / "class2" / "img0.jpg").write_bytes(b"changed")
    report = verify(tmp_path / "sh", against=small_tree, progress=False)
    assert [(p.kind, p.path) for p in report.problems] == [("source", "class2/img0.jpg")]


def test_verify_against_a_resized_pack(tmp_path: Path) -> None:
    from PIL import Image

    from lmdbfolder.write.options import Resize

    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    Image.effect_noise((300, 200), 50).convert("RGB").save(src / "a" / "big.jpg")
    Image.effect_noise((40, 30), 50).convert("RGB").save(src / "a" / "small.jpg")
    pack(src, tmp_path / "p", resize=Resize(64), progress=False)
    assert verify(tmp_path / "p", against=src, progress=False).ok
    Image.effect_noise((300, 100), 50).convert("RGB").save(src / "a" / "big.jpg")  # other shape now
    report = verify(tmp_path / "p", against=src, progress=False)
    assert [(p.kind, p.path) for p in report.problems] == [("source", "a/big.jpg")]
    assert "the resize gives 64x21" in report.problems[0].message


def test_verify_against_a_damaged_sharded_pack_reports_the_damage(small_tree: Path, tmp_path: Path) -> None:
    """A damaged record or a missing shard is a problem in the report, not an error that ends
    the comparison with the source."""
    import shutil

    from lmdbfolder.write.shards import pack_sharded

    pack_sharded(small_tree, tmp_path / "sh", shards=3, progress=False)
    shard = sorted(p for p in (tmp_path / "sh").iterdir() if p.is_dir())[0]

    def flip(txn) -> None:
        value = bytearray(txn.get(KEY.pack(1)))
        value[-5] ^= 0xFF
        txn.put(KEY.pack(1), bytes(value))

    _edit(shard, flip)
    report = verify(tmp_path / "sh", against=small_tree, progress=False)
    assert report.bad_indices == [1] and report.checked == 12
    shutil.rmtree(sorted(p for p in (tmp_path / "sh").iterdir() if p.is_dir())[-1])
    report = verify(tmp_path / "sh", against=small_tree, progress=False)
    assert any(p.kind == "shard" and "is missing" in p.message for p in report.problems)
    assert any(p.kind == "source" and "cannot compare" in p.message for p in report.problems)


@pytest.mark.parametrize("sharded", [False, True])
def test_verify_against_a_source_with_a_class_added_and_one_renamed(
    small_tree: Path, tmp_path: Path, sharded: bool
) -> None:
    """Classes are compared by name: a class folder added to the source (which renumbers the
    classes after it) or renamed is one problem, not one per record."""
    from lmdbfolder.write.shards import pack_sharded

    out = tmp_path / "p"
    if sharded:
        pack_sharded(small_tree, out, shards=2, progress=False)
    else:
        pack(small_tree, out, progress=False)
    import shutil

    shutil.copytree(small_tree / "class1", small_tree / "a_new")  # sorts first: every label moves by one
    report = verify(out, against=small_tree, progress=False)
    assert [p.message for p in report.problems] == [
        "class a_new is in the source but not in the pack (4 files, first a_new/img0.jpg)"
    ]
    (small_tree / "class2").rename(small_tree / "zz")
    report = verify(out, against=small_tree, progress=False)
    assert [p.message for p in report.problems] == [
        "class a_new is in the source but not in the pack (4 files, first a_new/img0.jpg)",
        "class zz is in the source but not in the pack (4 files, first zz/img0.jpg)",
        "class class2 is in the pack but not in the source (4 records, first 8: class2/img0.jpg)",
    ]


def test_verify_against_a_list_that_renames_a_class_says_so_once(small_tree: Path, tmp_path: Path) -> None:
    """A list file of class names in which one class got a new name: one problem, not one per record."""
    files = sorted(p.relative_to(small_tree).as_posix() for p in small_tree.rglob("*.jpg"))
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"{f} {f.split('/')[0]}\n" for f in files))
    pack(small_tree, tmp_path / "p", list_file=listing, progress=False)
    assert verify(tmp_path / "p", against=small_tree, progress=False).ok
    listing.write_text("".join(f"{f} {f.split('/')[0].replace('class1', 'renamed')}\n" for f in files))
    report = verify(tmp_path / "p", against=small_tree, progress=False)
    assert [p.message for p in report.problems] == [
        "class renamed of the source is not a class of the pack: 4 files of the pack are listed with it "
        "(first class1/img0.jpg)"
    ]

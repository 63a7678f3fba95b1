"""What keeps packs cheap at ImageNet size (issue 12): the map-size model, compact sample
lists, table checks that cost no copy, and the cheap shard check."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import shutil
import tracemalloc
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest

from conftest import image_bytes, make_small_tree, write
from lmdbfolder import format as fmt
from lmdbfolder.errors import NotAPackError, PackError
from lmdbfolder.format import encode_labels, encode_paths, encode_record
from lmdbfolder.read.opening import open_pack
from lmdbfolder.read.reader import Reader
from lmdbfolder.tools.verify import verify
from lmdbfolder.write import loop as loop_mod
from lmdbfolder.write import output as output_mod
from lmdbfolder.write import sizing
from lmdbfolder.write import writer as writer_mod
from lmdbfolder.write.compact import LabelList, PathList
from lmdbfolder.write.options import PackOptions, Resize
from lmdbfolder.write.records import Loaded
from lmdbfolder.write.shards import pack_sharded
from lmdbfolder.write.sources import SourceList, scan
from lmdbfolder.write.writer import pack, pack_sources


# -- the map-size model ----------------------------------------------------------------
def _sized_tree(root: Path, sizes: list[int], classes: int = 4) -> Path:
    rng = np.random.default_rng(0)
    for i, size in enumerate(sizes):
        write(root / f"c{i % classes}" / f"f{i:05d}.jpg", rng.bytes(int(size)))
    return root


def _real_bytes(path: Path) -> int:
    env = lmdb.open(str(path), readonly=True, lock=False)
    try:
        return (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    finally:
        env.close()


def _pack_counting_growth(
    monkeypatch: pytest.MonkeyPatch, src: Path, dst: Path, **options: Any
) -> tuple[writer_mod.PackResult, list[int]]:
    grown: list[int] = []
    original = loop_mod._Partial.grow

    def grow(self: loop_mod._Partial, map_size: int) -> None:
        grown.append(map_size)
        original(self, map_size)

    monkeypatch.setattr(loop_mod._Partial, "grow", grow)
    return pack(src, dst, progress=False, **options), grown


PSIZE = sizing.page_size()
OVERFLOW_AT = sizing.node_max(PSIZE) - 16 + 1 - fmt.RECORD_HEADER.size  # first payload on overflow pages
OVER_A_PAGE = PSIZE - sizing.PAGE_HEADER + 1 - fmt.RECORD_HEADER.size  # first payload taking two pages


def test_page_rules_are_lmdbs() -> None:
    # mdb.c for 4 KB pages: me_nodemax 2038; a leaf node of 16 + value, even, plus a 2-byte slot.
    assert sizing.node_max(4096) == 2038
    assert sizing.overflow_pages(2022, 4096) == 0 and sizing.overflow_pages(2023, 4096) == 1
    assert sizing.overflow_pages(4080, 4096) == 1 and sizing.overflow_pages(4081, 4096) == 2
    assert sizing.leaf_node_bytes(2023, 4096) == 26 and sizing.leaf_node_bytes(101, 4096) == 120


@pytest.mark.parametrize(
    "name, sizes",
    [
        ("small 2-6 KB", list(np.random.default_rng(1).integers(2000, 6000, 400))),
        ("just over a page", [OVER_A_PAGE] * 300),
        ("just over the overflow threshold", [OVERFLOW_AT] * 300),
        ("just under the overflow threshold", [OVERFLOW_AT - 1] * 300),
        ("tiny, in the leaves", list(np.random.default_rng(2).integers(10, 900, 600))),
        ("large ~100 KB", list(np.random.default_rng(3).integers(60_000, 140_000, 40))),
    ],
)
def test_estimate_matches_real_packs_and_the_map_never_grows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, sizes: list[int]
) -> None:
    src = _sized_tree(tmp_path / "src", sizes)
    sources = scan(src)
    opts = PackOptions(check="none")
    est = sizing.estimate_pack(
        sizing.sample_records(sources, opts), len(sources), PSIZE, tables=sizing.tables_bytes(sources)
    )
    result, grown = _pack_counting_growth(monkeypatch, src, tmp_path / "p", check="none")
    real = _real_bytes(tmp_path / "p")
    assert result.count == len(sizes) and not grown, name
    # Never below what LMDB used, and above it by the fixed pages (256 KB) plus at most 2%.
    assert real <= est.expected <= real * 1.02 + (320 << 10), (name, real, est.expected)


def test_sampled_estimate_keeps_a_margin_and_does_not_grow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Sizes that straddle the page boundary, and a sample of 1 in 12 files.
    rng = np.random.default_rng(4)
    sizes = list(rng.choice([OVER_A_PAGE - 100, OVER_A_PAGE + 100], 1200))
    src = _sized_tree(tmp_path / "src", sizes)
    monkeypatch.setattr(sizing, "MAX_STAT", 100)
    sources = scan(src)
    records = sizing.sample_records(sources, PackOptions(check="none"))
    assert len(records.values) == 100
    est = sizing.estimate_pack(records, len(sources), PSIZE, tables=sizing.tables_bytes(sources))
    assert est.margin > 0.05 * est.expected  # a sample of 100: the standard error is a few percent
    _, grown = _pack_counting_growth(monkeypatch, src, tmp_path / "p", check="none")
    real = _real_bytes(tmp_path / "p")
    assert not grown and real <= est.upper
    assert abs(est.expected - real) < est.margin


def test_one_plan_decides_the_map_and_the_free_space_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _sized_tree(tmp_path / "src", list(np.random.default_rng(7).integers(2000, 6000, 200)))
    sources = scan(src)
    plans: list[sizing.Plan] = []
    real_plan = sizing.plan

    def spy(*args: Any, **kwargs: Any) -> sizing.Plan:
        plans.append(real_plan(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(sizing, "plan", spy)
    checked: list[int] = []

    class Usage:
        def __init__(self, path: str) -> None:
            checked.append(1)
            self.free = 1 << 50

    monkeypatch.setattr(shutil, "disk_usage", Usage)
    result, grown = _pack_counting_growth(monkeypatch, src, tmp_path / "p", check="none")
    assert (len(plans), len(checked), result.count, grown) == (1, 1, 200, [])
    plan = plans[0]
    tables = sizing.tables_bytes(sources)
    assert plan.estimate == sizing.estimate_pack(plan.records, len(sources), PSIZE, tables=tables)
    assert plan.page_size == PSIZE and plan.map_size % (1 << 20) == 0
    assert plan.map_size >= plan.estimate.upper + (64 << 20)  # room on top: the map is sparse
    assert _real_bytes(tmp_path / "p") <= plan.estimate.upper
    assert plan.remaining(0) == plan.estimate and plan.remaining(150).upper < plan.estimate.upper
    other = plan.with_page_size(2 * PSIZE)
    assert (other.records, other.page_size) == (plan.records, 2 * PSIZE)
    assert other.estimate == sizing.estimate_pack(plan.records, len(sources), 2 * PSIZE, tables=tables)
    by_mean = real_plan(sources, PackOptions(), mean_size=3000)  # pack_sources(loader=..., mean_size=...)
    assert by_mean.records.mean_only and by_mean.mean_value_size == 3000 + fmt.RECORD_HEADER.size


@pytest.mark.parametrize("store, resize", [("raw", None), ("raw", Resize(20)), ("encoded", Resize(20, quality=95))])
def test_raw_and_resized_packs_are_estimated_from_real_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store: str, resize: Resize | None
) -> None:
    rng = np.random.default_rng(5)
    for i in range(160):
        data, ext = image_bytes("rgb_jpeg", rng, w=int(rng.integers(24, 48)), h=int(rng.integers(16, 40)))
        write(tmp_path / "src" / f"c{i % 2}" / f"{i:03d}{ext}", data)
    sources = scan(tmp_path / "src")
    opts = PackOptions(store=store, resize=resize)
    records = sizing.sample_records(sources, opts)
    assert 1 <= len(records.values) <= 10  # at most one in 16 files is built twice
    est = sizing.estimate_pack(records, len(sources), PSIZE, tables=sizing.tables_bytes(sources))
    _, grown = _pack_counting_growth(monkeypatch, tmp_path / "src", tmp_path / "p", store=store, resize=resize)
    real = _real_bytes(tmp_path / "p")
    assert not grown and real <= est.upper


def test_growth_without_compaction_and_aborted_batches_leave_no_free_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes = list(np.random.default_rng(6).integers(2000, 6000, 300))
    src = _sized_tree(tmp_path / "src", sizes)
    # Only a measured half-empty file would be compacted: a forced copy would show.
    monkeypatch.setattr(output_mod, "_COMPACT_FREE_FRACTION", 0.5)
    seen: list[dict[str, Any]] = []
    compact = output_mod._compact_if_needed

    def spy(partial: str, *, force: bool = False) -> bool:
        env = lmdb.open(partial, readonly=True, lock=False)
        seen.append({"pages": env.info()["last_pgno"] + 1, "free": output_mod._free_fraction(env), "force": force})
        env.close()
        return compact(partial, force=force)

    monkeypatch.setattr(output_mod, "_compact_if_needed", spy)
    ref, grown = _pack_counting_growth(monkeypatch, src, tmp_path / "ref", check="none", commit_every=25)
    assert not grown
    monkeypatch.setattr(sizing, "_MIN_MAP", 1 << 20)
    monkeypatch.setattr(sizing, "_map_size", lambda *args: 1 << 20)  # a dishonest source
    result, grown = _pack_counting_growth(monkeypatch, src, tmp_path / "p", check="none", commit_every=25)
    assert grown  # from 1 MB, for a 1.5 MB pack
    # The aborted transactions left nothing behind: the same pages, as few free, no copy.
    assert seen[1] == seen[0] and not seen[1]["force"] and not result.compacted
    assert seen[1]["free"] < 0.02
    # Every record and table is intact; the files are random bytes packed unchecked, which
    # verify says each read would refuse (Pillow cannot open them), and nothing else.
    problems = verify(tmp_path / "p", progress=False).problems
    assert len(problems) == 300 and {(p.kind, p.message.split(":")[0]) for p in problems} == {
        ("decode", "UnidentifiedImageError")
    }


def test_free_space_check_uses_the_page_estimate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 2.1 KB files take a whole 4 KB page each: the mean alone said half of it.
    src = _sized_tree(tmp_path / "src", [OVERFLOW_AT + 80] * 200)
    sources = scan(src)
    est = sizing.estimate_pack(
        sizing.sample_records(sources, PackOptions(check="none")),
        len(sources),
        PSIZE,
        tables=sizing.tables_bytes(sources),
    )
    by_mean = sources.mean_file_size() * len(sources) * 1.05
    assert est.upper > 1.5 * by_mean

    class Usage:
        def __init__(self, free: int) -> None:
            self.free = free

    monkeypatch.setattr(output_mod.shutil, "disk_usage", lambda path: Usage(int(by_mean * 1.2)))
    with pytest.raises(PackError, match="needs about .* [MG]B but only .* [MG]B are free"):
        pack(src, tmp_path / "p", check="none", progress=False)
    monkeypatch.setattr(output_mod.shutil, "disk_usage", lambda path: Usage(est.upper + (2 << 20)))
    assert pack(src, tmp_path / "p", check="none", progress=False).count == 200


# -- compact sample lists ---------------------------------------------------------------
ODD = ["a/b.jpg", "é/ü 猫.png", os.fsdecode(b"bad\xff\xfename.jpg"), "x y/z.JPG", "", "/abs/p.png"]


def test_pathlist_behaves_like_the_list() -> None:
    paths = PathList(ODD)
    assert len(paths) == len(ODD) and list(paths) == ODD and paths == ODD and paths == tuple(ODD)
    assert [paths[i] for i in range(-len(ODD), len(ODD))] == ODD + ODD
    for a, b in [(0, 3), (2, 6), (1, 1), (4, 100), (-3, None)]:
        assert paths[a:b] == ODD[a:b] and isinstance(paths[a:b], PathList)
    assert paths[::2] == ODD[::2] and paths[1:5][1:3] == ODD[1:5][1:3]
    assert paths.index("x y/z.JPG") == 3 and "é/ü 猫.png" in paths and paths != ODD[:-1]
    assert paths.raw(2) == b"bad\xff\xfename.jpg"
    with pytest.raises(IndexError):
        paths[len(ODD)]
    assert PathList(["a\0b", "c"]) == ["a\0b", "c"]  # NUL inside a path takes the slow way, still right
    for part in (paths, paths[1:4], PathList()):
        back = pickle.loads(pickle.dumps(part))
        assert back == part and list(back) == list(part)
    assert len(pickle.dumps(PathList(["p"] * 1000)[10:20])) < 400  # a slice pickles only its part


def test_labellist_behaves_like_the_list() -> None:
    values = [3, 0, -1, 2**31 - 1, 7]
    labels = LabelList(values)
    assert labels == values and list(labels) == values and labels[1:3] == values[1:3] and labels[-1] == 7
    assert pickle.loads(pickle.dumps(labels)) == values
    with pytest.raises(ValueError, match="int32"):
        LabelList([2**31])


def test_tables_from_compact_lists_equal_the_list_encoding() -> None:
    paths, labels = PathList(ODD), LabelList(range(len(ODD)))
    assert bytes(paths.table()) == encode_paths(ODD)
    assert bytes(paths[2:5].table()) == encode_paths(ODD[2:5])
    assert bytes(paths.table({0, 3})) == encode_paths([p for i, p in enumerate(ODD) if i not in (0, 3)])
    assert labels.table({5}) == encode_labels(list(range(5)))
    assert labels.table() == encode_labels(list(range(len(ODD))))


def _child_describe(sources: SourceList, queue: Any) -> None:
    queue.put((len(sources), list(sources.relpaths), list(sources.labels), sources.abspath(1)))


def test_sourcelist_is_compact_and_travels_to_a_spawned_process(tmp_path: Path) -> None:
    sources = SourceList(str(tmp_path), "list", list(ODD), list(range(6)), [str(i) for i in range(6)], {})
    assert isinstance(sources.relpaths, PathList) and isinstance(sources.labels, LabelList)
    half = sources.relpaths[:3]
    assert SourceList(str(tmp_path), "list", half, sources.labels[:3], [], {}).relpaths == ODD[:3]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_describe, args=(sources, queue))
    proc.start()
    got = queue.get(timeout=60)
    proc.join(60)
    assert got == (6, ODD, list(range(6)), os.path.join(str(tmp_path), ODD[1]))
    with pytest.raises(ValueError, match="labels"):
        SourceList(str(tmp_path), "list", ["a"], [1, 2], [], {})


def test_fingerprint_and_pack_equal_those_of_the_old_lists(tmp_path: Path) -> None:
    """The fingerprint (resume) and the tables are what the list representation gave."""
    import hashlib

    root = tmp_path / "src"
    rng = np.random.default_rng(7)
    names = ["plain.jpg", "ñandú_猫 é.jpg", "with space.jpg"]
    for k, name in enumerate(names):
        write(root / f"c{k}" / name, image_bytes("rgb_jpeg", rng)[0])
    odd_name = os.path.join(os.fsencode(root), b"c2", b"bad\xff.jpg")
    with open(odd_name, "wb") as f:  # not valid UTF-8: round-trips through surrogateescape
        f.write(image_bytes("rgb_jpeg", rng)[0])
    sources = scan(root)
    old = hashlib.sha256()
    for path, label in zip(list(sources.relpaths), list(sources.labels)):
        old.update(os.fsencode(path))
        old.update(b"\0%d\n" % label)
    assert sources.hash_samples(hashlib.sha256()).hexdigest() == old.hexdigest()
    pack(root, tmp_path / "p", progress=False)
    with Reader(tmp_path / "p") as r:
        meta, labels, paths = (bytes(b) for b in r.tables())
        assert paths == encode_paths(list(sources.relpaths)) and labels == encode_labels(list(sources.labels))
        assert r.paths() == list(sources.relpaths) and any(os.fsencode(p).endswith(b"/bad\xff.jpg") for p in r.paths())


# -- opening --------------------------------------------------------------------------------
def _tiny_pack(path: Path, n: int) -> int:
    """A pack of ``n`` tiny records made from memory (no files): returns its path table's size."""
    names = [f"n{i % 1000:08d}/n{i % 1000:08d}_{i:07d}.JPEG" for i in range(n)]
    classes = [str(c) for c in range(1000)]
    sources = SourceList("/nowhere", "list", names, [i % 1000 for i in range(n)], classes, {c: int(c) for c in classes})
    record = encode_record(b"tiny", label=0, encoding="other", width=1, height=1, channels=3)
    pack_sources(
        sources, path, PackOptions(check="none", workers=1, progress=False), loader=lambda i: Loaded(record, "other", 4)
    )
    return len(sources.relpaths.table())  # type: ignore[attr-defined]


def test_opening_makes_no_copy_of_the_path_table(tmp_path: Path) -> None:
    torch_mod = pytest.importorskip("lmdbfolder.torch")
    paths_bytes = _tiny_pack(tmp_path / "p", 100_000)
    assert paths_bytes > 3_000_000
    # Readers hold the manifest (the labels are copied when first asked for); LMDBFolder adds ImageFolder's
    # filter bookkeeping (numpy masks and label counts, ~20 bytes a sample, transient).
    # A copy of the 4 MB path table would put any of them above the table's size.
    for make, bound in ((Reader, 0.25), (open_pack, 0.25), (torch_mod.LMDBFolder, 0.75)):
        tracemalloc.start()
        try:
            opened = make(tmp_path / "p")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert len(opened) == 100_000
        assert peak < bound * paths_bytes, (make, peak)


def test_lmdbfolder_does_not_prefetch_by_default(small_pack: Path) -> None:
    torch_mod = pytest.importorskip("lmdbfolder.torch")
    assert torch_mod.LMDBFolder(small_pack).prefetch is False


# -- the cheap shard check --------------------------------------------------------------------
def test_shard_check_hashes_the_manifest_not_the_tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_small_tree(tmp_path / "src")
    dst = tmp_path / "sh"
    pack_sharded(src, dst, shards=3, progress=False)
    index = json.loads((dst / "index.json").read_text())
    assert all(len(e["manifest_sha256"]) == 64 and len(e["tables_bytes"]) == 2 for e in index["shards"])

    def no_table_hash(*args: Any) -> str:
        raise AssertionError("the tables were hashed on open")

    monkeypatch.setattr(fmt.shards, "tables_digest", no_table_hash)
    reader = open_pack(dst)
    assert [reader.get(i).index for i in reader.shard_offsets[:-1]] == reader.shard_offsets[:-1]


def test_cheap_shard_check_catches_a_repacked_shard_and_old_indexes_still_open(tmp_path: Path) -> None:
    from lmdbfolder.write.shards import pack_shard
    from lmdbfolder.write.sources import scan

    src = make_small_tree(tmp_path / "src")
    dst = tmp_path / "sh"
    pack_sharded(src, dst, shards=3, progress=False)
    index_text = (dst / "index.json").read_text()
    # The same shard packed again from the same files: a new pack (id, created_at), same records.
    pack_shard(scan(src), dst, 1, 3, overwrite=True, progress=False)
    reader = open_pack(dst)
    reader.get(0)
    with pytest.raises(NotAPackError, match="pack_id differs from the index's"):
        reader.get(reader.shard_offsets[1])
    problems = [p.message for p in verify(dst, progress=False).problems]
    for what in ("pack_id", "manifest_sha256", "tables_sha256"):
        assert any(what in m for m in problems), what
    # An index written before pack_ids: the manifest's hash and the tables' lengths.
    old = json.loads(index_text)
    for entry in old["shards"]:
        del entry["pack_id"]
    (dst / "index.json").write_text(json.dumps(old))
    reader = open_pack(dst)
    reader.get(0)
    with pytest.raises(NotAPackError, match="manifest or tables do not match the index's manifest_sha256"):
        reader.get(reader.shard_offsets[1])
    # ... and before manifest_sha256 existed: the old (slow) full hash.
    for entry in old["shards"]:
        del entry["manifest_sha256"], entry["tables_bytes"]
    (dst / "index.json").write_text(json.dumps(old))
    reader = open_pack(dst)
    reader.get(0)
    with pytest.raises(NotAPackError, match="tables_sha256"):
        reader.get(reader.shard_offsets[1])


def test_index_with_a_malformed_manifest_hash_is_refused(tmp_path: Path) -> None:
    src = make_small_tree(tmp_path / "src")
    pack_sharded(src, tmp_path / "sh", shards=2, progress=False)
    index = json.loads((tmp_path / "sh" / "index.json").read_text())
    index["shards"][0]["tables_bytes"] = [1]
    (tmp_path / "sh" / "index.json").write_text(json.dumps(index))
    with pytest.raises(NotAPackError, match="tables_bytes"):
        open_pack(tmp_path / "sh")


def test_opening_a_dataset_does_not_copy_the_label_table(small_pack: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The 5 MB copy at 1.28M samples (its page faults) was half of LMDBFolder's
    # open; the counts checked at open say whether a class is empty.
    torch_mod = pytest.importorskip("lmdbfolder.torch")
    from lmdbfolder.format import PackTables

    real = PackTables.labels
    copies: list[str] = []
    monkeypatch.setattr(PackTables, "labels", lambda *a: copies.append("copy") or real(*a))
    ds = torch_mod.LMDBFolder(small_pack)
    assert copies == [] and len(ds) > 0
    reader = Reader(small_pack)
    assert list(ds.targets) == list(reader.labels) and copies == ["copy", "copy"]
    assert list(reader.class_counts()) == list(np.bincount(np.asarray(reader.labels), minlength=len(reader.classes)))


@pytest.mark.parametrize("order", ["sorted", "shuffled", "unlabelled"])
def test_class_counts_are_bincount(order: str) -> None:
    from lmdbfolder.packfile import class_counts

    rng = np.random.default_rng(7)
    for n in (0, 1, 2, 32767, 32768, 32769, 70001):
        labels = rng.integers(0, 13, n).astype(np.int32)
        if order == "sorted":
            labels.sort()
        elif order == "unlabelled" and n:
            labels[rng.integers(0, n, max(1, n // 7))] = -1
        expected = np.bincount(labels[labels >= 0], minlength=13)
        assert np.array_equal(class_counts(labels, 13), expected)
        assert np.array_equal(class_counts(memoryview(labels.tobytes()), 13), expected)
    almost = np.sort(rng.integers(0, 5, 40000)).astype(np.int32)
    almost[32767], almost[32768] = 4, 0  # one inversion across a chunk boundary
    assert np.array_equal(class_counts(almost, 5), np.bincount(almost, minlength=5))

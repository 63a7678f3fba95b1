"""lmdbfolder bench and warm on tiny trees (what they print; never how fast)."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest

from lmdbfolder.cli import EXIT_CODES, main
from lmdbfolder.errors import NotAPackError, SkippedFilesWarning
from lmdbfolder.read.reader import Reader
from lmdbfolder.tools.cache import can_evict, evict, resident_fraction, warm
from lmdbfolder.torch import LMDBFolder
from lmdbfolder.write.shards import pack_sharded
from lmdbfolder.write.writer import pack


def test_bench_json_chart_and_resized_pack(
    small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chart = tmp_path / "bench.png"
    argv = [
        "bench",
        str(small_tree),
        "--workers",
        "0",
        "1",
        "--limit",
        "0",
        "--repeat",
        "1",
        "--max-size",
        "16",
        "--raw",
    ]
    assert main([*argv, "--json", "--chart", str(chart)]) == 0
    out = capsys.readouterr()
    result = json.loads(out.out)
    contestants = {(m["workload"], m["contestant"]) for m in result["measurements"]}
    for cache in ("cold", "warm"):
        for name in ("ImageFolder (files)", "pack, Reader.get", "pack, get_many + prefetch", "dd data.mdb"):
            assert (f"raw read, {cache}", name) in contestants
    pipeline = (
        "ImageFolder (files)",
        "LMDBFolder default",
        "LMDBFolder + fused crop",
        "LMDBFolder max-size",
    )
    for name in (*pipeline, "LMDBFolder max-size raw"):
        assert ("train pipeline, warm", name) in contestants
        assert ("train pipeline, cold", name) in contestants  # at the largest worker count
        assert ("decode+augment, warm", name) in contestants
    workers = {m["workers"] for m in result["measurements"] if m["workload"] == "train pipeline, warm"}
    assert workers == {0, 1}
    assert all(m["images"] == 12 for m in result["measurements"] if m["workload"].startswith("train"))
    assert result["images"] == 12 and result["pack"]["max_size"]["max_size"] == 16
    assert result["pack"]["max_size_raw"]["size"] > 0
    assert "evicted" in result["eviction"] or not can_evict()
    assert "raw_cold_batched_vs_dd" in result["summary"] and "loader_efficiency" in result["summary"]
    assert (
        result["recommendation"].startswith("Fastest measured: LMDBFolder")
        and "Use LMDBFolder" in result["recommendation"]
    )
    if result["chart"] is not None:
        assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not any(p.startswith("lmdbfolder-bench-") for p in os.listdir(tmp_path))


def test_bench_table_on_an_existing_pack(
    small_tree: Path, small_pack: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", str(small_tree), str(small_pack), "--workers", "0", "--warm-only", "--no-chart", "--repeat", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "contestant" in out and "vs files" in out and "img/s" in out
    assert "raw read, warm" in out and "train pipeline, warm" in out and "raw read, cold" not in out
    assert "Recommendation: " in out
    assert "packed" not in out.split("\n")[0]  # the given pack was used, not a new one


def test_bench_on_a_tree_with_bad_files(small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Real trees hold bad files: the pack skips them, ImageFolder would fail on them; the
    # bench used the tree's file list as pack indices (IndexError past the pack's end).
    good = (small_tree / "class0" / "img0.jpg").read_bytes()
    (small_tree / "class0" / "aa_truncated.jpg").write_bytes(good[: len(good) // 2])
    (small_tree / "class2" / "zero.jpg").write_bytes(b"")
    argv = ["bench", str(small_tree), "--workers", "0", "--repeat", "1", "--limit", "0", "--warm-only", "--no-chart"]
    assert main([*argv, "--json"]) == 0
    out = capsys.readouterr()
    result = json.loads(out.out)
    assert result["images"] == 12 and result["summary"]["left_out"] == 2
    assert "2 source files of " in out.err and "are not in the pack" in out.err
    pipeline = [m for m in result["measurements"] if m["workload"].startswith("train")]
    assert pipeline and all(m["images"] == 12 for m in pipeline)
    assert all(m["cpu_ms_per_image"] is not None and m["cpu_seconds"] >= 0 for m in pipeline)
    # the same with a pack given, and the report's words
    with pytest.warns(SkippedFilesWarning, match="2 source files could not be packed"):
        pack(small_tree, tmp_path / "given", progress=False)
    assert main([*argv[:2], str(tmp_path / "given"), *argv[2:]]) == 0
    text = capsys.readouterr().out
    assert "left out: 2 source files that the pack skipped" in text and "Recommendation: " in text
    assert "CPU ms/img" in text and "others" in text and "spread" in text


def test_bench_legend_and_advice_name_the_real_defaults(small_tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", str(small_tree), "--workers", "0", "--repeat", "1", "--limit", "0", "--warm-only", "--no-chart"]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    legend = result["config"]["settings"]
    assert "Pillow decoder" not in legend["LMDBFolder default"]
    assert "its default decoder='auto'" in legend["LMDBFolder default"]
    assert "decoder='auto'" not in result["recommendation"]  # already the default: nothing to pass


def test_warm_command(small_pack: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["warm", str(small_pack), "--no-progress"]) == 0
    assert "in the page cache before" in capsys.readouterr().out
    assert main(["warm", str(small_pack), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["nbytes"] == os.path.getsize(small_pack / "data.mdb")
    assert report["resident_after"] in (None, 1.0)
    assert main(["warm", str(small_pack / "nope")]) == 3


@pytest.mark.parametrize("gone", ["shard", "data.mdb"])
def test_warm_names_a_missing_shard(
    small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], gone: str
) -> None:
    # It said "the system refused: .../data.mdb: No such file or directory" with the hint
    # that a folder on the way may be missing.
    pack_sharded(small_tree, tmp_path / "s", shards=3, progress=False)
    shard = tmp_path / "s" / "train-00001-of-00003.lmdb"
    if gone == "shard":
        shutil.rmtree(shard)
    else:
        (shard / "data.mdb").unlink()
    with pytest.raises(NotAPackError, match="train-00001-of-00003.lmdb") as info:
        warm(tmp_path / "s", progress=False)
    assert "missing" in str(info.value) and "system refused" not in str(info.value)
    assert main(["warm", str(tmp_path / "s"), "--no-progress"]) == EXIT_CODES["not a pack"]
    err = capsys.readouterr().err
    assert "train-00001-of-00003.lmdb" in err and "missing" in err and "copy" in err


def test_evict_and_resident_fraction(small_pack: Path) -> None:
    data = str(small_pack / "data.mdb")
    warm(small_pack, progress=False)
    frac = resident_fraction(data)
    assert frac is None or frac == 1.0
    report = evict([data, str(small_pack / "missing")])
    assert report.supported == can_evict()
    assert report.files == 2 and report.failed == (1 if can_evict() else 0)
    assert report.resident_after is None or 0.0 <= report.resident_after <= 1.0
    assert "evicted" in report.describe()


def test_get_many_matches_get(small_pack: Path) -> None:
    with Reader(small_pack) as r:
        order = [5, 0, 11, 5, -1]
        for prefetch in (True, False):
            many = r.get_many(order, prefetch=prefetch)
            assert [m.index for m in many] == [5, 0, 11, 5, 11]
            for m in many:
                one = r.get(m.index)
                assert bytes(m.payload) == bytes(one.payload) and m.label == one.label
        assert r.get_many([]) == []
        with pytest.raises(IndexError):
            r.get_many([0, 12])


def test_dataset_getitems_is_getitem(small_pack: Path) -> None:
    ds = LMDBFolder(small_pack)
    batch = ds.__getitems__([2, 0, 2])
    for (img, t), i in zip(batch, [2, 0, 2]):
        ref, rt = ds[i]
        assert t == rt and img.tobytes() == ref.tobytes()


def test_evict_says_when_an_open_reader_keeps_pages(small_pack: Path) -> None:
    if not can_evict():
        pytest.skip("no posix_fadvise here")
    data = str(small_pack / "data.mdb")
    with Reader(small_pack) as r:
        for rec in r:
            bytes(rec.payload)  # map every page
        report = evict([data], always_check=[data])
    if report.resident_after is not None and report.resident_after > 0.1:
        assert "cannot be evicted" in report.describe()


@pytest.mark.parametrize("chart", ["no-such-folder/bench.png", "bench.notatype", ".", "made"])
def test_bench_refuses_a_chart_it_cannot_write_before_measuring(
    small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], chart: str
) -> None:
    # It once measured for minutes, then failed on the chart and lost every number.
    (tmp_path / "made.png").mkdir()  # "made" is written as made.png, a folder here
    argv = ["bench", str(small_tree), "--workers", "0", "--repeat", "1", "--limit", "4", "--warm-only"]
    assert main([*argv, "--chart", str(tmp_path / chart)]) == EXIT_CODES["usage"]
    out = capsys.readouterr()
    assert f"--chart {tmp_path / chart}" in out.err and "--no-chart" in out.err
    assert "raw read" not in out.out + out.err and "packs for the bench" not in out.out + out.err


@pytest.mark.parametrize("as_json", [False, True])
def test_a_chart_that_fails_to_draw_keeps_the_measurements(
    small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, as_json: bool
) -> None:
    from lmdbfolder.bench import chart

    def disk_full(result: object, path: str) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(chart, "write_chart", disk_full)
    argv = ["bench", str(small_tree), "--workers", "0", "--repeat", "1", "--limit", "4", "--warm-only"]
    png = tmp_path / "bench.png"
    assert main([*argv, "--chart", str(png), *(["--json"] if as_json else [])]) == EXIT_CODES["other error"]
    out = capsys.readouterr()
    if as_json:
        result = json.loads(out.out)
        assert result["measurements"] and result["chart"] is None
    else:
        assert "Recommendation: " in out.out and "train pipeline, warm" in out.out
    assert f"the chart {png} was not written" in out.err and "measurements above are complete" in out.err


def test_bench_says_when_src_is_a_pack(small_pack: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", str(small_pack), "--workers", "0", "--no-chart"]) == EXIT_CODES["source error"]
    err = capsys.readouterr().err
    assert "is a pack: bench takes the image folder first and its pack second" in err
    assert f"(`lmdbfolder bench TREE {small_pack}`)" in err


@pytest.mark.parametrize("tree", ["flat", "empty class", "no image"])
def test_bench_on_a_tree_imagefolder_refuses_says_what_to_do(
    small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], tree: str
) -> None:
    # The hints were pack's (--flat, --allow-empty): flags bench does not have.
    src = tmp_path / "src"
    src.mkdir()
    jpeg = (small_tree / "class0" / "img0.jpg").read_bytes()
    if tree == "flat":
        (src / "a.jpg").write_bytes(jpeg)
    elif tree == "empty class":
        (src / "a").mkdir()
        (src / "a" / "a.jpg").write_bytes(jpeg)
        (src / "b").mkdir()
        (src / "b" / "notes.txt").write_text("no image")
    else:
        (src / "a").mkdir()
        (src / "a" / "a.jpg").write_bytes(b"not a jpeg")
    argv = ["bench", str(src), "--workers", "0", "--repeat", "1", "--warm-only", "--no-chart"]
    assert main(argv) == EXIT_CODES["source error"]
    err = capsys.readouterr().err
    hint = err.split("hint: ", 1)[1]
    assert "--flat" not in hint and "--allow-empty" not in hint
    assert "ImageFolder" in hint and "<class>" in hint


def test_bench_escapes_a_skipped_file_name_in_its_left_out_line(
    small_tree: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The live "skipped" line was escaped, the bench's own note on it was not.
    (small_tree / "class0" / "zz\x1b[2J\rgone.jpg").write_bytes(b"not an image")
    argv = ["bench", str(small_tree), "--workers", "0", "--repeat", "1", "--limit", "4", "--warm-only", "--no-chart"]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert "\x1b" not in out.out + out.err
    assert "skipped when packing: class0/zz\\x1b[2J\\x0dgone.jpg: not an image" in out.out


def test_bench_refuses_a_chart_in_a_read_only_folder_before_measuring(small_tree: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    from conftest import as_unprivileged

    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    argv = ["bench", str(small_tree), "--workers", "0", "--repeat", "1", "--limit", "4", "--warm-only"]
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
    cmd = as_unprivileged([sys.executable, "-m", "lmdbfolder", *argv, "--chart", str(folder / "b.png")])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == EXIT_CODES["usage"], proc.stderr
    assert "cannot be written here (permission denied)" in proc.stderr and "raw read" not in proc.stdout

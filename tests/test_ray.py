"""The Ray backend on a local cluster (ray.init(num_cpus=2), one per session): one task per
shard, the same resume and bad-file rules as a local pack, progress, and a result equal to
the single-process pack sample for sample."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import make_small_tree, write
from lmdbfolder import open_pack, pack
from lmdbfolder.cli import EXIT_CODES, main
from lmdbfolder.errors import SourceError
from lmdbfolder.format import SHARD_INDEX_FILE, shard_name
from lmdbfolder.write.ray import pack_ray

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_cluster")]


def _equal(a_path: Path, b_path: Path) -> None:
    with open_pack(a_path) as a, open_pack(b_path) as b:
        assert len(a) == len(b) and a.paths() == b.paths() and list(a.labels) == list(b.labels)
        for i in range(len(a)):
            ra, rb = a.get(i), b.get(i)
            assert bytes(ra.payload) == bytes(rb.payload) and (ra.label, ra.encoding) == (rb.label, rb.encoding)


def test_ray_pack_equals_single_pack(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tree = make_small_tree(tmp_path / "t", classes=4, per_class=6)
    write(tree / "class3" / "img0_bad.jpg", b"\xff\xd8 not really")
    pack(tree, tmp_path / "single", progress=False)
    args = ["pack", str(tree), str(tmp_path / "sh"), "--shards", "4", "--json", "--ray"]
    assert main(args) == 0  # uses the cluster this process already has
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_shards"] == 4 and summary["count"] == 24
    assert [s["path"] for s in summary["skipped"]] == ["class3/img0_bad.jpg"]
    assert (tmp_path / "sh" / SHARD_INDEX_FILE).is_file()
    _equal(tmp_path / "single", tmp_path / "sh")
    # rerun after the index was lost: every shard is kept, progress reaches the total
    (tmp_path / "sh" / SHARD_INDEX_FILE).unlink()
    seen: list[tuple[int, int]] = []
    result = pack_ray(tree, tmp_path / "sh", shards=4, progress=False, on_progress=lambda d, t: seen.append((d, t)))
    assert all(s.kept for s in result.shards) and seen[-1] == (25, 25)
    _equal(tmp_path / "single", tmp_path / "sh")


def test_ray_strict_stops_the_shard_then_a_rerun_resumes(tmp_path: Path) -> None:
    tree = make_small_tree(tmp_path / "t", classes=3, per_class=6)
    write(tree / "class1" / "img4_bad.jpg", b"")  # source 11 of 19: in shard 2 of 4 (sources 9..13)
    with pytest.raises(SourceError, match="img4_bad.jpg") as info:
        pack_ray(tree, tmp_path / "sh", shards=4, strict=True, commit_every=1, progress=False)
    assert shard_name("train", 2, 4) in str(info.value) and "rerun" in str(info.value)
    done = sorted(p.name for p in (tmp_path / "sh").iterdir())
    assert done == [shard_name("train", i, 4) for i in (0, 1)] + [
        shard_name("train", 2, 4) + ".partial",
        shard_name("train", 3, 4),
    ]
    result = pack_ray(tree, tmp_path / "sh", shards=4, commit_every=1, progress=False)
    assert [s.kept for s in result.shards] == [True, True, False, True]
    assert result.shards[2].resumed_from == 2  # the two files before the bad one were committed
    assert [p for p, _ in result.skipped] == ["class1/img4_bad.jpg"]
    pack(tree, tmp_path / "single", progress=False)
    _equal(tmp_path / "single", tmp_path / "sh")


def test_a_task_failing_with_another_exception_names_it_plainly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Not an lmdbfolder error (here the staging path is a file): the message said
    # "RayTaskError(FileExistsError): ['...']", the last line of Ray's text as a list.
    tree = make_small_tree(tmp_path / "t", classes=2, per_class=2)
    write(tmp_path / "a_file", b"x")
    args = ["pack", str(tree), str(tmp_path / "sh"), "--shards", "2", "--no-progress", "--ray"]
    assert main([*args, "--staging", str(tmp_path / "a_file")]) == EXIT_CODES["pack failed"]
    err = capsys.readouterr().err
    assert f"the Ray task packing {shard_name('train', 0, 2)} failed: FileExistsError: [Errno 17]" in err
    assert str(tmp_path / "a_file") in err and "(raised at " in err and "line " in err
    assert "RayTaskError" not in err and "['" not in err and "Traceback" not in err

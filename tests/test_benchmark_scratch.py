"""The benchmarks' scratch: a folder of their own, removed at the end; the user's folder untouched.

Each benchmark that writes copies of a tree, packs or downloads is run here as a
user runs it (``python benchmarks/X.py``, a subprocess, tiny inputs) with its
work-folder option pointing at a folder that already holds the user's files
under the names the benchmark uses inside its scratch (``src``, ``old``,
``single``, ``tree``, ``pack.lmdb``, ``packs/0-N.lmdb``...). Afterwards the
folder must hold exactly what it held before: nothing written, nothing deleted,
no scratch left behind (a run of ``bench_update.py`` on a 100k-image tree left
17 GB).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from conftest import make_photo_sources

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"


def _load_workdir():
    spec = importlib.util.spec_from_file_location("bench_workdir", BENCH / "workdir.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root``: a file's bytes, ``None`` for a folder."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = None
        for f in filenames:
            path = os.path.join(dirpath, f)
            out[os.path.relpath(path, root)] = Path(path).read_bytes()
    return out


def users_folder(root: Path, names: list[str]) -> Path:
    """A folder of the user's own files, one folder per name (a file inside each)."""
    root.mkdir()
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / "mine.txt").write_text(f"the user's own {name}\n")
    return root


def tiny_tree(root: Path, classes: int = 3, per_class: int = 10) -> Path:
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (32 + i, 24), (40 * c, 9 * i, 100)).save(root / f"class{c}" / f"{i:03d}.jpg", quality=90)
    return root


def run_bench(script: str, *args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), *map(str, args)], capture_output=True, text=True, env=env, timeout=280
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


# -- the helper ---------------------------------------------------------------------------------
def test_scratch_is_a_new_folder_inside_the_one_named_and_is_removed(tmp_path: Path) -> None:
    scratch = _load_workdir().scratch
    parent = users_folder(tmp_path / "work", ["src", "old"])
    before = snapshot(parent)
    with scratch(str(parent), "bench-x-") as path:
        assert Path(path).parent == parent and Path(path).name.startswith("bench-x-")
        assert os.listdir(path) == []
        (Path(path) / "src").mkdir()  # the benchmark's own src, beside the user's
        (Path(path) / "src" / "big").write_bytes(b"x" * 1000)
    assert snapshot(parent) == before


def test_scratch_is_removed_when_the_run_fails_and_kept_when_asked(tmp_path: Path, capsys) -> None:
    scratch = _load_workdir().scratch
    parent = tmp_path / "not-yet"  # made if missing
    with pytest.raises(RuntimeError), scratch(str(parent), "bench-x-") as path:
        (Path(path) / "partial").write_bytes(b"x")
        raise RuntimeError("the benchmark failed")
    assert os.listdir(parent) == []
    with scratch(str(parent), "bench-x-", keep=True) as path:
        (Path(path) / "result").write_bytes(b"x")
    assert (Path(path) / "result").exists()
    assert path in capsys.readouterr().err


# -- the benchmarks, as users run them -----------------------------------------------------------
def test_bench_update_leaves_the_work_folder_as_it_found_it(tmp_path: Path) -> None:
    pytest.importorskip("torchvision")
    tree = tiny_tree(tmp_path / "tree")
    tree_before = snapshot(tree)
    work = users_folder(tmp_path / "work", ["src", "old", "fresh", "upd", "killed"])
    before = snapshot(work)
    proc = run_bench(
        "bench_update.py",
        *("--tree", tree, "--work", work, "--rounds", "1", "--kills", "1", "--json", tmp_path / "r.json"),
    )
    assert "equals the fresh pack: True" in proc.stdout
    assert snapshot(work) == before
    assert snapshot(tree) == tree_before


def test_bench_update_keep_leaves_its_scratch_and_says_where(tmp_path: Path) -> None:
    pytest.importorskip("torchvision")
    tree = tiny_tree(tmp_path / "tree", classes=2, per_class=6)
    work = tmp_path / "work"
    proc = run_bench(
        "bench_update.py",
        *("--tree", tree, "--work", work, "--rounds", "1", "--kills", "0", "--keep", "--json", tmp_path / "r.json"),
    )
    (kept,) = os.listdir(work)
    assert str(work / kept) in proc.stderr
    assert {"src", "old", "fresh", "upd"} <= set(os.listdir(work / kept))


def test_bench_shards_leaves_the_out_folder_as_it_found_it(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    tree = tiny_tree(tmp_path / "tree")
    out = users_folder(tmp_path / "out", ["single", "ray"])
    before = snapshot(out)
    proc = run_bench("bench_shards.py", "--tree", tree, "--shards", "2", "--cpus", "1", "--repeat", "1", "--out", out)
    assert "equal sample for sample: True" in proc.stdout
    assert snapshot(out) == before


def test_bench_s3_leaves_the_workdir_as_it_found_it(tmp_path: Path) -> None:
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    work = users_folder(tmp_path / "work", ["tree", "pack", "bulk", "copy", "cache"])
    (work / "one.mdb").write_bytes(b"the user's own file")
    before = snapshot(work)
    proc = run_bench("bench_s3.py", "--shards", "2", "--shard-mb", "0.3", "--repeat", "1", "--workdir", work)
    assert "copy / bulk download" in proc.stdout
    assert snapshot(work) == before


def test_check_map_model_leaves_the_work_folder_as_it_found_it(tmp_path: Path) -> None:
    from lmdbfolder import pack

    work = users_folder(tmp_path / "work", ["tiny_10_900_B"])
    pack(tiny_tree(tmp_path / "tree", classes=2, per_class=3), work / "pack.lmdb", progress=False)  # the user's pack
    before = snapshot(work)
    proc = run_bench("check_map_model.py", "--synthetic", "3", "--work", work)
    assert "tiny 10-900 B" in proc.stdout
    assert snapshot(work) == before


def photolike_sources(tmp_path: Path) -> dict[str, str]:
    """The environment that makes benchmarks/photolike.py take generated stand-ins for its
    source photographs: the Debian wallpaper packages they come from are not installed by
    ``make test`` (a fresh machine has none), and a test uses only what it installs."""
    spec = importlib.util.spec_from_file_location("bench_photolike", BENCH / "photolike.py")
    assert spec is not None and spec.loader is not None
    photolike = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = photolike  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(photolike)
    finally:
        del sys.modules[spec.name]
    folder = make_photo_sources(tmp_path / "photo-sources", len(photolike.SOURCES))
    return {"PHOTOLIKE_SOURCES": str(folder)}


def test_bench_scale_keeps_only_its_tree_in_the_data_folder(tmp_path: Path) -> None:
    data = users_folder(tmp_path / "data", ["packs", "packs/0-1000.lmdb"])
    before = snapshot(data)
    run_bench(
        "bench_scale.py",
        *("--sizes", "1000", "--repeat", "1", "--data", data, "--json", tmp_path / "r.json"),
        *("--skip", "tar", "open", "workers", "read", "sharded"),
        env=photolike_sources(tmp_path),
    )
    after = snapshot(data)
    assert {k: v for k, v in after.items() if not k.startswith("small-1000")} == before
    assert "small-1000" in after  # the tree, kept on purpose for the next run

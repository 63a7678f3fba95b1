"""The command line, through main(argv) and as real subprocesses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from lmdbfolder.cli import EXIT_CODES, main
from lmdbfolder.format import KEY, META_KEY
from lmdbfolder.read.reader import Reader


def run(*argv: str) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, "-m", "lmdbfolder", *argv], capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def test_pack_info_verify_json(small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p"
    assert main(["pack", str(small_tree), str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["count"] == 12 and summary["path"] == str(out)
    assert main(["info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["count"] == 12 and info["num_classes"] == 3 and info["format_version"] == 2
    assert info["encodings"] == {"jpeg": 12} and info["size_on_disk"] > 0
    assert main(["verify", str(out), "--json", "--decode"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["checked"] == 12


def test_human_output(small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p"
    assert main(["pack", str(small_tree), str(out), "--no-progress"]) == 0
    assert "packed 12 images" in capsys.readouterr().out
    assert main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "samples:" in text and "12" in text and "class0, class1, class2" in text
    assert main(["verify", str(out), "--no-progress"]) == 0
    assert "12 of 12 records checked" in capsys.readouterr().out


def test_pack_options(small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    listing = tmp_path / "l.txt"
    listing.write_text("class1/img1.jpg 1\n")
    assert main(["pack", str(small_tree), str(tmp_path / "l"), "--list", str(listing), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["count"] == 1
    args = ["pack", str(small_tree), str(tmp_path / "f"), "--flat", "--store", "raw", "--commit-every", "5", "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["store"] == "raw"
    assert main(["pack", str(small_tree), str(tmp_path / "f"), "--overwrite", "--json"]) == 0


def test_errors_go_to_stderr_with_exit_codes(
    small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p"
    assert main(["pack", str(small_tree), str(out), "--json"]) == 0
    capsys.readouterr()
    assert main(["pack", str(small_tree), str(out), "--check", "decode"]) == EXIT_CODES["output exists"]
    err = capsys.readouterr().err
    assert err.startswith("lmdbfolder pack: error: ") and "already holds a pack" in err and "--overwrite" in err
    assert main(["info", str(tmp_path / "nothing")]) == EXIT_CODES["not a pack"]
    assert "no such file" in capsys.readouterr().err
    assert main(["pack", str(tmp_path / "nosrc"), str(tmp_path / "q")]) == EXIT_CODES["source error"]
    assert "does not exist" in capsys.readouterr().err
    bad_list = tmp_path / "bad.txt"
    bad_list.write_text("a.jpg\n")
    assert main(["pack", str(small_tree), str(tmp_path / "q"), "--list", str(bad_list)]) == EXIT_CODES["source error"]
    assert f"{bad_list}:1" in capsys.readouterr().err
    assert main(["pack", str(small_tree)]) == EXIT_CODES["usage"]
    assert main(["frobnicate"]) == EXIT_CODES["usage"]
    capsys.readouterr()
    for option, value, said in [("--commit-bytes", "0", "must be at least 1, got 0"), ("--commit-every", "x", "'x'")]:
        assert main(["pack", str(small_tree), str(tmp_path / "r"), option, value]) == EXIT_CODES["usage"]
        err = capsys.readouterr().err
        assert f"argument {option}: " in err and said in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()


def test_verify_exit_code_on_damage(small_pack: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = lmdb.open(str(small_pack), map_size=1 << 30)
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(KEY.pack(2)))
        value[-1] ^= 0xFF
        txn.put(KEY.pack(2), bytes(value))
    env.close()
    assert main(["verify", str(small_pack), "--no-progress"]) == EXIT_CODES["problems found"]
    captured = capsys.readouterr()
    assert "checksum: record 2 (class0/img2.jpg)" in captured.err
    assert "1 problem in 1 record" in captured.out
    assert main(["verify", str(small_pack), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["bad_indices"] == [2]


def test_wrong_version_message(small_pack: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = lmdb.open(str(small_pack), map_size=1 << 30)
    with env.begin(write=True) as txn:
        meta = json.loads(txn.get(META_KEY))
        meta["format_version"] = 5
        txn.put(META_KEY, json.dumps(meta).encode())
    env.close()
    assert main(["info", str(small_pack)]) == EXIT_CODES["not a pack"]
    assert "format version 5, this lmdbfolder reads versions 1, 2, 3 and 4" in capsys.readouterr().err


def test_subprocess_module_and_console_script(small_tree: Path, tmp_path: Path) -> None:
    code, out, err = run("pack", str(small_tree), str(tmp_path / "p"), "--no-progress")
    assert code == 0, err
    assert "packed 12 images" in out
    code, out, err = run("info", str(tmp_path / "p"), "--json")
    assert code == 0 and json.loads(out)["count"] == 12
    code, out, err = run("info", str(tmp_path / "missing"))
    assert code == EXIT_CODES["not a pack"] and "hint:" in err and out == ""
    script = shutil.which("lmdbfolder", path=os.path.dirname(sys.executable))
    assert script, "the console script is installed next to the interpreter"
    proc = subprocess.run([script, "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("lmdbfolder ")


def test_progress_bar_on_request(small_tree: Path, tmp_path: Path) -> None:
    # A pack command shows a tqdm bar with img/s and MB/s; forced on here via the library call.
    from lmdbfolder.write.writer import pack

    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from lmdbfolder import pack; pack({str(small_tree)!r}, {str(tmp_path / 'p')!r}, progress=True)",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "12/12" in proc.stderr and "img/s" in proc.stderr and "MB/s" in proc.stderr
    del pack


def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    code, out, err = run(
        "demo", "--dir", str(tmp_path / "demo"), "--classes", "2", "--per-class", "6", "--workers", "0"
    )
    assert code == 0, err
    assert "verified 12 records" in out
    assert "LMDBFolder == ImageFolder" in out and ": yes" in out
    assert "ImageFolder (files)" in out and "vs files" in out and "train pipeline" in out
    assert "LMDBFolder + fused crop" in out and "Recommendation:" in out
    assert f"work folder: {tmp_path / 'demo'} (kept" in out
    assert "  train pipeline, warm, 0 workers, LMDBFolder default: " in out  # the bench's progress, as it goes
    code, out, err = run("demo", "--classes", "2", "--per-class", "3", "--workers", "0", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert "(temporary, deleted at the end" in err and "deleted the work folder " in err
    assert result["verified"] and result["same_as_imagefolder"] and result["images"] == 6
    assert result["bench"]["measurements"] and result["bench"]["recommendation"]


@pytest.mark.parametrize("theirs", ["images.lmdb", "images", "bench"])
def test_demo_dir_never_replaces_what_the_demo_did_not_make(
    small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], theirs: str
) -> None:
    # `demo --dir D` packed with overwrite=True into D/images.lmdb: a pack of the user's
    # own images there was replaced by the demo's, without a word.
    work = tmp_path / "work"
    work.mkdir()
    if theirs == "images.lmdb":
        assert main(["pack", str(small_tree), str(work / theirs), "--no-progress"]) == 0
    else:
        shutil.copytree(small_tree, work / theirs)
    before = sorted(p.relative_to(work) for p in work.rglob("*"))
    capsys.readouterr()
    argv = ["demo", "--dir", str(work), "--classes", "2", "--per-class", "3", "--workers", "0"]
    assert main(argv) == EXIT_CODES["usage"]
    err = capsys.readouterr().err
    assert f"--dir {work}" in err and theirs in err and "new or empty folder" in err
    assert sorted(p.relative_to(work) for p in work.rglob("*")) == before
    if theirs == "images.lmdb":
        with Reader(work / theirs) as r:
            assert r.meta["count"] == 12


def test_demo_dir_runs_again_in_its_own_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--dir", str(tmp_path / "d"), "--classes", "2", "--per-class", "3", "--workers", "0"]
    assert main(argv) == 0
    assert main(argv) == 0  # its own folder: kept, used again
    assert "2. packed them into" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["info", "pack"])
def test_output_into_a_closed_pipe_is_not_an_error(small_tree: Path, tmp_path: Path, command: str) -> None:
    # `lmdbfolder info P | head -1`: the reader went away. BrokenPipeError is an OSError, so
    # it reached the "system refused" branch first: "error: the system refused: : Broken
    # pipe", exit 7 (6, "pack failed", for a pack that had succeeded).
    argv = ["info", str(tmp_path / "p")] if command == "info" else ["pack", str(small_tree), str(tmp_path / "q")]
    if command == "info":
        assert main(["pack", str(small_tree), str(tmp_path / "p"), "--no-progress"]) == 0
    read, write = os.pipe()
    os.close(read)  # every write to stdout fails with EPIPE
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # each print writes (no buffer to fill first)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "lmdbfolder", *argv, *(["--no-progress"] if command == "pack" else [])],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            env=env,
        )
    finally:
        os.close(write)
    assert proc.returncode == 0 and proc.stderr == "", (proc.returncode, proc.stderr)


def test_a_broken_pipe_of_our_own_is_still_an_error() -> None:
    # Only a closed stdout is "not an error of ours": a BrokenPipeError from anything else
    # (a reader process, a connection) while stdout is fine must not end in silence with 0.
    code = (
        "import argparse, sys\n"
        "from lmdbfolder.cli.common import run_command\n"
        "def run(args): raise BrokenPipeError(32, 'Broken pipe')\n"
        "sys.exit(run_command(argparse.Namespace(run=run, command='pack')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_CODES["pack failed"] and "Broken pipe" in proc.stderr, proc.stderr

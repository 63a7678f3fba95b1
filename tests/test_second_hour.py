"""What a user meets in the second hour (issue 23): skipped files and option names in Python,
`lmdbfolder doctor` and the slow-path warning, the next step after a pack and `pack --dry-run`,
class names for `import`, `show`'s exit code, `info`'s layout, the shards message, --help names."""

from __future__ import annotations

import json
import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Any, Callable

import lmdb
import numpy as np
import pytest

from conftest import image_bytes, write
from lmdbfolder.cli import EXIT_CODES, build_parser, main
from lmdbfolder.errors import NotAPackError, OptionError, SkippedFilesWarning, SlowPathWarning
from lmdbfolder.read.capabilities import Capabilities
from lmdbfolder.read.opening import open_pack
from lmdbfolder.read.sharded import ShardedReader
from lmdbfolder.tools.importing import import_legacy
from lmdbfolder.tools.info import format_info, pack_info, pack_statistics
from lmdbfolder.write.options import Resize
from lmdbfolder.write.shards import pack_sharded, write_index
from lmdbfolder.write.writer import pack


def add_bad_files(tree: Path) -> None:
    good = (tree / "class0" / "img0.jpg").read_bytes()
    write(tree / "class0" / "cut.jpg", good[: len(good) // 2])
    write(tree / "class1" / "empty.jpg", b"")


# -- 5. pack() in Python says what it skipped ----------------------------------------------------------------
def test_python_pack_warns_about_skipped_files(small_tree: Path, tmp_path: Path) -> None:
    add_bad_files(small_tree)
    with pytest.warns(SkippedFilesWarning) as seen:
        result = pack(small_tree, tmp_path / "p", progress=False)
    assert len(seen) == 1
    message = str(seen[0].message)
    assert message.startswith("2 source files could not be packed and were skipped (class0/cut.jpg: truncated")
    assert str(tmp_path / "p" / "skipped.txt") in message and ".skipped" in message
    assert [p for p, _ in result.skipped] == ["class0/cut.jpg", "class1/empty.jpg"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", SkippedFilesWarning)
        again = pack(small_tree, tmp_path / "p", progress=False)  # nothing done: nothing new to say
    assert again.already_packed and len(again.skipped) == 2
    with pytest.warns(SkippedFilesWarning, match="each shard's skipped.txt"):
        pack_sharded(small_tree, tmp_path / "sharded", shards=2, progress=False)


def test_the_command_line_lists_skipped_files_itself(
    small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    add_bad_files(small_tree)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SkippedFilesWarning)  # not warned twice
        assert main(["pack", str(small_tree), str(tmp_path / "p"), "--no-progress"]) == 0
        assert main(["pack", str(small_tree), str(tmp_path / "s"), "--shards", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.count("skipped 2 files (listed in ") == 2 and "  class1/empty.jpg: empty file (0 bytes)" in out


# -- 6. the command line's option names work in Python -------------------------------------------------------
def test_cli_names_of_the_resize_options_work_as_keywords(small_tree: Path, tmp_path: Path) -> None:
    result = pack(small_tree, tmp_path / "p", max_size=16, quality=80, progress=False)
    assert result.count == 12
    with open_pack(tmp_path / "p") as r:
        assert r.meta["params"]["max_size"] == 16 and r.meta["params"]["quality"] == 80
        assert max(r.get(0).width, r.get(0).height) <= 16
    # the same pack as resize=Resize(16, 80): a rerun with the Python form has nothing to do
    assert pack(small_tree, tmp_path / "p", resize=Resize(16, 80), progress=False).already_packed
    with pytest.raises(OptionError, match="quality needs max_size"):
        pack(small_tree, tmp_path / "q", quality=80, progress=False)
    with pytest.raises(OptionError, match="not both"):
        pack(small_tree, tmp_path / "q", max_size=16, resize=Resize(16), progress=False)


@pytest.mark.parametrize(
    "keyword, said",
    [
        ("maxsize", "'maxsize' (did you mean max_size?)"),
        ("resize_sides", "'resize_sides' (did you mean resize_side?)"),
        ("no_space_check", "'no_space_check' (the command line's --no-space-check is space_check=False)"),
        ("commit_evry", "'commit_evry' (did you mean commit_every?)"),
    ],
)
def test_an_unknown_keyword_names_the_field(small_tree: Path, tmp_path: Path, keyword: str, said: str) -> None:
    with pytest.raises(TypeError) as info:
        pack(small_tree, tmp_path / "p", **{keyword: 1})
    assert said in str(info.value) and "resize=Resize(max_size, quality, side, format)" in str(info.value)
    assert not (tmp_path / "p").exists()


# -- 7. lmdbfolder doctor, and one warning when the compiled module is missing --------------------------------
def test_doctor_says_what_is_active(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "compiled crop decoder (lmdbfolder.read._crops): " in out and "decoder='auto'" in out
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) >= {"compiled", "decoders", "auto_decoder", "checksums", "libraries", "advice"}
    assert report["decoders"]["pillow"] == {"available": True, "matches_pillow": True, "why_not": None}
    if report["compiled"]["exact_resize"]:  # which vectors its passes use, in both forms
        simd = report["compiled"]["exact_resize_simd"]
        assert simd in ("avx512-vbmi", "avx2", "sse4.1", "none")
        assert f"exact resize into the batch (Pillow's bilinear, compiled): on ({simd})" in out


def test_doctor_says_what_to_install_without_the_compiled_module(
    capabilities: Callable[..., Capabilities], capsys: pytest.CaptureFixture[str]
) -> None:
    capabilities(compiled=None)  # as after `CC=false pip install .`
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "compiled crop decoder (lmdbfolder.read._crops): NOT built" in out
    assert "region decoding (only the crop's rows and columns): off (the compiled helper" in out
    assert "to read faster here:" in out and "libjpeg-dev" in out and "pip install --force-reinstall" in out


def test_one_warning_at_first_use_without_the_compiled_module(
    small_pack: Path, capabilities: Callable[..., Capabilities]
) -> None:
    from lmdbfolder.torch import LMDBFolder

    capabilities(compiled=None)
    with pytest.warns(SlowPathWarning, match="lmdbfolder doctor") as seen:
        LMDBFolder(small_pack)
        LMDBFolder(small_pack)
    assert len([w for w in seen if issubclass(w.category, SlowPathWarning)]) == 1  # once per process
    for answers in ({}, {"compiled": None}):
        capabilities(**answers)  # built: nothing to say; decoder="pillow": asked for the slow path
        with warnings.catch_warnings():
            warnings.simplefilter("error", SlowPathWarning)
            LMDBFolder(small_pack, decoder="pillow")
            if not answers:
                LMDBFolder(small_pack)


# -- 8. the next step after a pack, and pack --dry-run ----------------------------------------------------
def test_pack_says_what_to_do_next(small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "my pack"
    assert main(["pack", str(small_tree), str(dst), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"next: `lmdbfolder verify '{dst}'` checks every record, `lmdbfolder show '{dst}'`" in out
    assert f"LMDBFolder({str(dst)!r}, transform=...)" in out


def test_dry_run_says_what_a_pack_would_hold_and_writes_nothing(
    small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    add_bad_files(small_tree)
    dst = tmp_path / "p"
    assert main(["pack", str(small_tree), str(dst), "--dry-run", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"dry run, nothing written: {small_tree} (imagefolder) holds 14 files in 3 classes" in out
    assert "(class0 5, class1 5, class2 4)" in out
    assert "the check (--check header) would skip 2 files:" in out and "  class0/cut.jpg: truncated" in out
    assert f"would pack 12 images into {dst}: about " in out and " free there" in out
    assert not dst.exists() and not (tmp_path / "p.partial").exists() and not (tmp_path / "p.lock").exists()
    assert main(["pack", str(small_tree), str(dst), "--dry-run", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["dry_run"] and found["would_pack"] == 12 and found["files"] == 14
    assert found["class_counts"] == {"class0": 5, "class1": 5, "class2": 4}
    assert [s["path"] for s in found["would_skip"]] == ["class0/cut.jpg", "class1/empty.jpg"]
    # the estimate is the pack's own model: the real pack fits under its upper bound
    with pytest.warns(SkippedFilesWarning):
        pack(small_tree, dst, progress=False)
    on_disk = os.path.getsize(dst / "data.mdb")
    assert on_disk <= found["estimated_upper_bytes"]
    assert main(["pack", str(small_tree), str(dst), "--dry-run", "--check", "none", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "files not checked (--check none)" in out and f"note: {dst} holds a pack already" in out
    # refused as pack would refuse it: a DST inside SRC
    assert main(["pack", str(small_tree), str(small_tree / "in.lmdb"), "--dry-run"]) == EXIT_CODES["usage"]
    # an update is not previewed as if it were a new pack
    before = os.path.getmtime(dst / "data.mdb")
    assert main(["pack", str(small_tree), str(dst), "--dry-run", "--update"]) == EXIT_CODES["usage"]
    assert "cannot preview --update" in capsys.readouterr().err
    assert os.path.getmtime(dst / "data.mdb") == before


def test_dry_run_says_what_pack_would_do_with_what_is_at_dst(
    small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each note is what the pack that follows does (it said "pack resumes, refuses or needs
    --overwrite" whatever was there, and --overwrite replaces neither a file nor a foreign folder)."""

    def note(dst: Path) -> str:
        assert main(["pack", str(small_tree), str(dst), "--dry-run", "--check", "none", "--no-progress"]) == 0
        (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("note: ")]
        return line

    def pack_cli(dst: Path, *flags: str) -> int:
        code = main(["pack", str(small_tree), str(dst), "--no-progress", *flags])
        capsys.readouterr()
        return code

    a_file = tmp_path / "file"
    a_file.write_text("mine")
    assert "is a file: pack refuses to replace it, even with --overwrite" in note(a_file)
    assert pack_cli(a_file, "--overwrite") != 0 and a_file.read_text() == "mine"

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert "is a directory that is not a pack: pack refuses to replace it, even with --overwrite" in note(foreign)
    assert pack_cli(foreign, "--overwrite") != 0 and (foreign / "notes.txt").read_text() == "mine"

    empty = tmp_path / "empty"
    empty.mkdir()
    assert "is an empty directory: pack uses it with --overwrite" in note(empty)
    assert pack_cli(empty) != 0 and pack_cli(empty, "--overwrite") == 0

    assert "holds a pack already: pack does nothing if it was packed from this source" in note(empty)
    assert pack_cli(empty) == 0

    unfinished = tmp_path / "unfinished"
    write(small_tree / "class0" / "broken.png", b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    with pytest.raises(Exception, match="broken.png"):
        pack(small_tree, unfinished, strict=True, commit_every=2, progress=False)
    (small_tree / "class0" / "broken.png").unlink()
    assert "holds an unfinished pack: the same pack command resumes it" in note(unfinished)


# -- 13. import's class names, show's exit code, info's layout, the shards message, --help names ----------------
def recipe_lmdb(path: Path, labels: list[int]) -> None:
    """A folder2lmdb-style recipe LMDB: pickled (jpeg bytes, label), __len__ and __keys__."""
    rng = np.random.default_rng(0)
    env = lmdb.open(str(path), map_size=1 << 26)
    with env.begin(write=True) as txn:
        for i, label in enumerate(labels):
            txn.put(str(i).encode(), pickle.dumps((image_bytes("rgb_jpeg", rng, w=20 + i)[0], label)))
        txn.put(b"__len__", pickle.dumps(len(labels)))
        txn.put(b"__keys__", pickle.dumps([str(i).encode() for i in range(len(labels))]))
    env.close()


def test_import_takes_the_class_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe_lmdb(tmp_path / "old", [0, 1, 2, 3, 1])
    names = tmp_path / "classes.txt"
    names.write_text("cat\ndog\nfish\nbird\n\n")
    assert main(["import", str(tmp_path / "old"), str(tmp_path / "new"), "--classes", str(names), "--json"]) == 0
    with open_pack(tmp_path / "new") as r:
        assert r.classes == ["cat", "dog", "fish", "bird"] and list(r.labels) == [0, 1, 2, 3, 1]
        assert r.class_to_idx == {"cat": 0, "dog": 1, "fish": 2, "bird": 3}
    capsys.readouterr()
    names.write_text("cat\ndog\n")
    code = main(["import", str(tmp_path / "old"), str(tmp_path / "other"), "--classes", str(names)])
    assert (
        code == EXIT_CODES["usage"]
        and "labels 0..3 (4 classes) but 2 class names were given" in capsys.readouterr().err
    )
    with pytest.raises(OptionError, match="given twice"):
        import_legacy(tmp_path / "old", tmp_path / "x", classes=["a", "b", "a", "c"], progress=False)
    import_legacy(tmp_path / "old", tmp_path / "y", classes=["a", "b", "c", "d", "e"], progress=False)
    with open_pack(tmp_path / "y") as r:
        assert r.classes == ["a", "b", "c", "d", "e"]  # a class without samples may be named too


def test_show_exits_1_after_drawing_damaged_tiles(small_pack: Path, tmp_path: Path, capsys: Any) -> None:
    sheet = tmp_path / "sheet.png"
    assert main(["show", str(small_pack), "-o", str(sheet)]) == 0
    capsys.readouterr()
    with open_pack(small_pack) as r:
        payload = bytes(r.get(5).payload)
    data = bytearray((small_pack / "data.mdb").read_bytes())
    at = data.find(payload)
    assert at > 0 and data.find(payload, at + 1) == -1
    data[at + len(payload) // 2] ^= 0xFF  # one flipped byte inside record 5's image data
    (small_pack / "data.mdb").write_bytes(bytes(data))
    code = main(["show", str(small_pack), "-o", str(sheet), "--indices", "4", "5", "6"])
    out = capsys.readouterr().out
    assert code == EXIT_CODES["problems found"] and sheet.exists()
    assert "1 sample did not decode or is damaged (red tiles): 5; `lmdbfolder verify " in out
    assert main(["show", str(small_pack), "-o", str(sheet), "--indices", "5", "--json"]) == EXIT_CODES["problems found"]


def test_info_keeps_the_skipped_list_under_its_heading(small_tree: Path, tmp_path: Path) -> None:
    add_bad_files(small_tree)
    with pytest.warns(SkippedFilesWarning):
        pack(small_tree, tmp_path / "p", progress=False)
    info = pack_info(tmp_path / "p")
    stats = pack_statistics(info["path"])
    info.update({k: v for k, v in stats.items() if k not in ("path", "count", "encodings")})
    info["encoding_shares"] = {k: v["share"] for k, v in stats["encodings"].items()}
    lines = format_info(info).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("skipped:"))
    assert "2 source files (listed below)" in lines[at]
    assert lines[at + 1 :] == [
        "  class0/cut.jpg: truncated: the JPEG has no end-of-image marker (FFD9) after its image data",
        "  class1/empty.jpg: empty file (0 bytes)",
    ]
    assert any(line.startswith("image sizes:") for line in lines[:at])


@pytest.mark.parametrize("sharded", [False, True])
def test_info_shows_a_terminals_worth_of_skipped_files(
    small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], sharded: bool
) -> None:
    # A pack of a million files can skip tens of thousands: info printed every one of them.
    names = [f"class{i // 13}/zz{i:02}.jpg" for i in range(25)]  # after each class's images: no shard all bad
    for name in names:
        write(small_tree / name, b"")
    with pytest.warns(SkippedFilesWarning):
        if sharded:
            pack_sharded(small_tree, tmp_path / "p", shards=2, progress=False)
        else:
            pack(small_tree, tmp_path / "p", progress=False)
    assert main(["info", str(tmp_path / "p"), "--no-sizes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("skipped:"))
    assert "25 source files (the first 20 below)" in lines[at]
    listed = "each shard's skipped.txt" if sharded else "the pack's skipped.txt"
    assert lines[at + 1 :] == [f"  {name}: empty file (0 bytes)" for name in names[:20]] + [
        f"  ... and 5 more (`lmdbfolder info --json` and {listed} list them all)"
    ]
    assert main(["info", str(tmp_path / "p"), "--no-sizes", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["skipped"]) == 25


def test_one_missing_shard_is_one_shard(small_tree: Path, tmp_path: Path) -> None:
    import shutil

    result = pack_sharded(small_tree, tmp_path / "s", shards=3, progress=False)
    shutil.rmtree(result.shards[1].path)
    with pytest.raises(NotAPackError, match="1 of 3 shards is missing: "):
        ShardedReader(tmp_path / "s")
    with pytest.raises(NotAPackError, match="1 of 3 shards is missing: "):
        write_index(tmp_path / "s")
    shutil.rmtree(result.shards[2].path)
    with pytest.raises(NotAPackError, match="2 of 3 shards are missing: "):
        ShardedReader(tmp_path / "s")


def test_help_names_the_arguments_as_the_descriptions_do() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in sub.choices.items():  # type: ignore[attr-defined]
        usage = p.format_usage()
        for action in p._actions:
            if action.option_strings:
                continue
            shown = action.metavar or action.dest
            assert shown.isupper(), f"lmdbfolder {name}: positional {action.dest!r} shows as {shown!r}"
            assert shown in usage and shown in p.description, (name, shown)  # as the description names it


# -- 9. make test says what it runs, how long it takes, and which test is the long one -------------------------
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.long("a test of the notice (itself quick)")
def test_long_tests_are_named_when_they_start(request: pytest.FixtureRequest) -> None:
    from conftest import long_test_notice

    assert long_test_notice(request.node) == f"{request.node.nodeid}: a test of the notice (itself quick) ..."


def test_make_test_says_what_it_runs_and_how_long() -> None:
    import subprocess
    import sys

    makefile = (REPO / "Makefile").read_text()
    recipe = makefile[makefile.index("\ntest: ") : makefile.index("\n\n", makefile.index("\ntest: "))]
    assert "min on the 2-core development VM" in recipe and "longest" in recipe
    # The count it announces (and the README's) is the suite's, give or take a tenth: it said
    # "about 750" long after the suite had passed a thousand.
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    found = re.search(r"^(\d+) tests collected", collected.stdout, re.M)
    assert found, collected.stdout[-2000:] + collected.stderr
    suite = int(found.group(1))
    readme = (REPO / "README.md").read_text()
    for where, text in (("Makefile", recipe), ("README.md", readme[readme.index("`make test` (") :][:200])):
        said = re.search(r"about ([\d,]+) tests", text)
        assert said, where
        assert abs(int(said.group(1).replace(",", "")) - suite) <= suite / 10, (where, said.group(0), suite)
    assert "pytest --durations=5" in recipe and "-q" not in recipe  # a line per file, the slowest listed
    # a real pytest run prints the notice before the long test starts
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            f"{__file__}::test_long_tests_are_named_when_they_start",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "test_long_tests_are_named_when_they_start: a test of the notice (itself quick) ..." in proc.stdout
    # the suite's longest test is marked (it ran a minute or two without a word)
    distributed = (REPO / "tests" / "test_distributed.py").read_text()
    at = distributed.index("def test_every_sample_once_per_epoch_across_ranks_and_exact_resume")
    assert "@pytest.mark.long(" in distributed[at - 200 : at]


def test_check_identical_leaves_out_the_files_the_pack_skipped(small_tree: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    add_bad_files(small_tree)
    with pytest.warns(SkippedFilesWarning):
        pack(small_tree, tmp_path / "p", progress=False)
    script = REPO / "benchmarks" / "check_identical.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(small_tree), str(tmp_path / "p")], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr  # was: "targets differ", exit 1
    assert "12 samples, 3 classes compared pixel for pixel" in proc.stdout
    assert "identical (2 source files that the pack skipped left out)" in proc.stdout


def test_the_fast_settings_without_opencv_say_what_to_install(capabilities: Callable[..., Capabilities]) -> None:
    # The README walk after `make demo` alone (no OpenCV): a bare ModuleNotFoundError before.
    from lmdbfolder import fused
    from lmdbfolder.errors import MissingDependencyError

    capabilities(cv2=None)
    with pytest.raises(ImportError) as info:
        fused.RandomResizedCrop(224, resize="opencv", output="tensor")
    assert isinstance(info.value, MissingDependencyError)
    assert 'resize="opencv"' in str(info.value) and 'pip install ".[opencv]"' in str(info.value)
    fused.RandomResizedCrop(224, resize="pil", output="tensor")  # needs nothing

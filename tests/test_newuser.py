"""What a new user meets (issue 11): reruns, bad option values, hints, truncated files,
packing into the source, core-only installs, and the command line's own words."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import lmdb
import numpy as np
import pytest
from PIL import Image

import lmdbfolder
from conftest import make_small_tree, write
from lmdbfolder.cli import EXIT_CODES, build_parser, main
from lmdbfolder.errors import OptionError, OutputExistsError, install_hint, python_form
from lmdbfolder.read.reader import Reader
from lmdbfolder.tools.verify import verify
from lmdbfolder.write.shards import pack_sharded
from lmdbfolder.write.writer import pack

REPO = Path(__file__).resolve().parents[1]


def run(*argv: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    """``lmdbfolder ARGV`` in a fresh interpreter, after running ``prelude`` there."""
    code = prelude + "\nfrom lmdbfolder.cli import main\nraise SystemExit(main(" + repr(list(argv)) + "))\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def blocker(*modules: str) -> str:
    """Python source that makes ``import MODULE`` fail for each of ``modules`` (a core-only install)."""
    return (
        "import sys\n"
        "class _Block:\n"
        f"    names = {modules!r}\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in self.names:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "        return None\n"
        "sys.meta_path.insert(0, _Block())\n"
    )


# -- 1. rerunning a finished pack -------------------------------------------------------
def test_rerunning_the_same_pack_is_a_noop(
    small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p"
    first = pack(small_tree, out, progress=False)
    before = os.stat(out / "data.mdb").st_mtime_ns
    again = pack(small_tree, out, progress=False)
    assert again.already_packed and not first.already_packed
    assert (again.count, again.payload_bytes, again.encodings) == (first.count, first.payload_bytes, first.encodings)
    assert again.images_per_second == 0.0 and again.as_dict()["already_packed"] is True
    assert os.stat(out / "data.mdb").st_mtime_ns == before  # nothing was written
    assert main(["pack", str(small_tree), str(out), "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert "already packed from this source with these options: nothing to do" in said and "12 images" in said
    # Options that do not change the pack's content (workers, commits) are not "other options".
    assert pack(small_tree, out, workers=1, commit_every=3, progress=False).already_packed


def test_rerunning_with_other_sources_or_options_says_what_differs(
    small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p"
    pack(small_tree, out, progress=False)
    with pytest.raises(OutputExistsError, match="check was 'header', now 'decode'"):
        pack(small_tree, out, check="decode", progress=False)
    with pytest.raises(OutputExistsError, match=r"resize was None, now \[64, 90, 'longer'\]"):
        pack(small_tree, out, resize=lmdbfolder.Resize(64), progress=False)
    write(small_tree / "class2" / "new.jpg", (small_tree / "class0" / "img0.jpg").read_bytes())
    with pytest.raises(OutputExistsError, match="the number of source files was 12, now 13") as info:
        pack(small_tree, out, progress=False)
    assert "overwrite=True" in str(info.value) and "--overwrite" not in str(info.value)
    assert main(["pack", str(small_tree), str(out), "--store", "raw"]) == EXIT_CODES["output exists"]
    err = capsys.readouterr().err
    assert "--store was 'encoded', now 'raw'" in err and "pass --overwrite" in err and "overwrite=True" not in err
    assert pack(small_tree, out, overwrite=True, progress=False).count == 13


def test_rerunning_a_sharded_pack_is_a_noop(
    small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "s"
    pack_sharded(small_tree, out, shards=3, progress=False)
    index = (out / "index.json").read_bytes()
    again = pack_sharded(small_tree, out, shards=3, progress=False)
    assert again.already_packed and again.count == 12 and all(s.kept for s in again.shards)
    assert (out / "index.json").read_bytes() == index
    one = pack_sharded(small_tree, out, shards=3, shard_index=1, progress=False)
    assert one.already_packed and one.count == 4
    assert main(["pack", str(small_tree), str(out), "--shards", "3", "--no-progress"]) == 0
    assert "(3 shards) is already packed from this source with these options" in capsys.readouterr().out
    with pytest.raises(OutputExistsError, match="packed as 3 shards named train-\\*, this run packs 2"):
        pack_sharded(small_tree, out, shards=2, progress=False)
    with pytest.raises(OutputExistsError, match="train-00000-of-00003.lmdb: store was 'encoded', now 'raw'"):
        pack_sharded(small_tree, out, shards=3, store="raw", progress=False)


def test_the_readme_snippet_runs_twice(small_tree: Path, tmp_path: Path) -> None:
    # README "Example": `lmdbfolder.pack(...)  # resumable`, then LMDBFolder; twice in a row.
    code = (
        "import lmdbfolder\nfrom lmdbfolder.torch import LMDBFolder\n"
        f"lmdbfolder.pack({str(small_tree)!r}, {str(tmp_path / 'train.lmdb')!r})\n"
        f"ds = LMDBFolder({str(tmp_path / 'train.lmdb')!r})\nprint(len(ds), ds.classes[:3])\n"
    )
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "12 ['class0', 'class1', 'class2']"


# -- 2. bad option values ---------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, said",
    [
        (["--max-size", "0"], "argument --max-size: must be at least 1, got 0"),
        (["--max-size", "-3"], "argument --max-size: must be at least 1, got -3"),
        (["--max-size", "64", "--quality", "200"], "argument --quality: must be at most 100, got 200"),
        (["--quality", "90"], "--quality needs --max-size"),
        (["--workers", "-1"], "argument --workers: must be at least 1, got -1"),
        (["--workers", "0"], "argument --workers: must be at least 1, got 0"),
        (["--shards", "0"], "argument --shards: must be at least 1, got 0"),
        (["--shard-size", "lots"], "cannot read the size 'lots'"),
    ],
)
def test_bad_pack_options_are_usage_errors(
    small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    assert main(["pack", str(small_tree), str(tmp_path / "p"), *argv]) == EXIT_CODES["usage"]
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("lmdbfolder pack: error: ") and lines[1].startswith("  hint: ")
    assert not (tmp_path / "p").exists() and not (tmp_path / "p.partial").exists()


def test_other_bad_values_are_usage_errors(
    small_pack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--dir", "/proc/x"]) == EXIT_CODES["usage"]
    assert "cannot use --dir /proc/x as a work folder" in capsys.readouterr().err
    assert main(["verify", str(small_pack), "--list", str(tmp_path / "nosuch.txt")]) == EXIT_CODES["usage"]
    assert "--list FILE compares with a source and needs --against SRC" in capsys.readouterr().err
    for argv in (["bench", str(tmp_path), "--workers", "-1"], ["bench", str(tmp_path), "--repeat", "0"]):
        assert main(argv) == EXIT_CODES["usage"]
        assert "must be at least" in capsys.readouterr().err
    assert main(["demo", "--classes", "0"]) == EXIT_CODES["usage"]
    capsys.readouterr()
    # The library says the keyword, as Python callers write it.
    with pytest.raises(OptionError, match="max_size must be a positive number of pixels"):
        lmdbfolder.Resize(0)


def test_missing_ray_has_its_own_error_and_exit_code(small_tree: Path, tmp_path: Path) -> None:
    proc = run("pack", str(small_tree), str(tmp_path / "s"), "--shards", "2", "--ray", prelude=blocker("ray"))
    assert proc.returncode == EXIT_CODES["missing dependency"] == 8, proc.stderr
    assert "packing on a Ray cluster (--ray) needs Ray (not installed)" in proc.stderr
    assert 'pip install ".[ray]"' in proc.stderr and "every node" in proc.stderr
    assert "Traceback" not in proc.stderr
    exit_codes = (REPO / "docs" / "cli.md").read_text()  # the exit codes, moved from the README
    assert "| 8 " in exit_codes or "8 missing dependency" in exit_codes


# -- 3. truncated JPEGs and PNGs --------------------------------------------------------
def _jpeg(rng: np.random.Generator, mode: str = "RGB", **options: object) -> bytes:
    channels = {"RGB": 3, "L": 1, "CMYK": 4}[mode]
    shape = (48, 64) if channels == 1 else (48, 64, channels)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode).save(out, "JPEG", **options)
    return out.getvalue()


def _png(rng: np.random.Generator, **options: object) -> bytes:
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (40, 30, 3), dtype=np.uint8)).save(out, "PNG", **options)
    return out.getvalue()


def test_truncated_files_are_skipped_and_valid_ones_are_not(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    exif = Image.Exif()
    exif[0x0112] = 6
    thumb = _jpeg(rng, quality=50)
    base = _jpeg(rng)
    app1 = b"\xff\xe1" + (len(thumb) + 8).to_bytes(2, "big") + b"Exif\0\0" + thumb  # a thumbnail with its own EOI
    good = {
        "baseline.jpg": base,
        "progressive.jpg": _jpeg(rng, progressive=True),
        "exif.jpg": _jpeg(rng, exif=exif),
        "cmyk.jpg": _jpeg(rng, "CMYK"),
        "gray.jpg": _jpeg(rng, "L"),
        "padded.jpg": _jpeg(rng) + b"\0" * 3000,  # padding after EOI
        "trailer.jpg": _jpeg(rng) + rng.bytes(50_000),  # a long trailer (camera data) after EOI
        "thumbnail.jpg": base[:2] + app1 + base[2:],
        "plain.png": _png(rng),
        "interlaced.png": _png(rng, interlace=1),
        "trailing.png": _png(rng) + b"appended data" * 1000,
    }
    bad = {
        "cut.jpg": _jpeg(rng)[:-2],
        "half.jpg": _jpeg(rng, progressive=True)[:900],
        "cut_thumbnail.jpg": (base[:2] + app1 + base[2:])[:-300],  # the thumbnail's EOI must not count
        "cut.png": _png(rng)[:-12],
        "half.png": _png(rng)[:2000],
    }
    for name, data in {**good, **bad}.items():
        write(tmp_path / "src" / "c" / name, data)
        Image.open(io.BytesIO(data))  # every header opens: only the end is missing
    result = pack(tmp_path / "src", tmp_path / "p", progress=False)
    skipped = dict(result.skipped)
    assert set(skipped) == {f"c/{name}" for name in bad}
    assert all(reason.startswith("truncated: ") for reason in skipped.values())
    assert "the JPEG has no end-of-image marker (FFD9)" in skipped["c/cut.jpg"]
    assert "the PNG has no IEND chunk" in skipped["c/cut.png"]
    with Reader(tmp_path / "p") as r:
        assert len(r) == len(good)
        for i in range(len(r)):
            r.image(i).load()  # what got in decodes
    # --check none trusts the files; plain verify then names the cut ones (cheaply: no decode).
    pack(tmp_path / "src", tmp_path / "trusted", check="none", progress=False)
    report = verify(tmp_path / "trusted", progress=False)
    assert sorted(p.path for p in report.problems if p.kind == "truncated") == sorted(f"c/{n}" for n in bad)
    assert main(["verify", str(tmp_path / "trusted"), "--no-progress"]) == EXIT_CODES["problems found"]


# -- 4. hints ------------------------------------------------------------------------------
def test_a_recipe_lmdb_is_told_to_use_import(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = tmp_path / "old"
    env = lmdb.open(str(old), map_size=1 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"0", b"pickled sample")
        txn.put(b"__keys__", b"pickled keys")
        txn.put(b"__len__", b"1")
    env.close()
    for argv in (["info", str(old)], ["verify", str(old)]):
        assert main(argv) == EXIT_CODES["not a pack"]
        err = capsys.readouterr().err
        assert "folder2lmdb-style LMDB" in err and f"`lmdbfolder import {old} NEW`" in err
        assert "fresh `lmdbfolder pack`" not in err
    (old / "meta_info.txt").write_text("a.png (8,8,3) 1\n")
    assert main(["info", str(old)]) == EXIT_CODES["not a pack"]
    assert "BasicSR-style image LMDB" in capsys.readouterr().err


def test_hints_name_flags_on_the_command_line_and_keywords_in_python(
    small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    taken = tmp_path / "taken"
    write(taken / "notes.txt", b"x")
    with pytest.raises(OutputExistsError) as info:
        pack(small_tree, taken, progress=False)
    assert "pass overwrite=True" in str(info.value) and "--" not in str(info.value)
    assert main(["pack", str(small_tree), str(taken)]) == EXIT_CODES["output exists"]
    err = capsys.readouterr().err
    assert "pass --overwrite" in err and "overwrite=True" not in err
    # A backquoted command is a shell command in both places.
    assert python_form("run `lmdbfolder pack SRC DST --shards N` or pass --restart") == (
        "run `lmdbfolder pack SRC DST --shards N` or pass restart=True"
    )
    assert python_form("--max-size 256 --quality 90 --resize-side longer") == 'resize=Resize(256, 90, "longer")'


def test_install_hints_say_how_to_install_from_source_quoted() -> None:
    hint = install_hint("fast")
    assert '`pip install ".[fast]"`' in hint and '"lmdbfolder[fast] @ file:///' in hint
    # Every install hint in the package, the README and the docs: brackets only inside double quotes.
    texts = [p.read_text() for p in (REPO / "src" / "lmdbfolder").rglob("*.py")] + [(REPO / "README.md").read_text()]
    texts += [p.read_text() for p in (REPO / "docs").glob("*.md")]
    for text in texts:
        for line in re.findall(r"pip install [^\n`]*\[[^\n`]*", text):
            assert re.search(r'pip install (-U )?"[^"]*\[', line) or "{" in line, line


# -- 8. packing into the source ----------------------------------------------------------
def test_packing_into_the_source_is_refused(
    small_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inside = small_tree / "train.lmdb"
    with pytest.raises(OptionError, match="it is inside the source folder") as info:
        pack(small_tree, inside, progress=False)
    assert str(tmp_path / "train.lmdb") in info.value.hint
    with pytest.raises(OptionError, match="inside the source folder"):
        pack_sharded(small_tree, small_tree / "class0" / "shards", shards=2, progress=False)
    with pytest.raises(OptionError, match="the source folder .* is inside it"):
        pack(small_tree / "class0", small_tree, overwrite=True, progress=False)
    listing = tmp_path / "list.txt"
    listing.write_text("class0/img0.jpg 0\nclass1/img0.jpg 1\n")
    with pytest.raises(OptionError, match="inside the source folder"):
        pack(small_tree, small_tree / "l.lmdb", list_file=listing, progress=False)
    assert main(["pack", str(small_tree), str(inside)]) == EXIT_CODES["usage"]
    assert "cannot pack into" in capsys.readouterr().err
    assert sorted(os.listdir(small_tree)) == ["class0", "class1", "class2"]  # nothing was created
    assert sorted(os.listdir(small_tree / "class0")) == [f"img{k}.jpg" for k in range(4)]


# -- 9. core-only installs ---------------------------------------------------------------
@pytest.mark.parametrize(
    "statement",
    [
        "from lmdbfolder.torch import LMDBFolder",
        "from lmdbfolder.fused import RandomResizedCrop",
        "from lmdbfolder.sampler import ExactDistributedSampler",
    ],
)
def test_torch_modules_say_what_to_install(statement: str) -> None:
    code = blocker("torch", "torchvision") + (
        "import lmdbfolder\n"  # the core imports without torch
        "try:\n"
        f"    {statement}\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, type(exc.__cause__).__name__)\n"
        "    print(exc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    first, *rest = proc.stdout.splitlines()
    assert first == "MissingDependencyError ModuleNotFoundError"
    text = "\n".join(rest)
    assert "needs torch" in text and '`pip install ".[torch]"`' in text


def test_bench_without_torch_recommends_only_what_it_measured(small_tree: Path) -> None:
    argv = ["bench", str(small_tree), "--workers", "0", "--repeat", "1", "--warm-only", "--no-chart"]
    proc = run(*argv, prelude=blocker("torch", "torchvision"))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "Install torch and torchvision to measure the training pipeline" in out
    assert "fused" not in out and "Fastest measured" not in out and "decoder=" not in out
    assert "pack, get_many + prefetch" in out


# -- 10. the command line's own words -----------------------------------------------------
def test_every_subcommand_has_a_description_and_V_is_version(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in sub.choices.items():  # type: ignore[attr-defined]
        assert p.description and len(p.description) > 40, name
    assert main(["-V"]) == 0
    assert capsys.readouterr().out.strip() == f"lmdbfolder {lmdbfolder.__version__}"


def test_every_option_is_in_the_cli_reference() -> None:
    readme = (REPO / "docs" / "cli.md").read_text()  # the README's command-line reference moved there
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    missing = []
    for name, p in sub.choices.items():  # type: ignore[attr-defined]
        if f"lmdbfolder {name}" not in readme:
            missing.append(name)
        for action in p._actions:
            flags = [f for f in action.option_strings if f.startswith("--") and f != "--help"]
            if flags and not any(f in readme for f in flags):
                missing.append(f"{name} {flags[0]}")
    assert not missing, f"not in docs/cli.md: {missing}"


def test_plurals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = make_small_tree(tmp_path / "one", classes=1, per_class=1)
    assert main(["pack", str(src), str(tmp_path / "p"), "--no-progress"]) == 0
    assert "packed 1 image into" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "p"), "--no-progress"]) == 0
    assert "1 of 1 record checked" in capsys.readouterr().out


def test_skipped_report_escapes_tabs_and_newlines(small_tree: Path, tmp_path: Path) -> None:
    write(small_tree / "class0" / "tab\there.jpg", b"not an image")
    write(small_tree / "class0" / "new\nline.jpg", b"not an image either")
    write(small_tree / "class0" / "back\\slash.jpg", b"nor this")
    pack(small_tree, tmp_path / "p", progress=False)
    lines = (tmp_path / "p" / "skipped.txt").read_text().splitlines()
    assert lines[1].startswith("# a backslash, tab, newline or carriage return") and "\\t" in lines[1]
    entries = [line.split("\t") for line in lines[2:]]
    assert [e[0] for e in entries] == ["class0/back\\\\slash.jpg", "class0/new\\nline.jpg", "class0/tab\\there.jpg"]
    assert all(len(e) == 2 for e in entries)


def test_license_and_what_the_long_description_links(tmp_path: Path) -> None:
    license_text = (REPO / "LICENSE").read_text()
    assert license_text.startswith("MIT License") and 'license = "MIT"' in (REPO / "pyproject.toml").read_text()
    readme = (REPO / "README.md").read_text()
    # Relative links do not resolve on a package index: the README links only absolute URLs.
    assert not re.findall(r"\]\((?!https?://|#)[^)]*\)", readme)


def test_the_sdist_holds_every_file_the_readme_names() -> None:
    # The README is the package's long description; the files it names must come with the source
    # distribution (MANIFEST.in), since they are not in the wheel.
    import fnmatch

    patterns = []
    for line in (REPO / "MANIFEST.in").read_text().splitlines():
        words = line.split()
        if words and words[0] == "include":
            patterns += words[1:]
        elif words and words[0] == "recursive-include":
            patterns += [f"{words[1]}/**/{p}" for p in words[2:]] + [f"{words[1]}/{p}" for p in words[2:]]
    named = set(
        re.findall(r"`(?:python )?((?:[\w.-]+/)*[\w.-]+\.(?:md|txt|py)|Makefile)\b", (REPO / "README.md").read_text())
    )
    in_repo = sorted(n for n in named if (REPO / n).is_file())
    assert "FORMAT.md" in in_repo and "docs/design.md" in in_repo and "requirements-demo.txt" in in_repo
    for name in in_repo:
        assert any(fnmatch.fnmatch(name, p) or fnmatch.fnmatch(name, p.replace("**/", "")) for p in patterns), name
    assert "conftest.py" in [p.name for p in (REPO / "tests").glob("*.py")]  # tests/*.py: the sdist's tests run


def test_json_of_a_noop_pack(small_pack: Path, small_tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pack", str(small_tree), str(small_pack), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["already_packed"] is True and summary["count"] == 12

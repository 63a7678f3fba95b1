"""A pack from a stranger must not reach outside it (issue 22).

Nothing read from a pack (manifest fields, paths, class names) becomes a file
name, a regular expression or terminal output without bounds; only regular
files are opened (a FIFO blocks its reader, ``/dev/zero`` never ends); an
export never writes outside OUT. The packs here are forged with valid
checksums (``conftest.forge_table`` / ``forge_meta``), as anyone could.
Whatever could block runs in a child process with a time limit, so a
regression fails instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
from PIL import ImageDraw

from conftest import forge_meta, forge_table, make_small_tree, write
from lmdbfolder.cli import EXIT_CODES, main
from lmdbfolder.errors import NotAPackError, SourceError
from lmdbfolder.format import META_KEY, PATHS_KEY, encode_paths
from lmdbfolder.read.reader import Reader
from lmdbfolder.text import printable
from lmdbfolder.tools.export import export
from lmdbfolder.tools.show import contact_sheet
from lmdbfolder.write.writer import pack

SRC = Path(__file__).resolve().parent.parent / "src"


def _cli_child(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``lmdbfolder ARGV`` in a child process; a hang fails the test at ``timeout``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    return subprocess.run(
        [sys.executable, "-m", "lmdbfolder", *argv], capture_output=True, text=True, timeout=timeout, env=env
    )


def _python_child(code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture
def packed(small_tree: Path, tmp_path: Path) -> Path:
    out = tmp_path / "p.lmdb"
    pack(small_tree, out, progress=False)
    return out


# -- the manifest ----------------------------------------------------------------------------
def test_a_5000_digit_integer_in_the_manifest_is_a_clear_error(packed: Path, capsys: Any) -> None:
    # It was a ValueError traceback in info and verify, and a ValueError from LMDBFolder.
    with Reader(packed) as r:
        blob = bytes(r.tables()[0])
    forge_table(packed, META_KEY, blob.replace(b'"count":', b'"count":' + b"1" * 5000 + b',"x":', 1))
    for command in ("info", "verify"):
        assert main([command, str(packed)]) == EXIT_CODES["not a pack"]
        assert "manifest (key __meta__) is not valid JSON" in capsys.readouterr().err
    with pytest.raises(NotAPackError, match="not valid JSON"):
        Reader(packed)
    pytest.importorskip("torch")
    from lmdbfolder.torch import LMDBFolder

    with pytest.raises(NotAPackError):
        LMDBFolder(packed)


def test_huge_integers_in_informational_fields_are_shown_invalid(packed: Path, capsys: Any) -> None:
    # Within Python's digit limit, but too big for the arithmetic info does with them.
    forge_meta(packed, payload_bytes=10**400, encodings={"jpeg": 10**300})
    assert main(["info", str(packed)]) == 0
    out = capsys.readouterr().out
    assert "payload:      invalid" in out and "encodings:    invalid" in out


def test_info_prints_no_terminal_escape_sequences(packed: Path, capsys: Any) -> None:
    evil = ["\x1b]0;pwned\x07\x1b[2J\x1b[31mred", "bidi\u202eevil", "new\nline", "x" * 10_000]
    forge_meta(
        packed,
        classes=evil,
        class_to_idx={name: i for i, name in enumerate(evil)},
        created_by="\x1b[1mbold",
        source={"layout": "imagefolder", "root": "/tmp/\x1b[5mblink"},
    )
    assert main(["info", str(packed)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u202e" not in out and "\x07" not in out
    assert "\\x1b[31mred" in out and "bidi\\u202eevil" in out and "new\\x0aline" in out
    assert max(len(line) for line in out.splitlines()) < 2_000  # a 10,000-character name is cut
    assert main(["info", str(packed), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["classes"] == evil  # JSON keeps the exact names, escaped by JSON


def test_printable_escapes_and_bounds() -> None:
    assert printable("a\x1bb\x9bc\u200fd\udcffe") == "a\\x1bb\\x9bc\\u200fd\\udcffe"
    assert printable("x" * 300, 10) == "xxxxxxxxxx... (290 more characters)"
    assert printable("one\ntwo\r", None, newlines=True) == "one\ntwo\\x0d"


def test_show_fits_a_long_class_name_in_few_measurements(
    packed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The caption was shortened one character at a time: 2,000 characters took 4.4 s,
    # 10,000 over 120 s. Count the text measurements instead of timing them.
    with Reader(packed) as r:
        classes = list(r.classes)
    long = ["q" * 20_000 + c for c in classes]
    forge_meta(packed, classes=long, class_to_idx={name: i for i, name in enumerate(long)})
    calls = []
    original = ImageDraw.ImageDraw.textlength

    def counting(self: Any, text: str, *args: Any, **kwargs: Any) -> float:
        calls.append(len(text))
        return original(self, text, *args, **kwargs)

    monkeypatch.setattr(ImageDraw.ImageDraw, "textlength", counting)
    result = contact_sheet(packed, tmp_path / "sheet.png", per_class=2, size=64)
    tiles = len(result.indices)
    assert len(calls) <= tiles * 10  # bisection: ~log2(64) + 2 measurements a caption
    assert max(calls) <= 64 + 3  # never more characters than the tile has pixels (and the ellipsis)


# -- only regular files ----------------------------------------------------------------------
def _fifo_pack(packed: Path) -> Path:
    (packed / "data.mdb").unlink()
    os.mkfifo(packed / "data.mdb")
    return packed


@pytest.mark.parametrize("command", ["info", "verify", "copy", "show", "warm"])
def test_a_fifo_as_data_mdb_is_refused_not_waited_on(packed: Path, tmp_path: Path, command: str) -> None:
    _fifo_pack(packed)
    extra = {"copy": [str(tmp_path / "copy")], "show": ["-o", str(tmp_path / "s.png")]}.get(command, [])
    proc = _cli_child(command, str(packed), *extra)
    assert proc.returncode == EXIT_CODES["not a pack"], proc.stderr
    assert "data.mdb (it is a FIFO, not a regular file)" in proc.stderr


def test_warm_refuses_a_fifo_as_a_shards_data_mdb(small_tree: Path, tmp_path: Path) -> None:
    # warm opened every data.mdb as it found it: a FIFO waited for a writer for ever.
    from lmdbfolder.write.shards import pack_sharded

    pack_sharded(small_tree, tmp_path / "s", shards=2, progress=False)
    _fifo_pack(tmp_path / "s" / "train-00001-of-00002.lmdb")
    proc = _cli_child("warm", str(tmp_path / "s"), "--no-progress")
    assert proc.returncode == EXIT_CODES["not a pack"], proc.stderr
    assert "train-00001-of-00002.lmdb" in proc.stderr and "data.mdb (it is a FIFO, not a regular file)" in proc.stderr


def test_a_fifo_as_data_mdb_is_refused_by_the_dataset(packed: Path) -> None:
    _fifo_pack(packed)
    code = (
        "from lmdbfolder.torch import LMDBFolder\n"
        "from lmdbfolder.errors import NotAPackError\n"
        f"try:\n    LMDBFolder({str(packed)!r})\nexcept NotAPackError as exc:\n    print('refused:', exc.message)\n"
    )
    proc = _python_child(code)
    assert proc.returncode == 0, proc.stderr
    assert "refused:" in proc.stdout and "FIFO" in proc.stdout


def test_a_fifo_named_like_an_image_is_skipped_by_pack(small_tree: Path, tmp_path: Path) -> None:
    os.mkfifo(small_tree / "class0" / "fifo.jpg")
    proc = _cli_child("pack", str(small_tree), str(tmp_path / "p"), "--no-progress", "--json")
    assert proc.returncode == 0, proc.stderr
    with Reader(tmp_path / "p") as r:
        assert "class0/fifo.jpg" not in r.paths() and len(r) == 12
        skipped = r.skipped()
    assert skipped == [{"path": "class0/fifo.jpg", "reason": "not read: it is a FIFO, not a regular file"}]
    proc = _cli_child("pack", str(small_tree), str(tmp_path / "strict"), "--strict", "--no-progress")
    assert proc.returncode == EXIT_CODES["source error"] and "FIFO" in proc.stderr


def _list_pack(small_tree: Path, tmp_path: Path) -> Path:
    listing = tmp_path / "l.txt"
    listing.write_text("class0/img0.jpg 0\nclass1/img1.jpg 1\n")
    out = tmp_path / "listed.lmdb"
    pack(small_tree, out, list_file=listing, progress=False)
    return out


@pytest.mark.parametrize("where", ["/dev/zero", "fifo"])
def test_verify_against_never_opens_what_is_not_a_regular_file(small_tree: Path, tmp_path: Path, where: str) -> None:
    # The manifest's source fields are a stranger's: list_file=/dev/zero grew to 3.9 GB,
    # a FIFO blocked for ever.
    out = _list_pack(small_tree, tmp_path)
    if where == "fifo":
        os.mkfifo(tmp_path / "fifo")
        where = str(tmp_path / "fifo")
    forge_meta(out, source={"layout": "list", "root": str(small_tree), "list_file": where})
    proc = _cli_child("verify", str(out), "--against", str(small_tree), "--no-progress")
    assert proc.returncode == EXIT_CODES["source error"], proc.stderr
    assert "not a regular file" in proc.stderr


def test_verify_against_never_runs_a_regular_expression_from_the_pack(small_tree: Path, tmp_path: Path) -> None:
    # match="(a+)+$" backtracked for ever on a name of a's.
    write(small_tree / "class0" / ("a" * 40 + "!.jpg"), (small_tree / "class0" / "img0.jpg").read_bytes())
    out = tmp_path / "p.lmdb"
    pack(small_tree, out, progress=False)
    with Reader(out) as r:
        source = dict(r.meta["source"])
    forge_meta(out, source={**source, "match": "(a+)+$"})
    code = (
        "from lmdbfolder.tools.verify import verify\n"
        f"r = verify({str(out)!r}, against={str(small_tree)!r}, progress=False)\n"
        "print(r.ok, r.notes)\n"
    )
    proc = _python_child(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("True") and "a regular expression read from a pack is not run" in proc.stdout


def test_a_list_file_of_endless_lines_is_refused(small_tree: Path, tmp_path: Path) -> None:
    listing = tmp_path / "l.txt"
    listing.write_bytes(b"x" * (1 << 17))
    with pytest.raises(SourceError, match="a line of more than 65,536 characters"):
        pack(small_tree, tmp_path / "p", list_file=listing, progress=False)


# -- export ----------------------------------------------------------------------------------
def _forge_paths(pack_dir: Path, paths: list[str]) -> None:
    forge_table(pack_dir, PATHS_KEY, encode_paths(paths))


def test_webdataset_members_never_lead_outside(packed: Path, tmp_path: Path) -> None:
    with Reader(packed) as r:
        paths = r.paths()
    evil = ["../../X.jpg", "/etc/passwd.jpg", "a/\x00nul.jpg", "a/\x00nul2.jpg", "./a/../../b.jpg", "..", ""]
    _forge_paths(packed, evil + paths[len(evil) :])
    result = export(packed, tmp_path / "wds", format="webdataset")
    names = []
    for shard in result.shards:
        with tarfile.open(shard) as tar:
            names += tar.getnames()
    assert len(names) == len(set(names)) == 2 * len(paths)  # an image and a .cls each, none twice
    for name in names:
        parts = name.split("/")
        assert not name.startswith("/") and ".." not in parts and "" not in parts and "\x00" not in name, name
    target = tmp_path / "extracted"
    for shard in result.shards:
        with tarfile.open(shard) as tar:
            tar.extractall(target, filter="data")  # Python's own check agrees
    assert not (tmp_path / "X.jpg").exists() and not (tmp_path.parent / "X.jpg").exists()


@pytest.mark.parametrize(
    "evil, why",
    [
        (["cls/\x00nul.jpg"], "NUL"),
        (["cls/" + "n" * 300 + ".jpg"], "longer than the file system takes"),
        (["class0/img0.jpg", "class0/img0.jpg"], "record 0 has the same path"),
        (["class0/a", "class0/a/b.jpg"], "its folder 'class0/a' is record 0's file"),
        (["class0/a/b.jpg", "class0/a"], "also a folder"),
        (["class0/../../x.jpg"], "'..' component"),
    ],
)
def test_export_files_refuses_paths_it_cannot_write_and_writes_nothing(
    packed: Path, tmp_path: Path, evil: list[str], why: str, capsys: Any
) -> None:
    # These were tracebacks (and a duplicate could not be told from a crash).
    with Reader(packed) as r:
        paths = r.paths()
    _forge_paths(packed, evil + paths[len(evil) :])
    assert main(["export", str(packed), str(tmp_path / "out"), "--no-progress"]) == EXIT_CODES["source error"]
    err = capsys.readouterr().err
    assert why in err and "--format webdataset" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.lmdb", "small"]


@pytest.mark.parametrize(
    "evil", ["class0/a.jpg 0\n/etc/hostname", "class0/b.jpg\r/etc/hostname", "# class0/c.jpg", " class0/d.jpg"]
)
def test_export_of_a_list_pack_refuses_paths_a_list_file_cannot_hold(
    small_tree: Path, tmp_path: Path, evil: str
) -> None:
    # Written as they were, these became other lines of the exported list file: an injected
    # `/etc/hostname 0` entry, a comment, a path that is not the file's, when packed again.
    listing = tmp_path / "l.txt"
    listing.write_text("class0/img0.jpg 0\nclass1/img1.jpg 1\n")
    pack(small_tree, tmp_path / "p", list_file=listing, progress=False)
    _forge_paths(tmp_path / "p", [evil, "class1/img1.jpg"])
    assert main(["export", str(tmp_path / "p"), str(tmp_path / "out"), "--no-progress"]) == EXIT_CODES["source error"]
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_export_renames_the_list_file_rather_than_overwrite_a_sample(tmp_path: Path) -> None:
    src = make_small_tree(tmp_path / "src")
    os.rename(src / "class0" / "img0.jpg", src / "list.txt")
    listing = tmp_path / "list.txt"
    listing.write_text("list.txt 0\nclass1/img1.jpg 1\n")
    pack(src, tmp_path / "p", list_file=listing, progress=False)
    result = export(tmp_path / "p", tmp_path / "out")
    assert result.list_file == str(tmp_path / "out" / "list-1.txt")
    assert (tmp_path / "out" / "list.txt").read_bytes() == (src / "list.txt").read_bytes()  # the sample, intact
    assert (tmp_path / "out" / "list-1.txt").read_text() == listing.read_text()
    # A recorded list file name that is not a plain name is not used as one.
    for hostile in ("..", "a/../..", "\x00", "/"):
        forge_meta(tmp_path / "p", source={"layout": "list", "root": str(src), "list_file": hostile})
        out = tmp_path / f"out-{len(hostile)}-{ord(hostile[0])}"
        assert export(tmp_path / "p", out).list_file == str(out / "list-1.txt")
        assert sorted(os.listdir(out)) == ["class1", "list-1.txt", "list.txt"]


def test_a_shard_index_fifo_is_refused(small_tree: Path, tmp_path: Path) -> None:
    from lmdbfolder.write.shards import pack_sharded

    pack_sharded(small_tree, tmp_path / "s", shards=2, progress=False)
    (tmp_path / "s" / "index.json").unlink()
    os.mkfifo(tmp_path / "s" / "index.json")
    proc = _cli_child("info", str(tmp_path / "s"))
    assert proc.returncode == EXIT_CODES["not a pack"], proc.stderr
    assert "FIFO" in proc.stderr


def test_printing_a_hostile_error_message_is_bounded(packed: Path, tmp_path: Path) -> None:
    # An error naming a path read from the pack: escaped and cut, on stderr.
    _forge_paths(packed, ["\x1b[31m" + "p" * 9000 + "/\x00x.jpg"] + Reader(packed).paths()[1:])
    proc = _cli_child("export", str(packed), str(tmp_path / "out"), "--no-progress")
    assert proc.returncode == EXIT_CODES["source error"]
    assert "\x1b" not in proc.stderr and len(proc.stderr) < 5_000 and "\\x1b[31m" in proc.stderr


def test_import_never_opens_a_fifo_named_meta_info(tmp_path: Path) -> None:
    import lmdb

    old = tmp_path / "old"
    env = lmdb.open(str(old), map_size=1 << 24)
    with env.begin(write=True) as txn:
        txn.put(b"a", b"\0" * 12)
    env.close()
    os.mkfifo(old / "meta_info.txt")
    proc = _cli_child("import", str(old), str(tmp_path / "new"), "--no-progress")
    assert proc.returncode == EXIT_CODES["source error"], proc.stderr
    assert "meta_info.txt: cannot read it (it is a FIFO, not a regular file)" in proc.stderr


# -- names in the source -------------------------------------------------------------------------
def _hostile_tree(root: Path) -> Path:
    """A small tree whose file and class names carry terminal escape sequences, some of
    them files that pack skips (their names are echoed in the skipped-files list)."""
    make_small_tree(root)
    (root / "class1").rename(root / "\x1b]0;pwned\x07cls")
    write(root / "class0" / "\x1b[2J\x1b[31mred\u202e.jpg", b"not an image")
    write(root / "class0" / "cut\rhere.jpg", b"")
    return root


@pytest.mark.parametrize("flags", [[], ["--dry-run"]])
def test_pack_prints_no_terminal_escape_sequences_from_file_names(
    tmp_path: Path, capsys: Any, flags: list[str]
) -> None:
    # The skipped-files list of `pack` and `pack --dry-run` (and the dry run's classes)
    # printed the names as they are: the ESC sequences cleared the screen and set the title.
    src = _hostile_tree(tmp_path / "src")
    assert main(["pack", str(src), str(tmp_path / "out"), "--no-progress", *flags]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\r" not in out and "\u202e" not in out, out
    assert "class0/\\x1b[2J\\x1b[31mred\\u202e.jpg" in out and "class0/cut\\x0dhere.jpg" in out


def test_import_prints_no_terminal_escape_sequences_from_keys(tmp_path: Path, capsys: Any) -> None:
    # The keys of a recipe LMDB (anyone's) became the skipped samples' names, printed as they are.
    import pickle

    import lmdb

    old = tmp_path / "old"
    env = lmdb.open(str(old), map_size=1 << 24)
    with env.begin(write=True) as txn:
        txn.put(b"0", pickle.dumps(((make_small_tree(tmp_path / "t") / "class0" / "img0.jpg").read_bytes(), 0)))
        txn.put(b"\x1b]0;pwned\x07\x1b[2Jk", pickle.dumps((b"", 0)))  # empty image bytes: skipped
        txn.put(b"__len__", pickle.dumps(2))
        txn.put(b"__keys__", pickle.dumps([b"0", b"\x1b]0;pwned\x07\x1b[2Jk"]))
    env.close()
    assert main(["import", str(old), str(tmp_path / "new"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "skipped \\x1b]0;pwned\\x07\\x1b[2Jk: empty image bytes" in out and "\x1b" not in out, out


def test_json_output_of_names_that_are_not_utf8_is_utf8(tmp_path: Path) -> None:
    # A file name that is not UTF-8 (a latin-1 archive) is a str with lone surrogates: --json
    # wrote them raw, a traceback (UnicodeEncodeError) under a UTF-8 locale and bytes that
    # are not UTF-8 (not JSON) under the C locale.
    src = make_small_tree(tmp_path / "src")
    os.rename(src / "class0", os.path.join(os.fsencode(src), b"caf\xe9"))
    write(Path(os.fsdecode(os.path.join(os.fsencode(src), b"class1", b"bad\xff.jpg"))), b"not an image")
    env = dict(os.environ, PYTHONIOENCODING="utf-8")  # strict, as with LANG=en_US.UTF-8
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))
    out = tmp_path / "out"
    for argv in (["pack", src, out, "--json", "--dry-run"], ["pack", src, out, "--json"], ["info", out, "--json"]):
        proc = subprocess.run(
            [sys.executable, "-m", "lmdbfolder", *map(str, argv)], capture_output=True, timeout=120, env=env
        )
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")
        doc = json.loads(proc.stdout.decode("utf-8"))  # strict UTF-8, valid JSON
        if "classes" in doc:  # (the pack's own summary names no classes)
            assert os.fsencode(doc["classes"][0]) == b"caf\xe9"  # the exact name comes back
        skipped = doc["skipped"] if argv[0] == "info" else doc.get("would_skip", doc.get("skipped"))
        paths = [item["path"] if isinstance(item, dict) else item[0] for item in skipped]
        assert [os.fsencode(p) for p in paths] == [b"class1/bad\xff.jpg"], paths

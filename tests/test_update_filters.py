"""``pack --update`` keeps the layout and file filters the pack was made with.

An update without ``--extensions``/``--match``/``--flat`` uses the pack's own
(recorded in its manifest's ``source``); given ones that differ are refused,
naming the pack, the recorded and the given value. The oracle is a fresh pack
of the changed tree with the same filters, and torchvision's ImageFolder with
the same ``is_valid_file``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable

import lmdb
import numpy as np
import pytest

from conftest import image_bytes, write
from conftest import reader_view as contents
from lmdbfolder import OptionError, PackError, pack, pack_sharded, pack_sources, scan
from lmdbfolder.cli import main
from lmdbfolder.cli.common import EXIT_CODES
from lmdbfolder.errors import python_form
from lmdbfolder.format import CHECK_KEY, META_KEY, TABLE_KEYS, decode_meta, encode_check, encode_meta

FILTERS: dict[str, dict[str, Any]] = {
    "extensions": {"extensions": (".png",)},
    "match": {"match": "/keep/"},
    "both": {"extensions": ".png", "match": "/keep/"},
}


def image(path: Path, seed: int, w: int = 20) -> None:
    kind = "rgba_png" if path.suffix == ".png" else "rgb_jpeg"
    data, _ = image_bytes(kind, np.random.default_rng(seed), w=w, h=14)
    write(path, data)


def mixed_tree(root: Path) -> Path:
    """Two classes, each with PNGs and JPEGs in a keep/ and a drop/ folder."""
    seed = 0
    for cls in ("cat", "dog"):
        for sub in ("keep", "drop"):
            for name in ("a.png", "b.jpg", "c.png"):
                seed += 1
                image(root / cls / sub / name, seed, w=16 + seed)
    return root


def change(root: Path) -> None:
    """Files of every kind added (in and out of every filter), one kept file removed, one rewritten."""
    for k, rel in enumerate(("cat/keep/n.png", "cat/keep/n.jpg", "cat/drop/n.png", "dog/drop/n.jpg", "dog/keep/m.png")):
        image(root / rel, 100 + k)
    os.remove(root / "cat" / "keep" / "c.png")
    image(root / "dog" / "keep" / "a.png", 200, w=33)


def valid_file(root: Path, extensions: Any = None, match: str | None = None) -> Callable[[str], bool]:
    """ImageFolder's ``is_valid_file`` for the same filters (extensions, ``re.search`` on the relative path)."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    exts = IMG_EXTENSIONS if extensions is None else ((extensions,) if isinstance(extensions, str) else extensions)

    def valid(path: str) -> bool:
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        return path.lower().endswith(tuple(exts)) and (match is None or re.search(match, rel) is not None)

    return valid


def assert_imagefolder(src: Path, dst: Path, is_valid_file: Callable[[str], bool]) -> None:
    """The pack is torchvision's ImageFolder of ``src`` with ``is_valid_file``, sample by sample, pixel for pixel."""
    from torchvision.datasets import ImageFolder

    from lmdbfolder.torch import LMDBFolder

    theirs = ImageFolder(str(src), is_valid_file=is_valid_file)
    ours = LMDBFolder(str(dst))
    assert ours.classes == theirs.classes and ours.class_to_idx == theirs.class_to_idx
    assert [(os.path.relpath(p, src), t) for p, t in ours.samples] == [
        (os.path.relpath(p, src), t) for p, t in theirs.samples
    ]
    for i in range(len(theirs)):
        (a, ta), (b, tb) = theirs[i], ours[i]
        assert ta == tb and np.array_equal(np.asarray(a), np.asarray(b)), i


def cli_flags(filters: dict[str, Any]) -> list[str]:
    out = []
    if "extensions" in filters:
        exts = filters["extensions"]
        out += ["--extensions", exts if isinstance(exts, str) else ",".join(exts)]
    if "match" in filters:
        out += ["--match", filters["match"]]
    if filters.get("layout") == "flat":
        out += ["--flat"]
    return out


def do_pack(src: Path, dst: Path, how: str, *, sharded: bool = False, update: bool = False, **filters: Any) -> None:
    """Pack (or update) through the Python API or the command line."""
    if how == "cli":
        args = ["pack", str(src), str(dst), "--no-progress", *cli_flags(filters)]
        args += ["--update"] if update else (["--shards", "2"] if sharded else [])
        assert main(args) == 0
    elif sharded:
        pack_sharded(src, dst, **({"update": True} if update else {"shards": 2}), progress=False, **filters)
    else:
        pack(src, dst, update=update, progress=False, **filters)


def fresh(src: Path, tmp_path: Path, **filters: Any) -> dict[str, Any]:
    out = tmp_path / f"fresh-{len(list(tmp_path.iterdir()))}"
    pack(src, out, progress=False, **filters)
    return contents(out)


# -- an update without filters keeps the pack's -------------------------------------------
@pytest.mark.parametrize("sharded", [False, True], ids=["pack", "sharded"])
@pytest.mark.parametrize("how", ["api", "cli"])
@pytest.mark.parametrize("case", list(FILTERS))
def test_update_without_filters_keeps_the_packs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, how: str, sharded: bool
) -> None:
    filters = FILTERS[case]
    src = mixed_tree(tmp_path / "src")
    dst = tmp_path / "p"
    do_pack(src, dst, how, sharded=sharded, **filters)
    change(src)
    capsys.readouterr()
    again = {}
    if "match" in filters:
        # A pattern read from a pack is never run: the update asks for it again.
        before = contents(dst)
        if how == "cli":
            assert main(["pack", str(src), str(dst), "--update", "--no-progress"]) == EXIT_CODES["usage"]
            message = capsys.readouterr().err
        else:
            with pytest.raises(OptionError) as info:
                do_pack(src, dst, how, sharded=sharded, update=True)
            message = str(info.value)
        words = ("was packed with --match '/keep/'", "pass the same --match again")
        if how != "cli":
            words = tuple(python_form(w) for w in words)
        assert all(w in message for w in words), message
        assert contents(dst) == before
        again = {"match": filters["match"]}
    do_pack(src, dst, how, sharded=sharded, update=True, **again)  # no other filter given
    if how == "cli" and "extensions" in filters:  # it says which filters it kept
        assert "; kept the pack's --extensions .png" in capsys.readouterr().out
    assert contents(dst) == fresh(src, tmp_path, **filters)
    assert_imagefolder(src, dst, valid_file(src, **filters))


@pytest.mark.parametrize("how", ["api", "cli"])
def test_update_with_the_same_filters_written_otherwise_is_accepted(tmp_path: Path, how: str) -> None:
    src = mixed_tree(tmp_path / "src")
    dst = tmp_path / "p"
    do_pack(src, dst, how, extensions=(".png",), match="/keep/")
    change(src)
    # Other case (and on the command line, no dot): the same filter.
    do_pack(src, dst, how, update=True, extensions=("PNG",) if how == "cli" else (".PNG",), match="/keep/")
    assert contents(dst) == fresh(src, tmp_path, extensions=".png", match="/keep/")


@pytest.mark.parametrize("how", ["api", "cli"])
def test_a_flat_pack_stays_flat(tmp_path: Path, how: str) -> None:
    src = tmp_path / "flat"
    for k, name in enumerate(("1.png", "2.jpg", "sub/3.png")):
        image(src / name, k)
    dst = tmp_path / "p"
    do_pack(src, dst, how, layout="flat", extensions=".png")
    image(src / "sub" / "4.png", 9)
    image(src / "5.jpg", 10)
    do_pack(src, dst, how, update=True)
    assert contents(dst) == fresh(src, tmp_path, layout="flat", extensions=".png")


# -- given filters that differ are refused -------------------------------------------------
REFUSED = [
    # (the pack's filters, the update's, the pack's in words, the update's in words)
    ({"extensions": ".png"}, {"extensions": ".jpg"}, "--extensions .png", "--extensions .jpg"),
    ({"match": "/keep/"}, {"match": "/drop/"}, "--match '/keep/'", "--match '/drop/'"),
    ({}, {"match": "/keep/"}, "no --match", "--match '/keep/'"),
    ({}, {"layout": "flat"}, "the ImageFolder layout (neither --flat nor --list)", "--flat"),
]


@pytest.mark.parametrize("sharded", [False, True], ids=["pack", "sharded"])
@pytest.mark.parametrize("how", ["api", "cli"])
@pytest.mark.parametrize("made, given, was, asked", REFUSED, ids=["extensions", "match", "match-added", "flat"])
def test_other_filters_are_refused_and_the_pack_is_left_as_it_was(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    made: dict[str, Any],
    given: dict[str, Any],
    was: str,
    asked: str,
    how: str,
    sharded: bool,
) -> None:
    src = mixed_tree(tmp_path / "src")
    dst = tmp_path / "p"
    do_pack(src, dst, how, sharded=sharded, **made)
    before = contents(dst)
    change(src)
    if how == "cli":
        capsys.readouterr()
        code = main(["pack", str(src), str(dst), "--update", "--no-progress", *cli_flags(given)])
        assert code == EXIT_CODES["usage"]
        message, overwrite = capsys.readouterr().err, "--overwrite"
    else:
        with pytest.raises(OptionError) as info:
            do_pack(src, dst, how, sharded=sharded, update=True, **given)
        message, overwrite = str(info.value), "overwrite=True"
        was, asked = (python_form(words) for words in (was, asked))
    shown = message.replace("\n", " ")
    assert str(dst) in shown
    assert f"was packed with {was}; this update asks for {asked}" in shown, shown
    if made.get("match"):  # never "leave out --match": an update does not run the pack's pattern
        assert f"give the pack's own {was} again" in shown, shown
    assert overwrite in shown
    assert contents(dst) == before


def test_a_list_pack_needs_its_list_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = mixed_tree(tmp_path / "src")
    listing = tmp_path / "list.txt"
    listing.write_text("cat/keep/a.png 0\ndog/keep/b.jpg 1\n")
    dst = tmp_path / "p"
    pack(src, dst, list_file=listing, progress=False)
    before = contents(dst)
    with pytest.raises(OptionError, match="was packed from a list file") as info:
        pack(src, dst, update=True, progress=False)
    assert str(dst) in str(info.value) and "list_file=" in str(info.value)
    assert main(["pack", str(src), str(dst), "--update"]) == EXIT_CODES["usage"]
    assert "pass the list file with --list FILE" in capsys.readouterr().err
    assert contents(dst) == before
    listing.write_text("cat/keep/a.png 0\ndog/keep/b.jpg 1\ndog/drop/a.png 1\n")
    assert main(["pack", str(src), str(dst), "--update", "--list", str(listing), "--no-progress"]) == 0
    assert contents(dst) == fresh(src, tmp_path, list_file=listing)


def png_only(path: str) -> bool:
    return path.endswith(".png")


def keep_all(path: str) -> bool:
    return True


def test_is_valid_file_is_recorded_by_name_and_must_be_passed_again(tmp_path: Path) -> None:
    src = mixed_tree(tmp_path / "src")
    dst = tmp_path / "p"
    pack(src, dst, is_valid_file=png_only, progress=False)
    before = contents(dst)
    change(src)
    with pytest.raises(OptionError, match=r"was packed with the is_valid_file callable test_update_filters\.png_only"):
        pack(src, dst, update=True, progress=False)
    with pytest.raises(OptionError, match=r"is_valid_file test_update_filters\.keep_all"):
        pack(src, dst, update=True, is_valid_file=keep_all, progress=False)
    with pytest.raises(OptionError, match=r"was packed with is_valid_file test_update_filters\.png_only"):
        pack(src, dst, update=True, extensions=".png", progress=False)
    assert main(["pack", str(src), str(dst), "--update"]) == EXIT_CODES["usage"]
    assert contents(dst) == before
    pack(src, dst, update=True, is_valid_file=png_only, progress=False)
    assert contents(dst) == fresh(src, tmp_path, is_valid_file=png_only)
    assert_imagefolder(src, dst, png_only)


def test_pack_sources_refuses_sources_scanned_with_other_filters(tmp_path: Path) -> None:
    """The last guard: an update of already scanned sources (``pack_sources``) checks them too."""
    src = mixed_tree(tmp_path / "src")
    dst = tmp_path / "p"
    pack(src, dst, extensions=".png", progress=False)
    before = contents(dst)
    change(src)
    with pytest.raises(OptionError, match=r"was packed with extensions \.png; this update asks for extensions \.jpg"):
        pack_sources(scan(src), dst, update=True, progress=False)
    assert contents(dst) == before
    pack_sources(scan(src, extensions=".png"), dst, update=True, progress=False)
    assert contents(dst) == fresh(src, tmp_path, extensions=".png")


def _rewrite_source(dst: Path, source: Any) -> None:
    """Put ``source`` into the pack's manifest (None: leave it out), checksums made to match."""
    env = lmdb.open(str(dst), map_size=1 << 30)
    with env.begin(write=True) as txn:
        meta = dict(decode_meta(txn.get(META_KEY), where=str(dst)))  # a Manifest, read-only: a dict to edit
        if source is None:
            del meta["source"]
        else:
            meta["source"] = source
        txn.put(META_KEY, encode_meta(meta))
        tables = {key: txn.get(key) for key in TABLE_KEYS if txn.get(key) is not None}
        txn.put(CHECK_KEY, encode_check(tables))
    env.close()


def test_a_pack_that_records_no_source_is_updated_with_the_filters_given(tmp_path: Path) -> None:
    """Nothing recorded, nothing to keep: the filters given (or the defaults) apply, as before."""
    src = mixed_tree(tmp_path / "src")
    dst = tmp_path / "p"
    pack(src, dst, extensions=".png", progress=False)
    _rewrite_source(dst, None)
    change(src)
    pack(src, dst, update=True, extensions=".png", progress=False)
    assert contents(dst) == fresh(src, tmp_path, extensions=".png")


@pytest.mark.parametrize("pattern", ["(a+)+$", "(" * 10])
def test_a_pattern_read_from_a_pack_is_never_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pattern: str) -> None:
    """A recorded ``match`` (a hostile one: catastrophic backtracking, or no pattern at all) is
    named for the user to give again, never compiled or searched."""
    src = mixed_tree(tmp_path / "src")
    dst = tmp_path / "p"
    pack(src, dst, extensions=".png", progress=False)
    _rewrite_source(dst, {"layout": "imagefolder", "extensions": [".png"], "match": pattern})
    before = contents(dst)
    change(src)
    compiled: list[str] = []
    real_compile = re.compile
    monkeypatch.setattr(re, "compile", lambda p, *a: compiled.append(p) or real_compile(p, *a))
    with pytest.raises(OptionError, match=python_form("pass the same --match again")) as info:
        pack(src, dst, update=True, progress=False)
    assert repr(pattern) in str(info.value)
    assert pattern not in compiled
    assert contents(dst) == before


@pytest.mark.parametrize(
    "source",
    [
        {"layout": "imagefolder", "extensions": [".png"], "match": "a" * 5000},  # longer than any we take
        {"layout": "imagefolder", "extensions": [7]},
        {"layout": "../../etc", "extensions": [".png"]},
    ],
    ids=["long-regex", "not-text", "unknown-layout"],
)
def test_a_forged_source_record_is_refused(tmp_path: Path, source: dict[str, Any]) -> None:
    src = mixed_tree(tmp_path / "src")
    dst = tmp_path / "p"
    pack(src, dst, extensions=".png", progress=False)
    _rewrite_source(dst, source)
    before = contents(dst)
    change(src)
    with pytest.raises(PackError, match="records a source layout or file filters that are not valid"):
        pack(src, dst, update=True, progress=False)
    assert contents(dst) == before


def test_info_shows_the_filters_an_update_keeps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = mixed_tree(tmp_path / "src")
    dst = tmp_path / "p"
    pack(src, dst, extensions=(".png",), match="/keep/", progress=False)
    capsys.readouterr()
    assert main(["info", str(dst)]) == 0
    assert f"imagefolder {src} (--extensions .png --match '/keep/')" in capsys.readouterr().out

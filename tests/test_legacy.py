"""lmdbfolder import: recipe LMDBs converted, and pickles that would run code refused."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import lmdb
import numpy as np
import pytest
from PIL import Image

from conftest import image_bytes
from lmdbfolder.cli import EXIT_CODES, main
from lmdbfolder.errors import SourceError, UnsafePickleError
from lmdbfolder.read.reader import Reader
from lmdbfolder.tools.importing import RestrictedUnpickler, detect_legacy, import_legacy, safe_loads
from lmdbfolder.tools.verify import verify


def _write_lmdb(path: Path, items: dict[bytes, bytes]) -> None:
    env = lmdb.open(str(path), map_size=1 << 26)
    with env.begin(write=True) as txn:
        for k, v in items.items():
            txn.put(k, v)
    env.close()


def folder2lmdb(path: Path, n: int, *, with_keys: bool) -> list[tuple[bytes, int]]:
    """The Efficient-PyTorch recipe, pyarrow swapped for pickle (its most common fork)."""
    rng = np.random.default_rng(0)
    samples = [(image_bytes("rgb_jpeg", rng, w=20 + i)[0], i % 3) for i in range(n)]
    items = {str(i).encode(): pickle.dumps(s) for i, s in enumerate(samples)}
    items[b"__len__"] = pickle.dumps(n)
    if with_keys:
        items[b"__keys__"] = pickle.dumps([str(i).encode() for i in range(n)])
    _write_lmdb(path, items)
    return samples


@pytest.mark.parametrize("with_keys", [True, False])
def test_import_pickled_recipe(tmp_path: Path, with_keys: bool) -> None:
    samples = folder2lmdb(tmp_path / "old", 12, with_keys=with_keys)  # 12 keys: "10" sorts before "2"
    result = import_legacy(tmp_path / "old", tmp_path / "new", progress=False)
    assert result.count == 12
    with Reader(tmp_path / "new") as r:
        assert [bytes(rec.payload) for rec in r] == [s[0] for s in samples]
        assert list(r.labels) == [s[1] for s in samples]
        assert r.classes == ["0", "1", "2"]
        assert r.paths() == [str(i) for i in range(12)]
    assert verify(tmp_path / "new", decode=True, progress=False).ok


def test_malicious_pickle_does_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    payload = pickle.dumps((Exploit(), 1))
    with pytest.raises(UnsafePickleError, match=r"posix.system|os.system"):
        safe_loads(payload, where="x")
    assert not marker.exists()
    _write_lmdb(tmp_path / "old", {b"0": payload, b"__len__": pickle.dumps(1)})
    with pytest.raises(UnsafePickleError) as info:
        import_legacy(tmp_path / "old", tmp_path / "new", progress=False)
    assert "key 0" in str(info.value) and "could run code" in str(info.value) and info.value.hint
    assert not marker.exists()
    assert main(["import", str(tmp_path / "old"), str(tmp_path / "new2")]) == EXIT_CODES["source error"]
    assert not marker.exists()


@pytest.mark.parametrize(
    "obj",
    [np.zeros(3), Image.new("RGB", (1, 1)), {1, 2}],
)
def test_restricted_unpickler_refuses_non_plain_objects(obj) -> None:
    with pytest.raises(UnsafePickleError):
        safe_loads(pickle.dumps(obj), where="x")


def test_restricted_unpickler_reads_plain_data() -> None:
    data = {"a": [1, 2.5, None, True], "b": (b"x", "y")}
    assert safe_loads(pickle.dumps(data), where="x") == data
    assert RestrictedUnpickler.find_class is not pickle.Unpickler.find_class


def test_pyarrow_values_are_reported(tmp_path: Path) -> None:
    _write_lmdb(tmp_path / "old", {b"0": b"ARROW1\x00\x00garbage", b"__len__": b"1"})
    with pytest.raises(SourceError, match="not a pickle"):
        import_legacy(tmp_path / "old", tmp_path / "new", progress=False)


def _basicsr(path: Path, *, meta: str, encoded: bool) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    arrays = [rng.integers(0, 256, (5 + i, 7, 3), dtype=np.uint8) for i in range(4)]  # BGR, as cv2 reads
    names = [f"img_{i:03d}.png" for i in range(4)]
    items = {}
    for name, bgr in zip(names, arrays):
        key = os.path.splitext(name)[0].encode()
        if encoded:
            out = __import__("io").BytesIO()
            Image.fromarray(bgr[:, :, ::-1]).save(out, "PNG")
            items[key] = out.getvalue()
        else:
            items[key] = bgr.tobytes()
    _write_lmdb(path, items)
    if meta == "txt":
        lines = [f"{n} ({a.shape[0]},{a.shape[1]},{a.shape[2]}) 1" for n, a in zip(names, arrays)]
        (path / "meta_info.txt").write_text("\n".join(lines) + "\n")
    else:
        resolution = [f"{a.shape[2]}_{a.shape[0]}_{a.shape[1]}" for a in arrays]
        (path / "meta_info.pkl").write_bytes(pickle.dumps({"keys": names, "resolution": resolution}))
    return arrays


@pytest.mark.parametrize("meta", ["txt", "pkl"])
def test_import_basicsr_raw_arrays_bgr_to_rgb(tmp_path: Path, meta: str) -> None:
    arrays = _basicsr(tmp_path / "old", meta=meta, encoded=False)
    assert detect_legacy(str(tmp_path / "old")).kind == "basicsr"
    result = import_legacy(tmp_path / "old", tmp_path / "new", progress=False)
    assert result.store == "raw" and result.count == 4
    with Reader(tmp_path / "new") as r:
        for i, bgr in enumerate(arrays):
            assert np.array_equal(np.asarray(r.image(i)), bgr[:, :, ::-1])
        assert r.paths()[0] == "img_000.png" and set(r.labels) == {-1}
    import_legacy(tmp_path / "old", tmp_path / "rgb", channel_order="rgb", progress=False)
    with Reader(tmp_path / "rgb") as r:
        assert np.array_equal(np.asarray(r.image(0)), arrays[0])


def test_import_basicsr_encoded_values(tmp_path: Path) -> None:
    arrays = _basicsr(tmp_path / "old", meta="txt", encoded=True)
    assert main(["import", str(tmp_path / "old"), str(tmp_path / "new"), "--no-progress"]) == 0
    with Reader(tmp_path / "new") as r:
        assert r.store == "encoded" and r.get(0).encoding == "png"
        assert np.array_equal(np.asarray(r.image(3)), arrays[3][:, :, ::-1])


def test_unrecognised_lmdb(tmp_path: Path) -> None:
    _write_lmdb(tmp_path / "old", {b"alpha": b"1", b"beta": b"2"})
    with pytest.raises(SourceError, match="not a recognised recipe LMDB"):
        import_legacy(tmp_path / "old", tmp_path / "new", progress=False)


@pytest.mark.parametrize("where", ["__keys__", "meta_info.txt", "meta_info.pkl"])
def test_a_sample_listed_twice_is_refused_not_imported_twice(tmp_path: Path, where: str) -> None:
    # A list file naming a path twice is refused; a recipe's list of keys must be too, or every
    # epoch sees that sample twice (and the pack cannot be exported as files).
    old = tmp_path / "old"
    if where == "__keys__":
        folder2lmdb(old, 3, with_keys=True)
        env = lmdb.open(str(old), map_size=1 << 26)
        with env.begin(write=True) as txn:
            txn.put(b"__keys__", pickle.dumps([b"0", b"1", b"2", b"1"]))
            txn.put(b"__len__", pickle.dumps(4))
        env.close()
        twice = "'1'"
    else:
        _basicsr(old, meta=where.rsplit(".", 1)[1], encoded=True)
        if where == "meta_info.txt":
            lines = (old / where).read_text().splitlines()
            # the same key under another spelling: BasicSR keys are the names without extension
            (old / where).write_text("\n".join([*lines, lines[2].replace(".png", "", 1)]) + "\n")
            twice = "'img_002'"
        else:
            meta = pickle.loads((old / where).read_bytes())
            meta["keys"].append(meta["keys"][2])
            meta["resolution"].append(meta["resolution"][2])
            (old / where).write_bytes(pickle.dumps(meta))
            twice = "'img_002"
    with pytest.raises(SourceError, match="listed twice") as caught:
        import_legacy(old, tmp_path / "new", progress=False)
    assert twice in str(caught.value)
    assert main(["import", str(old), str(tmp_path / "new"), "--no-progress"]) == EXIT_CODES["source error"]
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize(
    ("meta", "shape"),
    [("pkl", "3_5_" + "9" * 1_000_000 + "x"), ("pkl", "3_5_" + "9" * 5000), ("txt", "(5," + "9" * 5000 + ",3)")],
)
def test_meta_info_with_absurd_numbers_is_a_clear_short_error(tmp_path: Path, meta: str, shape: str) -> None:
    # 5000 digits: int() refuses more than 4300 (a traceback, exit code 1, before); a long
    # resolution was quoted whole in the message.
    old = tmp_path / "old"
    _basicsr(old, meta=meta, encoded=True)
    if meta == "pkl":
        info = pickle.loads((old / "meta_info.pkl").read_bytes())
        info["resolution"][1] = shape
        (old / "meta_info.pkl").write_bytes(pickle.dumps(info))
    else:
        lines = (old / "meta_info.txt").read_text().splitlines()
        lines[1] = f"img_001.png {shape} 1"
        (old / "meta_info.txt").write_text("\n".join(lines) + "\n")
    with pytest.raises(SourceError) as caught:
        import_legacy(old, tmp_path / "new", progress=False)
    assert len(str(caught.value)) < 1000
    assert main(["import", str(old), str(tmp_path / "new"), "--no-progress"]) == EXIT_CODES["source error"]


@pytest.mark.parametrize("layout", ["pickled", "basicsr"])
def test_values_that_are_not_whole_images_are_skipped_as_pack_skips_files(tmp_path: Path, layout: str) -> None:
    # import stored them unchecked: verify then failed on a pack that import had called done.
    good = image_bytes("rgb_jpeg", np.random.default_rng(0))[0]
    values = [good, b"plain text, not an image", good[: len(good) // 2], good]
    if layout == "pickled":
        items = {str(i).encode(): pickle.dumps((v, i % 2)) for i, v in enumerate(values)}
        items[b"__len__"] = pickle.dumps(len(values))
        _write_lmdb(tmp_path / "old", items)
        names = [str(i) for i in range(4)]
    else:
        names = [f"img_{i}.jpg" for i in range(4)]
        _write_lmdb(tmp_path / "old", {os.path.splitext(n)[0].encode(): v for n, v in zip(names, values)})
        (tmp_path / "old" / "meta_info.txt").write_text("".join(f"{n} (1,1,3) 1\n" for n in names))
    result = import_legacy(tmp_path / "old", tmp_path / "new", progress=False)
    assert result.count == 2
    not_an_image = {
        "pickled": "not an image Pillow can identify (wrong content for its extension?)",
        "basicsr": "mixes encoded images and raw arrays; this pack stores encoded values",  # as before
    }
    assert result.skipped == [
        (names[1], not_an_image[layout]),
        (names[2], "truncated: the JPEG has no end-of-image marker (FFD9) after its image data"),
    ]
    assert (tmp_path / "new" / "skipped.txt").read_text().count("\n") == 4  # two comment lines, two files
    with Reader(tmp_path / "new") as r:
        assert r.paths() == [names[0], names[3]] and [bytes(rec.payload) for rec in r] == [good, good]
    assert verify(tmp_path / "new", decode=True, progress=False).ok


@pytest.mark.parametrize("recipe", ["basicsr", "pickled"])
def test_an_update_of_an_imported_pack_says_it_was_imported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], recipe: str
) -> None:
    """Issue 34, messages: the update called an imported pack "damaged, or not written by
    lmdbfolder" while `verify` found it fine. It says what it is, and what works."""
    from lmdbfolder import pack

    old = tmp_path / "old"
    if recipe == "basicsr":
        _basicsr(old, meta="txt", encoded=True)
    else:
        folder2lmdb(old, 4, with_keys=True)
    new = tmp_path / "new"
    import_legacy(old, new, progress=False)
    assert verify(new, progress=False).ok
    src = tmp_path / "src"
    data, _ = image_bytes("rgb_jpeg", np.random.default_rng(0), w=9, h=9)
    (src / "a").mkdir(parents=True)
    (src / "a" / "x.jpg").write_bytes(data)
    capsys.readouterr()
    assert main(["pack", str(src), str(new), "--update"]) == EXIT_CODES["usage"]
    err = capsys.readouterr().err
    assert "was imported from another LMDB" in err and "--overwrite" in err and "damaged" not in err, err
    with pytest.raises(Exception, match="was imported from another LMDB"):
        pack(src, new, update=True, progress=False)
    assert main(["pack", str(src), str(new), "--overwrite", "--no-progress"]) == 0  # what it says works

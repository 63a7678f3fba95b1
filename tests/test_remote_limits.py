"""Issue 34, 9: remote reads that never hang, never keep a wrong byte, never trust a name.

Against the real S3 API on 127.0.0.1 (moto, ``tests/conftest.py``) through a proxy that
misbehaves as servers do: it dribbles a response a byte at a time, or drops the ``Range``
header of every request (a server that ignores it answers with the whole object). A
forged ``index.json`` is uploaded over a real one. Nothing here measures time: the limits
are set small, and what is checked is the error and what was kept.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
from PIL import Image

from conftest import S3, Proxy
from lmdbfolder import copy_pack, open_pack, verify
from lmdbfolder.cli import main
from lmdbfolder.errors import LmdbFolderError, RemoteError
from lmdbfolder.format import COPYING_SUFFIX, SHARD_INDEX_FILE
from lmdbfolder.remote import MIN_RATE_ENV, STALL_ENV, WINDOW_ENV, Limits
from lmdbfolder.write.shards import pack_sharded

pytest.importorskip("s3fs")
pytest.importorskip("moto")

PART = 16 << 10


def _tree(root: Path, classes: int = 2, per_class: int = 4) -> Path:
    rng = np.random.default_rng(3)
    for c in range(classes):
        for k in range(per_class):
            path = root / f"class{c}" / f"img{k:02d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (40 + k, 48, 3), dtype=np.uint8)).save(path, quality=90)
    return root


@pytest.fixture
def uploaded(s3: S3, tmp_path: Path) -> tuple[str, Path]:
    """A sharded pack (2 shards) at a URL, and its local original."""
    local = tmp_path / "local"
    pack_sharded(_tree(tmp_path / "tree"), local, shards=2, progress=False)
    url = s3.url("train")
    copy_pack(local, url)
    return url, local


class _BadProxy(Proxy):
    """A ``Proxy`` that can dribble the bodies of the responses for ``data.mdb`` or
    ``index.json`` (one byte per ``gap`` seconds after the headers), and drop the
    ``Range`` header of every request (``strip_range``)."""

    def __init__(self, upstream: str) -> None:
        self.dribble: tuple[str, ...] = ()
        self.gap = 0.05
        self.strip_range = False
        super().__init__(upstream)

    def _request_bytes(self, data: bytes) -> bytes:
        if self.strip_range:
            return re.sub(rb"\r\n[Rr]ange: bytes=[0-9]*-[0-9]*", b"", data)
        return data

    def _deliver(self, dst: Any, data: bytes, path: str) -> None:
        if not any(path.split("?")[0].endswith(name) for name in self.dribble):
            dst.sendall(data)
            return
        head, sep, body = data.partition(b"\r\n\r\n") if data.startswith(b"HTTP/") else (b"", b"", data)
        dst.sendall(head + sep)
        for i in range(len(body)):
            time.sleep(self.gap)
            dst.sendall(body[i : i + 1])


@pytest.fixture
def bad_proxy(s3: S3) -> Iterator[_BadProxy]:
    p = _BadProxy(s3.endpoint)
    s3.use(p.endpoint)
    yield p
    p.close()


def _small_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STALL_ENV, "20")
    monkeypatch.setenv(WINDOW_ENV, "0.5")
    monkeypatch.setenv(MIN_RATE_ENV, "100000")


@pytest.mark.timeout(120)
def test_a_server_dribbling_bytes_is_a_clear_error_naming_the_url(
    s3: S3, uploaded: tuple[str, Path], bad_proxy: _BadProxy, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A byte every few hundredths of a second: `copy` hung with no message (each byte
    reset the client's read timeout)."""
    url, _ = uploaded
    _small_limits(s3.monkeypatch)
    bad_proxy.dribble = ("/data.mdb",)
    with pytest.raises(RemoteError, match="less than the minimum rate") as caught:
        copy_pack(url, tmp_path / "dst", part_size=PART, jobs=2)
    assert caught.value.url.startswith(url) and caught.value.url.endswith("/data.mdb")
    assert "run the same command again" in caught.value.hint and not (tmp_path / "dst").exists()
    # The command line says the same, without a traceback.
    assert main(["copy", url, str(tmp_path / "dst2"), "--part-size", "16KiB", "--min-rate", "200KB"]) != 0
    err = capsys.readouterr().err
    assert "minimum rate" in err and url in err and "Traceback" not in err
    # The index itself, read whole (the deadline of a read of known length).
    bad_proxy.dribble = ("/index.json",)
    s3.monkeypatch.setenv(STALL_ENV, "0.5")
    with pytest.raises(RemoteError, match="no complete response within") as caught:
        copy_pack(url, tmp_path / "dst3")
    assert caught.value.url == f"{url}/{SHARD_INDEX_FILE}"
    # Staging reads through the same limits.
    with pytest.raises(LmdbFolderError, match="no complete response within"):
        open_pack(url, cache_dir=tmp_path / "cache")
    # A healthy server again: the copy finishes.
    bad_proxy.dribble = ()
    result = copy_pack(url, tmp_path / "dst", part_size=PART, jobs=2)
    assert result.count == 8 and verify(tmp_path / "dst", progress=False).ok


def test_the_limits_are_checked_options() -> None:
    assert Limits().stall > 0 and Limits().min_rate > 0
    with pytest.raises(ValueError, match="positive"):
        Limits(stall=0)
    os.environ[MIN_RATE_ENV] = "fast"
    try:
        with pytest.raises(ValueError, match=MIN_RATE_ENV):
            Limits.current()
    finally:
        del os.environ[MIN_RATE_ENV]


def test_after_a_server_that_ignored_range_an_honest_rerun_succeeds_at_once(
    s3: S3, uploaded: tuple[str, Path], bad_proxy: _BadProxy, tmp_path: Path
) -> None:
    """Each part's response was the object from its first byte, written at the part's place
    and journalled; the shards aborted half way kept those parts, and the first honest rerun
    said "upload the pack again" (1 run in 2 to 5)."""
    url, local = uploaded
    dst = tmp_path / "dst"
    bad_proxy.strip_range = True
    with pytest.raises(RemoteError, match="ignores the Range header") as caught:
        copy_pack(url, dst, part_size=PART, jobs=4)
    assert caught.value.url.endswith("/data.mdb") and not dst.exists()
    copying = tmp_path / ("dst" + COPYING_SUFFIX)
    journals = [p for p in copying.rglob("*.parts")] if copying.exists() else []
    assert all(len(p.read_text().splitlines()) <= 1 for p in journals)  # no part was kept
    bad_proxy.strip_range = False
    result = copy_pack(url, dst, part_size=PART, jobs=4)
    assert result.count == 8
    assert verify(dst, progress=False).ok


def _forge_index(s3: S3, url: str, change: Any) -> None:
    key = url.removeprefix("s3://") + "/" + SHARD_INDEX_FILE
    index = json.loads(s3.client().cat_file(key))
    change(index)
    s3.client().pipe_file(key, json.dumps(index, sort_keys=True, indent=1).encode())


@pytest.mark.parametrize("forgery", ["pack_id", "tables_sha256"])
def test_an_index_that_does_not_describe_its_shards_is_never_published(
    s3: S3, uploaded: tuple[str, Path], tmp_path: Path, forgery: str
) -> None:
    """Without data_sha256, with a wrong pack_id or tables_sha256: `copy` exited 0 and
    published a pack that failed `verify`."""
    url, _ = uploaded

    def change(index: dict[str, Any]) -> None:
        for entry in index["shards"]:
            entry.pop("data_sha256", None)
        if forgery == "pack_id":
            index["shards"][1]["pack_id"] = "0123456789abcdef0123456789abcdef"
        else:
            index["shards"][1]["tables_sha256"] = "ab" * 32

    _forge_index(s3, url, change)
    dst = tmp_path / "dst"
    with pytest.raises(RemoteError, match=forgery) as caught:
        copy_pack(url, dst)
    assert caught.value.url == f"{url}/{SHARD_INDEX_FILE}" and "upload it again" in caught.value.hint
    assert not dst.exists()


@pytest.mark.parametrize(
    "name",
    ["..-00000-of-00002.lmdb", "a\x00b-00000-of-00002.lmdb", "a" * 300 + "-00000-of-00002.lmdb"],
    ids=["dotdot", "nul", "long"],
)
def test_a_shard_name_from_a_remote_index_is_checked_before_use(
    s3: S3, uploaded: tuple[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """`copy` crashed with a traceback, staging raised a bare ValueError or OSError."""
    url, _ = uploaded
    _forge_index(s3, url, lambda index: index["shards"][0].__setitem__("name", name))
    index_url = f"{url}/{SHARD_INDEX_FILE}"
    with pytest.raises(LmdbFolderError) as caught:
        copy_pack(url, tmp_path / "dst")
    assert index_url in str(caught.value) and "no valid name" in str(caught.value)
    assert main(["copy", url, str(tmp_path / "dst")]) != 0
    err = capsys.readouterr().err
    assert index_url in err and "Traceback" not in err
    with pytest.raises(LmdbFolderError) as staged:
        open_pack(url, cache_dir=tmp_path / "cache")
    assert index_url in str(staged.value) and "no valid name" in str(staged.value)
    assert not any("\x00" in p or len(p) > 255 for p in os.listdir(tmp_path))

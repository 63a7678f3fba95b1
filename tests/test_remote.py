"""`lmdbfolder copy` to and from object storage, against a real S3 API on 127.0.0.1.

moto's S3 server runs in this process (the session fixture ``moto_server``);
the round trips and the kill-and-resume copy also run against SeaweedFS, a
real object store that the tests start on 127.0.0.1 (``seaweedfs_server``);
the client is the real one (fsspec/s3fs -> aiobotocore -> botocore). Faults
are real too: a proxy in front of the server that stops mid-transfer, a
``kill -9`` of the `lmdbfolder copy` process, a tampered object, a missing
bucket or key, no or wrong credentials (a second moto server, with
authentication on, in its own process), and a full disk (a tiny tmpfs).
Transfers are judged by the bytes the proxy forwarded, never by time.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest
from PIL import Image

from conftest import S3, S3_ENV, Proxy, free_port, on_every_s3_server, write
from lmdbfolder import copy_pack, verify
from lmdbfolder.cli import EXIT_CODES, main
from lmdbfolder.errors import MissingDependencyError, OutputExistsError, RemoteError
from lmdbfolder.format import COPYING_SUFFIX, DATA_FILE, PARTS_SUFFIX, SHARD_INDEX_FILE, decode_shard_index
from lmdbfolder.write.shards import pack_sharded
from lmdbfolder.write.writer import pack

pytest.importorskip("s3fs")
pytest.importorskip("moto")

PART = 16 << 10  # small parts, so each shard downloads in ~10 ranged requests


def noise_tree(root: Path, classes: int = 4, per_class: int = 16, seed: int = 0) -> Path:
    """JPEGs of noise (~10 KB each), so shards are a few hundred KB."""
    rng = np.random.default_rng(seed)
    for c in range(classes):
        for k in range(per_class):
            img = Image.fromarray(rng.integers(0, 256, (48 + k, 64, 3), dtype=np.uint8))
            path = root / f"class{c}" / f"img{k:02d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            img.save(path, quality=90)
    return root


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    out = tmp_path / "packs" / "train"
    pack_sharded(noise_tree(tmp_path / "tree"), out, shards=4, progress=False)
    return out


def shard_names(pack_dir: Path) -> list[str]:
    return [e["name"] for e in json.loads((pack_dir / SHARD_INDEX_FILE).read_text())["shards"]]


def data_total(pack_dir: Path) -> int:
    return sum((pack_dir / n / DATA_FILE).stat().st_size for n in shard_names(pack_dir))


def same_shards(a: Path, b: Path) -> None:
    for name in shard_names(a):
        assert filecmp.cmp(a / name / DATA_FILE, b / name / DATA_FILE, shallow=False), name


@on_every_s3_server
def test_round_trip_local_s3_local_byte_for_byte(s3: S3, sharded: Path, tmp_path: Path) -> None:
    url = s3.url("datasets/train")
    up = copy_pack(sharded, url)
    assert (up.count, up.shards) == (64, 4) and up.transferred == data_total(sharded)
    # the uploaded index: the local one plus each shard's digest, size and classes
    remote_index = decode_shard_index(s3.client().cat_file(f"{s3.bucket}/datasets/train/index.json"), where=url)
    local_index = json.loads((sharded / SHARD_INDEX_FILE).read_text())
    for theirs, ours in zip(remote_index["shards"], local_index["shards"]):
        added = {k: theirs.pop(k) for k in ("data_sha256", "class_counts", "bytes")}
        ours.pop("bytes", None)
        assert theirs == ours
        assert sum(n for _, n in added["class_counts"]) == ours["count"]

    back = tmp_path / "back"
    down = copy_pack(url, back)
    assert (down.count, down.shards) == (64, 4) and down.transferred == data_total(sharded)
    same_shards(sharded, back)
    assert verify(back, progress=False).ok
    assert not (tmp_path / ("back" + COPYING_SUFFIX)).exists()
    # the CLI says the same; a second download to the same place is refused, not overwritten
    assert main(["copy", url, str(back)]) == EXIT_CODES["output exists"]
    with pytest.raises(OutputExistsError):
        copy_pack(sharded, url)  # a pack is there: not replaced without overwrite


@on_every_s3_server
def test_single_pack_round_trip(s3: S3, tmp_path: Path) -> None:
    single = tmp_path / "single.lmdb"
    pack(noise_tree(tmp_path / "tree", classes=2, per_class=5), single, progress=False)
    copy_pack(single, s3.url("single"))
    back = tmp_path / "back"
    result = copy_pack(s3.url("single"), back, part_size=PART)
    assert result.count == 10 and result.shards == 1
    assert filecmp.cmp(single / DATA_FILE, back / DATA_FILE, shallow=False)
    assert verify(back, progress=False).ok
    # a single pack cannot be staged: the message says what to do
    from lmdbfolder import open_pack

    with pytest.raises(RemoteError, match="single pack"):
        open_pack(s3.url("single"), cache_dir=tmp_path / "cache")


def test_an_interrupted_download_says_a_rerun_resumes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import lmdbfolder.tools.copy as copy_module

    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt  # Ctrl-C (or SIGTERM) half way

    monkeypatch.setattr(copy_module, "_download", interrupted)
    assert main(["copy", "s3://bucket/train", str(tmp_path / "dst")]) == EXIT_CODES["interrupted"]
    assert "interrupted; run the same command again to resume" in capsys.readouterr().err


def _journal_bytes(copying: Path, names: list[str], part: int) -> int:
    """Bytes the interrupted copy had on disk: published shards whole, plus the journaled parts."""
    done = 0
    for name in names:
        if (copying / name / DATA_FILE).is_file():
            done += (copying / name / DATA_FILE).stat().st_size
            continue
        journal = copying / (name + COPYING_SUFFIX) / (DATA_FILE + PARTS_SUFFIX)
        if journal.is_file():
            lines = journal.read_text().split("\n")
            size = json.loads(lines[0])["size"]
            for line in lines[1:-1]:
                k = int(line)
                done += min(part, size - k * part)
    return done


def _wait_for(condition: Any, what: str, timeout: float = 120) -> None:
    # Waits for an observable state (a file the child writes), bounded: not a guessed delay.
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@on_every_s3_server
def test_kill_9_mid_download_resumes_fetching_only_the_missing_parts(
    s3: S3, proxy: Proxy, sharded: Path, tmp_path: Path
) -> None:
    url = s3.url("train")
    copy_pack(sharded, url)
    total = data_total(sharded)
    names = shard_names(sharded)
    dst = tmp_path / "dst"
    copying = tmp_path / ("dst" + COPYING_SUFFIX)

    proxy.reset()
    proxy.pause_after(total // 2)  # the transfer stops half way; the process is then killed
    env = {**os.environ, **s3.env(proxy.endpoint)}
    child = subprocess.Popen(
        [sys.executable, "-m", "lmdbfolder", "copy", url, str(dst), "--part-size", str(PART), "--jobs", "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proxy.paused.wait(120), "the download never got half way"
        _wait_for(lambda: _journal_bytes(copying, names, PART) > 0, "a part on disk")
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        # The killed copy's connections end here: a response held by the pause must not
        # be forwarded (and counted) once the rerun's counting has begun.
        proxy.down()
        proxy.resume()
        proxy.up()
    assert child.returncode == -signal.SIGKILL
    assert not dst.exists() and copying.is_dir()
    done = _journal_bytes(copying, names, PART)
    assert 0 < done < total

    proxy.reset()
    result = copy_pack(url, dst, part_size=PART, jobs=2)
    fetched = proxy.data_bytes()
    data_requests = sum(1 for method, path in proxy.requests if method == "GET" and DATA_FILE in path)
    # Only what was missing travelled again (responses carry ~0.5 KB of headers each).
    assert result.transferred == total - done
    assert fetched <= total - done + 1024 * data_requests, (fetched, total, done)
    same_shards(sharded, dst)
    assert verify(dst, progress=False).ok
    assert not copying.exists()


def test_a_copy_lists_the_shards_once_instead_of_a_head_request_each(
    s3: S3, proxy: Proxy, sharded: Path, tmp_path: Path
) -> None:
    url = s3.url("train")
    copy_pack(sharded, url)
    proxy.reset()
    with pytest.MonkeyPatch.context() as mp:
        for key, value in s3.env(proxy.endpoint).items():
            mp.setenv(key, value)
        copy_pack(url, tmp_path / "dst", part_size=PART, jobs=2)
    heads = [path for method, path in proxy.requests if method == "HEAD" and DATA_FILE in path]
    gets = [path for method, path in proxy.requests if method == "GET" and DATA_FILE in path]
    assert heads == [] and len(gets) >= len(shard_names(sharded))  # counted requests, not seconds
    same_shards(sharded, tmp_path / "dst")


def test_server_stopping_mid_copy_is_a_clear_error_and_the_rerun_resumes(
    s3: S3, proxy: Proxy, sharded: Path, tmp_path: Path
) -> None:
    import threading

    url = s3.url("train")
    copy_pack(sharded, url)
    total = data_total(sharded)
    proxy.reset()
    proxy.pause_after(total // 2)
    # botocore's and fsspec's standard settings: fewer attempts, so the dead server is given up on sooner
    s3.monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    s3.monkeypatch.setenv("FSSPEC_S3_RETRIES", "2")

    def stop_server() -> None:
        proxy.paused.wait(120)
        proxy.down()  # every connection closed, new ones refused from now on
        proxy.resume()

    stopper = threading.Thread(target=stop_server)
    stopper.start()
    dst = tmp_path / "dst"
    with pytest.raises(RemoteError) as caught:
        copy_pack(url, dst, part_size=PART, jobs=2)
    stopper.join()
    assert caught.value.url.startswith(url)
    assert caught.value.kind in ("connection", "other")
    assert "run the same command again" in caught.value.hint
    assert not dst.exists()  # nothing half-published

    proxy.up()
    proxy.reset()
    result = copy_pack(url, dst, part_size=PART, jobs=2)
    assert 0 < result.transferred < total
    same_shards(sharded, dst)
    assert verify(dst, progress=False).ok


def _tamper(s3: S3, url_prefix: str, name: str, data_file: Path, *, grow: bool = False) -> None:
    blob = bytearray(data_file.read_bytes())
    blob[len(blob) // 2] ^= 0xFF  # a record's bytes, in the middle of the file
    if grow:
        blob += b"\0" * 4096
    s3.client().pipe_file(f"{s3.bucket}/{url_prefix}/{name}/{DATA_FILE}", bytes(blob))


def test_a_shard_whose_bytes_do_not_match_its_digest_is_never_published(s3: S3, sharded: Path, tmp_path: Path) -> None:
    url = s3.url("train")
    copy_pack(sharded, url)
    names = shard_names(sharded)
    _tamper(s3, "train", names[2], sharded / names[2] / DATA_FILE)
    dst = tmp_path / "dst"
    with pytest.raises(RemoteError) as caught:
        copy_pack(url, dst, part_size=PART)
    assert caught.value.kind == "digest"
    assert caught.value.url == f"{url}/{names[2]}/{DATA_FILE}"
    assert "do not match the index's digest" in str(caught.value)
    copying = tmp_path / ("dst" + COPYING_SUFFIX)
    assert not dst.exists()
    assert not (copying / names[2]).exists() and not (copying / (names[2] + COPYING_SUFFIX) / DATA_FILE).exists()
    # the good shards were kept: after the shard is uploaded again, the rerun fetches it and
    # nothing of the shards finished before the failure (a shard still on its way when it
    # failed stopped there, as many parts in as the machine's pace allowed: fetched again)
    finished = [n for n in names if (copying / n / DATA_FILE).exists()]
    assert names[2] not in finished
    copy_pack(sharded, url, overwrite=True)
    result = copy_pack(url, dst, part_size=PART)
    size = {n: (sharded / n / DATA_FILE).stat().st_size for n in names}
    assert size[names[2]] <= result.transferred <= sum(size[n] for n in names if n not in finished)
    same_shards(sharded, dst)

    # the same object grown: its size already contradicts the index
    _tamper(s3, "train", names[1], sharded / names[1] / DATA_FILE, grow=True)
    with pytest.raises(RemoteError, match="the index says"):
        copy_pack(url, tmp_path / "dst2", part_size=PART)


def test_missing_bucket_and_missing_key_name_the_url(s3: S3, tmp_path: Path) -> None:
    with pytest.raises(RemoteError) as caught:
        copy_pack("s3://no-such-bucket-here/train", tmp_path / "a")
    assert caught.value.kind == "bucket" and caught.value.url.startswith("s3://no-such-bucket-here/train")
    with pytest.raises(RemoteError) as caught:
        copy_pack(s3.url("nothing/here"), tmp_path / "b")
    assert caught.value.kind == "missing" and "no pack there" in caught.value.message
    assert s3.url("nothing/here") in str(caught.value)
    assert not any(tmp_path.iterdir())  # nothing was created locally
    # the CLI: one message naming the URL, its own exit code
    assert main(["copy", s3.url("nothing/here"), str(tmp_path / "c")]) == EXIT_CODES["storage error"]


def test_no_credentials_is_a_clear_error(s3: S3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(RemoteError) as caught:
        copy_pack(s3.url("train"), tmp_path / "a")
    assert caught.value.kind == "credentials" and "AWS_PROFILE" in caught.value.hint


@pytest.fixture(scope="module")
def authenticating_server() -> Any:
    """A moto server in its own process with authentication on: the first 4 requests (an IAM
    user, its key and policy, a bucket) pass unsigned, every later one must be signed by a known key."""
    port = free_port()
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "4"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        import boto3

        kw = {
            "endpoint_url": endpoint,
            "region_name": "us-east-1",
            "aws_access_key_id": "a",
            "aws_secret_access_key": "b",
        }
        import botocore.exceptions

        deadline = time.monotonic() + 60
        while True:  # the server is up when it answers (bounded)
            try:
                iam = boto3.client("iam", **kw)
                iam.create_user(UserName="trainer")
                break
            except botocore.exceptions.EndpointConnectionError:
                assert time.monotonic() < deadline, "moto's server did not start"
                time.sleep(0.05)
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        policy = '{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":"s3:*","Resource":"*"}]}'
        iam.put_user_policy(UserName="trainer", PolicyName="all", PolicyDocument=policy)
        boto3.client("s3", **kw).create_bucket(Bucket="secured")
        yield endpoint, key["AccessKeyId"], key["SecretAccessKey"]
    finally:
        proc.terminate()
        proc.wait()


def test_wrong_credentials_are_a_clear_error(
    authenticating_server: Any, monkeypatch: pytest.MonkeyPatch, sharded: Path, tmp_path: Path
) -> None:
    endpoint, key, secret = authenticating_server
    for name, value in {**S3_ENV, "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": key}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    copy_pack(sharded, "s3://secured/train")  # the right key works
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(RemoteError) as caught:
        copy_pack("s3://secured/train", tmp_path / "a")
    assert caught.value.kind == "credentials" and caught.value.url.startswith("s3://secured/train")
    assert "access denied" in caught.value.message
    assert not any(tmp_path.glob("a*"))
    # credentials from a profile (AWS_PROFILE + a credentials file), as the standard chain reads them
    creds = write(
        tmp_path / "credentials", f"[trainer]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n".encode()
    )
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_PROFILE", "trainer")
    assert copy_pack("s3://secured/train", tmp_path / "b", part_size=PART).count == 64


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="mounting a tiny file system needs root")
def test_full_disk_is_a_clear_error_and_the_rerun_resumes(s3: S3, proxy: Proxy, sharded: Path, tmp_path: Path) -> None:
    url = s3.url("train")
    copy_pack(sharded, url)
    total = data_total(sharded)
    disk = tmp_path / "disk"
    disk.mkdir()
    small = total // 2  # room for about two shards
    script = (
        f'mount -t tmpfs -o size={small} tmpfs "$1" && '
        f'"{sys.executable}" -m lmdbfolder copy "$2" "$1/out" --part-size {PART} --no-progress; echo "rc=$?"; '
        f'mount -o remount,size={4 * total} "$1" && '
        f'"{sys.executable}" -m lmdbfolder copy "$2" "$1/out" --part-size {PART} --json && '
        f'"{sys.executable}" -m lmdbfolder verify "$1/out" --no-progress'
    )
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", str(disk), url],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **s3.env(proxy.endpoint)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"rc={EXIT_CODES['storage error']}" in proc.stdout, proc.stdout + proc.stderr
    assert "the disk is full" in proc.stderr and url in proc.stderr, proc.stderr
    summary = json.loads(proc.stdout[proc.stdout.index("{") : proc.stdout.rindex("}") + 1])
    assert 0 < summary["transferred"] < total  # the rerun kept what the full disk had taken


def test_the_client_library_is_optional(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "sys.modules['s3fs'] = None\n"  # as if not installed
        "import lmdbfolder\n"
        "assert 'fsspec' not in sys.modules and sys.modules['s3fs'] is None\n"
        "from lmdbfolder.errors import MissingDependencyError\n"
        "try:\n"
        f"    lmdbfolder.open_pack('s3://bucket/train', cache_dir={str(tmp_path)!r})\n"
        "except MissingDependencyError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "s3fs" in out and '".[s3]"' in out


def test_bad_urls_and_options(tmp_path: Path, small_pack: Path) -> None:
    from lmdbfolder import open_pack
    from lmdbfolder.errors import OptionError

    with pytest.raises(RemoteError, match="not supported"):
        copy_pack("ftp://host/x", tmp_path / "a")
    with pytest.raises(OptionError, match="one URL to another"):
        copy_pack("s3://a/b", "s3://c/d")
    with pytest.raises(OptionError, match="cache_dir"):
        open_pack("s3://a/b")
    with pytest.raises(OptionError, match="object storage"):
        open_pack(small_pack, cache_dir=tmp_path)
    assert isinstance(MissingDependencyError("x", "s3"), ImportError)


@pytest.mark.parametrize("hold", [0, 3, 1 << 20])
def test_the_digest_of_parts_landing_out_of_order_is_the_files(tmp_path: Path, hold: int) -> None:
    # Parts fetched now are hashed from the bytes in hand, held until their turn
    # (within `hold` bytes) or read back from the file; kept parts are read back.
    import hashlib

    from lmdbfolder.remote import _OrderedHash

    payload = np.random.default_rng(1).integers(0, 256, 1000, dtype=np.uint8).tobytes()
    part = 7
    path = tmp_path / "f"
    path.write_bytes(payload)
    fd = os.open(path, os.O_RDONLY)
    try:
        hasher = _OrderedHash(fd, len(payload), part, hold=hold)
        parts = list(range(-(-len(payload) // part)))
        order = parts[::-1][: len(parts) // 2] + parts[: len(parts) - len(parts) // 2]
        for i, k in enumerate(order):
            fetched = i % 3 != 0  # every third one "kept from an earlier run": no bytes in hand
            hasher.landed(k, payload[k * part : (k + 1) * part] if fetched else None)
        assert hasher.next == len(parts) and not hasher.held and hasher.held_bytes == 0
        assert hasher.hexdigest() == hashlib.sha256(payload).hexdigest()
    finally:
        os.close(fd)


@pytest.mark.parametrize("seed", range(6))
def test_the_digest_of_streamed_chunks_in_any_interleaving_is_the_files(tmp_path: Path, seed: int) -> None:
    # Streamed parts report their chunks in order within a part, interleaved across
    # parts; some without their bytes (a backlog), some parts kept from an earlier run.
    import hashlib

    from lmdbfolder.remote import _OrderedHash

    rng = np.random.default_rng(seed)
    payload = rng.integers(0, 256, 5000, dtype=np.uint8).tobytes()
    part = 600
    path = tmp_path / "f"
    path.write_bytes(payload)
    nparts = -(-len(payload) // part)
    kept = {int(k) for k in rng.choice(nparts, size=2, replace=False)}
    streams: dict[int, list[tuple[int, int]]] = {}
    for k in range(nparts):
        if k in kept:
            continue
        size = min(part, len(payload) - k * part)
        cuts = sorted({0, size, *rng.integers(1, size, size=3).tolist()})
        streams[k] = list(zip(cuts[:-1], cuts[1:]))
    fd = os.open(path, os.O_RDONLY)
    try:
        hasher = _OrderedHash(fd, len(payload), part)
        for k in sorted(kept):
            hasher.landed(k)
        while streams:
            k = int(rng.choice(sorted(streams)))
            begin, end = streams[k].pop(0)
            data = payload[k * part + begin : k * part + end] if rng.random() < 0.7 else None
            hasher.chunk(k, begin, data, end - begin)
            if not streams[k]:
                del streams[k]
                hasher.landed(k)
        assert hasher.next == nparts
        assert hasher.hexdigest() == hashlib.sha256(payload).hexdigest()
    finally:
        os.close(fd)


def test_an_s3_download_is_streamed_and_its_digest_is_the_objects(s3: S3, tmp_path: Path) -> None:
    # s3:// responses go to the file chunk by chunk, hashed on the way (parts of 16 MiB,
    # two at a time, so the second part's chunks arrive before the first is whole).
    import hashlib

    from lmdbfolder.remote import Remote, download

    payload = np.random.default_rng(2).integers(0, 256, 40 << 20, dtype=np.uint8).tobytes()
    s3.client().pipe_file(f"{s3.bucket}/big/data.mdb", payload)
    remote = Remote(s3.url("big/data.mdb"))
    assert remote.streams()
    dest = tmp_path / "data.mdb"
    fetched, digest = download(remote, str(dest), part_size=16 << 20, jobs=2)
    assert fetched == len(payload) and digest == hashlib.sha256(payload).hexdigest()
    assert dest.read_bytes() == payload
    assert not (tmp_path / ("data.mdb" + PARTS_SUFFIX)).exists()


def test_writeback_is_started_early_where_the_kernel_offers_it(tmp_path: Path) -> None:
    # Each streamed part asks the kernel to start writing it out (Linux sync_file_range), so the
    # fdatasync before publishing waits for the tail only; elsewhere it does nothing.
    from lmdbfolder import remote

    path = tmp_path / "f"
    path.write_bytes(b"x" * 100_000)
    fd = os.open(path, os.O_RDWR)
    try:
        remote._start_writeback(fd, 0, 100_000)
        remote._start_writeback(fd, 0, 0)
    finally:
        os.close(fd)
    if sys.platform.startswith("linux"):
        assert remote._sync_file_range() is not None
    assert path.read_bytes() == b"x" * 100_000


def test_uploading_a_damaged_pack_is_refused_so_no_digest_blesses_the_damage(
    s3: S3, sharded: Path, tmp_path: Path
) -> None:
    # A flipped byte inside a record's payload: a local copy refuses it; an upload must too,
    # or the index's digest (of the damaged bytes) makes every later download "good".
    # Through LMDB, into a record it serves: the first JPEG marker in data.mdb can be a stale
    # copy in a freed page (where batches were committed depends on the disk's sync latency),
    # whose flip damages nothing (it failed so under load).
    names = shard_names(sharded)
    env = lmdb.open(str(sharded / names[1]), map_size=1 << 30, subdir=True)
    with env.begin(write=True) as txn:
        key, value = next(
            (bytes(k), bytearray(v)) for k, v in txn.cursor() if not k.startswith(b"__") and b"\xff\xd8\xff" in v
        )
        value[value.find(b"\xff\xd8\xff") + 200] ^= 0x55  # inside the record's JPEG bytes
        txn.put(key, bytes(value))
    env.close()
    assert not verify(sharded, progress=False).ok
    url = s3.url("damaged")
    assert main(["copy", str(sharded), url, "--no-progress"]) == EXIT_CODES["pack failed"]
    assert not s3.client().exists(f"{s3.bucket}/damaged/{SHARD_INDEX_FILE}")  # no index: no "good" pack
    with pytest.raises(RemoteError):
        copy_pack(url, tmp_path / "back")
    assert not (tmp_path / "back").exists()
    # Refused before anything at the URL is replaced: the good pack there stays whole.
    good = tmp_path / "good.lmdb"
    pack(noise_tree(tmp_path / "other", classes=2, per_class=3, seed=5), good, progress=False)
    copy_pack(good, url)
    assert main(["copy", str(sharded), url, "--overwrite", "--no-progress"]) == EXIT_CODES["pack failed"]
    copy_pack(url, tmp_path / "back")
    assert filecmp.cmp(good / DATA_FILE, tmp_path / "back" / DATA_FILE, shallow=False)


def test_overwriting_a_sharded_upload_with_a_single_pack_leaves_no_stale_index(
    s3: S3, sharded: Path, tmp_path: Path
) -> None:
    # The old index.json would still name the old shards: a download would get the old pack.
    url = s3.url("train")
    copy_pack(sharded, url)
    single = tmp_path / "single.lmdb"
    pack(noise_tree(tmp_path / "other", classes=2, per_class=3, seed=7), single, progress=False)
    assert main(["copy", str(single), url, "--overwrite", "--no-progress"]) == 0
    back = tmp_path / "back"
    result = copy_pack(url, back, part_size=PART)
    assert (result.count, result.shards) == (6, 1)
    assert filecmp.cmp(single / DATA_FILE, back / DATA_FILE, shallow=False)


def test_overwrite_never_replaces_objects_that_are_not_a_pack(
    s3: S3, sharded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # --overwrite deleted (or wrote over) a data.mdb or index.json at the URL that was no pack.
    single = tmp_path / "single.lmdb"
    pack(noise_tree(tmp_path / "tree", classes=2, per_class=3), single, progress=False)
    client = s3.client()
    for name, blob in ((DATA_FILE, b"my own notes, not a database"), (SHARD_INDEX_FILE, b'{"mine": true}')):
        url = s3.url(f"stranger-{name}")
        client.pipe(f"{s3.bucket}/stranger-{name}/{name}", blob)
        for src in (single, sharded):
            assert main(["copy", str(src), url, "--overwrite", "--no-progress"]) == EXIT_CODES["output exists"]
            err = capsys.readouterr().err
            assert f"{url}/{name}" in err and "not" in err and "hint:" in err
        assert client.find(f"{s3.bucket}/stranger-{name}") == [f"{s3.bucket}/stranger-{name}/{name}"]
        assert client.cat(f"{s3.bucket}/stranger-{name}/{name}") == blob
    copy_pack(single, s3.url("ours"))  # a pack of ours is still replaced
    assert main(["copy", str(sharded), s3.url("ours"), "--overwrite", "--no-progress"]) == 0


def test_overwriting_a_single_upload_leaves_no_stale_skipped_report(s3: S3, tmp_path: Path) -> None:
    url = s3.url("single")
    tree = noise_tree(tmp_path / "tree", classes=2, per_class=3)
    (tree / "class0" / "empty.jpg").write_bytes(b"")  # skipped: the pack has a skipped.txt
    first = tmp_path / "first.lmdb"
    pack(tree, first, progress=False)
    assert (first / "skipped.txt").is_file()
    copy_pack(first, url)
    (tree / "class0" / "empty.jpg").unlink()
    second = tmp_path / "second.lmdb"
    pack(tree, second, progress=False)
    copy_pack(second, url, overwrite=True)
    back = tmp_path / "back"
    copy_pack(url, back)
    assert not (back / "skipped.txt").exists()  # the report of the pack that was replaced


def test_a_remote_skipped_report_is_fetched_in_bounded_pieces(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # skipped.txt was read whole into memory (anyone's object at the URL: gigabytes).
    import lmdbfolder.tools.copy as copy_mod
    from lmdbfolder.remote import Remote

    url = s3.url("reported")
    tree = noise_tree(tmp_path / "tree", classes=2, per_class=3)
    for k in range(40):
        (tree / "class0" / f"empty-{k:03d}-{'x' * 40}.jpg").write_bytes(b"")  # skipped, a line each
    local = tmp_path / "local.lmdb"
    pack(tree, local, progress=False)
    report = (local / "skipped.txt").read_bytes()
    assert len(report) > 3000
    copy_pack(local, url)
    monkeypatch.setattr(copy_mod, "_REPORT_CHUNK", 1000, raising=False)
    reads: list[tuple[int | None, int | None]] = []
    real_read = Remote.read

    def read(self: Remote, start: int | None = None, end: int | None = None) -> bytes:
        if self.url.endswith("/skipped.txt"):
            reads.append((start, end))
        return real_read(self, start, end)

    monkeypatch.setattr(Remote, "read", read)
    back = tmp_path / "back"
    copy_pack(url, back)
    assert (back / "skipped.txt").read_bytes() == report
    assert len(reads) >= 4 and all(s is not None and e is not None and e - s <= 1000 for s, e in reads), reads


def test_an_oversized_remote_index_is_refused_without_reading_it_whole(
    s3: S3, proxy: Proxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A local index.json above MAX_INDEX_FILE_BYTES is refused before it is read; a remote one
    # was fetched whole into memory first (anyone's object at the URL: gigabytes).
    import lmdbfolder.format.shards
    import lmdbfolder.read.staging

    limit = 64 << 10
    monkeypatch.setattr(lmdbfolder.format.shards, "MAX_INDEX_FILE_BYTES", limit)
    monkeypatch.setattr(lmdbfolder.read.staging, "MAX_INDEX_FILE_BYTES", limit)
    s3.client().pipe_file(f"{s3.bucket}/big/{SHARD_INDEX_FILE}", b" " * (1 << 20))
    proxy.reset()
    assert main(["copy", s3.url("big"), str(tmp_path / "dst"), "--no-progress"]) == EXIT_CODES["not a pack"]
    index_path = f"/{s3.bucket}/big/{SHARD_INDEX_FILE}"
    assert 0 < sum(n for path, n in proxy.sent.items() if path.startswith(index_path)) < 2 * limit
    assert not (tmp_path / "dst").exists()
    # an empty one is a damaged index too (a ranged read of an empty object is refused: 416)
    s3.client().pipe_file(f"{s3.bucket}/empty/{SHARD_INDEX_FILE}", b"")
    assert main(["copy", s3.url("empty"), str(tmp_path / "dst"), "--no-progress"]) == EXIT_CODES["not a pack"]

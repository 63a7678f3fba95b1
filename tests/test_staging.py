"""Staged reading: LMDBFolder("s3://...", cache_dir=...) on a real S3 API (moto's server on 127.0.0.1;
the main cases also on SeaweedFS, a real object store the tests start on 127.0.0.1).

Shards are fetched into the cache as the sampler will read them, so the first
batch comes when the first shards have landed, not all of them; the epoch is
the local pack's, sample for sample; DataLoader workers (fork and spawn) and
the prefetch thread share one cache with one download per shard; a cache
limit evicts what no rank needs any more; a tampered shard is never opened;
several "nodes" (gloo ranks with their own cache folders) each stage only
their share. Downloads are counted by a proxy in front of the server.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from conftest import S3, Proxy, free_port, on_every_s3_server
from lmdbfolder import copy_pack
from lmdbfolder.errors import NotAPackError, RemoteError
from lmdbfolder.format import DATA_FILE, ROOM_LOCK, SHARD_INDEX_FILE
from lmdbfolder.write.shards import pack_sharded

pytest.importorskip("s3fs")
pytest.importorskip("moto")
torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402
from torchvision.transforms import PILToTensor  # noqa: E402

from lmdbfolder.read import staging  # noqa: E402
from lmdbfolder.read.staging import StagedPack  # noqa: E402
from lmdbfolder.sampler import ExactDistributedSampler  # noqa: E402
from lmdbfolder.torch import LMDBFolder  # noqa: E402

HERE = Path(__file__).resolve().parent


def noise_tree(root: Path, classes: int, per_class: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    for c in range(classes):
        for k in range(per_class):
            path = root / f"class{c}" / f"img{k:02d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)).save(path, quality=90)
    return root


@pytest.fixture
def uploaded(s3: S3, tmp_path: Path) -> tuple[Path, str]:
    """An 8-shard pack of 128 images (16 per shard), here and in the bucket."""
    local = tmp_path / "train"
    pack_sharded(noise_tree(tmp_path / "tree", classes=8, per_class=16), local, shards=8, progress=False)
    url = s3.url("train")
    copy_pack(local, url)
    return local, url


def shard_sizes(local: Path) -> dict[str, int]:
    index = json.loads((local / SHARD_INDEX_FILE).read_text())
    return {e["name"]: (local / e["name"] / DATA_FILE).stat().st_size for e in index["shards"]}


def fetched_shards(proxy: Proxy) -> set[str]:
    with proxy.lock:
        return {path.split("/")[-2] for path in proxy.sent if path.split("?")[0].endswith("/" + DATA_FILE)}


def assert_one_download_per_shard(proxy: Proxy, sizes: dict[str, int]) -> None:
    with proxy.lock:
        per_shard: dict[str, int] = {}
        requests: dict[str, int] = {}
        for path, n in proxy.sent.items():
            if path.split("?")[0].endswith("/" + DATA_FILE):
                name = path.split("/")[-2]
                per_shard[name] = per_shard.get(name, 0) + n
        for _, path in proxy.requests:
            if path.split("?")[0].endswith("/" + DATA_FILE):
                name = path.split("/")[-2]
                requests[name] = requests.get(name, 0) + 1
    for name, n in per_shard.items():
        assert n <= sizes[name] + 1024 * requests[name], (name, n, sizes[name])  # once, plus headers


# Both worker start methods on moto; SeaweedFS with fork only (spawn tests the workers, not the server).
@pytest.mark.parametrize(
    ("s3_server", "context"), [("moto", "fork"), ("moto", "spawn"), ("seaweedfs", "fork")], indirect=["s3_server"]
)
def test_first_batch_before_every_shard_landed_and_the_epoch_is_the_local_packs(
    s3: S3, proxy: Proxy, uploaded: tuple[Path, str], tmp_path: Path, context: str
) -> None:
    local, url = uploaded
    proxy.reset()
    staged = LMDBFolder(url, cache_dir=tmp_path / "cache", transform=PILToTensor())
    reference = LMDBFolder(local, transform=PILToTensor())
    assert len(staged) == len(reference) and staged.classes == reference.classes
    assert fetched_shards(proxy) == set()  # opening fetched the index only

    def sampler(ds: Any) -> ExactDistributedSampler:
        return ExactDistributedSampler(ds, 1, 0, seed=7, order="nodes", nodes=1, shards_at_once=1)

    loader = DataLoader(staged, batch_size=4, sampler=sampler(staged), num_workers=2, multiprocessing_context=context)
    batches = iter(loader)
    first = next(batches)
    at_first_batch = fetched_shards(proxy)
    got = [first, *batches]
    # the first batch needed one shard; the prefetch reads one ahead, and the loader
    # has asked for a few batches more: far from all 8
    assert 1 <= len(at_first_batch) <= 3, at_first_batch
    assert len(fetched_shards(proxy)) == 8
    expected = list(DataLoader(reference, batch_size=4, sampler=sampler(reference), num_workers=0))
    assert len(got) == len(expected) == 32
    for (x, y), (ex, ey) in zip(got, expected):
        assert torch.equal(x, ex) and torch.equal(y, ey)
    assert_one_download_per_shard(proxy, shard_sizes(local))


@contextlib.contextmanager
def forked_child() -> Any:
    """A child forked here that lives (doing nothing) until the block ends: the body runs
    once the child's Python runs, so after every at-fork hook of the child."""
    r, w = os.pipe()
    started_r, started_w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(w)
        os.write(started_w, b"!")
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    os.close(started_w)
    try:
        assert os.read(started_r, 1) == b"!"
        os.close(started_r)
        yield
    finally:
        os.close(w)
        os.waitpid(child, 0)


@on_every_s3_server
def test_a_cache_limit_evicts_what_no_rank_needs_any_more(
    s3: S3, proxy: Proxy, uploaded: tuple[Path, str], tmp_path: Path
) -> None:
    local, url = uploaded
    sizes = shard_sizes(local)
    limit = 3 * max(sizes.values())
    ds = LMDBFolder(url, cache_dir=tmp_path / "cache", cache_limit=limit)
    staging = ds.reader.staging  # type: ignore[union-attr]
    sampler = ExactDistributedSampler(ds, 1, 0, seed=1, order="nodes", nodes=1, shards_at_once=1)
    proxy.reset()
    most = 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for i in sampler:
            ds[i]
            most = max(most, staging.cached_bytes())
            assert most <= limit
    assert len(staging.staged()) <= 3
    # the second epoch had to fetch again what was evicted, but never one shard twice in a row
    assert len(fetched_shards(proxy)) == 8


HOLD_DOWNLOAD = """
import sys
from lmdbfolder.read import staging
real = staging.fetch_shard
def held(*args, **kwargs):
    print("downloading", flush=True)
    sys.stdin.readline()  # until the test has made its own room
    return real(*args, **kwargs)
staging.fetch_shard = held
pack = staging.StagedPack(sys.argv[1], sys.argv[2], cache_limit=int(sys.argv[3]), ahead=0)
pack.ensure(1)
print("done", flush=True)
"""


@pytest.mark.parametrize("other", ["thread", "process"])
def test_two_downloads_that_start_together_count_each_other(
    s3: S3, uploaded: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, other: str
) -> None:
    """The prefetch thread and a DataLoader worker (or two ranks) each start a download:
    the second to make room must count the first's shard, or both fit "one more"."""
    local, url = uploaded
    limit = 2 * max(shard_sizes(local).values())
    cache = str(tmp_path / "cache")
    pack = StagedPack(url, cache, cache_limit=limit, ahead=0)
    pack.ensure(0)
    if other == "thread":
        downloading, go_on = threading.Event(), threading.Event()
        real = staging.fetch_shard

        def held(remote: Any, entry: dict[str, Any], *args: Any, **kwargs: Any) -> int:
            if entry["name"] == pack.names[1]:
                downloading.set()
                go_on.wait()
            return real(remote, entry, *args, **kwargs)

        monkeypatch.setattr(staging, "fetch_shard", held)
        first = threading.Thread(target=pack.ensure, args=(1,))
        first.start()
        downloading.wait()
        pack.ensure(2)
        go_on.set()
        first.join()
    else:
        rank = subprocess.Popen(
            [sys.executable, "-c", HOLD_DOWNLOAD, url, cache, str(limit)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert rank.stdout is not None and rank.stdin is not None
            assert rank.stdout.readline().strip() == "downloading"
            pack.ensure(2)
            rank.stdin.write("go on\n")
            rank.stdin.flush()
            assert rank.stdout.readline().strip() == "done"
            assert rank.wait() == 0
        finally:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    # shard 0 (needed by nobody) made room for both downloads
    assert pack.staged() == [1, 2]
    assert pack.cached_bytes() <= limit


def test_a_decision_never_reads_a_list_of_needs_half_written(
    s3: S3, uploaded: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank rewrites its list of needs as its sampler moves on; an eviction decided in
    that moment once read an empty list as "keep everything" and let the cache outgrow its
    limit. The writer is stopped between emptying the file and writing the new list."""
    _, url = uploaded
    pack = StagedPack(url, str(tmp_path / "cache"), ahead=0)
    follower = pack.follow([(0, 9), (1, 19), (2, 29)])
    answers: list[dict[int, int]] = []
    emptied, asked_or_done, go_on = threading.Event(), threading.Event(), threading.Event()

    def read() -> None:
        answers.append(pack.needed_soonest())
        asked_or_done.set()

    writer = threading.Thread(target=follower.advance, args=(10,))
    reader = threading.Thread(target=read)
    real_pwrite, real_flock = os.pwrite, staging._flock

    def held_pwrite(fd: int, data: bytes, offset: int) -> int:
        if threading.current_thread() is writer:
            emptied.set()
            go_on.wait()
        return real_pwrite(fd, data, offset)

    def watched_flock(path: str, mode: int, **kwargs: Any) -> Any:
        if threading.current_thread() is reader and path.endswith(ROOM_LOCK):
            asked_or_done.set()  # from here on it waits for the writer
        return real_flock(path, mode, **kwargs)

    monkeypatch.setattr(os, "pwrite", held_pwrite)
    monkeypatch.setattr(staging, "_flock", watched_flock)
    writer.start()
    emptied.wait()
    reader.start()
    asked_or_done.wait()
    go_on.set()
    reader.join()
    writer.join()
    assert answers == [{1: 0, 2: 1}]
    follower.stop()


def test_two_samplers_of_one_process_keep_their_own_needs(s3: S3, uploaded: tuple[Path, str], tmp_path: Path) -> None:
    """Two datasets over one pack in one process (a train view and a held-out view, each with
    its sampler): each follower's list counts, and one stopping leaves the other's."""
    _, url = uploaded
    cache = str(tmp_path / "cache")
    first, second = StagedPack(url, cache, ahead=0), StagedPack(url, cache, ahead=0)
    a = first.follow([(0, 9), (1, 19)])
    b = second.follow([(5, 9), (6, 19)])
    try:
        assert first.needed_soonest() == {0: 0, 1: 1, 5: 0, 6: 1}
        a.stop()
        assert second.needed() == {5, 6}
    finally:
        a.stop()
        b.stop()


def test_stopping_a_follower_twice_closes_nothing_else(s3: S3, uploaded: tuple[Path, str], tmp_path: Path) -> None:
    _, url = uploaded
    pack = StagedPack(url, str(tmp_path / "cache"))
    follower = pack.follow([])  # nothing to fetch: no thread opens files meanwhile
    follower.join()
    follower.stop()
    # another file opened meanwhile under the number the follower's list had
    other = os.open(os.devnull, os.O_RDONLY)
    os.dup2(other, follower._needs_fd)
    os.close(other)
    try:
        follower.stop()
        os.fstat(follower._needs_fd)  # still open
    finally:
        os.close(follower._needs_fd)


def lock_is_free(pack: StagedPack, k: int) -> bool:
    fd = os.open(pack._lock_file(k), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@pytest.mark.filterwarnings("ignore:the staging cache of")  # cache_limit=1: above it, on purpose
@pytest.mark.parametrize("during", ["download", "opening", "eviction", "probe"])
def test_a_process_forked_while_a_lock_is_held_does_not_keep_it(
    s3: S3, uploaded: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, during: str
) -> None:
    """DataLoader workers are forked while the prefetch thread may hold a shard's lock (a
    validation loader's persistent workers, mid-epoch). A forked copy of the lock's descriptor
    would hold the lock as long as the child lives: every reader of the shard would wait.
    The prefetch thread is stopped inside the lock: downloading shard 1, between opening shard
    1's lock file and locking it, evicting shard 0, or probing shard 1's lock while it counts
    downloads in flight."""
    _, url = uploaded
    pack = StagedPack(url, str(tmp_path / "cache"), cache_limit=1, ahead=0)
    inside, go_on = threading.Event(), threading.Event()

    def pause() -> None:
        if threading.current_thread() is prefetch:
            inside.set()
            go_on.wait()

    if during == "download":
        real_fetch = staging.fetch_shard

        def fetch(*args: Any, **kwargs: Any) -> int:
            pause()
            return real_fetch(*args, **kwargs)

        monkeypatch.setattr(staging, "fetch_shard", fetch)
        k, prefetch = 1, threading.Thread(target=pack.ensure, args=(1,))
    elif during == "eviction":
        pack.ensure(0)
        real_rmtree = staging.shutil.rmtree

        def rmtree(path: str, *args: Any, **kwargs: Any) -> None:
            pause()
            real_rmtree(path, *args, **kwargs)

        monkeypatch.setattr(staging.shutil, "rmtree", rmtree)
        k, prefetch = 0, threading.Thread(target=pack.evict, args=(0,))
    elif during == "opening":
        real_open = os.open

        def open_(path: str, *args: Any, **kwargs: Any) -> int:
            fd = real_open(path, *args, **kwargs)
            if path == pack._lock_file(1):
                pause()  # opened, not yet locked
            return fd

        monkeypatch.setattr(os, "open", open_)
        k, prefetch = 1, threading.Thread(target=pack.ensure, args=(1,))
    else:
        with open(pack._lock_file(1), "w"):
            pass  # shard 1 was asked for once
        real_flock = fcntl.flock

        def flock(fd: int, mode: int) -> None:
            real_flock(fd, mode)
            pause()

        monkeypatch.setattr(staging.fcntl, "flock", flock)
        k, prefetch = 1, threading.Thread(target=pack._in_flight, args=({0},))
    prefetch.start()
    inside.wait()
    with forked_child():  # a worker that lives on
        go_on.set()
        prefetch.join()
        monkeypatch.undo()
        assert lock_is_free(pack, k), "the shard's lock is still held by the forked child"


@on_every_s3_server
def test_a_tampered_shard_is_never_opened(s3: S3, uploaded: tuple[Path, str], tmp_path: Path) -> None:
    local, url = uploaded
    name = sorted(shard_sizes(local))[3]
    blob = bytearray((local / name / DATA_FILE).read_bytes())
    blob[len(blob) // 2] ^= 1
    s3.client().pipe_file(f"{s3.bucket}/train/{name}/{DATA_FILE}", bytes(blob))
    ds = LMDBFolder(url, cache_dir=tmp_path / "cache")
    ds[0]  # shard 0 is fine
    first_of_3 = ds.reader.shard_offsets[3]  # type: ignore[union-attr]
    with pytest.raises(RemoteError) as caught:
        ds[first_of_3]
    assert caught.value.kind == "digest" and name in caught.value.url
    staging = ds.reader.staging  # type: ignore[union-attr]
    assert 3 not in staging.staged() and not os.path.exists(staging.path(3))


@on_every_s3_server
def test_a_pack_replaced_under_a_reader_is_said_so_and_opened_again_reads_the_new_one(
    s3: S3, uploaded: tuple[Path, str], tmp_path: Path
) -> None:
    # The reader's next download failed with "the shard was replaced in storage without
    # its index: upload the pack again", where the whole pack was (rightly) uploaded again.
    local, url = uploaded
    ds = LMDBFolder(url, cache_dir=tmp_path / "cache")
    ds[0]
    other = tmp_path / "other"
    pack_sharded(noise_tree(tmp_path / "tree2", classes=8, per_class=16, seed=5), other, shards=8, progress=False)
    copy_pack(other, url, overwrite=True)
    with pytest.raises(RemoteError, match="the pack was replaced in storage since it was opened here") as caught:
        ds[ds.reader.shard_offsets[5]]  # type: ignore[union-attr]
    assert "open the pack again" in caught.value.hint
    assert ds[1] == LMDBFolder(local)[1]  # what it had staged is still the pack it opened
    again = LMDBFolder(url, cache_dir=tmp_path / "cache", transform=PILToTensor())
    expected = LMDBFolder(other, transform=PILToTensor())
    for i in range(0, len(expected), 9):
        assert again[i][1] == expected[i][1] and torch.equal(again[i][0], expected[i][0])


HOLD_NEEDS = """
import sys
from lmdbfolder.read.staging import StagedPack
pack = StagedPack(sys.argv[1], sys.argv[2], ahead=0)
pack.follow([(2, 10), (5, 20)], linger=0)
print("ready", flush=True)
sys.stdin.read()
"""


def test_eviction_spares_shards_in_use_and_shards_a_live_rank_needs(
    s3: S3, uploaded: tuple[Path, str], tmp_path: Path
) -> None:
    _, url = uploaded
    cache = str(tmp_path / "cache")
    pack = StagedPack(url, cache, ahead=0)
    for k in (0, 2):
        pack.ensure(k)
    with pack.reading(0):
        assert not pack.evict(0)  # a process is opening it
    assert pack.evict(0) and pack.staged() == [2]

    # another rank of the node (its own process) follows a sampler: its list counts while it lives
    rank = subprocess.Popen(
        [sys.executable, "-c", HOLD_NEEDS, url, cache], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "ready"
        assert pack.needed_soonest() == {2: 0, 5: 1}
        rank.kill()  # kill -9: its list must no longer count
        rank.wait()
        assert pack.needed() == set()
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait()


def test_the_folder_of_a_replaced_upload_gives_back_what_no_live_rank_needs(
    s3: S3, uploaded: tuple[Path, str], tmp_path: Path
) -> None:
    # Each upload of a URL gets its own cache folder: the old one's shards stayed for ever.
    local, url = uploaded
    cache = str(tmp_path / "cache")
    old = StagedPack(url, cache)
    for k in range(4):
        old.ensure(k)
    other = tmp_path / "other"
    pack_sharded(noise_tree(tmp_path / "tree2", classes=8, per_class=16, seed=5), other, shards=8, progress=False)
    rank = subprocess.Popen(  # a rank of the old upload, still needing shards 2 and 5
        [sys.executable, "-c", HOLD_NEEDS, url, cache], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "ready"
        copy_pack(other, url, overwrite=True)
        new = StagedPack(url, cache)
        assert new.root != old.root and old.staged() == [2]
        rank.kill()
        rank.wait()
        StagedPack(url, cache)
        assert old.staged() == [] and new.staged() == []
        assert sorted(os.listdir(cache)) == sorted(os.path.basename(p.root) for p in (old, new))
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait()


def test_several_nodes_each_stage_only_their_share(s3: S3, tmp_path: Path) -> None:
    """2 "nodes" x 2 gloo ranks, each node its own cache folder and its own proxy (to count
    its downloads); 4 equal shards, node-local order, 3 epochs."""
    local = tmp_path / "train"
    pack_sharded(noise_tree(tmp_path / "tree", classes=4, per_class=10), local, shards=4, progress=False)
    url = s3.url("nodes")
    copy_pack(local, url)
    sizes = shard_sizes(local)
    proxies = [Proxy(s3.endpoint) for _ in range(2)]
    result = tmp_path / "result.json"
    spec = {"url": url, "epochs": 3, "nodes": 2, "caches": [str(tmp_path / f"node{k}") for k in range(2)]}
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps({**spec, "result": str(result)}))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "4"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "_node_worker.py"), str(spec_file)],
            env={**env, **s3.env(proxies[rank // 2].endpoint), "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(4)
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=600)
            outputs.append((p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for proxy in proxies:
            proxy.close()
    failed = [(rank, code, out[-3000:]) for rank, (code, out) in enumerate(outputs) if code != 0]
    assert not failed, failed
    rows = json.loads(result.read_text())
    assert len(rows) == 3
    for row in rows:
        assert row["missing"] == 0 and row["duplicated"] == 0 and row["seen"] == 40, row
        for node in range(2):
            assert row["downloaded"][node] <= 0.6 * 4, row  # <= 60 % of the shards per epoch
            assert row["read"][node] == 2, row  # each node reads exactly its 2 shards
    for proxy in proxies:
        assert_one_download_per_shard(proxy, sizes)  # one download per shard per node


READ_ONLY_CACHE = """
import sys
from torch.utils.data import DataLoader
from lmdbfolder.errors import NotAPackError, RemoteError
from lmdbfolder.sampler import ExactDistributedSampler
from lmdbfolder.torch import LMDBFolder

ds = LMDBFolder(sys.argv[1], cache_dir=sys.argv[2])
sampler = ExactDistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0)
loader = DataLoader(ds, sampler=sampler, batch_size=16, num_workers=2, collate_fn=lambda batch: batch)
try:
    print("read", sum(len(batch) for batch in loader), flush=True)
except RemoteError as exc:
    print("refused", exc.text(), flush=True)
"""


def test_a_cache_staged_beforehand_reads_when_it_is_read_only(
    s3: S3, uploaded: tuple[Path, str], tmp_path: Path
) -> None:
    # Staged by one job, then shared read-only: reading (through the sampler, whose
    # prefetch thread keeps a list of needs) died with PermissionError on a lock file.
    from conftest import as_unprivileged

    local, url = uploaded
    cache = tmp_path / "cache"
    ds = LMDBFolder(url, cache_dir=cache)
    for i in range(len(ds)):
        ds[i]
    root = ds.reader.staging.root  # type: ignore[union-attr]
    del ds
    env = {**os.environ, **s3.env(), "PYTHONPATH": str(HERE.parent / "src")}

    def run() -> str:
        subprocess.run(["chmod", "-R", "a-w", str(cache)], check=True)
        try:
            cmd = as_unprivileged([sys.executable, "-c", READ_ONLY_CACHE, url, str(cache)])
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        finally:
            subprocess.run(["chmod", "-R", "u+w", str(cache)], check=True)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    assert run().split() == ["read", "128"]
    assert StagedPack(url, cache).evict(3)  # a shard it lacks: a clear refusal, not a traceback
    before = sorted(os.listdir(root))
    out = run()
    assert out.startswith("refused ") and "Permission denied" in out and "check the permissions" in out
    assert sorted(os.listdir(root)) == before


@pytest.mark.parametrize("forged", ["count", "pack_id"])
def test_a_forged_remote_index_names_the_url_and_says_to_upload_again(
    s3: S3, uploaded: tuple[Path, str], tmp_path: Path, forged: str
) -> None:
    # The error named the cache's copy of index.json and said to run `lmdbfolder index`
    # (on a cache folder), where the index in storage disagrees with its shards.
    local, url = uploaded
    index = json.loads((local / SHARD_INDEX_FILE).read_text())
    if forged == "count":
        index["shards"][0]["count"] += 1
        index["shards"][1]["count"] -= 1
    else:
        index["shards"][0]["pack_id"] = "0" * 32
    s3.client().pipe_file(f"{s3.bucket}/train/{SHARD_INDEX_FILE}", json.dumps(index).encode())
    with pytest.raises(NotAPackError) as caught:
        LMDBFolder(url, cache_dir=tmp_path / "cache")[0]
    assert f"{url}/{SHARD_INDEX_FILE}" in caught.value.message
    assert "upload it again" in caught.value.hint and "lmdbfolder index" not in caught.value.hint


# -- what is planted in a shared cache folder is never followed or waited on (issue 34, 6) ------
@pytest.fixture
def small_upload(s3: S3, tmp_path: Path) -> str:
    """A 2-shard pack of 8 images in the bucket."""
    local = tmp_path / "small"
    pack_sharded(noise_tree(tmp_path / "small-tree", classes=2, per_class=4), local, shards=2, progress=False)
    url = s3.url("small")
    copy_pack(local, url)
    return url


def test_a_linked_data_file_in_a_copying_folder_is_never_written_through(
    s3: S3, small_upload: str, tmp_path: Path
) -> None:
    """A ``<shard>.copying`` folder that looks like ours (its marker) with a link as its
    ``data.mdb``: the download wrote the shard into the file the link named."""
    from lmdbfolder import packdir
    from lmdbfolder.format import COPYING_SUFFIX

    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    pack = StagedPack(small_upload, tmp_path / "cache", ahead=0)
    copying = Path(pack.path(0) + COPYING_SUFFIX)
    packdir.make_temp_dir(str(copying))
    os.symlink(victim, copying / DATA_FILE)
    with pytest.raises(RemoteError, match="remove") as caught:
        pack.ensure(0)
    assert caught.value.kind == "disk" and str(copying) in str(caught.value)
    assert victim.read_bytes() == b"precious" and 0 not in pack.staged()
    (copying / DATA_FILE).unlink()
    pack.ensure(0)  # what it says works
    assert pack.staged() == [0]


def test_a_linked_cache_folder_of_the_pack_is_refused(s3: S3, small_upload: str, tmp_path: Path) -> None:
    """The pack's folder in ``cache_dir`` planted as a link: index.json and every shard
    were written where it led."""
    name = os.path.basename(StagedPack(small_upload, tmp_path / "first", ahead=0).root)
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "cache").mkdir()
    os.symlink(outside, tmp_path / "cache" / name)
    with pytest.raises(RemoteError, match="remove") as caught:
        StagedPack(small_upload, tmp_path / "cache", ahead=0)
    assert caught.value.kind == "disk" and name in str(caught.value)
    assert os.listdir(outside) == []


def test_a_linked_list_of_needs_is_never_written_through(
    s3: S3, small_upload: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link planted under the name of a rank's ``.needs`` file (its pid and a counter):
    the rank wrote its list into the file the link named."""
    import itertools

    from lmdbfolder.format import NEEDS_PREFIX

    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    pack = StagedPack(small_upload, tmp_path / "cache", ahead=0)
    monkeypatch.setattr(staging, "_FOLLOWERS", itertools.count(1000))
    planted = Path(pack.root) / f"{NEEDS_PREFIX}{os.getpid()}-1000"
    os.symlink(victim, planted)
    with pytest.raises(RemoteError, match="remove") as caught:
        pack.follow([(0, 9)])
    assert str(planted) in str(caught.value)
    assert victim.read_bytes() == b"precious"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # a cache_limit below one shard: said so
@pytest.mark.parametrize("planted", ["FIFO", "link to a FIFO"])
def test_a_fifo_named_like_a_list_of_needs_is_not_waited_on(
    s3: S3, small_upload: str, tmp_path: Path, planted: str
) -> None:
    """With ``cache_limit`` set, deciding what to evict read every ``.needs-*`` file: a FIFO
    under such a name blocked the reader for ever. It is not a list a rank wrote: ignored."""
    from lmdbfolder.format import NEEDS_PREFIX

    pack = StagedPack(small_upload, tmp_path / "cache", cache_limit=1, ahead=0)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    name = Path(pack.root) / f"{NEEDS_PREFIX}1-0"
    if planted == "FIFO":
        os.mkfifo(name)
    else:
        os.symlink(fifo, name)
    done = threading.Event()
    failed: list[BaseException] = []

    def read_both() -> None:
        try:
            pack.ensure(0)
            pack.ensure(1)  # no room for both: shard 0 is evicted
        except BaseException as exc:
            failed.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=read_both, daemon=True)
    thread.start()
    finished = done.wait(120)  # a guard against a hang, not a measurement
    if not finished:  # open the FIFO's other end, so that the blocked reader returns
        os.close(os.open(name, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(60)
    assert finished and not failed, failed
    assert pack.staged() == [1] and name.exists()


# -- a mapped shard is never evicted: the cache accounts for what readers map (issue 34, 8) -------
def _family() -> list[int]:
    """This process and its children (DataLoader workers, and servers it started)."""
    me, pids = os.getpid(), [os.getpid()]
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == me:
            pids.append(int(name))
    return pids


def _mapped_shards(root: str) -> tuple[int, int]:
    """(bytes of the cache's data.mdb files mapped now, bytes of those mapped but no longer in
    the cache folder: deleted, yet still using the disk), over this process and its children."""
    live: dict[tuple[str, str], int] = {}
    deleted: dict[tuple[str, str], int] = {}
    for pid in _family():
        try:
            lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:
            continue  # a worker that has just exited
        for line in lines:
            fields = line.split(None, 5)
            if len(fields) < 6 or not fields[5].startswith(root + os.sep) or DATA_FILE not in fields[5]:
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            # one file mapped by several processes uses its disk space once: by device and inode
            (deleted if fields[5].endswith("(deleted)") else live)[(fields[3], fields[4])] = end - start
    return sum(live.values()), sum(deleted.values())


def _shard_disk_use(root: str) -> int:
    """Disk blocks of the shards' data.mdb files in the cache folder (downloads in flight too)."""
    total = 0
    for folder, _, files in os.walk(root):
        if DATA_FILE in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, DATA_FILE)).st_blocks * 512
    return total


class DiskWatch:
    """Looks at a staging cache's disk use, under its decision lock (what is evicted, and what
    readers let go of, is decided there: a look never sees a half-made decision)."""

    def __init__(self, root: str, limit: int) -> None:
        self.root, self.limit = root, limit
        self.looks = self.deleted_seen = self.over = 0

    def look(self) -> None:
        with open(os.path.join(self.root, ROOM_LOCK), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            mapped, deleted = _mapped_shards(self.root)
            disk = _shard_disk_use(self.root) + deleted
        self.looks += 1
        self.deleted_seen += deleted > 0
        # beyond the limit only what readers map now (in use)
        self.over += disk > self.limit + mapped


@pytest.mark.filterwarnings("ignore:the staging cache of")  # a limit below shards_at_once + 3 shards: said so
@pytest.mark.parametrize("s3_server", ["seaweedfs"], indirect=True)
@pytest.mark.parametrize("reader", ["in-process", "fork", "spawn"])
def test_a_small_cache_limit_frees_disk_as_it_evicts(
    s3: S3, uploaded: tuple[Path, str], tmp_path: Path, reader: str
) -> None:
    """A cache_limit of 2 shards, every shard read in order (the sampler's prefetch thread
    ahead): an evicted shard that a reader still mapped stayed on disk, unseen by the limit
    (up to 4 per process), and the disk filled. The cache's disk use, the folder's shards
    plus any deleted file still mapped, stays within the limit plus what readers map."""
    local, url = uploaded
    size = max(shard_sizes(local).values())
    limit = 2 * size
    ds = LMDBFolder(url, cache_dir=tmp_path / "cache", cache_limit=limit, transform=PILToTensor())
    watch = DiskWatch(ds.reader.staging.root, limit)  # type: ignore[union-attr]
    sampler = ExactDistributedSampler(ds, 1, 0, seed=1, order="nodes", nodes=1, shards_at_once=1)
    read: list[int] = []
    if reader == "in-process":

        def read_all() -> None:
            for i in sampler:
                ds[i]
                read.append(i)
                watch.look()

        thread = threading.Thread(target=read_all, daemon=True)
        thread.start()
        thread.join(300)  # a guard against a deadlock, not a measurement
        assert not thread.is_alive(), "the reader and the prefetch thread wait on each other"
    else:
        loader = DataLoader(
            ds, batch_size=4, sampler=sampler, num_workers=2, multiprocessing_context=reader, timeout=300
        )
        for _, labels in loader:
            read.extend(labels.tolist())
            watch.look()
    assert len(read) == len(ds) == 128
    assert watch.looks >= 32 and watch.deleted_seen == 0, (watch.deleted_seen, watch.looks)
    assert watch.over == 0, (watch.over, watch.looks)


def test_a_mapped_shard_is_evicted_once_its_reader_lets_go_and_a_forked_child_keeps_no_hold(
    s3: S3, uploaded: tuple[Path, str], tmp_path: Path
) -> None:
    _, url = uploaded
    ds = LMDBFolder(url, cache_dir=tmp_path / "cache")
    pack = ds.reader.staging  # type: ignore[union-attr]
    ds[0]  # shard 0, mapped
    assert not pack.evict(0)  # held while mapped
    with forked_child():  # a DataLoader worker forked while the parent maps shard 0; it lives on
        ds.reader.close()
        assert pack.evict(0), "the forked child kept the parent's hold on shard 0"
        assert ds[0] == LMDBFolder(uploaded[0])[0]  # read again: fetched and mapped afresh
        assert not pack.evict(0)


MAP_A_SHARD = """
import sys
from lmdbfolder.torch import LMDBFolder
ds = LMDBFolder(sys.argv[1], cache_dir=sys.argv[2])
ds[ds.reader.shard_offsets[int(sys.argv[3])]]
print("mapped", flush=True)
sys.stdin.read()
"""


def test_a_reader_lets_go_of_what_no_rank_needs_and_the_warning_names_what_is_mapped(
    s3: S3, uploaded: tuple[Path, str], tmp_path: Path
) -> None:
    local, url = uploaded
    size = max(shard_sizes(local).values())
    cache = str(tmp_path / "cache")
    ds = LMDBFolder(url, cache_dir=cache, cache_limit=size)
    pack = ds.reader.staging  # type: ignore[union-attr]
    starts = ds.reader.shard_offsets  # type: ignore[union-attr]
    ds[starts[0]]
    pack.ensure(1)  # shard 0, mapped by this process's reader, stays: no room for 1 yet
    assert pack.staged() == [0, 1]
    ds[starts[1]]  # opening shard 1, this reader lets shard 0 go, and it is evicted
    assert pack.staged() == [1]
    # another process maps shard 1 (a DataLoader worker): the warning names it
    other = subprocess.Popen(
        [sys.executable, "-c", MAP_A_SHARD, url, cache, "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "mapped"
        ds.reader.close()
        with pytest.warns(RuntimeWarning, match=r"train-00001-of-00008\.lmdb .* still mapped by 1 reader process"):
            pack.ensure(2)
        assert pack.staged() == [1, 2]
    finally:
        other.kill()
        other.wait()
    pack.ensure(3)  # its reader gone, shard 1 is evicted
    assert pack.staged() == [3]


def test_a_full_disk_says_how_much_of_the_cache_readers_map(
    s3: S3, uploaded: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local, url = uploaded
    sizes = shard_sizes(local)
    ds = LMDBFolder(url, cache_dir=tmp_path / "cache", cache_limit=10 * max(sizes.values()))
    pack = ds.reader.staging  # type: ignore[union-attr]
    ds[0]  # shard 0, mapped here

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(staging, "download", full)
    with pytest.raises(RemoteError, match="the disk is full") as caught:
        pack.ensure(1)
    mapped = sizes[pack.names[0]]
    assert f"{mapped:,} of them in 1 shard that readers map now" in caught.value.hint
    assert "cache_limit" in caught.value.hint and "shards_at_once" in caught.value.hint

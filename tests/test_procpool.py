"""The writer's reading pipelines: worker processes over shared memory, threads, in-process.

`ProcessReader` is driven directly with a synthetic loader (tiny rings force
every path of its protocol: waiting for room, committing early, records sent
inline), and through `pack`, whose three pipelines must write the same pack.
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import lmdbfolder.write.loop as loop_mod
import lmdbfolder.write.processes as procpool
from conftest import image_bytes, pack_contents, write
from lmdbfolder.errors import PackError
from lmdbfolder.format import CRC32_IMPLEMENTATION, checksum
from lmdbfolder.tools.verify import verify
from lmdbfolder.write.loop import batch_bytes, sync_latency
from lmdbfolder.write.processes import ProcessReader, processes_available
from lmdbfolder.write.records import Alloc, Loaded, Skipped, read_into_record
from lmdbfolder.write.sources import scan
from lmdbfolder.write.writer import pack, pack_sources

needs_processes = pytest.mark.skipif(sys.platform != "linux", reason="worker processes need Linux (fork)")


def _settle_threads() -> None:
    # A thread pool of an earlier test's dataset (threads=N) ends once the dataset is
    # collected: collect it and wait for its threads, which then end by themselves.
    gc.collect()
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and thread.name.startswith(("lmdbfolder-batch", "ThreadPool")):
            thread.join()


def test_a_progress_bars_monitor_thread_does_not_stop_worker_processes() -> None:
    # Any library's first tqdm bar starts tqdm's monitor thread, which stays: it must not
    # make every later pack in the process read with threads.
    from tqdm import tqdm

    if sys.platform != "linux":
        return
    _settle_threads()
    monitor_interval = tqdm.monitor_interval
    tqdm.monitor_interval = 10  # tqdm's default
    try:
        with open(os.devnull, "w") as sink, tqdm(total=1, file=sink) as bar:
            bar.update(1)
    finally:
        tqdm.monitor_interval = monitor_interval
    assert any(type(t).__name__ == "TMonitor" for t in threading.enumerate())
    assert processes_available(), f"a thread was left running: {threading.enumerate()}"


def test_processes_are_used_only_without_other_threads() -> None:
    if sys.platform != "linux":
        assert not processes_available()
        return
    _settle_threads()
    assert processes_available(), f"a thread was left running: {threading.enumerate()}"
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert not processes_available()
    finally:
        stop.set()
        thread.join()
    assert processes_available()


def _payload(i: int) -> bytes:
    size = 100 + (i * 7919) % 3000
    return (i.to_bytes(4, "little") * (size // 4 + 1))[:size]


def _synthetic_load(i: int, alloc: Alloc | None) -> Loaded | Skipped:
    data = _payload(i)
    if i % 13 == 0:
        return Loaded(_oversized(i), "jpeg", len(data))  # built anew, and larger than a ring: sent inline
    buf = alloc(len(data)) if alloc is not None else None
    if i % 11 == 0:
        return Skipped(f"skip {i}")  # after taking a slot, which must be given back
    if buf is None:
        return Loaded(data, "png", len(data))
    buf[:] = data
    return Loaded(buf, "png", len(data))


def _oversized(i: int) -> bytes:
    return (i.to_bytes(4, "little") * 25_000)[: 100_000 - i]


def _expected(i: int) -> tuple[str, bytes | str]:
    if i % 13 == 0:
        return "jpeg", _oversized(i)
    if i % 11 == 0:
        return "skip", f"skip {i}"
    return "png", _payload(i)


@needs_processes
def test_process_reader_in_order_through_tiny_rings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(procpool, "MIN_RING", 0)
    events = {"full": 0}
    seen: list[tuple[str, bytes | str]] = []
    kinds = {"view": 0, "bytes": 0}
    held: list[Loaded] = []

    # 64 KB rings: room for a chunk (16 records of at most 3 KB), not for much more.
    ring = 64 << 10
    with ProcessReader(range(400), _synthetic_load, workers=3, ring_bytes=3 * ring, on_full=lambda: None) as reader:

        def commit() -> None:  # what the writer does: the records are safe, the ring is free
            events["full"] += 1
            held.clear()
            reader.release()

        reader.on_full = commit
        for n, result in enumerate(reader):
            if isinstance(result, Skipped):
                seen.append(("skip", result.reason))
                continue
            kinds["view" if isinstance(result.value, memoryview) else "bytes"] += 1
            seen.append((result.encoding, bytes(result.value)))
            held.append(result)
            if n >= 200 and n % 10 == 9:  # the first half is only ever released when a ring is full
                held.clear()
                reader.release()
        held.clear()

    assert seen == [_expected(i) for i in range(400)]
    assert kinds["bytes"] == len([i for i in range(400) if i % 13 == 0])  # the oversized ones came inline
    assert kinds["view"] > 250
    assert events["full"] > 0  # the rings filled up before the consumer's own commits


def _failing_load(i: int, alloc: Alloc | None) -> Loaded | Skipped:
    if i == 37:
        raise RuntimeError("this loader is broken")
    return _synthetic_load(i, alloc)


def _dying_load(i: int, alloc: Alloc | None) -> Loaded | Skipped:
    if i == 37:
        os._exit(3)
    return _synthetic_load(i, alloc)


@needs_processes
@pytest.mark.parametrize(
    ("load", "message"),
    [
        (_failing_load, "RuntimeError: this loader is broken"),
        (_dying_load, "stopped unexpectedly (exit code 3)"),
    ],
)
def test_process_reader_reports_a_failing_or_dead_worker(load: procpool.Load, message: str) -> None:
    with (
        pytest.raises(PackError) as info,
        ProcessReader(range(100), load, workers=2, ring_bytes=1 << 20, on_full=lambda: None) as reader,
    ):
        for _ in reader:
            pass
    assert message in str(info.value)
    assert "run the same command again to resume" in str(info.value)


@pytest.fixture
def mixed_tree(tmp_path: Path) -> Path:
    rng = np.random.default_rng(5)
    kinds = ["rgb_jpeg", "gray_jpeg", "cmyk_jpeg", "rgba_png", "palette_png"]
    for i in range(60):
        data, ext = image_bytes(kinds[i % len(kinds)], rng, w=20 + i % 40, h=16 + i % 30)
        write(tmp_path / "src" / f"c{i % 3}" / f"img{i:03d}{ext}", data)
    write(tmp_path / "src" / "c1" / "empty.jpg", b"")
    write(tmp_path / "src" / "c2" / "text.png", b"not a png at all")
    return tmp_path / "src"


def _pack_in_pool(args: tuple[str, str]) -> int:
    return pack(args[0], args[1], workers=4, progress=False).count


def test_pack_inside_a_pool_worker_reads_with_threads(mixed_tree: Path, tmp_path: Path) -> None:
    # Pool workers are daemonic and may not start processes of their own.
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.map(_pack_in_pool, [(str(mixed_tree), str(tmp_path / "p"))]) == [60]
    assert verify(tmp_path / "p", progress=False).ok


@pytest.mark.parametrize("store", ["encoded", "raw"])
def test_processes_threads_and_one_thread_write_the_same_pack(
    mixed_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store: str
) -> None:
    entered = []
    original_enter = ProcessReader.__enter__
    monkeypatch.setattr(ProcessReader, "__enter__", lambda self: entered.append(1) or original_enter(self))
    packs = {}
    packs["in-process"] = pack(mixed_tree, tmp_path / "one", workers=1, store=store, progress=False)
    assert not entered
    packs["processes"] = pack(mixed_tree, tmp_path / "procs", workers=4, store=store, progress=False)
    assert entered == ([1] if processes_available() else [])
    monkeypatch.setattr(loop_mod, "processes_available", lambda: False)
    entered.clear()
    packs["threads"] = pack(mixed_tree, tmp_path / "threads", workers=4, store=store, progress=False)
    assert not entered
    contents = {name: pack_contents(Path(result.path)) for name, result in packs.items()}
    assert contents["processes"] == contents["in-process"] == contents["threads"]
    assert len(packs["processes"].skipped) == 2 and packs["processes"].count == 60
    assert all(verify(result.path, progress=False).ok for result in packs.values())


@needs_processes
def test_pack_through_tiny_rings_and_batches(mixed_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference = pack_contents(
        Path(pack(mixed_tree, tmp_path / "ref", workers=1, commit_bytes=1024, progress=False).path)
    )
    monkeypatch.setattr(procpool, "MIN_RING", 0)
    monkeypatch.setattr(procpool, "CHUNK", 3)
    # 2 KB rings and 1 KB batches: most records wait for room or travel inline.
    result = pack(mixed_tree, tmp_path / "tiny", workers=3, commit_bytes=1024, progress=False)
    assert pack_contents(Path(result.path)) == reference


def _children(pid: int) -> set[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return {int(x) for x in f.read().split()}
    except OSError:
        return set()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1].split()[0] != "Z"
    except OSError:
        return False


def _slow_tree(root: Path) -> Path:
    rng = np.random.default_rng(2)
    for i in range(400):
        data, ext = image_bytes("rgb_jpeg", rng, w=320, h=240)
        write(root / f"c{i % 4}" / f"{i:04d}{ext}", data)
    return root


def _pack_cmd(src: Path, out: Path) -> list[str]:
    # --check decode makes the pack slow enough to be caught while it runs.
    return [sys.executable, "-m", "lmdbfolder", "pack", str(src), str(out), "--check", "decode", "--no-progress"]


def _wait_for_children(proc: subprocess.Popen[bytes], want: int) -> set[int]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        kids = _children(proc.pid)
        if len(kids) >= want:
            return kids
        time.sleep(0.005)
    pytest.fail("the pack never started its reader processes")


def _caught_mid_pack(
    src: Path, out: Path, stop: Callable[[subprocess.Popen[bytes]], None]
) -> tuple[Any, set[int], bytes]:
    """Start a pack of ``src`` and ``stop`` it once its readers run; again (from
    scratch) if it finished first, which a loaded machine can make happen: the
    pack of 400 files takes well under a second."""
    for _ in range(5):
        shutil.rmtree(out, ignore_errors=True)
        proc = subprocess.Popen(
            _pack_cmd(src, out),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_terminal_signals,
        )
        kids = _wait_for_children(proc, 4)
        stop(proc)
        _, err = proc.communicate(timeout=60)
        if not (proc.returncode == 0 and out.is_dir()):
            return proc, kids, err
    mask = [
        line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(("SigBlk", "SigIgn"))
    ]
    pytest.fail(f"the pack always finished before it could be stopped (this process: {mask})")


def _terminal_signals() -> None:
    # What a shell gives a command it starts in a terminal: nothing blocked,
    # SIGINT at its default. A blocked or ignored mask (left by whatever ran
    # earlier in this process) is inherited through exec, and a pack started
    # with it never sees the Ctrl-C.
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@needs_processes
def test_killed_writer_takes_its_readers_along_and_resumes(tmp_path: Path) -> None:
    src, out = _slow_tree(tmp_path / "src"), tmp_path / "out"
    proc, kids, _ = _caught_mid_pack(src, out, lambda p: p.kill())
    deadline = time.monotonic() + 10
    while any(_alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(_alive(k) for k in kids), "reader processes outlived a SIGKILLed writer"
    assert not out.exists()
    done = subprocess.run(_pack_cmd(src, out), capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    assert verify(out, progress=False).ok


@needs_processes
def test_ctrl_c_stops_writer_and_readers_and_resumes(tmp_path: Path) -> None:
    src, out = _slow_tree(tmp_path / "src"), tmp_path / "out"
    # What a terminal's Ctrl-C does: SIGINT to the whole foreground group.
    proc, kids, err = _caught_mid_pack(src, out, lambda p: os.killpg(p.pid, signal.SIGINT))
    assert proc.returncode != 0 and "interrupted; run the same command again to resume" in err.decode()
    assert not any(_alive(k) for k in kids)
    done = subprocess.run(_pack_cmd(src, out), capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    assert verify(out, progress=False).ok


def test_batches_follow_the_disk_flush_latency(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    latency = sync_latency(str(tmp_path))
    assert 0 < latency < 5 and os.listdir(tmp_path) == []  # measured, and the probe file is gone
    for seconds, mean, want in [
        (0.0001, 100e3, 2 << 20),  # a fast disk: the smallest batches
        (0.001, 100e3, int(0.001 * (10 << 30))),  # 1 ms flushes: ~10 MB batches
        (0.02, 100e3, 64 << 20),  # a slow disk: capped
        (0.0001, 5e6, 20_000_000),  # at least four records
        (float("inf"), 100e3, 64 << 20),  # cannot measure: large batches
    ]:
        monkeypatch.setattr(loop_mod, "sync_latency", lambda _d, s=seconds: s)
        assert batch_bytes(str(tmp_path), 64 << 20, mean) == want


def test_checksum_is_zlib_crc32_whatever_computes_it() -> None:
    rng = np.random.default_rng(0)
    for size in (0, 1, 31, 4096, 100_003):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        for start in (0, 1, 0xDEADBEEF):
            assert checksum(data, start) == zlib.crc32(data, start)
            assert checksum(memoryview(data), start) == zlib.crc32(data, start)
    try:
        import zlib_ng  # noqa: F401
    except ImportError:
        assert CRC32_IMPLEMENTATION == "zlib"
    else:
        assert CRC32_IMPLEMENTATION == "zlib-ng"


def test_read_into_record_handles_files_that_change_while_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "f.jpg"
    path.write_bytes(bytes(range(256)) * 40)
    real_fstat = os.fstat

    def fstat_off_by(delta: int):  # fstat saw the file before it grew or shrank
        def fake(fd: int) -> os.stat_result:
            st = real_fstat(fd)
            return os.stat_result((st.st_mode, *st[1:6], st.st_size + delta, *st[7:10]))

        return fake

    for delta in (-100, +100, 0):
        monkeypatch.setattr(os, "fstat", fstat_off_by(delta))
        buf = read_into_record(str(path))
        assert bytes(buf[32:]) == path.read_bytes()
    monkeypatch.setattr(os, "fstat", real_fstat)

    slots = []

    def alloc(n: int) -> memoryview:
        slots.append(memoryview(bytearray(n)))
        return slots[-1]

    buf = read_into_record(str(path), alloc)
    assert buf is slots[0] and bytes(buf[32:]) == path.read_bytes()
    with pytest.raises(IsADirectoryError):
        read_into_record(str(tmp_path))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the swallowed one
def test_a_ctrl_c_that_python_swallows_still_stops_the_pack(small_tree: Path, tmp_path: Path) -> None:
    # A SIGINT handled while a __del__ runs (multiprocessing's connections have
    # one) raises inside it, where Python prints "Exception ignored" and goes
    # on: the pack ran to the end (exit 0, 1 in 15 tries of `lmdbfolder pack`
    # + Ctrl-C here). The writer remembers the signal and stops at the next record.
    class Drops:
        def __del__(self) -> None:
            signal.raise_signal(signal.SIGINT)

    def progress(done: int, total: int) -> None:
        if done == 3:
            Drops()  # made and dropped at once: the signal arrives inside __del__

    out = tmp_path / "out"
    # Python's own handler, as in a fresh interpreter: something earlier in a
    # full test run can leave this process's SIGINT otherwise (and the latch
    # leaves a handler that is not Python's alone).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            pack_sources(scan(small_tree), out, progress=False, workers=1, commit_every=1, on_progress=progress)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not out.exists() and (tmp_path / "out.partial").is_dir()
    result = pack(small_tree, out, progress=False)
    assert result.resumed_from >= 3 and verify(out, progress=False).ok

"""Read source files in worker processes, straight into shared memory.

The writer's other reading pipeline (``write.threads.ordered_map`` runs threads).
On a warm page cache packing is CPU-bound, and in threads the Python part of
every file (opening it, Pillow's header parse, building the record) runs one
thread at a time under the GIL, with a futex hand-off around each system call.
Here each worker is a forked process with its own interpreter. It reads every
file into its own ring of shared memory, behind room for the record header,
and fills the header in place; the writer hands views of that memory to LMDB.
A record is never pickled and its payload is copied no more often than with
threads.

Protocol, for worker ``w`` of ``W``:

* The items are cut into chunks of consecutive items; chunk ``k`` belongs to
  worker ``k % W``. Fork gives the worker the item list, so no task is ever
  sent: the worker walks its chunks in order, as fast as its ring allows.
* Worker -> writer, on the results pipe: ``("c", k, results)`` per chunk, in
  order (each result a record's place in the ring, or a skip, with the
  file's size and modification time); ``("full", need)`` when it waits for the ring bytes before
  (monotonic) offset ``need`` to be freed; ``("error", text)``.
* Writer -> worker, on the control pipe: ``("f", end)``: the ring bytes before
  ``end`` are free again, sent after each commit (the records there are in
  LMDB). A ``"full"`` the writer reads before such a message has answered it
  is answered by committing at once when the batch holds the bytes needed,
  else by ``("nomore",)``: the record does not fit beside the rest of its
  chunk, and is sent in the result message itself.

Only on Linux (fork, and ``PR_SET_PDEATHSIG`` so a killed writer takes its
workers with it); elsewhere the writer uses threads.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import multiprocessing
import os
import signal
import sys
import threading
import traceback
import warnings
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable, Iterator, Sequence

from PIL import Image

from lmdbfolder.errors import PackError
from lmdbfolder.write.records import Alloc, Loaded, Skipped

__all__ = ["ProcessReader", "processes_available"]

#: Items per chunk: one result message each. Small enough that the writer
#: rarely waits for a chunk, large enough that messages cost little.
CHUNK = 16
#: Smallest ring per worker. Small rings stay in the CPU cache: the writer
#: copies records out soon after a worker wrote them.
MIN_RING = 2 << 20

Load = Callable[[int, "Alloc | None"], "Loaded | Skipped"]
#: Signals held back while a worker is forked (see ProcessReader.__enter__).
_FORK_BLOCKED = {signal.SIGINT, signal.SIGTERM}


def processes_available() -> bool:
    """Whether worker processes can be used here: Linux, no other Python thread running, not a daemon.

    Forking beside running Python threads can leave the child stuck (a lock
    held at the fork, or CPython's after-fork handler meeting a thread that
    is exiting), and a daemonic process (a multiprocessing Pool worker) may
    not start processes. Then the writer reads with threads instead, which
    since the batches became small is nearly as fast (bench_pack.py --compare).
    """
    if sys.platform != "linux" or "fork" not in multiprocessing.get_all_start_methods():
        return False
    current = threading.current_thread()
    others = [t for t in threading.enumerate() if t is not current and not _harmless(t)]
    return not others and not multiprocessing.current_process().daemon


def _harmless(thread: threading.Thread) -> bool:
    # tqdm's monitor thread: started by any library's first progress bar (Hugging Face
    # datasets, ...) and kept for the life of the process, it would make every later pack
    # read with threads. It only sleeps and nudges bars, and the forked workers never use
    # tqdm, so no lock it may hold at the fork is ever needed in them.
    return thread.daemon and type(thread).__name__ == "TMonitor"


class _Ring:
    """A worker's side of its ring: where the next record goes, and waiting for room."""

    def __init__(self, view: memoryview, control: Connection, results: Connection) -> None:
        self.view = view
        self.size = len(view)
        self.control = control
        self.results = results
        self.written = 0  # monotonic: bytes handed out so far (with skipped tails)
        self.freed = 0  # monotonic: bytes the writer has released
        self.slot = 0  # monotonic offset of the last slot handed out

    def alloc(self, n: int) -> memoryview | None:
        """``n`` contiguous bytes of the ring, or None when they cannot fit."""
        pos = self.written % self.size
        start = self.written if pos + n <= self.size else self.written + self.size - pos
        need = start + n - self.size  # the writer must have freed everything before this
        if self.freed < need and not self._wait_for_room(need):
            return None
        self.written = start + n
        self.slot = start
        offset = start % self.size
        return self.view[offset : offset + n]

    def drain(self) -> None:
        """Take the writer's pending messages (so its pipe never fills up)."""
        while self.control.poll():
            self._take(self.control.recv())

    def _take(self, msg: tuple[Any, ...]) -> bool:
        if msg[0] == "f":
            self.freed = max(self.freed, msg[1])
            return True
        return False  # "nomore": the writer cannot free enough

    def _wait_for_room(self, need: int) -> bool:
        self.drain()
        if self.freed >= need:
            return True
        self.results.send(("full", need))
        while self.freed < need:
            if not self._take(self.control.recv()):
                return False
        return True


def _set_parent_death_signal() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass
class _WorkerJob:
    """What worker ``w`` of ``workers`` is given (through the fork, not pickled): the items
    and how they are cut in ``chunks`` of ``chunk`` (it loads chunks ``w``,
    ``w + workers``, ...), the loader, its region ``[base, base + size)`` of the shared
    ring, its two pipe ends (and the others it inherited, closed at once), the writer's pid."""

    w: int
    workers: int
    items: Sequence[int]
    chunk: int
    chunks: int
    load: Load
    ring: mmap.mmap
    base: int
    size: int
    control: Connection
    results: Connection
    inherited: list[Connection]
    parent: int


def _worker(job: _WorkerJob) -> None:
    """The body of worker ``job.w`` (a forked child)."""
    _set_parent_death_signal()
    if os.getppid() != job.parent:  # the writer died before the signal was armed
        os._exit(1)
    # Ctrl-C reaches the whole process group; it is the writer's to handle (it
    # stops the workers). SIGINT and SIGTERM were blocked across the fork so
    # that none can land before this; SIGTERM (how the writer stops a worker)
    # gets its default action back from any Python handler the writer had.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORK_BLOCKED)
    gc.disable()  # short-lived, and records form no cycles
    # Pillow's DecompressionBombWarning says what the skip reason records; and
    # printing is the one thing here that takes a lock another thread of the
    # writer's process might have held when it forked.
    warnings.simplefilter("ignore")
    for conn in job.inherited:
        conn.close()
    r = _Ring(memoryview(job.ring)[job.base : job.base + job.size], job.control, job.results)
    results, chunk = job.results, job.chunk
    try:
        for k in range(job.w, job.chunks, job.workers):
            out: list[tuple[Any, ...]] = []
            for item in job.items[k * chunk : (k + 1) * chunk]:
                out.append(_load_one(r, job.load, item))
            results.send(("c", k, out))
            r.drain()
    except (BrokenPipeError, EOFError, ConnectionResetError):
        return  # the writer has gone
    except BaseException:
        try:
            results.send(("error", traceback.format_exc()))
        except OSError:
            pass


def _load_one(r: _Ring, load: Load, item: int) -> tuple[Any, ...]:
    mark = r.written
    result = load(item, r.alloc)
    if isinstance(result, Skipped):
        r.written = mark
        return ("s", result.reason, result.size, result.mtime_ns)
    value = result.value
    if isinstance(value, memoryview) and value.obj is r.view.obj:
        r.written = r.slot + len(value)  # the file may have shrunk while read
        return ("r", r.slot, len(value), result.encoding, result.source_bytes, result.mtime_ns)
    r.written = mark  # a record built anew (raw pixels, resized, a grown file)
    slot = r.alloc(len(value))
    if slot is None:
        return ("i", bytes(value), result.encoding, result.source_bytes, result.mtime_ns)
    slot[:] = value
    return ("r", r.slot, len(value), result.encoding, result.source_bytes, result.mtime_ns)


class ProcessReader:
    """Results of ``load(item, alloc)`` for each item, in order, computed by worker processes.

    Use as a context manager. Iterating yields Loaded (whose value is a view
    of shared memory, valid until ``release``) or Skipped. Call ``release()``
    once every record yielded so far is committed; ``on_full`` is called when
    a worker runs out of room, and should commit (and release) what it can.
    """

    def __init__(
        self,
        items: Sequence[int],
        load: Load,
        *,
        workers: int,
        ring_bytes: int,
        on_full: Callable[[], None],
        chunk: int | None = None,
    ) -> None:
        self.items = items
        self.load = load
        self.chunk = CHUNK if chunk is None else chunk
        self.chunks = -(-len(items) // self.chunk)
        self.workers = max(1, min(workers, self.chunks))
        self.ring_size = max(MIN_RING, ring_bytes // self.workers)
        self.on_full = on_full
        self._ring: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._procs: list[Any] = []
        self._control: list[Connection] = []
        self._results: list[Connection] = []
        self._consumed = [0] * self.workers
        self._sent = [0] * self.workers

    def __enter__(self) -> ProcessReader:
        Image.preinit()  # import the common plugins once, before the fork, not in every worker
        self._ring = mmap.mmap(-1, self.ring_size * self.workers)
        self._view = memoryview(self._ring)
        ctx = multiprocessing.get_context("fork")
        pipes = [(ctx.Pipe(duplex=False), ctx.Pipe(duplex=False)) for _ in range(self.workers)]
        every = [conn for pair in pipes for ends in pair for conn in ends]
        try:
            for w, ((control_r, control_w), (results_r, results_w)) in enumerate(pipes):
                # The child keeps only its own two ends: a pipe end left open in
                # another process would hide a dead writer or worker (no EOF).
                inherited = [c for c in every if c is not control_r and c is not results_w]
                proc = ctx.Process(
                    target=_worker,
                    args=(
                        _WorkerJob(
                            w,
                            self.workers,
                            self.items,
                            self.chunk,
                            self.chunks,
                            self.load,
                            self._ring,
                            w * self.ring_size,
                            self.ring_size,
                            control_r,
                            results_w,
                            inherited,
                            os.getpid(),
                        ),
                    ),
                    name=f"lmdbfolder-read-{w}",
                    daemon=True,
                )
                # Block Ctrl-C and SIGTERM across the fork (the child resets them before
                # unblocking; here a pending one is delivered right after). A Python
                # handler that ran inside an at-fork hook instead would raise there,
                # where CPython only prints "Exception ignored": the signal was lost.
                blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _FORK_BLOCKED)
                try:
                    proc.start()
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
                self._procs.append(proc)
                control_r.close()
                results_w.close()
                self._control.append(control_w)
                self._results.append(results_r)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[Loaded | Skipped]:
        if self._view is None:
            raise RuntimeError("use ProcessReader as a context manager")
        view, size = self._view, self.ring_size
        for k in range(self.chunks):
            w = k % self.workers
            for item in self._chunk(w, k):
                tag = item[0]
                if tag == "r":
                    _, start, n, encoding, source_bytes, mtime_ns = item
                    offset = w * size + start % size
                    self._consumed[w] = start + n
                    yield Loaded(view[offset : offset + n], encoding, source_bytes, mtime_ns)
                elif tag == "s":
                    yield Skipped(item[1], item[2], item[3])
                else:
                    yield Loaded(item[1], item[2], item[3], item[4])

    def _chunk(self, w: int, k: int) -> list[tuple[Any, ...]]:
        while True:
            try:
                msg = self._results[w].recv()
            except EOFError:
                proc = self._procs[w]
                proc.join(1)
                raise PackError(
                    f"reader process {proc.pid} stopped unexpectedly (exit code {proc.exitcode})",
                    "run the same command again to resume; if it recurs, pass --workers 1",
                ) from None
            if msg[0] == "c":
                if msg[1] != k:
                    raise PackError(f"reader process {w} sent chunk {msg[1]} where {k} was expected")
                return msg[2]  # type: ignore[no-any-return]
            if msg[0] == "full":
                self._make_room(w, msg[1])
            elif msg[0] == "error":
                raise PackError(f"a reader process failed:\n{msg[1]}", "run the same command again to resume")

    def _make_room(self, w: int, need: int) -> None:
        """Worker ``w`` waits until everything before ``need`` is freed."""
        if self._sent[w] >= need:
            return  # freed by a commit since it asked: it is already on its way
        if self._consumed[w] >= need:
            self.on_full()  # the space is held by the batch, so commit it now
        if self._sent[w] < need:  # what it needs is (part of) the chunk it is reading
            self._tell(w, ("nomore",))

    def release(self) -> None:
        """Every record yielded so far is committed: its ring space can be reused."""
        for w in range(self.workers):
            if self._consumed[w] > self._sent[w]:
                self._sent[w] = self._consumed[w]
                self._tell(w, ("f", self._consumed[w]))

    def _tell(self, w: int, msg: tuple[Any, ...]) -> None:
        try:
            self._control[w].send(msg)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the worker has finished its chunks and exited

    def close(self) -> None:
        """Stop the workers and unmap the ring (views handed out must be gone)."""
        for conn in (*self._control, *self._results):
            conn.close()
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self._procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._control, self._results, self._procs = [], [], []
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._ring is not None:
            try:
                self._ring.close()
            except BufferError:
                pass  # a record view is still referenced; the map goes with it
            self._ring = None

"""Timing harness shared by ``lmdbfolder demo``/``bench`` and ``benchmarks/``.

Each function measures one contestant on one workload and returns a
``Measurement``; callers alternate contestants in one run and report ratios,
because absolute numbers on a shared machine drift. torch is imported only by
the functions that need a DataLoader.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from lmdbfolder.read.opening import open_pack

__all__ = [
    "Measurement",
    "CpuMeter",
    "CpuUse",
    "proc_cpu_sample",
    "measured",
    "time_raw_files",
    "time_raw_pack",
    "time_sequential",
    "time_loader",
    "time_in_process",
    "train_transform",
    "fast_train_transform",
    "fast_resize",
    "read_path_overhead",
]


@dataclass(frozen=True)
class Measurement:
    """``images`` read (``nbytes`` bytes) in ``seconds`` by ``contestant`` on ``workload``."""

    contestant: str
    workload: str
    workers: int
    images: int
    nbytes: int
    seconds: float
    #: CPU seconds this process and its workers used during the measurement (None: not measured)
    cpu_seconds: float | None = None
    #: CPU seconds every other process on the machine used meanwhile (None: unknown here)
    others_cpu_seconds: float | None = None
    #: wall seconds the CPU use was measured over (the measurement with its setup)
    cpu_wall_seconds: float | None = None

    @property
    def cpu_ms_per_image(self) -> float | None:
        """CPU milliseconds per image of this process and its workers (None: not measured)."""
        if self.cpu_seconds is None or not self.images:
            return None
        return self.cpu_seconds / self.images * 1e3

    @property
    def others_cpus(self) -> float | None:
        """CPUs that other processes kept busy on average during the measurement (None: unknown)."""
        if self.others_cpu_seconds is None or not self.cpu_wall_seconds:
            return None
        return self.others_cpu_seconds / self.cpu_wall_seconds

    def renamed(self, **changes: Any) -> Measurement:
        """A copy with ``changes`` (another contestant or workload name)."""
        return dataclasses.replace(self, **changes)

    @property
    def images_per_second(self) -> float:
        """Throughput in images per second."""
        return self.images / self.seconds if self.seconds > 0 else 0.0

    @property
    def mb_per_second(self) -> float:
        """Throughput in megabytes (10**6 bytes) per second."""
        return self.nbytes / 1e6 / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class CpuUse:
    """What the CPUs did during one measurement: ``own`` CPU seconds of this process
    and its descendants, ``others`` of every other process (None where unknown), over ``wall`` seconds."""

    wall: float
    own: float
    others: float | None


def _stat_fields(text: str) -> list[str]:
    # /proc/PID/stat: "pid (comm) state ppid ..."; comm may hold spaces and parentheses.
    return text[text.rindex(")") + 2 :].split()


def proc_cpu_sample(root_pid: int | None = None) -> tuple[float | None, float]:
    """``(busy CPU seconds of the whole machine, CPU seconds of the process tree at root_pid)``.

    The machine's busy time is ``/proc/stat``'s first line without idle and
    iowait (steal counts: another VM used the core). The tree's is every
    descendant's ``utime + stime`` plus what its reaped children used
    (``cutime + cstime``), from ``/proc/PID/stat``; the root defaults to this
    process. Where ``/proc`` is missing: ``(None, this process's CPU time)``.
    """
    root = os.getpid() if root_pid is None else root_pid
    tick = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
    try:
        with open("/proc/stat", "rb") as f:
            cpu = f.readline().split()
    except OSError:
        t = os.times()
        return None, t.user + t.system + t.children_user + t.children_system
    # user nice system idle iowait irq softirq steal (guest time is inside user)
    values = [int(v) for v in cpu[1:9]] + [0] * max(0, 9 - len(cpu))
    busy = sum(values[:3]) + sum(values[5:8])
    parents: dict[int, list[int]] = {}
    times: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = _stat_fields(f.read().decode("ascii", "replace"))
        except (OSError, ValueError):
            continue  # it ended meanwhile
        pid = int(name)
        parents.setdefault(int(fields[1]), []).append(pid)
        times[pid] = sum(int(v) for v in fields[11:15])  # utime stime cutime cstime
    tree, todo = 0, [root]
    while todo:
        pid = todo.pop()
        tree += times.get(pid, 0)
        todo.extend(parents.get(pid, ()))
    return busy / tick, tree / tick


class CpuMeter:
    """CPU seconds used by this process tree and by everything else, between ``start`` and ``stop``.

    ``sample`` returns ``(machine busy seconds or None, tree seconds)``
    (``proc_cpu_sample``; tests pass their own), ``clock`` wall seconds,
    ``cpus`` the CPUs the machine has. The others' share is the machine's busy
    time minus the tree's: what other processes (and other VMs, as steal)
    took from the CPUs meanwhile. The kernel counts CPU time in ticks
    (10 ms), so over less than ``MIN_WALL`` seconds it is not told (None).
    """

    #: The shortest interval whose others' CPU time is reported.
    MIN_WALL = 0.5

    def __init__(
        self,
        sample: Callable[[], tuple[float | None, float]] = proc_cpu_sample,
        clock: Callable[[], float] = time.perf_counter,
        cpus: int | None = None,
    ) -> None:
        self._sample = sample
        self._clock = clock
        self._cpus = cpus or os.cpu_count() or 1
        self._start: tuple[float | None, float] = (None, 0.0)
        self._t0 = 0.0

    def start(self) -> CpuMeter:
        """Take the first reading."""
        self._start = self._sample()
        self._t0 = self._clock()
        return self

    def stop(self) -> CpuUse:
        """Take the second reading; what was used in between."""
        busy, own = self._sample()
        wall = self._clock() - self._t0
        used = max(0.0, own - self._start[1])
        others = None
        if busy is not None and self._start[0] is not None and wall >= self.MIN_WALL:
            others = min(max(0.0, (busy - self._start[0]) - used), wall * self._cpus)
        return CpuUse(wall, used, others)


def measured(fn: Callable[[], Measurement], meter: CpuMeter | None = None) -> Measurement:
    """``fn()``'s measurement with the CPU use recorded around it (``CpuMeter``)."""
    meter = (meter or CpuMeter()).start()
    m = fn()
    use = meter.stop()
    return m.renamed(cpu_seconds=use.own, others_cpu_seconds=use.others, cpu_wall_seconds=use.wall)


def _order(n: int, shuffle: bool, seed: int) -> list[int]:
    order = list(range(n))
    if shuffle:
        random.Random(seed).shuffle(order)
    return order


def time_raw_files(paths: Sequence[str], *, shuffle: bool = True, seed: int = 0) -> Measurement:
    """Read every file's bytes (open, read, close), no decoding."""
    nbytes = 0
    start = time.perf_counter()
    for i in _order(len(paths), shuffle, seed):
        with open(paths[i], "rb", buffering=0) as f:
            nbytes += len(f.readall())
    return Measurement("files", "raw read", 0, len(paths), nbytes, time.perf_counter() - start)


def time_raw_pack(
    path: str,
    *,
    shuffle: bool = True,
    seed: int = 0,
    readahead: bool = True,
    batch: int = 0,
    indices: Sequence[int] | None = None,
    contestant: str = "lmdbfolder",
) -> Measurement:
    """Touch every record's payload through ``Reader.get``, no decoding.

    The payload is summed a byte per page so the pages are really read, as a
    decoder would read them, without copying them. With ``batch > 0`` the
    records are fetched ``batch`` at a time with ``Reader.get_many``, the
    next batch prefetched (``Reader.prefetch``) while one is read. ``indices``
    restricts the read to those samples (in that order, then shuffled).
    """
    reader = open_pack(path, readahead=readahead)
    nbytes = 0
    order = list(indices) if indices is not None else list(range(len(reader)))
    if shuffle:
        random.Random(seed).shuffle(order)
    try:
        start = time.perf_counter()
        if batch > 0:
            reader.prefetch(order[:batch])
            for k in range(0, len(order), batch):
                reader.prefetch(order[k + batch : k + 2 * batch])  # the next batch, while reading this one
                for rec in reader.get_many(order[k : k + batch], prefetch=False):
                    payload = rec.payload
                    nbytes += len(payload)
                    sum(payload[::4096])
        else:
            for i in order:
                payload = reader.get(i).payload
                nbytes += len(payload)
                sum(payload[::4096])
        seconds = time.perf_counter() - start
    finally:
        reader.close()
    return Measurement(contestant, "raw read", 0, len(order), nbytes, seconds)


def time_sequential(
    paths: str | Sequence[str], *, block: int = 1 << 20, contestant: str = "dd data.mdb"
) -> Measurement:
    """Read ``paths`` (one file, or several one after the other: the shards of a
    sharded pack) front to back in ``block``-byte reads (what ``dd bs=1M`` does)."""
    buf = bytearray(block)
    view = memoryview(buf)
    nbytes = 0
    start = time.perf_counter()
    for path in [paths] if isinstance(paths, str) else paths:
        with open(path, "rb", buffering=0) as f:
            while True:
                n = f.readinto(view)
                if not n:
                    break
                nbytes += n
    return Measurement(contestant, "raw read", 0, 0, nbytes, time.perf_counter() - start)


def train_transform(size: int = 224) -> Any:
    """The training pipeline used in comparisons: RandomResizedCrop, flip, PILToTensor."""
    from torchvision import transforms as T

    return T.Compose([T.RandomResizedCrop(size, antialias=True), T.RandomHorizontalFlip(), T.PILToTensor()])


def fast_train_transform(size: int = 224) -> Any:
    """``train_transform`` with the crop fused into decoding (``lmdbfolder.fused``),
    resized by the compiled ``native`` resize where it is built (else OpenCV where it
    is installed, else Pillow), straight to a uint8 CHW tensor (the same output type
    and augmentation as ``train_transform``)."""
    from torchvision import transforms as T

    from lmdbfolder.fused import RandomResizedCrop

    return T.Compose([RandomResizedCrop(size, resize=fast_resize(), output="tensor"), T.RandomHorizontalFlip()])


def fast_resize() -> str:
    """The fused crop's fastest resize here: ``native`` where the compiled helper is
    built, else ``opencv`` where OpenCV is installed, else ``pil``."""
    from lmdbfolder.read.capabilities import current

    caps = current()
    return "native" if caps.native_resize() is not None else "opencv" if caps.cv2() is not None else "pil"


def time_in_process(dataset: Any, indices: Sequence[int], *, contestant: str) -> Measurement:
    """``dataset[i]`` for each index in this process: decode + augment alone, no DataLoader.

    torch runs single-threaded meanwhile, as it does in DataLoader workers.
    """
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else 0
    if torch is not None:
        torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        for i in indices:
            dataset[i]
        seconds = time.perf_counter() - start
    finally:
        if torch is not None:
            torch.set_num_threads(threads)
    return Measurement(contestant, "decode+augment", 1, len(indices), 0, seconds)


def time_loader(
    dataset: Any,
    *,
    contestant: str,
    workers: int,
    batch_size: int = 64,
    epochs: int = 1,
    multiprocessing_context: str | None = None,
    indices: Sequence[int] | None = None,
) -> Measurement:
    """Iterate ``dataset`` through a shuffling DataLoader for ``epochs`` epochs.

    Worker start-up is included (it is part of what a user waits for); use
    ``epochs > 1`` with persistent workers to see the steady state.
    ``indices`` restricts the epoch to a subset (``torch.utils.data.Subset``).

    With ``workers=0`` the samples are loaded in this process; torch runs with
    one intra-op thread meanwhile (restored afterwards), as it does in every
    DataLoader worker (``torch.utils.data._utils.worker`` sets it): with
    several, tensor ops on single images spent most of their time making
    threads meet (``ToTensor`` took 5.6 ms instead of 0.34 ms per image here).
    """
    import torch
    from torch.utils.data import DataLoader, Subset

    if indices is not None:
        dataset = Subset(dataset, list(indices))
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        multiprocessing_context=multiprocessing_context if workers > 0 else None,
        generator=torch.Generator().manual_seed(0),
    )
    images = 0
    threads = torch.get_num_threads()
    if workers == 0:
        torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        for _ in range(epochs):
            for batch, _target in loader:
                images += len(batch)
        seconds = time.perf_counter() - start
    finally:
        if workers == 0:
            torch.set_num_threads(threads)
    del loader
    return Measurement(contestant, "train pipeline", workers, images, 0, seconds)


def read_path_overhead(path: str, *, samples: int = 2000, decodes: int = 100) -> dict[str, float]:
    """Microseconds per record of the read path (key encode, get, header parse,
    Record) with a warm cache, and per full Pillow decode of the same records."""
    from lmdbfolder.encodings import decode_rgb

    reader = open_pack(path)
    try:
        n = len(reader)
        order = _order(n, True, 1)[: min(n, samples)]
        for i in order:  # warm the pages and the transaction
            reader.get(i)
        start = time.perf_counter()
        for i in order:
            reader.get(i)
        get_us = (time.perf_counter() - start) / len(order) * 1e6
        recs = [reader.get(i) for i in order[:decodes]]
        start = time.perf_counter()
        for rec in recs:
            decode_rgb(rec.payload, rec.encoding, rec.width, rec.height)
        decode_us = (time.perf_counter() - start) / len(recs) * 1e6
    finally:
        reader.close()
    return {"get_us": round(get_us, 2), "pillow_decode_us": round(decode_us, 1), "share": round(get_us / decode_us, 4)}

"""``lmdbfolder bench``: plain files against packs, on the user's data and machine.

One run measures every contestant on every workload, alternating them (a
shared machine drifts; ratios measured in one run are what to compare):

* raw read (bytes only, random order), page cache cold and warm: ``dd`` of
  ``data.mdb`` (the sequential reference), the plain files (open/read/close,
  what ImageFolder does per sample), the pack read record by record
  (``Reader.get``) and batch by batch with prefetching
  (``Reader.get_many``, what ``LMDBFolder`` does under a DataLoader);
* the training pipeline (``RandomResizedCrop(224)``, flip, to tensor) through
  a DataLoader for each worker count, warm, and cold at the largest count:
  ``ImageFolder``, ``LMDBFolder`` with its defaults, ``LMDBFolder`` with
  ``decoder="auto"`` and the crop fused into decoding, and optionally the
  latter on a pack resized at pack time (``--max-size``). With 0 workers the
  pipeline runs in the main process with torch limited to one intra-op
  thread, as DataLoader workers are (else torch's threads fight the process);
* decode + augment alone in one process, to tell how much the loader costs.

Contestants are named by their settings; the report calls a ratio below 1
slower and above 1 faster, and "fastest" only what measured fastest.

Only the samples that are in every pack are measured, for every contestant:
a source file that the pack skipped (truncated, not an image) is left out of
the ImageFolder runs too (ImageFolder would fail on it), and the report says
how many. Each contestant's runs are alternated with the others'; the report
gives the fastest of them (interference on a shared machine only slows a run
down), says where the runs disagree (``SPREAD_WARNING``), and records for
each run the CPU time of this process and its workers (CPU ms per image) and
the CPU time every other process used meanwhile (``timing.CpuMeter``): when
other processes kept more than ``BUSY_SHARE`` of the CPUs busy, the report
says the machine was shared and the ratios are only directional.

The page cache is made cold by ``os.sync()`` and ``posix_fadvise(DONTNEED)``
on every file (no root needed); the report says when that is impossible.
"""

from __future__ import annotations

import functools
import os
import platform
import random
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from lmdbfolder import packdir
from lmdbfolder.bench.timing import (
    CpuMeter,
    Measurement,
    fast_resize,
    fast_train_transform,
    measured,
    read_path_overhead,
    time_in_process,
    time_loader,
    time_raw_files,
    time_raw_pack,
    time_sequential,
    train_transform,
)
from lmdbfolder.errors import SkippedFilesWarning, SourceError, SourceNotFoundError
from lmdbfolder.text import plural, printable
from lmdbfolder.tools.cache import EvictReport, can_evict, evict, warm

__all__ = [
    "BenchConfig",
    "BenchResult",
    "run_bench",
    "format_report",
    "versus",
    "FILES",
    "DEFAULT",
    "FUSED",
    "RAW_GET",
    "RAW_BATCH",
    "RESIZED",
    "RESIZED_RAW",
    "SPREAD_WARNING",
    "BUSY_SHARE",
]

FILES = "ImageFolder (files)"
#: Raw reads of the pack: one record at a time, and a batch at a time with prefetching.
RAW_GET = "pack, Reader.get"
RAW_BATCH = "pack, get_many + prefetch"
DEFAULT = "LMDBFolder default"
FUSED = "LMDBFolder + fused crop"
RESIZED = "LMDBFolder max-size"
RESIZED_RAW = "LMDBFolder max-size raw"
DD = "dd data.mdb"
RECIPE = "LMDB readahead=False (recipe)"
BATCH = 64
#: Repeated runs whose fastest is this many times their slowest are reported as disagreeing.
SPREAD_WARNING = 1.2
#: Other processes using more than this share of the CPUs during a run make it a shared machine's run.
BUSY_SHARE = 0.1


@dataclass
class BenchConfig:
    """What ``run_bench`` measures (the ``lmdbfolder bench`` options)."""

    src: str
    packed: str | None = None
    workers: Sequence[int] = (0, 1, 2)
    limit: int = 2000
    raw_limit: int = 0
    repeat: int = 2
    cold: bool = True
    max_size: int | None = None
    max_size_raw: bool = False
    quality: int = 90
    size: int = 224
    batch_size: int = BATCH
    seed: int = 0
    #: also measure the GPU batch path (lmdbfolder.gpu) on this device ("cuda", "cpu"); None: not
    device: str | None = None
    workdir: str | None = None
    progress: bool | None = None
    say: Callable[[str], None] = print


@dataclass
class BenchResult:
    """Everything ``run_bench`` measured, JSON-ready with ``as_dict``."""

    config: dict[str, Any]
    machine: dict[str, Any]
    images: int
    source_bytes: int
    pack: dict[str, Any]
    eviction: str
    measurements: list[Measurement] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    recommendation: str = ""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (``lmdbfolder bench --json``)."""
        return {
            "config": self.config,
            "machine": self.machine,
            "images": self.images,
            "source_bytes": self.source_bytes,
            "pack": self.pack,
            "eviction": self.eviction,
            "measurements": [
                dict(
                    m.__dict__,
                    images_per_second=round(m.images_per_second, 1),
                    mb_per_second=round(m.mb_per_second, 1),
                    cpu_ms_per_image=None if m.cpu_ms_per_image is None else round(m.cpu_ms_per_image, 2),
                    others_cpus=None if m.others_cpus is None else round(m.others_cpus, 2),
                )
                for m in self.measurements
            ],
            "summary": self.summary,
            "recommendation": self.recommendation,
        }


class _Best:
    """All runs of each (contestant, workload, workers); reports the fastest run of each.

    On a shared machine another process can only slow a run down, so the
    fastest run is the best estimate of what the contestant does undisturbed
    (a median of two is the slower one: one stall decided a ratio). How far
    the runs are apart is reported beside it (``spreads``).
    """

    def __init__(self) -> None:
        self.all: dict[tuple[str, str, int], list[Measurement]] = {}

    def add(self, m: Measurement) -> Measurement:
        self.all.setdefault((m.contestant, m.workload, m.workers), []).append(m)
        return m

    @property
    def runs(self) -> dict[tuple[str, str, int], Measurement]:
        return {key: _fastest(ms) for key, ms in self.all.items()}

    def get(self, contestant: str, workload: str, workers: int) -> Measurement | None:
        ms = self.all.get((contestant, workload, workers))
        return _fastest(ms) if ms else None

    def spreads(self) -> list[dict[str, Any]]:
        """Every (contestant, workload, workers) with several runs: the rate of each run
        and ``spread``, the fastest over the slowest (1.0: they agree)."""
        out = []
        for (contestant, workload, workers), ms in self.all.items():
            if len(ms) < 2:
                continue
            rates = [_speed(m) for m in ms]
            low, high = min(rates), max(rates)
            out.append(
                {
                    "contestant": contestant,
                    "workload": workload,
                    "workers": workers,
                    "runs": [round(r, 1) for r in rates],
                    "unit": "MB/s" if ms[0].images == 0 else "img/s",
                    "spread": round(high / low, 2) if low > 0 else None,
                    "others_cpus": [None if m.others_cpus is None else round(m.others_cpus, 2) for m in ms],
                }
            )
        return out

    def every_run(self) -> list[Measurement]:
        return [m for ms in self.all.values() for m in ms]


def _speed(m: Measurement) -> float:
    return m.mb_per_second if m.images == 0 else m.images_per_second


def _fastest(ms: list[Measurement]) -> Measurement:
    """The fastest run (by images/s; MB/s for byte-only runs)."""
    return max(ms, key=_speed)


def _machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    for mod in ("torch", "torchvision", "PIL", "lmdb", "simplejpeg", "cv2"):
        m = sys.modules.get(mod)
        if m is not None:
            info[mod] = getattr(m, "__version__", "?")
    return info


def _torch_available() -> bool:
    try:
        import torch  # noqa: F401
        import torchvision  # noqa: F401
    except ImportError:
        return False
    return True


#: What to do with a SRC that torchvision's ImageFolder (one of the contestants) cannot read.
IMAGEFOLDER_TREE_HINT = (
    "bench compares torchvision's ImageFolder on SRC with the pack, so SRC must be an ImageFolder tree: "
    "SRC/<class>/<image>, every class folder holding at least one image Pillow reads (.jpg, .png, ...); "
    "move the images into class folders, remove the folders without one, or bench another tree"
)


def run_bench(cfg: BenchConfig) -> BenchResult:
    """Measure files against the pack as described in the module docstring."""
    from lmdbfolder.read.capabilities import resolve_decoder_name
    from lmdbfolder.write.sources import scan

    say = cfg.say
    try:
        sources = scan(cfg.src)
    except SourceNotFoundError as exc:
        if packdir.inspect(cfg.src).is_pack:
            exc.hint = (
                f"{cfg.src} is a pack: bench takes the image folder first and its pack second "
                f"(`lmdbfolder bench TREE {cfg.src}`)"
            )
        elif os.path.isdir(cfg.src):  # a tree, but not one ImageFolder reads (pack's hint names its flags)
            exc.hint = IMAGEFOLDER_TREE_HINT
        raise
    workdir = cfg.workdir or tempfile.mkdtemp(prefix="lmdbfolder-bench-")
    made_workdir = cfg.workdir is None
    if made_workdir and (cfg.packed is None or cfg.max_size):
        say(f"packs for the bench go to the temporary folder {workdir} (deleted at the end)")
    try:
        packs = _make_packs(cfg, workdir)
        samples = _Samples.of(sources, packs)
        if samples.left_out:
            say(
                f"{plural(samples.left_out, 'source file')} of {cfg.src} {'is' if samples.left_out == 1 else 'are'} "
                f"not in the pack (skipped when packing: {packs.skipped_note}); every contestant reads the "
                f"{plural(len(samples.files), 'other')}"
            )
        files = samples.files
        source_bytes = sum(os.path.getsize(p) for p in files)
        run = _Run(cfg, samples, packs)
        _measure_raw_reads(run)
        _warm_everything(run)
        overhead = _read_path(run)
        fastest_decoder = resolve_decoder_name("auto")
        single, device_summary = _measure_pipeline(run, fastest_decoder)
        result = BenchResult(
            config=_config(run, fastest_decoder, torch_measured=bool(single)),
            machine=_machine(),
            images=len(files),
            source_bytes=source_bytes,
            pack=run.packs.info,
            eviction=_eviction(run),
            measurements=list(run.best.runs.values()),
        )
        result.summary = _summarize(run.best, cfg, single)
        result.summary["read_path"] = overhead
        result.summary["left_out"] = samples.left_out
        result.summary["spread"] = run.best.spreads()
        result.summary["others"] = _others(run.best.every_run(), result.machine.get("cpus") or 1)
        if device_summary is not None:
            result.summary["device"] = device_summary
        result.recommendation = _recommend(run.best, cfg, result.summary)
        return result
    finally:
        if made_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
            if cfg.packed is None or cfg.max_size:
                say(f"deleted the temporary folder {workdir}")


@dataclass
class _Packs:
    """The packs one bench run reads: the given (or freshly packed) one and the resized copies."""

    packed: str
    resized: str | None
    resized_raw: str | None
    #: what ``BenchResult.pack`` reports: paths, sizes, packing times
    info: dict[str, Any]
    #: where the files the pack skipped are listed (for the report)
    skipped_note: str = ""

    def paths(self) -> list[str]:
        """Every pack of the run."""
        return [p for p in (self.packed, self.resized, self.resized_raw) if p]


@dataclass
class _Samples:
    """The samples a bench run measures: the source files that are in every pack.

    A file that ``pack`` skipped is in the tree (and in ImageFolder, which
    would fail on it) but in no pack; it is left out for every contestant, and
    each contestant reads the others by its own index: ``source_index`` into
    ``ImageFolder(SRC)``, ``pack_index[pack]`` into each pack.
    """

    files: list[str]
    source_index: list[int]
    pack_index: dict[str, list[int]]
    #: source files in no pack (or not in every one)
    left_out: int

    @classmethod
    def of(cls, sources: Any, packs: _Packs) -> _Samples:
        from lmdbfolder.read.opening import open_pack

        by_pack: dict[str, dict[str, int]] = {}
        for path in packs.paths():
            with open_pack(path) as reader:
                by_pack[path] = {p: i for i, p in reversed(list(enumerate(reader.paths())))}
        files, source_index = [], []
        pack_index: dict[str, list[int]] = {path: [] for path in by_pack}
        for i, rel in enumerate(sources.relpaths):
            found = [table.get(rel) for table in by_pack.values()]
            if any(k is None for k in found):
                continue
            files.append(sources.abspath(i))
            source_index.append(i)
            for path, k in zip(by_pack, found):
                pack_index[path].append(int(k))  # type: ignore[arg-type]
        if not files:
            raise SourceError(
                packs.packed,
                f"none of its samples is a file of {sources.root} (compared by path relative to the source folder)",
                "pass the pack made from this folder (or leave PACKED out to pack it now)",
            )
        return cls(files, source_index, pack_index, len(sources) - len(files))


def _make_packs(cfg: BenchConfig, workdir: str) -> _Packs:
    """Pack SRC into ``workdir`` unless ``cfg.packed`` is given, and the ``--max-size`` copies asked for."""
    from lmdbfolder.write.options import Resize
    from lmdbfolder.write.writer import pack

    say = cfg.say
    pack_info: dict[str, Any] = {}
    packed = cfg.packed
    skipped_note = f"see `lmdbfolder info {packed}`"
    if packed is None:
        packed = os.path.join(workdir, "pack")
        with warnings.catch_warnings():  # said below, with what it means for the bench
            warnings.simplefilter("ignore", SkippedFilesWarning)
            try:
                result = pack(cfg.src, packed, progress=cfg.progress)
            except SourceError as exc:
                # Every file skipped: none is an image ImageFolder could read either (pack's
                # own hint, how to list them, after bench's).
                exc.hint = IMAGEFOLDER_TREE_HINT + (f"; {exc.hint}" if exc.hint else "")
                raise
        pack_info.update(packed_in_seconds=round(result.seconds, 2), images_per_second=round(result.images_per_second))
        say(f"packed {result.count:,} images into {packed} in {result.seconds:.1f} s")
        more = "; ..." if len(result.skipped) > 3 else ""
        # file names are anyone's: escaped, as pack's own lines are
        skipped_note = "; ".join(f"{printable(p, 1000)}: {printable(r)}" for p, r in result.skipped[:3]) + more
    pack_info.update(path=os.path.abspath(packed), size=packdir.pack_size(packed))
    resized = None
    if cfg.max_size:
        resized = os.path.join(workdir, f"pack-max{cfg.max_size}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SkippedFilesWarning)
            result = pack(cfg.src, resized, resize=Resize(cfg.max_size, cfg.quality), progress=cfg.progress)
        pack_info["max_size"] = {
            "path": resized,
            "max_size": cfg.max_size,
            "quality": cfg.quality,
            "size": packdir.pack_size(resized),
            "packed_in_seconds": round(result.seconds, 2),
            "images_per_second": round(result.images_per_second),
        }
        say(
            f"packed a copy resized to longer side <= {cfg.max_size} px (JPEG q{cfg.quality}) in "
            f"{result.seconds:.1f} s ({result.images_per_second:,.0f} img/s): "
            f"{packdir.pack_size(resized) / 1e6:,.0f} MB vs {pack_info['size'] / 1e6:,.0f} MB"
        )
    resized_raw = None
    if cfg.max_size and cfg.max_size_raw:
        resized_raw = os.path.join(workdir, f"pack-max{cfg.max_size}-raw")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SkippedFilesWarning)
            result = pack(cfg.src, resized_raw, store="raw", resize=Resize(cfg.max_size), progress=cfg.progress)
        pack_info["max_size_raw"] = {
            "path": resized_raw,
            "size": packdir.pack_size(resized_raw),
            "packed_in_seconds": round(result.seconds, 2),
            "images_per_second": round(result.images_per_second),
        }
        say(
            f"packed a raw copy (--store raw --max-size {cfg.max_size}) in {result.seconds:.1f} s: "
            f"{packdir.pack_size(resized_raw) / 1e6:,.0f} MB"
        )
    return _Packs(packed, resized, resized_raw, pack_info, skipped_note)


class _Run:
    """What the steps of one bench run share: the files and packs it reads, the
    samples drawn for each workload, the measurements so far, the evictions."""

    def __init__(self, cfg: BenchConfig, samples: _Samples, packs: _Packs) -> None:
        self.cfg = cfg
        self.samples = samples
        self.files = files = samples.files
        self.packs = packs
        self.main_files = packdir.data_files(packs.packed)
        self.data_files = self.main_files + [
            f for p in (packs.resized, packs.resized_raw) if p for f in packdir.data_files(p)
        ]
        rng = random.Random(cfg.seed)
        n = len(files)
        # Drawn in this order (raw first) so that a seed picks the same samples as before.
        self.raw_subset = sorted(rng.sample(range(n), cfg.raw_limit)) if 0 < cfg.raw_limit < n else list(range(n))
        self.subset = sorted(rng.sample(range(n), cfg.limit)) if 0 < cfg.limit < n else list(range(n))
        self.best = _Best()
        self.evictions: list[EvictReport] = []

    def cold(self) -> None:
        """Evict every file of the run (sources and packs) from the page cache."""
        self.evictions.append(evict(self.files + self.data_files, always_check=self.data_files))

    def in_pack(self, pack: str, positions: Sequence[int]) -> list[int]:
        """The indices in ``pack`` of the samples at ``positions`` (of ``samples``)."""
        table = self.samples.pack_index[pack]
        return [table[k] for k in positions]

    def in_source(self, positions: Sequence[int]) -> list[int]:
        """The indices in ``ImageFolder(SRC)`` of the samples at ``positions``."""
        table = self.samples.source_index
        return [table[k] for k in positions]


def _measure_raw_reads(run: _Run) -> None:
    """Raw reads (bytes only, random order), cold then warm, contestants alternated."""
    cfg, packed = run.cfg, run.packs.packed
    raw_files = [run.files[i] for i in run.raw_subset]
    in_pack = run.in_pack(packed, run.raw_subset)
    raw: list[tuple[str, Callable[[], Measurement]]] = [
        (DD, lambda: time_sequential(run.main_files)),
        (FILES, lambda: time_raw_files(raw_files, seed=cfg.seed).renamed(contestant=FILES)),
        (RAW_GET, lambda: time_raw_pack(packed, indices=in_pack, seed=cfg.seed, contestant=RAW_GET)),
        (
            RAW_BATCH,
            lambda: time_raw_pack(packed, indices=in_pack, seed=cfg.seed, batch=BATCH, contestant=RAW_BATCH),
        ),
    ]
    caches = (["cold"] if cfg.cold else []) + ["warm"]
    for cache in caches:
        contestants = list(raw)
        if cache == "cold":
            contestants.append(
                (
                    RECIPE,
                    lambda: time_raw_pack(packed, indices=in_pack, seed=cfg.seed, readahead=False, contestant=RECIPE),
                )
            )
        else:
            for _, fn in contestants:  # warm everything once
                fn()
        for rep in range(cfg.repeat):
            for name, fn in _rotate(contestants, rep):
                if cache == "cold":
                    run.cold()
                m = run.best.add(_tag(measured(fn), cache))
                cfg.say(f"  raw read, {cache}, {name}: {_rate(m)}{_cpu_note(m)}")


def _warm_everything(run: _Run) -> None:
    """Cache everything the warm runs read (the cold runs evicted the resized
    packs too, and --raw-limit may have skipped files)."""
    for pack_dir in (run.packs.packed, run.packs.resized, run.packs.resized_raw):
        if pack_dir:
            warm(pack_dir, progress=False)
    time_raw_files([run.files[i] for i in run.subset], shuffle=False)


def _read_path(run: _Run) -> dict[str, Any]:
    """The cost of the read path alone (get + header parse), warm, against a Pillow decode."""
    overhead = read_path_overhead(run.packs.packed)
    run.cfg.say(
        f"  read path (get + header parse), warm: {overhead['get_us']:.1f} us/record = "
        f"{overhead['share']:.2%} of a Pillow decode ({overhead['pillow_decode_us']:,.0f} us)"
    )
    return overhead


def _measure_pipeline(run: _Run, fastest_decoder: str) -> tuple[dict[str, Measurement], dict[str, Any] | None]:
    """The training pipeline: decode + augment in one process, then the DataLoader
    for each worker count (warm, and cold at the largest), then ``--device``'s rows.

    Returns the single-process measurements (empty without torch) and the GPU
    path's summary (None without ``--device``).
    """
    cfg, packs, subset, best = run.cfg, run.packs, run.subset, run.best
    single: dict[str, Measurement] = {}
    if not _torch_available():
        cfg.say("torch/torchvision are not installed: only the raw-read workload was measured")
        return single, None
    from torchvision.datasets import ImageFolder

    from lmdbfolder.torch import LMDBFolder

    def indices(name: str, positions: Sequence[int]) -> list[int]:
        if name == FILES:
            return run.in_source(positions)
        path = {RESIZED: packs.resized, RESIZED_RAW: packs.resized_raw}.get(name) or packs.packed
        return run.in_pack(path, positions)

    def make(name: str) -> Any:
        if name == FILES:
            return ImageFolder(cfg.src, transform=train_transform(cfg.size))
        if name == DEFAULT:
            return LMDBFolder(packs.packed, transform=train_transform(cfg.size))
        path = str({RESIZED: packs.resized, RESIZED_RAW: packs.resized_raw}.get(name) or packs.packed)
        return LMDBFolder(path, transform=fast_train_transform(cfg.size), decoder=fastest_decoder, size_hint=cfg.size)

    names = (
        [FILES, DEFAULT, FUSED] + ([RESIZED] if packs.resized else []) + ([RESIZED_RAW] if packs.resized_raw else [])
    )
    small = subset[: min(len(subset), 300)]
    for name in names:  # warm-up and the single-process rate of decode + augment
        ds = make(name)
        time_in_process(ds, indices(name, small[:20]), contestant=name)
        chosen = indices(name, small)
        single[name] = best.add(_tag(measured(functools.partial(time_in_process, ds, chosen, contestant=name)), "warm"))
        _close(ds)
        cfg.say(f"  decode+augment in one process, {name}: {_rate(single[name])}{_cpu_note(single[name])}")
    top = max(cfg.workers)
    runs = [("warm", w) for w in cfg.workers] + ([("cold", top)] if cfg.cold else [])
    for cache, w in runs:
        for rep in range(cfg.repeat):
            for name in _rotate(names, rep):
                ds = make(name)
                if cache == "cold":
                    run.cold()
                chosen = indices(name, subset)
                m = measured(
                    functools.partial(
                        time_loader, ds, contestant=name, workers=w, batch_size=cfg.batch_size, indices=chosen
                    )
                )
                _close(ds)
                m = best.add(_tag(m, cache))
                cfg.say(f"  train pipeline, {cache}, {plural(w, 'worker')}, {name}: {_rate(m)}{_cpu_note(m)}")
    in_pack = run.in_pack(packs.packed, subset)
    device_summary = _device_rows(cfg, packs.packed, in_pack, best, cfg.say) if cfg.device else None
    return single, device_summary


def _config(run: _Run, fastest_decoder: str, *, torch_measured: bool) -> dict[str, Any]:
    """``BenchResult.config``: what was measured, and each contestant's settings in words."""
    cfg = run.cfg
    return {
        "src": os.path.abspath(cfg.src),
        "packed": cfg.packed,
        "workers": list(cfg.workers),
        "limit": len(run.subset),
        "raw_limit": len(run.raw_subset),
        "repeat": cfg.repeat,
        "size": cfg.size,
        "batch_size": cfg.batch_size,
        "max_size": cfg.max_size,
        "device": cfg.device,
        "settings": {
            RAW_BATCH: f"Reader.get_many in batches of {BATCH}, the next batch prefetched (madvise WILLNEED)",
            RAW_GET: "Reader.get, one record at a time",
            **(
                {
                    DEFAULT: (
                        f"LMDBFolder(root) with the pipeline as given (its default decoder='auto': here "
                        f"{fastest_decoder!r})"
                    ),
                    FUSED: (
                        f"LMDBFolder(root, size_hint={cfg.size}) (decoder='auto': here {fastest_decoder!r}) with "
                        f"lmdbfolder.fused.RandomResizedCrop({cfg.size}, resize="
                        f"{fast_resize()!r}, output='tensor') first"
                    ),
                }
                if torch_measured
                else {}
            ),
        },
        "in_process_threads": "0 workers: the main process, torch.set_num_threads(1) like a DataLoader worker",
    }


def _eviction(run: _Run) -> str:
    """How the page cache was made cold (the last eviction's report), or why it was not."""
    if run.evictions:
        return run.evictions[-1].describe()
    return "cold cache not measured (--warm-only)" if can_evict() else "page cache cannot be evicted here"


def device_contestant(device: str) -> str:
    """The contestant name of the GPU batch path's rows (``lmdbfolder.gpu``) on ``device``."""
    return f"GPU path ({device})"


def _device_rows(
    cfg: BenchConfig, packed: str, subset: list[int], best: _Best, say: Callable[[str], None]
) -> dict[str, Any]:
    """``lmdbfolder bench --device``: the GPU batch path beside the CPU rows (same workers, subset, batch size).

    Workers ship record bytes and planned crop boxes (``RecordBytes``); the
    training process decodes + crops + flips each batch on ``cfg.device``
    (``DeviceRandomResizedCrop``). Rows: the transform alone on batches read
    beforehand ("decode+augment"), then the DataLoader epoch for each worker
    count ("train pipeline"). Returns the per-batch times (GPU time from CUDA
    events on CUDA), the fallback counters and the ratio to the CPU fast path.
    """
    import torch

    from lmdbfolder.bench.gpu_timing import time_device_path, time_device_transform

    device = str(cfg.device)
    name = device_contestant(device)
    out: dict[str, Any] = {"device": device, "batch_size": cfg.batch_size, "per_workers": {}}
    if device.startswith("cuda"):
        out["name"] = torch.cuda.get_device_name(torch.device(device))
    alone, details = time_device_transform(
        packed, device=device, batch_size=cfg.batch_size, size=cfg.size, indices=subset, contestant=name
    )
    best.add(_tag(alone, "warm"))
    out["transform_alone"] = details
    say(
        f"  decode+augment on {device}, batches read beforehand: {_rate(alone)} "
        f"({details['transform_ms_per_batch']} ms/batch wall, {details['gpu_ms_per_batch']} ms/batch GPU)"
    )
    for w in cfg.workers:
        for _rep in range(cfg.repeat):
            m, details = time_device_path(
                packed,
                device=device,
                workers=w,
                batch_size=cfg.batch_size,
                size=cfg.size,
                indices=subset,
                contestant=name,
            )
            m = best.add(_tag(m, "warm"))
            out["per_workers"].setdefault(str(w), []).append(details)
            say(f"  train pipeline, warm, {w} workers, {name}: {_rate(m)} ({details['gpu_ms_per_batch']} ms/batch GPU)")
    top = max(cfg.workers)
    out["vs_fastest"] = _ratio(
        best.get(name, "train pipeline, warm", top), best.get(FUSED, "train pipeline, warm", top)
    )
    out["stats"] = details["stats"]
    return out


def _tag(m: Measurement, cache: str) -> Measurement:
    return m.renamed(workload=f"{m.workload}, {cache}")


def _cpu_note(m: Measurement) -> str:
    """`` (CPU: 3.1 ms/img; other processes: 0.9 CPUs)`` for a measurement's progress line."""
    parts = []
    if m.cpu_ms_per_image is not None:
        parts.append(f"{m.cpu_ms_per_image:,.1f} CPU ms/img")
    if m.others_cpus is not None:
        parts.append(f"other processes {m.others_cpus:.2f} CPUs")
    return f" ({'; '.join(parts)})" if parts else ""


def _others(runs: list[Measurement], cpus: int) -> dict[str, Any]:
    """What other processes used during the runs: the mean and the most CPUs, and whether
    that makes this a shared machine's measurement (``BUSY_SHARE`` of the CPUs)."""
    known = [m.others_cpus for m in runs if m.others_cpus is not None]
    if not known:
        if runs and all(m.cpu_wall_seconds is not None and m.cpu_wall_seconds < CpuMeter.MIN_WALL for m in runs):
            why = (
                f"every run took less than {CpuMeter.MIN_WALL} s, too short to tell from the kernel's CPU ticks "
                "(a larger --limit or --raw-limit makes the runs longer)"
            )
        else:
            why = "/proc/stat cannot be read here"
        return {"measured": False, "mean_cpus": None, "max_cpus": None, "busy": False, "why": why}
    worst = max(known)
    return {
        "measured": True,
        "mean_cpus": round(sum(known) / len(known), 2),
        "max_cpus": round(worst, 2),
        "busy": worst > BUSY_SHARE * cpus,
    }


def _rotate(items: list[Any], k: int) -> list[Any]:
    k %= max(1, len(items))
    return items[k:] + items[:k]


def _close(ds: Any) -> None:
    reader = getattr(ds, "reader", None)
    if reader is not None:
        reader.close()


def _rate(m: Measurement) -> str:
    if m.images == 0:
        return f"{m.mb_per_second:,.0f} MB/s"
    mb = f", {m.mb_per_second:,.0f} MB/s" if m.nbytes else ""
    return f"{m.images_per_second:,.0f} img/s{mb}"


def _ratio(a: Measurement | None, b: Measurement | None, attr: str = "images_per_second") -> float | None:
    if a is None or b is None:
        return None
    den = getattr(b, attr)
    return round(getattr(a, attr) / den, 2) if den > 0 else None


def _summarize(best: _Best, cfg: BenchConfig, single: dict[str, Measurement]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for cache in ("cold", "warm"):
        wl = f"raw read, {cache}"
        batched, files, dd = best.get(RAW_BATCH, wl, 0), best.get(FILES, wl, 0), best.get(DD, wl, 0)
        if batched is not None:
            out[f"raw_{cache}_batched_vs_dd"] = _ratio(batched, dd, "mb_per_second")
            out[f"raw_{cache}_batched_vs_files"] = _ratio(batched, files)
            out[f"raw_{cache}_get_vs_files"] = _ratio(best.get(RAW_GET, wl, 0), files)
    top = max(cfg.workers)
    for cache in ("warm", "cold"):
        wl = f"train pipeline, {cache}"
        files = best.get(FILES, wl, top)
        for name, key in (
            (DEFAULT, "default"),
            (FUSED, "fused"),
            (RESIZED, "max_size"),
            (RESIZED_RAW, "max_size_raw"),
        ):
            r = _ratio(best.get(name, wl, top), files)
            if r is not None:
                out[f"train_{cache}_{key}_vs_files_{top}w"] = r
    eff: dict[str, dict[str, float]] = {}
    for name, one in single.items():
        for w in cfg.workers:
            m = best.get(name, "train pipeline, warm", w)
            if m is not None and w > 0 and one.images_per_second > 0:
                eff.setdefault(name, {})[str(w)] = round(m.images_per_second / (w * one.images_per_second), 2)
    out["loader_efficiency"] = eff  # loader img/s / (workers x single-process img/s)
    return out


def versus(ratio: float, what: str) -> str:
    """A speed ratio in words that never call a loss a gain:
    ``"1.81x faster than ImageFolder"``, ``"about as fast as ImageFolder (1.02x)"``,
    ``"slower than plain files (0.92x)"``."""
    if ratio >= 1.05:
        return f"{ratio:.2f}x faster than {what}"
    if ratio > 0.95:
        return f"about as fast as {what} ({ratio:.2f}x)"
    return f"slower than {what} ({ratio:.2f}x)"


def _best_raw(best: _Best, cache: str) -> Measurement | None:
    """The faster of the pack's two raw-read contestants."""
    found = [m for m in (best.get(RAW_GET, f"raw read, {cache}", 0), best.get(RAW_BATCH, f"raw read, {cache}", 0)) if m]
    return max(found, key=lambda m: m.images_per_second) if found else None


def _recommend(best: _Best, cfg: BenchConfig, summary: dict[str, Any]) -> str:
    wl = "train pipeline, warm"
    raw_cache = "cold" if cfg.cold else "warm"
    raw = _best_raw(best, raw_cache)
    raw_ratio = _ratio(raw, best.get(FILES, f"raw read, {raw_cache}", 0))
    raw_words = (
        f"{raw_cache} raw reads ({raw.contestant}) are {versus(raw_ratio, 'plain files')}"
        if raw is not None and raw_ratio
        else ""
    )
    candidates = [m for (c, w_l, _w), m in best.runs.items() if w_l == wl and c in (DEFAULT, FUSED)]
    if not candidates:
        return (
            "Install torch and torchvision to measure the training pipeline"
            + (f"; {raw_words}" if raw_words else "")
            + "."
        )
    top = max(candidates, key=lambda m: m.images_per_second)
    files = best.get(FILES, wl, top.workers)
    gain = _ratio(top, files) or 0.0
    setting = (
        f"LMDBFolder(..., size_hint={cfg.size}) with lmdbfolder.fused.RandomResizedCrop({cfg.size}) first in the "
        "transform"
        if top.contestant == FUSED
        else "LMDBFolder(...) with its defaults"
    )
    parts = [f"the training pipeline is {versus(gain, 'ImageFolder')} (warm cache)"] + (
        [raw_words] if raw_words else []
    )
    pays = gain >= 1.1 or (raw_ratio or 0) >= 1.1
    verdict = ("packing pays off here: " if pays else "packing buys little on this machine: ") + "; ".join(parts)
    if not pays:
        verdict += "; plain files are fine here"
    resized = summary.get(f"train_warm_max_size_vs_files_{max(cfg.workers)}w")
    resized_raw = summary.get(f"train_warm_max_size_raw_vs_files_{max(cfg.workers)}w")
    extra = f"; a --max-size {cfg.max_size} pack is {versus(resized, 'ImageFolder')}" if resized else ""
    if resized_raw:
        extra += f" ({versus(resized_raw, 'ImageFolder')} with --store raw)"
    in_process = (
        " (0 workers loads in the training process itself; with a GPU to feed, workers let loading overlap "
        "the training steps)"
        if top.workers == 0
        else ""
    )
    return (
        f"Fastest measured: {top.contestant} with {plural(top.workers, 'worker')}{in_process}. "
        f"Use {setting}, num_workers={top.workers}; {verdict}{extra}." + _caveat(summary)
    )


def _caveat(summary: dict[str, Any]) -> str:
    """What makes the numbers less sure: a shared machine, repeated runs that disagree."""
    notes = []
    others = summary.get("others") or {}
    if others.get("busy"):
        notes.append(
            f"other processes used up to {others['max_cpus']:.2f} CPUs during the runs (this machine is shared)"
        )
    wide = [s for s in summary.get("spread") or [] if s["spread"] is not None and s["spread"] >= SPREAD_WARNING]
    if wide:
        notes.append(f"repeated runs disagreed ({plural(len(wide), 'measurement')}, listed above)")
    if not notes:
        return ""
    return " Caution: " + " and ".join(notes) + "; the ratios are only directional: rerun on a quiet machine."


def _device_lines(dev: dict[str, Any], top: int) -> list[str]:
    """The report lines of ``--device``: per-batch times, the ratio to the CPU fast path, the fallbacks."""
    where = dev["device"] + (f" ({dev['name']})" if dev.get("name") else "")
    alone = dev["transform_alone"]
    lines = [
        f"GPU path on {where}, batch {dev['batch_size']}: decode+crop+flip alone {alone['transform_ms_per_batch']} "
        f"ms/batch wall, {alone['gpu_ms_per_batch']} ms/batch GPU (CUDA events; None off CUDA)"
    ]
    for w, runs in dev["per_workers"].items():
        gpu = [r["gpu_ms_per_batch"] for r in runs]
        wall = [r["transform_ms_per_batch"] for r in runs]
        lines.append(f"  {w} workers: transform {wall} ms/batch wall, {gpu} ms/batch GPU, per run")
    lines.append(f"GPU path vs {FUSED} at {top} workers: {dev['vs_fastest']}x; samples by path: {dev['stats']}")
    return lines


def _format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Plain-text table with right-aligned numeric columns."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _trust_lines(s: dict[str, Any], cpus: int) -> list[str]:
    """The report's warnings: samples left out, a shared machine, runs that disagree."""
    lines = []
    if s.get("left_out"):
        lines.append(
            f"left out: {plural(s['left_out'], 'source file')} that the pack skipped (not measured for any contestant)"
        )
    others = s.get("others") or {}
    if others.get("busy"):
        lines.append(
            f"shared machine: other processes kept {others['mean_cpus']:.2f} of {plural(cpus, 'CPU')} busy on "
            f"average, up to {others['max_cpus']:.2f} during one run (column 'others'): runs compete with them, "
            "so the ratios are only directional"
        )
    elif not others.get("measured", True):
        lines.append(f"other processes' CPU use is unknown: {others.get('why') or '/proc/stat cannot be read here'}")
    wide = [d for d in s.get("spread") or [] if d["spread"] is not None and d["spread"] >= SPREAD_WARNING]
    for d in wide[:10]:
        if all(c is None for c in d["others_cpus"]):
            busy = "runs too short to measure other processes' CPU"
        else:
            busy = "other processes used " + ", ".join("-" if c is None else f"{c:.2f}" for c in d["others_cpus"])
            busy += " CPUs in those runs"
        lines.append(
            f"runs disagree: {d['workload']}, {plural(d['workers'], 'worker')}, {d['contestant']}: "
            f"{', '.join(f'{r:,.0f}' for r in d['runs'])} {d['unit']} ({d['spread']:.2f}x apart; {busy}); "
            "the fastest is reported"
        )
    if len(wide) > 10:
        lines.append(f"runs disagree: ... and {len(wide) - 10} more (summary.spread in --json)")
    return lines + ([""] if lines else [])


def format_report(result: BenchResult) -> str:
    """The human-readable table, the target ratios and the recommendation."""
    cfg = result.config
    runs = "one run per contestant" if cfg["repeat"] == 1 else f"the fastest of {cfg['repeat']} alternated runs"
    lines = [
        f"{result.images:,} images, {result.source_bytes / 1e6:,.0f} MB; pack {result.pack.get('size', 0) / 1e6:,.0f} "
        f"MB; {plural(result.machine.get('cpus') or 0, 'CPU')}; {runs}; pipeline = "
        f"RandomResizedCrop({cfg['size']}) + flip + to tensor, batch {cfg['batch_size']}, "
        f"{cfg['limit']:,} images/run",
        *(f"{name} = {text}" for name, text in (cfg.get("settings") or {}).items()),
        cfg.get("in_process_threads", ""),
        result.eviction,
        "",
        "CPU ms/img: CPU time of this process and its DataLoader workers per image; others: CPUs that other "
        "processes kept busy meanwhile (from /proc/stat); spread: fastest run / slowest run",
        "",
        _format_table(
            ["workload", "workers", "contestant", "img/s", "MB/s", "vs files", "CPU ms/img", "others", "spread"],
            _report_rows(result),
        ),
        "",
    ]
    s = result.summary
    lines.extend(_trust_lines(s, result.machine.get("cpus") or 1))
    lines.extend(_ratio_lines(s))
    if "read_path" in s:
        rp = s["read_path"]
        lines.append(
            f"read path overhead (warm): {rp['get_us']:.1f} us/record = {rp['share']:.2%} of a Pillow decode "
            f"({rp['pillow_decode_us']:,.0f} us)"
        )
    for name, by_w in s.get("loader_efficiency", {}).items():
        text = ", ".join(f"{plural(int(w), 'worker')} {e:.0%}" for w, e in by_w.items())
        lines.append(f"loader efficiency (img/s / (workers x one-process rate)), {name}: {text}")
    if "device" in s:
        lines.extend(_device_lines(s["device"], max(cfg["workers"])))
    lines.append("")
    lines.append("Recommendation: " + result.recommendation)
    return "\n".join(lines)


def _report_rows(result: BenchResult) -> list[list[Any]]:
    """The table's rows: raw reads first, then the pipeline, cold before warm, by workers and contestant."""
    rows = []
    order = {FILES: 1, DD: 0, RAW_GET: 2, RAW_BATCH: 3, DEFAULT: 2, FUSED: 3, RESIZED: 4, RESIZED_RAW: 5, RECIPE: 6}
    ms = sorted(
        result.measurements,
        key=lambda m: (
            m.workload.split(",")[0] != "raw read",
            m.workload.split(",")[0],
            m.workload.endswith("warm"),
            m.workers,
            order.get(m.contestant, 9),
        ),
    )
    base = {(m.workload, m.workers): m for m in ms if m.contestant == FILES}
    spreads = {(d["contestant"], d["workload"], d["workers"]): d for d in result.summary.get("spread") or []}
    for m in ms:
        ref = base.get((m.workload, m.workers))
        vs = _ratio(m, ref) if m.images else None
        spread = (spreads.get((m.contestant, m.workload, m.workers)) or {}).get("spread")
        cpu_ms, others = m.cpu_ms_per_image, m.others_cpus
        rows.append(
            [
                m.workload,
                m.workers if m.workload.startswith("train") else "-",
                m.contestant,
                f"{m.images_per_second:,.0f}" if m.images else "-",
                f"{m.mb_per_second:,.0f}" if m.nbytes else "-",
                f"{vs:.2f}x" if vs is not None else "-",
                f"{cpu_ms:,.1f}" if cpu_ms is not None else "-",
                f"{others:.2f}" if others is not None else "-",
                (f"{spread:.2f}x" + (" !" if spread >= SPREAD_WARNING else "")) if spread is not None else "-",
            ]
        )
    return rows


def _ratio_lines(s: dict[str, Any]) -> list[str]:
    """The summary's ratios in words: raw reads against the files and dd, each pipeline against ImageFolder."""
    lines = []
    for cache in ("cold", "warm"):
        if f"raw_{cache}_batched_vs_dd" in s:
            dd = s[f"raw_{cache}_batched_vs_dd"]
            batched, get = s[f"raw_{cache}_batched_vs_files"], s[f"raw_{cache}_get_vs_files"]
            lines.append(
                f"raw read, {cache}: {RAW_BATCH} is "
                + (versus(batched, "plain files") if batched else "not compared")
                + (f" and reads at {dd:.2f}x dd's MB/s" if dd else "")
                + (f"; {RAW_GET} is {versus(get, 'plain files')}" if get else "")
            )
    names = {"default": DEFAULT, "fused": FUSED, "max_size": RESIZED, "max_size_raw": RESIZED_RAW}
    for key, value in s.items():
        if key.startswith("train_") and value is not None:
            _, cache, *what, _vs, _files, workers = key.split("_")
            label = names.get("_".join(what), "_".join(what))
            lines.append(
                f"train pipeline, {cache}, {plural(int(workers.rstrip('w')), 'worker')}: "
                f"{label} is {versus(value, 'ImageFolder')}"
            )
    return lines

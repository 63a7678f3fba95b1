"""One planner for every pack: a ``PackRequest`` becomes a ``Plan``, which one executor runs.

A request is everything a pack call or ``lmdbfolder pack`` says: where from
(``src`` and a ``SourceSpec``: layout, list file, file filters), where to
(``dst``), how (``PackOptions``), in how many shards (``Sharding``), where
(locally, or on a Ray cluster: ``OnRay``) and whether to write at all
(``dry_run``). ``plan`` makes every decision, once, for every entry point
(``pack``, ``pack_sharded``, ``pack_ray``, ``dry_run``, the CLI):

1. the refusals of combinations that cannot work (``--update`` with
   ``--ray`` or ``--dry-run``, ``shard_index`` without ``shards``, ...);
2. the output is not inside the source (nor is ``staging``);
3. an update takes the pack's own layout and file filters (``update_spec``);
4. the one scan of the source into the sample list;
5. the ``Kind`` of run: a single pack, a sharded one, an update of either in
   place, shards on Ray, or a dry run. An update of a ``dst`` that holds no
   pack yet is a pack (its options made those of a new pack).

The executors do the work and decide nothing of this: ``writer.execute_single``
(``Kind.SINGLE``, ``Kind.UPDATE``), ``shards.execute_sharded``
(``Kind.SHARDED``, ``Kind.UPDATE_SHARDED``), ``ray.execute_ray`` and
``dryrun.execute_dry_run``; ``executors.EXECUTORS`` maps each kind to its
executor (docs/design.md, "The pack planner").
"""

from __future__ import annotations

import dataclasses
import enum
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from lmdbfolder import packdir
from lmdbfolder.errors import MissingDependencyError, OptionError
from lmdbfolder.write.options import PackOptions, pack_options
from lmdbfolder.write.output import check_outside_source
from lmdbfolder.write.sources import SourceList, SourceSpec
from lmdbfolder.write.update import update_spec

__all__ = [
    "DEFAULT_PREFIX",
    "Kind",
    "OnRay",
    "PackRequest",
    "Plan",
    "Sharding",
    "import_ray",
    "plan",
    "request_from_settings",
    "updatable",
]

#: Shard directories are named ``<prefix>-00003-of-00008.lmdb``.
DEFAULT_PREFIX = "train"


@dataclass(frozen=True)
class Sharding:
    """How a sharded pack is split (``pack_sharded``'s and ``pack --shards``'s keywords).

    ``shards`` shards, or as many as make about ``shard_size`` each; only shard
    ``shard_index`` of them (one job of an array); shard names start with
    ``prefix``; each shard built in ``staging`` (a node-local disk) and copied
    into ``dst`` when finished.
    """

    shards: int | None = None
    shard_size: int | str | None = None
    shard_index: int | None = None
    prefix: str = DEFAULT_PREFIX
    staging: str | os.PathLike[str] | None = None


@dataclass(frozen=True)
class OnRay:
    """Where and how the shards are packed on Ray (``pack_ray``'s keywords): the
    cluster ``address``, the CPUs reserved per shard task, ``ray.init``'s other
    keywords, and ``on_progress(done, total)`` as tasks report."""

    address: str | None = None
    task_cpus: float = 1.0
    init_kwargs: dict[str, Any] | None = None
    on_progress: Callable[[int, int], None] | None = None


@dataclass(frozen=True)
class PackRequest:
    """What to pack, where to and how: the one value every pack entry point builds.

    ``sharding`` None is a single pack; ``ray`` set packs the shards on a Ray
    cluster; ``dry_run`` writes nothing. ``update_as_packed``: an update of a
    sharded ``dst`` without ``sharding`` updates it as it is split (the command
    line's ``pack --update``) instead of being refused (``pack(update=True)``).
    """

    src: str | os.PathLike[str]
    dst: str | os.PathLike[str]
    source: SourceSpec = field(default_factory=SourceSpec)
    options: PackOptions = field(default_factory=PackOptions)
    sharding: Sharding | None = None
    ray: OnRay | None = None
    dry_run: bool = False
    update_as_packed: bool = False


class Kind(enum.Enum):
    """Which executor runs a plan (``executors.EXECUTORS``)."""

    SINGLE = "single"
    UPDATE = "update"
    SHARDED = "sharded"
    UPDATE_SHARDED = "update sharded"
    RAY = "ray"
    DRY_RUN = "dry run"


@dataclass(frozen=True)
class Plan:
    """A planned run: its ``kind``, the request, the options it runs with (an update
    of nothing is a new pack), the scanned sample list and when planning started."""

    kind: Kind
    request: PackRequest
    options: PackOptions
    sources: SourceList
    start_time: float

    @property
    def dst(self) -> str | os.PathLike[str]:
        """The output, as the request gives it."""
        return self.request.dst

    @property
    def sharding(self) -> Sharding:
        """The request's sharding (the defaults for an update that follows the pack's split)."""
        return self.request.sharding or Sharding()


def import_ray() -> Any:
    """The ``ray`` module, or MissingDependencyError saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        error = MissingDependencyError("packing on a Ray cluster (--ray)", "ray", "Ray")
        error.hint += " (on the driver and on every node)"
        raise error from exc
    return ray


def updatable(dst: str | os.PathLike[str]) -> bool:
    """Whether ``dst`` holds a single pack that an update changes in place (else it is packed)."""
    return packdir.inspect(dst).kind is packdir.Kind.PACK and not os.path.islink(dst)


def plan(request: PackRequest) -> Plan:
    """The plan of ``request``: every refusal, the scan, and which executor runs it (module docstring)."""
    start_time = time.perf_counter()
    opts, sharding = request.options, request.sharding
    _refuse_combinations(request)
    if request.ray is not None:
        import_ray()  # before the scan, which may take minutes
    check_outside_source(request.src, request.dst)  # before the scan, which would see a DST inside SRC as a class
    if sharding is not None and sharding.staging is not None:
        check_outside_source(request.src, sharding.staging)
        if request.ray is None:  # on Ray, each node's own disk holds it: the driver's says nothing
            _check_staging_folder(sharding.staging)
    sharded_dst = opts.update and packdir.inspect(request.dst).kind is packdir.Kind.SHARDED
    if sharded_dst and sharding is None and not request.update_as_packed:
        raise OptionError(
            f"{os.path.abspath(os.fspath(request.dst))} is a sharded pack",
            "update it with the shard options it was packed with: `lmdbfolder pack SRC DST --update --shards N` "
            "(Python: pack_sharded(..., update=True))",
        )
    spec = update_spec(request.source, request.dst) if opts.update else request.source
    sources = spec.scan(request.src)
    if sharding is not None and sharding.shard_index is not None and sharding.shards is None:
        raise ValueError("shard_index needs the number of shards (shards=N), the same for every job")
    kind = _kind(request, sharded_dst)
    if opts.update and kind in (Kind.SINGLE, Kind.SHARDED):
        opts = opts.for_new_pack()  # nothing to update: pack it (or finish the pack started there)
    return Plan(kind, request, opts, sources, start_time)


def _kind(request: PackRequest, sharded_dst: bool) -> Kind:
    """Which executor runs ``request`` (its refusals are raised already)."""
    if request.dry_run:
        return Kind.DRY_RUN
    if request.ray is not None:
        return Kind.RAY
    if sharded_dst:
        return Kind.UPDATE_SHARDED
    if request.sharding is not None:
        return Kind.SHARDED
    return Kind.UPDATE if request.options.update and updatable(request.dst) else Kind.SINGLE


def _refuse_combinations(request: PackRequest) -> None:
    """OptionError for what no executor can do, before any file is read."""
    if request.dry_run and request.options.update:
        raise OptionError(
            "--dry-run describes a new pack; it cannot preview --update (run --update itself: it is atomic)"
        )
    if request.ray is not None and request.sharding is not None and request.sharding.shard_index is not None:
        raise OptionError("--ray packs every shard; do not combine it with --shard-index")
    if request.ray is not None and request.options.update:
        raise OptionError(
            "--update reads only the files that changed, in one process: drop --ray",
            "run `lmdbfolder pack SRC DST --update` (Python: pack_sharded(src, dst, update=True))",
        )


def _check_staging_folder(staging: str | os.PathLike[str]) -> None:
    """The staging folder is a folder (or missing: it is made)."""
    where = os.path.abspath(os.path.expanduser(os.fspath(staging)))
    if os.path.lexists(where) and not os.path.isdir(where):
        # Found before any shard is packed: else every shard's makedirs failed with "File exists".
        raise OptionError(
            f"--staging {where} is not a folder", "pass a folder on a local disk (it is made if it is missing)"
        )


def _take(kind: type[Any], settings: dict[str, Any], without: tuple[str, ...] = ()) -> Any:
    """A ``kind`` (a dataclass) made of the keywords in ``settings`` that are its fields, popped."""
    names = [f.name for f in dataclasses.fields(kind) if f.name not in without]
    return kind(**{name: settings.pop(name) for name in names if name in settings})


def request_from_settings(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    options: PackOptions | None,
    settings: Mapping[str, Any],
    *,
    sharded: bool = False,
    ray: bool = False,
) -> PackRequest:
    """The request of ``pack_sharded(src, dst, options, **settings)`` (``sharded``) or
    ``pack_ray`` (``ray``): the keywords that are ``SourceSpec``'s, ``Sharding``'s
    (``pack_ray``: no ``shard_index``) and ``OnRay``'s fields make those; the
    others are ``PackOptions``' (``pack_options``: an unknown one is a TypeError
    naming it)."""
    rest = dict(settings)
    source = _take(SourceSpec, rest)
    sharding = _take(Sharding, rest, without=("shard_index",) if ray else ()) if sharded or ray else None
    on_ray = _take(OnRay, rest) if ray else None
    return PackRequest(src, dst, source, pack_options(options, rest), sharding, on_ray)

"""Pack a sharded pack on a Ray cluster: one task per shard (needs Ray: the ``ray`` extra).

The driver (the machine that runs ``lmdbfolder pack --ray`` or ``pack_ray``)
scans the source once, puts the sample list in Ray's object store and starts
one task per shard. Each task runs ``lmdbfolder.write.shards.pack_shard``: the
ordinary writer on its slice of the list, so an interrupted shard resumes
from its last commit when the command is run again, finished shards are kept,
bad files are skipped and reported (or, with ``strict``, stop that shard with
an error naming the file). Tasks report progress to a small actor that the
driver polls for its progress bar. When every task has finished, the driver
checks the shards and writes ``index.json`` (``write_index``).

Requirements on a real cluster: the source and the destination are paths
every node sees (a shared file system), and lmdbfolder is installed on every
node (same version). LMDB must not be written over NFS and the like; pass
``staging`` (``--staging DIR``, a node-local disk) so each shard is built
locally and copied into the destination when finished.

Ray is imported only when ``pack_ray`` runs, so ``import lmdbfolder`` never
needs it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from lmdbfolder.errors import LmdbFolderError, PackError
from lmdbfolder.progress import Progress
from lmdbfolder.text import printable
from lmdbfolder.write import planner
from lmdbfolder.write.options import PackOptions
from lmdbfolder.write.planner import Kind, OnRay, Plan, import_ray, request_from_settings
from lmdbfolder.write.shards import (
    ShardedPackResult,
    ShardResult,
    finished_sharded_pack,
    pack_shard,
    plan_sharded_output,
    plan_split,
    shard_name,
    sources_digest,
    write_index,
)
from lmdbfolder.write.sources import SourceList
from lmdbfolder.write.writer import warn_skipped

__all__ = ["pack_ray"]

#: Seconds between a task's progress reports (and the driver's polls).
REPORT_EVERY = 0.5


class _Tracker:
    """Ray actor: how many source files each shard task has handled."""

    def __init__(self) -> None:
        self.done: dict[int, int] = {}

    def report(self, shard: int, done: int) -> None:
        self.done[shard] = max(done, self.done.get(shard, 0))

    def total(self) -> int:
        return sum(self.done.values())


def _pack_shard_task(
    sources: SourceList,
    dst: str,
    index: int,
    num_shards: int,
    options: PackOptions,
    shard_args: dict[str, Any],
    tracker: Any,
) -> ShardResult:
    """One Ray task: pack shard ``index`` with the ordinary writer, reporting progress to ``tracker``."""
    last = [0.0]

    def report(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] >= REPORT_EVERY:
            last[0] = now
            tracker.report.remote(index, done)

    result = pack_shard(sources, dst, index, num_shards, options, on_progress=report, **shard_args)
    tracker.report.remote(index, result.sources)
    return result


def pack_ray(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    options: PackOptions | None = None,
    **settings: Any,
) -> ShardedPackResult:
    """Pack ``src`` into the sharded pack ``dst`` with one Ray task per shard.

    Keywords (``settings``):
        address: the Ray cluster (``"auto"``, ``"ray://head:10001"``, ...).
            If Ray is already initialised in this process, that cluster is
            used; otherwise ``ray.init(address, **init_kwargs)`` is called
            (``None``: ``RAY_ADDRESS``, or a new local cluster) and shut down
            at the end.
        task_cpus: CPUs Ray reserves for each shard task (default 1).
        init_kwargs: ``ray.init``'s other keywords.
        on_progress: called with ``(source files done, total)`` as tasks report.
        staging: a node-local directory to build each shard in (see ``pack_shard``).
        shards, shard_size, prefix, layout, list_file, allow_empty, extensions,
            is_valid_file, match: those of ``lmdbfolder.pack_sharded``, with the
            same meaning.
        the ``PackOptions`` fields: those of ``lmdbfolder.pack``; ``workers``
            (readers per task) defaults to 2 per reserved CPU, at least 4
            (threads, since a Ray worker process runs threads of its own).

    Rerunning after an interruption or a failed task keeps finished shards
    and resumes the others. If shards fail, the others still finish, and the
    first error is raised naming how many failed.

    Example:
        >>> from lmdbfolder.write.ray import pack_ray
        >>> pack_ray("/shared/imagenet/train", "/shared/train", shard_size="4GB", address="auto")  # doctest: +SKIP
    """
    return execute_ray(planner.plan(request_from_settings(src, dst, options, settings, ray=True)))


def execute_ray(planned: Plan) -> ShardedPackResult:
    """The executor of ``Kind.RAY``: the shards not finished yet as Ray tasks, then the index,
    then the ``SkippedFilesWarning``."""
    if planned.kind is not Kind.RAY or planned.request.ray is None:
        raise ValueError(f"execute_ray runs Ray plans, not a {planned.kind.value} plan")
    ray, on_ray = import_ray(), planned.request.ray
    sharding, opts, sources = planned.sharding, planned.options, planned.sources
    done = finished_sharded_pack(
        sources, planned.dst, opts, sharding.shards, sharding.shard_size, None, sharding.prefix, planned.start_time
    )
    if done is not None:
        return done
    num, dst = plan_sharded_output(
        sources, planned.dst, opts, sharding.shards, sharding.shard_size, None, sharding.prefix
    )
    task_opts = opts.replace(
        workers=opts.workers if opts.workers is not None else max(4, int(2 * on_ray.task_cpus)),
        overwrite=False,
        progress=False,
    )
    staging = sharding.staging
    shard_args: dict[str, Any] = dict(
        prefix=sharding.prefix,
        digest=sources_digest(sources),
        staging=None if staging is None else os.path.abspath(os.path.expanduser(os.fspath(staging))),
    )
    started = not ray.is_initialized()
    if started:
        ray.init(address=on_ray.address, **(on_ray.init_kwargs or {}))
    try:
        results = _run_tasks(ray, _Tasks(sources, dst, num, task_opts, shard_args, on_ray), opts.progress)
    finally:
        if started:
            ray.shutdown()
    index = write_index(dst, prefix=sharding.prefix)
    result = ShardedPackResult(dst, index.count, results, time.perf_counter() - planned.start_time, opts.store)
    warn_skipped(result.skipped, "each shard's skipped.txt", stacklevel=4)
    return result


@dataclass(frozen=True)
class _Tasks:
    """What the shard tasks of one run share: the sample list, the prepared ``dst``, the
    number of shards, the options and ``pack_shard`` keywords of each task, the cluster."""

    sources: SourceList
    dst: str
    num: int
    options: PackOptions
    shard_args: dict[str, Any]
    on_ray: OnRay


def _run_tasks(ray: Any, tasks: _Tasks, progress: bool | None) -> list[ShardResult]:
    """Start one task per shard, follow them with a progress bar, and return their results
    in shard order; the first error (naming how many failed) once every task has ended."""
    sources, num, shard_args, on_progress = tasks.sources, tasks.num, tasks.shard_args, tasks.on_ray.on_progress
    tracker = ray.remote(num_cpus=0)(_Tracker).remote()
    task = ray.remote(num_cpus=tasks.on_ray.task_cpus)(_pack_shard_task)
    sources_ref = ray.put(sources)  # one copy in the object store, fetched once per node
    refs = {task.remote(sources_ref, tasks.dst, i, num, tasks.options, shard_args, tracker): i for i in range(num)}
    pending = list(refs)
    results: dict[int, ShardResult] = {}
    errors: dict[int, LmdbFolderError] = {}
    total = len(sources)
    shown = 0
    try:
        with Progress(total, f"pack {num} shards (Ray)", enabled=progress) as bar:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1, timeout=REPORT_EVERY)
                for ref in ready:
                    i = refs[ref]
                    try:
                        results[i] = ray.get(ref)
                    except Exception as exc:  # a RayTaskError wrapping the task's exception, or a Ray failure
                        errors[i] = _as_error(exc, shard_name(shard_args["prefix"], i, num))
                        bar.write(f"shard {i} failed: {errors[i].message}")
                done = ray.get(tracker.total.remote())
                if not pending and not errors:
                    # Reports from tasks reach the tracker asynchronously; once every
                    # task has returned, all sources are done whatever it has seen.
                    done = total
                bar.update(done - shown)
                shown = done
                if on_progress is not None:
                    on_progress(done, total)
    except KeyboardInterrupt:
        for ref in pending:
            ray.cancel(ref)  # the writers stop; each keeps its last commit, so a rerun resumes
        raise
    if errors:
        first = min(errors)
        error = errors[first]
        if len(errors) > 1:
            names = ", ".join(shard_name(shard_args["prefix"], i, num) for i in sorted(errors))
            error.message += f" ({len(errors)} of {num} shards failed: {names})"
            error.args = (error.message,)
        error.hint = (error.hint + "; " if error.hint else "") + (
            "finished shards are kept: rerun the same command to resume the others"
        )
        raise error
    # Shards that were already finished were kept; the ranges are the plan's.
    for i, (lo, hi) in enumerate(plan_split(total, num)):
        if results[i].sources != hi - lo:
            raise PackError(f"shard {i} reports {results[i].sources} sources, the plan says {hi - lo}")
    return [results[i] for i in range(num)]


def _as_error(exc: Exception, name: str) -> LmdbFolderError:
    """The error to raise for the shard task ``name`` that failed with ``exc``: the task's
    own lmdbfolder error, else a PackError naming the exception the task raised (its type,
    message and where it was raised), not Ray's wrapper of it."""
    cause = getattr(exc, "cause", None)
    error = cause if isinstance(cause, LmdbFolderError) else exc
    if isinstance(error, LmdbFolderError):
        error.message += f" (packing {name})"
        error.args = (error.message,)
        return error
    raised = cause if isinstance(cause, BaseException) else exc
    text = " ".join(str(raised).split())  # one line: a message may hold newlines
    # Ray's error (a subclass of both RayTaskError and the cause's type) prints the task's traceback.
    where = _raised_at(getattr(exc, "traceback_str", None) or str(exc)) if raised is not exc else None
    return PackError(
        f"the Ray task packing {name} failed: {type(raised).__name__}"
        + (f": {printable(text, 500)}" if text else "")
        + (f" (raised at {printable(where, 300)})" if where else ""),
        "see the Ray logs for the whole traceback",  # _run_tasks adds how to resume
    )


def _raised_at(traceback_text: Any) -> str | None:
    """``file, line N, in function`` of the innermost frame of a formatted traceback."""
    if not isinstance(traceback_text, str):
        return None
    frames = [line.strip() for line in traceback_text.splitlines() if line.strip().startswith('File "')]
    if not frames:
        return None
    return frames[-1].removeprefix("File ").replace('"', "", 2)

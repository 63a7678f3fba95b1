"""Which executor runs each kind of plan (``write.planner``): the one table, and ``execute``.

The Python entry points each build their request and call the executor of
the only kinds their request can plan (``pack``: ``writer.execute_single``;
``pack_sharded``: ``shards.execute_sharded``; ``pack_ray``: ``ray.execute_ray``;
``dry_run``: ``dryrun.execute_dry_run``). The command line's ``pack`` can ask
for any of them, so it runs its request through ``execute``.
"""

from __future__ import annotations

from typing import Any, Callable

from lmdbfolder.write import planner
from lmdbfolder.write.dryrun import execute_dry_run
from lmdbfolder.write.planner import Kind, PackRequest, Plan
from lmdbfolder.write.ray import execute_ray
from lmdbfolder.write.shards import execute_sharded
from lmdbfolder.write.writer import execute_single

__all__ = ["EXECUTORS", "execute"]

#: The executor of each kind of plan.
EXECUTORS: dict[Kind, Callable[[Plan], Any]] = {
    Kind.SINGLE: execute_single,
    Kind.UPDATE: execute_single,
    Kind.SHARDED: execute_sharded,
    Kind.UPDATE_SHARDED: execute_sharded,
    Kind.RAY: execute_ray,
    Kind.DRY_RUN: execute_dry_run,
}


def execute(request: PackRequest) -> tuple[Plan, Any]:
    """Plan ``request`` and run the plan: ``(the plan, its executor's result)`` (a
    ``PackResult``, a ``ShardedPackResult`` or a ``DryRun``, as the plan's kind says)."""
    planned = planner.plan(request)
    return planned, EXECUTORS[planned.kind](planned)

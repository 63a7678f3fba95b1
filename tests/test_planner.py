"""The pack planner: one request, one plan, one executor per kind (docs/design.md, "The pack planner")."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmdbfolder.errors import OptionError
from lmdbfolder.write.executors import EXECUTORS
from lmdbfolder.write.options import PackOptions
from lmdbfolder.write.planner import Kind, OnRay, PackRequest, Sharding, plan, request_from_settings
from lmdbfolder.write.shards import pack_sharded


def test_every_kind_has_an_executor() -> None:
    assert set(EXECUTORS) == set(Kind)


def test_the_kind_of_each_request(small_tree: Path, small_pack: Path, tmp_path: Path) -> None:
    new = tmp_path / "new"
    assert plan(PackRequest(small_tree, new)).kind is Kind.SINGLE
    assert plan(PackRequest(small_tree, new, dry_run=True)).kind is Kind.DRY_RUN
    assert plan(PackRequest(small_tree, new, sharding=Sharding(shards=2))).kind is Kind.SHARDED
    assert plan(PackRequest(small_tree, new, sharding=Sharding(shards=2), ray=OnRay())).kind is Kind.RAY
    updating = PackOptions(update=True, check="content")
    assert plan(PackRequest(small_tree, small_pack, options=updating)).kind is Kind.UPDATE
    # An update of nothing is a pack, with the options of a new one.
    planned = plan(PackRequest(small_tree, new, options=updating))
    assert planned.kind is Kind.SINGLE and planned.options == PackOptions(check="header")
    assert len(planned.sources) == 12


def test_an_update_of_a_sharded_pack(small_tree: Path, tmp_path: Path) -> None:
    dst = tmp_path / "sh"
    pack_sharded(small_tree, dst, shards=2, progress=False)
    updating = PackOptions(update=True)
    assert plan(PackRequest(small_tree, dst, options=updating, sharding=Sharding())).kind is Kind.UPDATE_SHARDED
    assert plan(PackRequest(small_tree, dst, options=updating, update_as_packed=True)).kind is Kind.UPDATE_SHARDED
    with pytest.raises(OptionError, match="is a sharded pack"):
        plan(PackRequest(small_tree, dst, options=updating))


def test_combinations_no_executor_runs_are_refused_before_the_scan(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-source"  # a scan would fail otherwise
    updating = PackOptions(update=True)
    with pytest.raises(OptionError, match="cannot preview update=True"):
        plan(PackRequest(missing, tmp_path / "d", options=updating, dry_run=True))
    with pytest.raises(OptionError, match="drop --ray|drop ray"):
        plan(PackRequest(missing, tmp_path / "d", options=updating, sharding=Sharding(shards=2), ray=OnRay()))
    with pytest.raises(OptionError, match="packs every shard"):
        plan(PackRequest(missing, tmp_path / "d", sharding=Sharding(shards=2, shard_index=0), ray=OnRay()))


def test_the_keywords_of_pack_sharded_and_pack_ray_make_the_request(tmp_path: Path) -> None:
    request = request_from_settings(
        "src", "dst", None, {"shards": 4, "match": "^a", "store": "raw", "max_size": 64}, sharded=True
    )
    assert request.sharding == Sharding(shards=4)
    assert request.source.match == "^a"
    assert request.options.store == "raw" and request.options.resize is not None
    assert request.ray is None
    on_ray = request_from_settings("src", "dst", None, {"address": "auto", "task_cpus": 2.0}, ray=True)
    assert on_ray.ray == OnRay(address="auto", task_cpus=2.0) and on_ray.sharding == Sharding()
    with pytest.raises(TypeError, match="unexpected pack option 'shard_index'"):
        request_from_settings("src", "dst", None, {"shard_index": 1}, ray=True)  # pack_ray packs every shard
    with pytest.raises(TypeError, match="unexpected pack option 'address'"):
        request_from_settings("src", "dst", None, {"address": "auto"}, sharded=True)

"""Proof by test: ExactDistributedSampler under real torch.distributed (gloo) ranks.

World sizes 1, 2, 3 and 4 run as separate processes (like torchrun), each rank
reading a sharded pack through LMDBFolder and a StatefulDataLoader with real
worker processes (several counts; fork, and spawn in the slow matrix). Across ranks, every sample
is seen exactly once per epoch, or with padding exactly the reported number of
extra times, or with drop_last exactly the reported number fewer; the pixels
of every sample are right; and a run interrupted mid-epoch and resumed from
its checkpoint sees exactly the samples, in exactly the order, of an
uninterrupted run. The per-epoch counts are printed as a table
(``pytest -s tests/test_distributed.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import make_small_tree, run_ranks
from lmdbfolder.write.shards import pack_sharded

HERE = Path(__file__).resolve().parent
# 5 x 11 = 55 samples: not a multiple of 2, 3 or 4, so every world size > 1 has a remainder.
CLASSES, PER_CLASS = 5, 11


def _run_world(world: int, spec: dict[str, Any], tmp_path: Path) -> None:
    run_ranks(HERE / "_ddp_worker.py", world, spec, tmp_path / f"spec-{world}.json")


def _check(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        where = json.dumps(row)
        assert row["wrong_pixels"] == 0, where
        assert row["resume_equal"] and row["as_planned"], where
        assert row["per_rank"] == [row["num_samples"]], where  # every rank the same number of samples
        n = row["dataset"]
        if row["remainder"] == "pad":
            assert row["missing"] == 0 and row["duplicated"] == row["reported_padded"], where
            assert row["seen"] == n + row["reported_padded"], where
        else:
            assert row["duplicated"] == 0 and row["missing"] == row["reported_dropped"], where
            assert row["seen"] == n - row["reported_dropped"], where


def _table(rows: list[dict[str, Any]]) -> str:
    head = "world workers context order    remainder epoch seen missing duplicated reported resume"
    lines = [head]
    for r in rows:
        reported = r["reported_padded"] if r["remainder"] == "pad" else r["reported_dropped"]
        lines.append(
            f"{r['world']:>5} {r['workers']:>7} {r['context']:>7} {r['order']:<8} {r['remainder']:<9} "
            f"{r['epoch']:>5} {r['seen']:>4} {r['missing']:>7} {r['duplicated']:>10} {reported:>8} "
            f"{('exact' if r['resume_equal'] else 'DIFFERS') if r['resumed'] else '-':>6}"
        )
    return "\n".join(lines)


def _configs(world: int, slow: bool) -> list[dict[str, Any]]:
    base = {"batch": 4, "seed": 11, "epochs": 2, "stop_after": 3}
    if slow:
        return [
            dict(base, workers=w, drop_last=d, order=o, context="fork", epochs=3)
            for w in (0, 1, 2, 4)
            for d in (False, True)
            for o in ("random", "shards")
        ] + [
            dict(base, workers=2, drop_last=d, order=o, context="spawn")
            for d, o in ((False, "random"), (True, "shards"))
        ]
    return [
        dict(base, workers=0, drop_last=False, order="random"),
        dict(base, workers=2, drop_last=True, order="random", context="fork"),
        dict(base, workers=1, drop_last=world % 2 == 0, order="shards", context="fork"),
    ]


@pytest.fixture(scope="module")
def sharded_pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ddp")
    tree = make_small_tree(root / "tree", classes=CLASSES, per_class=PER_CLASS)
    pack_sharded(tree, root / "sharded", shards=3, progress=False)
    return root / "sharded"


def _run_matrix(sharded_pack: Path, tmp_path: Path, worlds: list[int], slow: bool) -> list[dict[str, Any]]:
    out = tmp_path / "rows.jsonl"
    for world in worlds:
        spec = {"pack": str(sharded_pack), "out": str(out), "configs": _configs(world, slow)}
        _run_world(world, spec, tmp_path)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    print("\n" + _table(rows))
    return rows


@pytest.mark.long("about 1 min on 2 cores (2 min on a busy machine): real gloo ranks, world sizes 1-4, 0-2 workers")
def test_every_sample_once_per_epoch_across_ranks_and_exact_resume(sharded_pack: Path, tmp_path: Path) -> None:
    worlds = [1, 2, 3, 4]
    rows = _run_matrix(sharded_pack, tmp_path, worlds, slow=False)
    assert sorted({r["world"] for r in rows}) == worlds
    assert {r["workers"] for r in rows} == {0, 1, 2}
    assert len(rows) == sum(len(_configs(w, False)) * 2 for w in worlds)
    assert all(r["resumed"] for r in rows if r["epoch"] == 1)
    _check(rows)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_full_matrix(sharded_pack: Path, tmp_path: Path) -> None:
    rows = _run_matrix(sharded_pack, tmp_path, [1, 2, 3, 4], slow=True)
    _check(rows)

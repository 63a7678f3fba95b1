"""ExactDistributedSampler under a training framework that manages samplers itself.

PyTorch Lightning's Trainer (``use_distributed_sampler=True``, its default) replaces
the sampler of a distributed job's DataLoader with its own wrapper, which splits
the indices our sampler yields between the ranks once more, unless the sampler is a
``torch.utils.data.DistributedSampler`` (lightning/pytorch/trainer/connectors/
data_connector.py, ``_requires_distributed_sampler``). Split twice, every rank
trained on half of its share, silently: half of each epoch was never seen.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.data import DistributedSampler

from conftest import free_port, make_small_tree
from lmdbfolder import pack
from lmdbfolder.sampler import ExactDistributedSampler

HERE = Path(__file__).resolve().parent


def test_the_sampler_is_a_distributed_sampler_with_its_attributes() -> None:
    # What frameworks look at: the type, and the attributes torch's sampler has.
    sampler = ExactDistributedSampler(range(10), num_replicas=3, rank=1, shuffle=False, seed=5)
    assert isinstance(sampler, DistributedSampler)
    assert (sampler.num_replicas, sampler.rank, sampler.shuffle, sampler.seed, sampler.drop_last) == (
        3,
        1,
        False,
        5,
        False,
    )
    assert (sampler.num_samples, sampler.total_size, sampler.epoch) == (4, 12, 0)
    assert list(sampler) == list(DistributedSampler(range(10), num_replicas=3, rank=1, shuffle=False))


@pytest.mark.timeout(600)
def test_a_lightning_ddp_job_trains_on_every_sample_of_each_epoch_once(tmp_path: Path) -> None:
    pytest.importorskip("lightning")  # pinned in requirements-test.txt: always there under `make test`
    tree = make_small_tree(tmp_path / "tree", classes=3, per_class=7)  # 21 samples: 2 ranks pad one
    pack(tree, tmp_path / "pack", progress=False)
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    env.pop("RAY_ADDRESS", None)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        str(HERE / "_lightning_worker.py"), str(tmp_path / "pack"), str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    for epoch in ("0", "1"):
        seen = ranks[0]["seen"][epoch] + ranks[1]["seen"][epoch]
        assert sorted(set(seen)) == list(range(21)), epoch  # every sample, each epoch
        assert len(seen) == 22  # 21 on 2 ranks: one sample repeated, as describe() says
    for r, result in enumerate(ranks):
        assert result["sampler_kept"], (r, result["sampler_type"])
        for epoch in ("0", "1"):
            assert result["seen"][epoch] == result["planned"][epoch], (r, epoch)  # in the sampler's order

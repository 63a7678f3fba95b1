"""One rank of tests/test_trainers.py's Lightning run (not collected by pytest).

Run under torchrun (``python -m torch.distributed.run --nproc_per_node 2
_lightning_worker.py PACK OUT_DIR``), as a Lightning DDP job on a cluster is: the
Trainer finds torchrun's environment and launches nothing itself. The DataLoader
is built as docs/distributed.md says, with ExactDistributedSampler,
and the Trainer keeps its default ``use_distributed_sampler=True``. Each rank
writes which samples its training steps saw, per epoch, and which the sampler
planned for it, to ``OUT_DIR/rank-<r>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from lmdbfolder.sampler import ExactDistributedSampler
from lmdbfolder.torch import LMDBFolder

EPOCHS = 2


class Indexed(LMDBFolder):
    """LMDBFolder whose target is the sample's index, to see which samples a step got."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, _ = super().__getitem__(index)
        return torch.tensor(image.size), index


class Recorder(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: dict[int, list[int]] = {}

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.setdefault(self.current_epoch, []).extend(batch[1].tolist())
        return (self.weight * batch[0].float().sum()).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def main(pack: str, out_dir: str) -> None:
    ds = Indexed(pack)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # Lightning starts the process group only in fit(): the sampler is given the rank
    # and world size the Trainer read from torchrun's environment.
    rank, world = trainer.global_rank, trainer.world_size
    sampler = ExactDistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=3)
    loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2)
    model = Recorder()
    trainer.fit(model, loader)
    planned = {epoch: sampler.indices(epoch) for epoch in range(EPOCHS)}
    used = trainer.train_dataloader.sampler if trainer.train_dataloader is not None else None
    result = {
        "seen": {str(e): v for e, v in model.seen.items()},
        "planned": {str(e): v for e, v in planned.items()},
        "sampler_kept": used is sampler,
        "sampler_type": type(used).__name__,
    }
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""A 2-rank DDP fit on CPU with the Lightning callback, run as a script (Lightning's DDP launcher starts rank 1 by
running this file again). Rank 0 writes what its monitor counted as JSON to argv[1]; argv[2] is the nvidia-smi.

Each rank takes 5 steps of 8 samples per epoch (80 samples over 2 ranks), sleeping a little per step so that an
epoch spans several nvidia-smi samples.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import lightning as L
import torch

from smiquery.training.lightning import GpuMonitor


class Tiny(L.LightningModule):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        time.sleep(0.1)
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.02)


def main(out: str, nvidia_smi: str) -> None:
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.rand(80, 4, generator=g), torch.rand(80, 1, generator=g))
    # one GPU per rank, as `devices=2` on a GPU host would use
    monitor = GpuMonitor(interval=0.05, alerts=(), nvidia_smi=nvidia_smi, framework_memory=False, gpus=[0, 1])
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        callbacks=[monitor],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(Tiny(), torch.utils.data.DataLoader(ds, batch_size=8))
    if trainer.global_rank == 0:
        totals = monitor.monitor.totals
        doc = {"epochs": monitor.epochs, "steps": totals.steps, "samples": totals.samples, "world": trainer.world_size}
        with open(out, "w", encoding="utf-8") as fh:
            json.dump(doc, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

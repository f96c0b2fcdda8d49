"""A module built in configure_model() that cannot be initialised: the setup error must reach the
user, not the teardown's failure to move the half-built module (launched as a script: popen)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L
import torch
from torch import nn

from lightning_pipe import PipelineStrategy
from tests.models import CLASSES, IN, loader


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(IN, IN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = None

    def configure_model(self) -> None:
        if self.layers is None:
            self.layers = nn.Sequential(nn.Linear(IN, IN), NoReset(), nn.Linear(IN, CLASSES))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return nn.functional.cross_entropy(self.layers(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=PipelineStrategy(), max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    trainer.fit(Net(), loader())

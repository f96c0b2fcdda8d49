"""Tiny models and data shared by the tests (importable by spawned processes)."""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

IN, HIDDEN, CLASSES = 6, 8, 3


def make_layers(depth: int = 8, dropout: float = 0.0) -> nn.Sequential:
    """``depth`` layers: Linear/Tanh pairs (a Dropout among them when asked), ending in a Linear."""
    layers: list[nn.Module] = [nn.Linear(IN, HIDDEN)]
    while len(layers) < depth - 1:
        layers.append(nn.Tanh() if dropout == 0.0 or len(layers) % 4 != 1 else nn.Dropout(dropout))
        if len(layers) < depth - 1:
            layers.append(nn.Linear(HIDDEN, HIDDEN))
    layers.append(nn.Linear(HIDDEN, CLASSES))
    return nn.Sequential(*layers)


class TinyNet(L.LightningModule):
    """An ordinary LightningModule: nothing in it knows about the pipeline."""

    def __init__(self, depth: int = 8, lr: float = 0.1, dropout: float = 0.0, optimizer: str = "sgd") -> None:
        super().__init__()
        self.layers = make_layers(depth, dropout)
        self.lr = lr
        self.optimizer = optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def dataset(n: int = 64, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN, generator=g)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return TensorDataset(x, y)


def loader(n: int = 64, batch_size: int = 12, seed: int = 0) -> DataLoader:
    return DataLoader(dataset(n, seed), batch_size=batch_size, shuffle=False)


def trainer_kwargs(max_steps: int = 6, **extra: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        max_steps=max_steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    kwargs.update(extra)
    return kwargs


def fit_plain(model: L.LightningModule, data: Optional[DataLoader] = None, **extra: Any) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", devices=1, **trainer_kwargs(**extra))
    trainer.fit(model, data if data is not None else loader())
    return trainer

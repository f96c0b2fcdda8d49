"""What a periodic checkpoint costs an elastic run: seconds per save of a small pipeline.

    python benchmarks/elastic_checkpoint.py [--width 1024] [--layers 8] [--saves 10]

Two CPU processes (2 stages, ``start_method="fork"``) train an MLP of ``layers`` Linear layers of
``width`` x ``width`` with SGD and momentum; after each training step every rank calls
``trainer.save_checkpoint`` (what ``ModelCheckpoint(every_n_train_steps=1)`` calls), timed on
global rank 0 from the call to its return (every stage's shard written, checksummed and published).
Prints the checkpoint's size and the median and range of the seconds per save.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from lightning_pipe import PipelineStrategy


class MLP(L.LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class TimeSaves(L.Callback):
    def __init__(self, folder: Path) -> None:
        self.folder, self.seconds = folder, []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        start = time.perf_counter()
        trainer.save_checkpoint(self.folder / f"step={trainer.global_step}.ckpt")
        self.seconds.append(time.perf_counter() - start)
        if trainer.is_global_zero:
            (self.folder / "seconds.json").write_text(json.dumps(self.seconds))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--saves", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, args.width), torch.randn(64, args.width)), batch_size=16)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=PipelineStrategy(start_method="fork", chunks=2),
            max_steps=args.saves, max_epochs=-1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[TimeSaves(folder)],
        )  # fmt: skip
        trainer.fit(MLP(args.width, args.layers), data)
        seconds = json.loads((folder / "seconds.json").read_text())
        last = folder / f"step={args.saves}.ckpt"
        size = sum(f.stat().st_size for f in last.rglob("*") if f.is_file())
    print(
        f"{args.layers} x Linear({args.width}, {args.width}), 2 stages: checkpoint {size / 2**20:.1f} MiB; "
        f"{statistics.median(seconds):.3f} s per save (median of {len(seconds)}, "
        f"{min(seconds):.3f} to {max(seconds):.3f})"
    )


if __name__ == "__main__":
    main()

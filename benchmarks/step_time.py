"""Median seconds per training step: 2-stage pipeline against plain single-process Lightning.

    python benchmarks/step_time.py --model tiny --steps 60
    python benchmarks/step_time.py --model mlp --width 1024 --blocks 8 --batch 256 --chunks 8

Both runs use one CPU thread per process. A step's time is taken on rank 0 from the end of the
previous step to the end of this one (loading the batch included), over the steps after a warm-up.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from lightning_pipe import PipelineStrategy


def workload_arguments(parser: argparse.ArgumentParser, rounds: int, steps: int) -> None:
    """The benchmark MLP's arguments (8 blocks of width 1024, batch 256 in 8 micro-batches, 2
    stages), and how many rounds, steps and warm-up steps to run."""
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--stages", type=int, default=2)


class StepTimer(L.Callback):
    """Seconds between the ends of consecutive optimizer steps, after ``warmup`` steps: everything a
    step costs (loading the batch and Lightning's work between steps included), as a user sees it.
    ``every`` is the number of batches per optimizer step (``accumulate_grad_batches``)."""

    def __init__(self, path: str, warmup: int, every: int = 1) -> None:
        self.path, self.warmup, self.every = path, warmup, every
        self.ends: list[float] = []

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        gc.collect()  # setup's garbage would otherwise be collected during a timed step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()  # the step's GPU work is part of its time
        self.ends.append(time.perf_counter())

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == 0:
            with open(self.path, "w") as f:
                json.dump(intervals(self.ends[self.every - 1 :: self.every], self.warmup), f)


def intervals(ends: list[float], warmup: int) -> list[float]:
    """Step times from the times steps ended, dropping the first ``warmup`` steps."""
    return [ends[i] - ends[i - 1] for i in range(max(warmup, 1), len(ends))]


class MLP(L.LightningModule):
    """``blocks`` blocks of ``Linear(width, width)`` and ReLU, and a head. With ``heavy > 1`` the
    first half of the blocks hold ``heavy`` such pairs each: a model whose costs are skewed
    ``heavy``:1 between its halves, so that a split by layer count is unbalanced."""

    def __init__(self, width: int, blocks: int, classes: int = 10, heavy: int = 1) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for index in range(blocks):
            pairs = heavy if index < blocks // 2 else 1
            layers += [nn.Sequential(*[m for _ in range(pairs) for m in (nn.Linear(width, width), nn.ReLU())])]
        layers.append(nn.Linear(width, classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def build(args: argparse.Namespace) -> tuple[L.LightningModule, DataLoader]:
    torch.manual_seed(0)
    if args.model == "tiny":
        from tests.models import IN, TinyNet

        model: L.LightningModule = TinyNet()
        x = torch.randn(args.batch * 8, IN)
        y = torch.randint(0, 3, (len(x),))
    else:
        model = MLP(args.width, args.blocks)
        x = torch.randn(args.batch * 8, args.width)
        y = torch.randint(0, 10, (len(x),))
    return model, DataLoader(TensorDataset(x, y), batch_size=args.batch, shuffle=False)


def run(args: argparse.Namespace, pipeline: bool, path: str) -> list[float]:
    model, data = build(args)
    common: dict[str, Any] = dict(
        max_steps=args.steps, max_epochs=-1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[StepTimer(path, args.warmup)],
    )  # fmt: skip
    if pipeline:
        strategy = PipelineStrategy(
            schedule=args.schedule, chunks=args.chunks, balance=args.balance, start_method="fork"
        )
        trainer = L.Trainer(accelerator="cpu", devices=args.stages, strategy=strategy, **common)
    else:
        trainer = L.Trainer(accelerator="cpu", devices=1, **common)
    trainer.fit(model, data)
    with open(path) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny", "mlp"], default="tiny")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--balance", default="parameters")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3, help="alternating plain / pipeline runs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tmp = f"/tmp/lightning_pipe_step_{os.getpid()}.json"
    plain: list[float] = []
    piped: list[float] = []
    for _ in range(args.rounds):
        plain += run(args, False, tmp)
        piped += run(args, True, tmp)
    result = {
        "config": vars(args),
        "plain_median_s": statistics.median(plain),
        "pipeline_median_s": statistics.median(piped),
        "ratio": statistics.median(piped) / statistics.median(plain),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

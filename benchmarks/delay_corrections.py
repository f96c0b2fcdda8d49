"""The delay corrections against 1F1B and plain PipeDream-2BW on the tests' MLP, final loss per seed.

    python benchmarks/delay_corrections.py   # 3 seeds, 2 lrs: benchmarks/results/delay_corrections.json
    python benchmarks/delay_corrections.py --seeds 0 --lrs 0.05 --epochs 4

Each run: the tests' MLP (``tests.models.EpochLossNet``, 8 layers) on the tests' separable task
(``separable_loader``: 96 samples, batches of 16, 6 steps an epoch), 2 CPU processes (2 stages), 4
micro-batches, the same initial weights and data per seed. The final loss is the last epoch's mean
training loss. Optimizers: SGD with momentum 0.9 at ``--lr``, except under ``delay_correction="nesterov"``,
which carries the momentum itself and runs with plain SGD (gamma 0.9), at the same lr and at the lr that
makes its long-run step equal SGD with momentum's (:data:`MATCHED`). Each lr of ``--lrs`` runs every row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch

from tests.models import EpochLossNet, RecordMetrics, separable_loader
from tests.pipeline import fit_pipeline

GAMMA = 0.9
#: Nesterov's correction at delay 1 steps by about ``g (1 + (gamma + gamma^2) / (1 - gamma))`` in the long run,
#: SGD with momentum by ``g / (1 - gamma)``: this factor on the lr makes the two equal
MATCHED = (1 / (1 - GAMMA)) / (1 + (GAMMA + GAMMA**2) / (1 - GAMMA))

#: label -> (schedule, delay correction, optimizer of EpochLossNet, factor on the lr)
RUNS: dict[str, tuple[str, str | None, str, float]] = {
    "1f1b": ("1f1b", None, "sgd", 1.0),
    "pipedream_2bw": ("pipedream_2bw", None, "sgd", 1.0),
    "pipedream_2bw + error_feedback": ("pipedream_2bw", "error_feedback", "sgd", 1.0),
    "pipedream_2bw + nesterov": ("pipedream_2bw", "nesterov", "plain-sgd", 1.0),
    f"pipedream_2bw + nesterov, lr x {MATCHED:.3f}": ("pipedream_2bw", "nesterov", "plain-sgd", MATCHED),
}


def final_loss(label: str, seed: int, lr: float, epochs: int) -> float:
    schedule, correction, optimizer, factor = RUNS[label]
    torch.manual_seed(seed)
    model = EpochLossNet(lr=lr * factor, optimizer=optimizer)
    options: dict[str, Any] = dict(schedule=schedule, chunks=4, max_steps=-1, max_epochs=epochs)
    if correction is not None:
        options["delay_correction"] = correction
    with tempfile.TemporaryDirectory() as folder:
        fit_pipeline(model, 2, separable_loader(), callbacks=[RecordMetrics(folder)], **options)
        return float(json.loads((Path(folder) / "rank0.json").read_text())["train_loss_epoch"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.05, 0.1])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results/delay_corrections.json")
    args = parser.parse_args()
    results: dict[str, dict[str, list[float]]] = {}
    for lr in args.lrs:
        mine = results[str(lr)] = {}
        for label in RUNS:
            mine[label] = [final_loss(label, seed, lr, args.epochs) for seed in args.seeds]
            print(f"lr {lr} {label:40s} " + " ".join(f"{x:.4f}" for x in mine[label]), flush=True)
    print("\n| lr | run | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean |")
    print("|---|---|" + "---|" * (len(args.seeds) + 1))
    for lr, mine in results.items():
        for label, losses in mine.items():
            row = " | ".join(f"{x:.4f}" for x in losses)
            print(f"| {lr} | {label} | {row} | {statistics.mean(losses):.4f} |")
    settings = {"seeds": args.seeds, "lrs": args.lrs, "epochs": args.epochs, "stages": 2, "chunks": 4, "gamma": GAMMA}
    Path(args.out).write_text(json.dumps({"settings": settings, "final_loss": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Final training loss of 1F1B and the asynchronous schedules on the 4-stage test MLP.

    python benchmarks/xpipe_convergence.py --lr 0.3 --out benchmarks/results/xpipe_mlp_lr0.3.json

The model is the test suite's MLP (``tests.models.TinyNet``: 8 layers, 4 stages of 2), SGD with
momentum 0.9, on its random data (``tests.models.dataset``: 64 samples by default, read for several
epochs, so the loss can fall by memorising them), one seed per run for the initial weights and the
data. For each schedule and seed: the final loss, the mean training loss over the last 10% of steps
(as in ``pipemare_convergence.py``), and the peak weight memory per stage in copies of the stage's
weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from pipemare_convergence import final_loss, train_recorded

from lightning_pipe import PipelineStrategy
from tests.models import TinyNet, dataset

SCHEDULES = ("1f1b", "pipedream", "pipedream_2bw", "pipemare", "xpipe", "wpipe")


def run(schedule: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = TinyNet(lr=args.lr)  # SGD with momentum 0.9
    samples = args.samples or args.batch * args.steps
    data = DataLoader(dataset(n=samples, seed=seed), batch_size=args.batch, shuffle=False)
    strategy = PipelineStrategy(schedule=schedule, chunks=args.chunks, start_method="fork")
    losses, copies = train_recorded(model, data, strategy, args.stages, args.steps)
    return {"schedule": schedule, "seed": seed, "final_loss": final_loss(losses), "losses": losses, "copies": copies}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=0.3)
    parser.add_argument("--seeds", type=str, default="0,1,2")
    parser.add_argument(
        "--samples",
        type=int,
        default=64,
        help="the dataset's size (the tests' 64, read for several epochs: learnable); 0: "
        "batch x steps fresh random samples, never repeated (nothing to learn)",
    )
    parser.add_argument("--out", type=str, default=None)
    args = parser.parse_args()
    runs = [run(s, int(seed), args) for s in SCHEDULES for seed in args.seeds.split(",")]
    print(
        "| schedule | " + " | ".join(f"seed {r['seed']}" for r in runs if r["schedule"] == SCHEDULES[0]) + " | mean |"
    )
    for schedule in SCHEDULES:
        finals = [r["final_loss"] for r in runs if r["schedule"] == schedule]
        cells = " | ".join(f"{v:.4f}" for v in finals)
        print(f"| {schedule} | {cells} | {sum(finals) / len(finals):.4f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()

"""Step time of pipeline x data-parallel layouts (stages x replicas) on the benchmark MLP.

    python benchmarks/layouts.py --layouts 2x1 2x2 4x1 --rounds 3
    python benchmarks/layouts.py --layouts 2x2 2x2:shard        # data_parallel="shard"

Every replica reads a DataLoader batch of ``--batch`` samples, so a step of ``p x d`` trains on
``d x batch`` samples. Layouts run in alternating rounds (one run of each per round); the median
step time (rank 0, after a warm-up, as ``step_time.py`` measures it) and samples per second are
printed as JSON. One CPU thread per process: more processes than cores are oversubscribed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.step_time import MLP, StepTimer
from lightning_pipe import PipelineStrategy


def run(args: argparse.Namespace, stages: int, replicas: int, mode: str, path: str) -> list[float]:
    torch.manual_seed(0)
    model = MLP(args.width, args.blocks)
    x = torch.randn(args.batch * replicas * (args.steps + 1), args.width)
    y = torch.randint(0, 10, (len(x),))
    data = DataLoader(TensorDataset(x, y), batch_size=args.batch, shuffle=False)
    strategy = PipelineStrategy(
        schedule=args.schedule, chunks=args.chunks, stages=stages, data_parallel=mode, start_method="fork"
    )
    common: dict[str, Any] = dict(
        max_steps=args.steps, max_epochs=-1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[StepTimer(path, args.warmup)],
    )  # fmt: skip
    L.Trainer(accelerator="cpu", devices=stages * replicas, strategy=strategy, **common).fit(model, data)
    with open(path) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=["2x1", "2x2", "4x1"], help="stages x replicas[:shard]")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tmp = f"/tmp/lightning_pipe_layouts_{os.getpid()}.json"
    times: dict[str, list[float]] = {layout: [] for layout in args.layouts}
    for _ in range(args.rounds):
        for layout in args.layouts:
            shape, _, mode = layout.partition(":")
            p, d = (int(n) for n in shape.split("x"))
            times[layout] += run(args, p, d, mode or "replicate", tmp)
    result = {
        "config": vars(args),
        "cpu_count": os.cpu_count(),
        "layouts": {
            name: {
                "median_step_s": statistics.median(values),
                "samples_per_s": args.batch * int(name.split(":")[0].split("x")[1]) / statistics.median(values),
                "steps_timed": len(values),
            }
            for name, values in times.items()
        },
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

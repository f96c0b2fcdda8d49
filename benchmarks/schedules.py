"""Steps per second of each schedule on the same CPU pipeline, plus the memory in weight versions.

    python benchmarks/schedules.py --stages 2 --batch 256 --chunks 8 --steps 30

Runs alternate between schedules (``--rounds`` times) so that machine drift hits all of them; each
reports the median step time on rank 0 after a warm-up, and the peak bytes each rank held in
stashed weight versions (asynchronous schedules only).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
from typing import Any

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from step_time import StepTimer, build

from lightning_pipe import PipelineStrategy


class VersionMemory(L.Callback):
    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        versions = trainer.strategy.pipeline.runner.versions
        params = sum(p.numel() * p.element_size() for p in trainer.lightning_module.parameters())
        with open(os.path.join(self.folder, f"mem{trainer.global_rank}.json"), "w") as f:
            json.dump({"version_bytes": versions.peak_bytes if versions else 0, "param_bytes": params}, f)


def run(args: argparse.Namespace, schedule: str, folder: str) -> tuple[list[float], list[dict[str, int]]]:
    model, data = build(args)
    timer_path = os.path.join(folder, "times.json")
    strategy = PipelineStrategy(schedule=schedule, chunks=args.chunks, balance=args.balance, start_method="fork")
    trainer = L.Trainer(
        accelerator="cpu", devices=args.stages, strategy=strategy, max_steps=args.steps, max_epochs=-1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[StepTimer(timer_path, args.warmup), VersionMemory(folder)],
    )  # fmt: skip
    trainer.fit(model, data)
    with open(timer_path) as f:
        times = json.load(f)
    memory = []
    for path in sorted(glob.glob(os.path.join(folder, "mem*.json"))):
        with open(path) as f:
            memory.append(json.load(f))
    return times, memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny", "mlp"], default="mlp")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--balance", default="parameters")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--schedules", default="1f1b,pipedream,pipedream_2bw")
    args = parser.parse_args()
    torch.set_num_threads(1)
    schedules = args.schedules.split(",")
    times: dict[str, list[float]] = {s: [] for s in schedules}
    memory: dict[str, list[dict[str, int]]] = {}
    for _ in range(args.rounds):
        for schedule in schedules:
            with tempfile.TemporaryDirectory() as folder:
                step_times, memory[schedule] = run(args, schedule, folder)
                times[schedule] += step_times
    result: dict[str, Any] = {"config": vars(args), "schedules": {}}
    for schedule in schedules:
        median = statistics.median(times[schedule])
        result["schedules"][schedule] = {
            "median_step_s": median,
            "steps_per_s": 1.0 / median,
            "version_bytes_per_rank": [m["version_bytes"] for m in memory[schedule]],
            "param_bytes_per_rank": [m["param_bytes"] for m in memory[schedule]],
        }
    base = result["schedules"][schedules[0]]["median_step_s"]
    for schedule in schedules:
        result["schedules"][schedule][f"speedup_vs_{schedules[0]}"] = (
            base / result["schedules"][schedule]["median_step_s"]
        )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

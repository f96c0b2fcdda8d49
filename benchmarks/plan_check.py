"""The planner's predictions against measured step times, on 2 CPU processes.

    python benchmarks/plan_check.py [--model mlp|vgg19] [--rounds 2] [--top 4]

Runs ``PipelineStrategy(plan="auto")`` once (which profiles, measures the link and ranks every
layout of the 2-stage pipeline: every synchronous schedule, ``virtual_stages`` included), then
trains the ``--top`` best layouts and a few more from the grid in alternating
rounds, and prints each layout's predicted and measured step time (median over the steps after
the warm-up, each round) and whether the planner's first choice is within 10% of the fastest.
"""

from __future__ import annotations

import argparse
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

import compare
from step_time import StepTimer

from lightning_pipe import PipelineStrategy


class KeepPlan(L.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 0:
            torch.save(trainer.strategy.plan_candidates, self.path)


def run(model: str, steps: int, warmup: int, folder: str, **strategy: Any) -> list[float]:
    spec = compare.MODELS[model]
    path = os.path.join(folder, "times.json")
    callbacks: list[L.Callback] = [StepTimer(path, warmup)]
    if strategy.get("plan") == "auto":
        callbacks.append(KeepPlan(os.path.join(folder, "plan.pt")))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=PipelineStrategy(start_method="fork", **strategy),
        max_steps=steps, max_epochs=-1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(compare.build_module(model), compare.data(model, spec["batch"], steps))
    with open(path) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mlp", choices=sorted(compare.MODELS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--top", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        auto_times = run(args.model, args.steps, args.warmup, folder, plan="auto")
        ranked = torch.load(os.path.join(folder, "plan.pt"), weights_only=False)
    print(f"{len(ranked)} layouts ranked; plan='auto' ran #1 at {1e3 * statistics.median(auto_times):.1f} ms/step")
    chosen = list(ranked[: args.top])
    others = [c for c in ranked[args.top :] if c.chunks in (1, 8) and c.recompute == "never"][:2]
    chosen += others
    measured: dict[int, list[float]] = {i: [] for i in range(len(chosen))}
    for round_ in range(args.rounds):
        order = range(len(chosen)) if round_ % 2 == 0 else reversed(range(len(chosen)))
        for i in order:
            with tempfile.TemporaryDirectory() as folder:
                times = run(args.model, args.steps, args.warmup, folder, **chosen[i].strategy_arguments())
            measured[i].append(statistics.median(times))
    rows = [
        "| rank | schedule | v | chunks | balance | recompute | predicted ms | measured ms | measured / predicted |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    fastest = min(statistics.median(v) for v in measured.values())
    for i, c in enumerate(chosen):
        m = statistics.median(measured[i])
        rows.append(
            f"| {ranked.index(c) + 1} | {c.schedule} | {c.virtual_stages} | {c.chunks} | {c.balance_mode} "
            f"{list(c.balance)} | {c.recompute} | {1e3 * c.step_seconds:.1f} | {1e3 * m:.1f} "
            f"({', '.join(f'{1e3 * t:.1f}' for t in measured[i])}) | {m / c.step_seconds:.2f} |"
        )
    print("\n".join(rows))
    first = statistics.median(measured[0])
    print(f"first choice {1e3 * first:.1f} ms vs fastest measured {1e3 * fastest:.1f} ms: {first / fastest:.2f}x")


if __name__ == "__main__":
    main()

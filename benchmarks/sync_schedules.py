"""The synchronous schedules side by side: step time, measured bubble against the simulated one,
and the activation memory each rank holds.

    python benchmarks/sync_schedules.py                      # the benchmark MLP, 2 processes
    python benchmarks/sync_schedules.py --rounds 9 --schedules 1f1b,zero_bubble

Each round runs every schedule once, in alternating order, on the benchmark MLP (8 blocks of
width 1024 and a head, batch 256 in 8 micro-batches, ``balance="parameters"`` over the schedule's
stages) with 2 CPU processes, one thread each. Per run:

- the step time on rank 0 (end of one optimizer step to the end of the next, after the warm-up);
- from the executor's timeline, per rank, the measured bubble: the share of the executor's step
  that is not forward, B or W compute (waiting, posting communication, idle);
- the simulated bubble of the same schedule played with the measured median F, B and W time of
  each stage (what the schedule would leave idle if communication were free);
- per rank, the peak bytes of activations held for the backward: tensors autograd saves, plus,
  for split backwards, what the deferred weight-gradient work keeps from B until W.

Ratios are taken per round (paired), the median reported; the machine's speed drifts, so only
ratios from the same round mean much. Writes ``--out``/sync_schedules.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from step_time import MLP, StepTimer, workload_arguments

from lightning_pipe import PipelineStrategy
from lightning_pipe.runtime.activations.meter import SavedActivationMeter
from lightning_pipe.runtime.stage import StageRunner
from lightning_pipe.schedules import build, simulate

COMPUTE = ("F", "B", "W")


def work_bytes(runners: list[StageRunner]) -> int:
    """Bytes of the tensors the deferred weight-gradient work of every runner keeps for W."""
    seen: set[tuple[int, int]] = set()  # as the meter counts: a tensor's own bytes, once
    for runner in runners:
        for works in runner.weights_due.values():
            for work in works:
                for arg in getattr(work, "args", ()):
                    if isinstance(arg, Tensor) and not isinstance(arg, torch.nn.Parameter):
                        seen.add((arg.data_ptr(), arg.numel() * arg.element_size()))
    return sum(nbytes for _, nbytes in seen)


class Record(L.Callback):
    """Per rank: the timeline's spans after the warm-up and the activation memory peak."""

    def __init__(self, folder: str, warmup: int) -> None:
        self.folder, self.warmup = folder, warmup
        self.peak = 0

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        self.timeline = strategy.enable_timeline()
        runners = list(strategy.pipeline.runners.values())
        meter = SavedActivationMeter(pl_module.parameters())
        for runner in runners:
            runner.meter = meter
            for name in ("forward", "backward", "backward_input", "backward_weight"):
                setattr(runner, name, self._watched(getattr(runner, name), meter, runners))

    def _watched(
        self, method: Callable[..., Any], meter: SavedActivationMeter, runners: list[StageRunner]
    ) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            out = method(*args)
            self.peak = max(self.peak, meter.peak, meter.current + work_bytes(runners))
            return out

        return run

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        steps = [[(s.name, s.stage, s.seconds) for s in spans] for spans in self.timeline.steps[self.warmup :]]
        with open(os.path.join(self.folder, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"steps": steps, "peak_bytes": self.peak}, f)


def run_one(schedule: str, args: argparse.Namespace, folder: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = MLP(args.width, args.blocks)
    x, y = torch.randn(args.batch * 4, args.width), torch.randint(0, 10, (args.batch * 4,))
    data = DataLoader(TensorDataset(x, y), batch_size=args.batch)
    times = os.path.join(folder, "times.json")
    trainer = L.Trainer(
        accelerator="cpu", devices=args.stages, max_steps=args.steps, max_epochs=-1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        strategy=PipelineStrategy(schedule=schedule, chunks=args.chunks, balance="parameters", start_method="fork"),
        callbacks=[StepTimer(times, args.warmup), Record(folder, args.warmup)],
    )  # fmt: skip
    trainer.fit(model, data)
    ranks = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(args.stages)]
    return {"step_s": json.loads(Path(times).read_text()), "ranks": ranks}


def analyse(schedule: str, result: dict[str, Any], stages: int, chunks: int) -> dict[str, Any]:
    """Measured bubble per rank, the simulated one from the measured stage costs, memory per rank."""
    per_stage: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    bubbles, executor = [], []
    for rank in result["ranks"]:
        shares, steps = [], []
        for spans in rank["steps"]:
            step = next(sec for name, _, sec in spans if name == "step")
            steps.append(step)
            busy = sum(sec for name, _, sec in spans if name in COMPUTE)
            shares.append(1.0 - busy / step)
            for name, stage, sec in spans:
                if name in COMPUTE:
                    per_stage[stage][name].append(sec)
        bubbles.append(statistics.median(shares))
        executor.append(statistics.median(steps))
    # median action time per stage, scaled to one step's worth of micro-batches
    costs = [
        tuple(statistics.median(per_stage[s][k]) if per_stage[s][k] else 0.0 for k in COMPUTE)
        for s in sorted(per_stage)
    ]
    schedule_obj = build(schedule, stages, chunks, len(costs) // stages)
    simulated = simulate(schedule_obj, stage_costs=costs, rendezvous=False)
    return {
        "median_step_s": statistics.median(result["step_s"]),
        "measured_bubble_per_rank": bubbles,
        # the executor's share of the step (the schedule's actions); the rest is outside it: the
        # gradients' hand-over (sums over ranks), the optimizer step, Lightning's work between steps
        "executor_step_ms_per_rank": [1e3 * e for e in executor],
        "simulated_bubble": simulated.bubble_fraction,
        "stage_costs_ms": [[round(1e3 * c, 2) for c in stage] for stage in costs],
        "peak_activation_mib_per_rank": [r["peak_bytes"] / 2**20 for r in result["ranks"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", default="1f1b,zero_bubble,interleaved_1f1b,interleaved_zero_bubble,zbv")
    workload_arguments(parser, rounds=7, steps=12)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    schedules = args.schedules.split(",")
    rounds: list[dict[str, dict[str, Any]]] = []
    for index in range(args.rounds):
        rounds.append({})
        for schedule in schedules if index % 2 == 0 else schedules[::-1]:
            with tempfile.TemporaryDirectory() as folder:
                rounds[-1][schedule] = analyse(schedule, run_one(schedule, args, folder), args.stages, args.chunks)
        print(json.dumps({"round": index, **{s: r["median_step_s"] for s, r in rounds[-1].items()}}), flush=True)
    base = schedules[0]
    summary: dict[str, Any] = {"config": vars(args), "schedules": {}}
    for schedule in schedules:
        entries = [r[schedule] for r in rounds]
        ratios = [r[base]["median_step_s"] / r[schedule]["median_step_s"] for r in rounds]
        summary["schedules"][schedule] = {
            "median_step_s": statistics.median(e["median_step_s"] for e in entries),
            f"speedup_over_{base}_per_round": [round(v, 3) for v in ratios],
            f"speedup_over_{base}_median": statistics.median(ratios),
            f"faster_than_{base}_in_rounds": sum(v > 1 for v in ratios),
            "measured_bubble_per_rank": [
                statistics.median(e["measured_bubble_per_rank"][r] for e in entries) for r in range(args.stages)
            ],
            "executor_step_ms_per_rank": [
                statistics.median(e["executor_step_ms_per_rank"][r] for e in entries) for r in range(args.stages)
            ],
            "simulated_bubble": statistics.median(e["simulated_bubble"] for e in entries),
            "stage_costs_ms": entries[len(entries) // 2]["stage_costs_ms"],
            "peak_activation_mib_per_rank": [
                max(e["peak_activation_mib_per_rank"][r] for e in entries) for r in range(args.stages)
            ],
        }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sync_schedules.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

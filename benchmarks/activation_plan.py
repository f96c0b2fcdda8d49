"""The planner's activation policy per stage on the benchmark MLP: predicted against measured, and its step time.

    python benchmarks/activation_plan.py                       # 4 processes, 1F1B, 8 chunks, 6 pairs
    python benchmarks/activation_plan.py --pairs 8 --steps 10

1. Profiles the benchmark MLP (8 blocks of width 1024 and a head, batch 256, SGD with momentum) on this
   CPU for 8 micro-batches (:func:`~lightning_pipe.partition.measure.profile.profile_module`, as
   ``plan="auto"`` does) and measures the offload copy's bandwidth
   (:func:`~lightning_pipe.plan.auto.measure_copy`: host to host on CPU).
2. Plans 1F1B on 4 processes with 8 chunks and ``balance="parameters"`` (every recompute mode for the
   whole model, and the activation policy per stage) first without a budget, then under a budget per
   process of that split's largest static bytes (parameters, gradients, optimizer state) plus 1.25 x
   the saved activations its last stage holds: room on every stage for a quarter more than the last
   stage holds. (The split is fixed so that the budget asks for activation memory: with every balance
   mode, a split with less static memory on the first stage can fit the same budget keeping
   everything.)
3. Runs the planner's choice under the budget and ``recompute="always"`` on the same split, in
   alternating pairs (which runs first alternates), each for ``--steps`` steps: per process the peak of
   saved activations (the saved-tensor meter of ``activation_memory.py``) and rank 0's median step
   time after the first two steps. Writes ``--out``/activation_plan.json.
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

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from activation_memory import ActivationPeak
from step_time import MLP, StepTimer

from lightning_pipe import PipelineStrategy
from lightning_pipe.partition.measure.profile import profile_module
from lightning_pipe.plan.auto import measure_copy
from lightning_pipe.plan.planner import Candidate, Link, activations_line, plan

WIDTH, BLOCKS, BATCH = 1024, 8, 256


def data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(BATCH * 2, WIDTH), torch.randint(0, 10, (BATCH * 2,))


def planned(stages: int, chunks: int) -> tuple[Candidate, Candidate, int, float]:
    """The planner's first choice without a budget and under the budget of the module docstring,
    the budget, and the copy bandwidth it priced offload at."""
    torch.manual_seed(0)
    model = MLP(WIDTH, BLOCKS)
    x, y = data()
    profile = profile_module(
        model, model.layers, lambda: (x[:BATCH], y[:BATCH]), chunks, torch.device("cpu"),
        optimizers=lambda: [model.configure_optimizers()],
    )  # fmt: skip
    saved = max(c.activation_bytes for c in profile.layers)
    bandwidth = measure_copy(torch.device("cpu"), max(saved, 1 << 20))
    free = Link(latency=0.0, bandwidth=float("inf"))  # one machine: the plan compares activation policies
    grid: dict[str, Any] = {"schedules": ("1f1b",), "balances": ("parameters",), "copy_bandwidth": bandwidth}
    kept = plan({chunks: profile}, stages, free, **grid)[0]
    static = max(m - a for m, a in zip(kept.stage_bytes, kept.activation_bytes))
    budget = static + int(1.25 * kept.activation_bytes[-1])
    best = plan({chunks: profile}, stages, free, budget, **grid)[0]
    return kept, best, budget, bandwidth


def run(arguments: dict[str, Any], stages: int, steps: int) -> dict[str, Any]:
    """One fit of ``steps`` steps: per process its activation record, rank 0's step times."""
    torch.manual_seed(0)
    model = MLP(WIDTH, BLOCKS)
    x, y = data()
    with tempfile.TemporaryDirectory() as folder:
        times = os.path.join(folder, "times.json")
        trainer = L.Trainer(
            accelerator="cpu", devices=stages, max_steps=steps, max_epochs=-1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            strategy=PipelineStrategy(start_method="fork", **arguments),
            callbacks=[ActivationPeak(folder), StepTimer(times, warmup=2)],
        )  # fmt: skip
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=BATCH))
        ranks = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(stages)]
        return {"ranks": ranks, "step_times": json.loads(Path(times).read_text())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=4, help="processes")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    kept, best, budget, bandwidth = planned(args.stages, args.chunks)
    chosen = best.strategy_arguments()
    always = {**{k: v for k, v in chosen.items() if k != "offload"}, "recompute": "always"}
    print(json.dumps({"budget_mib": budget / 2**20, "copy_gb_per_s": bandwidth / 1e9, "chosen": chosen}))
    print("without a budget: " + activations_line(kept))
    print("under the budget: " + activations_line(best))
    rounds = []
    for pair in range(args.pairs):
        order = [("planned", chosen), ("always", always)]
        if pair % 2:
            order.reverse()
        load = os.getloadavg()[0]
        result = {name: run(arguments, args.stages, args.steps) for name, arguments in order}
        medians = {name: statistics.median(r["step_times"]) for name, r in result.items()}
        row = {
            "pair": pair, "first": order[0][0], "load_1min": [load, os.getloadavg()[0]],
            "planned_s": medians["planned"], "always_s": medians["always"],
            "ratio": medians["planned"] / medians["always"],
            "planned_peak_mib": [r["peak_mib"] for r in result["planned"]["ranks"]],
            "always_peak_mib": [r["peak_mib"] for r in result["always"]["ranks"]],
            "planned_host_mib": [r["peak_host_mib"] for r in result["planned"]["ranks"]],
        }  # fmt: skip
        rounds.append(row)
        print(json.dumps(row))
    ratios = [r["ratio"] for r in rounds]
    measured = rounds[0]["planned_peak_mib"]
    summary = {
        "predicted_activation_mib": [b / 2**20 for b in best.activation_bytes],
        "predicted_host_mib": [b / 2**20 for b in best.host_bytes],
        "measured_activation_mib": measured,
        "first_over_last": measured[0] / measured[-1],
        "ratio_median": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
        "predicted_step_ms": 1e3 * best.step_seconds,
    }
    print(json.dumps(summary))
    os.makedirs(args.out, exist_ok=True)
    record = {
        "config": vars(args), "budget_bytes": budget, "copy_bytes_per_s": bandwidth, "chosen": chosen,
        "unbudgeted": kept.strategy_arguments(), "unbudgeted_activation_bytes": kept.activation_bytes,
        "rounds": rounds, "summary": summary,
    }  # fmt: skip
    Path(args.out, "activation_plan.json").write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()

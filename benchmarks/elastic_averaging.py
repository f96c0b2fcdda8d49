"""Elastic averaging (``replicas_sync="elastic"``) against the gradient all-reduce of every step, on
2 stages x 2 replicas (4 CPU processes; ``--stages 1``: 2 processes, which a 2-core machine can time).

    python benchmarks/elastic_averaging.py --rounds 5 --out benchmarks/results/elastic_averaging.json

Throughput: the benchmark MLP (``step_time.MLP``), each mode once per round, alternating, the first
mode of a round alternating too; per run the median step time on rank 0 after a warm-up
(``step_time.StepTimer``), per round the ratio elastic / allreduce, and the median of those ratios.
Convergence: the test suite's MLP (``tests.models.TinyNet``, SGD with momentum 0.9) on its random
data (``tests.models.dataset``, 64 samples read for several epochs), one seed per run for the weights
and the data, both modes on the same global batch (each replica a DataLoader batch of ``--batch``):
the final training loss (the mean of the last 10% of steps' losses, as logged: the mean over both
replicas' batches, each on its own weights) and the loss of replica 0's final weights on all samples.
One CPU thread per process.
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
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from pipemare_convergence import final_loss, train_recorded
from step_time import MLP, StepTimer

from lightning_pipe import PipelineStrategy
from tests.models import TinyNet, dataset

MODES = ("allreduce", "elastic")


def strategy(mode: str, args: argparse.Namespace) -> PipelineStrategy:
    elastic = {"replicas_sync_period": args.period} if mode == "elastic" else {}
    return PipelineStrategy(
        schedule=args.schedule,
        chunks=args.chunks,
        stages=args.stages,
        replicas_sync=mode,
        start_method="fork",
        **elastic,
    )


def step_time(mode: str, args: argparse.Namespace, path: str) -> float:
    torch.manual_seed(0)
    model = MLP(args.width, args.blocks)
    x = torch.randn(args.batch_timed * 2 * (args.steps + 1), args.width)
    y = torch.randint(0, 10, (len(x),))
    data = DataLoader(TensorDataset(x, y), batch_size=args.batch_timed, shuffle=False)
    L.Trainer(
        accelerator="cpu", devices=2 * args.stages, strategy=strategy(mode, args), max_steps=args.steps, max_epochs=-1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[StepTimer(path, args.warmup)],
    ).fit(model, data)  # fmt: skip
    with open(path) as f:
        return statistics.median(json.load(f))


def convergence(mode: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = TinyNet(lr=args.lr)
    samples = dataset(n=args.samples, seed=seed)
    data = DataLoader(samples, batch_size=args.batch, shuffle=False)
    losses, _ = train_recorded(model, data, strategy(mode, args), 4, args.train_steps)
    with torch.no_grad():  # replica 0's weights, gathered back into this process
        x, y = samples.tensors
        whole = F.cross_entropy(model(x), y).item()
    return {"mode": mode, "seed": seed, "final_loss": final_loss(losses), "replica0_loss": whole, "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument(
        "--stages", type=int, default=2, help="stages x 2 replicas (1: 2 processes, timeable on 2 cores)"
    )
    parser.add_argument("--period", type=int, default=4, help="replicas_sync_period")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--batch-timed", type=int, default=64, help="each replica's batch in the timed runs")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16, help="each replica's batch in the convergence runs")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--train-steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--skip-convergence", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tmp = f"/tmp/lightning_pipe_elastic_{os.getpid()}.json"
    rounds = []
    for index in range(0 if args.skip_timing else args.rounds):
        order = MODES if index % 2 == 0 else MODES[::-1]
        times = {mode: step_time(mode, args, tmp) for mode in order}
        rounds.append({**times, "ratio": times["elastic"] / times["allreduce"]})
        print(json.dumps(rounds[-1]), flush=True)
    seeds = [] if args.skip_convergence else [int(seed) for seed in args.seeds.split(",")]
    runs = [convergence(mode, seed, args) for seed in seeds for mode in MODES]
    result = {
        "config": vars(args),
        "cpu_count": os.cpu_count(),
        "load_before": os.getloadavg(),
        "rounds": rounds,
        "median_ratio": statistics.median(r["ratio"] for r in rounds) if rounds else None,
        "convergence": [{k: v for k, v in r.items() if k != "losses"} for r in runs],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "config"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**result, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()

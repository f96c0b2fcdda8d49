"""How much ``balance="time"`` gains on a model whose costs are skewed, against the split by layer
count (``"uniform"``), in paired rounds.

    python benchmarks/skewed_balance.py --rounds 7

The workload is the benchmark MLP with its first 4 of 8 blocks ``--heavy`` (4) times as costly
(each holds 4 Linear + ReLU pairs: 4:1 between the halves), batch 256 in 8 micro-batches, 1F1B on
2 CPU processes with one thread each; every run is a fresh interpreter (``overhead.py``'s runs).
Per round the two splits run back to back in alternating order, and the ratio of their median step
times (time / uniform) is taken; the median over rounds is reported with each round's ratio.

What the split allows: the ratio of the slowest stage's compute per step (F + B, measured on the
run's timeline) under the two splits, also paired per round. A step cannot gain more than that,
and gains less by what the pipeline costs itself (the bubble, communication, the optimizer).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from overhead import ROOT, run  # noqa: E402
from step_time import workload_arguments  # noqa: E402


def slowest_stage_ms(result: dict) -> float:
    """The slowest stage's compute per micro-batch (F + B + W medians, ms)."""
    return max(sum(stage) for stage in result["stage_costs_ms"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_arguments(parser, rounds=7, steps=12)
    parser.add_argument("--heavy", type=int, default=4, help="cost of each of the first half's blocks, in light blocks")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--balances", default="uniform,time", help="the first is the reference")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "skewed_balance.json"))
    args = parser.parse_args()
    args.cprofile = None
    balances = args.balances.split(",")
    rounds: list[dict[str, dict]] = []
    for index in range(args.rounds):
        rounds.append({})
        for balance in balances if index % 2 == 0 else balances[::-1]:
            args.balance = balance
            rounds[-1][balance] = run(ROOT, args.schedule, args)
        print(
            json.dumps({"round": index, **{b: round(1e3 * r["step_s"], 1) for b, r in rounds[-1].items()}}), flush=True
        )
    reference = balances[0]
    summary: dict = {"config": {k: v for k, v in vars(args).items() if k != "balance"}, "balances": {}}
    for balance in balances:
        entry = {
            "median_step_ms": round(1e3 * statistics.median(r[balance]["step_s"] for r in rounds), 2),
            "stage_costs_ms": rounds[-1][balance]["stage_costs_ms"],
            "measured_bubble_per_rank": [
                round(statistics.median(r[balance]["measured_bubble"][k] for r in rounds), 4)
                for k in range(args.stages)
            ],
        }
        if balance != reference:
            step = [r[balance]["step_s"] / r[reference]["step_s"] for r in rounds]
            allowed = [slowest_stage_ms(r[balance]) / slowest_stage_ms(r[reference]) for r in rounds]
            entry.update(
                step_ratio_per_round=[round(v, 3) for v in step], step_ratio_median=round(statistics.median(step), 3),
                slowest_stage_ratio_per_round=[round(v, 3) for v in allowed],
                slowest_stage_ratio_median=round(statistics.median(allowed), 3),
            )  # fmt: skip
        summary["balances"][balance] = entry
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary["balances"], indent=1))


if __name__ == "__main__":
    main()

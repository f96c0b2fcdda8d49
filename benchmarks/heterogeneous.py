"""Unequal devices on one CPU: does ``balance="time"`` with every rank's own speed give the slower rank
less work, and how much faster does it train than the split that assumes equal ranks?

    python benchmarks/heterogeneous.py --rounds 7

Two processes (gloo, one CPU thread each), each pinned to its own core (``os.sched_setaffinity``,
every thread of the process); a busy process (a spinning Python loop) is pinned to rank 1's core,
so rank 1 gets about half of its core. The workload is the benchmark MLP (``--blocks`` blocks of
``Linear(width, width)`` and ReLU, and a head), batch 256 in 8 micro-batches, 1F1B. Three splits:

- ``speed_aware``: ``balance="time"`` as it runs by default on several ranks: rank 0's profile, each
  stage's seconds divided by its rank's speed, timed by the probe on every rank at once;
- ``rank0_profile``: ``balance="time"`` with ``rank_speeds=[1.0, 1.0]``: rank 0's profile for every
  rank, as before per-rank speeds (every rank assumed as fast as rank 0);
- ``uniform``: equal layer counts.

Placement (``--devices 4 --stages 2 --cores 0,1,0,1 --contenders placed,default_placement``): 2
stages x 2 replicas, ranks 0 and 2 on one core, ranks 1 and 3 and the busy process on the other, so
each node-like pair has a fast and a slow rank. Both contenders run ``balance="time"`` with measured
speeds; ``placed`` lets the speeds choose which rank holds which stage (ranks 0 and 2 on one stage),
``default_placement`` fixes ``rank_order`` to rank ``r`` on stage ``r // 2`` (a slow rank in every stage).

Every run is a fresh interpreter; each round runs the contenders back to back, in an order that rotates
from round to round. A step's time is rank 0's, from one step's end to the next, the median over the
steps after ``--warmup``. Per round the ratios ``rank0_profile / speed_aware`` and
``uniform / speed_aware`` are taken (paired); their medians over the rounds are reported, with each
round's ratio, the splits and the speeds the probe measured. Writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONTENDERS = ("speed_aware", "rank0_profile", "uniform", "placed", "default_placement")
DEFAULT_CONTENDERS = CONTENDERS[:3]


def pin(core: int) -> None:
    """Pin every thread of this process (those started before, such as gloo's, too) to ``core``."""
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError, PermissionError):  # a thread that has ended since the listing
            os.sched_setaffinity(int(task), {core})
    os.sched_setaffinity(0, {core})


def strategy_options(contender: str, devices: int = 2) -> dict[str, Any]:
    """The ``PipelineStrategy`` arguments of each contender (besides schedule, chunks and stages)."""
    if contender in ("speed_aware", "placed"):
        return {"balance": "time"}
    if contender == "rank0_profile":
        return {"balance": "time", "rank_speeds": [1.0] * devices}
    if contender == "uniform":
        return {"balance": "uniform"}
    if contender == "default_placement":
        return {"balance": "time", "rank_order": list(range(devices))}
    raise ValueError(f"unknown contender {contender!r}; valid: {', '.join(CONTENDERS)}")


def order(round_index: int, contenders: list[str]) -> list[str]:
    """The contenders' order in round ``round_index``: rotated each round, so each runs first as often."""
    k = round_index % len(contenders)
    return contenders[k:] + contenders[:k]


def child(config: dict[str, Any]) -> None:
    """One run, in this interpreter: the ranks (fork), each pinned to its core before the profile."""
    sys.path.insert(0, ROOT)
    sys.path.insert(1, HERE)
    import lightning as L
    import torch
    from step_time import MLP, StepTimer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pipe import PipelineStrategy

    cores = config["cores"]

    class Pin(L.Callback):
        """Each rank on its own core (runs in the Trainer's setup, before the strategy profiles)."""

        def setup(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
            pin(cores[trainer.global_rank])
            torch.set_num_threads(1)

    class Record(L.Callback):
        def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_rank == 0:
                resources = trainer.strategy.rank_resources
                profile = trainer.strategy.profile
                record = {
                    "balance": trainer.strategy.stage_balance,
                    "rank_order": list(trainer.strategy.layout.order),
                    "speeds": resources and resources.speeds,
                    "layer_ms": profile and [round(1e3 * c, 3) for c in profile.time_costs()],
                }
                Path(config["folder"], "split.json").write_text(json.dumps(record))

    pin(cores[0])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MLP(config["width"], config["blocks"])
    g = torch.Generator().manual_seed(0)
    n = config["batch"] * 4
    data = DataLoader(
        TensorDataset(torch.randn(n, config["width"], generator=g), torch.randint(0, 10, (n,), generator=g)),
        batch_size=config["batch"],
    )
    devices = config["devices"]
    strategy = PipelineStrategy(
        schedule="1f1b", chunks=config["chunks"], start_method="fork", stages=config["stages"],
        **strategy_options(config["contender"], devices),
    )  # fmt: skip
    timer = StepTimer(os.path.join(config["folder"], "steps.json"), config["warmup"])
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, max_steps=config["warmup"] + config["steps"], max_epochs=-1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, strategy=strategy,
        callbacks=[Pin(), timer, Record()],
    )  # fmt: skip
    trainer.fit(model, data)


def run(contender: str, args: argparse.Namespace) -> dict[str, Any]:
    """Rank 0's median step time, the split and the speeds of one fresh run of ``contender``."""
    with tempfile.TemporaryDirectory() as folder:
        config = {"contender": contender, "folder": folder, "cores": args.cores, "width": args.width,
                  "blocks": args.blocks, "batch": args.batch, "chunks": args.chunks, "steps": args.steps,
                  "warmup": args.warmup, "devices": args.devices, "stages": args.stages}  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        done = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(config)], env=env, cwd=ROOT, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"{contender} failed:\n{done.stderr[-4000:]}")
        steps = json.loads(Path(folder, "steps.json").read_text())
        split = json.loads(Path(folder, "split.json").read_text())
    return {"step_s": statistics.median(steps), "steps_s": steps, **split}


def summarize(rounds: list[dict[str, dict[str, Any]]], contenders: list[str]) -> dict[str, Any]:
    """Per contender its median step time over the rounds and the splits it ran; per other contender
    its step time over the first contender's in each round (paired) and the median of those ratios."""
    summary: dict[str, Any] = {"rounds": len(rounds), "contenders": {}}
    reference = contenders[0]
    for name in contenders:
        ran = [r[name] for r in rounds if name in r]
        entry: dict[str, Any] = {
            "median_step_s": round(statistics.median(r["step_s"] for r in ran), 4),
            "step_s_per_round": [round(r["step_s"], 4) for r in ran],
            "balances": [r["balance"] for r in ran],
            "rank_orders": [r.get("rank_order") for r in ran],
            "speeds": [r["speeds"] for r in ran],
            "layer_ms": [r.get("layer_ms") for r in ran],  # rank 0's profile: each layer's F + B per micro-batch
        }
        if name != reference:
            ratios = [r[name]["step_s"] / r[reference]["step_s"] for r in rounds if name in r and reference in r]
            entry[f"over_{reference}_per_round"] = [round(v, 3) for v in ratios]
            entry[f"over_{reference}_median"] = round(statistics.median(ratios), 3)
        summary["contenders"][name] = entry
    return summary


def busy_loop(core: int) -> subprocess.Popen:
    """A spinning Python process pinned to ``core``: whatever else runs there gets about half of it."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    os.sched_setaffinity(busy.pid, {core})
    return busy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--devices", type=int, default=2, help="processes")
    parser.add_argument("--stages", type=int, default=None, help="pipeline depth (default: every process)")
    parser.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS), help="the first is the reference")
    parser.add_argument("--cores", default="0,1", help="each rank's core; the busy loop shares rank 1's")
    parser.add_argument("--no-busy", action="store_true", help="leave rank 1's core alone (equal ranks)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "heterogeneous.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    args.cores = [int(c) for c in args.cores.split(",")]
    args.contenders = args.contenders.split(",")
    if len(args.cores) != args.devices or not set(args.contenders) <= set(CONTENDERS):
        parser.error(f"give one core per process (--cores) and contenders among {', '.join(CONTENDERS)}")
    busy = None if args.no_busy else busy_loop(args.cores[1])
    rounds: list[dict[str, dict[str, Any]]] = []
    try:
        for index in range(args.rounds):
            rounds.append({name: run(name, args) for name in order(index, args.contenders)})
            line = {name: (round(1e3 * r["step_s"], 1), r["balance"], r["speeds"]) for name, r in rounds[-1].items()}
            print(json.dumps({"round": index, **line}), flush=True)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    summary = {"config": {k: v for k, v in vars(args).items() if k != "child"}, **summarize(rounds, args.contenders)}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary["contenders"], indent=1))


if __name__ == "__main__":
    main()

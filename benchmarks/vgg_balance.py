"""The published balance x micro-batches comparison (torchgpipe, FairScale and DeepSpeed on VGG19 /
CIFAR-100), reproduced with lightning-pipe on this machine.

    python benchmarks/vgg_balance.py                     # 2 x 4 x 3 layouts, one round
    python benchmarks/vgg_balance.py --rounds 2 --stages 2 --chunks 1,8,16

VGG19 with batch norm on CIFAR-100-shaped random data (3 x 32 x 32, 100 classes), batch 128, 1F1B,
SGD with momentum, for each ``--stages`` (2, 4) x ``--balances`` (time, memory, uniform,
parameters) x ``--chunks`` (1, 8, 16), one CPU thread per process. Each layout trains ``--steps``
steps; the step time is rank 0's median after ``--warmup`` steps (a step: the end of one optimizer
step to the end of the next). With ``--rounds`` > 1 the layouts run again in reverse order. Layouts
with more processes than cores share the cores: their times say how the layouts compare with each
other, not how 4 devices would run. Writes ``--out``/vgg_balance.json and prints a Markdown table
(steps per second and samples per second, the split each balance chose, the fastest per stage
count in bold).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from step_time import StepTimer

from lightning_pipe import PipelineStrategy
from lightning_pipe.recipes.vgg import VGGClassifier


class KeepSplit(L.Callback):
    """Writes the split the strategy chose (layers per stage)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 0:
            with open(self.path, "w") as f:
                json.dump(list(trainer.strategy.stage_balance), f)


def run(stages: int, balance: str, chunks: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    model = VGGClassifier(depth=19, batch_norm=True, num_classes=100)
    g = torch.Generator().manual_seed(0)
    batches = args.steps + 1
    x = torch.randn(args.batch * batches, 3, 32, 32, generator=g)
    y = torch.randint(0, 100, (args.batch * batches,), generator=g)
    with tempfile.TemporaryDirectory() as folder:
        times, split = os.path.join(folder, "times.json"), os.path.join(folder, "split.json")
        began = time.perf_counter()
        trainer = L.Trainer(
            accelerator="cpu", devices=stages, max_steps=args.steps, max_epochs=-1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            strategy=PipelineStrategy(schedule="1f1b", chunks=chunks, balance=balance, start_method="fork"),
            callbacks=[StepTimer(times, args.warmup), KeepSplit(split)],
        )  # fmt: skip
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=args.batch))
        return {
            "step_s": json.load(open(times)),
            "split": json.load(open(split)),
            "run_s": time.perf_counter() - began,
        }


def table(results: list[dict[str, Any]], batch: int) -> str:
    rows = ["| stages | balance | split | chunks | s/step | samples/s |", "|---:|---|---|---:|---:|---:|"]
    best = {s: min(r["median_step_s"] for r in results if r["stages"] == s) for s in {r["stages"] for r in results}}
    for r in results:
        mark = "**" if r["median_step_s"] == best[r["stages"]] else ""
        rows.append(
            f"| {r['stages']} | {r['balance']} | {r['split']} | {r['chunks']} | {mark}{r['median_step_s']:.3f}{mark} "
            f"| {batch / r['median_step_s']:.1f} |"
        )
    return "\n".join(rows)


def svg_chart(results: list[dict[str, Any]], batch: int) -> str:
    """Samples per second per layout: one group of bars per stage count and balance, one bar per
    ``chunks`` (no plotting library)."""
    colors = {1: "#999999", 8: "#2b7bba", 16: "#e08214"}
    order = {"time": 0, "memory": 1, "uniform": 2, "parameters": 3}
    groups = sorted({(r["stages"], r["balance"]) for r in results}, key=lambda g: (g[0], order.get(g[1], 9)))
    top = max(batch / r["median_step_s"] for r in results)
    bar, gap, left, width = 14, 10, 170, 420
    out: list[str] = []
    y = 30
    for stages, balance in groups:
        rows = sorted(
            (r for r in results if (r["stages"], r["balance"]) == (stages, balance)), key=lambda r: r["chunks"]
        )
        out.append(f'<text x="10" y="{y + len(rows) * bar / 2 + 4:.0f}">{stages} stages, {balance}</text>')
        for r in rows:
            value = batch / r["median_step_s"]
            length = width * value / top
            color = colors.get(r["chunks"], "#444444")
            out.append(f'<rect x="{left}" y="{y}" width="{length:.1f}" height="{bar - 2}" fill="{color}"/>')
            out.append(
                f'<text x="{left + length + 4:.1f}" y="{y + bar - 3}" font-size="11">{value:.1f} (chunks '
                f"{r['chunks']})</text>"
            )
            y += bar
        y += gap
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 130}" height="{y + 10}" '
        'font-family="sans-serif" font-size="12">'
        f'<text x="10" y="18" font-weight="bold">VGG19, batch {batch}, 1F1B: samples per second (higher is '
        "faster)</text>"
    )
    return "\n".join([head, *out, "</svg>"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", default="2,4")
    parser.add_argument("--balances", default="time,memory,uniform,parameters")
    parser.add_argument("--chunks", default="1,8,16")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--chart", help="only redraw: the table and vgg_balance.svg from this vgg_balance.json")
    args = parser.parse_args()
    if args.chart:
        saved = json.loads(Path(args.chart).read_text())
        with open(os.path.join(os.path.dirname(args.chart), "vgg_balance.svg"), "w") as f:
            f.write(svg_chart(saved["results"], saved["config"]["batch"]))
        print(table(saved["results"], saved["config"]["batch"]))
        return
    torch.set_num_threads(1)
    layouts = [
        (int(s), b, int(c))
        for s in args.stages.split(",")
        for b in args.balances.split(",")
        for c in args.chunks.split(",")
    ]
    times: dict[tuple[int, str, int], list[float]] = {layout: [] for layout in layouts}
    splits: dict[tuple[int, str, int], list[int]] = {}
    for index in range(args.rounds):
        for layout in layouts if index % 2 == 0 else layouts[::-1]:
            out = run(*layout, args)
            times[layout] += out["step_s"]
            splits[layout] = out["split"]
            print(
                json.dumps(
                    {
                        "layout": layout,
                        "median_step_s": statistics.median(out["step_s"]),
                        "run_s": round(out["run_s"], 1),
                    }
                ),
                flush=True,
            )
    results = [
        {
            "stages": s,
            "balance": b,
            "chunks": c,
            "split": splits[(s, b, c)],
            "median_step_s": statistics.median(times[(s, b, c)]),
        }
        for s, b, c in layouts
    ]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "vgg_balance.json"), "w") as f:
        json.dump({"config": vars(args), "results": results}, f, indent=2)
    with open(os.path.join(args.out, "vgg_balance.svg"), "w") as f:
        f.write(svg_chart(results, args.batch))
    print(table(results, args.batch))


if __name__ == "__main__":
    main()

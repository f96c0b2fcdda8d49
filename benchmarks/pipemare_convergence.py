"""Convergence of the asynchronous schedules against synchronous 1F1B, on the same runs.

    python benchmarks/pipemare_convergence.py --recipe bert --steps 300 --find-lr 1e-3,2e-3,4e-3
    python benchmarks/pipemare_convergence.py --recipe vgg --steps 300 --find-lr 0.02,0.05,0.1
    python benchmarks/pipemare_convergence.py --report benchmarks/results/pipemare_bert.json   # the table again

First (``--find-lr``) 1F1B runs at each learning rate given and the one with the lowest final loss
is "1F1B's best" (or give it with ``--lr``). Then every schedule runs at 0.5x, 1x and 2x of it,
4 stages, the same seed, data order and initial weights: ``1f1b``, ``pipedream``,
``pipedream_2bw``, ``pipemare``, and ``pipemare`` without each of its techniques
(``pipemare_no_resched``: ``pipemare_warmup=0``; ``pipemare_no_correction``:
``pipemare_correction=False``). For each run: the final loss (mean training loss over the last 10%
of steps), the first step from which the running mean over a window of 10% of the steps reaches
1F1B's final loss at that learning rate (None: never), and the peak weight memory per stage in
copies of the stage's weights (parameters + PipeDream's stashed versions + PipeMare's velocity,
measured on every rank). Results go to a JSON file and a picture (loss against step, one line per
schedule, one panel per learning rate) to an SVG.

Recipes (small, so that the grid runs on a CPU): ``bert`` is the BERT masked-LM recipe
(``size=tiny``: embeddings, 2 encoder layers, the head = 4 stages of one layer; AdamW with the
recipe's warm-up and linear decay; untied embeddings, which the stage-wise delays require);
``vgg`` is VGG19 with batch norm on the recipe's synthetic images (SGD with momentum 0.9 and the
recipe's cosine schedule).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

import lightning as L
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from lightning_pipe import PipelineStrategy

#: name -> (schedule, extra strategy arguments)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "1f1b": ("1f1b", {}),
    "pipedream": ("pipedream", {}),
    "pipedream_2bw": ("pipedream_2bw", {}),
    "pipemare": ("pipemare", {}),
    "pipemare_no_resched": ("pipemare", {"pipemare_warmup": 0}),
    "pipemare_no_correction": ("pipemare", {"pipemare_correction": False}),
}
COLOURS = {
    "1f1b": "#000000", "pipedream": "#d62728", "pipedream_2bw": "#ff7f0e", "pipemare": "#1f77b4",
    "pipemare_no_resched": "#17becf", "pipemare_no_correction": "#9467bd",
}  # fmt: skip


class Record(L.Callback):
    """Rank 0: the training loss of every batch; every rank: its weight memory.

    The losses are the ``train_loss`` values logged on rank 0, one per batch in batch order. With
    2 or more stages rank 0 runs no step method: it logs only the last stage's per-batch summaries.
    The loss a step returns is no substitute under the asynchronous schedules: it is the previous
    batch's (``nan`` at the first step), and the last batch's is never returned.
    """

    def __init__(self, folder: str, key: str = "train_loss") -> None:
        self.folder = folder
        self.key = key
        self.losses: list[float] = []

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        # the pipeline routes each micro-batch's self.log through an instance attribute, which it
        # deletes afterwards: the recording sits on the instance's own subclass, for this run only
        cls, record = type(module), self

        def log(self: L.LightningModule, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if name == record.key:
                record.losses.append(float(value))
            cls.log(self, name, value, *args, **kwargs)

        module.__class__ = type(cls.__name__, (cls,), {"log": log})

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        pipeline = trainer.strategy.pipeline
        params = sum(p.numel() * p.element_size() for p in pipeline.host.parameters())
        run = pipeline.asynchronous
        stashed = run.versions.peak_weight_bytes if run is not None and run.stashes else 0
        velocity = run.pipemare.nbytes() if run is not None and run.pipemare is not None else 0
        memory = {"param_bytes": params, "stash_bytes": stashed, "velocity_bytes": velocity}
        with open(os.path.join(self.folder, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"losses": self.losses, "memory": memory}, f)


def build(
    recipe: str, lr: float, steps: int, args: argparse.Namespace, seed: int = 0, bert: type | None = None
) -> tuple[L.LightningModule, L.LightningDataModule]:
    """The recipe's model and data (``bert``: a ``BertMLM`` subclass to build instead, e.g. another optimizer)."""
    torch.manual_seed(seed)  # the initial weights and the data order (the workers fork after this)
    if recipe == "bert":
        from lightning_pipe.recipes.bert import BertMLM, TextData

        data = TextData(vocab_size=args.vocab, max_len=args.max_len, batch_size=args.batch, limit_chars=args.chars)
        model = (bert or BertMLM)(vocab_size=args.vocab, size="tiny", max_len=args.max_len, lr=lr,
                        warmup_steps=max(1, steps // 10), max_steps=steps, tie_embeddings=False,
                        build="eager")  # fmt: skip
        return model, data
    from lightning_pipe.recipes.vgg import CIFAR100Data, VGGClassifier

    data = CIFAR100Data(source="synthetic", batch_size=args.batch, num_classes=args.classes, augment=False,
                        synthetic_train=args.batch * steps, synthetic_val=args.batch)  # fmt: skip
    model = VGGClassifier(depth=19, width=args.width, num_classes=args.classes, lr=lr, max_steps=steps, build="eager")
    return model, data


def run(recipe: str, variant: str, lr: float, args: argparse.Namespace, seed: int = 0) -> dict[str, Any]:
    schedule, extra = VARIANTS[variant]
    if schedule == "pipemare" and "pipemare_warmup" not in extra:
        extra = {**extra, "pipemare_warmup": args.warmup}
    if schedule == "pipemare" and extra.get("pipemare_correction") is not False and args.decay is not None:
        extra = {**extra, "pipemare_decay": args.decay}
    chunks = args.chunks_2bw if schedule == "pipedream_2bw" else args.chunks
    model, data = build(recipe, lr, args.steps, args, seed)
    strategy = PipelineStrategy(schedule=schedule, chunks=chunks, start_method="fork", **extra)
    losses, copies = train_recorded(model, data, strategy, args.stages, args.steps)
    return {
        "variant": variant,
        "schedule": schedule,
        "chunks": chunks,
        "lr": lr,
        "seed": seed,
        "losses": losses,
        "weight_copies": copies,
    }


def train_recorded(model: Any, data: Any, strategy: Any, stages: int, steps: int) -> tuple[list[float], list[float]]:
    """Train ``model`` for ``steps`` on ``stages`` CPU processes; rank 0's training losses, and each
    stage's peak weight memory in copies of its weights (weights, stashed versions, velocities)."""
    with tempfile.TemporaryDirectory() as folder:
        trainer = L.Trainer(
            accelerator="cpu", devices=stages, strategy=strategy, max_steps=steps, max_epochs=-1,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Record(folder)],
        )  # fmt: skip
        trainer.fit(model, data)
        ranks = []
        for r in range(stages):
            with open(os.path.join(folder, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    if len(ranks[0]["losses"]) != steps:
        raise RuntimeError(
            f"recorded {len(ranks[0]['losses'])} training losses in {steps} steps: one per batch expected"
        )
    copies = [
        round((m["param_bytes"] + m["stash_bytes"] + m["velocity_bytes"]) / m["param_bytes"], 3)
        if m["param_bytes"]
        else 0.0
        for m in (r["memory"] for r in ranks)
    ]
    return ranks[0]["losses"], copies


def final_loss(losses: list[float]) -> float:
    tail = max(1, len(losses) // 10)
    return sum(losses[-tail:]) / tail


def steps_to_reach(losses: list[float], target: float) -> int | None:
    window = max(1, len(losses) // 10)
    for end in range(window, len(losses) + 1):
        if sum(losses[end - window : end]) / window <= target:
            return end
    return None


def summary(results: list[dict[str, Any]], lrs: list[float]) -> list[dict[str, Any]]:
    """One row per learning rate and schedule: the final loss per seed and its mean, each seed's
    ratio to 1F1B's final loss on the same seed (and their mean), and the steps each seed took to
    reach that 1F1B loss. A run's ``reference`` names the variant it is compared with (default
    ``"1f1b"``; e.g. 1F1B under the same optimizer)."""
    table = []
    for value in lrs:
        runs = [r for r in results if r["lr"] == value]
        # each run against its reference on the same seed: "1f1b", or the run's "reference" (1F1B with its optimizer)
        reference = {(r["variant"], r.get("seed", 0)): final_loss(r["losses"]) for r in runs}
        for variant in dict.fromkeys(r["variant"] for r in runs):
            mine = [r for r in runs if r["variant"] == variant]
            finals = [final_loss(r["losses"]) for r in mine]
            # no 1F1B run at this rate and seed (a subset of --variants): no ratio, no steps to reach it
            refs = [reference.get((r.get("reference", "1f1b"), r.get("seed", 0))) for r in mine]
            ratios = [None if ref is None else f / ref - 1 for f, ref in zip(finals, refs)]
            known = [x for x in ratios if x is not None]
            table.append({"lr": value, "variant": variant, "chunks": mine[0]["chunks"],
                          "seeds": [r.get("seed", 0) for r in mine], "final_loss": round(sum(finals) / len(finals), 4),
                          "final_losses": [round(f, 4) for f in finals],
                          "vs_1f1b": round(sum(known) / len(known), 4) if known else None,
                          "vs_1f1b_per_seed": [None if x is None else round(x, 4) for x in ratios],
                          "steps_to_1f1b_final": [None if ref is None else steps_to_reach(r["losses"], ref)
                                                  for r, ref in zip(mine, refs)],
                          "weight_copies": mine[0]["weight_copies"]})  # fmt: skip
    return table


def markdown(table: list[dict[str, Any]]) -> str:
    """The summary as a Markdown table: one row per schedule, the learning rates side by side."""
    lrs = sorted({row["lr"] for row in table})
    variants = list(dict.fromkeys(row["variant"] for row in table))
    by = {(row["variant"], row["lr"]): row for row in table}
    rates = " / ".join(f"{lr:g}" for lr in lrs)
    lines = [f"| schedule | chunks | final loss at lr {rates} | steps to 1F1B's final loss at lr {rates} | weight "
             "copies per stage |",
             "|---|---|---|---|---|"]  # fmt: skip
    for variant in variants:
        rows = [by.get((variant, lr)) for lr in lrs]
        first = next(r for r in rows if r is not None)
        losses = " / ".join(_loss_cell(r) if r else "-" for r in rows)
        reach = " / ".join(
            _reach_cell(r["steps_to_1f1b_final"]) if r and r["vs_1f1b"] is not None else "-" for r in rows
        )
        copies = ", ".join(f"{c:g}" for c in first["weight_copies"])
        lines.append(f"| {variant} | {first['chunks']} | {losses} | {reach} | {copies} |")
    return "\n".join(lines)


def mean_over_seeds(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One run per learning rate and schedule whose losses are the seeds' mean at each step."""
    grouped: dict[tuple[float, str], list[dict[str, Any]]] = {}
    for r in results:
        grouped.setdefault((r["lr"], r["variant"]), []).append(r)
    return [
        {**runs[0], "losses": [sum(v) / len(v) for v in zip(*(r["losses"] for r in runs))]} for runs in grouped.values()
    ]


def _loss_cell(row: dict[str, Any]) -> str:
    """The mean final loss, and with several seeds its ratio to 1F1B and each seed's loss."""
    per_seed = row.get("final_losses")
    if not per_seed or len(per_seed) == 1 or row.get("vs_1f1b") is None:
        return f"{row['final_loss']:.4f}"
    return f"{row['final_loss']:.4f} ({row['vs_1f1b']:+.1%}; " + ", ".join(f"{v:.4f}" for v in per_seed) + ")"


def _reach_cell(steps: Any) -> str:
    if not isinstance(steps, list):
        return str(steps or "never")
    return ", ".join(str(s or "never") for s in steps)


def svg(results: list[dict[str, Any]], lrs: list[float], title: str, path: str) -> None:
    """Loss against step, one panel per learning rate, one line per schedule (running mean over 5% of the steps)."""
    panels = [(f"lr {lr:g} (step)", [r for r in results if r["lr"] == lr]) for lr in lrs]
    draw(panels, title, path, list(VARIANTS), COLOURS)


def draw(
    panels: list[tuple[str, list[dict[str, Any]]]],
    title: str,
    path: str,
    names: list[str],
    colours: dict[str, str],
    ceiling: float = 3.0,
) -> None:
    """Loss against step: one panel per ``(label, runs)``, one line per run coloured by its
    variant (running mean over 5% of the steps; a run stops where it is no longer finite), and a
    legend of ``names``. The vertical scale is shared and clipped at ``ceiling`` x the median loss,
    so a diverging run runs along the top of its panel."""
    width, height, pad = 330, 240, 40
    results = [r for _, runs in panels for r in runs]
    finite = [v for r in results for v in r["losses"] if v == v and abs(v) < 1e6]
    top = min(max(finite), ceiling * sorted(finite)[len(finite) // 2]) if finite else 1.0
    bottom = min(finite) if finite else 0.0
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width * len(panels) + 180}" height="{height + 60}" '
             'font-family="sans-serif" font-size="11">',
             f'<text x="10" y="16" font-size="13">{title}</text>']  # fmt: skip
    for panel, (label, runs) in enumerate(panels):
        x0, y0 = panel * width + pad, 30
        w, h = width - pad - 10, height - 30
        parts.append(f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#888"/>')
        parts.append(f'<text x="{x0 + 10}" y="{y0 + h + 28}">{label}</text>')
        for frac in (0.0, 0.5, 1.0):
            value = bottom + frac * (top - bottom)
            parts.append(f'<text x="{x0 - 36}" y="{y0 + h - frac * h + 4}">{value:.2f}</text>')
        for r in runs:
            losses = r["losses"]
            smooth = max(1, len(losses) // 20)
            points = []
            for i in range(len(losses)):
                window = losses[max(0, i - smooth + 1) : i + 1]
                value = sum(window) / len(window)
                if value != value or abs(value) > 1e6:
                    break
                clipped = min(max(value, bottom), top)
                x = x0 + w * i / max(1, len(losses) - 1)
                y = y0 + h - h * (clipped - bottom) / (top - bottom or 1)
                points.append(f"{x:.1f},{y:.1f}")
            parts.append(
                f'<polyline fill="none" stroke="{colours.get(r["variant"], "#7f7f7f")}" stroke-width="1.3" '
                f'points="{" ".join(points)}"/>'
            )
    legend_x = width * len(panels) + 10
    for i, name in enumerate(names):
        parts.append(
            f'<line x1="{legend_x}" y1="{40 + 16 * i}" x2="{legend_x + 20}" y2="{40 + 16 * i}" '
            f'stroke="{colours.get(name, "#7f7f7f")}" stroke-width="2"/>'
        )
        parts.append(f'<text x="{legend_x + 25}" y="{44 + 16 * i}">{name}</text>')
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", choices=("bert", "vgg"), default="bert")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument(
        "--chunks", type=int, default=1, help="micro-batches per batch (1: delays 3, 2, 1, 0 on 4 stages)"
    )
    parser.add_argument("--chunks-2bw", type=int, default=3, help="pipedream_2bw needs chunks >= stages - 1")
    parser.add_argument("--warmup", type=int, default=None, help="pipemare_warmup K (default: a third of the steps)")
    parser.add_argument("--lr", type=float, default=None, help="1F1B's best learning rate, if known")
    parser.add_argument(
        "--decay", type=float, default=None, help="pipemare_decay D for the corrected pipemare runs (default 0.1)"
    )
    parser.add_argument("--find-lr", default=None, help="comma-separated learning rates for 1F1B, to pick the best")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--factors", default="0.5,1,2", help="learning rates to run, as multiples of 1F1B's best")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=2000)
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--chars", type=int, default=400_000)
    parser.add_argument("--width", type=float, default=0.125)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument(
        "--seeds", default="0", help="comma-separated seeds (initial weights and data order), each run per seed"
    )
    parser.add_argument("--out", default=None)
    parser.add_argument("--svg", default=None)
    parser.add_argument("--report", default=None, help="print the Markdown table of a results file and stop")
    args = parser.parse_args()
    if args.report:
        with open(args.report) as f:
            print(markdown(json.load(f)["table"]))
        return
    torch.set_num_threads(1)
    args.warmup = args.warmup if args.warmup is not None else max(1, args.steps // 3)
    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"pipemare_{args.recipe}.json")
    search: dict[str, float] = {}
    lr = args.lr
    if lr is None:
        if not args.find_lr:
            parser.error("give --lr or --find-lr")
        for candidate in (float(v) for v in args.find_lr.split(",")):
            result = run(args.recipe, "1f1b", candidate, args)
            search[str(candidate)] = final_loss(result["losses"])
            print(f"1f1b lr {candidate:g}: final loss {search[str(candidate)]:.4f}", flush=True)
        lr = min((float(k) for k in search), key=lambda k: (search[str(k)] != search[str(k)], search[str(k)]))
    lrs = [lr * float(f) for f in args.factors.split(",")]
    seeds = [int(v) for v in args.seeds.split(",")]
    results = []
    for value in lrs:
        for seed in seeds:
            for variant in args.variants.split(","):
                result = run(args.recipe, variant, value, args, seed)
                results.append(result)
                print(f"lr {value:g} seed {seed} {variant}: final {final_loss(result['losses']):.4f} "
                      f"copies {result['weight_copies']}", flush=True)  # fmt: skip
    table = summary(results, lrs)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "svg", "find_lr")}
    with open(out, "w") as f:
        json.dump(
            {"settings": settings, "lr_search": search, "best_1f1b_lr": lr, "table": table, "runs": results},
            f,
            indent=1,
        )
    print(markdown(table))
    title = (
        f"{args.recipe}: training loss, {args.stages} stages, {args.steps} steps (1F1B's best lr {lr:g} x "
        f"{args.factors})"
    )
    if len(seeds) > 1:
        title += f", mean of seeds {args.seeds}"
    svg(
        mean_over_seeds(results),
        lrs,
        title,
        args.svg or os.path.join(os.path.dirname(__file__), "..", "docs", f"pipemare-{args.recipe}.svg"),
    )


if __name__ == "__main__":
    main()

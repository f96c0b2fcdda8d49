"""Every asynchronous rule against 1F1B on four models, 3 seeds each, at 1F1B's best learning rate.

    python benchmarks/async_models.py                                  # everything (49 min on 2 shared cores)
    python benchmarks/async_models.py --models mlp --seeds 0 --rules pipedream,xpipe   # a subset, merged in
    python benchmarks/async_models.py --models mlp,mlp_wide,vgg --all-lrs   # the rules at the sweep's other rates too
    python benchmarks/async_models.py --report                         # the tables and picture again

Models (each small enough for CPU processes with one thread each; nothing is downloaded):

- ``mlp``: the tests' MLP (``tests.models.make_layers``: 8 layers, width 8) on the tests' separable
  task (``separable_loader``: 96 samples, batches of 16, 6 steps an epoch), 2 stages, 4 micro-batches,
  SGD with momentum 0.9, 120 steps.
- ``mlp_wide``: a second MLP of another shape (4 linear layers of width 32 with Tanh between them) on the
  same task, the shape a user would try: 4 stages, 8 micro-batches, SGD with momentum 0.9, 60 steps.
- ``bert``: the BERT masked-LM recipe (``size=tiny``: embeddings, 2 encoder layers, the head) on its
  offline text (the standard library's docstrings), vocabulary 1000, sequences of 32 tokens, batch 16,
  untied embeddings, AdamW with the recipe's warm-up (a tenth of the steps) and linear decay, 2 stages,
  4 micro-batches, 300 steps.
- ``vgg``: the VGG recipe (VGG11 with batch norm, ``width=0.125``) on its synthetic images, 10 classes,
  batch 16, SGD with momentum 0.9, weight decay 5e-4 and the recipe's cosine schedule, 2 stages,
  4 micro-batches, 200 steps.

For each model, 1F1B runs at each rate of the model's sweep on every seed; 1F1B's best rate is the one
with the lowest final loss averaged over the seeds. Every rule of :data:`RULES` then runs at that rate
on every seed (same initial weights and data order per seed as 1F1B's run). ``pipedream+nesterov``
(``delay_correction="nesterov"``, gamma 0.9) carries the momentum itself, so it runs the model's
optimizer without momentum at :data:`MATCHED` x the rate (the factor that makes its long-run step equal
momentum SGD's); it applies to the models trained with SGD and momentum, not to BERT's AdamW. On 2
stages ``wpipe`` is PipeDream's rule (its first half, stage 0, stashes with a delay of 1, its second
half, the last stage, has none), so there its losses equal ``pipedream``'s.

Final loss: the mean training loss (each batch's logged loss, recorded once) over the last 10% of the
steps (``mlp``: 12 of 120, two epochs of its task; ``mlp_wide``: 6 of 60, one epoch). Steps to 1F1B's
final loss: the first step at which the mean over the last 10% of steps is at or below the same seed's
1F1B final loss (None: never). The bound of issue 56: a rule "holds" on a seed when its final loss
<= 1.25 x 1F1B's + 0.05.

Results go to ``benchmarks/results/async_models.json`` (runs already there with the same settings are
reused, so a subset re-runs only what it names), the tables to stdout, the picture (loss against step,
mean over seeds, one panel per rate the rules ran at) to ``docs/async-models-<model>.svg``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from pipemare_convergence import draw, final_loss, steps_to_reach, train_recorded

from lightning_pipe import PipelineStrategy

HERE = os.path.dirname(os.path.abspath(__file__))
GAMMA = 0.9
#: Nesterov's correction at delay 1 steps by about ``g (1 + (gamma + gamma^2) / (1 - gamma))`` in the long run,
#: SGD with momentum by ``g / (1 - gamma)``: this factor on the lr makes the two equal
MATCHED = (1 / (1 - GAMMA)) / (1 + (GAMMA + GAMMA**2) / (1 - GAMMA))
#: the bound of issue 56: final loss <= FACTOR x 1F1B's + MARGIN
FACTOR, MARGIN = 1.25, 0.05


@dataclass(frozen=True)
class Model:
    """One model of the benchmark: how it runs, and the learning rates 1F1B is swept over."""

    stages: int
    chunks: int
    steps: int
    lrs: tuple[float, ...]
    optimizer: str  # "sgd": SGD with momentum (Nesterov's correction applies), "adamw"
    extra: dict[str, Any] = field(default_factory=dict)


MODELS: dict[str, Model] = {
    "mlp": Model(stages=2, chunks=4, steps=120, lrs=(0.02, 0.05, 0.1, 0.2), optimizer="sgd"),
    "mlp_wide": Model(stages=4, chunks=8, steps=60, lrs=(0.01, 0.03, 0.1, 0.3), optimizer="sgd"),
    "bert": Model(stages=2, chunks=4, steps=300, lrs=(3e-4, 1e-3, 3e-3, 1e-2), optimizer="adamw",
                  extra={"vocab": 1000, "max_len": 32, "batch": 16, "chars": 400_000}),
    "vgg": Model(stages=2, chunks=4, steps=200, lrs=(0.01, 0.03, 0.1), optimizer="sgd",
                 extra={"depth": 11, "width": 0.125, "classes": 10, "batch": 16}),
}  # fmt: skip

#: rule -> (schedule, strategy options, "nesterov": plain SGD at MATCHED x the rate)
RULES: dict[str, tuple[str, dict[str, Any]]] = {
    "pipedream": ("pipedream", {}),
    "pipedream_2bw": ("pipedream_2bw", {}),
    "pipemare": ("pipemare", {}),
    "xpipe": ("xpipe", {}),
    "wpipe": ("wpipe", {}),
    "pipedream_2bw+error_feedback": ("pipedream_2bw", {"delay_correction": "error_feedback"}),
    "pipedream+nesterov": ("pipedream", {"delay_correction": "nesterov"}),
}
COLOURS = {
    "1f1b": "#000000", "pipedream": "#d62728", "pipedream_2bw": "#ff7f0e", "pipemare": "#1f77b4",
    "xpipe": "#2ca02c", "wpipe": "#8c564b", "pipedream_2bw+error_feedback": "#e377c2",
    "pipedream+nesterov": "#9467bd",
}  # fmt: skip


def applies(rule: str, model: Model) -> bool:
    """Nesterov's correction carries SGD's momentum: only where the model trains with SGD and momentum."""
    return rule != "pipedream+nesterov" or model.optimizer == "sgd"


# ------------------------------------------------------------------ the models
class SGDNet(L.LightningModule):
    """An MLP under SGD (``momentum`` 0: plain SGD, for Nesterov's correction)."""

    def __init__(self, layers: nn.Sequential, lr: float, momentum: float) -> None:
        super().__init__()
        self.layers, self.lr, self.momentum = layers, lr, momentum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def wide_layers() -> nn.Sequential:
    from tests.models import CLASSES, IN

    width = 32
    return nn.Sequential(
        nn.Linear(IN, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
        nn.Linear(width, width), nn.Tanh(), nn.Linear(width, CLASSES),
    )  # fmt: skip


def build(name: str, spec: Model, lr: float, seed: int, momentum: float) -> tuple[Any, Any]:
    """The model (its initial weights from ``seed``) and its data."""
    from tests.models import make_layers, separable_loader

    torch.manual_seed(seed)  # the initial weights and the data order (the workers fork after this)
    if name in ("mlp", "mlp_wide"):
        layers = make_layers(8) if name == "mlp" else wide_layers()
        return SGDNet(layers, lr, momentum), separable_loader()
    x = spec.extra
    if name == "bert":
        from lightning_pipe.recipes.bert import BertMLM, TextData

        data = TextData(vocab_size=x["vocab"], max_len=x["max_len"], batch_size=x["batch"], limit_chars=x["chars"])
        model = BertMLM(vocab_size=x["vocab"], size="tiny", max_len=x["max_len"], lr=lr,
                        warmup_steps=max(1, spec.steps // 10), max_steps=spec.steps, tie_embeddings=False,
                        build="eager")  # fmt: skip
        return model, data
    from lightning_pipe.recipes.vgg import CIFAR100Data, VGGClassifier

    data = CIFAR100Data(source="synthetic", batch_size=x["batch"], num_classes=x["classes"], augment=False,
                        synthetic_train=x["batch"] * spec.steps, synthetic_val=x["batch"])  # fmt: skip
    model = VGGClassifier(depth=x["depth"], width=x["width"], num_classes=x["classes"], lr=lr, momentum=momentum,
                          max_steps=spec.steps, build="eager")  # fmt: skip
    return model, data


def run(name: str, spec: Model, rule: str, lr: float, seed: int) -> dict[str, Any]:
    """One training run of the real engine on ``spec.stages`` CPU processes; rank 0's loss of every batch."""
    schedule, options = RULES.get(rule, ("1f1b", {}))
    nesterov = options.get("delay_correction") == "nesterov"
    options = dict(options)
    if schedule == "pipemare":
        options["pipemare_warmup"] = max(1, spec.steps // 3)
    model, data = build(name, spec, lr * (MATCHED if nesterov else 1.0), seed, 0.0 if nesterov else GAMMA)
    strategy = PipelineStrategy(schedule=schedule, chunks=spec.chunks, start_method="fork", **options)
    losses, copies = train_recorded(model, data, strategy, spec.stages, spec.steps)
    return {"model": name, "rule": rule, "lr": lr, "seed": seed, "losses": losses, "weight_copies": copies,
            "settings": asdict(spec)}  # fmt: skip


# ------------------------------------------------------------------ the summary (no processes)
def key(r: dict[str, Any]) -> tuple[str, str, float, int]:
    return (r["model"], r["rule"], float(r["lr"]), int(r["seed"]))


def finite_mean(values: Sequence[float]) -> float:
    """The mean, or inf where a run diverged (so it never wins a comparison)."""
    if any(v != v or abs(v) == float("inf") for v in values):
        return float("inf")
    return sum(values) / len(values)


def holds(loss: float, reference: float) -> bool:
    """Issue 56's bound: within 1.25 x 1F1B's final loss + 0.05."""
    return loss == loss and loss <= FACTOR * reference + MARGIN


def best_lr(runs: Sequence[dict[str, Any]], name: str, seeds: Sequence[int]) -> float | None:
    """1F1B's learning rate with the lowest final loss averaged over ``seeds`` (None: no complete sweep)."""
    by_lr: dict[float, dict[int, float]] = {}
    for r in runs:
        if r["model"] == name and r["rule"] == "1f1b":
            by_lr.setdefault(float(r["lr"]), {})[int(r["seed"])] = final_loss(r["losses"])
    complete = {lr: finite_mean([v[s] for s in seeds]) for lr, v in by_lr.items() if all(s in v for s in seeds)}
    return min(complete, key=lambda lr: (complete[lr], lr)) if complete else None


def summarize(
    runs: Sequence[dict[str, Any]], name: str, seeds: Sequence[int], lr: float | None = None
) -> dict[str, Any] | None:
    """One model's results: the sweep, 1F1B's best rate, and per rule at rate ``lr`` (None: that best rate)
    each seed's final loss, the step reaching 1F1B's final loss at that rate, whether the bound holds; the
    best asynchronous rule (lowest mean)."""
    best = best_lr(runs, name, seeds)
    if best is None:
        return None
    lr = best if lr is None else lr
    mine = {key(r): r for r in runs if r["model"] == name}
    sweep = {
        f"{v:g}": [round(final_loss(mine[(name, "1f1b", v, s)]["losses"]), 4) for s in seeds]
        for v in sorted({k[2] for k in mine if k[1] == "1f1b"})
        if all((name, "1f1b", v, s) in mine for s in seeds)
    }
    reference = {s: final_loss(mine[(name, "1f1b", lr, s)]["losses"]) for s in seeds}
    rows = []
    for rule in ["1f1b", *RULES]:
        if not all((name, rule, lr, s) in mine for s in seeds):
            continue
        finals = [final_loss(mine[(name, rule, lr, s)]["losses"]) for s in seeds]
        rows.append({
            "rule": rule, "final_losses": [round(f, 4) for f in finals], "mean": round(finite_mean(finals), 4),
            "vs_1f1b": [round(f / reference[s], 3) for f, s in zip(finals, seeds)],
            "steps_to_1f1b_final": [steps_to_reach(mine[(name, rule, lr, s)]["losses"], reference[s]) for s in seeds],
            "holds": [holds(f, reference[s]) for f, s in zip(finals, seeds)],
            "weight_copies": mine[(name, rule, lr, seeds[0])]["weight_copies"],
        })  # fmt: skip
    asynchronous = [row for row in rows if row["rule"] != "1f1b"]
    first = min(asynchronous, key=lambda row: row["mean"]) if asynchronous else None
    return {
        "model": name, "seeds": list(seeds), "sweep": sweep, "best_lr": best, "lr": lr, "rows": rows,
        "best_rule": first["rule"] if first else None, "bound_holds": all(first["holds"]) if first else None,
        "rules_within_bound": [row["rule"] for row in asynchronous if all(row["holds"])],
    }  # fmt: skip


def loss_text(value: float, digits: int = 4) -> str:
    """A loss with ``digits`` decimals; a diverged one (1000 or more) in 3 significant digits."""
    return f"{value:.{digits}f}" if abs(value) < 1000 else f"{value:.3g}"


def markdown(summary: dict[str, Any]) -> str:
    """One model's table: the sweep line, then a row per rule at 1F1B's best rate."""
    seeds = ", ".join(str(s) for s in summary["seeds"])
    sweep = "; ".join(f"lr {lr}: {', '.join(f'{v:.4f}' for v in vs)}" for lr, vs in summary["sweep"].items())
    rate = "" if summary["lr"] == summary["best_lr"] else f" Rows at lr {summary['lr']:g}, not 1F1B's best."
    lines = [f"1F1B's sweep (final loss, seeds {seeds}): {sweep}. Best: lr {summary['best_lr']:g}.{rate}", "",
             "| rule | final loss per seed | mean | x 1F1B per seed | steps to 1F1B's final loss | within bound "
             "| weight copies per stage |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in summary["rows"]:
        losses = ", ".join(loss_text(v) for v in row["final_losses"])
        ratios = ", ".join(loss_text(v, 2) for v in row["vs_1f1b"])
        reach = ", ".join(str(v) if v is not None else "never" for v in row["steps_to_1f1b_final"])
        within = ", ".join("yes" if h else "no" for h in row["holds"])
        copies = ", ".join(f"{c:g}" for c in row["weight_copies"])
        lines.append(
            f"| {row['rule']} | {losses} | {loss_text(row['mean'])} | {ratios} | {reach} | {within} | {copies} |"
        )
    verdict = "holds on every seed" if summary["bound_holds"] else "does not hold on every seed"
    lines += ["", f"Best asynchronous rule (lowest mean): {summary['best_rule']}; the bound {verdict}. Rules within "
              f"the bound on every seed: {', '.join(summary['rules_within_bound']) or 'none'}."]  # fmt: skip
    return "\n".join(lines)


def overview(summaries: Sequence[dict[str, Any]]) -> str:
    """Every rule in each summary (each model at 1F1B's best rate, or one model at several rates): its final loss
    (mean over the seeds) and on how many seeds the bound holds (a ratio says little where 1F1B's loss is near
    0); the schedule table of the docs."""
    names = [s["model"] for s in summaries]
    lines = ["| rule | " + " | ".join(f"{n} (lr {s['lr']:g})" for n, s in zip(names, summaries)) + " |",
             "|---|" + "---|" * len(names)]  # fmt: skip
    for rule in ["1f1b", *RULES]:
        cells = []
        for summary in summaries:
            row = next((r for r in summary["rows"] if r["rule"] == rule), None)
            if row is None:
                cells.append("-")
                continue
            cells.append(f"{loss_text(row['mean'])}; {sum(row['holds'])}/{len(row['holds'])}")
        lines.append(f"| {rule} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def loss_at(runs: Sequence[dict[str, Any]], summary: dict[str, Any]) -> str:
    """A compact table of the loss at a tenth, a quarter, half and all of the steps (mean over seeds of the
    mean over the last 10% of steps ending there)."""
    name, lr = summary["model"], summary["lr"]
    steps = len(next(r["losses"] for r in runs if key(r)[:3] == (name, "1f1b", lr)))
    window = max(1, steps // 10)
    at = sorted({max(1, steps // 10), max(1, steps // 4), max(1, steps // 2), steps})
    lines = ["| rule | " + " | ".join(f"step {t}" for t in at) + " |", "|---|" + "---|" * len(at)]
    for row in summary["rows"]:
        mine = [r["losses"] for r in runs if key(r)[:3] == (name, row["rule"], lr) and r["seed"] in summary["seeds"]]
        cells = []
        for t in at:
            windows = [sum(ls[max(0, t - window) : t]) / len(ls[max(0, t - window) : t]) for ls in mine]
            cells.append(f"{sum(windows) / len(windows):.3f}")
        lines.append(f"| {row['rule']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def picture(runs: Sequence[dict[str, Any]], summaries: Sequence[dict[str, Any]], path: str) -> None:
    """Loss against step, mean over seeds, one line per rule: one panel per rate the rules ran at (1F1B's best
    first), one picture per model (its own scale) at ``path`` with ``{model}`` replaced by the model's name."""
    for summary in summaries:
        name, seeds = summary["model"], summary["seeds"]
        panels = []
        for at in [summary, *other_rates(runs, summary)]:
            mean = []
            for row in at["rows"]:
                mine = [r["losses"] for r in runs if key(r)[:3] == (name, row["rule"], at["lr"]) and r["seed"] in seeds]
                mean.append({"variant": row["rule"], "losses": [sum(v) / len(v) for v in zip(*mine)]})
            best = " (1F1B's best)" if at["lr"] == at["best_lr"] else ""
            panels.append((f"lr {at['lr']:g}{best} (step)", mean))
        finite = sorted(v for _, mean in panels for r in mean for v in r["losses"] if v == v and abs(v) < 1e6)
        first = max(r["losses"][0] for _, mean in panels for r in mean)
        ceiling = 1.05 * first / finite[len(finite) // 2]  # the scale's top: the highest first loss
        spec = MODELS[name]
        title = (f"{name}: training loss, {spec.stages} stages, {spec.chunks} micro-batches, mean of seeds "
                 f"{', '.join(str(s) for s in seeds)}")  # fmt: skip
        draw(panels, title, path.replace("{model}", name), ["1f1b", *RULES], COLOURS, ceiling=ceiling)


def other_rates(runs: Sequence[dict[str, Any]], summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The model's summaries at the sweep's other rates where an asynchronous rule ran on every seed."""
    out = []
    for value in summary["sweep"]:
        lr = float(value)
        if lr != summary["best_lr"]:
            other = summarize(runs, summary["model"], summary["seeds"], lr)
            if other is not None and other["best_rule"] is not None:
                out.append(other)
    return out


# ------------------------------------------------------------------ the grid
def load(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return list(json.load(f)["runs"])


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal settings, whether read back from JSON (lists) or not (tuples); the sweep's rates are not the run's
    (a rate added to a sweep re-runs nothing else)."""
    a, b = ({k: v for k, v in json.loads(json.dumps(x)).items() if k != "lrs"} for x in (a, b))
    return a == b


def grid(
    specs: dict[str, Model],
    seeds: Sequence[int],
    rules: Sequence[str],
    runs: list[dict[str, Any]],
    save: Callable[[], None],
    runner: Callable[..., dict[str, Any]] = run,
    all_lrs: bool = False,
) -> None:
    """The sweep, then every rule at 1F1B's best rate (``all_lrs``: then at the sweep's other rates too); a run
    already in ``runs`` with the same settings is reused."""
    done = {key(r): r for r in runs}

    def once(name: str, rule: str, lr: float, seed: int) -> None:
        old = done.get((name, rule, lr, seed))
        if old is not None and same(old["settings"], asdict(specs[name])):
            return
        if old is not None:
            runs.remove(old)  # other settings (e.g. --steps): run again
        result = runner(name, specs[name], rule, lr, seed)
        runs.append(result)
        done[key(result)] = result
        print(f"{name} {rule} lr {lr:g} seed {seed}: final {final_loss(result['losses']):.4f}", flush=True)
        save()

    for name, spec in specs.items():
        for lr in spec.lrs:
            for seed in seeds:
                once(name, "1f1b", lr, seed)
        best = best_lr(runs, name, seeds)
        assert best is not None
        for lr in [best, *(v for v in spec.lrs if all_lrs and v != best)]:
            for seed in seeds:
                for rule in rules:
                    if rule != "1f1b" and applies(rule, spec):
                        once(name, rule, lr, seed)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rules", default=",".join(RULES), help="asynchronous rules (1F1B's sweep always runs)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "async_models.json"))
    parser.add_argument("--svg", default=os.path.join(HERE, "..", "docs", "async-models-{model}.svg"),
                        help="the pictures' path, {model} replaced by each model's name")  # fmt: skip
    parser.add_argument("--steps", type=int, default=None, help="every model's steps (default: its own; a smoke run)")
    parser.add_argument(
        "--all-lrs", action="store_true", help="the rules at every rate of the sweep, not only the best"
    )
    parser.add_argument("--report", action="store_true", help="only the tables and the picture of --out")
    args = parser.parse_args(argv)
    names, rules = args.models.split(","), args.rules.split(",")
    seeds = [int(v) for v in args.seeds.split(",")]
    for name in names:
        if name not in MODELS:
            parser.error(f"--models: {name!r} is not a model; valid: {', '.join(MODELS)}")
    for rule in rules:
        if rule not in RULES:
            parser.error(f"--rules: {rule!r} is not a rule; valid: {', '.join(RULES)}")
    torch.set_num_threads(1)
    runs = load(args.out)

    def save() -> None:
        summaries = [s for s in (summarize(runs, n, seeds) for n in MODELS) if s is not None]
        others = [o for s in summaries for o in other_rates(runs, s)]
        with open(args.out, "w") as f:
            json.dump({"factor": FACTOR, "margin": MARGIN, "matched": MATCHED, "summaries": summaries,
                       "other_rates": others, "runs": runs}, f, indent=1)  # fmt: skip

    specs = {n: MODELS[n] if args.steps is None else replace(MODELS[n], steps=args.steps) for n in names}
    if not args.report:
        grid(specs, seeds, rules, runs, save, all_lrs=args.all_lrs)
    summaries = [s for s in (summarize(runs, n, seeds) for n in names) if s is not None]
    for summary in summaries:
        print(f"\n### {summary['model']}\n\n{markdown(summary)}\n\n{loss_at(runs, summary)}")
        others = other_rates(runs, summary)
        for other in others:
            print(f"\n### {summary['model']} at lr {other['lr']:g}\n\n{markdown(other)}")
        if others:
            rates = sorted([summary, *others], key=lambda s: s["lr"])
            print(f"\n### {summary['model']}, every rate: mean final loss; seeds within the bound\n\n{overview(rates)}")
    if summaries:
        print(f"\n### Every rule at 1F1B's best rate: mean final loss; seeds within the bound\n\n{overview(summaries)}")
        picture(runs, summaries, args.svg)


if __name__ == "__main__":
    main()

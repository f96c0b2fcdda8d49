"""Every asynchronous rule, with and without each delay correction, against 1F1B on six models, 3 seeds each,
at 1F1B's best learning rate (``--triple``: and at 3x it).

    python benchmarks/async_models.py                                  # everything at the best rate
    python benchmarks/async_models.py --models char_gpt,conv_bn --triple   # the best rate and 3x it
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
- ``char_gpt``: a character-level GPT (learned token and position embeddings, 2 pre-norm causal transformer
  blocks of width 32 with 2 heads, a norm and the head) on windows of 32 characters of the standard library's
  ``argparse`` source (characters above 127 as 127), batch 16, AdamW (weight decay 0.01), 2 stages,
  4 micro-batches, 90 steps (one pass over its windows).
- ``conv_bn``: a convolutional net with batch norm (three 3x3 convolutions of 16, 32, 32 channels, each with
  batch norm and ReLU, the second of stride 2, global average pooling and a linear head) on noisy 12x12
  images around one random pattern per class, 10 classes, batch 16, SGD with momentum 0.9, 2 stages,
  4 micro-batches, 90 steps.

For each model, 1F1B runs at each rate of the model's sweep on every seed; 1F1B's best rate is the one
with the lowest final loss averaged over the seeds. Every rule of :data:`RULES` then runs at that rate
on every seed (same initial weights and data order per seed as 1F1B's run). The ``+nesterov`` rules
(``delay_correction="nesterov"``: NAdam's step, beta1 0.99) run plain SGD in place of the model's optimizer,
at the rate on the AdamW models and at :data:`NESTEROV_SGD_RATE` x the rate on the SGD ones (not on BERT,
whose recipe builds its optimizer). ``+error_feedback`` refuses SGD, so it runs on the AdamW models only. On 2
stages ``wpipe`` is PipeDream's rule (its first half, stage 0, stashes with a delay of 1, its second
half, the last stage, has none), so there its losses equal ``pipedream``'s.

Final loss: the mean training loss (each batch's logged loss, recorded once) over the last 10% of the
steps (``mlp``: 12 of 120, two epochs of its task; ``mlp_wide``: 6 of 60, one epoch). Steps to 1F1B's
final loss: the first step at which the mean over the last 10% of steps is at or below the same seed's
1F1B final loss (None: never). The bound: a rule "holds" on a seed when its final loss <= 1.25 x 1F1B's
+ 0.05.

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
#: ``delay_correction="nesterov"`` steps as NAdam does (about lr per weight); on a model trained with SGD and
#: momentum 0.9 (about 10 lr times the gradient per step) its runs take this factor on the rate (a choice, not
#: tuned); on a model trained with AdamW they take the same rate
NESTEROV_SGD_RATE = 0.1
#: the bound: final loss <= FACTOR x 1F1B's + MARGIN
FACTOR, MARGIN = 1.25, 0.05


@dataclass(frozen=True)
class Model:
    """One model of the benchmark: how it runs, and the learning rates 1F1B is swept over."""

    stages: int
    chunks: int
    steps: int
    lrs: tuple[float, ...]
    optimizer: str  # "sgd": SGD with momentum (error feedback is refused with it), "adamw"
    extra: dict[str, Any] = field(default_factory=dict)


MODELS: dict[str, Model] = {
    "mlp": Model(stages=2, chunks=4, steps=120, lrs=(0.02, 0.05, 0.1, 0.2), optimizer="sgd"),
    "mlp_wide": Model(stages=4, chunks=8, steps=60, lrs=(0.01, 0.03, 0.1, 0.3), optimizer="sgd"),
    "bert": Model(stages=2, chunks=4, steps=300, lrs=(3e-4, 1e-3, 3e-3, 1e-2), optimizer="adamw",
                  extra={"vocab": 1000, "max_len": 32, "batch": 16, "chars": 400_000}),
    "vgg": Model(stages=2, chunks=4, steps=200, lrs=(0.01, 0.03, 0.1), optimizer="sgd",
                 extra={"depth": 11, "width": 0.125, "classes": 10, "batch": 16}),
    "char_gpt": Model(stages=2, chunks=4, steps=90, lrs=(0.001, 0.003, 0.009, 0.027), optimizer="adamw",
                      extra={"seq": 32, "batch": 16, "width": 32, "heads": 2, "blocks": 2}),
    "conv_bn": Model(stages=2, chunks=4, steps=90, lrs=(0.01, 0.03, 0.09, 0.27), optimizer="sgd",
                     extra={"classes": 10, "batch": 16, "size": 12}),
}  # fmt: skip

#: rule -> (schedule, strategy options; "nesterov": plain SGD, see :data:`NESTEROV_SGD_RATE`)
RULES: dict[str, tuple[str, dict[str, Any]]] = {
    "pipedream": ("pipedream", {}),
    "pipedream_2bw": ("pipedream_2bw", {}),
    "pipemare": ("pipemare", {}),
    "xpipe": ("xpipe", {}),
    "wpipe": ("wpipe", {}),
    "pipedream_2bw+error_feedback": ("pipedream_2bw", {"delay_correction": "error_feedback"}),
    "pipedream+nesterov": ("pipedream", {"delay_correction": "nesterov"}),
    "pipedream_2bw+nesterov": ("pipedream_2bw", {"delay_correction": "nesterov"}),
    "wpipe+nesterov": ("wpipe", {"delay_correction": "nesterov"}),
}
COLOURS = {
    "1f1b": "#000000", "pipedream": "#d62728", "pipedream_2bw": "#ff7f0e", "pipemare": "#1f77b4",
    "xpipe": "#2ca02c", "wpipe": "#8c564b", "pipedream_2bw+error_feedback": "#e377c2",
    "pipedream+nesterov": "#9467bd", "pipedream_2bw+nesterov": "#bcbd22", "wpipe+nesterov": "#17becf",
}  # fmt: skip


def applies(rule: str, name: str) -> bool:
    """Error feedback refuses SGD: only where the model trains with AdamW. Nesterov's correction runs plain SGD in
    place of the model's optimizer: not on BERT, whose recipe builds its AdamW and warm-up itself."""
    if rule.endswith("+error_feedback"):
        return MODELS[name].optimizer == "adamw"
    return not rule.endswith("+nesterov") or name != "bert"


# ------------------------------------------------------------------ the models
class SGDNet(L.LightningModule):
    """A classifier (an MLP, the conv net) under SGD (``momentum`` 0: plain SGD, for Nesterov's correction), or
    AdamW (``adamw``); the loss is the cross-entropy over every position of the output's last dimension."""

    def __init__(self, layers: nn.Sequential, lr: float, momentum: float, adamw: bool = False) -> None:
        super().__init__()
        self.layers, self.lr, self.momentum, self.adamw = layers, lr, momentum, adamw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        if self.adamw:
            return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


class Embed(nn.Module):
    """Characters and their positions, embedded."""

    def __init__(self, vocab: int, seq: int, width: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(seq, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tokens(x) + self.positions(torch.arange(x.shape[1], device=x.device))


class Block(nn.Module):
    """A pre-norm causal transformer block."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.norm1(x)
        x = x + self.attention(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


def char_gpt_layers(x: dict[str, Any], vocab: int) -> nn.Sequential:
    blocks = [Block(x["width"], x["heads"]) for _ in range(x["blocks"])]
    head = nn.Sequential(nn.LayerNorm(x["width"]), nn.Linear(x["width"], vocab))
    return nn.Sequential(Embed(vocab, x["seq"], x["width"]), *blocks, head)


def char_text_loader(x: dict[str, Any], steps: int) -> tuple[Any, int]:
    """Windows of ``seq`` characters of the standard library's ``argparse`` source (offline, the same on every
    machine with this Python), the next character as target; characters above 127 as 127. Shuffled by torch's
    generator (seeded before)."""
    import argparse as text_source

    from torch.utils.data import DataLoader, TensorDataset

    with open(text_source.__file__, encoding="utf-8") as f:
        codes = torch.tensor([min(ord(c), 127) for c in f.read()])
    n = x["batch"] * steps  # as many windows as the run takes: one epoch
    starts = torch.randint(0, len(codes) - x["seq"] - 1, (n,))
    windows = torch.stack([codes[s : s + x["seq"] + 1] for s in starts.tolist()])
    data = TensorDataset(windows[:, :-1], windows[:, 1:])
    return DataLoader(data, batch_size=x["batch"], shuffle=False), 128


def conv_bn_layers(x: dict[str, Any]) -> nn.Sequential:
    def unit(a: int, b: int, stride: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(a, b, 3, stride, 1, bias=False), nn.BatchNorm2d(b), nn.ReLU())

    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, x["classes"]))
    return nn.Sequential(unit(3, 16, 1), unit(16, 32, 2), unit(32, 32, 1), head)


def image_loader(x: dict[str, Any], steps: int) -> Any:
    """Noisy images around one random pattern per class (``size`` pixels square, 3 channels): as many as the
    run takes, one epoch."""
    from torch.utils.data import DataLoader, TensorDataset

    patterns = torch.randn(x["classes"], 3, x["size"], x["size"])
    labels = torch.randint(0, x["classes"], (x["batch"] * steps,))
    images = patterns[labels] + 1.5 * torch.randn(len(labels), 3, x["size"], x["size"])
    return DataLoader(TensorDataset(images, labels), batch_size=x["batch"], shuffle=False)


def wide_layers() -> nn.Sequential:
    from tests.models import CLASSES, IN

    width = 32
    return nn.Sequential(
        nn.Linear(IN, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
        nn.Linear(width, width), nn.Tanh(), nn.Linear(width, CLASSES),
    )  # fmt: skip


def build(name: str, spec: Model, lr: float, seed: int, plain: bool = False) -> tuple[Any, Any]:
    """The model (its initial weights from ``seed``) and its data; ``plain``: plain SGD in place of the model's
    optimizer (for Nesterov's correction)."""
    from tests.models import make_layers, separable_loader

    torch.manual_seed(seed)  # the initial weights and the data order (the workers fork after this)
    momentum = 0.0 if plain else GAMMA
    x = spec.extra
    if name in ("mlp", "mlp_wide"):
        layers = make_layers(8) if name == "mlp" else wide_layers()
        return SGDNet(layers, lr, momentum), separable_loader()
    if name == "char_gpt":
        data, vocab = char_text_loader(x, spec.steps)
        return SGDNet(char_gpt_layers(x, vocab), lr, 0.0, adamw=not plain), data
    if name == "conv_bn":
        data = image_loader(x, spec.steps)
        return SGDNet(conv_bn_layers(x), lr, momentum), data
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
    rate = lr * (NESTEROV_SGD_RATE if nesterov and spec.optimizer == "sgd" else 1.0)
    model, data = build(name, spec, rate, seed, plain=nesterov)
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
    """The bound: within 1.25 x 1F1B's final loss + 0.05."""
    return loss == loss and loss <= FACTOR * reference + MARGIN


def best_lr(
    runs: Sequence[dict[str, Any]], name: str, seeds: Sequence[int], sweep: Sequence[float] | None = None
) -> float | None:
    """1F1B's learning rate with the lowest final loss averaged over ``seeds`` (None: no complete sweep); with
    ``sweep``, among those rates only (1F1B's runs at 3x the best do not count)."""
    by_lr: dict[float, dict[int, float]] = {}
    for r in runs:
        if r["model"] == name and r["rule"] == "1f1b" and (sweep is None or float(r["lr"]) in sweep):
            by_lr.setdefault(float(r["lr"]), {})[int(r["seed"])] = final_loss(r["losses"])
    complete = {lr: finite_mean([v[s] for s in seeds]) for lr, v in by_lr.items() if all(s in v for s in seeds)}
    return min(complete, key=lambda lr: (complete[lr], lr)) if complete else None


def summarize(
    runs: Sequence[dict[str, Any]],
    name: str,
    seeds: Sequence[int],
    lr: float | None = None,
    sweep: Sequence[float] | None = None,
) -> dict[str, Any] | None:
    """One model's results: the sweep, 1F1B's best rate, and per rule at rate ``lr`` (None: that best rate)
    each seed's final loss, the step reaching 1F1B's final loss at that rate, whether the bound holds; the
    best asynchronous rule (lowest mean). ``sweep``: the rates 1F1B's best is chosen among (None: all it ran at)."""
    sweep_lrs = sweep
    best = best_lr(runs, name, seeds, sweep)
    if best is None:
        return None
    lr = best if lr is None else lr
    mine = {key(r): r for r in runs if r["model"] == name}
    sweep = {
        f"{v:g}": [round(final_loss(mine[(name, "1f1b", v, s)]["losses"]), 4) for s in seeds]
        for v in sorted({k[2] for k in mine if k[1] == "1f1b"})
        if all((name, "1f1b", v, s) in mine for s in seeds) and (sweep_lrs is None or v in sweep_lrs)
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
        "sweep_lrs": None if sweep_lrs is None else list(sweep_lrs),
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
    """The model's summaries at 1F1B's other rates (the sweep's, 3x the best) where an asynchronous rule ran on
    every seed."""
    out = []
    rates = sorted({float(r["lr"]) for r in runs if r["model"] == summary["model"] and r["rule"] == "1f1b"})
    for lr in rates:
        if lr != summary["best_lr"] and all(
            any(key(r) == (summary["model"], "1f1b", lr, s) for r in runs) for s in summary["seeds"]
        ):
            other = summarize(runs, summary["model"], summary["seeds"], lr, summary.get("sweep_lrs"))
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
    triple: bool = False,
) -> None:
    """The sweep, then every rule at 1F1B's best rate (``all_lrs``: then at the sweep's other rates too;
    ``triple``: then at 3x it, 1F1B included); a run already in ``runs`` with the same settings is reused."""
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
        best = best_lr(runs, name, seeds, spec.lrs)
        assert best is not None
        rates = [best, *(v for v in spec.lrs if all_lrs and v != best)]
        if triple and round(3 * best, 10) not in rates:
            rates.append(round(3 * best, 10))
        for lr in rates:
            for seed in seeds:
                once(name, "1f1b", lr, seed)  # run already where lr is in the sweep
                for rule in rules:
                    if rule != "1f1b" and applies(rule, name):
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
    parser.add_argument("--triple", action="store_true", help="the rules at 3x 1F1B's best rate too")
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
        summaries = [s for s in (summarize(runs, n, seeds, sweep=MODELS[n].lrs) for n in MODELS) if s is not None]
        others = [o for s in summaries for o in other_rates(runs, s)]
        with open(args.out, "w") as f:
            json.dump({"factor": FACTOR, "margin": MARGIN, "nesterov_sgd_rate": NESTEROV_SGD_RATE,
                       "summaries": summaries, "other_rates": others, "runs": runs}, f, indent=1)  # fmt: skip

    specs = {n: MODELS[n] if args.steps is None else replace(MODELS[n], steps=args.steps) for n in names}
    if not args.report:
        grid(specs, seeds, rules, runs, save, all_lrs=args.all_lrs, triple=args.triple)
    summaries = [s for s in (summarize(runs, n, seeds, sweep=specs[n].lrs) for n in names) if s is not None]
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

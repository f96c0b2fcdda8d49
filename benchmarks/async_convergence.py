"""Convergence of every asynchronous schedule against synchronous 1F1B, on the same runs.

    python benchmarks/async_convergence.py mlp               # the test MLP: SGD at lr 0.3 and 0.1, the NAdam sweep
    python benchmarks/async_convergence.py bert --steps 600  # the BERT recipe at 1F1B's best lr (1e-3)
    python benchmarks/async_convergence.py rule              # the update rules in one process, no pipeline
    python benchmarks/async_convergence.py --report benchmarks/results/async_mlp.json   # the tables again

Every schedule of ``SCHEDULES`` runs on 4 stages (4 CPU processes) with the same seed, data order and
initial weights per seed, against 1F1B under the same optimizer, learning rate and seed. Two
optimizers: the model's own (``mlp``: SGD with momentum 0.9; ``bert``: the recipe's AdamW with
warm-up and linear decay) and NAdam with beta1 = 0.99 (Ajanthan et al., "Nesterov Method for
Asynchronous Pipeline Parallel Optimization", ICML 2025: PipeDream's weight stashing with NAdam,
``torch.optim.NAdam(betas=(0.99, 0.999))``, torch's default ``momentum_decay=0.004`` as in their
recipe; on BERT their decoupled weight decay, here the recipe's 0.01), which runs under the
schedules in ``NADAM_SCHEDULES``.

For each run: the final loss (mean training loss over the last 10% of steps), the first step at
which the mean over a window of 10% of the steps reaches 1F1B's final loss (None: never), and
each stage's peak weight memory in copies of its weights (the parameters plus PipeDream's stashed
versions, PipeMare's velocity, XPipe's prediction and last-update buffers, as the runtime counts
them; optimizer state is not counted). Results go to a JSON file, the tables to stdout, and a
picture (loss against step, mean over seeds) to an SVG in docs/.

``rule`` replays the asynchronous update rules in one process on the same MLP, data and seeds:
stage ``i`` (2 layers) applies the gradient of batch ``t - d_i`` at step ``t``, computed at the
weights batch ``t - d_i`` ran on (PipeDream's stashing, 2BW's ``W(t+1) = W(t) - lr grad f(W(t-1))``
with ``d = 1`` on every stage). It also measures each stage's largest Hessian eigenvalue along
1F1B's trajectory: on a quadratic with curvature ``h``, SGD with momentum ``beta`` is stable for
``lr h < 2 (1 + beta)`` without delay and for ``lr h < 1 - beta`` with a delay of one step
(the characteristic polynomial ``z^2 - (1 + beta) z + beta + lr h``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from pipemare_convergence import build, draw, final_loss, markdown, mean_over_seeds, summary, train_recorded

from lightning_pipe import PipelineStrategy
from tests.models import TinyNet, dataset

#: every schedule the benchmark runs with the model's own optimizer (1F1B first: the reference)
SCHEDULES = ("1f1b", "pipedream", "pipedream_2bw", "pipemare", "xpipe", "wpipe")
#: the schedules that also run with NAdam beta1 = 0.99 (Ajanthan et al.); 1F1B is their reference
NADAM_SCHEDULES = ("1f1b", "pipedream")
NADAM_BETAS = (0.99, 0.999)
COLOURS = {
    "1f1b": "#000000", "pipedream": "#d62728", "pipedream_2bw": "#ff7f0e", "pipemare": "#1f77b4",
    "xpipe": "#2ca02c", "1f1b+nadam": "#7f7f7f", "pipedream+nadam": "#e377c2",
}  # fmt: skip
HERE = os.path.dirname(os.path.abspath(__file__))


def variant(schedule: str, optimizer: str) -> str:
    return schedule if optimizer == "own" else f"{schedule}+{optimizer}"


class NAdamNet(TinyNet):
    """The test MLP under NAdam with beta1 = 0.99."""

    def configure_optimizers(self) -> Any:
        return torch.optim.NAdam(self.parameters(), lr=self.lr, betas=NADAM_BETAS)


def nadam_bert() -> type:
    """The BERT recipe with NAdam (beta1 = 0.99, the recipe's decoupled weight decay) in place of AdamW."""
    from lightning_pipe.recipes.bert import BertMLM
    from lightning_pipe.recipes.warmup import warmup_then_decay

    class NAdamBert(BertMLM):
        def configure_optimizers(self) -> Any:
            hp = self.hparams
            optimizer = torch.optim.NAdam(self.parameters(), lr=hp.lr, betas=NADAM_BETAS,
                                          weight_decay=hp.weight_decay, decoupled_weight_decay=True)  # fmt: skip
            schedule = warmup_then_decay(optimizer, hp.warmup_steps, hp.max_steps, "linear")
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    return NAdamBert


def mlp_loader(seed: int, args: argparse.Namespace) -> DataLoader:
    return DataLoader(dataset(n=args.samples, seed=seed), batch_size=args.batch, shuffle=False)


def run(recipe: str, schedule: str, optimizer: str, lr: float, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One training run; its losses (rank 0) and weight copies per stage."""
    extra: dict[str, Any] = {"pipemare_warmup": max(1, args.steps // 3)} if schedule == "pipemare" else {}
    if recipe == "mlp":
        torch.manual_seed(seed)  # the initial weights
        model: Any = (NAdamNet if optimizer == "nadam" else TinyNet)(lr=lr)  # TinyNet: SGD with momentum 0.9
        data: Any = mlp_loader(seed, args)
    else:
        model, data = build("bert", lr, args.steps, args, seed, nadam_bert() if optimizer == "nadam" else None)
    strategy = PipelineStrategy(schedule=schedule, chunks=args.chunks, start_method="fork", **extra)
    losses, copies = train_recorded(model, data, strategy, args.stages, args.steps)
    return {"variant": variant(schedule, optimizer), "reference": variant("1f1b", optimizer), "schedule": schedule,
            "optimizer": optimizer, "chunks": args.chunks, "lr": lr, "seed": seed, "losses": losses,
            "weight_copies": copies}  # fmt: skip


def grid(recipe: str, groups: Sequence[tuple[str, Sequence[str], Sequence[float]]], args: argparse.Namespace) -> list:
    """Every (optimizer, schedules, learning rates) group over every seed; 1F1B's run first."""
    seeds = [int(v) for v in args.seeds.split(",")]
    results = []
    for optimizer, schedules, lrs in groups:
        for lr in lrs:
            for seed in seeds:
                for schedule in schedules:
                    result = run(recipe, schedule, optimizer, lr, seed, args)
                    results.append(result)
                    print(f"{result['variant']} lr {lr:g} seed {seed}: final {final_loss(result['losses']):.4f} "
                          f"copies {result['weight_copies']}", flush=True)  # fmt: skip
    return results


def tables(results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """One summary per optimizer (each run against 1F1B under the same optimizer, rate and seed)."""
    out = {}
    for optimizer in dict.fromkeys(r["optimizer"] for r in results):
        mine = [r for r in results if r["optimizer"] == optimizer]
        out[optimizer] = summary(mine, list(dict.fromkeys(r["lr"] for r in mine)))
    return out


def best_lr(table: list[dict[str, Any]], name: str) -> float:
    """The learning rate at which ``name`` ended lowest (mean over seeds; a diverged run never wins)."""
    rows = [r for r in table if r["variant"] == name]
    return min(rows, key=lambda r: (r["final_loss"] != r["final_loss"], r["final_loss"]))["lr"]


def picture(results: list[dict[str, Any]], by_optimizer: dict[str, list], args: argparse.Namespace, path: str) -> None:
    """Loss against step (mean over seeds): one panel per learning rate of the model's own optimizer,
    and one for NAdam at the rate where PipeDream with NAdam ended lowest."""
    mean = mean_over_seeds(results)
    panels = [
        (f"{'SGD' if args.recipe == 'mlp' else 'AdamW'}, lr {lr:g} (step)",
         [r for r in mean if r["optimizer"] == "own" and r["lr"] == lr])
        for lr in dict.fromkeys(r["lr"] for r in results if r["optimizer"] == "own")
    ]  # fmt: skip
    if "nadam" in by_optimizer:
        lr = best_lr(by_optimizer["nadam"], "pipedream+nadam")
        panels.append(
            (f"NAdam b1 0.99, lr {lr:g} (step)", [r for r in mean if r["optimizer"] == "nadam" and r["lr"] == lr])
        )
    seeds = args.seeds.replace(",", ", ")
    which = f"mean of seeds {seeds}" if "," in args.seeds else f"seed {seeds}"
    title = f"{args.recipe}: training loss, {args.stages} stages, {args.chunks} micro-batches, {which}"
    names = list(dict.fromkeys(r["variant"] for r in results))
    draw(panels, title, path, names, COLOURS, ceiling=1.5)


# ------------------------------------------------------------------ the rules in one process
def stage_of(model: nn.Sequential, stages: int) -> dict[str, int]:
    """Parameter name -> stage under the uniform balance (layers split into equal runs)."""
    per = len(model) // stages
    return {name: min(int(name.split(".")[0]) // per, stages - 1) for name, _ in model.named_parameters()}


def replay(delays: Sequence[int], lr: float, seed: int, args: argparse.Namespace, momentum: float = 0.9) -> list[float]:
    """The asynchronous update rule in one process: at step ``t`` batch ``t`` runs on the current
    weights, then stage ``i``'s weights take SGD's step with the gradient of batch ``t - d_i``
    (computed at the weights that batch ran on); nothing before the first due gradient. Returns
    the loss of every batch (a non-finite loss ends the run)."""
    torch.manual_seed(seed)
    model = TinyNet(lr=lr).layers
    stage = stage_of(model, len(delays))
    params = dict(model.named_parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    grads: dict[int, dict[str, torch.Tensor]] = {}
    batches = iter(())
    losses: list[float] = []
    for t in range(args.steps):
        batch = next(batches, None)
        if batch is None:
            batches = iter(mlp_loader(seed, args))
            batch = next(batches)
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        losses.append(loss.item())
        if not torch.isfinite(loss):
            break
        grads[t] = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
        for name, p in params.items():
            source = t - delays[stage[name]]
            p.grad = grads[source][name] if source >= 0 else None
        optimizer.step()
        grads.pop(t - max(delays), None)
    return losses


def stage_curvature(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, stages: int) -> list[float]:
    """Each stage's largest Hessian eigenvalue of the loss on ``(x, y)`` (its diagonal block), then
    the whole Hessian's."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def loss(vector: torch.Tensor) -> torch.Tensor:
        tensors, start = {}, 0
        for name, shape in zip(names, shapes):
            tensors[name] = vector[start : start + shape.numel()].reshape(shape)
            start += shape.numel()
        return F.cross_entropy(torch.func.functional_call(model, tensors, (x,)), y)

    hessian = torch.autograd.functional.hessian(loss, flat)
    owner = stage_of(model, stages)
    index = torch.cat([torch.full((s.numel(),), owner[n]) for n, s in zip(names, shapes)])
    blocks = [float(torch.linalg.eigvalsh(hessian[index == i][:, index == i]).max()) for i in range(stages)]
    return blocks + [float(torch.linalg.eigvalsh(hessian).max())]


def curvature(lr: float, seed: int, args: argparse.Namespace, at: Sequence[int]) -> dict[int, list[float]]:
    """Each stage's largest Hessian eigenvalue (loss over the whole dataset) at steps ``at`` of 1F1B's rule."""
    torch.manual_seed(seed)
    model = TinyNet(lr=lr).layers
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    x, y = dataset(n=args.samples, seed=seed).tensors
    data = [b for _ in range(args.steps // max(1, args.samples // args.batch) + 1) for b in mlp_loader(seed, args)]
    out = {}
    for t in range(args.steps + 1):
        if t in at:
            out[t] = [round(v, 4) for v in stage_curvature(model, x, y, args.stages)]
        if t == args.steps:
            break
        optimizer.zero_grad()
        F.cross_entropy(model(data[t][0]), data[t][1]).backward()
        optimizer.step()
    return out


#: name -> (delay per stage, SGD's momentum)
RULES = {
    "1f1b": ((0, 0, 0, 0), 0.9), "pipedream": ((1, 1, 1, 0), 0.9), "pipedream_2bw": ((1, 1, 1, 1), 0.9),
    "last_stage_delayed": ((0, 0, 0, 1), 0.9), "pipedream_2bw_no_momentum": ((1, 1, 1, 1), 0.0),
}  # fmt: skip


def rules(args: argparse.Namespace) -> dict[str, Any]:
    """The rules' final losses per seed and learning rate, and the curvature along 1F1B's run."""
    seeds = [int(v) for v in args.seeds.split(",")]
    out: dict[str, Any] = {"final_loss": {}, "losses": {}, "curvature": {}}
    for lr in (0.3, 0.1):
        for name, (delays, momentum) in RULES.items():
            runs = [replay(delays, lr, s, args, momentum) for s in seeds]
            out["final_loss"][f"{name} lr {lr:g}"] = [round(final_loss(r), 4) for r in runs]
            out["losses"][f"{name} lr {lr:g}"] = runs
            print(
                f"rule {name} (delays {delays}, momentum {momentum:g}) lr {lr:g}: final "
                + ", ".join(f"{final_loss(r):.4f}" for r in runs)
            )
        for s in seeds:
            steps = [0, args.steps // 4, args.steps // 2, args.steps]
            out["curvature"][f"lr {lr:g} seed {s}"] = found = curvature(lr, s, args, steps)
            print(
                f"1f1b lr {lr:g} seed {s}: largest Hessian eigenvalue per stage, then of the whole, "
                f"at steps {steps}: {found}"
            )
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", choices=("mlp", "bert", "rule"), nargs="?", default="mlp")
    parser.add_argument("--report", default=None, help="print the Markdown tables of a results file and stop")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=None, help="micro-batches per batch (mlp: 8, bert: 4)")
    parser.add_argument("--steps", type=int, default=None, help="mlp: 60, bert: 600")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds (mlp: 0,1,2; bert: 0)")
    parser.add_argument("--lrs", default=None, help="the model's own optimizer's learning rates (mlp: 0.3,0.1; "
                        "bert: 1F1B's best, 0.001)")  # fmt: skip
    parser.add_argument("--nadam-lrs", default=None, help="NAdam's learning rates (mlp: 0.001,0.003,0.01,0.03,0.1,0.3;"
                        " bert: 0.001); empty: no NAdam runs")  # fmt: skip
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--nadam-schedules", default=",".join(NADAM_SCHEDULES))
    parser.add_argument("--batch", type=int, default=None, help="mlp: 16, bert: 32")
    parser.add_argument("--samples", type=int, default=64, help="mlp: the dataset's size (the tests' 64, read "
                        "for several epochs, so the loss falls by memorising them)")  # fmt: skip
    parser.add_argument("--vocab", type=int, default=2000)
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--chars", type=int, default=400_000)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/async_<recipe>.json")
    parser.add_argument("--svg", default=None, help="default: docs/async-<recipe>.svg (with --report: draw it again)")
    args = parser.parse_args(argv)
    if args.report:
        with open(args.report) as f:
            saved = json.load(f)
        for optimizer, table in saved["tables"].items():
            print(f"{optimizer}:\n{markdown(table)}\n")
        if args.svg:  # the picture again
            picture(saved["runs"], saved["tables"], argparse.Namespace(**saved["settings"]), args.svg)
        return
    mlp = args.recipe != "bert"
    defaults = {"chunks": 8 if mlp else 4, "steps": 60 if mlp else 600, "seeds": "0,1,2" if mlp else "0",
                "lrs": "0.3,0.1" if mlp else "0.001", "batch": 16 if mlp else 32,
                "nadam_lrs": "0.001,0.003,0.01,0.03,0.1,0.3" if mlp else "0.001"}  # fmt: skip
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    torch.set_num_threads(1)
    out = args.out or os.path.join(HERE, "results", f"async_{args.recipe}.json")
    if args.recipe == "rule":
        found = rules(args)
        with open(out, "w") as f:
            json.dump({"settings": vars(args), **found}, f, indent=1)
        return
    groups: list[tuple[str, Sequence[str], Sequence[float]]] = [
        ("own", args.schedules.split(","), [float(v) for v in args.lrs.split(",")])
    ]
    if args.nadam_lrs and args.nadam_schedules:  # --nadam-schedules "": none
        groups.append(("nadam", args.nadam_schedules.split(","), [float(v) for v in args.nadam_lrs.split(",")]))
    results = grid(args.recipe, groups, args)
    by_optimizer = tables(results)
    for optimizer, table in by_optimizer.items():
        print(f"{optimizer}:\n{markdown(table)}\n")
    with open(out, "w") as f:
        json.dump({"settings": vars(args), "tables": by_optimizer, "runs": results}, f, indent=1)
    picture(results, by_optimizer, args, args.svg or os.path.join(HERE, "..", "docs", f"async-{args.recipe}.svg"))


if __name__ == "__main__":
    main()

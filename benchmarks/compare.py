"""Side-by-side throughput and memory: lightning-pipe against torch.distributed.pipelining,
DeepSpeed's pipeline engine and plain Lightning, on the same models, stage split and micro-batches.

    python benchmarks/compare.py                       # both models, under 15 minutes on 2 CPU cores
    python benchmarks/compare.py --models mlp --rounds 3 --steps 20
    python benchmarks/compare.py --device cuda         # the GPU mode

Contenders (2 processes, one CPU thread each, gloo; plain runs use one process):

- ``plain``: single-process Lightning on whole batches;
- ``plain_micro``: single-process Lightning on the same micro-batches one after another
  (``accumulate_grad_batches=chunks``): the work a pipeline divides between its stages;
- ``pipe_1stage``: lightning-pipe on one process (one stage, the same micro-batches): its
  overhead over ``plain_micro``;
- ``pipe_<schedule>``: lightning-pipe with each schedule (``pipe_chimera``: Chimera, the same split
  kept twice, in two pipelines in opposite directions); ``pipe_1f1b_unfused``: its 1F1B with
  gradient-accumulation fusion switched off (``gradient_accumulation_fusion=False``), which shows
  what the fusion is worth and how the rest of lightning-pipe compares with torch's;
- ``torch_gpipe`` / ``torch_1f1b``: torch.distributed.pipelining's ``ScheduleGPipe`` and
  ``Schedule1F1B`` in a plain training loop (no Lightning), on the same stage split;
  ``torch_interleaved_1f1b`` / ``torch_zero_bubble`` / ``torch_interleaved_zero_bubble`` / ``torch_zbv``
  / ``torch_dualpipev``: its ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble`` (one stage
  per process: ZB-H1; two: interleaved zero bubble), ``ScheduleZBVZeroBubble`` and
  ``ScheduleDualPipeV``, on the same p x v split as ``pipe_interleaved_1f1b``, ``pipe_zero_bubble``,
  ``pipe_interleaved_zero_bubble``, ``pipe_zbv`` and ``pipe_dualpipev`` (``--contenders`` picks
  them; not in the default set);
- ``deepspeed_1f1b``: DeepSpeed's pipeline engine (its 1F1B ``TrainSchedule``), when DeepSpeed is
  installed (``pip install 'lightning-pipe[bench]'``); skipped with a message otherwise.

Rounds alternate between contenders (and their order) so that machine drift hits all of them;
extra rounds of only lightning-pipe's 1F1B (fused and unfused) and torch's tighten their paired
ratios. A step's time is taken on rank 0 from the end of one optimizer step to the end of the next
(loading the batch and the framework's work between steps count). The result is each contender's
median seconds per step and samples per second, the ratio of lightning-pipe's 1F1B to each (over
all steps, and the median of per-round ratios), and the ratio to the ideal pipeline: the faster
single-process run of the same micro-batches (``plain_micro`` or ``pipe_1stage``) x (m + p - 1) /
(p m). Per rank, where lightning-pipe's step time goes (forward, backward, posting and waiting for
communication, outside the executor). For the MLP, the peak bytes of activations each stage saves
for the backward under GPipe and 1F1B with each recompute mode, beside the closed forms. Writes
``results.json`` and ``throughput.svg`` to ``--out``.

GPU mode (``--device cuda``): the same with NCCL (``--share-gpu``: lightning-pipe's two ranks on
one GPU over gloo, torch's contenders skipped); per-action timings are CUDA events and each
rank reports the allocator's peak. With one GPU only the single-GPU contenders run (``plain``,
``plain_micro``, ``pipe_1stage``): NCCL cannot put two ranks on one GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import deepspeed_runner
from step_time import StepTimer, intervals
from workload import MODELS, STAGES, build_module, data, free_port

from lightning_pipe import PipelineStrategy
from lightning_pipe.partition import resolve_balance, stage_layers
from lightning_pipe.runtime.activations.meter import SavedActivationMeter
from lightning_pipe.schedules import (
    VIRTUAL_STAGES,
    stage_positions,
)

UNFUSED = "_unfused"  # a lightning-pipe contender without gradient-accumulation fusion
DEVICE = "cpu"  # "cuda" in GPU mode (set by main before processes fork)
SHARE_GPU = False  # --share-gpu: lightning-pipe's ranks all on cuda:0, over gloo


def _trainer_args(steps: int, callbacks: list) -> dict[str, Any]:
    return dict(
        max_steps=steps, max_epochs=-1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks,
        accelerator="gpu" if DEVICE == "cuda" else "cpu",
    )  # fmt: skip


def lightning_trainer(
    model: str, contender: str, steps: int, callbacks: list, **options: Any
) -> tuple[L.Trainer, DataLoader]:
    """The trainer and data of a Lightning contender: ``plain``, ``plain_micro``, ``pipe_1stage``
    (lightning-pipe on one process: its overhead over ``plain_micro``) or ``pipe_<schedule>``."""
    spec = MODELS[model]
    m = spec["chunks"]
    if contender == "plain_micro":
        trainer = L.Trainer(devices=1, accumulate_grad_batches=m, **_trainer_args(steps, callbacks))
        return trainer, data(model, spec["batch"] // m, steps * m)
    if contender == "plain":
        trainer = L.Trainer(devices=1, **_trainer_args(steps, callbacks))
    else:
        name = contender.removesuffix(UNFUSED)
        schedule = "1f1b" if name == "pipe_1stage" else name[len("pipe_") :]
        devices = 1 if name == "pipe_1stage" else STAGES
        options.setdefault("gradient_accumulation_fusion", not contender.endswith(UNFUSED))
        if SHARE_GPU and devices > 1:  # NCCL refuses two ranks on one GPU: gloo through host memory
            options.update(parallel_devices=[torch.device("cuda", 0)] * devices, process_group_backend="gloo")
            devices = 1
        strategy = PipelineStrategy(schedule=schedule, chunks=m, balance="parameters", start_method="fork", **options)
        trainer = L.Trainer(devices=devices, strategy=strategy, **_trainer_args(steps, callbacks))
    return trainer, data(model, spec["batch"], steps)


def fit_isolated(model: str, contender: str, steps: int, callbacks: list, **options: Any) -> None:
    """Fit a Lightning contender in a child process. A run in this process would initialize CUDA
    here (GPU mode), after which no later contender could fork its ranks; on CPUs it keeps one
    run's state (threads, allocator) out of the next."""

    def fit() -> None:
        trainer, loader = lightning_trainer(model, contender, steps, callbacks, **options)
        trainer.fit(build_module(model), loader)

    child = mp.get_context("fork").Process(target=fit)
    child.start()
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"{contender} on {model} failed (exit code {child.exitcode}); its output is above")


def run_lightning(model: str, contender: str, steps: int, warmup: int, folder: str) -> list[float]:
    path = os.path.join(folder, "times.json")
    every = MODELS[model]["chunks"] if contender == "plain_micro" else 1
    fit_isolated(model, contender, steps, [StepTimer(path, warmup, every)])
    with open(path) as f:
        return json.load(f)


def _torch_worker(rank: int, model: str, schedule: str, steps: int, warmup: int, port: int, path: str) -> None:
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleDualPipeV,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(DEVICE, rank) if DEVICE == "cuda" else torch.device("cpu")
    if DEVICE == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", rank=rank, world_size=STAGES)
    spec = MODELS[model]
    layers = build_module(model).layers
    # the same split as lightning-pipe's: p x v stages by parameters, placed as its schedule places them
    positions = stage_positions(schedule, STAGES, VIRTUAL_STAGES.get(schedule, 1))
    balance = resolve_balance("parameters", layers, len(positions))
    mine = [s for s, position in enumerate(positions) if position == rank]
    parts = [nn.Sequential(OrderedDict(stage_layers(layers, balance, s))).to(device) for s in mine]
    stages = [PipelineStage(part, s, len(positions), device) for s, part in zip(mine, parts)]
    single = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    multi = {
        "interleaved_1f1b": ScheduleInterleaved1F1B,
        "zero_bubble": ScheduleInterleavedZeroBubble,  # one stage per process: ZB-H1
        "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
        "zbv": ScheduleZBVZeroBubble,
        "dualpipev": ScheduleDualPipeV,
    }
    loss = nn.functional.cross_entropy
    pipe = (
        single[schedule](stages[0], spec["chunks"], loss_fn=loss)
        if schedule in single
        else multi[schedule](stages, spec["chunks"], loss_fn=loss)
    )
    optimizer = torch.optim.SGD([p for part in parts for p in part.parameters()], lr=0.01, momentum=0.9)
    first, last = 0 in mine, len(positions) - 1 in mine
    ends = []
    gc.collect()  # as every contender does before its timed steps
    for x, y in data(model, spec["batch"], steps):
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        pipe.step(*([x] if first else []), **({"target": y} if last else {}))
        optimizer.step()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        ends.append(time.perf_counter())
    if rank == 0:
        with open(path, "w") as f:
            json.dump(intervals(ends, warmup), f)
    dist.destroy_process_group()


def run_torch(model: str, contender: str, steps: int, warmup: int, folder: str) -> list[float]:
    path = os.path.join(folder, "times.json")
    mp.start_processes(
        _torch_worker,
        args=(model, contender[len("torch_") :], steps, warmup, free_port(), path),
        nprocs=STAGES,
        start_method="fork",
    )
    with open(path) as f:
        return json.load(f)


class _Meter(L.Callback):
    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.strategy.pipeline.runner.meter = SavedActivationMeter(pl_module.parameters())

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with open(os.path.join(self.folder, f"peak{trainer.global_rank}.json"), "w") as f:
            json.dump(trainer.strategy.pipeline.runner.meter.peak, f)


class _Breakdown(L.Callback):
    """Per-action timings of each rank's executor (CUDA events on a GPU), the step's time outside
    the executor (Lightning's loop, the optimizer, the glue) and, on a GPU, the allocator's peak."""

    def __init__(self, folder: str, warmup: int) -> None:
        self.folder, self.warmup, self.ends = folder, warmup, []

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.timeline = trainer.strategy.enable_timeline()
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        totals = self.timeline.totals(slice(self.warmup, None))
        step = statistics.mean(intervals(self.ends, self.warmup))
        result = {name: round(seconds, 6) for name, seconds in totals.items()}
        result["step_interval"] = round(step, 6)
        result["outside_executor"] = round(step - totals["step"], 6)
        if trainer.strategy.root_device.type == "cuda":
            result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        with open(os.path.join(self.folder, f"breakdown{trainer.global_rank}.json"), "w") as f:
            json.dump(result, f)


def breakdown(model: str, contender: str, steps: int, warmup: int) -> list[dict[str, float]]:
    """Where a lightning-pipe step's time goes, per rank: mean seconds per step in forwards (F),
    backwards (B), the rest of the executor's run (other: posting and waiting for communication),
    the executor's whole run (step) and outside it (outside_executor)."""
    with tempfile.TemporaryDirectory() as folder:
        fit_isolated(model, contender, steps, [_Breakdown(folder, warmup)])
        ranks = 1 if contender == "pipe_1stage" else STAGES
        return [json.load(open(os.path.join(folder, f"breakdown{r}.json"))) for r in range(ranks)]


def measure_memory(model: str, steps: int = 3) -> dict[str, Any]:
    spec = MODELS[model]
    m, p = spec["chunks"], STAGES
    peaks: dict[str, list[int]] = {}
    for schedule in ("gpipe", "1f1b"):
        for mode in ("never", "except_last", "always"):
            with tempfile.TemporaryDirectory() as folder:
                fit_isolated(model, f"pipe_{schedule}", steps, [_Meter(folder)], recompute=mode)
                peaks[f"{schedule}/{mode}"] = [json.loads(Path(folder, f"peak{r}.json").read_text()) for r in range(p)]
    per_microbatch = [peaks["gpipe/never"][s] / m for s in range(p)]
    layers = build_module(model).layers
    balance = resolve_balance("parameters", layers, p)
    widths = [spec["features"], *[_output_shape(layers, balance, s, spec) for s in range(p - 1)]]
    input_bytes = [4 * (spec["batch"] // m) * int(torch.tensor(w).prod()) for w in widths]
    return {
        "peak_bytes": peaks,
        "microbatches_held": {
            k: [round(v[s] / per_microbatch[s], 2) for s in range(p)] for k, v in peaks.items() if "never" in k
        },
        "closed_form_microbatches": {"gpipe/never": [m] * p, "1f1b/never": [min(p - s, m) for s in range(p)]},
        "ratio_1f1b_to_gpipe_stage0": peaks["1f1b/never"][0] / peaks["gpipe/never"][0],
        "bound_p_over_m": p / m,
        "stage_input_bytes_per_microbatch": input_bytes,
        # with recompute="always" a stage keeps its micro-batches' inputs; anything beyond is what
        # the step computes outside the Sequential (on the last stage: the logits the loss keeps)
        "always_bytes_beyond_stage_inputs": {
            k: [peaks[k][s] - held * input_bytes[s] for s, held in enumerate(counts)]
            for k, counts in (("gpipe/always", [m] * p), ("1f1b/always", [min(p - s, m) for s in range(p)]))
        },
    }


def _output_shape(layers: nn.Sequential, balance: list[int], stage: int, spec: dict[str, Any]) -> tuple[int, ...]:
    with torch.no_grad():
        x = torch.zeros(1, *spec["features"])
        for s in range(stage + 1):
            x = nn.Sequential(OrderedDict(stage_layers(layers, balance, s)))(x)
    return tuple(x.shape[1:])


def svg_chart(results: dict[str, Any]) -> str:
    """A bar chart of samples per second per contender, one panel per model, each scaled to its
    fastest contender (no plotting library)."""
    rows = [
        (model, name, r["samples_per_s"]) for model, res in results.items() for name, r in res["contenders"].items()
    ]
    if not rows:
        return (
            '<svg xmlns="http://www.w3.org/2000/svg" width="300" height="30"><text x="10" y="20">no '
            "results</text></svg>"
        )
    width, bar, gap = 760, 18, 6
    height = 40 + len(rows) * (bar + gap) + 20 * len(results)
    top = {model: max(v for m, _, v in rows if m == model) for model in results}  # each panel its own scale
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           'font-size="12">',
           '<text x="10" y="20" font-size="14">samples per second (higher is better), 2 CPU stages</text>']  # fmt: skip
    y = 36
    current = None
    for model, name, value in rows:
        if model != current:
            current = model
            out.append(f'<text x="10" y="{y + 12}" font-weight="bold">{model}</text>')
            y += 20
        length = 440 * value / top[model]
        color = "#2b7bba" if name.startswith("pipe_") else "#999999"
        out.append(f'<text x="10" y="{y + 13}">{name}</text>')
        out.append(f'<rect x="150" y="{y}" width="{length:.1f}" height="{bar}" fill="{color}"/>')
        out.append(f'<text x="{155 + length:.1f}" y="{y + 13}">{value:.1f}</text>')
        y += bar + gap
    out.append("</svg>")
    return "\n".join(out)


CPU_CONTENDERS = (
    "plain,plain_micro,pipe_1stage,pipe_gpipe,pipe_1f1b,pipe_1f1b_unfused,pipe_pipedream,pipe_pipedream_2bw,"
    "torch_gpipe,torch_1f1b,deepspeed_1f1b"
)


def default_contenders() -> str:
    """On CPUs every contender; in GPU mode the two-stage ones need two GPUs (NCCL refuses two
    ranks on one GPU), so one GPU measures lightning-pipe's single-GPU overhead only."""
    if DEVICE == "cpu":
        return CPU_CONTENDERS
    single = "plain,plain_micro,pipe_1stage"
    if torch.cuda.device_count() < STAGES:
        print(
            f"GPU mode: {torch.cuda.device_count()} GPU(s); two-stage contenders need {STAGES}: single-GPU overhead "
            "only"
        )
        return single
    return single + ",pipe_gpipe,pipe_1f1b,pipe_1f1b_unfused,pipe_pipedream,pipe_pipedream_2bw,torch_gpipe,torch_1f1b"


def runner_for(contender: str) -> Callable[..., list[float]] | None:
    """The function that runs ``contender``, or None (with a message) when it cannot run here."""
    if contender.startswith("torch_"):
        if SHARE_GPU:
            print(f"skipping {contender}: torch's contenders run under NCCL, one GPU per rank")
            return None
        return run_torch
    if contender.startswith("deepspeed_"):
        reason = deepspeed_runner.available() if DEVICE == "cpu" else "the DeepSpeed contender runs on CPUs only"
        if reason is not None:
            print(f"skipping {contender}: {reason}")
            return None
        return deepspeed_runner.run_deepspeed
    return run_lightning


def single_process_figures(medians: dict[str, float], m: int, p: int) -> dict[str, float]:
    """The ideal pipeline and lightning-pipe's single-process overhead, from median step times.

    The ideal takes the faster single-process run of the same micro-batches: ``plain_micro``
    (Lightning's gradient accumulation: a Lightning step per micro-batch) or ``pipe_1stage`` (all
    micro-batches in one step), times (m + p - 1) / (p m)."""
    out: dict[str, float] = {}
    single = [medians[c] for c in ("plain_micro", "pipe_1stage") if c in medians]
    if single and "pipe_1f1b" in medians:
        out["ideal_step_s"] = min(single) * (m + p - 1) / (p * m)
        out["pipe_1f1b_over_ideal"] = medians["pipe_1f1b"] / out["ideal_step_s"]
    if "pipe_1stage" in medians:
        for baseline in ("plain", "plain_micro"):
            if baseline in medians:
                out[f"pipe_1stage_over_{baseline}"] = medians["pipe_1stage"] / medians[baseline]
    return out


def summarize(model: str, rounds: list[dict[str, list[float]]]) -> dict[str, Any]:
    """Medians over all rounds, and per-round (paired) ratios against lightning-pipe's 1F1B: a
    round's contenders ran back to back, so their ratio is less exposed to machine drift."""
    spec = MODELS[model]
    m, p = spec["chunks"], STAGES
    names = list(rounds[0])
    times = {c: [t for r in rounds for t in r.get(c, [])] for c in names}
    medians = {c: statistics.median(times[c]) for c in names}
    entry: dict[str, Any] = {"batch": spec["batch"], "chunks": m, "stages": p, "rounds": len(rounds), "contenders": {}}
    for c in names:
        entry["contenders"][c] = {
            "median_step_s": medians[c],
            "samples_per_s": spec["batch"] / medians[c],
            "steps": len(times[c]),
            "round_median_s": [statistics.median(r[c]) for r in rounds if r.get(c)],
        }
    # each schedule both engines ran: torch's step time over lightning-pipe's, per round (paired)
    against = {
        c[len("pipe_") :]: [
            statistics.median(r["torch_" + c[len("pipe_") :]]) / statistics.median(r[c])
            for r in rounds
            if c in r and "torch_" + c[len("pipe_") :] in r
        ]
        for c in names
        if c.startswith("pipe_") and "torch_" + c[len("pipe_") :] in names
    }
    if against:
        entry["torch_over_pipe_per_round"] = against
        entry["torch_over_pipe_paired_median"] = {s: statistics.median(v) for s, v in against.items()}
    if "pipe_1f1b" in medians:
        entry["pipe_1f1b_speedup_over"] = {c: medians[c] / medians["pipe_1f1b"] for c in names if c != "pipe_1f1b"}
        paired = {
            c: [statistics.median(r[c]) / statistics.median(r["pipe_1f1b"]) for r in rounds if c in r]
            for c in names
            if c != "pipe_1f1b"
        }
        entry["pipe_1f1b_speedup_per_round"] = paired
        entry["pipe_1f1b_speedup_paired_median"] = {c: statistics.median(v) for c, v in paired.items()}
    if "pipe_1f1b_unfused" in medians and "torch_1f1b" in medians:
        # the ablation: lightning-pipe without gradient-accumulation fusion against torch's 1F1B
        entry["unfused_speedup_over_torch_1f1b_per_round"] = unfused = [
            statistics.median(r["torch_1f1b"]) / statistics.median(r["pipe_1f1b_unfused"])
            for r in rounds
            if "torch_1f1b" in r and "pipe_1f1b_unfused" in r
        ]
        entry["unfused_speedup_over_torch_1f1b_paired_median"] = statistics.median(unfused)
    entry.update(single_process_figures(medians, m, p))
    return entry


def main() -> None:
    global DEVICE, SHARE_GPU
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,vgg19")
    parser.add_argument("--steps", type=int, help="steps per run (default: per model, mlp 14, vgg19 7)")
    parser.add_argument("--warmup", type=int, help="steps dropped per run (default: per model, mlp 4, vgg19 2)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--paired-rounds",
        type=int,
        help="extra rounds of pipe_1f1b, pipe_1f1b_unfused and torch_1f1b only (default: per model, mlp 8, vgg19 0)",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: the GPU mode")
    parser.add_argument(
        "--share-gpu",
        action="store_true",
        help="GPU mode on one GPU: lightning-pipe's two-stage contenders put both ranks on it, over gloo "
        "(tensors between stages through pinned host memory); torch's contenders are skipped",
    )
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--contenders", help=f"comma-separated (default on CPUs: {CPU_CONTENDERS})")
    args = parser.parse_args()
    DEVICE = args.device
    SHARE_GPU = args.share_gpu
    if SHARE_GPU and DEVICE != "cuda":
        parser.error("--share-gpu needs --device cuda")
    if DEVICE == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU; none is visible to torch")
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    runners = {c: runner_for(c) for c in (args.contenders or default_contenders()).split(",")}
    contenders = [c for c, fn in runners.items() if fn is not None]
    results: dict[str, Any] = {}
    began = time.time()
    for model in args.models.split(","):
        steps = args.steps or MODELS[model]["steps"]
        warmup = args.warmup if args.warmup is not None else MODELS[model]["warmup"]
        rounds: list[dict[str, list[float]]] = []
        # then extra rounds of only lightning-pipe's 1F1B (with and without gradient-accumulation
        # fusion) and torch's, for tighter paired ratios
        paired_rounds = args.paired_rounds if args.paired_rounds is not None else MODELS[model]["paired_rounds"]
        extra = [c for c in ("pipe_1f1b", "pipe_1f1b_unfused", "torch_1f1b") if c in contenders]
        plan = [contenders] * args.rounds + (
            [extra] * paired_rounds if {"pipe_1f1b", "torch_1f1b"} <= set(extra) else []
        )
        for index, chosen in enumerate(plan):
            rounds.append({c: [] for c in chosen})
            for contender in chosen if index % 2 == 0 else chosen[::-1]:
                with tempfile.TemporaryDirectory() as folder:
                    rounds[-1][contender] = runners[contender](model, contender, steps, warmup, folder)  # type: ignore[misc]
        entry = results[model] = summarize(model, rounds)
        for contender in ("pipe_1f1b", "pipe_1f1b_unfused", "pipe_1stage"):
            if contender in contenders:
                entry.setdefault("breakdown", {})[contender] = breakdown(model, contender, steps, warmup)
        print(json.dumps({model: entry}, indent=2), flush=True)
    if "mlp" in args.models.split(",") and (DEVICE == "cpu" or torch.cuda.device_count() >= STAGES) and not SHARE_GPU:
        results["mlp"]["activation_memory"] = memory = measure_memory("mlp")
        print(json.dumps({"mlp activation memory": memory}, indent=2), flush=True)
    results["_machine"] = {
        "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
        "lightning": L.__version__, "wall_s": round(time.time() - began, 1),
    }  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(args.out, "throughput.svg"), "w") as f:
        f.write(svg_chart({k: v for k, v in results.items() if not k.startswith("_")}))
    print(f"wrote {args.out}/results.json and {args.out}/throughput.svg in {results['_machine']['wall_s']} s")


if __name__ == "__main__":
    main()

"""Side-by-side throughput and memory: lightning-pipe against torch.distributed.pipelining and
plain Lightning, on the same models, stage split and micro-batches.

    python benchmarks/compare.py                       # both models, about 10 minutes on 2 CPU cores
    python benchmarks/compare.py --models mlp --rounds 3 --steps 20

Contenders (2 processes, one CPU thread each, gloo; plain runs use one process):

- ``plain``: single-process Lightning on whole batches;
- ``plain_micro``: single-process Lightning on the same micro-batches one after another
  (``accumulate_grad_batches=chunks``): the work a pipeline divides between its stages;
- ``pipe_<schedule>``: lightning-pipe with each schedule;
- ``torch_gpipe`` / ``torch_1f1b``: torch.distributed.pipelining's ``ScheduleGPipe`` and
  ``Schedule1F1B`` in a plain training loop (no Lightning), on the same stage split.

Rounds alternate between contenders so that machine drift hits all of them. The result is the
median seconds per optimizer step on rank 0 after a warm-up, samples per second, the ratio of
lightning-pipe's 1F1B to each contender, and the ratio to the ideal pipeline: ``plain_micro``'s
time x (m + p - 1) / (p m). Then, for the MLP, the peak bytes of activations each stage saves for
the backward under GPipe and 1F1B with each checkpoint mode, beside the closed forms. Writes
``results.json`` and ``throughput.svg`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections import OrderedDict
from typing import Any, Callable

import lightning as L
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from step_time import MLP, StepTimer  # noqa: E402

from lightning_pipe import PipelineStrategy  # noqa: E402
from lightning_pipe.partition import resolve_balance, stage_layers  # noqa: E402
from lightning_pipe.runtime.memory import SavedActivationMeter  # noqa: E402

MODELS = {
    "mlp": {"batch": 256, "chunks": 8, "features": (1024,), "classes": 10},
    "vgg19": {"batch": 32, "chunks": 4, "features": (3, 32, 32), "classes": 100},
}
STAGES = 2


def build_module(model: str) -> L.LightningModule:
    torch.manual_seed(0)
    if model == "mlp":
        return MLP(1024, 8)
    from lightning_pipe.recipes.vgg import VGGClassifier

    return VGGClassifier(depth=19, batch_norm=True, num_classes=100)


def data(model: str, batch: int, batches: int) -> DataLoader:
    spec = MODELS[model]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch * batches, *spec["features"], generator=g)
    y = torch.randint(0, spec["classes"], (batch * batches,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch)


def _trainer_args(steps: int, callbacks: list) -> dict[str, Any]:
    return dict(
        max_steps=steps, max_epochs=-1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks,
    )  # fmt: skip


def run_lightning(model: str, contender: str, steps: int, warmup: int, folder: str) -> list[float]:
    spec = MODELS[model]
    module = build_module(model)
    path = os.path.join(folder, "times.json")
    m = spec["chunks"]
    if contender == "plain_micro":
        trainer = L.Trainer(accelerator="cpu", devices=1, accumulate_grad_batches=m, **_trainer_args(steps, [StepTimer(path, 0)]))
        trainer.fit(module, data(model, spec["batch"] // m, steps * m))
        with open(path) as f:
            per_batch = json.load(f)
        return [sum(per_batch[i : i + m]) for i in range(warmup * m, len(per_batch) - m + 1, m)]
    if contender == "plain":
        trainer = L.Trainer(accelerator="cpu", devices=1, **_trainer_args(steps, [StepTimer(path, warmup)]))
    else:
        strategy = PipelineStrategy(schedule=contender[len("pipe_") :], chunks=m, balance="parameters", start_method="fork")
        trainer = L.Trainer(accelerator="cpu", devices=STAGES, strategy=strategy, **_trainer_args(steps, [StepTimer(path, warmup)]))
    trainer.fit(module, data(model, spec["batch"], steps))
    with open(path) as f:
        return json.load(f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torch_worker(rank: int, model: str, schedule: str, steps: int, warmup: int, port: int, path: str) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=STAGES)
    spec = MODELS[model]
    layers = build_module(model).layers
    balance = resolve_balance("parameters", layers, STAGES)
    part = nn.Sequential(OrderedDict(stage_layers(layers, balance, rank)))
    stage = PipelineStage(part, rank, STAGES, torch.device("cpu"))
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    pipe = cls(stage, spec["chunks"], loss_fn=nn.functional.cross_entropy)
    optimizer = torch.optim.SGD(part.parameters(), lr=0.01, momentum=0.9)
    times = []
    for x, y in data(model, spec["batch"], steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        if rank == 0:
            pipe.step(x)
        else:
            pipe.step(target=y)
        optimizer.step()
        times.append(time.perf_counter() - start)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(times[warmup:], f)
    dist.destroy_process_group()


def run_torch(model: str, contender: str, steps: int, warmup: int, folder: str) -> list[float]:
    path = os.path.join(folder, "times.json")
    mp.start_processes(
        _torch_worker, args=(model, contender[len("torch_") :], steps, warmup, _free_port(), path), nprocs=STAGES, start_method="fork"
    )
    with open(path) as f:
        return json.load(f)


class _Meter(L.Callback):
    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.strategy._runner.meter = SavedActivationMeter(pl_module.parameters())

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with open(os.path.join(self.folder, f"peak{trainer.global_rank}.json"), "w") as f:
            json.dump(trainer.strategy._runner.meter.peak, f)


def measure_memory(model: str, steps: int = 3) -> dict[str, Any]:
    spec = MODELS[model]
    m, p = spec["chunks"], STAGES
    peaks: dict[str, list[int]] = {}
    for schedule in ("gpipe", "1f1b"):
        for mode in ("never", "except_last", "always"):
            with tempfile.TemporaryDirectory() as folder:
                strategy = PipelineStrategy(schedule=schedule, chunks=m, balance="parameters", checkpoint=mode, start_method="fork")
                trainer = L.Trainer(accelerator="cpu", devices=p, strategy=strategy, **_trainer_args(steps, [_Meter(folder)]))
                trainer.fit(build_module(model), data(model, spec["batch"], steps))
                peaks[f"{schedule}/{mode}"] = [json.load(open(os.path.join(folder, f"peak{r}.json"))) for r in range(p)]
    per_microbatch = [peaks["gpipe/never"][s] / m for s in range(p)]
    layers = build_module(model).layers
    balance = resolve_balance("parameters", layers, p)
    widths = [spec["features"], *[_output_shape(layers, balance, s, spec) for s in range(p - 1)]]
    input_bytes = [4 * (spec["batch"] // m) * int(torch.tensor(w).prod()) for w in widths]
    return {
        "peak_bytes": peaks,
        "microbatches_held": {k: [round(v[s] / per_microbatch[s], 2) for s in range(p)] for k, v in peaks.items() if "never" in k},
        "closed_form_microbatches": {"gpipe/never": [m] * p, "1f1b/never": [min(p - s, m) for s in range(p)]},
        "ratio_1f1b_to_gpipe_stage0": peaks["1f1b/never"][0] / peaks["gpipe/never"][0],
        "bound_p_over_m": p / m,
        "stage_input_bytes_per_microbatch": input_bytes,
        # with checkpoint="always" a stage keeps its micro-batches' inputs; anything beyond is what
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
    """A bar chart of samples per second per contender, one panel per model (no plotting library)."""
    rows = [(model, name, r["samples_per_s"]) for model, res in results.items() for name, r in res["contenders"].items()]
    width, bar, gap = 760, 18, 6
    height = 40 + len(rows) * (bar + gap) + 20 * len(results)
    top = max(v for _, _, v in rows)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">',
           '<text x="10" y="20" font-size="14">samples per second (higher is better), 2 CPU stages</text>']  # fmt: skip
    y = 36
    current = None
    for model, name, value in rows:
        if model != current:
            current = model
            out.append(f'<text x="10" y="{y + 12}" font-weight="bold">{model}</text>')
            y += 20
        length = 440 * value / top
        color = "#2b7bba" if name.startswith("pipe_") else "#999999"
        out.append(f'<text x="10" y="{y + 13}">{name}</text>')
        out.append(f'<rect x="150" y="{y}" width="{length:.1f}" height="{bar}" fill="{color}"/>')
        out.append(f'<text x="{155 + length:.1f}" y="{y + 13}">{value:.1f}</text>')
        y += bar + gap
    out.append("</svg>")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,vgg19")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument(
        "--contenders",
        default="plain,plain_micro,pipe_gpipe,pipe_1f1b,pipe_pipedream,pipe_pipedream_2bw,torch_gpipe,torch_1f1b",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    contenders = args.contenders.split(",")
    runners: dict[str, Callable[..., list[float]]] = {c: (run_torch if c.startswith("torch_") else run_lightning) for c in contenders}
    results: dict[str, Any] = {}
    began = time.time()
    for model in args.models.split(","):
        times: dict[str, list[float]] = {c: [] for c in contenders}
        for _ in range(args.rounds):
            for contender in contenders:
                with tempfile.TemporaryDirectory() as folder:
                    times[contender] += runners[contender](model, contender, args.steps, args.warmup, folder)
        spec = MODELS[model]
        m, p = spec["chunks"], STAGES
        medians = {c: statistics.median(times[c]) for c in contenders}
        entry: dict[str, Any] = {"batch": spec["batch"], "chunks": m, "stages": p, "contenders": {}}
        for c in contenders:
            entry["contenders"][c] = {"median_step_s": medians[c], "samples_per_s": spec["batch"] / medians[c], "steps": len(times[c])}
        if "pipe_1f1b" in medians:
            entry["pipe_1f1b_speedup_over"] = {c: medians[c] / medians["pipe_1f1b"] for c in contenders if c != "pipe_1f1b"}
            if "plain_micro" in medians:
                ideal = medians["plain_micro"] * (m + p - 1) / (p * m)
                entry["ideal_step_s"] = ideal
                entry["pipe_1f1b_over_ideal"] = medians["pipe_1f1b"] / ideal
        results[model] = entry
        print(json.dumps({model: entry}, indent=2), flush=True)
    if "mlp" in args.models.split(","):
        results["mlp"]["activation_memory"] = memory = measure_memory("mlp")
        print(json.dumps({"mlp activation memory": memory}, indent=2), flush=True)
    results["_machine"] = {
        "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__, "lightning": L.__version__, "wall_s": round(time.time() - began, 1),
    }  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(args.out, "throughput.svg"), "w") as f:
        f.write(svg_chart({k: v for k, v in results.items() if not k.startswith("_")}))
    print(f"wrote {args.out}/results.json and {args.out}/throughput.svg in {results['_machine']['wall_s']} s")


if __name__ == "__main__":
    main()

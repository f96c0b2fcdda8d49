"""Peak activation memory per process, in micro-batches of one stage: DualPipeV against ZB-V and 1F1B.

    python benchmarks/activation_memory.py                                   # 2 processes, 4, 8, 16 chunks
    python benchmarks/activation_memory.py --stages 4 --chunk-list 8,16

DeepSeek's table gives DualPipeV ``PP + 1`` micro-batches' activations per device for ``PP`` stages
on ``PP / 2`` devices (ZB-V and 1F1B: ``PP``). This measures it on the benchmark MLP (8 blocks of
width 1024 and a head, batch 256, ``balance="parameters"``), one CPU thread per process: every
tensor autograd saves for a backward is counted while it lives
(:class:`~lightning_pipe.runtime.activations.meter.SavedActivationMeter`), and the peak of a process is
divided by what one forward of one micro-batch adds on that process (the mean over its stages),
so the figure is in "micro-batches of one stage". Tensors the split backward keeps from B until W
(input-gradient work done, weight-gradient work pending) are reported beside it. Writes
``--out``/activation_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from step_time import MLP
from sync_schedules import work_bytes

from lightning_pipe import PipelineStrategy
from lightning_pipe.runtime.activations.meter import SavedActivationMeter
from lightning_pipe.runtime.stage import StageRunner


class ActivationPeak(L.Callback):
    """Per process: the peak of saved activations, what one forward adds, and the peak with W's work."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.increments: list[int] = []
        self.peak_with_work = 0

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        runners = list(trainer.strategy.pipeline.runners.values())  # type: ignore[attr-defined]
        self.meter = SavedActivationMeter(pl_module.parameters())
        for runner in runners:
            runner.meter = self.meter
            for name in ("forward", "backward", "backward_input", "backward_weight"):
                setattr(runner, name, self._watched(name, getattr(runner, name), runners))

    def _watched(self, name: str, method: Callable[..., Any], runners: list[StageRunner]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            before = self.meter.current
            out = method(*args)
            if name == "forward" and torch.is_grad_enabled():
                self.increments.append(self.meter.current - before)
            self.peak_with_work = max(self.peak_with_work, self.meter.current + work_bytes(runners))
            return out

        return run

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        unit = sum(self.increments) / len(self.increments)
        runners = list(trainer.strategy.pipeline.runners.values())  # type: ignore[attr-defined]
        record = {
            "stage_microbatch_mib": unit / 2**20,
            "peak_mib": self.meter.peak / 2**20,
            "peak_stage_microbatches": self.meter.peak / unit if unit else None,  # None: every forward offloaded
            "peak_with_weight_work_mib": self.peak_with_work / 2**20,
            # offload=: the peak of saved tensors this process held in host memory instead (0 without offload)
            "peak_host_mib": sum(r.offload.peak_host_bytes for r in runners if r.offload is not None) / 2**20,
        }
        Path(self.folder, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


#: ``--variants``: the activation-memory settings compared (``offload=``, ``recompute=``)
VARIANTS: dict[str, dict[str, Any]] = {
    "keep": {},
    "offload": {"offload": True},
    "offload_auto": {"offload": "auto"},
    "recompute_auto": {"recompute": "auto"},
}


def measure(
    schedule: str, stages: int, chunks: int, steps: int, width: int = 1024, batch: int = 256, **memory: Any
) -> list[dict[str, float]]:
    """Per process, what :class:`ActivationPeak` records over ``steps`` steps of the benchmark MLP."""
    torch.manual_seed(0)
    model = MLP(width, 8)
    x, y = torch.randn(batch * 2, width), torch.randint(0, 10, (batch * 2,))
    with tempfile.TemporaryDirectory() as folder:
        trainer = L.Trainer(
            accelerator="cpu", devices=stages, max_steps=steps, max_epochs=-1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            strategy=PipelineStrategy(
                schedule=schedule, chunks=chunks, balance="parameters", start_method="fork", **memory
            ),
            callbacks=[ActivationPeak(folder)],
        )  # fmt: skip
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=batch))
        return [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(stages)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", default="1f1b,zbv,dualpipev")
    parser.add_argument("--stages", type=int, default=2, help="processes")
    parser.add_argument("--chunk-list", default="4,8,16")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--variants", default="keep", help=f"activation memory per stage: {', '.join(VARIANTS)}")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for chunks in (int(c) for c in args.chunk_list.split(",")):
        for schedule in args.schedules.split(","):
            for variant in args.variants.split(","):
                ranks = measure(schedule, args.stages, chunks, args.steps, **VARIANTS[variant])
                row = {"schedule": schedule, "processes": args.stages, "chunks": chunks, "ranks": ranks}
                rows.append({**row, "variant": variant})
                peaks = [round(r["peak_mib"], 1) for r in ranks]
                host = [round(r["peak_host_mib"], 1) for r in ranks]
                print(json.dumps({**row, "variant": variant, "peak_mib": peaks, "host_mib": host, "ranks": None}))
    os.makedirs(args.out, exist_ok=True)
    suffix = "" if args.variants == "keep" else "_" + args.variants.replace(",", "_")
    path = Path(args.out, f"activation_memory_{args.stages}_processes{suffix}.json")
    path.write_text(json.dumps({"config": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

"""Timeline pictures for docs/: a schedule's predicted timeline and a measured run's.

    python benchmarks/timeline.py            # writes docs/timeline-1f1b.svg and docs/timeline-run.svg

The run trains the benchmark MLP (8 blocks of width 1024, batch 256 in 8 micro-batches) on 2 CPU
processes with 1F1B for 6 steps and draws the last step under the prediction from its median
forward and backward times.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from step_time import MLP

from lightning_pipe import PipelineStrategy
from lightning_pipe.observe import TimelinePicture, simulated_bars, timeline_svg
from lightning_pipe.schedules import one_f_one_b, simulate

DOCS = Path(__file__).resolve().parent.parent / "docs"


def main() -> None:
    torch.set_num_threads(1)
    schedule = one_f_one_b(4, 8)
    svg = timeline_svg(
        [("1f1b, 4 stages, 8 micro-batches (backward = 2 forwards)", simulated_bars(simulate(schedule)))],
        unit="forward times",
    )
    (DOCS / "timeline-1f1b.svg").write_text(svg)
    torch.manual_seed(0)
    model = MLP(1024, 8)
    x, y = torch.randn(256 * 6, 1024), torch.randint(0, 10, (256 * 6,))
    picture = TimelinePicture(DOCS / "timeline-run.svg")
    trainer = L.Trainer(
        accelerator="cpu", devices=2,
        strategy=PipelineStrategy(schedule="1f1b", chunks=8, balance="parameters", start_method="fork"), max_steps=6,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[picture],
    )  # fmt: skip
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=256))
    print("wrote", DOCS / "timeline-1f1b.svg", DOCS / "timeline-run.svg")


if __name__ == "__main__":
    main()

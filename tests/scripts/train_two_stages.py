"""A user's script: ``python train_two_stages.py OUT``. Lightning's script launcher re-runs it once
per extra process (``start_method="popen"``, the default), as with ``strategy="ddp"``."""

import os
import sys

import lightning as L
import torch

import lightning_pipe  # noqa: F401  (registers strategy="pipeline")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.models import TinyNet, loader, trainer_kwargs

if __name__ == "__main__":
    torch.set_num_threads(1)
    out = sys.argv[1]
    torch.manual_seed(0)
    model = TinyNet()
    trainer = L.Trainer(strategy="pipeline", accelerator="cpu", devices=2, **trainer_kwargs())
    trainer.fit(model, loader())
    # each rank holds only its stage, under the unsplit names
    torch.save(model.state_dict(), os.path.join(out, f"rank{trainer.global_rank}.pt"))

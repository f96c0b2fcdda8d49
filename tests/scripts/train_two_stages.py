"""A user's script: ``python train_two_stages.py OUT``. Lightning's script launcher re-runs it once
per extra process (``start_method="popen"``, the default), as with ``strategy="ddp"``. The package is
imported before Lightning, by the name whose import imports Lightning: ``strategy="pipeline"`` is then
registered while ``lightning_pipe.strategy`` is still being imported (see ``lightning_pipe/__init__.py``)."""

import os
import sys

import torch

from lightning_pipe import PipelineStrategy  # registers strategy="pipeline" (once Lightning is imported)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.models import TinyNet, loader, trainer_kwargs

if __name__ == "__main__":
    import lightning as L

    torch.set_num_threads(1)
    out = sys.argv[1]
    torch.manual_seed(0)
    model = TinyNet()
    trainer = L.Trainer(strategy="pipeline", accelerator="cpu", devices=2, **trainer_kwargs())
    assert isinstance(trainer.strategy, PipelineStrategy) and trainer.strategy.config.start_method == "popen"
    trainer.fit(model, loader())
    # each rank holds only its stage, under the unsplit names
    torch.save(model.state_dict(), os.path.join(out, f"rank{trainer.global_rank}.pt"))

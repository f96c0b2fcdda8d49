"""A checkpoint of other tensor shapes than the module's is refused by name (the file and the tensors)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_pipe.trainer.checkpoint_hooks import check_shapes
from tests.pipeline import fit_pipeline

pytestmark = pytest.mark.timeout(120)


class Wide(L.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, width), nn.Linear(width, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.layers(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_shapes_that_differ_are_named_with_the_checkpoint() -> None:
    check_shapes({"a": torch.zeros(2)}, {"a": torch.ones(2), "b": torch.ones(3)}, "ok.ckpt")  # names: not here
    with pytest.raises(RuntimeError, match=r"the checkpoint x.ckpt .* a: \(2,\) in the checkpoint, \(3,\) here"):
        check_shapes({"a": torch.zeros(2)}, {"a": torch.zeros(3)}, "x.ckpt")


def test_resuming_a_checkpoint_of_other_shapes_names_it(tmp_path: Path) -> None:
    saves = ModelCheckpoint(dirpath=tmp_path, filename="wide", save_last=False)
    fit_pipeline(Wide(8), 2, chunks=2, callbacks=[saves], enable_checkpointing=True, max_steps=2)
    path = tmp_path / "wide.ckpt"
    with pytest.raises(Exception, match="was saved from a module of other shapes") as refused:
        fit_pipeline(Wide(16), 2, chunks=2, ckpt_path=str(path), max_steps=4)
    # whichever rank's refusal the launcher reports names that rank's own tensors (stage 0's or stage 1's)
    wrong = r"layers\.\d+\.(weight|bias): \([^)]*8[^)]*\) in the checkpoint, \([^)]*16[^)]*\) here"
    assert str(path) in str(refused.value) and re.search(wrong, str(refused.value)), str(refused.value)

"""The refusals of compatibility.py speak of what was split: an nn.Sequential or a block container."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_pipe.trainer.compatibility import check_async, check_correction_optimizers, check_shard
from tests.models import RecordWarnings, TinyNet
from tests.pipeline import fit_pipeline


def test_the_asynchronous_schedules_take_parameters_outside_the_split_and_refuse_ties_that_drift() -> None:
    """Parameters outside the split layers are versioned with the stage that uses them; a weight tied
    across stages is still refused where the stages' delays differ."""
    model = nn.Module()
    model.wte = nn.Embedding(4, 2)
    check_async("pipedream", model, [model.wte.weight], False, 2, 4, None, blocks="model.transformer.h")
    check_async("pipedream", model, [model.wte.weight], False, 2, 4, None)
    with pytest.raises(MisconfigurationException, match="copies of a weight tied across stages would drift"):
        check_async("pipedream", model, [model.wte.weight], True, 2, 4, None, blocks="model.transformer.h")


def test_shard_takes_parameters_outside_the_split_and_ties_and_refuses_weight_versions() -> None:
    """Parameters outside the split layers and weights tied across stages are sharded with their stage."""
    weight = nn.Parameter(nn.Linear(2, 2).weight.detach())
    check_shard("1f1b", [weight], True, blocks="model.model.layers")
    check_shard("zero_bubble", [weight], False)
    with pytest.raises(MisconfigurationException, match="schedule='pipedream' keeps weight versions"):
        check_shard("pipedream", [weight], False, blocks="model.model.layers")


class WarningsFromSetup(RecordWarnings):
    """``RecordWarnings`` from the Trainer's setup on: what the strategy's setup says too."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().on_train_start(trainer, pl_module)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pass


def test_nesterov_correction_with_an_optimizer_of_its_own_momentum_is_told_before_training(tmp_path: Path) -> None:
    """``delay_correction="nesterov"`` carries the momentum: an SGD with momentum, or Adam's moments, is told on
    rank 0 at setup; plain SGD, another correction or none says nothing."""
    params = [nn.Parameter(torch.zeros(2))]
    said = check_correction_optimizers("nesterov", [torch.optim.SGD(params, lr=0.1, momentum=0.9)])
    assert said is not None and "momentum=0.9" in said and "plain SGD" in said
    assert "betas=(0.9, 0.999)" in (check_correction_optimizers("nesterov", [torch.optim.Adam(params)]) or "")
    assert check_correction_optimizers("nesterov", [torch.optim.SGD(params, lr=0.1)]) is None
    assert check_correction_optimizers("error_feedback", [torch.optim.SGD(params, lr=0.1, momentum=0.9)]) is None
    assert check_correction_optimizers(None, [torch.optim.Adam(params)]) is None
    record = WarningsFromSetup(str(tmp_path))
    fit_pipeline(
        TinyNet(), 2, schedule="pipedream", chunks=2, delay_correction="nesterov", callbacks=[record], max_steps=1
    )
    caught = json.loads((tmp_path / "warnings0.json").read_text())  # rank 0 says it (TinyNet's SGD has momentum)
    assert len([w for w in caught if "delay_correction='nesterov') carries the momentum itself" in w]) == 1, caught

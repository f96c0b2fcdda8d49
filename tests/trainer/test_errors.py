"""Misuse ends before training with an error naming the bad value and the valid ones; never a hang."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

import lightning_pipe
from lightning_pipe import PipelineStrategy
from tests.models import TinyNet
from tests.pipeline import fit_pipeline

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"schedule": "pipedreamz"},
            r"Unknown pipeline schedule 'pipedreamz'. Valid schedules: 1f1b, chimera, dualpipev, gpipe, "
            r"interleaved_1f1b, interleaved_zero_bubble, pipedream, pipedream_2bw, pipemare, wpipe, xpipe, zbv, "
            r"zero_bubble",
        ),
        ({"recompute": "sometimes"}, r"recompute='sometimes'.*Valid: always, except_last, never"),
        ({"chunks": 0}, r"chunks=0.*integer >= 1"),
        ({"chunks": 2.5}, r"chunks=2.5.*integer >= 1"),
        ({"balance": "speed"}, r"balance='speed'.*Valid: uniform, parameters, time, memory"),
        ({"balance": 3}, r"balance=3.*list of layer counts"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PipelineStrategy(**kwargs)


def test_registered_name_and_registering_twice() -> None:
    assert "pipeline" in StrategyRegistry
    PipelineStrategy.register_strategies(StrategyRegistry)  # again: no error
    import importlib

    importlib.reload(lightning_pipe)
    trainer = L.Trainer(strategy="pipeline", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, lightning_pipe.PipelineStrategy)
    for name, method in (("pipeline", "popen"), ("pipeline_notebook", "fork"), ("pipeline_spawn", "spawn")):
        strategy = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False).strategy
        assert isinstance(strategy, lightning_pipe.PipelineStrategy) and strategy.config.start_method == method


class NoSequential(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.a(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Manual(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class CallsTwice(TinyNet):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x) + self(x), y)


class NeverCalls(TinyNet):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layers[0].weight.sum()


@pytest.mark.parametrize(
    "model, devices, kwargs, match",
    [
        (TinyNet, 2, {"balance": [8]}, r"balance=\[8\] has 1 entries but the pipeline has 2 stages"),
        (TinyNet, 2, {"balance": [4, 3]}, r"balance=\[4, 3\] sums to 7 but the module has 8 layers"),
        (lambda: TinyNet(depth=3), 4, {}, r"cannot split 3 layers into 4 stages"),
        (NoSequential, 2, {}, r"NoSequential has no top-level nn.Sequential to split"),
        (TinyNet, 2, {"module": "body"}, r"TinyNet has no attribute 'body'"),
        (Manual, 2, {}, r"supports automatic optimization only"),
        (CallsTwice, 2, {}, r"called the pipelined Sequential twice"),
        (NeverCalls, 2, {}, r"never called the pipelined Sequential"),
    ],
    ids=["balance-length", "balance-sum", "too-many-stages", "no-sequential", "bad-module", "manual", "twice", "never"],
)
def test_model_errors_stop_every_rank(model: Any, devices: int, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(Exception, match=match):
        fit_pipeline(model(), devices, **kwargs)

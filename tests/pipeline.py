"""Running a model under the pipeline from a test, launched as a user would launch it."""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_pipe import PipelineStrategy
from lightning_pipe.config import arguments
from tests.models import loader, trainer_kwargs


def pipeline_trainer(
    devices: int, start_method: str = "fork", callbacks: list | None = None, **strategy_and_trainer: Any
) -> L.Trainer:
    """A Trainer with ``PipelineStrategy`` on ``devices`` CPU processes; keyword arguments go to the
    strategy when they are its own and to the Trainer otherwise."""
    strategy_keys = {argument.name for argument in arguments()}  # every argument of PipelineConfig's groups
    strategy_args = {k: v for k, v in strategy_and_trainer.items() if k in strategy_keys}
    trainer_args = {k: v for k, v in strategy_and_trainer.items() if k not in strategy_keys}
    strategy = PipelineStrategy(start_method=start_method, **strategy_args)
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        callbacks=callbacks or [],
        **trainer_kwargs(**trainer_args),
    )


def fit_pipeline(
    model: L.LightningModule,
    devices: int,
    data: DataLoader | None = None,
    val_data: DataLoader | None = None,
    ckpt_path: str | None = None,
    **options: Any,
) -> L.Trainer:
    """Fit ``model`` in place with ``devices`` CPU processes; the trained weights of every stage come
    back into ``model`` in this process."""
    trainer = pipeline_trainer(devices, **options)
    trainer.fit(model, data if data is not None else loader(), val_data, ckpt_path=ckpt_path)
    return trainer


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        torch.testing.assert_close(sa[name], sb[name], rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def twins(model: L.LightningModule) -> tuple[L.LightningModule, L.LightningModule]:
    return model, copy.deepcopy(model)

"""An elastic start resumes its own run's checkpoints, not another run's left in the watched folder.

Run A saves at step 4 into the folder; a new run with another module (depth, class) or other
hyperparameters is refused, naming A's checkpoint and what differs; A's restart resumes it without a
word, and a new torchrun run of the same module resumes it and says from where."""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_pipe import PipelineStrategy
from lightning_pipe.trainer.launch import restarts
from lightning_pipe.trainer.launch.restarts import resume_arguments
from tests.models import TinyNet
from tests.pipeline import fit_pipeline

pytestmark = pytest.mark.timeout(120)


class HyperNet(TinyNet):
    def __init__(self, depth: int = 8, lr: float = 0.1) -> None:
        super().__init__(depth=depth, lr=lr)
        self.save_hyperparameters()


def _chosen(folder: Path, model: L.LightningModule) -> Any:
    """The ``ckpt_path`` an elastic ``fit(model)`` watching ``folder`` runs with (nothing launched)."""
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=PipelineStrategy(elastic=str(folder)), logger=False)
    trainer.state.fn = TrainerFn.FITTING
    args, kwargs = resume_arguments(trainer, trainer.fit, (model,), {}, str(folder))
    return inspect.signature(trainer.fit).bind(*args, **kwargs).arguments.get("ckpt_path")


def _run(folder: Path, model: L.LightningModule, steps: int) -> None:
    saves = ModelCheckpoint(dirpath=folder, every_n_train_steps=4, save_top_k=-1)
    fit_pipeline(model, 2, chunks=2, elastic=str(folder), callbacks=[saves], enable_checkpointing=True, max_steps=steps)


def test_a_first_start_refuses_another_runs_checkpoint_and_a_restart_resumes_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "checkpoints"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    _run(folder, HyperNet(), 4)  # run A (no torchrun: no run id)
    saved = str(folder / "epoch=0-step=4.ckpt")
    with pytest.raises(Exception, match="names or shapes") as raised:  # launched as a user launches it
        _run(folder, HyperNet(depth=6), 8)
    assert saved in str(raised.value) and "another run" in str(raised.value)
    for other, what in ((HyperNet(lr=0.2), "lr=0.1 -> 0.2"), (TinyNet(), "the module is a tests.models.TinyNet")):
        with pytest.raises(MisconfigurationException) as refused:
            _chosen(folder, other)
        assert saved in str(refused.value) and what in str(refused.value), str(refused.value)

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if "resum" in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger=restarts.__name__):
        assert _chosen(folder, HyperNet()) == saved  # a first start of the same module: resumed, and said
    assert len(said()) == 1 and saved in said()[0] and "this start resumes from" in said()[0], said()
    caplog.clear()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # run A restarted by its agent: resumed, nothing to say
    with caplog.at_level(logging.WARNING, logger=restarts.__name__):
        assert _chosen(folder, HyperNet()) == saved
    assert not said()
    for name, value in {"TORCHELASTIC_RUN_ID": "run-b", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)  # a torchrun run other than the one that saved: resumed, and said
    with caplog.at_level(logging.WARNING, logger=restarts.__name__):
        assert _chosen(folder, HyperNet()) == saved
    assert len(said()) == 1 and "written by torchrun run None (this is 'run-b')" in said()[0], said()

"""``trainer.should_stop`` set on one rank stops every rank at the same step, as one process stops.

A user's callback or step sets the flag on one process (a rank-0 check, the last stage's loss); the
stages agree on it where Lightning reads it, so none waits for a peer that has left. The oracle is
plain Lightning on one process, where the same code stops training at that step."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_pipe import PipelineStrategy
from tests.models import LifecycleNet, RecordEpochs, RecordMetrics, TinyNet, fit_plain, loader, trainer_kwargs
from tests.pipeline import assert_same_weights, fit_pipeline, twins

pytestmark = pytest.mark.timeout(120)


class StopAt(L.Callback):
    """Sets ``trainer.should_stop`` on ``rank`` (None: any rank): after global step ``when`` (``at="step"``),
    after the validation run at global step ``when`` (``"validation"``), at the end or the start of epoch
    ``when`` (``"epoch_end"``, ``"epoch_start"``)."""

    def __init__(self, when: int, rank: int | None, at: str) -> None:
        self.when, self.rank, self.at = when, rank, at

    def _stop(self, trainer: L.Trainer, at: str, now: int) -> None:
        if self.at == at and now == self.when and (self.rank is None or trainer.global_rank == self.rank):
            trainer.should_stop = True

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._stop(trainer, "step", trainer.global_step)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop(trainer, "validation", trainer.global_step)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop(trainer, "epoch_end", trainer.current_epoch)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop(trainer, "epoch_start", trainer.current_epoch)


CASES = {  # (devices, the rank that asks, where, after which step or epoch, with validation data)
    "rank0_mid_epoch": (2, 0, "step", 2, False),
    "last_rank_mid_epoch": (3, 2, "step", 3, False),
    "rank0_at_epoch_end": (2, 0, "epoch_end", 0, False),
    "last_rank_at_epoch_start": (2, 1, "epoch_start", 1, False),
    # a stop asks Lightning for a validation run first: every rank runs it, or none
    "last_rank_mid_epoch_validating": (2, 1, "step", 4, True),
    "rank0_after_a_validation_mid_epoch": (2, 0, "validation", 3, True),  # validated every 3 batches
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_should_stop_on_one_rank_stops_every_rank_at_the_step_plain_training_stops(tmp_path: Path, case: str) -> None:
    devices, rank, at, when, validating = CASES[case]
    torch.manual_seed(0)
    piped, plain = twins(LifecycleNet(depth=8))
    val = loader(n=20, batch_size=8, seed=5) if validating else None
    limits: dict[str, Any] = dict(max_steps=-1, max_epochs=5, val_check_interval=3 if validating else None)
    reference = fit_plain(plain, val_data=val, callbacks=[StopAt(when, None, at)], **limits)
    strategy = PipelineStrategy(start_method="fork", chunks=2, timeout=timedelta(seconds=30))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        callbacks=[StopAt(when, rank, at), RecordEpochs(str(tmp_path)), RecordMetrics(str(tmp_path))],
        **trainer_kwargs(**limits),
    )
    trainer.fit(piped, loader(), val)
    ends = [json.loads((tmp_path / f"end{r}.json").read_text()) for r in range(devices)]
    steps = {end["global_step"] for end in ends}
    # 64 samples in batches of 12: 6 steps per epoch
    expected = {"epoch_end": 6 * (when + 1), "epoch_start": 6 * when}.get(at, when)
    assert steps == {expected}, ends
    assert all(end["should_stop"] for end in ends)
    assert_same_weights(plain, piped)
    if validating:  # the validation the stop asked for ran on every rank, as in plain training
        for r in range(devices):
            metrics = json.loads((tmp_path / f"rank{r}.json").read_text())
            assert metrics["val_loss"] == pytest.approx(float(reference.callback_metrics["val_loss"]), rel=1e-4)


@pytest.mark.parametrize("schedule", ["pipedream", "pipedream_2bw"])
def test_an_asynchronous_schedule_stopped_on_one_rank_ends_as_max_steps_at_that_step(
    tmp_path: Path, schedule: str
) -> None:
    """The work in flight when rank 0 stops mid-epoch is handled as at ``max_steps``: the same weights."""
    torch.manual_seed(0)
    stopped, limited = twins(TinyNet(optimizer="plain-sgd"))
    options: dict[str, Any] = dict(schedule=schedule, chunks=2, timeout=timedelta(seconds=30))
    fit_pipeline(limited, 2, max_steps=3, **{k: v for k, v in options.items() if k != "timeout"})
    strategy = PipelineStrategy(start_method="fork", **options)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, callbacks=[StopAt(3, 0, "step"), RecordEpochs(str(tmp_path))],
        **trainer_kwargs(max_steps=-1, max_epochs=3),
    )  # fmt: skip
    trainer.fit(stopped, loader())
    assert [json.loads((tmp_path / f"end{r}.json").read_text())["global_step"] for r in range(2)] == [3, 3]
    assert_same_weights(limited, stopped, rtol=0, atol=0)

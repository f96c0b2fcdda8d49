"""The rest of the Lightning lifecycle under the pipeline: validation, test, predict, callbacks on
rank 0, checkpoints that resume exactly (under another stage count, or without the pipeline),
learning-rate schedules and mixed precision."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_pipe.checkpoint import consolidate, is_pipeline_checkpoint
from lightning_pipe.checkpoint import main as consolidate_main
from tests.models import LifecycleNet, RecordEpochs, RecordMetrics, fit_plain, loader, plain_trainer
from tests.pipeline import assert_same_weights, fit_pipeline, pipeline_trainer

pytestmark = pytest.mark.timeout(240)
EPOCH = {"max_steps": -1}


def _val() -> torch.utils.data.DataLoader:
    return loader(n=20, batch_size=8, seed=5)


def test_fit_validate_checkpoint_resume_and_predict(tmp_path: Path) -> None:
    torch.manual_seed(0)
    initial = LifecycleNet().state_dict()
    reference = LifecycleNet()
    reference.load_state_dict(initial)
    plain = fit_plain(reference, val_data=_val(), max_epochs=2, **EPOCH)

    piped = LifecycleNet()
    piped.load_state_dict(initial)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val_loss", save_last=True)
    trainer = fit_pipeline(
        piped, 2, val_data=_val(), schedule="1f1b", chunks=3, max_epochs=2, enable_checkpointing=True,
        callbacks=[checkpoints, RecordMetrics(str(tmp_path))], **EPOCH,
    )  # fmt: skip
    assert_same_weights(reference, piped)
    # rank 0 (the main process gets its metrics) and every rank see the validation loss
    expected = float(plain.callback_metrics["val_loss"])
    assert float(trainer.callback_metrics["val_loss"]) == pytest.approx(expected, rel=1e-5)
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text())["val_loss"] == pytest.approx(expected, rel=1e-5)
    best, last = Path(trainer.checkpoint_callback.best_model_path), tmp_path / "ckpt" / "last.ckpt"
    assert best.name.startswith("epoch=") and is_pipeline_checkpoint(best) and is_pipeline_checkpoint(last)

    # resume from the last checkpoint to epoch 3 == an uninterrupted 3-epoch single-process run
    three = LifecycleNet()
    three.load_state_dict(initial)
    fit_plain(three, val_data=_val(), max_epochs=3, **EPOCH)
    resumed = LifecycleNet()
    fit_pipeline(resumed, 2, val_data=_val(), ckpt_path=str(last), schedule="1f1b", chunks=3, max_epochs=3, **EPOCH)
    assert_same_weights(three, resumed)

    # predict: rank 0 gets the single-process outputs, in order
    expected_out = torch.cat(plain_trainer().predict(three, loader(batch_size=12)))
    predictions = pipeline_trainer(2, chunks=4).predict(resumed, loader(batch_size=12))
    assert predictions is not None and len(predictions) == 6
    torch.testing.assert_close(torch.cat(predictions), expected_out, rtol=1e-4, atol=1e-6)

    # validate and test outside fit: the logged losses match
    plain_val = plain_trainer().validate(three, _val(), verbose=False)
    piped_val = pipeline_trainer(2, chunks=3).validate(resumed, _val(), verbose=False)
    assert piped_val[0]["val_loss"] == pytest.approx(plain_val[0]["val_loss"], rel=1e-5)
    plain_test = plain_trainer().test(three, _val(), verbose=False)
    piped_test = pipeline_trainer(2, chunks=3).test(resumed, _val(), verbose=False)
    assert piped_test[0]["test_loss"] == pytest.approx(plain_test[0]["test_loss"], rel=1e-5)


def test_checkpoint_resumes_under_four_stages_and_without_the_pipeline(tmp_path: Path) -> None:
    torch.manual_seed(0)
    initial = LifecycleNet().state_dict()
    three = LifecycleNet()
    three.load_state_dict(initial)
    fit_plain(three, max_epochs=3, **EPOCH)

    two = LifecycleNet()
    two.load_state_dict(initial)
    checkpoint_cb = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    fit_pipeline(two, 2, chunks=4, max_epochs=2, enable_checkpointing=True, callbacks=[checkpoint_cb], **EPOCH)
    last = tmp_path / "last.ckpt"
    assert sorted(p.name for p in last.iterdir()) == ["meta.pt", "stage-00000.pt", "stage-00001.pt"]

    four = LifecycleNet()
    fit_pipeline(four, 4, ckpt_path=str(last), schedule="gpipe", chunks=4, max_epochs=3, **EPOCH)
    assert_same_weights(three, four)

    plain_file = tmp_path / "plain.ckpt"
    consolidate_main([str(last), str(plain_file)])
    unsplit = LifecycleNet.load_from_checkpoint(plain_file, weights_only=True)
    two_epochs = LifecycleNet()
    two_epochs.load_state_dict(initial)
    fit_plain(two_epochs, max_epochs=2, **EPOCH)
    assert_same_weights(two_epochs, unsplit)
    no_pipeline = LifecycleNet()
    fit_plain(no_pipeline, ckpt_path=str(plain_file), max_epochs=3, **EPOCH)
    assert_same_weights(three, no_pipeline)
    assert consolidate(last)["optimizer_states"][0]["param_groups"][0]["params"] == list(range(10))


def test_early_stopping_stops_every_rank_at_the_same_epoch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = LifecycleNet()
    stopper = EarlyStopping(monitor="val_loss", min_delta=10.0, patience=1)
    fit_pipeline(
        model, 2, val_data=_val(), chunks=3, max_epochs=10, callbacks=[stopper, RecordEpochs(str(tmp_path))], **EPOCH
    )
    ends = [json.loads((tmp_path / f"end{rank}.json").read_text()) for rank in range(2)]
    assert ends[0] == ends[1]
    assert ends[0]["should_stop"] and ends[0]["epoch"] == 2 < 10


def test_learning_rate_schedule_and_monitor(tmp_path: Path) -> None:
    torch.manual_seed(0)
    reference = LifecycleNet(scheduler=True)
    piped = LifecycleNet(scheduler=True)
    piped.load_state_dict(reference.state_dict())
    fit_plain(reference, max_epochs=2, **EPOCH)
    logger = CSVLogger(tmp_path, name="run")
    fit_pipeline(
        piped,
        2,
        chunks=2,
        max_epochs=2,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[LearningRateMonitor("step")],
        **EPOCH,
    )
    assert_same_weights(reference, piped)
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        rates = [float(row["lr-Adam"]) for row in csv.DictReader(f) if row["lr-Adam"]]
    assert rates[:7] == [0.01, 0.01, 0.01, 0.005, 0.005, 0.005, 0.0025]  # halved every 3 steps, as scheduled


def test_bf16_mixed_matches_plain_bf16() -> None:
    torch.manual_seed(0)
    reference = LifecycleNet()
    piped = LifecycleNet()
    piped.load_state_dict(reference.state_dict())
    fit_plain(reference, precision="bf16-mixed")
    fit_pipeline(piped, 2, chunks=3, precision="bf16-mixed")
    assert_same_weights(reference, piped, rtol=2e-2, atol=2e-3)


class InfOnStageZero(LifecycleNet):
    """At step 2 the first layer's gradient (which lives on stage 0 only) becomes inf."""

    def on_train_start(self) -> None:
        first = self.layers._modules.get("0")
        if first is not None:
            first.weight.register_hook(lambda g: g * float("inf") if self.trainer.global_step == 2 else g)


def _fp16_plugin() -> L.pytorch.plugins.precision.MixedPrecision:
    return L.pytorch.plugins.precision.MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


def test_gradient_scaler_skips_the_same_steps_on_every_stage(tmp_path: Path) -> None:
    torch.manual_seed(0)
    reference = InfOnStageZero()
    piped = InfOnStageZero()
    piped.load_state_dict(reference.state_dict())
    (tmp_path / "plain").mkdir()
    fit_plain(reference, plugins=[_fp16_plugin()], callbacks=[RecordEpochs(str(tmp_path / "plain"))])
    fit_pipeline(piped, 2, chunks=3, plugins=[_fp16_plugin()], callbacks=[RecordEpochs(str(tmp_path))])
    ends = [json.loads((tmp_path / f"end{rank}.json").read_text()) for rank in range(2)]
    plain_end = json.loads((tmp_path / "plain" / "end0.json").read_text())
    assert ends[0]["scale"] == ends[1]["scale"] == plain_end["scale"] == 65536.0 * 0.5  # one skipped step
    assert_same_weights(reference, piped, rtol=1e-2, atol=1e-3)

"""Validation, predict and checkpoints with data-parallel replicas of the pipeline: a 2 x 2
checkpoint resumes exactly under 2 x 2 and loads under 4 x 1 and 1 x 4."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pipe.checkpoint import consolidate
from tests.models import LifecycleNet, RecordMetrics, fit_plain, loader, plain_trainer
from tests.pipeline import assert_same_weights, fit_pipeline, pipeline_trainer

pytestmark = pytest.mark.timeout(300)
EPOCH = {"max_steps": -1}


def _val(batch_size: int) -> torch.utils.data.DataLoader:
    return loader(n=20, batch_size=batch_size, seed=5)


def _trained(initial: dict, epochs: int) -> LifecycleNet:
    model = LifecycleNet()
    model.load_state_dict(initial)
    fit_plain(model, loader(batch_size=24), max_epochs=epochs, **EPOCH)
    return model


def test_replicas_validate_checkpoint_resume_under_other_layouts_and_predict(tmp_path: Path) -> None:
    torch.manual_seed(0)
    initial = LifecycleNet().state_dict()
    two_epochs = LifecycleNet()
    two_epochs.load_state_dict(initial)
    plain = fit_plain(two_epochs, loader(batch_size=24), val_data=_val(10), max_epochs=2, **EPOCH)

    piped = LifecycleNet()
    piped.load_state_dict(initial)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val_loss", save_last=True)
    fit_pipeline(
        piped, 4, data=loader(batch_size=12), val_data=_val(5), stages=2, chunks=3, max_epochs=2,
        enable_checkpointing=True, callbacks=[checkpoints, RecordMetrics(str(tmp_path))], **EPOCH,
    )  # fmt: skip
    assert_same_weights(two_epochs, piped)
    expected = float(plain.callback_metrics["val_loss"])
    for rank in range(4):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text())["val_loss"] == pytest.approx(expected, rel=1e-5)
    last = tmp_path / "ckpt" / "last.ckpt"
    assert sorted(p.name for p in last.iterdir()) == ["meta.pt", "stage-00000.pt", "stage-00001.pt"]  # written once
    consolidate(last, tmp_path / "plain.ckpt")
    assert_same_weights(two_epochs, LifecycleNet.load_from_checkpoint(tmp_path / "plain.ckpt", weights_only=True))

    three = _trained(initial, 3)
    for devices, stages, batch in ((4, 2, 12), (4, 4, 24), (4, 1, 6)):  # 2 x 2, 4 x 1, 1 x 4
        resumed = LifecycleNet()
        fit_pipeline(resumed, devices, data=loader(batch_size=batch), ckpt_path=str(last), stages=stages, chunks=2, max_epochs=3, **EPOCH)
        assert_same_weights(three, resumed, rtol=1e-4, atol=1e-6)

    # predict: every sample once, in order, on global rank 0
    expected_out = torch.cat(plain_trainer().predict(three, loader(batch_size=12)))
    predictions = pipeline_trainer(4, stages=2, chunks=2).predict(resumed, loader(batch_size=12))
    assert predictions is not None and len(predictions) == 6
    torch.testing.assert_close(torch.cat(predictions), expected_out, rtol=1e-4, atol=1e-6)


def test_bf16_mixed_with_replicas_matches_plain_bf16() -> None:
    torch.manual_seed(0)
    reference = LifecycleNet()
    piped = LifecycleNet()
    piped.load_state_dict(reference.state_dict())
    fit_plain(reference, loader(batch_size=24), precision="bf16-mixed")
    fit_pipeline(piped, 4, data=loader(batch_size=12), stages=2, chunks=3, precision="bf16-mixed")
    assert_same_weights(reference, piped, rtol=2e-2, atol=2e-3)


def test_sharded_checkpoint_resumes_under_2x2_shard_and_loads_under_4x1_and_1x4(tmp_path: Path) -> None:
    torch.manual_seed(0)
    initial = LifecycleNet().state_dict()
    piped = LifecycleNet()
    piped.load_state_dict(initial)
    checkpoint_cb = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    fit_pipeline(
        piped, 4, data=loader(batch_size=12), stages=2, chunks=2, data_parallel="shard", max_epochs=2,
        enable_checkpointing=True, callbacks=[checkpoint_cb], **EPOCH,
    )  # fmt: skip
    two_epochs = _trained(initial, 2)
    assert_same_weights(two_epochs, piped)
    last = tmp_path / "last.ckpt"
    # per stage: the index (replica 0) and a torch.distributed.checkpoint directory with every replica's part
    assert sorted(p.name for p in last.iterdir()) == ["meta.pt", "stage-00000.dcp", "stage-00000.pt", "stage-00001.dcp", "stage-00001.pt"]
    assert len(list((last / "stage-00000.dcp").glob("*.distcp"))) == 2
    consolidate(last, tmp_path / "plain.ckpt")
    assert_same_weights(two_epochs, LifecycleNet.load_from_checkpoint(tmp_path / "plain.ckpt", weights_only=True))
    three = _trained(initial, 3)
    for stages, batch, mode in ((2, 12, "shard"), (4, 24, "replicate"), (1, 6, "replicate")):
        resumed = LifecycleNet()
        fit_pipeline(
            resumed, 4, data=loader(batch_size=batch), ckpt_path=str(last), stages=stages, chunks=2,
            data_parallel=mode, max_epochs=3, **EPOCH,
        )  # fmt: skip
        assert_same_weights(three, resumed, rtol=1e-4, atol=1e-6)


def test_early_stopping_stops_every_rank_of_every_replica_at_the_same_epoch(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import EarlyStopping

    from tests.models import RecordEpochs

    torch.manual_seed(0)
    stopper = EarlyStopping(monitor="val_loss", min_delta=10.0, patience=1)
    fit_pipeline(
        LifecycleNet(), 4, data=loader(batch_size=12), val_data=_val(5), stages=2, chunks=3, max_epochs=10,
        callbacks=[stopper, RecordEpochs(str(tmp_path))], **EPOCH,
    )  # fmt: skip
    ends = [json.loads((tmp_path / f"end{rank}.json").read_text()) for rank in range(4)]
    assert all(end == ends[0] for end in ends)
    assert ends[0]["should_stop"] and ends[0]["epoch"] == 2 < 10

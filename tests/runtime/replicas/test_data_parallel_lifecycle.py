"""Validation, predict and checkpoints with data-parallel replicas of the pipeline: evaluation
counts every sample once, as plain Lightning does; a 2 x 2 checkpoint resumes exactly under 2 x 2
and loads under 4 x 1 and 1 x 4."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe.checkpoint import consolidate
from tests.models import LifecycleNet, RecordMetrics, TiedNet, dataset, fit_plain, loader, plain_trainer
from tests.pipeline import assert_same_weights, fit_pipeline, pipeline_trainer

pytestmark = pytest.mark.timeout(300)
EPOCH = {"max_steps": -1}


def _val(batch_size: int) -> torch.utils.data.DataLoader:
    """21 samples: with 2 replicas of batch 5 the last step has one sample, on one replica."""
    return loader(n=21, batch_size=batch_size, seed=5)


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
        fit_pipeline(
            resumed,
            devices,
            data=loader(batch_size=batch),
            ckpt_path=str(last),
            stages=stages,
            chunks=2,
            max_epochs=3,
            **EPOCH,
        )
        assert_same_weights(three, resumed, rtol=1e-4, atol=1e-6)

    # predict: every sample once, in order, on global rank 0
    expected_out = torch.cat(plain_trainer().predict(three, loader(batch_size=12)))
    predictions = pipeline_trainer(4, stages=2, chunks=2).predict(resumed, loader(batch_size=12))
    assert predictions is not None and len(predictions) == 6
    torch.testing.assert_close(torch.cat(predictions), expected_out, rtol=1e-4, atol=1e-6)


class _EvalNet(LifecycleNet):
    """Logs a per-sample mean, and a mean over "tokens" (1 to 3 per sample) with their count as
    ``batch_size``, which Lightning's epoch mean weights by; keeps the samples it validated."""

    def __init__(self) -> None:
        super().__init__()
        self.validated: list[float] = []

    def _evaluate(self, kind: str, batch: Any) -> None:
        x, y = batch
        losses = F.cross_entropy(self(x), y, reduction="none")
        if kind == "val":
            self.validated += x[:, 0].tolist()
        tokens = (y + 1).float()
        self.log(f"{kind}_loss", losses.mean())
        self.log(f"{kind}_per_token", (losses * tokens).sum() / tokens.sum(), batch_size=int(tokens.sum()))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate("val", batch)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate("test", batch)


class _EvaluationMetrics(L.Callback):
    """Each rank's ``callback_metrics`` after validation and after test, in ``<folder>/<kind><rank>.json``
    (after validation, with the samples the rank's validation steps saw)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def _write(self, trainer: L.Trainer, kind: str) -> None:
        values: dict[str, Any] = {k: float(v) for k, v in trainer.callback_metrics.items()}
        if kind == "validation":
            values["validated"] = trainer.lightning_module.validated
        (Path(self.folder) / f"{kind}{trainer.global_rank}.json").write_text(json.dumps(values))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer, "validation")

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer, "test")


@pytest.mark.parametrize(
    "stages, drop_last, mode",
    [(2, False, "replicate"), (1, False, "replicate"), (2, True, "replicate"), (2, False, "shard")],
    ids=["2x2", "1x4", "2x2-drop_last", "2x2-shard"],
)
def test_evaluation_with_replicas_counts_every_sample_once(
    tmp_path: Path, stages: int, drop_last: bool, mode: str
) -> None:
    """21 samples in batches of 5: the replicas split them without repeating any (the last step has
    one sample, on one replica; the others skip it, or under ``shard`` run its forward on a padding
    sample and count nothing), and every rank's epoch means equal plain Lightning's."""
    torch.manual_seed(0)
    model = _EvalNet()

    def data() -> DataLoader:
        return DataLoader(dataset(21, seed=5), batch_size=5, drop_last=drop_last)

    expected = {
        **plain_trainer().validate(model, data(), verbose=False)[0],
        **plain_trainer().test(model, data(), verbose=False)[0],
    }
    assert len(expected) == 4
    model.validated = []
    trainer = pipeline_trainer(
        4, stages=stages, chunks=2, data_parallel=mode, callbacks=[_EvaluationMetrics(str(tmp_path))]
    )
    trainer.validate(model, data(), verbose=False)
    trainer.test(model, data(), verbose=False)
    validated = []
    for rank in range(4):
        seen = {
            **json.loads((tmp_path / f"validation{rank}.json").read_text()),
            **json.loads((tmp_path / f"test{rank}.json").read_text()),
        }
        for name, value in expected.items():
            assert seen[name] == pytest.approx(value, rel=1e-6), (rank, name, seen[name], value)
        validated += seen["validated"]  # only a last stage's steps get past the model's forward
    samples = data().dataset.tensors[0][: 20 if drop_last else 21, 0].tolist()
    # each once; a padding step runs no step, except under shard: there replica 1 runs its first sample again
    padding = [samples[1]] if mode == "shard" and not drop_last else []
    assert sorted(validated) == sorted(samples + padding)


class _TokenEvalNet(TiedNet):
    """Validates a language model's loss, the mean over the tokens whose label is not -100."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        ids, labels = batch
        self.log("val_loss", F.cross_entropy(self(ids).reshape(-1, self.VOCAB), labels.reshape(-1)))


def test_a_token_mean_validated_with_replicas_equals_plain_lightning_on_the_global_batch() -> None:
    """``loss_weight=token_count(...)``, 2 x 2 with batches of 4 (global batch 8), 21 rows holding 1 to 5
    tokens (row 3 none): each step's ``val_loss`` is the token mean of the global batch (replica j's
    batch holds rows j, j + 2, ... of it) and Lightning's epoch mean weights the steps by their rows,
    as plain Lightning validating batches of 8; the last step has 3 rows on replica 0 and 2 on
    replica 1. Weighting the replicas' token means by their rows instead was 1.1e-3 off (2.6208 for 2.6179)."""
    from lightning_pipe import token_count

    torch.manual_seed(0)
    model = _TokenEvalNet()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.VOCAB, (21, model.LENGTH), generator=g)
    kept = torch.arange(model.LENGTH) < torch.randint(1, model.LENGTH + 1, (21, 1), generator=g)
    kept[3] = False
    labels = torch.where(kept, (ids + 1) % model.VOCAB, torch.full_like(ids, -100))

    def data(batch_size: int) -> DataLoader:
        return DataLoader(TensorDataset(ids, labels), batch_size=batch_size)

    expected = plain_trainer().validate(model, data(8), verbose=False)[0]["val_loss"]
    per_replica_batch = plain_trainer().validate(model, data(4), verbose=False)[0]["val_loss"]
    assert abs(per_replica_batch / expected - 1) > 1e-3  # the batching matters for a token mean
    trainer = pipeline_trainer(4, stages=2, chunks=2, loss_weight=token_count(labels=1, shift=False))
    logged = trainer.validate(model, data(4), verbose=False)[0]["val_loss"]
    assert logged == pytest.approx(expected, rel=1e-6)


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
    assert sorted(p.name for p in last.iterdir()) == [
        "meta.pt",
        "stage-00000.dcp",
        "stage-00000.pt",
        "stage-00001.dcp",
        "stage-00001.pt",
    ]
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


@pytest.mark.parametrize("schedule", ["pipemare", "pipedream", "pipedream_2bw"])
def test_async_checkpoint_with_replicas_resumes_exactly(tmp_path: Path, schedule: str) -> None:
    """2 stages x 2 replicas: each replica's gradients not yet applied at the save are its own, and
    a resume under the same layout continues with each replica's own, bit for bit."""
    from tests.models import TinyNet

    options = dict(stages=2, schedule=schedule, chunks=2, **EPOCH)
    torch.manual_seed(0)
    initial = TinyNet().state_dict()
    straight = TinyNet()
    straight.load_state_dict(initial)
    fit_pipeline(straight, 4, data=loader(batch_size=6), max_epochs=3, **options)
    first = TinyNet()
    first.load_state_dict(initial)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    fit_pipeline(
        first, 4, data=loader(batch_size=6), max_epochs=2, enable_checkpointing=True, callbacks=[ckpt], **options
    )
    resumed = TinyNet()
    fit_pipeline(resumed, 4, data=loader(batch_size=6), ckpt_path=str(tmp_path / "last.ckpt"), max_epochs=3, **options)
    differences = {
        n: (a - b).abs().max().item()
        for (n, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items())
    }
    assert max(differences.values()) == 0.0, differences
    saved = torch.load(tmp_path / "last.ckpt" / "stage-00000.pt", weights_only=True)["extra"]["async"]
    assert len(saved["replica_pending"]) == 2 and saved["pending"]  # each replica's own, and their mean
    if schedule == "pipedream_2bw":  # one pipeline on the global batch continues from the replicas' mean
        alone = TinyNet()
        fit_pipeline(
            alone, 2, data=loader(batch_size=12), ckpt_path=str(tmp_path / "last.ckpt"), max_epochs=3, **options
        )
        assert_same_weights(straight, alone)

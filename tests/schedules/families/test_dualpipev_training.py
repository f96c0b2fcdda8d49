"""DualPipeV trains like plain training: 2 and 4 processes, chunks 2x and 4x the processes, with and
without recomputation, tied weights, parameters outside the Sequential, a block container,
replicas; it evaluates, predicts, checkpoints, resumes and consolidates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_pipe import PipelineStrategy
from lightning_pipe.checkpoint import is_pipeline_checkpoint
from lightning_pipe.checkpoint import main as consolidate_main
from tests.models import (
    CLASSES,
    HIDDEN,
    IN,
    LifecycleNet,
    TiedNet,
    TinyNet,
    WrappedNet,
    fit_plain,
    loader,
    plain_trainer,
    token_loader,
)
from tests.pipeline import assert_same_weights, fit_pipeline, pipeline_trainer, twins

EPOCH = {"max_steps": -1}


def _data() -> torch.utils.data.DataLoader:
    return loader(n=48, batch_size=12)  # four full batches: every step has 12 samples


@pytest.mark.parametrize(
    "stages, chunks, recompute",
    [
        (2, 4, "never"),  # 2 x processes
        (2, 8, "always"),  # 4 x processes
        pytest.param(2, 8, "never", marks=pytest.mark.slow),
        pytest.param(2, 4, "always", marks=pytest.mark.slow),
        pytest.param(4, 8, "never", marks=pytest.mark.slow),
        pytest.param(4, 12, "always", marks=pytest.mark.slow),  # 12 samples: 12 micro-batches at most
    ],
)
def test_weights_equal_plain_training(stages: int, chunks: int, recompute: str) -> None:
    torch.manual_seed(0)
    reference, piped = twins(TinyNet(depth=4 * stages))  # a Linear on every one of the 2 x stages stages
    fit_plain(reference, _data())
    fit_pipeline(piped, stages, _data(), schedule="dualpipev", chunks=chunks, recompute=recompute)
    assert_same_weights(reference, piped)


class _BackwardFirst(TinyNet):
    """Runs each F&B unit's backward half before its forward half, through the model's hook."""

    def overlapped_forward_backward(self, forward: Any, backward: Any) -> None:
        backward()
        forward()


def test_the_models_overlap_hook_runs_the_units_across_processes() -> None:
    torch.manual_seed(0)
    reference, piped = twins(_BackwardFirst(depth=8))
    fit_plain(reference, _data())
    fit_pipeline(piped, 2, _data(), schedule="dualpipev", chunks=8)
    assert_same_weights(reference, piped)


def test_parameters_outside_the_sequential_and_tied_weights() -> None:
    torch.manual_seed(0)
    reference, piped = twins(WrappedNet())
    fit_plain(reference, _data())
    fit_pipeline(piped, 2, _data(), schedule="dualpipev", chunks=4, recompute="except_last")
    assert_same_weights(reference, piped)
    # TiedNet ties its first and last layer: both on process 0, the two ends of the V
    reference, piped = twins(TiedNet())
    fit_plain(reference, token_loader(), gradient_clip_val=0.5)
    fit_pipeline(piped, 2, token_loader(), schedule="dualpipev", chunks=4, gradient_clip_val=0.5, balance=[1, 1, 2, 1])
    assert_same_weights(reference, piped)


class _LoopNet(L.LightningModule):
    """Blocks in an ``nn.ModuleList`` the forward loops over (a block container, ``module="blocks"``),
    an embedding before them and a head after."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, HIDDEN)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(depth)])
        self.head = nn.Linear(HIDDEN, CLASSES)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        hidden = torch.tanh(self.embed(x))
        for block in self.blocks:
            hidden = block(hidden)
        return F.cross_entropy(self.head(hidden), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def test_a_block_container_trains_like_plain_training() -> None:
    torch.manual_seed(0)
    reference, piped = twins(_LoopNet())
    fit_plain(reference, _data())
    fit_pipeline(piped, 2, _data(), schedule="dualpipev", chunks=4, module="blocks", recompute="always")
    assert_same_weights(reference, piped)


def test_replicas_train_as_plain_training_on_the_global_batch() -> None:
    torch.manual_seed(0)
    reference, piped = twins(TinyNet(depth=8))
    fit_plain(reference, loader(n=96, batch_size=24))
    fit_pipeline(piped, 4, loader(n=96, batch_size=12), schedule="dualpipev", chunks=4, stages=2)
    assert_same_weights(reference, piped)


def test_too_few_chunks_are_refused_with_the_smallest_valid_value() -> None:
    # raised in the processes at setup, before the first batch, as Lightning's configuration error
    with pytest.raises(
        Exception,
        match=r"MisconfigurationException: schedule='dualpipev' .*chunks >= 2 x processes = 4 .*Use chunks=4 or more",
    ):
        fit_pipeline(TinyNet(depth=8), 2, _data(), schedule="dualpipev", chunks=3)


def test_defaults() -> None:
    strategy = PipelineStrategy(schedule="dualpipev")
    assert strategy.config.virtual_stages == 2
    with pytest.raises(ValueError, match="exactly 2"):
        PipelineStrategy(schedule="dualpipev", virtual_stages=3)


def test_evaluate_predict_checkpoint_resume_under_another_layout_and_consolidate(tmp_path: Path) -> None:
    torch.manual_seed(0)
    initial = LifecycleNet().state_dict()
    plain_model = LifecycleNet()
    plain_model.load_state_dict(initial)
    val = loader(n=24, batch_size=8, seed=5)
    plain = fit_plain(plain_model, _data(), val_data=val, max_epochs=2, **EPOCH)

    piped = LifecycleNet()
    piped.load_state_dict(initial)
    trainer = fit_pipeline(
        piped, 2, _data(), val_data=val, schedule="dualpipev", chunks=4, max_epochs=2, enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)], **EPOCH,
    )  # fmt: skip
    assert_same_weights(plain_model, piped)
    assert float(trainer.callback_metrics["val_loss"]) == pytest.approx(
        float(plain.callback_metrics["val_loss"]), rel=1e-5
    )
    last = tmp_path / "last.ckpt"
    assert is_pipeline_checkpoint(last)

    # a DualPipeV checkpoint resumes under DualPipeV and under plain 1F1B
    three = LifecycleNet()
    three.load_state_dict(initial)
    fit_plain(three, _data(), max_epochs=3, **EPOCH)
    for options in ({"schedule": "dualpipev", "chunks": 4}, {"schedule": "1f1b", "chunks": 3}):
        resumed = LifecycleNet()
        fit_pipeline(resumed, 2, _data(), ckpt_path=str(last), max_epochs=3, **options, **EPOCH)
        assert_same_weights(three, resumed)

    # predict on the V: rank 0 gets the single-process outputs, in order (a short last batch too)
    expected = torch.cat(plain_trainer().predict(three, loader(batch_size=12)))
    predictions = pipeline_trainer(2, schedule="dualpipev", chunks=4).predict(resumed, loader(batch_size=12))
    assert predictions is not None and len(predictions) == 6
    torch.testing.assert_close(torch.cat(predictions), expected, rtol=1e-4, atol=1e-6)

    plain_file = tmp_path / "plain.ckpt"
    consolidate_main([str(last), str(plain_file)])
    two_epochs = LifecycleNet.load_from_checkpoint(plain_file, weights_only=True)
    assert_same_weights(plain_model, two_epochs)

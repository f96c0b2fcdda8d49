"""Several stages per process: interleaved 1F1B and ZB-V train like plain training, evaluate,
predict, checkpoint and resume under another layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pipe import PipelineStrategy
from lightning_pipe.checkpoint import is_pipeline_checkpoint
from lightning_pipe.checkpoint import main as consolidate_main
from tests.models import (
    LifecycleNet,
    NamedLayersNet,
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


def _val() -> torch.utils.data.DataLoader:
    return loader(n=20, batch_size=8, seed=5)


@pytest.mark.parametrize(
    "schedule, stages, chunks, recompute",
    [
        ("interleaved_1f1b", 2, 4, "never"),
        ("interleaved_1f1b", 2, 3, "always"),  # chunks not a multiple of the processes: one round
        ("interleaved_1f1b", 4, 4, "always"),
        ("interleaved_1f1b", 4, 6, "never"),
        ("zbv", 2, 4, "never"),
        ("zbv", 2, 3, "always"),
        ("interleaved_zero_bubble", 2, 4, "never"),
        ("interleaved_zero_bubble", 2, 3, "always"),
        ("interleaved_zero_bubble", 4, 4, "always"),
        ("interleaved_zero_bubble", 4, 8, "never"),
    ],
)
def test_weights_equal_plain_training(schedule: str, stages: int, chunks: int, recompute: str) -> None:
    torch.manual_seed(0)
    reference, piped = twins(TinyNet(depth=4 * stages))  # a Linear on every one of the 2 x stages stages
    fit_plain(reference)
    fit_pipeline(piped, stages, schedule=schedule, chunks=chunks, recompute=recompute)
    assert_same_weights(reference, piped)


def test_interleaved_zero_bubble_with_three_stages_per_process() -> None:
    torch.manual_seed(0)
    reference, piped = twins(TinyNet(depth=12))
    fit_plain(reference)
    fit_pipeline(piped, 2, schedule="interleaved_zero_bubble", virtual_stages=3, chunks=4, recompute="except_last")
    assert_same_weights(reference, piped)


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv"])  # the two shapes: round robin and the V
def test_a_sequential_of_named_layers_keeps_their_names_and_order(schedule: str) -> None:
    """An ``nn.Sequential(OrderedDict(...))`` (torchvision's ViT encoder) with 12 named layers: each
    process's stages hold them in the Sequential's order, under the unsplit module's names."""
    torch.manual_seed(0)
    reference, piped = twins(NamedLayersNet())
    fit_plain(reference)
    fit_pipeline(piped, 2, schedule=schedule, chunks=4)
    assert_same_weights(reference, piped)
    assert "layers.encoder_layer_10.weight" in piped.state_dict()


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv", "interleaved_zero_bubble"])
def test_parameters_outside_the_sequential_and_tied_weights(schedule: str) -> None:
    torch.manual_seed(0)
    reference, piped = twins(WrappedNet())
    fit_plain(reference)
    fit_pipeline(piped, 2, schedule=schedule, chunks=4, recompute="except_last")
    assert_same_weights(reference, piped)
    # TiedNet ties its first and last layer: on one process under ZB-V, across two under interleaving
    reference, piped = twins(TiedNet())
    fit_plain(reference, token_loader(), gradient_clip_val=0.5)
    fit_pipeline(piped, 2, token_loader(), schedule=schedule, chunks=3, gradient_clip_val=0.5, balance=[1, 1, 2, 1])
    assert_same_weights(reference, piped)


def test_evaluate_predict_checkpoint_resume_under_another_layout_and_consolidate(tmp_path: Path) -> None:
    torch.manual_seed(0)
    initial = LifecycleNet().state_dict()
    plain_model = LifecycleNet()
    plain_model.load_state_dict(initial)
    plain = fit_plain(plain_model, val_data=_val(), max_epochs=2, **EPOCH)

    piped = LifecycleNet()
    piped.load_state_dict(initial)
    trainer = fit_pipeline(
        piped, 2, val_data=_val(), schedule="zbv", chunks=4, max_epochs=2, enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)], **EPOCH,
    )  # fmt: skip
    assert_same_weights(plain_model, piped)
    assert float(trainer.callback_metrics["val_loss"]) == pytest.approx(
        float(plain.callback_metrics["val_loss"]), rel=1e-5
    )
    last = tmp_path / "last.ckpt"
    assert is_pipeline_checkpoint(last)

    # a ZB-V checkpoint (4 stages on 2 processes) resumes under interleaving and under plain 1F1B
    three = LifecycleNet()
    three.load_state_dict(initial)
    fit_plain(three, max_epochs=3, **EPOCH)
    for options in ({"schedule": "interleaved_1f1b", "chunks": 4}, {"schedule": "1f1b", "chunks": 3}):
        resumed = LifecycleNet()
        fit_pipeline(resumed, 2, ckpt_path=str(last), max_epochs=3, **options, **EPOCH)
        assert_same_weights(three, resumed)

    # predict and validate on the virtual layout: rank 0 gets the single-process outputs, in order
    expected = torch.cat(plain_trainer().predict(three, loader(batch_size=12)))
    for schedule in ("zbv", "interleaved_1f1b"):
        predictions = pipeline_trainer(2, schedule=schedule, chunks=4).predict(resumed, loader(batch_size=12))
        assert predictions is not None and len(predictions) == 6
        torch.testing.assert_close(torch.cat(predictions), expected, rtol=1e-4, atol=1e-6)
    piped_val = pipeline_trainer(2, schedule="interleaved_1f1b", chunks=3).validate(resumed, _val(), verbose=False)
    plain_val = plain_trainer().validate(three, _val(), verbose=False)
    assert piped_val[0]["val_loss"] == pytest.approx(plain_val[0]["val_loss"], rel=1e-5)

    plain_file = tmp_path / "plain.ckpt"
    consolidate_main([str(last), str(plain_file)])
    two_epochs = LifecycleNet.load_from_checkpoint(plain_file, weights_only=True)
    assert_same_weights(plain_model, two_epochs)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"schedule": "gpipe", "virtual_stages": 2}, "one stage per process"),
        ({"schedule": "interleaved_1f1b", "virtual_stages": 1}, "at least 2"),
        ({"schedule": "zbv", "virtual_stages": 3}, "exactly 2"),
        ({"schedule": "1f1b", "virtual_stages": 0}, "integer >= 1"),
    ],
)
def test_bad_virtual_stages_are_rejected_at_construction(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PipelineStrategy(**options)


def test_defaults_and_chunks_interleaving_cannot_round() -> None:
    assert PipelineStrategy(schedule="zbv").virtual_stages == 2
    assert PipelineStrategy(schedule="interleaved_1f1b").virtual_stages == 2
    assert PipelineStrategy(schedule="1f1b").virtual_stages == 1
    with pytest.raises(Exception, match="rounds of equal size"):
        fit_pipeline(TinyNet(), 2, schedule="interleaved_1f1b", chunks=5)

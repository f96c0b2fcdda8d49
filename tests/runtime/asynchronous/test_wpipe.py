"""WPipe inside the Trainer loop: its update rule against plain PyTorch, its weight copies against
2BW's, and an exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.models import TinyNet, loader
from tests.pipeline import assert_same_weights, fit_pipeline
from tests.runtime.asynchronous.test_pipemare import WeightMemory
from tests.runtime.test_async_pipeline import _cycle, _reference, _stage_delays

pytestmark = pytest.mark.timeout(300)


def _copies(folder: Path, stages: int) -> list[float]:
    records = [json.loads((folder / f"mem{r}.json").read_text()) for r in range(stages)]
    return [(r["params"] + r["stashed"] + r["velocity"]) / r["params"] for r in records]


@pytest.mark.parametrize("stages, chunks, samples", [(2, 4, 64), (4, 3, 64), (4, 3, 62)])
def test_weights_follow_wpipes_rule_and_hold_fewer_copies_than_2bw(
    tmp_path: Path, stages: int, chunks: int, samples: int
) -> None:
    """After 6 steps (an epoch, its short last batch drained) the weights are plain PyTorch's with G0's
    gradients applied one step late and G1's at once; 2BW's rule (one step late everywhere) is not it.
    With 62 samples the last batch (2 samples) has fewer micro-batches than ``stages - 1`` and runs
    from an empty pipeline, drained at once, under the same rule."""
    torch.manual_seed(0)
    piped = TinyNet(lr=0.1)
    piped.optimizer = "plain-sgd"
    initial = piped.state_dict()
    steps = 6
    batches = [b for _, b in zip(range(steps), iter(_cycle(loader(samples))))]
    expected, two_bw = TinyNet(), TinyNet()
    for reference, schedule in ((expected, "wpipe"), (two_bw, "pipedream_2bw")):
        reference.load_state_dict(initial)
        _reference(reference, batches, 0.1, _stage_delays(schedule, stages, chunks, reference))
    fit_pipeline(
        piped, stages, loader(samples), schedule="wpipe", chunks=chunks, max_steps=steps,
        callbacks=[WeightMemory(str(tmp_path))],
    )  # fmt: skip
    assert_same_weights(expected, piped, rtol=1e-4, atol=1e-6)
    with pytest.raises(AssertionError):
        assert_same_weights(two_bw, piped, rtol=1e-4, atol=1e-6)
    half = stages // 2  # G0 keeps the version its last backwards need across one update; G1 never does
    assert _copies(tmp_path, stages) == [2.0] * half + [1.0] * (stages - half)


def test_2bw_holds_a_second_copy_on_every_stage_but_the_last(tmp_path: Path) -> None:
    """The comparison the docs state: on 4 stages WPipe holds 2, 2, 1, 1 copies, 2BW 2, 2, 2, 1."""
    torch.manual_seed(0)
    fit_pipeline(TinyNet(), 4, schedule="pipedream_2bw", chunks=3, max_steps=6, callbacks=[WeightMemory(str(tmp_path))])
    assert _copies(tmp_path, 4) == [2.0, 2.0, 2.0, 1.0]


def test_replicas_equal_one_pipeline_on_the_global_batch() -> None:
    from tests.pipeline import twins

    torch.manual_seed(0)
    one, two = twins(TinyNet())
    fit_pipeline(one, 2, data=loader(batch_size=24), schedule="wpipe", chunks=3)
    fit_pipeline(two, 4, data=loader(batch_size=12), stages=2, schedule="wpipe", chunks=3)
    assert_same_weights(one, two)


def test_checkpoint_under_wpipe_resumes_exactly(tmp_path: Path) -> None:
    """G0's gradient not yet applied goes into the checkpoint and is applied after the resume."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    initial = TinyNet().state_dict()
    options = dict(schedule="wpipe", chunks=3, max_steps=-1)
    straight, first, resumed = TinyNet(), TinyNet(), TinyNet()
    straight.load_state_dict(initial)
    first.load_state_dict(initial)
    fit_pipeline(straight, 4, max_epochs=3, **options)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    fit_pipeline(first, 4, max_epochs=2, enable_checkpointing=True, callbacks=[ckpt], **options)
    fit_pipeline(resumed, 4, ckpt_path=str(tmp_path / "last.ckpt"), max_epochs=3, **options)
    assert_same_weights(straight, resumed)
    with pytest.raises(AssertionError):
        assert_same_weights(first, resumed)  # the resumed run did train on


def test_weights_tied_across_stages_are_refused() -> None:
    from tests.models import TiedNet, token_loader

    with pytest.raises(Exception, match="schedule='wpipe' applies gradients with a different delay on each stage"):
        fit_pipeline(TiedNet(), 2, token_loader(), schedule="wpipe", chunks=2)


def test_too_few_chunks_are_refused_before_training() -> None:
    with pytest.raises(Exception, match=r"schedule='wpipe' keeps two weight versions.*Use chunks >= 3"):
        fit_pipeline(TinyNet(), 4, schedule="wpipe", chunks=2)

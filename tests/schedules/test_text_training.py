"""A schedule handed in as text trains like plain training: a hand-written order with two stages
per process in a V and a split backward, evaluated on the text's stages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_pipe import PipelineStrategy
from lightning_pipe.observe.picture import TimelinePicture
from lightning_pipe.schedules import build, load_schedule
from tests.models import TinyNet, fit_plain, loader
from tests.pipeline import assert_same_weights, fit_pipeline, twins
from tests.torch_texts import TORCH_SCHEDULES, torch_text

# Stages 0 and 3 on process 0, 1 and 2 on process 1; every forward first, then each micro-batch's
# input gradient (I) and, at the end of each stage, the weight gradients (W); cells apart by
# commas on one line, by spaces on the other.
V_BY_HAND = """# my own schedule: 2 processes, 4 stages in a V, 4 micro-batches
0F0,0F1,0F2,0F3, 3F0,3I0,3F1,3I1,3F2,3I2,3F3,3I3, 3W0,3W1,3W2,3W3, 0I0,0I1,0I2,0I3, 0W0,0W1,0W2,0W3
1F0 2F0 1F1 2F1 1F2 2F2 1F3 2F3  2I0 1I0 2I1 1I1 2I2 1I2 2I3 1I3  2W0 2W1 2W2 2W3 1W0 1W1 1W2 1W3
"""


def test_a_hand_written_schedule_file_trains_as_plain_training(tmp_path: Path) -> None:
    path = tmp_path / "my_schedule.csv"
    path.write_text(V_BY_HAND)
    torch.manual_seed(0)
    reference, piped = twins(TinyNet(depth=8))  # two layers on each of the 4 stages
    fit_plain(reference)
    # chunks and virtual_stages come from the text; the last batch of 4 samples still splits into 4
    picture = tmp_path / "timeline.svg"
    trainer = fit_pipeline(
        piped,
        2,
        schedule_text=str(path),
        val_data=loader(n=20, batch_size=8, seed=5),
        callbacks=[TimelinePicture(picture)],
    )
    assert_same_weights(reference, piped)
    assert (trainer.strategy.virtual_stages, trainer.strategy.chunks) == (2, None)
    assert load_schedule(V_BY_HAND).actions != build("zbv", 2, 4, 2).actions  # not a built-in's order
    svg = picture.read_text()  # the last step, measured, under the text's simulated prediction
    assert 'data-title="text &#x27;my_schedule.csv&#x27;: predicted from' in svg
    assert 'data-title="text &#x27;my_schedule.csv&#x27;: measured, the last training step' in svg


# Texts whose ranks take the micro-batches in different orders: every message meets the receive of
# the micro-batch its action names (a tag per micro-batch), not the receive posted first.
REORDERED = {
    # rank 1 forwards micro-batch 1 first while rank 0 sends micro-batch 0 first
    "second_rank_forwards_1_first": (2, "0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3\n1F1,1B1,1F0,1B0,1F2,1B2,1F3,1B3\n"),
    # rank 0 takes its backwards newest first while rank 1 sends the oldest gradient first
    "first_rank_backwards_newest_first": (2, "0F0,0F1,0F2,0F3,0B3,0B2,0B1,0B0\n1F0,1F1,1F2,1F3,1B0,1B1,1B2,1B3\n"),
    # the middle rank of 3 swaps its first two forwards
    "middle_rank_swaps_its_forwards": (
        3,
        "0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3\n1F1,1F0,1F2,1F3,1B0,1B1,1B2,1B3\n2F0,2B0,2F1,2B1,2F2,2B2,2F3,2B3\n",
    ),
}


@pytest.mark.parametrize("case", sorted(REORDERED))
def test_ranks_taking_the_micro_batches_in_different_orders_train_as_plain_training(case: str) -> None:
    """Six steps; the last batch of 5 samples splits into micro-batches of 2, 1, 1 and 1, so two shapes'
    headers travel in that step, each met by the micro-batch it was sent with whichever comes first."""
    devices, text = REORDERED[case]
    torch.manual_seed(0)
    reference, piped = twins(TinyNet(depth=6, optimizer="plain-sgd" if devices == 3 else "sgd"))
    fit_plain(reference, loader(n=65))
    fit_pipeline(piped, devices, loader(n=65), schedule_text=text)
    assert_same_weights(reference, piped)


# torch's own texts, written by its _dump_csv from its schedule classes: B the whole backward, I the input
# gradient, W the weight gradient, mixed in one text (DualPipeV); with communication, torch's lowering (its
# UNSHARD, RESHARD and REDUCE_GRAD skipped, the hand-overs between one rank's stages placed at their computes)
RUNNABLE_TORCH = [name for name in TORCH_SCHEDULES if name != "Schedule1F1B"]


@pytest.mark.parametrize("communication", [False, True], ids=["compute_only", "compute_comms"])
@pytest.mark.parametrize("name", RUNNABLE_TORCH)
def test_torch_s_own_text_trains_as_plain_training(name: str, communication: bool) -> None:
    text = torch_text(name, 2, 4, communication=communication)
    stages = 2 * (TORCH_SCHEDULES[name] or 2)
    torch.manual_seed(0)
    reference, piped = twins(TinyNet(depth=2 * stages, optimizer="plain-sgd" if communication else "sgd"))
    fit_plain(reference)
    fit_pipeline(piped, 2, schedule_text=text)
    assert_same_weights(reference, piped)


@pytest.mark.slow  # 4 processes, 8 stages: about 4 s each on 2 cores
@pytest.mark.parametrize("name", RUNNABLE_TORCH)
def test_torch_s_own_text_on_4_processes_trains_as_plain_training(name: str) -> None:
    text = torch_text(name, 4, 8, communication=True)
    stages = 4 * (TORCH_SCHEDULES[name] or 2)
    torch.manual_seed(0)
    reference, piped = twins(TinyNet(depth=2 * stages))
    fit_plain(reference, loader(n=96, batch_size=16))
    fit_pipeline(piped, 4, loader(n=96, batch_size=16), schedule_text=text)
    assert_same_weights(reference, piped)


def test_torch_s_own_1f1b_text_is_refused_before_launch() -> None:
    """torch 2.13's Schedule1F1B order starts its last rank at micro-batch 1 (1F1, 1B0, ..., 1F4): torch's
    runtime refuses to lower it, and so does the strategy, naming the line, before any process starts."""
    text = torch_text("Schedule1F1B", 2, 4)
    assert text.splitlines()[1].startswith("1F1,1B0,")
    with pytest.raises(ValueError, match=r"line 2 \(rank 1\), position \d+ \(B0@s1\): backward before its forward"):
        PipelineStrategy(schedule_text=text)


@pytest.mark.parametrize(
    ("name", "communication"),
    [("ScheduleDualPipeV", False), ("ScheduleInterleavedZeroBubble", True), ("ScheduleGPipe", False)],
)
def test_a_short_last_batch_runs_the_text_s_first_micro_batches_as_plain_training(
    name: str, communication: bool
) -> None:
    """A text of 6 micro-batches; each epoch's last batch has 4 samples, so it runs the text's micro-batches
    0 to 3 only (before: the epoch trained, then its last batch was refused); 8 steps cross into the
    next epoch."""
    text = torch_text(name, 2, 6, communication=communication)
    stages = 2 * (TORCH_SCHEDULES[name] or 2)
    torch.manual_seed(0)
    reference, piped = twins(TinyNet(depth=2 * stages))
    plain = fit_plain(reference, max_steps=8)
    assert plain.global_step == 8 and plain.current_epoch >= 1  # past the short batch that ends epoch 0
    fit_pipeline(piped, 2, schedule_text=text, max_steps=8)
    assert_same_weights(reference, piped)

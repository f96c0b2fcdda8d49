"""What a step returns and logs, once per batch: the recorder on the last stage and the summary's
way to every rank (a gloo world of one: the broadcasts' bookkeeping, without peers)."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_pipe.runtime.topology import Topology
from lightning_pipe.trainer.step_results import StepRecorder, SummaryBroadcaster, SummarySharing, step_loss


class _Logs(L.LightningModule):
    """A module whose ``log`` (outside a Trainer) records its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def log(self, name: str, value: object, **kwargs: object) -> None:  # type: ignore[override]
        self.calls.append((name, value, kwargs))


def test_logged_values_and_the_loss_are_means_weighted_by_microbatch_size() -> None:
    module, recorder = _Logs(), StepRecorder()
    for weight, value in ((0.75, 1.0), (0.25, 3.0)):  # a batch of 4: micro-batches of 3 and 1
        with recorder.capture(module, weight, keep=True):
            module.log("acc", torch.tensor(value), prog_bar=True)
        recorder.add_loss(torch.tensor(2 * value), weight)
    assert module.calls == []  # nothing reached the module's own log
    assert "log" not in vars(module)  # the routing is undone after each micro-batch
    summary = recorder.summary()
    assert summary["loss"] == pytest.approx(2 * (0.75 * 1.0 + 0.25 * 3.0))
    assert summary["logs"] == [("acc", pytest.approx(1.5), {"prog_bar": True})]


def test_batch_sizes_given_to_log_weigh_the_mean_and_stages_before_the_last_drop_their_calls() -> None:
    module, recorder = _Logs(), StepRecorder()
    for weight, value, size in ((0.5, 1.0, 1), (0.5, 4.0, 3)):
        with recorder.capture(module, weight, keep=True):
            module.log("x", value, batch_size=size)
        with recorder.capture(module, weight, keep=False):
            module.log("dropped", value)
    assert recorder.summary()["logs"] == [("x", pytest.approx((1.0 * 1 + 4.0 * 3) / 4), {"batch_size": 4})]


def test_a_step_returns_its_loss_as_a_tensor_or_under_loss() -> None:
    loss = torch.tensor(1.0)
    assert step_loss(loss) is loss and step_loss({"loss": loss, "x": 1}) is loss and step_loss(None) is None
    with pytest.raises(TypeError, match="dict with a 'loss' key"):
        step_loss([loss])


def test_summaries_reach_every_rank_once_and_a_lagged_one_a_step_later(world_of_one: Topology) -> None:
    sharing = SummarySharing(0, world_of_one.meta_group, is_src=True)
    first = {"loss": 0.5, "logs": [("acc", 0.25, {})]}
    assert sharing.share("train", first) is first  # the last stage keeps its own at once
    assert sharing._unfinished is None  # new names: the others wait for them now, so it completed
    second = {"loss": 0.75, "logs": [("acc", 0.5, {})]}
    assert sharing.share("train", second) is second and sharing._unfinished is not None  # values only: left open
    sharing.finish_pending()
    assert sharing._unfinished is None
    assert sharing.take_lagged() is None  # nothing posted a step ago
    sharing.post_lagged({"loss": None, "logs": [("acc", 1.0, {})]})
    assert sharing.take_lagged() == {"loss": None, "logs": [("acc", 1.0, {})]}


def test_a_summary_too_large_for_one_tensor_goes_whole(world_of_one: Topology) -> None:
    broadcaster = SummaryBroadcaster(0, world_of_one.meta_group, is_src=True)
    summary = {"loss": 1.0, "logs": [(f"m{i}", float(i), {}) for i in range(SummaryBroadcaster.SLOTS)]}
    handle = broadcaster.post(summary)
    assert broadcaster.needs_more(handle)
    assert broadcaster.complete(handle) == summary


@pytest.mark.parametrize(
    "reduce_fx, expected",
    [
        ("max", 7.0),
        ("min", -2.0),
        ("sum", 1.0 + 7.0 - 2.0),
        (torch.max, 7.0),
        ("avg", 0.5 * 1.0 + 0.25 * 7.0 + 0.25 * -2.0),
    ],
)
def test_logged_values_are_reduced_over_microbatches_by_their_reduce_fx(reduce_fx: object, expected: float) -> None:
    module, recorder = _Logs(), StepRecorder()
    for weight, value in ((0.5, 1.0), (0.25, 7.0), (0.25, -2.0)):
        with recorder.capture(module, weight, keep=True):
            module.log("x", torch.tensor(value), reduce_fx=reduce_fx)
    ((_name, value, kwargs),) = recorder.summary()["logs"]
    assert value == pytest.approx(expected)
    assert kwargs["reduce_fx"] == reduce_fx  # Lightning reduces the batches' values over the epoch the same way


def test_chimera_absorbs_another_recorders_extremes_by_their_reduce_fx() -> None:
    module, here, there = _Logs(), StepRecorder(), StepRecorder()
    for recorder, value in ((here, 2.0), (there, 5.0)):
        with recorder.capture(module, 0.5, keep=True):
            module.log("hi", value, reduce_fx="max")
            module.log("lo", value, reduce_fx="min")
            module.log("n", value, reduce_fx="sum")
    here.absorb(there.portable())
    assert [(name, value) for name, value, _ in here.summary()["logs"]] == [("hi", 5.0), ("lo", 2.0), ("n", 7.0)]


def test_a_microbatch_of_weight_zero_leaves_the_mean_alone() -> None:
    """A micro-batch holding no item its loss averages over (every label -100) has a NaN token mean."""
    module, recorder = _Logs(), StepRecorder()
    for weight, value in ((1.0, 3.0), (0.0, float("nan"))):
        with recorder.capture(module, weight, keep=True):
            module.log("loss", torch.tensor(value))
        recorder.add_loss(torch.tensor(value), weight)
    summary = recorder.summary()
    assert summary["loss"] == 3.0 and summary["logs"][0][1] == 3.0

"""What the launching process refuses before any other process starts (lightning_pipe.trainer.preflight)."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies.launchers import multiprocessing, subprocess_script
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_pipe import PipelineStrategy
from lightning_pipe.config import PipelineConfig
from lightning_pipe.runtime.topology import Layout
from lightning_pipe.trainer.preflight import check_before_launch
from tests.models import ReadsBlocksNet, TiedNet, TinyNet, loader


class ReluMiddle(TinyNet):
    """Linear, ReLU, ReLU, Linear: a split [1, 2, 1] leaves the middle stage without parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.ReLU(), nn.Linear(8, 3))


class BuiltLater(TinyNet):
    """Its layers exist only once configure_model() ran, after the launch."""

    def __init__(self) -> None:
        super().__init__()
        del self.layers

    def configure_model(self) -> None:
        if not hasattr(self, "layers"):
            self.layers = nn.Sequential(nn.Linear(6, 3))


@pytest.mark.parametrize(
    "model, config, layout, match",
    [
        (lambda: TinyNet(depth=3), PipelineConfig(), Layout(4, 1), r"cannot split 3 layers into 4 stages"),
        (ReluMiddle, PipelineConfig(balance=[1, 2, 1]), Layout(3, 1), r"leaves stage 1 with only layers that hold no"),
        (TinyNet, PipelineConfig(balance=[4, 3]), Layout(2, 1), r"sums to 7 but the module has 8 layers"),
        (TinyNet, PipelineConfig(schedule="chimera"), Layout(2, 2), r"chimera"),
        (TinyNet, PipelineConfig(module="body"), Layout(2, 1), r"TinyNet has no attribute 'body'"),
        (lambda: TinyNet(depth=3), PipelineConfig(balance="time"), Layout(4, 1), r"cannot split 3 layers into 4"),
        (TinyNet, PipelineConfig(schedule="pipedream", data_parallel="shard"), Layout(2, 2),
         r"data_parallel='shard'\) cannot run here: schedule='pipedream' keeps weight versions"),
        (TiedNet, PipelineConfig(schedule="zbv", data_parallel="shard"), Layout(2, 2),
         r"schedule='zbv' places the first and last stage on one process"),
        (TiedNet, PipelineConfig(schedule="pipemare"), Layout(2, 1), r"copies of a weight tied across stages"),
        (TinyNet, PipelineConfig(schedule="pipedream_2bw", chunks=1), Layout(3, 1), r"needs chunks >= stages - 1"),
    ],
    ids=["too-many-stages", "stage-without-parameters", "balance-sum", "chimera-replicas", "bad-module", "measured",
         "shard-async", "shard-v-tied", "pipemare-tied", "2bw-chunks"],
)  # fmt: skip
def test_what_the_module_and_arguments_decide_is_refused(
    model: Any, config: PipelineConfig, layout: Layout, match: str
) -> None:
    with pytest.raises(Exception, match=match):  # ValueError, TypeError or MisconfigurationException
        check_before_launch(model(), config, layout)


def test_a_valid_split_and_what_needs_the_launch_pass() -> None:
    check_before_launch(TinyNet(), PipelineConfig(), Layout(4, 1))
    check_before_launch(TinyNet(depth=8), PipelineConfig(balance="time"), Layout(4, 1))  # measured after the launch
    check_before_launch(BuiltLater(), PipelineConfig(), Layout(2, 1))  # layers from configure_model(), later
    check_before_launch(None, PipelineConfig(), Layout(2, 1))
    check_before_launch(ReadsBlocksNet("pool"), PipelineConfig(module="blocks", schedule="zero_bubble"), Layout(2, 1))
    check_before_launch(TiedNet(), PipelineConfig(schedule="pipedream_2bw"), Layout(2, 1))  # the same delay everywhere
    # the ends outside the blocks take the weight versions of the stage that uses them
    check_before_launch(ReadsBlocksNet("pool"), PipelineConfig(module="blocks", schedule="xpipe"), Layout(2, 1))
    check_before_launch(ReadsBlocksNet("pool"), PipelineConfig(module="blocks", data_parallel="shard"), Layout(2, 2))


def test_the_trainer_refuses_before_starting_any_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through ``trainer.fit``, with each start method: the launcher never starts a process."""

    def started(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess_script._SubprocessScriptLauncher, "_call_children_scripts", started)
    monkeypatch.setattr(multiprocessing._MultiProcessingLauncher, "launch", started)
    for start_method in ("popen", "spawn"):
        trainer = L.Trainer(
            strategy=PipelineStrategy(start_method=start_method),
            accelerator="cpu",
            devices=4,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        with pytest.raises(ValueError, match=r"cannot split 3 layers into 4 stages"):
            trainer.fit(TinyNet(depth=3), loader())
    assert torch.distributed.is_initialized() is False


def test_a_rank_order_for_another_world_is_refused_before_starting_any_process(monkeypatch: pytest.MonkeyPatch) -> None:
    def started(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess_script._SubprocessScriptLauncher, "_call_children_scripts", started)
    refused = r"rank_order=\[1, 0, 2\]\): names 3 ranks for 2 processes; give each global rank of 2 processes once"
    with pytest.raises(ValueError, match=refused):
        trainer = L.Trainer(
            strategy=PipelineStrategy(rank_order=[1, 0, 2]), accelerator="cpu", devices=2, logger=False,
            enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(TinyNet(), loader())
    assert torch.distributed.is_initialized() is False


def test_accumulation_under_an_asynchronous_schedule_is_refused_before_starting_any_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Trainer's ``accumulate_grad_batches`` reaches the launching process's check (it was refused
    at the first training step, after every process had started)."""

    def started(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess_script._SubprocessScriptLauncher, "_call_children_scripts", started)
    monkeypatch.setattr(multiprocessing._MultiProcessingLauncher, "launch", started)
    for start_method in ("popen", "spawn"):
        trainer = L.Trainer(
            strategy=PipelineStrategy(schedule="pipedream", start_method=start_method), accelerator="cpu",
            devices=2, accumulate_grad_batches=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        with pytest.raises(MisconfigurationException, match=r"accumulate_grad_batches must be 1, got 2"):
            trainer.fit(TinyNet(), loader())
    check_before_launch(TinyNet(), PipelineConfig(), Layout(2, 1), accumulate_grad_batches=2)  # synchronous: fine
    assert torch.distributed.is_initialized() is False


def test_the_preflight_is_the_splits_own_decision_run_dry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launching process runs split_module's :func:`decide_split` without measuring (the two
    cannot disagree): a given balance is decided as the split decides it, ties included; a measured
    one is left to the setup, where the same function takes the measured counts."""
    from lightning_pipe.assembly import split as assemble
    from lightning_pipe.trainer import preflight

    seen: list[assemble.SplitDecision] = []

    def recorded(*args: Any, **kwargs: Any) -> assemble.SplitDecision:
        seen.append(assemble.decide_split(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(preflight, "decide_split", recorded)
    check_before_launch(TiedNet(), PipelineConfig(), Layout(2, 1))
    (dry,) = seen
    assert (dry.positions, dry.num_split, dry.balance) == ([0, 1], 2, [3, 2])
    assert dry.tied == [{0: "0.weight", 1: "4.weight"}]  # the embedding is the head's weight

    check_before_launch(TiedNet(), PipelineConfig(balance="time"), Layout(2, 1))
    assert seen[-1].balance is None and seen[-1].tied is None  # measured in the setup

    asked: list[tuple[int, list[bool]]] = []
    net = TiedNet()
    measured = assemble.decide_split(
        net,
        net.layers,
        PipelineConfig(balance="time"),
        Layout(2, 1),
        lambda n, owners: asked.append((n, owners)) or [1, 4],
    )
    assert asked == [(2, [True, False, True, False, True])]  # the split's stages and which layers hold parameters
    assert (measured.positions, measured.balance) == ([0, 1], [1, 4])
    assert measured.tied == [{0: "0.weight", 1: "4.weight"}]  # named by the layer's index

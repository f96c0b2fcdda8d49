"""Numerical parity with plain single-process training: the main proof of correctness.

Each test trains the same initial model twice, once with ``Trainer(accelerator="cpu", devices=1)``
and once under the pipeline with several CPU processes (gloo), and compares every parameter
after the last optimizer step. The data has 64 samples in batches of 12, so the 6th step is a
short batch of 4 (micro-batches of uneven size, fewer than ``chunks`` when chunks=8).
"""

from __future__ import annotations

import json
import os
from typing import Any

import lightning as L
import pytest
import torch

from lightning_pipe import PipelineStrategy
from tests.models import MaskedNet, RecordMetrics, TinyNet, WrappedNet, fit_plain, masked_loader, variable_length_loader
from tests.pipeline import assert_same_weights, fit_pipeline, twins

DEFAULT_GRID = {
    ("gpipe", 2, 4, "never"),
    ("gpipe", 4, 3, "always"),
    ("gpipe", 2, 3, "except_last"),
    ("1f1b", 2, 3, "except_last"),
    ("1f1b", 4, 4, "always"),
    ("1f1b", 4, 3, "never"),
}
GRID = [
    pytest.param(*case, marks=() if case in DEFAULT_GRID else pytest.mark.slow, id="-".join(map(str, case)))
    for case in [
        (schedule, stages, chunks, recompute)
        for schedule in ("gpipe", "1f1b")
        for stages in (2, 4)
        for chunks in (4, 3)
        for recompute in ("never", "always", "except_last")
    ]
]


@pytest.mark.parametrize("schedule, stages, chunks, recompute", GRID)
def test_weights_equal_plain_training(schedule: str, stages: int, chunks: int, recompute: str) -> None:
    torch.manual_seed(0)
    reference, piped = twins(TinyNet())
    fit_plain(reference)
    fit_pipeline(piped, stages, schedule=schedule, chunks=chunks, recompute=recompute)
    assert_same_weights(reference, piped)


def test_more_chunks_than_the_short_batch_and_balance_by_parameters() -> None:
    torch.manual_seed(0)
    reference, piped = twins(TinyNet())
    fit_plain(reference)
    fit_pipeline(piped, 2, schedule="1f1b", chunks=8, balance="parameters")
    assert_same_weights(reference, piped)


class _RecordFusion(L.Callback):
    """Which Linear layers of this rank's stage carry the fused forward while training runs."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        from lightning_pipe.runtime.grads.fused_linear import _Forward

        linears = [m for m in pl_module.modules() if isinstance(m, torch.nn.Linear)]
        fused = [isinstance(m.__dict__.get("forward"), _Forward) for m in linears]
        with open(f"{self.folder}/fusion{trainer.global_rank}.json", "w") as f:
            json.dump({"linears": len(linears), "fused": sum(fused)}, f)


@pytest.mark.parametrize(
    "schedule, fusion, fused", [("1f1b", False, False), ("gpipe", True, True), ("pipedream_2bw", True, True)]
)
def test_gradient_accumulation_fusion_where_it_applies(tmp_path, schedule: str, fusion: bool, fused: bool) -> None:
    """Fused unless switched off (the grid above and the asynchronous tests run it: default on);
    the unfused path gives plain training's weights too."""
    torch.manual_seed(0)
    reference, piped = twins(TinyNet())
    fit_plain(reference)
    options = dict(
        schedule=schedule, chunks=4, gradient_accumulation_fusion=fusion, callbacks=[_RecordFusion(str(tmp_path))]
    )
    fit_pipeline(piped, 2, **options)
    for rank in range(2):
        record = json.loads((tmp_path / f"fusion{rank}.json").read_text())
        assert record["linears"] > 0 and record["fused"] == (record["linears"] if fused else 0)
    if schedule != "pipedream_2bw":
        assert_same_weights(reference, piped)


def test_explicit_balance() -> None:
    torch.manual_seed(0)
    reference, piped = twins(TinyNet())
    fit_plain(reference)
    fit_pipeline(piped, 2, schedule="gpipe", chunks=4, balance=[5, 3])
    assert_same_weights(reference, piped)


def test_gradient_clipping_uses_the_global_norm() -> None:
    torch.manual_seed(0)
    reference, piped = twins(TinyNet())
    unclipped = TinyNet()
    unclipped.load_state_dict(reference.state_dict())
    fit_plain(reference, gradient_clip_val=0.05)
    fit_plain(unclipped)
    fit_pipeline(piped, 2, schedule="1f1b", chunks=4, gradient_clip_val=0.05)
    assert_same_weights(reference, piped)
    with pytest.raises(AssertionError):  # the clipping was active
        assert_same_weights(unclipped, piped)


def test_gradient_clipping_by_value() -> None:
    torch.manual_seed(0)
    reference, piped = twins(TinyNet())
    fit_plain(reference, gradient_clip_val=0.01, gradient_clip_algorithm="value")
    fit_pipeline(piped, 2, schedule="gpipe", chunks=3, gradient_clip_val=0.01, gradient_clip_algorithm="value")
    assert_same_weights(reference, piped)


def test_accumulate_grad_batches() -> None:
    torch.manual_seed(0)
    reference, piped = twins(TinyNet())
    fit_plain(reference, accumulate_grad_batches=2)
    fit_pipeline(piped, 2, schedule="1f1b", chunks=3, accumulate_grad_batches=2)
    assert_same_weights(reference, piped)


def test_adam_and_four_stages_with_parameters_outside_the_sequential() -> None:
    torch.manual_seed(0)
    reference, piped = twins(WrappedNet())
    fit_plain(reference)
    fit_pipeline(piped, 4, schedule="1f1b", chunks=4)
    assert_same_weights(reference, piped)


def test_tuple_activations_with_a_mask() -> None:
    torch.manual_seed(0)
    reference, piped = twins(MaskedNet())
    fit_plain(reference, masked_loader())
    fit_pipeline(piped, 3, masked_loader(), schedule="gpipe", chunks=3)
    assert_same_weights(reference, piped)


def test_activation_shapes_that_change_between_batches() -> None:
    torch.manual_seed(0)
    reference, piped = twins(MaskedNet())
    fit_plain(reference, variable_length_loader(), max_steps=5)
    fit_pipeline(piped, 2, variable_length_loader(), schedule="1f1b", chunks=3, max_steps=5, recompute="except_last")
    assert_same_weights(reference, piped)


def test_recomputation_draws_the_same_dropout_masks() -> None:
    torch.manual_seed(0)
    always, never = twins(TinyNet(dropout=0.5))
    torch.manual_seed(1)
    fit_pipeline(always, 2, schedule="1f1b", chunks=4, recompute="always")
    torch.manual_seed(1)
    fit_pipeline(never, 2, schedule="1f1b", chunks=4, recompute="never")
    assert_same_weights(always, never, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("stages, schedule", [(2, "1f1b"), (3, "gpipe")])
def test_weights_tied_across_the_first_and_last_stage(stages: int, schedule: str) -> None:
    from tests.models import TiedNet, token_loader

    torch.manual_seed(0)
    reference, piped = twins(TiedNet())
    fit_plain(reference, token_loader(), gradient_clip_val=0.5)
    fit_pipeline(piped, stages, token_loader(), schedule=schedule, chunks=3, gradient_clip_val=0.5)
    assert reference.layers[0].weight is reference.layers[4].weight
    assert_same_weights(reference, piped)  # both names of the tied weight, from their stages


@pytest.mark.parametrize("schedule", ["1f1b", "pipedream_2bw"])
def test_metric_objects_are_logged_on_the_last_stage(tmp_path, schedule: str) -> None:
    from tests.models import MetricNet

    torch.manual_seed(0)
    fit_pipeline(
        MetricNet(),
        2,
        schedule=schedule,
        chunks=3,
        max_steps=-1,
        max_epochs=1,
        callbacks=[RecordMetrics(str(tmp_path))],
    )
    last = json.loads((tmp_path / "rank1.json").read_text())
    assert last["seen"] == 64.0  # every sample of the epoch, counted once


class _RecordTimeline(L.Callback):
    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.timeline = trainer.strategy.enable_timeline()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        steps = [[(s.name, s.stage, s.microbatch) for s in spans] for spans in self.timeline.steps]
        with open(f"{self.folder}/timeline{trainer.global_rank}.json", "w") as f:
            json.dump({"steps": steps, "totals": self.timeline.totals()}, f)


def test_loss_and_logs_are_batch_means_and_the_timeline_records_every_action(tmp_path) -> None:
    """One fit, two findings: the logged loss is the batch mean on every rank, and the timeline holds every
    action of every step."""
    torch.manual_seed(0)
    reference, piped = twins(TinyNet())
    plain = fit_plain(reference, max_steps=5)  # stop on a full batch, whose mean the log holds
    recorders = [RecordMetrics(str(tmp_path)), _RecordTimeline(str(tmp_path))]
    trainer = fit_pipeline(piped, 2, schedule="1f1b", chunks=3, max_steps=5, callbacks=recorders)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]
    expected = float(plain.callback_metrics["train_loss"])
    assert ranks[0]["train_loss"] == pytest.approx(expected, rel=1e-5)
    assert float(trainer.callback_metrics["train_loss"]) == pytest.approx(expected, rel=1e-5)
    for rank in range(2):
        record = json.loads((tmp_path / f"timeline{rank}.json").read_text())
        assert len(record["steps"]) == 5
        for spans in record["steps"]:
            compute = [(name, mb) for name, stage, mb in spans if name in ("F", "B")]
            assert sorted(compute) == [("B", i) for i in range(3)] + [("F", i) for i in range(3)]
            assert all(stage == rank for name, stage, _ in spans if name in ("F", "B"))
        totals = record["totals"]
        assert totals["F"] > 0 and totals["B"] > 0 and totals["step"] >= totals["F"] + totals["B"]


def test_timeline_before_setup_says_when_to_call_it() -> None:
    with pytest.raises(RuntimeError, match="on_fit_start"):
        PipelineStrategy().enable_timeline()


def test_gloo_host_staging_matches_plain_training(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """gloo on GPUs stages every point-to-point tensor through host memory; the same path, forced
    on CPU tensors, trains as plain training does."""
    from lightning_pipe.runtime.p2p import Transport

    arrived = Transport.arrived

    def staged(self: Transport, buffers: list) -> list:
        assert self.through_host
        (tmp_path / f"staged{os.getpid()}").touch()
        return arrived(self, buffers)

    from lightning_pipe.runtime.topology import Placement

    monkeypatch.setattr(Placement, "through_host", property(lambda self: True))  # the forked ranks inherit both
    monkeypatch.setattr(Transport, "arrived", staged)
    torch.manual_seed(0)
    reference, piped = twins(TinyNet())
    fit_plain(reference)
    fit_pipeline(piped, 2, schedule="1f1b", chunks=3)
    assert_same_weights(reference, piped)
    assert len(list(tmp_path.glob("staged*"))) == 2  # both ranks received through the host path


@pytest.mark.parametrize("schedule, chunks", [("interleaved_1f1b", 4), ("zbv", 4)])
def test_schedules_with_several_stages_per_process_are_regrouped_under_nccl(schedule: str, chunks: int) -> None:
    """Under NCCL the pipeline runs the regrouped placement (proven to finish where calls
    rendezvous) instead of refusing; under gloo the placement built for gloo, unchanged."""
    from lightning_pipe.runtime.topology import Layout, Placement
    from lightning_pipe.schedules import build, for_rendezvous, forward_only_like, traits, validate
    from lightning_pipe.schedules.runnable import runnable_schedule

    nccl = Placement(Layout(2, 1), 0, (0, 1, 1, 0) if schedule == "zbv" else (0, 1, 0, 1), torch.device("cpu"), "nccl")
    assert nccl.rendezvous and not Placement(Layout(2, 1), 0, nccl.positions, torch.device("cpu"), "gloo").rendezvous
    train = runnable_schedule(traits(schedule), 2, chunks, 2, nccl.rendezvous)
    evaluate = runnable_schedule(traits(schedule), 2, chunks, 2, nccl.rendezvous, forward=True)
    assert train == build(schedule, 2, chunks, 2, rendezvous=True) != build(schedule, 2, chunks, 2)
    assert evaluate == for_rendezvous(forward_only_like(build(schedule, 2, chunks, 2)))
    validate(train, rendezvous=True)
    validate(evaluate, rendezvous=True)
    assert runnable_schedule(traits(schedule), 2, chunks, 2, rendezvous=False) == build(schedule, 2, chunks, 2)


def test_too_few_chunks_for_interleaving_under_nccl_are_refused_with_the_fix() -> None:
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from lightning_pipe.schedules import traits
    from lightning_pipe.schedules.runnable import runnable_schedule
    from lightning_pipe.trainer.compatibility import as_misconfiguration

    with (
        pytest.raises(MisconfigurationException, match=r"under NCCL.*Use other chunks \(checked: >= 2"),
        as_misconfiguration(),  # how the strategy's steps and setup report the pipeline's refusal
    ):
        runnable_schedule(traits("interleaved_1f1b"), 2, 1, 2, rendezvous=True)


def test_a_stage_that_starts_with_an_in_place_layer_trains_as_plain_training() -> None:
    """A split may leave ``nn.ReLU(inplace=True)`` first on a stage, whose input is the received
    activation: a leaf that requires a gradient, which autograd does not let change in place."""
    from torch import nn

    from tests.models import CLASSES, HIDDEN, IN, fit_plain
    from tests.pipeline import assert_same_weights, fit_pipeline, twins

    torch.manual_seed(0)
    model = TinyNet()
    model.layers = nn.Sequential(
        nn.Linear(IN, HIDDEN),
        nn.ReLU(inplace=True),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(inplace=True),
        nn.Linear(HIDDEN, CLASSES),
    )
    reference, piped = twins(model)
    fit_plain(reference)
    fit_pipeline(piped, 2, balance=[1, 4], chunks=3, recompute="except_last")
    assert_same_weights(reference, piped)


class _ReducedLogs(TinyNet):
    """Logs per-sample loss statistics reduced by max, min and sum, in training and validation."""

    def _log_reduced(self, batch: Any, prefix: str) -> torch.Tensor:
        x, y = batch
        losses = torch.nn.functional.cross_entropy(self(x), y, reduction="none")
        for reduce_fx in ("max", "min", "sum"):
            value = getattr(losses.detach(), reduce_fx)()
            self.log(f"{prefix}_{reduce_fx}", value, reduce_fx=reduce_fx, on_step=False, on_epoch=True)
        return losses.mean()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._log_reduced(batch, "train")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._log_reduced(batch, "val")


@pytest.mark.parametrize("devices, stages", [(2, None), (4, 2)], ids=["2-stages", "2x2-replicas"])
def test_logged_max_min_and_sum_are_reduced_as_plain_lightning_reduces_them(
    tmp_path, devices: int, stages: int
) -> None:
    """Over micro-batches and replicas, in training and validation (6 validation samples over 2
    replicas in batches of 5: one replica's last batch is short)."""
    from tests.models import loader

    torch.manual_seed(0)
    reference, piped = twins(_ReducedLogs())
    replicas, options = devices // (stages or devices), dict(max_steps=-1, max_epochs=1)
    plain = fit_plain(reference, loader(n=40, batch_size=10 * replicas), loader(n=26, batch_size=5, seed=1), **options)
    fit_pipeline(piped, devices, loader(n=40, batch_size=10), loader(n=26, batch_size=5, seed=1), schedule="1f1b",
                 chunks=3, stages=stages, callbacks=[RecordMetrics(str(tmp_path))], **options)  # fmt: skip
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(devices)]
    assert all(rank == ranks[0] for rank in ranks)
    expected = {k: float(v) for k, v in plain.callback_metrics.items()}
    assert sorted(expected) == sorted(f"{p}_{r}" for p in ("train", "val") for r in ("max", "min", "sum"))
    assert ranks[0] == pytest.approx(expected, rel=1e-5)

"""The planner's activation policy per stage (keep, recompute, offload k) under a memory budget, pure."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_pipe.partition.solvers.costs import LayerCost, Profile, saved_bytes
from lightning_pipe.plan.activations import (
    KEEP,
    OffloadReplay,
    StagePolicy,
    StagePrediction,
    choose_policies,
    offload_replay,
    predict_stage,
)
from lightning_pipe.plan.planner import Link, format_plans, plan
from lightning_pipe.plan.report import overrides, plan_text
from lightning_pipe.schedules import build, peak_in_flight
from tests.models import SkewedNet, loader
from tests.pipeline import fit_pipeline

FREE = Link(latency=0.0, bandwidth=float("inf"))
MIB = 2**20


def _layer(size: int = 1) -> LayerCost:
    """A Linear + ReLU block: saves its input and its output (each ``size`` MiB)."""
    return LayerCost(
        forward=1e-3, backward=2e-3, parameter_bytes=4 * MIB, gradient_bytes=4 * MIB, optimizer_bytes=0,
        activation_bytes=2 * size * MIB, input_bytes=size * MIB, output_bytes=size * MIB,
        saved_input_bytes=size * MIB, saved_output_bytes=size * MIB,
    )  # fmt: skip


def test_a_tensor_saved_by_two_layers_of_a_stage_is_counted_once() -> None:
    layers = [_layer(), _layer(), _layer()]
    assert saved_bytes(layers) == 4 * MIB  # the stage input and three outputs, not 6
    assert Profile(tuple(layers), 1, "cpu", 1).stage_bytes([3], [2]) == [24 * MIB + 2 * 4 * MIB]


@pytest.mark.parametrize(
    ("schedule", "virtual"), [("1f1b", 1), ("gpipe", 1), ("zero_bubble", 1), ("interleaved_1f1b", 2), ("zbv", 2)]
)
def test_the_offload_replay_keeps_k_plus_the_one_brought_back(schedule: str, virtual: int) -> None:
    """Without offload the replay holds what the schedule holds in flight; keeping ``k`` it holds at most
    ``k + 1`` (the one brought back ahead of its backward; with a split backward, those waiting for W too)."""
    built = build(schedule, 4, 8, virtual)
    peaks = peak_in_flight(built)
    for stage, held in peaks.items():
        assert offload_replay(built, stage, None) == OffloadReplay(held, 0, 0)
        everything = offload_replay(built, stage, 0)
        assert everything.offloaded == 8 and everything.peak + everything.host_peak >= held
        if schedule in ("1f1b", "interleaved_1f1b", "gpipe"):  # the next backward's micro-batch brought back
            assert everything.peak == 1  # (GPipe's backwards run newest first: the next one is the nearest)
        for k in range(held):
            assert offload_replay(built, stage, k).peak <= held
    one_f_one_b = build("1f1b", 4, 8)
    assert [offload_replay(one_f_one_b, s, 1).peak for s in range(4)] == [2, 2, 2, 1]
    assert offload_replay(one_f_one_b, 0, 1).offloaded == 6  # F0 and F4 found no other kept on the device


def test_each_policy_predicts_its_bytes_and_seconds() -> None:
    built = build("1f1b", 4, 8)
    layers = [_layer(), _layer()]  # 3 MiB saved per micro-batch, stage 0 holds 4
    keep = predict_stage(built, 0, layers, 4, KEEP, 1e9)
    recompute = predict_stage(built, 0, layers, 4, StagePolicy("always"), 1e9)
    offload = predict_stage(built, 0, layers, 4, StagePolicy(offload=0), 3 * MIB / 1e-3)
    assert (keep.device_bytes, keep.seconds) == (12 * MIB, 0.0)
    assert recompute.device_bytes == 4 * MIB + 3 * MIB and recompute.seconds == pytest.approx(2e-3)
    assert (offload.device_bytes, offload.host_bytes) == (3 * MIB, 12 * MIB)  # all four wait in host memory
    assert offload.copy_seconds == pytest.approx(1e-3)  # every micro-batch copied out and back, 1 ms each way


def test_the_choice_keeps_what_fits_and_takes_the_cheapest_saving() -> None:
    def option(policy: StagePolicy, nbytes: int, seconds: float) -> StagePrediction:
        return StagePrediction(policy, nbytes, recompute_seconds=seconds)

    stage = [option(KEEP, 40, 0.0), option(StagePolicy(offload=1), 20, 1.0), option(StagePolicy("always"), 15, 5.0)]
    # two stages on one rank (static 10): 90 over a budget of 70; offloading one saves 20 for 1 s
    chosen = choose_policies([stage, stage], [0, 0], [10], [70])
    assert sorted(p.policy.label() for p in chosen) == ["keep", "offload k=1"]
    assert [p.policy for p in choose_policies([stage], [0], [10], [100])] == [KEEP]
    assert [p.policy for p in choose_policies([stage], [0], [10], None)] == [KEEP]
    # an option holding more bytes at more seconds than another is never taken
    worse = [*stage, option(StagePolicy(offload=2), 30, 2.0)]
    assert [p.policy.label() for p in choose_policies([worse], [0], [0], [25])] == ["offload k=1"]
    assert [p.policy.label() for p in choose_policies([worse], [0], [0], [1])] == ["recompute"]  # over, the least


def _mlp_profile() -> Profile:
    """Eight Linear + ReLU blocks: the first stage of 1F1B holds four micro-batches, the last one."""
    return Profile(tuple(_layer() for _ in range(8)), 32, "cpu", 3)


def test_the_planner_chooses_each_stages_policy_under_the_budget() -> None:
    profile = _mlp_profile()
    free = plan({8: profile}, 4, FREE, schedules=("1f1b",), balances=("uniform",), checkpoints=("never", "always"))
    assert free[0].recompute == "never" and not free[0].offload  # no budget: every activation kept
    kept = free[0]
    assert kept.activation_bytes == (12 * MIB, 9 * MIB, 6 * MIB, 3 * MIB)
    static = 16 * MIB  # two blocks' parameters and gradients
    budget = static + 4 * MIB  # the last stage's one micro-batch (3 MiB) and room for a quarter more
    ranked = plan(
        {8: profile}, 4, FREE, memory_budget=budget, schedules=("1f1b",), balances=("uniform",),
        checkpoints=("never", "always"), copy_bandwidth=3 * MIB / 1e-4,
    )  # fmt: skip
    best = ranked[0]
    assert best.fits and best.offload == (0, 0, 0, None) and best.recompute == "never"
    assert best.activation_bytes == (3 * MIB,) * 4 and best.host_bytes == (12 * MIB, 9 * MIB, 6 * MIB, 0)
    assert max(best.stage_bytes) <= budget
    uniform_always = next(c for c in ranked if c.recompute == "always")
    assert not uniform_always.fits  # 4 inputs + one micro-batch's activations: 7 MiB on stage 0
    assert best.step_seconds > kept.step_seconds  # the copies are priced
    assert best.strategy_arguments()["offload"] == [0, 0, 0, None]
    assert "strategy.offload=[0,0,0,null]" in overrides(best, 4, 1)
    assert "offload k=0, offload k=0, offload k=0, keep" in format_plans(ranked, 1)
    assert plan_text(ranked, 4, 1).splitlines()[-1] == (
        "activations per stage (predicted peak MiB of saved tensors): stage 0 offload k=0 3.00, 12.00 in host "
        "memory; stage 1 offload k=0 3.00, 9.00 in host memory; stage 2 offload k=0 3.00, 6.00 in host memory; "
        "stage 3 keep 3.00"
    )
    # slow copies: recomputing is cheaper where it fits (a budget with room for it)
    slow = plan(
        {8: profile}, 4, FREE, memory_budget=static + 7 * MIB, schedules=("1f1b",), balances=("uniform",),
        checkpoints=("never",), copy_bandwidth=1.0 * MIB,
    )[0]  # fmt: skip
    assert slow.recompute[0] == "always" and slow.fits
    # data_parallel="shard" cannot offload: the budget is met by recomputing (stage 2 holds 6 MiB: it keeps)
    sharded = plan(
        {8: profile}, 4, FREE, memory_budget=static + 7 * MIB, schedules=("1f1b",), balances=("uniform",),
        checkpoints=("never",), offload=False,
    )[0]  # fmt: skip
    assert not sharded.offload and sharded.recompute == ("always", "always", "never", "never") and sharded.fits


class _RecordPolicies(L.Callback):
    """Writes each rank's planned candidates and its runners' recompute mode and offload to ``rank<k>.pt``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        runners = trainer.strategy.pipeline.runners  # type: ignore[attr-defined]
        policies = {s: (r.recompute, None if r.offload is None else r.offload.keep) for s, r in runners.items()}
        record = {"plan": trainer.strategy.plan_candidates, "policies": policies}  # type: ignore[attr-defined]
        torch.save(record, os.path.join(self.folder, f"rank{trainer.global_rank}.pt"))


@pytest.mark.slow
def test_plan_auto_runs_the_policy_per_stage_it_chose_under_the_memory_budget(tmp_path: Path) -> None:
    """A budget nothing fits (1 byte): the planner ranks by the largest process, and the least of each
    split is its policy per stage; every rank runs the first choice's."""
    fit_pipeline(SkewedNet(), 2, data=loader(32, 8), max_steps=2, plan="auto", memory_budget=1,
                 callbacks=[_RecordPolicies(str(tmp_path))])  # fmt: skip
    records = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    best = records[0]["plan"][0]
    assert not best.fits and any(p != KEEP for p in best.policies), best
    held = {**records[0]["policies"], **records[1]["policies"]}
    assert [held[s] for s in range(len(best.policies))] == [(p.recompute, p.offload) for p in best.policies]


def test_the_memory_budget_is_checked_before_training() -> None:
    from lightning_pipe import PipelineStrategy

    assert PipelineStrategy(plan="auto", memory_budget=[2**30, 2**29]).config.memory_budget == [2**30, 2**29]
    for bad in (0, -5, "8GB", [1, 0], []):
        with pytest.raises(ValueError, match="integer >= 1"):
            PipelineStrategy(plan="auto", memory_budget=bad)
    with pytest.raises(ValueError, match="Give plan='auto' with it"):
        PipelineStrategy(memory_budget=2**30)
    from lightning_pipe.cli import build_strategy
    from tests.test_cli import _compose

    composed = _compose(["strategy.plan=auto", "strategy.memory_budget=[1000,2000]"])
    assert build_strategy(composed.strategy, 2)[0].config.memory_budget == [1000, 2000]  # a list, not the YAML's

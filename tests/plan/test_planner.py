"""The planner: predictions from a profile, the ranking, the memory budget, and plan="auto"."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_pipe import PipelineStrategy
from lightning_pipe.partition.costs import LayerCost, Profile
from lightning_pipe.plan.planner import Link, chunk_candidates, format_plans, plan, stage_seconds
from lightning_pipe.schedules import closed_form_bubble
from tests.models import RecordSplit, SkewedNet, loader
from tests.pipeline import fit_pipeline


def _profile(chunks: int, batch: int = 16, skew: float = 1.0, overhead: float = 0.0) -> Profile:
    """Eight layers; forward time proportional to the micro-batch size plus a fixed overhead."""
    size = batch // chunks
    layers = tuple(
        LayerCost(
            forward=overhead + size * (skew if i < 4 else 1.0),
            backward=2 * (overhead + size * (skew if i < 4 else 1.0)),
            parameter_bytes=100, gradient_bytes=100, optimizer_bytes=100,
            activation_bytes=10 * size, input_bytes=size, output_bytes=size, update=0.5,
        )  # fmt: skip
        for i in range(8)
    )
    return Profile(layers, size, "cpu", 3)


FREE = Link(latency=0.0, bandwidth=float("inf"))


def test_prediction_matches_the_closed_form_on_equal_stages() -> None:
    profiles = {m: _profile(m) for m in (1, 2, 4, 8)}
    ranked = plan(profiles, 2, FREE, schedules=("1f1b",), balances=("uniform",), checkpoints=("never",))
    assert [c.chunks for c in ranked] == [8, 4, 2, 1]  # no per-micro-batch overhead: more chunks, less bubble
    for c in ranked:
        assert c.bubble == pytest.approx(closed_form_bubble(2, c.chunks))
        per_microbatch = 3 * 4 * (16 // c.chunks)  # forward + backward of a 4-layer stage
        assert c.step_seconds == pytest.approx((c.chunks + 1) * per_microbatch + 4 * 0.5)


def test_overheads_and_skew_change_the_choice() -> None:
    best = plan({m: _profile(m, overhead=40.0) for m in (1, 2, 4, 8)}, 2, FREE)[0]
    assert best.chunks < 8  # a fixed cost per micro-batch makes many small ones lose
    skewed = plan({m: _profile(m, skew=4.0) for m in (1, 2, 4, 8)}, 2, FREE, checkpoints=("never",))
    assert skewed[0].balance_mode == "time" and skewed[0].balance[0] < 4
    slow_link = plan({4: _profile(4)}, 2, Link(latency=1.0, bandwidth=1.0), schedules=("1f1b",), balances=("uniform",), checkpoints=("never",))
    assert slow_link[0].step_seconds > plan({4: _profile(4)}, 2, FREE, schedules=("1f1b",), balances=("uniform",), checkpoints=("never",))[0].step_seconds
    assert stage_seconds(_profile(4), [4, 4], "never", 4, Link(1.0, 2.0))[0][0] == pytest.approx(4 * 4 + 1.0 + 4 / 2.0)


def test_the_memory_budget_ranks_layouts_that_fit_first() -> None:
    profiles = {m: _profile(m) for m in (1, 2, 4, 8)}
    unlimited = plan(profiles, 2, FREE)
    tight = min(max(c.stage_bytes) for c in unlimited)  # only the leanest layouts fit
    assert max(unlimited[0].stage_bytes) > tight
    ranked = plan(profiles, 2, FREE, memory_budget=tight)
    assert ranked[0].fits and max(ranked[0].stage_bytes) <= tight
    assert all(not c.fits for c in ranked if max(c.stage_bytes) > tight)
    assert [c.fits for c in ranked] == sorted((c.fits for c in ranked), reverse=True)
    table = format_plans(ranked, top=3)
    assert table.count("\n") == 3 and "peak MiB per stage" in table


def test_chunk_candidates() -> None:
    assert chunk_candidates(12) == [1, 2, 4, 8]
    assert chunk_candidates(256) == [1, 2, 4, 8, 16, 32]


def test_bad_plan_value_is_refused() -> None:
    with pytest.raises(ValueError, match=r"plan='fast'.*None .* and 'auto'"):
        PipelineStrategy(plan="fast")


def test_auto_plan_runs_the_same_first_choice_on_every_rank(tmp_path: Path) -> None:
    fit_pipeline(SkewedNet(heavy=4.0), 2, data=loader(32, 8), max_steps=2, plan="auto", callbacks=[RecordSplit(str(tmp_path))])
    records = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert records[0]["balance"] == records[1]["balance"]
    assert records[0]["profile"] == records[1]["profile"] is not None
    ranked = records[0]["plan"]
    assert ranked == records[1]["plan"] and len(ranked) > 10  # one ranking, on every rank
    best = ranked[0]
    for record in records:  # every rank runs the first choice
        assert (record["schedule"], record["chunks"], record["balance"]) == (best.schedule, best.chunks, list(best.balance))

"""The planner: predictions from a profile, the ranking, the memory budget, and plan="auto"."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_pipe import PipelineStrategy
from lightning_pipe.partition.solvers.costs import LayerCost, Profile
from lightning_pipe.plan.planner import (
    PLAN_SCHEDULES,
    Link,
    chunk_candidates,
    format_plans,
    layouts,
    microbatch_size,
    needed_sizes,
    plan,
    plan_layouts,
    stage_ranks,
    stage_seconds,
)  # fmt: skip
from lightning_pipe.plan.report import overrides, plan_text
from lightning_pipe.schedules import build, closed_form_bubble, simulate
from tests.models import DeferredNet, RecordSplit, SkewedNet, loader
from tests.pipeline import fit_pipeline


def _profile(chunks: int, batch: int = 16, skew: float = 1.0, overhead: float = 0.0) -> Profile:
    """Eight layers; forward time proportional to the micro-batch size plus a fixed overhead."""
    size = batch // chunks
    layers = tuple(
        LayerCost(
            forward=overhead + size * (skew if i < 4 else 1.0),
            backward=2 * (overhead + size * (skew if i < 4 else 1.0)),
            parameter_bytes=100,
            gradient_bytes=100,
            optimizer_bytes=100,
            activation_bytes=10 * size,
            input_bytes=size,
            output_bytes=size,
            update=0.5,
        )
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
    one_pipeline = ("1f1b", "gpipe", "zero_bubble", "interleaved_1f1b", "interleaved_zero_bubble", "zbv")
    skewed = plan(
        {m: _profile(m, skew=4.0) for m in (1, 2, 4, 8)}, 2, FREE, schedules=one_pipeline, checkpoints=("never",)
    )
    assert skewed[0].balance_mode == "time" and skewed[0].balance[0] < 4
    # Chimera on 2 processes is not planned (each process would hold the whole model, and measured slower
    # than 1F1B there, though predicted faster): the default grid ranks the one-pipeline schedules alone
    both = plan({m: _profile(m, skew=4.0) for m in (1, 2, 4, 8)}, 2, FREE, checkpoints=("never",))
    assert "chimera" in PLAN_SCHEDULES and not [c for c in both if c.schedule == "chimera"]
    assert both[0].step_seconds == skewed[0].step_seconds
    slow_link = plan(
        {4: _profile(4)},
        2,
        Link(latency=1.0, bandwidth=1.0),
        schedules=("1f1b",),
        balances=("uniform",),
        checkpoints=("never",),
    )
    assert (
        slow_link[0].step_seconds
        > plan({4: _profile(4)}, 2, FREE, schedules=("1f1b",), balances=("uniform",), checkpoints=("never",))[
            0
        ].step_seconds
    )
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
    assert table.count("\n") == 3 and "peak MiB per rank" in table and "checkpoint" not in table


def test_the_table_stays_aligned_for_long_names() -> None:
    """Every row's entries start (text) or end (numbers) where the header's do, whatever the
    schedule's name (``interleaved_zero_bubble v3``) or the balance's length."""
    ranked = plan(
        {4: _split_profile(4, layers=12)},
        2,
        FREE,
        schedules=("1f1b", "interleaved_zero_bubble"),
        virtual=(2, 3),
        **GLOO,
    )
    assert {c.virtual_stages for c in ranked} == {1, 2, 3}
    table = format_plans(ranked, top=len(ranked)).splitlines()
    header, rows = table[0], table[1:]
    for row, c in zip(rows, ranked):
        label = f"{c.schedule} v{c.virtual_stages}" if c.virtual_stages > 1 else c.schedule
        for text, entry in (
            ("schedule", label),
            ("balance", f"{c.balance_mode} {list(c.balance)}"),
            ("recompute", c.recompute),  # named as the strategy.recompute= its command writes
        ):
            start = header.index(text)
            assert row[start : start + len(entry)] == entry and row[start - 1] == " ", (text, row)
        for text, entry in (
            ("chunks", str(c.chunks)),
            ("step ms", f"{1e3 * c.step_seconds:.2f}"),
            ("bubble", f"{100 * c.bubble:.1f}%"),
        ):
            end = header.index(text) + len(text)
            assert row[end - len(entry) : end] == entry and row[end : end + 1] in ("", " "), (text, row)


def test_chunk_candidates() -> None:
    assert chunk_candidates(12) == [1, 2, 4, 8]
    assert chunk_candidates(256) == [1, 2, 4, 8, 16, 32]


def test_bad_plan_value_is_refused() -> None:
    with pytest.raises(ValueError, match=r"plan='fast'.*None .* and 'auto'"):
        PipelineStrategy(plan="fast")


def test_auto_plan_runs_the_same_first_choice_on_every_rank(tmp_path: Path) -> None:
    """... and rank 0 shows the ranking through Lightning's logger, which prints its INFO lines without
    any logging set-up (a handler on it here, inherited by the forked processes, reads them)."""
    lightning_log = logging.getLogger("lightning.pytorch")
    handler = logging.FileHandler(tmp_path / "lightning.log")
    lightning_log.addHandler(handler)
    try:
        fit_pipeline(
            SkewedNet(heavy=4.0),
            2,
            data=loader(32, 8),
            max_steps=2,
            plan="auto",
            callbacks=[RecordSplit(str(tmp_path))],
        )
    finally:
        lightning_log.removeHandler(handler)
        handler.close()
    shown = (tmp_path / "lightning.log").read_text()
    assert shown.count("lightning-pipe plan: ") >= 1 and shown.count(" layouts:\n") == 1, shown
    records = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert records[0]["balance"] == records[1]["balance"]
    assert records[0]["profile"] == records[1]["profile"] is not None
    ranked = records[0]["plan"]
    assert ranked == records[1]["plan"] and len(ranked) > 10  # one ranking, on every rank
    best = ranked[0]
    for record in records:  # every rank runs the first choice
        assert (record["schedule"], record["chunks"], record["balance"]) == (
            best.schedule,
            best.chunks,
            list(best.balance),
        )


def _split_profile(
    size: int, layers: int = 8, gradient_bytes: int = 100, param_bytes: int = 100, overhead: float = 0.0
) -> Profile:
    """Layers whose F, B and W each take ``overhead + size`` seconds (B + W the whole backward)."""
    t = overhead + size
    costs = tuple(
        LayerCost(
            forward=t,
            backward=2 * t,
            parameter_bytes=param_bytes,
            gradient_bytes=gradient_bytes,
            optimizer_bytes=0,
            activation_bytes=10 * size,
            input_bytes=size,
            output_bytes=size,
            input_backward=t,
            weight_backward=t,
        )
        for _ in range(layers)
    )
    return Profile(costs, size, "cpu", 3)


ONE: dict[str, Any] = {"balances": ("uniform",), "checkpoints": ("never",)}
GLOO: dict[str, Any] = {**ONE, "rendezvous": False}  # interleaving and ZB-V hang under NCCL's model at most counts


def test_zero_bubble_predicts_less_bubble_than_1f1b_with_equal_f_b_w() -> None:
    ranked = plan({4: _split_profile(4)}, 4, FREE, schedules=("1f1b", "zero_bubble"), **ONE)
    by_schedule = {c.schedule: c for c in ranked}
    assert by_schedule["zero_bubble"].bubble < by_schedule["1f1b"].bubble
    assert by_schedule["zero_bubble"].step_seconds < by_schedule["1f1b"].step_seconds
    assert ranked[0].schedule == "zero_bubble"
    assert by_schedule["zero_bubble"].stage_costs[1] == pytest.approx((8.0, 8.0, 8.0))  # two layers: F, B, W apart


def test_interleaved_zero_bubble_predicts_less_bubble_than_interleaving_at_each_v() -> None:
    schedules = ("interleaved_1f1b", "interleaved_zero_bubble")
    ranked = plan({4: _split_profile(4, layers=24)}, 2, FREE, schedules=schedules, **GLOO)
    by = {(c.schedule, c.virtual_stages): c for c in ranked}
    assert {v for s, v in by if s == "interleaved_zero_bubble"} == {2, 3, 4}
    for v in (2, 3, 4):
        assert by["interleaved_zero_bubble", v].bubble < by["interleaved_1f1b", v].bubble
        assert by["interleaved_zero_bubble", v].step_seconds < by["interleaved_1f1b", v].step_seconds
    assert by["interleaved_zero_bubble", 3].strategy_arguments()["virtual_stages"] == 3
    arguments = by["interleaved_zero_bubble", 3].strategy_arguments()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # recompute=, not its former name checkpoint=
        assert PipelineStrategy(**arguments).config.recompute == arguments["recompute"]
    # under NCCL's rendezvous only what the regrouped schedule runs is proposed: multiples of p here
    nccl = plan(
        {m: _split_profile(16 // m, layers=8) for m in (1, 2, 4)},
        2,
        FREE,
        schedules=("interleaved_zero_bubble",),
        **ONE,
    )
    assert {c.chunks for c in nccl} == {2, 4}


def test_interleaving_bubble_falls_with_more_stages_per_rank() -> None:
    ranked = plan({4: _split_profile(4, layers=24)}, 2, FREE, schedules=("interleaved_1f1b",), **GLOO)
    by_v = {c.virtual_stages: c for c in ranked}
    assert sorted(by_v) == [2, 3, 4]
    assert by_v[2].bubble > by_v[3].bubble > by_v[4].bubble  # equal stages: (p - 1) / (v m) of the ideal time
    assert [len(c.balance) for c in ranked if c.virtual_stages == 2] == [4]
    few = plan({4: _split_profile(4, layers=6)}, 2, FREE, schedules=("interleaved_1f1b",), **GLOO)
    assert {c.virtual_stages for c in few} == {2, 3}  # 2 x 4 stages would need more than 6 layers
    assert len(by_v[3].balance) == 6 and len(by_v[3].stage_bytes) == 2  # memory per rank, its stages together
    assert by_v[3].strategy_arguments()["virtual_stages"] == 3
    # under NCCL's rendezvous the planner plays the regrouped schedules the runtime builds there
    nccl = plan({m: _split_profile(16 // m) for m in (1, 2, 4)}, 2, FREE, schedules=("interleaved_1f1b", "zbv"), **ONE)
    assert {(c.schedule, c.chunks) for c in nccl} == {
        ("interleaved_1f1b", 2),
        ("interleaved_1f1b", 4),
        ("zbv", 2),
        ("zbv", 4),
    }
    zbv4 = next(c for c in nccl if (c.schedule, c.chunks) == ("zbv", 4))
    regrouped = build("zbv", 2, 4, 2, rendezvous=True)
    assert zbv4.bubble == pytest.approx(simulate(regrouped, stage_costs=zbv4.stage_costs).bubble_fraction)


def test_zbv_places_the_last_stage_on_rank_0() -> None:
    (zbv,) = plan({4: _split_profile(4)}, 2, FREE, schedules=("zbv",), **GLOO)
    assert zbv.virtual_stages == 2 and len(zbv.balance) == 4
    assert stage_ranks("zbv", 2, 2) == [0, 1, 1, 0] and stage_ranks("interleaved_1f1b", 2, 2) == [0, 1, 0, 1]
    # stages 1 and 2 share rank 1: stage 1's output is handed over in memory, no transfer costed;
    # a transfer costs its sender latency + bytes / bandwidth and its receiver the latency
    slow = plan({4: _split_profile(4)}, 2, Link(latency=100.0, bandwidth=float("inf")), schedules=("zbv",), **GLOO)[0]
    assert slow.stage_costs[0][0] == zbv.stage_costs[0][0] + 100.0  # sends to stage 1
    assert slow.stage_costs[1][0] == zbv.stage_costs[1][0] + 100.0  # receives from stage 0 only
    assert slow.stage_costs[3][0] == zbv.stage_costs[3][0] + 100.0  # receives from stage 2 only
    assert slow.stage_costs[3][1] == zbv.stage_costs[3][1] + 100.0  # its B sends the gradient to stage 2


def _layout_profiles(batch: int, world: int, **kwargs: Any) -> dict[int, Profile]:
    return {size: _split_profile(size, **kwargs) for size in needed_sizes(world, batch)}


def test_replicas_win_on_a_free_link_and_lose_to_a_slow_all_reduce() -> None:
    assert layouts(4, 16) == [(1, 4), (2, 2), (4, 1)] and layouts(4, 6) == [(2, 2), (4, 1)]
    assert microbatch_size(16, 2, 4) == 2 and 8 in needed_sizes(4, 16) and 16 in needed_sizes(4, 16)
    profiles = _layout_profiles(16, 4, gradient_bytes=10**6)
    free = plan_layouts(profiles, 4, 16, FREE, **ONE)
    assert (free[0].depth, free[0].replicas) == (1, 4)  # no pipeline bubble, a quarter of the batch each
    assert free[0].replica_batch == 4 and free[0].strategy_arguments()["stages"] == 1
    assert {(c.depth, c.replicas) for c in free} == {(1, 4), (2, 2), (4, 1)}
    slow = plan_layouts(profiles, 4, 16, Link(latency=0.0, bandwidth=1.0), **ONE)  # 1 byte/s: the all-reduce dominates
    assert slow[0].replicas == 1 and slow[0].all_reduce_seconds == 0.0
    two = next(c for c in slow if c.replicas == 2)
    assert two.all_reduce_seconds == pytest.approx(
        2 * (2 - 1) / 2 * 4 * 10**6
    )  # a ring over 2 replicas of a rank's 4 layers' gradients
    assert two.step_seconds > two.all_reduce_seconds


def test_the_memory_budget_excludes_whole_model_replicas() -> None:
    profiles = _layout_profiles(16, 4, param_bytes=10**6, gradient_bytes=10**6)
    free = plan_layouts(profiles, 4, 16, FREE, **ONE)
    whole = min(max(c.stage_bytes) for c in free if c.depth == 1)  # the whole model on every rank
    ranked = plan_layouts(profiles, 4, 16, FREE, memory_budget=whole - 1, **ONE)
    assert ranked[0].fits and ranked[0].depth > 1
    assert all(not c.fits for c in ranked if c.depth == 1)


class _AllLayouts(RecordSplit):
    """What ``lightning-pipe plan`` sets: rank every stages x replicas too (before the strategy's setup)."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        trainer.strategy.plan_all_layouts = True


def test_auto_plan_ranking_all_layouts_still_runs_the_configured_one(tmp_path: Path) -> None:
    fit_pipeline(
        SkewedNet(heavy=2.0), 2, data=loader(32, 8), max_steps=1, plan="auto", callbacks=[_AllLayouts(str(tmp_path))]
    )
    record = torch.load(tmp_path / "rank0.pt", weights_only=False)
    ranked = record["plan"]
    assert {(c.depth, c.replicas) for c in ranked} == {(2, 1), (1, 2)}
    assert {c.replica_batch for c in ranked if c.replicas == 2} == {4} and all(
        c.all_reduce_seconds > 0 for c in ranked if c.replicas == 2
    )
    best = next(c for c in ranked if c.replicas == 1)  # the configured 2 stages x 1 replica runs
    assert (record["schedule"], record["chunks"], record["balance"]) == (best.schedule, best.chunks, list(best.balance))
    assert any(c.schedule in ("zero_bubble", "interleaved_1f1b", "zbv") for c in ranked)
    assert all(c.stage_costs for c in ranked) and any(w > 0 for c in ranked for _, _, w in c.stage_costs)  # W measured


def test_auto_plan_profiles_a_model_built_on_the_meta_device(tmp_path: Path) -> None:
    fit_pipeline(DeferredNet(), 2, max_steps=2, plan="auto", callbacks=[RecordSplit(str(tmp_path))])
    records = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert records[0]["profile"] == records[1]["profile"] is not None and len(records[0]["profile"].layers) == 8
    best = records[0]["plan"][0]
    for record in records:
        assert (record["schedule"], record["chunks"], record["balance"]) == (
            best.schedule,
            best.chunks,
            list(best.balance),
        )


def test_predicted_timelines_replay_each_candidate_as_it_was_planned() -> None:
    """gloo's placement of the V and interleaved schedules hangs under NCCL's model: the pictures
    replay each candidate with the schedule and model it was planned with."""
    from lightning_pipe.plan.report import predicted_timelines

    for rendezvous in (False, True):
        schedules = ("zbv", "interleaved_zero_bubble", "interleaved_1f1b")
        ranked = plan({4: _split_profile(4)}, 2, FREE, schedules=schedules, rendezvous=rendezvous, **ONE)
        assert ranked and all(c.rendezvous is rendezvous for c in ranked)
        svg = predicted_timelines(ranked, 2, top=len(ranked))
        assert all(f"#{i + 1}: {c.schedule}" in svg for i, c in enumerate(ranked))


def test_chimera_in_the_grid_counts_both_copies() -> None:
    """Equal stages, a free link: the predicted bubble is the paper's (D-2)/(2N+D-2) with the
    profile's backward = 2 forward played out; each process holds two stages, so twice 1F1B's static
    bytes; odd depths, 2 processes and data-parallel replicas leave Chimera out."""
    profiles = {m: _profile(m) for m in (4, 8)}
    ranked = plan(profiles, 4, FREE, schedules=("chimera", "1f1b"), balances=("uniform",), checkpoints=("never",))
    chimera = {c.chunks: c for c in ranked if c.schedule == "chimera"}
    one = {c.chunks: c for c in ranked if c.schedule == "1f1b"}
    assert sorted(chimera) == [4, 8] and all(c.balance == (2, 2, 2, 2) for c in chimera.values())
    for m, c in chimera.items():
        assert c.bubble == pytest.approx(
            simulate(build("chimera", 4, m, rendezvous=True), 1.0, 2.0, rendezvous=True).bubble_fraction
        )
        assert c.bubble < one[m].bubble
        static = 2 * 300  # two layers of parameters, gradients and optimizer state per stage
        assert min(c.stage_bytes) >= 2 * static
        assert c.strategy_arguments()["schedule"] == "chimera" and "virtual_stages" not in c.strategy_arguments()
    assert not [c for c in plan(profiles, 3, FREE, schedules=("chimera",)) if c.schedule == "chimera"]
    assert not [c for c in plan(profiles, 2, FREE, schedules=("chimera",)) if c.schedule == "chimera"]
    assert not [c for c in plan(profiles, 2, FREE, schedules=("chimera",), replicas=2) if c.schedule == "chimera"]


def test_the_planner_places_ranks_by_speed_and_its_choice_follows_them() -> None:
    """2 stages x 2 replicas, ranks 1 and 3 at half speed (one slow device per node): the default
    layout has a slow rank in each stage, so both run at half speed; the planner groups the fast
    ranks on one stage and predicts a shorter step than the default layout's. Equal speeds keep the
    default; a given ``rank_order`` is planned as given."""
    profiles = {m: _profile(m) for m in (1, 2, 4)}
    options: dict[str, Any] = dict(schedules=("1f1b",), checkpoints=("never",), replicas=2, replica_batch=16)
    speeds = [1.0, 0.5, 1.0, 0.5]
    placed = plan(profiles, 2, FREE, rank_speeds=speeds, **options)
    kept = plan(profiles, 2, FREE, rank_speeds=speeds, rank_order=[0, 1, 2, 3], **options)
    best, default = placed[0], kept[0]
    assert best.rank_order == (0, 2, 1, 3) and default.rank_order == ()
    assert best.balance_mode == "time" and best.balance[0] > best.balance[1]  # the fast stage takes more
    assert best.step_seconds < 0.9 * default.step_seconds
    assert best.strategy_arguments()["rank_order"] == [0, 2, 1, 3] and "rank_order" not in default.strategy_arguments()
    assert {c.rank_order for c in plan(profiles, 2, FREE, rank_speeds=[1.0] * 4, **options)} == {()}
    assert {c.rank_order for c in plan(profiles, 2, FREE, rank_speeds=speeds, rank_order=[1, 3, 0, 2], **options)} == {
        (1, 3, 0, 2)
    }
    # the speeds line of plan.txt lists every rank's speed and where each stage sits; the overrides run it
    line = plan_text(placed, 2, 2).splitlines()[1]
    assert line == (
        "rank speeds relative to rank 0: rank 0 1.00, rank 1 0.50, rank 2 1.00, rank 3 0.50; "
        "ranks placed: stage 0 on ranks 0, 2; stage 1 on ranks 1, 3"
    )
    assert "strategy.rank_order=[0,2,1,3]" in overrides(best, 2, 2)


def test_each_ranks_own_free_memory_bounds_its_stages() -> None:
    """A budget per global rank: rank 1 has room for about half of an even split, so the memory
    split gives it fewer layers and only such candidates fit; one budget of rank 1's size for every
    rank fits nothing. plan.txt lists each rank's free memory beside its speed."""
    profiles = {m: _profile(m) for m in (1, 2, 4)}
    options: dict[str, Any] = dict(schedules=("1f1b",), checkpoints=("never",), balances=("uniform", "memory"))
    even = plan(profiles, 2, FREE, **options)
    largest = max(max(c.stage_bytes) for c in even)
    small = min(c.stage_bytes[1] for c in even if c.balance == (4, 4)) - 1  # below every even split's rank 1
    ranked = plan(profiles, 2, FREE, memory_budget=[4 * largest, small], **options)
    fitting = [c for c in ranked if c.fits]
    assert fitting and all(c.balance_mode == "memory" and c.stage_bytes[1] <= small for c in fitting)
    assert all(not c.fits for c in ranked if c.balance == (4, 4)) and ranked[0].rank_free == (4 * largest, small)
    assert not any(c.fits for c in plan(profiles, 2, FREE, memory_budget=small, **options) if c.balance == (4, 4))
    speeds = plan(profiles, 2, FREE, memory_budget=[2**30, 2**29], rank_speeds=[1.0, 1.0], **options)
    line = plan_text(speeds, 2, 1).splitlines()[1]
    assert line.startswith(
        "rank speeds relative to rank 0 (equal within 10%: predicted and split as equal): "
        "rank 0 1.00 (1.0 GiB free), rank 1 1.00 (0.5 GiB free)"
    )


def test_dualpipev_is_planned_from_two_micro_batches_per_process() -> None:
    """The planner's grid comes from the traits: DualPipeV is a candidate where its chunk rule
    holds (chunks >= 2 x processes), predicted from the schedule the runtime builds."""
    assert "dualpipev" in PLAN_SCHEDULES
    profiles = {m: _split_profile(16 // m) for m in (1, 2, 4, 8)}
    for rendezvous in (False, True):
        ranked = plan(profiles, 2, FREE, schedules=("dualpipev", "zbv"), **{**ONE, "rendezvous": rendezvous})
        assert {c.chunks for c in ranked if c.schedule == "dualpipev"} == {4, 8}
        for c in ranked:
            assert c.virtual_stages == 2 and len(c.balance) == 4 and c.strategy_arguments()["virtual_stages"] == 2
            if c.schedule == "dualpipev":
                schedule = build("dualpipev", 2, c.chunks, 2, rendezvous=rendezvous)
                predicted = simulate(schedule, stage_costs=c.stage_costs, rendezvous=rendezvous)
                assert c.bubble == pytest.approx(predicted.bubble_fraction)


def test_a_slow_rank_gets_less_work_and_the_prediction_uses_the_speeds() -> None:
    """Rank 1 at half speed: the time split gives it fewer (equal-cost) layers, its stage's compute is
    predicted at twice the profile's seconds, and the time split is predicted faster than the even one."""
    profiles = {m: _profile(m) for m in (1, 2, 4, 8)}
    options: dict[str, Any] = dict(schedules=("1f1b",), checkpoints=("never",))
    equal = plan(profiles, 2, FREE, **options)
    slow = plan(profiles, 2, FREE, rank_speeds=[1.0, 0.5], **options)
    assert equal[0].balance == (4, 4) and equal[0].rank_speeds == ()
    best = slow[0]
    assert best.balance_mode == "time" and best.balance[1] < best.balance[0] and best.rank_speeds == (1.0, 0.5)
    even = next(c for c in slow if c.balance == (4, 4) and c.chunks == best.chunks)
    before = next(c for c in equal if c.balance == (4, 4) and c.chunks == best.chunks)
    assert even.step_seconds > best.step_seconds and even.step_seconds > before.step_seconds
    assert even.stage_costs[0] == pytest.approx(before.stage_costs[0])  # rank 0 runs at the profile's speed
    assert [2 * t for t in before.stage_costs[1]] == pytest.approx(even.stage_costs[1])
    # speeds equal within 10% plan as equal speeds do
    near = plan(profiles, 2, FREE, rank_speeds=[1.0, 0.95], **options)
    assert [(c.balance, c.step_seconds) for c in near] == [(c.balance, c.step_seconds) for c in equal]

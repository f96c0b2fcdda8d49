"""Interleaved 1F1B, ZB-H1 and ZB-V as data: valid, and the bubble their authors publish.

Published figures compared against (bubble relative to the ideal, busy, time; equal costs):

- Megatron's interleaved 1F1B (Narayanan et al., 2021, section 2.2): ``(p - 1) / (v m)``.
- Zero Bubble (Qi et al., 2024; the authors' comparison "assuming T_F = T_B = T_W"): 1F1B
  ``(p - 1) / m``, ZB-H1 ("ZB1P") ``(p - 1) / (3 m)``, i.e. each rank idles ``(p - 1)(T_F + T_B -
  T_W)`` instead of 1F1B's ``(p - 1)(T_F + T_B + T_W)``, with 1F1B's peak memory; ZB-V "0", which the
  exact simulation refines: the V still pays the ramp of one forward per rank, ``p - 1`` half-stage
  units on every rank once ``m >= 2p``, a rate of ``(p - 1) / (6 m)`` (a sixth of 1F1B's).
- Interleaved zero bubble (ZB-H1's rule on Megatron's interleaving, as
  ``torch.distributed.pipelining.ScheduleInterleavedZeroBubble`` orders it): ZB-H1's idle
  ``(p - 1)(T_F + T_B - T_W)`` with each of the ``p x v`` stages costing ``1 / v`` of a rank's
  layers, i.e. ``(p - 1) / (3 v m)`` with equal costs once ``m >= p``, holding no more micro-batches
  than interleaved 1F1B.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from lightning_pipe.schedules import (
    ActionKind,
    InvalidScheduleError,
    Schedule,
    build,
    interleaved_1f1b,
    interleaved_zero_bubble,
    one_f_one_b,
    peak_in_flight,
    render,
    simulate,
    validate,
    zbv,
    zero_bubble,
)
from lightning_pipe.schedules.actions import F, W
from lightning_pipe.schedules.families.interleaved import round_size
from lightning_pipe.schedules.families.zero_bubble import zbv_stage_to_rank

FULL = [(p, m) for p in range(1, 9) for m in range(1, 33)]
SAMPLE = [
    (1, 1),
    (1, 5),
    (2, 1),
    (2, 2),
    (2, 3),
    (2, 4),
    (2, 6),
    (3, 3),
    (3, 7),
    (4, 4),
    (4, 6),
    (4, 8),
    (5, 10),
    (8, 16),
    (8, 32),
]


def _grid(slow: bool) -> list[tuple[int, int]]:
    return FULL if slow else SAMPLE


def _idle_ratio(schedule: Schedule, *costs: float) -> float:
    sim = simulate(schedule, *costs, rendezvous=False)
    busy = sum(sim.busy)
    return (sim.makespan * schedule.num_ranks - busy) / busy


def _interleaved_counts(p: int, m: int) -> bool:
    try:
        round_size(p, m)
    except ValueError:
        return False
    return True


def _interleaved_cases(grid: list[tuple[int, int]], build_fn: Any) -> Iterator[tuple[int, int, int, Schedule]]:
    """(p, m, v, schedule) for every v in 2..4 over ``grid``, checking that the counts that cannot
    be split into equal rounds are refused."""
    for p, m in grid:
        for v in (2, 3, 4):
            if not _interleaved_counts(p, m):
                with pytest.raises(ValueError, match="rounds"):
                    build_fn(p, m, v)
                continue
            schedule = build_fn(p, m, v)
            validate(schedule, rendezvous=False)
            assert schedule.stage_to_rank == tuple(s % p for s in range(p * v))
            yield p, m, v, schedule


def _check_interleaved(grid: list[tuple[int, int]]) -> None:
    for p, m, v, schedule in _interleaved_cases(grid, interleaved_1f1b):
        if m >= p:  # Megatron's figure holds once a round fills the pipeline
            assert _idle_ratio(schedule, 1.0, 2.0) == pytest.approx((p - 1) / (v * m), abs=1e-9), (p, m, v)
        else:
            assert _idle_ratio(schedule, 1.0, 2.0) >= (p - 1) / (v * m) - 1e-9


def _check_zero_bubble(grid: list[tuple[int, int]]) -> None:
    for p, m in grid:
        schedule = zero_bubble(p, m)
        validate(schedule)  # under NCCL's rendezvous model too
        sim = simulate(schedule, 1.0, 1.0, 1.0)
        base = simulate(one_f_one_b(p, m), 1.0, 2.0)
        if m >= p:
            assert [sim.makespan - b for b in sim.busy] == pytest.approx([p - 1] * p), (p, m)
            assert _idle_ratio(schedule, 1.0, 1.0, 1.0) == pytest.approx((p - 1) / (3 * m))
            assert _idle_ratio(one_f_one_b(p, m), 1.0, 2.0) == pytest.approx((p - 1) / m)
        assert sim.makespan <= base.makespan
        assert max(peak_in_flight(schedule).values()) <= max(peak_in_flight(one_f_one_b(p, m)).values())


def _check_zbv(grid: list[tuple[int, int]]) -> None:
    for p, m in grid:
        schedule = zbv(p, m)
        validate(schedule, rendezvous=False)
        sim = simulate(schedule, 1.0, 1.0, 1.0, rendezvous=False)
        if m >= 2 * p:
            assert [sim.makespan - b for b in sim.busy] == pytest.approx([p - 1] * p), (p, m)
            assert _idle_ratio(schedule, 1.0, 1.0, 1.0) == pytest.approx((p - 1) / (6 * m))
            peaks = peak_in_flight(schedule)  # half-size stages: p + 1/2 full ones on every rank
            assert [peaks[r] + peaks[2 * p - 1 - r] for r in range(p)] == [2 * p + 1] * p


def _check_interleaved_zero_bubble(grid: list[tuple[int, int]]) -> None:
    for p, m, v, schedule in _interleaved_cases(grid, interleaved_zero_bubble):
        assert schedule.split_backward
        sim = simulate(schedule, 1.0, 1.0, 1.0, rendezvous=False)
        if m >= p:
            assert [sim.makespan - b for b in sim.busy] == pytest.approx([p - 1] * p), (p, m, v)
            assert _idle_ratio(schedule, 1.0, 1.0, 1.0) == pytest.approx((p - 1) / (3 * v * m)), (p, m, v)
        interleaved = interleaved_1f1b(p, m, v)
        assert sim.makespan <= simulate(interleaved, 1.0, 2.0, rendezvous=False).makespan + 1e-9, (p, m, v)
        assert max(peak_in_flight(schedule).values()) <= max(peak_in_flight(interleaved).values()), (p, m, v)
        if m % p == 0:  # NCCL (rendezvous): regrouped, every multiple of p runs
            validate(build("interleaved_zero_bubble", p, m, v, rendezvous=True))


@pytest.mark.slow  # about 12 s; the sampled property and rendezvous grids cover the schedule by default
def test_interleaved_zero_bubble_sample() -> None:
    _check_interleaved_zero_bubble(_grid(False))


def test_interleaved_zero_bubble_orders_compute_as_torch_does() -> None:
    """The same compute order per rank as torch.distributed.pipelining's ScheduleInterleavedZeroBubble
    (whose idle slots are its own runtime's, not actions)."""
    pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
    for p, m, v in [(2, 4, 2), (4, 8, 2), (3, 6, 3), (4, 4, 4), (2, 3, 2)]:
        ours = interleaved_zero_bubble(p, m, v)
        torch_schedule = pipelining.ScheduleInterleavedZeroBubble.__new__(pipelining.ScheduleInterleavedZeroBubble)
        torch_schedule.pp_group_size, torch_schedule.n_local_stages, torch_schedule._n_microbatches = p, v, m
        torch_schedule.number_of_rounds = max(1, m // p)
        torch_schedule.microbatches_per_round = m // torch_schedule.number_of_rounds
        for rank in range(p):
            theirs = [a for a in torch_schedule._calculate_single_rank_operations(rank) if a is not None]
            expected = [(kinds[a.computation_type.name], a.stage_index, a.microbatch_index) for a in theirs]
            assert [(a.kind.value, a.stage, a.microbatch) for a in ours.compute(rank)] == expected, (p, m, v, rank)


def test_interleaved_sample() -> None:
    _check_interleaved(_grid(False))


def test_zero_bubble_sample() -> None:
    _check_zero_bubble(_grid(False))


def test_zbv_sample() -> None:
    _check_zbv(_grid(False))


@pytest.mark.slow
@pytest.mark.parametrize("check", [_check_interleaved, _check_zero_bubble, _check_zbv, _check_interleaved_zero_bubble])
def test_every_count(check) -> None:
    check(_grid(True))


def test_interleaved_rank_holds_every_pth_stage_in_megatron_order() -> None:
    schedule = interleaved_1f1b(2, 4, 2)
    assert schedule.stages_of(0) == [0, 2] and schedule.stages_of(1) == [1, 3]
    # rank 0: a round of p forwards on stage 0, the same micro-batches on stage 2, then 1F1B
    assert schedule.compute(0)[:5] == [F(0, 0), F(0, 1), F(2, 0), F(2, 1), F(0, 2)]


def test_interleaved_rejects_counts_it_cannot_round() -> None:
    with pytest.raises(ValueError, match="chunks"):
        interleaved_1f1b(2, 5, 2)
    assert interleaved_1f1b(2, 3, 2).num_microbatches == 3  # fewer than 2p: one round


def test_zero_bubble_defers_weight_gradients_by_the_stage_index() -> None:
    schedule = zero_bubble(4, 8)
    assert schedule.split_backward
    first = [str(a) for a in schedule.compute(0)]
    assert first.index("W0@s0") == first.index("B0@s0") + 1  # stage 0: p - 1 warm-up forwards, no delay
    last = [str(a) for a in schedule.compute(3)]
    assert last[:8] == ["F0@s3", "B0@s3", "F1@s3", "B1@s3", "F2@s3", "B2@s3", "F3@s3", "B3@s3"]
    assert last[8] == "W0@s3"  # stage 3: three backwards late, filling what was 1F1B's bubble
    assert peak_in_flight(schedule) == {s: 4 for s in range(4)}


def test_zbv_places_first_and_last_stage_on_rank_zero() -> None:
    assert zbv_stage_to_rank(3) == [0, 1, 2, 2, 1, 0]
    schedule = zbv(3, 6)
    assert schedule.stages_of(0) == [0, 5]
    assert schedule.split_backward


def test_weight_before_input_gradient_is_rejected() -> None:
    good = zero_bubble(1, 2)
    actions = list(good.actions[0])
    i, j = actions.index(W(0, 0)), actions.index(next(a for a in actions if a.kind is ActionKind.BACKWARD))
    actions[i], actions[j] = actions[j], actions[i]
    bad = Schedule("bad", 1, 2, (0,), (tuple(actions),), split_backward=True)
    with pytest.raises(InvalidScheduleError, match="weight gradient before"):
        validate(bad)


def test_missing_weight_gradient_is_rejected() -> None:
    good = zero_bubble(1, 2)
    bad = Schedule("bad", 1, 2, (0,), (tuple(a for a in good.actions[0] if a != W(0, 1)),), split_backward=True)
    with pytest.raises(InvalidScheduleError, match="missing"):
        validate(bad)


def test_local_receive_before_its_send_is_rejected() -> None:
    good = interleaved_1f1b(1, 1, 2)  # both stages on one rank: a hand-over in memory
    actions = list(good.actions[0])
    send = next(a for a in actions if a.kind is ActionKind.SEND_ACTIVATION)
    recv = send.matching()
    i, j = actions.index(send), actions.index(recv)
    actions[i], actions[j] = actions[j], actions[i]
    bad = Schedule("bad", 2, 1, (0, 0), (tuple(actions),))
    with pytest.raises(InvalidScheduleError, match="same rank before it sent"):
        validate(bad)


def test_render_shows_weight_actions_and_stages() -> None:
    text = render(zero_bubble(2, 2), 1, 1, 1)
    assert "W0" in text and "zero_bubble" in text
    text = render(interleaved_1f1b(2, 2, 2))
    assert "F0s2" in text


def test_sampled_counts_are_random_enough() -> None:
    rng = random.Random(0)
    extra = [(rng.randint(1, 8), rng.randint(1, 32)) for _ in range(4)]
    _check_zero_bubble(extra)


def test_measured_stage_costs_give_b_and_w_their_own_times() -> None:
    """Per-stage (F, B, W) costs, as measured, play like the same fixed costs; under an unsplit
    schedule the backward costs B + W."""
    split = zero_bubble(4, 8)
    fixed = simulate(split, forward_cost=1.0, backward_cost=1.5, weight_cost=0.5)
    measured = simulate(split, stage_costs=[(1.0, 1.5, 0.5)] * 4)
    assert measured.makespan == pytest.approx(fixed.makespan)
    assert measured.cost(W(0, 3)) == 0.5
    unsplit = simulate(one_f_one_b(4, 8), stage_costs=[(1.0, 1.5, 0.5)] * 4)
    assert unsplit.makespan == pytest.approx(simulate(one_f_one_b(4, 8), forward_cost=1.0, backward_cost=2.0).makespan)
    cheap_w = simulate(split, stage_costs=[(1.0, 1.5, 0.1)] * 4)
    assert cheap_w.makespan < measured.makespan

"""DualPipeV as data: valid, DeepSeek's bubble and activations, torch's order, its F&B pairs.

DeepSeek's table (DeepSeek-V3, section 3.2.1; the DualPipe repository), ``PP`` stages on ``PP / 2``
ranks: bubble ``(PP/2 - 1)(F&B + B - 3W)``, ``PP + 1`` micro-batches' activations. ``B`` there is a
whole backward (our B + W) and ``F&B`` an overlapped pair's time: the simulation's ``overlap=1.0``
runs each unit as one block of ``F + B + W`` whose sends leave at its end.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_pipe.schedules import (
    ActionKind,
    InvalidScheduleError,
    build,
    dualpipev,
    peak_in_flight,
    peak_in_flight_per_rank,
    simulate,
    traits,
    validate,
)
from lightning_pipe.schedules.actions import Action, B, F, W
from lightning_pipe.schedules.families.dualpipe import table_bubble
from lightning_pipe.schedules.families.zero_bubble import zbv_stage_to_rank


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_equal_costs_give_the_table_bubble_on_every_rank(ranks: int) -> None:
    for m in (2 * ranks, 2 * ranks + 1, 4 * ranks):
        schedule = dualpipev(ranks, m)
        validate(schedule, rendezvous=False)
        # F = B = W = 1: a whole backward 2, an F&B unit (on two streams, no gain) 3 -> 2 (p - 1)
        expected = table_bubble(ranks, forward=1.0, backward=2.0, weight=1.0, overlapped=3.0)
        assert expected == 2 * (ranks - 1)
        sim = simulate(schedule, 1.0, 1.0, 1.0, rendezvous=False, overlap=1.0)
        assert [sim.makespan - b for b in sim.busy] == pytest.approx([expected] * ranks), (ranks, m)
        # run one after another as listed, the forward's output leaves before the backward computes:
        # ZB-V's p - 1
        sim = simulate(schedule, 1.0, 1.0, 1.0, rendezvous=False)
        assert [sim.makespan - b for b in sim.busy] == pytest.approx([ranks - 1] * ranks), (ranks, m)
        zbv = simulate(build("zbv", ranks, m, 2), 1.0, 1.0, 1.0, rendezvous=False)
        assert sim.makespan == pytest.approx(zbv.makespan), (ranks, m)


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_holds_pp_plus_one_activations_on_the_v(ranks: int) -> None:
    peaks = peak_in_flight(dualpipev(ranks, 4 * ranks))  # half-size stages: PP + 1 of them, PP = 2 x ranks
    assert [peaks[r] + peaks[2 * ranks - 1 - r] for r in range(ranks)] == [2 * ranks + 1] * ranks
    # held at once (what benchmarks/activation_memory.py measures: 5 on 2 processes, 9 on 4), and
    # ZB-V's PP, whose stages' separate peaks also sum to PP + 1 but never coincide
    for m in (2 * ranks, 4 * ranks):
        assert peak_in_flight_per_rank(dualpipev(ranks, m)) == dict.fromkeys(range(ranks), 2 * ranks + 1)
        assert peak_in_flight_per_rank(build("zbv", ranks, m, 2)) == dict.fromkeys(range(ranks), 2 * ranks)


def test_places_stages_in_a_v_and_splits_the_backward() -> None:
    schedule = dualpipev(4, 8)
    assert schedule.stage_to_rank == tuple(zbv_stage_to_rank(4)) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert schedule.split_backward and schedule.num_stages == 8
    t = traits("dualpipev")
    assert (t.placement, t.virtual_stages, t.split_backward, t.overlaps) == ("v", 2, True, True)
    assert t.min_chunks is not None and t.min_chunks(4) == 8


@pytest.mark.parametrize(("ranks", "chunks"), [(2, 3), (4, 7), (8, 1)])
def test_too_few_chunks_are_refused_with_the_smallest_valid_value(ranks: int, chunks: int) -> None:
    with pytest.raises(ValueError, match=rf"chunks >= 2 x processes = {2 * ranks} .* Use chunks={2 * ranks}"):
        dualpipev(ranks, chunks)
    validate(dualpipev(ranks, 2 * ranks), rendezvous=False)


def test_one_rank_runs_both_legs_in_order() -> None:
    schedule = dualpipev(1, 3)
    validate(schedule, rendezvous=False)
    assert schedule.stage_to_rank == (0, 0)


def _torch_order(ranks: int, chunks: int, rank: int) -> list[tuple[str, int, int]]:
    """torch's ScheduleDualPipeV per-rank compute order as (kind, stage, micro-batch), its F&B pairs
    unpacked and each whole backward as B then W."""
    torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    order = torch_schedules.ScheduleDualPipeV._calculate_single_rank_operations

    class _Host:
        pp_group_size = ranks
        _n_microbatches = chunks

    names = {"FORWARD": ["F"], "BACKWARD_INPUT": ["B"], "BACKWARD_WEIGHT": ["W"], "FULL_BACKWARD": ["B", "W"]}
    out: list[tuple[str, int, int]] = []
    for action in order(_Host(), rank):
        for sub in action.sub_actions or (action,):
            for kind in names[sub.computation_type.name]:
                out.append((kind, sub.stage_index, sub.microbatch_index))
    return out


@pytest.mark.parametrize(("ranks", "chunks"), [(2, 4), (2, 7), (4, 8), (4, 13)])
def test_orders_compute_as_torch_does(ranks: int, chunks: int) -> None:
    schedule = dualpipev(ranks, chunks)
    for rank in range(ranks):
        ours = [(a.kind.value, a.stage, a.microbatch) for a in schedule.compute(rank)]
        assert ours == _torch_order(ranks, chunks, rank), rank


def test_f_and_b_pairs_post_their_receives_before_either_compute() -> None:
    schedule = dualpipev(4, 16)
    assert all(schedule.overlapped)
    for rank, units in enumerate(schedule.overlapped):
        actions = schedule.actions[rank]
        for unit in units:
            start, end = actions.index(unit[0]), actions.index(unit[-1])
            assert [a for a in actions[start : end + 1] if a.kind.is_compute] == list(unit)
            assert not any(a.kind.is_recv for a in actions[start:end])  # nothing the unit waits for in between
            assert unit[0].kind is ActionKind.FORWARD and unit[1].kind is ActionKind.BACKWARD
            assert unit[0].stage != unit[1].stage  # one leg's forward with the other leg's backward
            before = set(actions[:start])
            for a in unit:
                depth = a.stage % schedule.num_stages
                if a.kind is ActionKind.FORWARD and depth > 0:
                    assert Action(ActionKind.RECV_ACTIVATION, a.stage, a.microbatch) in before
                if a.kind is ActionKind.BACKWARD and depth < schedule.num_stages - 1:
                    assert Action(ActionKind.RECV_GRADIENT, a.stage, a.microbatch) in before


def test_rendezvous_regrouping_runs_every_count_it_is_given() -> None:
    for ranks in (2, 4):
        for m in (2 * ranks, 3 * ranks + 1):
            validate(build("dualpipev", ranks, m, 2, rendezvous=True), rendezvous=True)


def test_a_bad_overlapped_unit_is_refused() -> None:
    schedule = dualpipev(2, 4)
    rank0 = schedule.overlapped[0]
    forward, backward = rank0[0][0], rank0[0][1]
    second = rank0[1]
    for bad, match in [
        ((backward, forward), "give a forward"),
        ((forward, backward, W(forward.stage, forward.microbatch)), "not the B's"),
        ((F(forward.stage, backward.microbatch), B(backward.stage, backward.microbatch)), "cannot overlap"),
        ((forward, second[1]), "not consecutive"),
    ]:
        broken = ((bad, *rank0[1:]), *schedule.overlapped[1:])
        with pytest.raises(InvalidScheduleError, match=match):
            validate(replace(schedule, overlapped=broken), rendezvous=False)

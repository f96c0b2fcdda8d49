import pytest

from lightning_pipe.schedules import (
    ActionKind,
    InvalidScheduleError,
    build,
    chimera,
    closed_form_bubble,
    for_rendezvous,
    get_schedule,
    one_f_one_b,
    peak_in_flight,
    render,
    simulate,
    traits,
    validate,
)
from lightning_pipe.schedules.actions import B, F
from lightning_pipe.schedules.families.chimera import DOWN, UP, chimera_chains, chimera_forward, paper_bubble
from lightning_pipe.schedules.runnable import ScheduleRefused, runnable_schedule

#: D in {2, 4, 6, 8}, N every multiple of D up to 32.
GRID = [(d, n) for d in (2, 4, 6, 8) for n in range(d, 33, d)]


@pytest.mark.parametrize("d, n", GRID)
def test_valid_and_the_papers_bubble_with_equal_costs(d: int, n: int) -> None:
    schedule = chimera(d, n)
    validate(schedule, rendezvous=False)  # gloo's model
    # Li and Hoefler, SC'21, Table 2: Chimera's bubble ratio (D - 2) / (2N + D - 2), forward = backward
    sim = simulate(schedule, 1.0, 1.0, rendezvous=False)
    assert sim.bubble_fraction == pytest.approx((d - 2) / (2 * n + d - 2), abs=1e-12)
    assert sim.bubble_fraction == pytest.approx(paper_bubble(d, n))
    assert sim.makespan == 2 * n + d - 2
    if d > 2:  # against 1F1B's (D - 1) / (N + D - 1) on the same D stages
        assert sim.bubble_fraction < closed_form_bubble(d, n)


@pytest.mark.parametrize("d, n", [(d, n) for d, n in GRID if n >= 2 * d - 4])
def test_regrouped_for_nccl_finishes(d: int, n: int) -> None:
    regrouped = build("chimera", d, n, rendezvous=True)
    validate(regrouped, rendezvous=True)
    assert [regrouped.compute(r) for r in range(d)] == [chimera(d, n).compute(r) for r in range(d)]


@pytest.mark.parametrize("d, n", [(6, 6), (8, 8)])
def test_too_few_microbatches_for_nccl_are_refused_with_the_fix(d: int, n: int) -> None:
    with pytest.raises(ScheduleRefused, match=f">= {2 * d - 4} for 'chimera'"):
        runnable_schedule(traits("chimera"), d, n, 1, rendezvous=True)
    runnable_schedule(traits("chimera"), d, n, 1, rendezvous=False)  # gloo runs it


@pytest.mark.parametrize("d, n", [(4, 5), (4, 7), (6, 9), (8, 3), (2, 1), (2, 3)])
def test_other_counts_are_valid_under_gloo(d: int, n: int) -> None:
    validate(chimera(d, n), rendezvous=False)


def test_layout_two_pipelines_in_opposite_directions() -> None:
    schedule = chimera(4, 8)
    assert schedule.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    assert schedule.chains == 2 and schedule.chain_length == 4
    assert schedule.chain_of == (DOWN, DOWN, UP, UP, DOWN, DOWN, UP, UP) == chimera_chains(4, 8)
    assert list(schedule.chain_stages(0)) == [0, 1, 2, 3]
    assert list(schedule.chain_stages(2)) == [4, 5, 6, 7]
    for rank in range(4):  # rank i holds stage i down and the up copy of stage 3 - i
        assert schedule.stages_of(rank) == [rank, 7 - rank]
    # a micro-batch goes through its own chain only, and only its chain's sends and receives
    for rank in range(4):
        for action in schedule.actions[rank]:
            assert action.stage in schedule.chain_stages(action.microbatch)


def test_basic_unit_is_the_papers() -> None:
    """Figure 3 of the paper (D = 4, N = 4): rank 0 starts the down pipeline, rank 3 the up one."""
    schedule = chimera(4, 4)
    assert schedule.compute(0) == [F(0, 0), F(0, 1), F(7, 2), B(7, 2), F(7, 3), B(7, 3), B(0, 0), B(0, 1)]
    assert schedule.compute(3) == [F(4, 2), F(4, 3), F(3, 0), B(3, 0), F(3, 1), B(3, 1), B(4, 2), B(4, 3)]
    lines = render(schedule, 1, 1).splitlines()
    assert lines[0] == "rank 0 | F0s0 F1s0 ..   F2s7 B2s7 F3s7 B3s7 B0s0 ..   B1s0"
    assert "bubble 20.0%" in lines[-1]


@pytest.mark.parametrize("d, n", [(4, 4), (4, 16), (8, 8), (8, 32)])
def test_activations_held_per_rank_between_half_and_all_of_d(d: int, n: int) -> None:
    """The paper: each worker holds between D/2 + 1 and D micro-batches' activations (1F1B: 1 to D)."""
    schedule = chimera(d, n)
    per_rank = [_peak_on_rank(schedule, r) for r in range(d)]
    assert max(per_rank) == d
    assert min(per_rank) >= d // 2 + 1
    if n == d:  # the basic unit: the ends hold D/2 + 1, the middle D
        assert per_rank[0] == per_rank[-1] == d // 2 + 1
        assert per_rank[d // 2] == d
    ofob = peak_in_flight(one_f_one_b(d, n))
    assert max(ofob.values()) == d and min(ofob.values()) == 1


def _peak_on_rank(schedule, rank: int) -> int:
    """Micro-batches whose forward ran on this rank and whose backward has not, over both stages."""
    live = peak = 0
    for action in schedule.compute(rank):
        live += 1 if action.kind is ActionKind.FORWARD else -1
        peak = max(peak, live)
    return peak


def test_unequal_costs_still_finish_and_beat_1f1b() -> None:
    for d, n in [(4, 8), (8, 16)]:
        sim = simulate(chimera(d, n), 1.0, 2.0, rendezvous=False)
        assert sim.bubble_fraction < closed_form_bubble(d, n)


def test_no_bubble_on_two_ranks() -> None:
    for n in (2, 4, 8):
        assert simulate(chimera(2, n), 1.0, 2.0, rendezvous=False).bubble_fraction == 0.0


def test_evaluation_goes_through_the_up_pipeline() -> None:
    schedule = chimera_forward(4, 3)
    validate(schedule, rendezvous=True)
    assert schedule.forward_only and schedule.chain_of == (UP, UP, UP)
    assert schedule.compute(0) == [F(7, 0), F(7, 1), F(7, 2)]  # the last stage is on rank 0
    assert all(a.kind is ActionKind.FORWARD for r in range(4) for a in schedule.compute(r))
    evaluation = runnable_schedule(traits("chimera"), 4, 3, 1, rendezvous=True, forward=True)
    assert evaluation.compute(3) == [F(4, i) for i in range(3)]


@pytest.mark.parametrize("d", [1, 3, 5])
def test_odd_stage_counts_are_refused_with_the_fix(d: int) -> None:
    with pytest.raises(ValueError, match="even number of pipeline stages"):
        get_schedule("chimera")(d, 4)


def test_a_microbatch_on_the_wrong_chain_is_rejected() -> None:
    schedule = chimera(2, 2)
    wrong = type(schedule)(**{**schedule.__dict__, "chain_of": (UP, UP)})
    with pytest.raises(InvalidScheduleError, match="missing"):
        validate(wrong, rendezvous=False)


def test_regrouping_keeps_chains() -> None:
    regrouped = for_rendezvous(chimera(4, 4))
    assert regrouped.chains == 2 and regrouped.chain_of == chimera(4, 4).chain_of

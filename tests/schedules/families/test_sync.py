import pytest

from lightning_pipe.schedules import (
    ActionKind,
    InvalidScheduleError,
    Schedule,
    closed_form_bubble,
    forward_only,
    get_schedule,
    gpipe,
    one_f_one_b,
    peak_in_flight,
    render,
    simulate,
    validate,
)
from lightning_pipe.schedules.actions import B, F

#: every stage count to 8 with micro-batch counts below, at and above it (the closed form changes shape at m = p)
GRID = [(p, m) for p in range(1, 9) for m in (*range(1, 13), 16, 23, 32)]
FULL_GRID = [(p, m) for p in range(1, 9) for m in range(1, 33)]


def _closed_form_over(name: str, grid: list[tuple[int, int]]) -> None:
    fn = get_schedule(name)
    for p, m in grid:
        schedule = fn(p, m)
        validate(schedule)
        sim = simulate(schedule)
        assert sim.bubble_fraction == pytest.approx(closed_form_bubble(p, m), abs=1e-12), (name, p, m)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_every_schedule_is_valid_and_has_the_closed_form_bubble(name: str) -> None:
    _closed_form_over(name, GRID)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_every_schedule_of_the_full_grid_is_valid_and_has_the_closed_form_bubble(name: str) -> None:
    _closed_form_over(name, FULL_GRID)


@pytest.mark.parametrize("p, m", [(1, 1), (2, 1), (3, 7), (8, 32)])
def test_forward_only_is_valid_and_holds_nothing(p: int, m: int) -> None:
    schedule = forward_only(p, m)
    validate(schedule)
    assert all(a.kind is not ActionKind.BACKWARD for rank in schedule.actions for a in rank)
    assert set(peak_in_flight(schedule).values()) == {0}


def test_bubble_is_independent_of_the_backward_cost() -> None:
    for fn in (gpipe, one_f_one_b):
        for backward in (1.0, 2.0, 3.0):
            assert simulate(fn(4, 6), 1.0, backward).bubble_fraction == pytest.approx(closed_form_bubble(4, 6))


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 3), (8, 32)])
def test_peak_in_flight(p: int, m: int) -> None:
    assert peak_in_flight(gpipe(p, m)) == {s: m for s in range(p)}
    assert peak_in_flight(one_f_one_b(p, m)) == {s: min(p - s, m) for s in range(p)}


def test_1f1b_order_on_two_stages() -> None:
    schedule = one_f_one_b(2, 3)
    assert schedule.compute(0) == [F(0, 0), F(0, 1), B(0, 0), F(0, 2), B(0, 1), B(0, 2)]
    assert schedule.compute(1) == [F(1, 0), B(1, 0), F(1, 1), B(1, 1), F(1, 2), B(1, 2)]


def test_sends_are_grouped_with_the_receive_from_the_same_neighbour() -> None:
    # 1F1B steady state: stage 0 sends an activation and receives a gradient in one group,
    # which NCCL's rendezvous point-to-point needs to avoid a deadlock.
    actions = [str(a) for a in one_f_one_b(2, 3).actions[0]]
    assert actions[:5] == ["F0@s0", "SEND_F0@s0", "F1@s0", "SEND_F1@s0", "RECV_B0@s0"]


def test_render_shows_the_timetable() -> None:
    text = render(one_f_one_b(2, 3))
    lines = text.splitlines()
    assert lines[0] == "rank 0 | F0 F1 .. .. B0 B0 F2 B1 B1 .. B2 B2"
    assert lines[1] == "rank 1 | .. F0 B0 B0 F1 B1 B1 F2 B2 B2 .. .."
    assert "bubble 25.0%" in lines[2] and "2, 1" in lines[2]


def test_unknown_schedule_names_the_valid_ones() -> None:
    with pytest.raises(
        ValueError,
        match="Valid schedules: 1f1b, chimera, dualpipev, gpipe, interleaved_1f1b, interleaved_zero_bubble, "
        "pipedream, pipedream_2bw, pipemare, wpipe, xpipe, zbv, zero_bubble",
    ):
        get_schedule("zero_bubbles")


@pytest.mark.parametrize("bad", [0, -1])
def test_schedule_sizes_must_be_positive(bad: int) -> None:
    with pytest.raises(ValueError):
        gpipe(bad, 2)
    with pytest.raises(ValueError):
        one_f_one_b(2, bad)


def _replace(schedule: Schedule, rank: int, actions: list) -> Schedule:
    per_rank = list(schedule.actions)
    per_rank[rank] = tuple(actions)
    return Schedule(
        schedule.name, schedule.num_stages, schedule.num_microbatches, schedule.stage_to_rank, tuple(per_rank)
    )


def test_validator_rejects_a_missing_backward() -> None:
    good = gpipe(1, 2)
    broken = _replace(good, 0, [a for a in good.actions[0] if a != B(0, 0)])
    with pytest.raises(InvalidScheduleError, match=r"missing \['B0@s0'\]"):
        validate(broken)


def test_validator_rejects_backward_before_forward() -> None:
    good = gpipe(1, 2)
    broken = _replace(good, 0, [B(0, 0), F(0, 0), F(0, 1), B(0, 1)])
    with pytest.raises(InvalidScheduleError, match="backward before its forward"):
        validate(broken)


def test_validator_rejects_a_deadlock() -> None:
    # Stage 1 waits for the gradient order 1, 0 while stage 0's activations come in order 0, 1,
    # but stage 0 only sends activation 1 after receiving gradient 0: a cycle.
    good = gpipe(2, 2)
    a0 = list(good.actions[0])
    reordered = [x for x in a0 if str(x) not in ("F1@s0", "SEND_F1@s0")]
    position = reordered.index(B(0, 0)) + 1
    reordered[position:position] = [F(0, 1)]
    send = next(x for x in a0 if str(x) == "SEND_F1@s0")
    reordered.append(send)
    with pytest.raises(InvalidScheduleError):
        validate(_replace(good, 0, reordered))


def test_validator_rejects_an_action_on_the_wrong_rank() -> None:
    good = gpipe(2, 1)
    broken = _replace(good, 0, list(good.actions[0]) + [F(1, 0)])
    with pytest.raises(InvalidScheduleError, match="lives on rank 1"):
        validate(broken)


def test_docs_timetable_is_what_render_prints() -> None:
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[3] / "docs" / "observe.md").read_text()
    for line in render(one_f_one_b(num_stages=2, num_microbatches=3)).splitlines():
        assert f"# {line}" in readme

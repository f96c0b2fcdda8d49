"""WPipe's order and update rule on paper: two groups of stages, the first one step late, the second not."""

from __future__ import annotations

import pytest

from lightning_pipe.schedules import (
    InvalidScheduleError,
    closed_form_bubble,
    pipedream_2bw,
    render,
    steady_state_bubble,
    step_actions,
    traits,
    unroll,
    update_delay,
    validate,
    versions_held,
)
from lightning_pipe.schedules.actions import ActionKind
from lightning_pipe.schedules.families.asynchronous import min_chunks, wpipe, wpipe_second_group

STAGES = (2, 4, 8)


def _chunks(p: int) -> list[int]:
    return sorted({p - 1 or 1, p, p + 1, 2 * p, 3 * p + 1})


@pytest.mark.parametrize("p", STAGES)
def test_unrolled_steps_are_valid(p: int) -> None:
    for m in _chunks(p):
        steady = wpipe(p, m)
        validate(unroll(steady, 1))  # one step from an empty pipeline, under the strict model too
        for steps in (2, 5):
            validate(unroll(steady, steps), rendezvous=False)


def test_two_stages_are_valid_under_the_strict_model_across_steps() -> None:
    """With one stage in G1 (the last) nothing waits at a step's end; deeper G1s flush each batch,
    and only the runtime's separate posting of each step keeps them apart (not modelled by unroll)."""
    for m in (1, 2, 5):
        validate(unroll(wpipe(2, m), 5))
    with pytest.raises(InvalidScheduleError, match="deadlocks"):
        validate(unroll(wpipe(4, 4), 2))


@pytest.mark.parametrize("p", STAGES)
def test_the_first_half_is_one_step_late_and_the_second_at_once(p: int) -> None:
    for m in _chunks(p):
        half = p // 2
        assert wpipe_second_group(p) == half
        assert [update_delay("wpipe", p, m, s) for s in range(p)] == [1] * half + [0] * (p - half)
        assert [versions_held("wpipe", p, m, s) for s in range(p)] == [2] * half + [1] * (p - half)
        # 2BW: one step late everywhere, two versions on all but the last stage
        assert [update_delay("pipedream_2bw", p, m, s) for s in range(p)] == [1] * p
        fewer = sum(versions_held("pipedream_2bw", p, m, s) - versions_held("wpipe", p, m, s) for s in range(p))
        assert fewer == p - p // 2 - 1  # 2BW's second copies on G1 but its last stage


@pytest.mark.parametrize("p", STAGES)
def test_the_order_gives_those_delays(p: int) -> None:
    """Where each batch's backwards run: on G1 all within the batch's own step (so its update can
    come before the next batch's forwards there), on G0 some in the next step (so the batch's
    version must be kept across one update, and its gradient is applied one step later)."""
    for m in _chunks(p):
        steady = wpipe(p, m)
        t = 3  # a steady step: batch t's micro-batches are t * m .. t * m + m - 1
        for s in range(p):
            now = {a.microbatch for a in step_actions(steady, s, t) if a.kind is ActionKind.BACKWARD}
            later = {a.microbatch for a in step_actions(steady, s, t + 1) if a.kind is ActionKind.BACKWARD}
            batch = set(range(t * m, t * m + m))
            if s >= wpipe_second_group(p):
                assert batch <= now and not batch & later
            else:
                assert batch & later and batch <= now | later


@pytest.mark.parametrize("p", STAGES)
def test_the_steady_bubble_is_that_of_1f1b_over_the_second_group(p: int) -> None:
    for m in _chunks(p):
        bubble = steady_state_bubble(wpipe(p, m), rendezvous=False)
        assert bubble == pytest.approx(closed_form_bubble(p - p // 2, m), abs=1e-9)
        assert steady_state_bubble(pipedream_2bw(p, m), rendezvous=False) == pytest.approx(0.0, abs=1e-12)
        if p > 2:
            assert 0 < bubble < closed_form_bubble(p, m)


def test_too_few_chunks_are_refused_with_the_fix() -> None:
    assert [min_chunks("wpipe", p) for p in (1, 2, 4, 8)] == [1, 1, 3, 7]
    with pytest.raises(ValueError, match=r"chunks >= stages - 1.*Use chunks >= 3"):
        wpipe(4, 2)


def test_traits_and_rendering() -> None:
    t = traits("wpipe")
    assert t.asynchronous and t.stashes_weights and t.refuses_ties and not t.planned
    text = render(unroll(wpipe(4, 4), 3), rendezvous=False)
    assert text.splitlines()[-1].endswith("weight versions per stage 2, 2, 1, 1")

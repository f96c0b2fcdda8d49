"""Property tests over every registered training schedule: for p stages up to 16 and m
micro-batches up to 64, the schedule is valid (every micro-batch's forward before its backward,
nothing missing, sends matched, no deadlock under the strict communication model) and its
simulation finishes with the expected bubble. A seeded sample of the grid runs by default; the
whole grid with ``--runslow``."""

from __future__ import annotations

import random

import pytest

from lightning_pipe.schedules import SCHEDULES, closed_form_bubble, is_async, peak_in_flight, simulate, unroll, validate
from lightning_pipe.schedules.asynchronous import isolated_step, min_chunks

FULL = [(p, m) for p in range(1, 17) for m in range(1, 65)]
CORNERS = [(1, 1), (1, 64), (16, 1), (16, 15), (16, 16), (16, 64), (2, 1), (7, 3)]
SAMPLE = CORNERS + random.Random(20261122).sample(FULL, 12)


def _check(name: str, p: int, m: int) -> None:
    if is_async(name):
        if m < min_chunks(name, p):  # runs as an isolated step, drained at once
            validate(unroll(isolated_step(p, m), 1))
            return
        unrolled = unroll(SCHEDULES[name](p, m), 2)
        validate(unrolled)
        simulate(unrolled)
        return
    schedule = SCHEDULES[name](p, m)
    validate(schedule)
    assert simulate(schedule).bubble_fraction == pytest.approx(closed_form_bubble(p, m), abs=1e-9), (name, p, m)
    if name == "1f1b":
        assert peak_in_flight(schedule) == {s: min(p - s, m) for s in range(p)}
    if name == "gpipe":
        assert set(peak_in_flight(schedule).values()) == {m}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_sampled_grid(name: str) -> None:
    for p, m in SAMPLE:
        _check(name, p, m)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_whole_grid(name: str) -> None:
    for p, m in FULL:
        _check(name, p, m)

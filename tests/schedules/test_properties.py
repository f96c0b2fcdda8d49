"""Property tests over every registered training schedule: for p stages up to 16 and m
micro-batches up to 64, the schedule is valid (every micro-batch's forward before its backward,
nothing missing, sends matched, no deadlock under the strict communication model) and its
simulation finishes with the expected bubble. A seeded sample of the grid runs by default; the
whole grid with ``--runslow``."""

from __future__ import annotations

import random

import pytest

from lightning_pipe.schedules import SCHEDULES, closed_form_bubble, is_async, peak_in_flight, simulate, unroll, validate
from lightning_pipe.schedules.families.asynchronous import isolated_step, min_chunks

FULL = [(p, m) for p in range(1, 17) for m in range(1, 65)]
CORNERS = [(1, 1), (1, 64), (16, 1), (16, 15), (16, 16), (16, 64), (2, 1), (7, 3)]
SAMPLE = CORNERS + random.Random(20261122).sample(FULL, 6)


def _idle(schedule, *costs: float) -> list[float]:
    sim = simulate(schedule, *costs, rendezvous=False)
    return [sim.makespan - b for b in sim.busy]


def _check_new(name: str, p: int, m: int) -> None:
    """The schedules with a split backward or several stages per rank, against their published
    bubbles (see tests/schedules/families/test_zero_bubble.py for the sources)."""
    if name == "zero_bubble":
        schedule = SCHEDULES[name](p, m)
        validate(schedule)
        if m >= p:  # ZB-H1: (p - 1)(T_F + T_B - T_W) per rank
            assert _idle(schedule, 1.0, 1.0, 1.0) == pytest.approx([p - 1] * p), (p, m)
        return
    try:
        schedule = SCHEDULES[name](p, m)
    except ValueError:
        assert name in ("interleaved_1f1b", "interleaved_zero_bubble") and m % max(1, m // p), (name, p, m)
        return
    validate(schedule, rendezvous=False)
    if name == "interleaved_1f1b" and m >= p:  # Megatron: (p - 1) / (v m) of the ideal time, v = 2
        idle = sum(_idle(schedule, 1.0, 2.0))
        assert idle / (3.0 * 2 * m * p) == pytest.approx((p - 1) / (2 * m)), (p, m)
    if name == "interleaved_zero_bubble" and m >= p:  # ZB-H1's idle on half-size stages, v = 2
        assert _idle(schedule, 1.0, 1.0, 1.0) == pytest.approx([p - 1] * p), (p, m)
    if name == "zbv" and m >= 2 * p:  # the V's ramp: p - 1 half-stage forwards per rank
        assert _idle(schedule, 1.0, 1.0, 1.0) == pytest.approx([p - 1] * p), (p, m)


def _check_chimera(p: int, m: int) -> None:
    """Chimera: even stage counts only; the paper's bubble (D - 2) / (2N + D - 2) with equal forward
    and backward costs for multiples of D (see tests/schedules/families/test_chimera.py)."""
    if p % 2:
        with pytest.raises(ValueError, match="even number"):
            SCHEDULES["chimera"](p, m)
        return
    schedule = SCHEDULES["chimera"](p, m)
    validate(schedule, rendezvous=False)
    if m % p == 0:
        assert simulate(schedule, 1.0, 1.0, rendezvous=False).bubble_fraction == pytest.approx(
            (p - 2) / (2 * m + p - 2)
        )


def _check_dualpipev(p: int, m: int) -> None:
    """DualPipeV: chunks >= 2p, refused below with the smallest valid value; DeepSeek's bubble
    (PP/2 - 1)(F&B + B - 3W), 2 (p - 1) with equal costs and F&B = F + B + W, p - 1 with its
    computes one after another (see tests/schedules/families/test_dualpipe.py)."""
    if m < 2 * p:
        with pytest.raises(ValueError, match=f"Use chunks={2 * p}"):
            SCHEDULES["dualpipev"](p, m)
        return
    schedule = SCHEDULES["dualpipev"](p, m)
    validate(schedule, rendezvous=False)
    assert _idle(schedule, 1.0, 1.0, 1.0) == pytest.approx([p - 1] * p), (p, m)
    if m in (2 * p, 2 * p + 1, 4 * p):  # the table's model, on a part of the grid (the whole grid's time)
        sim = simulate(schedule, 1.0, 1.0, 1.0, rendezvous=False, overlap=1.0)
        assert [sim.makespan - b for b in sim.busy] == pytest.approx([2 * (p - 1)] * p), (p, m)


def _check(name: str, p: int, m: int) -> None:
    if name == "dualpipev":
        _check_dualpipev(p, m)
        return
    if name == "chimera":
        _check_chimera(p, m)
        return
    if name in ("zero_bubble", "interleaved_1f1b", "zbv", "interleaved_zero_bubble"):
        _check_new(name, p, m)
        return
    if is_async(name):
        if m < min_chunks(name, p):  # runs as an isolated step, drained at once
            validate(unroll(isolated_step(p, m), 1))
            return
        unrolled = unroll(SCHEDULES[name](p, m), 2)
        # WPipe's G1 flushes each batch: the unrolled list joins two steps' groups there
        # (tests/schedules/families/test_wpipe.py)
        strict = name != "wpipe"
        validate(unrolled, rendezvous=strict)
        simulate(unrolled, rendezvous=strict)
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

"""The schedule traits table: every schedule is one row that builds, validates and places its stages,
and no module outside ``schedules/`` compares schedule names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lightning_pipe.schedules import (
    ASYNC_SCHEDULES,
    REGROUPED_FOR_RENDEZVOUS,
    SCHEDULES,
    TRAITS,
    VIRTUAL_STAGES,
    build,
    check_virtual_stages,
    is_async,
    stage_positions,
    traits,
    unroll,
    validate,
)

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_pipe"


@pytest.mark.parametrize("name", sorted(TRAITS))
@pytest.mark.parametrize("ranks", [2, 4])
def test_every_row_builds_a_valid_schedule_on_its_own_placement(name: str, ranks: int) -> None:
    t = traits(name)
    v = t.virtual_stages
    if t.asynchronous:  # one steady step, validated as three steps from an empty pipeline and the drain
        validate(unroll(build(name, ranks, 2 * ranks, v), 3), rendezvous=False)
    else:
        validate(build(name, ranks, 2 * ranks, v), rendezvous=False)  # gloo's posting order
        validate(build(name, ranks, 2 * ranks, v, rendezvous=True), rendezvous=True)  # NCCL's, regrouped where needed
    positions = stage_positions(name, ranks, v)
    assert len(positions) == (2 * ranks if t.mirrored else ranks * v)
    assert sorted(set(positions)) == list(range(ranks))
    check_virtual_stages(name, v)  # the default is accepted
    assert is_async(name) == t.asynchronous


def test_the_name_tables_are_derived_from_the_traits() -> None:
    assert set(SCHEDULES) == set(TRAITS)
    assert set(ASYNC_SCHEDULES) == {n for n, t in TRAITS.items() if t.asynchronous}
    assert {n: t.virtual_stages for n, t in TRAITS.items() if t.virtual_stages > 1} == VIRTUAL_STAGES
    assert {n for n, t in TRAITS.items() if t.regroup_for_rendezvous} == REGROUPED_FOR_RENDEZVOUS
    for name, t in TRAITS.items():
        # an asynchronous schedule keeps its forwards' weights one way: stashed, predicted back, or predicted ahead
        ways = [t.stashes_weights, t.predicts_weights, t.predicts_ahead]
        assert sum(ways) == t.asynchronous, name
        assert t.single is None or (t.interleaved and t.single in TRAITS), name


def test_an_unknown_name_is_refused_with_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="Unknown pipeline schedule 'zigzag'. Valid schedules: 1f1b, chimera"):
        traits("zigzag")


NAMES = "|".join(sorted(map(re.escape, TRAITS), key=len, reverse=True))
COMPARISON = re.compile(
    rf"""(==|!=)\s*["']({NAMES})["']|["']({NAMES})["']\s*(==|!=)|\bin\s*[\(\[{{][^\]\)}}]*["']({NAMES})["']"""
)


def test_no_schedule_name_is_compared_outside_schedules() -> None:
    """A schedule's traits are asked of the table; adding a schedule touches ``schedules/`` only."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.name == "schedules":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if COMPARISON.search(line):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert not found, "schedule names compared outside schedules/ (ask lightning_pipe.schedules.traits):\n" + "\n".join(
        found
    )

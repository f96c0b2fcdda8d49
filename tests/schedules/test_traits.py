"""The schedule traits table: every schedule is one row that builds, validates and places its stages,
and no module outside ``schedules/`` compares schedule names."""

from __future__ import annotations

import ast
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
from lightning_pipe.schedules.families.interleaved import valid_microbatches

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
        if path.relative_to(PACKAGE).parts[0] == "schedules":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if COMPARISON.search(line):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert not found, "schedule names compared outside schedules/ (ask lightning_pipe.schedules.traits):\n" + "\n".join(
        found
    )


def _name_collections(tree: ast.Module, module_level_only: bool) -> list[tuple[int, str]]:
    """Each tuple, list or set written in ``tree`` that holds two or more schedule names."""
    nodes = [
        n.value
        for n in tree.body
        if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None and "__all__" not in ast.unparse(n)
    ]
    found = []
    for top in nodes if module_level_only else [tree]:
        for node in ast.walk(top):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                names = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in TRAITS]
                if len(names) >= 2:
                    found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_set_of_schedule_names_is_kept_outside_the_table() -> None:
    """A group of schedules (those that round their micro-batches, those that carry recorded values, the
    asynchronous ones) is a column of the table, asked with ``traits(name).column``: no module outside
    ``schedules/`` writes a collection of schedule names, and none in it keeps one as a constant but
    ``traits.py``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "traits.py" and path.parent.name == "schedules":
            continue
        tree = ast.parse(path.read_text())
        inside = path.relative_to(PACKAGE).parts[0] == "schedules"  # schedules/ and its families/
        for number, text in _name_collections(tree, module_level_only=inside):
            found.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {text}")
    assert found == []
    # the check sees a constant like the interleaved module's former ROUNDED
    former = ast.parse('ROUNDED = frozenset({"interleaved_1f1b", "interleaved_zero_bubble"})')
    assert _name_collections(former, module_level_only=True) == [(1, "{'interleaved_1f1b', 'interleaved_zero_bubble'}")]


def test_the_rounding_and_carrying_columns() -> None:
    """``rounds``: the schedules that refuse a micro-batch count that does not fill their rounds, which the
    pipeline lowers to one that does; ``records_cross``: every built-in schedule."""
    for name, t in TRAITS.items():
        assert t.records_cross, name  # every built-in schedule: a schedule text's traits leave it off
        if t.rounds:
            with pytest.raises(ValueError, match="cannot be split into rounds"):
                t.make(2, 5, 2)  # 5 micro-batches do not make equal rounds on 2 processes
            assert valid_microbatches(2, 5) == 4
            t.make(2, valid_microbatches(2, 5), 2)
    assert {n for n, t in TRAITS.items() if t.rounds} == {"interleaved_1f1b", "interleaved_zero_bubble"}

"""The conformance matrix: every schedule x lifecycle event x layout x model, each cell against its
oracle (see ``tests/conformance/runner.py``). The default run checks a fixed set that covers every
pair of axis values, each asynchronous rule against its reference and each refusal; ``--runslow`` runs
every cell; ``LIGHTNING_PIPE_MATRIX_SEED=<seed>`` builds another cover and ``LIGHTNING_PIPE_MATRIX_CELLS=<id>,...``
runs the named cells (ids as ``schedule/event/layout/model``, as the test ids show them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conformance.axes import (
    CELL_VARIABLE,
    FIXED_SEED,
    SEED_VARIABLE,
    Cell,
    all_cells,
    by_id,
    default_seed,
    open_defect,
    selected,
)
from tests.conformance.runner import run_cell

pytestmark = pytest.mark.timeout(600)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "cell" in metafunc.fixturenames:
        _seed, cells = selected(full=metafunc.config.getoption("--runslow"))
        marked = [
            pytest.param(c, marks=pytest.mark.xfail(reason=why, strict=True)) if (why := open_defect(c)) else c
            for c in cells
        ]
        metafunc.parametrize("cell", marked, ids=[c.id for c in cells])


def test_cell(cell: Cell, tmp_path: Path) -> None:
    if cell.model.records:
        pytest.importorskip("transformers")
    outcome = run_cell(cell, tmp_path)
    print(outcome)
    replay = f"replay: {CELL_VARIABLE}={cell.id} python -m pytest tests/conformance/test_matrix.py"
    if default_seed() != FIXED_SEED:
        replay += f" (this run's cover: {SEED_VARIABLE}={default_seed()})"
    assert outcome.status in ("pass", "refused"), f"{outcome}\n{replay}"


def test_the_axes_make_every_cell_and_the_sample_covers_every_value() -> None:
    from tests.conformance.axes import AXES, KNOWN, refusal, sample

    cells = all_cells()
    assert {c.id for c in by_id(KNOWN)} <= {c.id for c in cells}
    for seed in (0, 1, 2):
        chosen = sample(seed)
        running = [c for c in chosen if refusal(c) is None]
        for axis, values in AXES.items():
            names = {v if isinstance(v, str) else v.name for v in values}
            assert {getattr(c, axis) if axis == "schedule" else getattr(c, axis).name for c in running} == names, axis
    assert sample(3) == sample(3) and sample(3) != sample(4)


def test_the_default_set_is_fixed_and_covers_every_pair_every_reference_and_every_refusal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same cells whatever the date (the clock is moved a year on), every pair of values that a running
    cell has, each asynchronous rule once on the model its one-process reference takes, each refusal sentence."""
    import time

    from tests.conformance.axes import COVERED_BY_OTHERS, MODE_VARIABLE, _pairs, cover_pool, references, refusal

    for variable in (SEED_VARIABLE, CELL_VARIABLE, MODE_VARIABLE):
        monkeypatch.delenv(variable, raising=False)
    _, today = selected(full=False)
    monkeypatch.setattr(time, "time", lambda: 4e9)
    _, later = selected(full=False)
    assert [c.id for c in today] == [c.id for c in later]
    running = [c for c in today if refusal(c) is None]
    wanted = set().union(*(_pairs(c) for c in cover_pool() if refusal(c) is None))
    assert wanted - set().union(*(_pairs(c) for c in running)) == set()
    from lightning_pipe.schedules.traits import TRAITS

    async_rules = {s for s, t in TRAITS.items() if t.asynchronous}
    assert {c.schedule for c in references()} == async_rules and {c.id for c in references()} <= {c.id for c in today}
    assert {layout for layout in COVERED_BY_OTHERS} <= {c.layout.name for c in all_cells()}  # in the full matrix
    sentences = {s for c in all_cells() for s in (refusal(c) or "").split("|") if s}
    assert sentences == {s for c in today for s in (refusal(c) or "").split("|") if s}

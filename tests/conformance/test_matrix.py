"""The conformance matrix: every schedule x lifecycle event x layout x model, each cell against its
oracle (see ``tests/conformance/runner.py``). The default run checks a sample that covers every
value of every axis, rotating daily by a seed printed in the header; ``--runslow`` runs every cell;
``LIGHTNING_PIPE_MATRIX_SEED=<seed>`` replays a sample and ``LIGHTNING_PIPE_MATRIX_CELLS=<id>,...``
runs the named cells (ids as ``schedule/event/layout/model``, as the test ids show them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conformance.axes import (
    CELL_VARIABLE,
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
    replay = (
        f"replay: {CELL_VARIABLE}={cell.id} python -m pytest tests/conformance/test_matrix.py "
        f"(this run's sample: {SEED_VARIABLE}={default_seed()})"
    )
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

"""Where a rank's step goes: the executor's parts from its timeline, the rest from Lightning's hooks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_pipe.observe import StepProfile
from lightning_pipe.observe.step_profile import CPU, PARTS, markdown, means
from tests.models import LifecycleNet, TinyNet, loader
from tests.pipeline import fit_pipeline


def test_means_skip_the_warm_up_and_the_first_step_and_add_up() -> None:
    first = {part: 1.0 for part in PARTS if part != "between"}  # the first step: no between, no total
    rows = [first] + [{**{part: float(k) for part in PARTS}, "total": 9.0 * k} for k in (1, 2, 3)]
    assert means(rows) == {**{part: 2.0 for part in PARTS}, "total": 18.0}
    assert means(rows, skip=2) == {**{part: 2.5 for part in PARTS}, "total": 22.5}
    assert means([first]) == {}
    table = markdown([means(rows), means(rows, skip=3)])
    assert "| compute | 2000.0 ms (11%) | 3000.0 ms (11%) |" in table
    assert table.splitlines()[-1] == "| total | 18000.0 ms | 27000.0 ms |"
    assert markdown([means(rows)], ranks=[3]).splitlines()[0] == "| part | rank 3 |"


def test_cpu_times_are_averaged_beside_the_parts_where_every_step_has_them() -> None:
    rows = [
        {**{part: 1.0 for part in PARTS}, "total": 9.0, "main_thread_cpu": 0.5 * k, "other_threads_cpu": 0.1 * k}
        for k in (1, 3)
    ]
    m = means(rows)
    assert m["main_thread_cpu"] == 1.0 and m["other_threads_cpu"] == pytest.approx(0.2) and m["total"] == 9.0
    assert "| other_threads_cpu | 200.0 ms |" in markdown([m])
    del rows[0]["other_threads_cpu"]
    assert "other_threads_cpu" not in means(rows) and "main_thread_cpu" in means(rows)


@pytest.mark.parametrize("schedule", ["1f1b", "pipedream"])
def test_every_rank_profiles_every_step(tmp_path: Path, schedule: str) -> None:
    fit_pipeline(TinyNet(), 2, schedule=schedule, chunks=4, callbacks=[StepProfile(str(tmp_path))], max_steps=5)
    for rank in range(2):
        rows = json.loads((tmp_path / f"step_profile_rank{rank}.json").read_text())
        assert len(rows) == 5 and "total" not in rows[0] and all("total" in row for row in rows[1:])
        for row in rows:
            assert row["compute"] > 0.0 and row["optimizer"] > 0.0 and row["hand_over"] > 0.0
            assert not [p for p in PARTS if row.get(p, 0.0) <= -1e-4], row  # no part runs backwards
        for row in rows[1:]:
            assert sum(row[part] for part in PARTS) == pytest.approx(row["total"], rel=1e-6)
            # the training loop's thread computed during the step; the process's other threads
            # (gloo's) used CPU time of their own, none of it counted twice
            assert row["main_thread_cpu"] > 0.0 and row["other_threads_cpu"] >= 0.0
            assert set(CPU) <= set(row)
            # the executor's parts lie within the step: it cannot take longer than the whole step
            assert row["compute"] + row["wait"] + row["post"] + row["executor_other"] < row["total"]


def test_a_validation_between_steps_counts_as_between(tmp_path: Path) -> None:
    """The executor also runs for validation batches: those runs are not taken for the next
    training step's (its work before the executor would come out negative)."""
    fit_pipeline(LifecycleNet(), 2, loader(), loader(24), callbacks=[StepProfile(str(tmp_path))], chunks=2,
                 max_steps=5, val_check_interval=2, limit_val_batches=2)  # fmt: skip
    for rank in range(2):
        rows = json.loads((tmp_path / f"step_profile_rank{rank}.json").read_text())
        assert len(rows) == 5
        assert min(row["before_executor"] for row in rows) >= 0.0

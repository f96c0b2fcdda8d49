"""Timeline pictures: one row per rank and every action of the schedule, predicted and measured."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from lightning_pipe.plan import TimelinePicture, simulated_bars, timeline_svg
from lightning_pipe.schedules import gpipe, one_f_one_b, simulate
from lightning_pipe.schedules.actions import Schedule
from tests.models import TinyNet, loader
from tests.pipeline import fit_pipeline

SVG = "{http://www.w3.org/2000/svg}"


def _panels(svg: str) -> dict[str, list[dict[str, str]]]:
    root = ET.fromstring(svg)
    return {g.get("data-title", ""): [r.attrib for r in g.iter(f"{SVG}rect") if "data-kind" in r.attrib] for g in root.iter(f"{SVG}g")}


def _rows(svg: str, panel: dict[str, str]) -> set[str]:
    root = ET.fromstring(svg)
    return {t.text or "" for g in root.iter(f"{SVG}g") if g.get("data-title") == panel for t in g.iter(f"{SVG}text") if t.get("class") == "rank"}


def _assert_every_action(bars: list[dict[str, str]], schedule: Schedule) -> None:
    assert {int(b["data-rank"]) for b in bars} == set(range(schedule.num_ranks))
    for rank in range(schedule.num_ranks):
        drawn = sorted((b["data-kind"], int(b["data-microbatch"])) for b in bars if b["data-rank"] == str(rank) and b["data-kind"] in "FB")
        expected = sorted((a.kind.value, a.microbatch) for a in schedule.compute(rank))
        assert drawn == expected, rank


def test_predicted_timeline_shows_each_rank_and_action() -> None:
    for schedule in (one_f_one_b(3, 5), gpipe(4, 2)):
        svg = timeline_svg([("predicted", simulated_bars(simulate(schedule)))], unit="forward times")
        (bars,) = _panels(svg).values()
        _assert_every_action(bars, schedule)
        assert _rows(svg, "predicted") == {f"rank {r}" for r in range(schedule.num_ranks)}
        waits = {b["data-rank"] for b in bars if b["data-kind"] == "wait"}
        assert str(schedule.num_ranks - 1) in waits  # the last rank waits for the pipeline to fill


def test_measured_timeline_of_a_run(tmp_path: Path) -> None:
    path = tmp_path / "run.svg"
    fit_pipeline(TinyNet(), 2, chunks=3, max_steps=3, callbacks=[TimelinePicture(path)])
    svg = path.read_text()
    panels = _panels(svg)
    predicted = next(t for t in panels if "predicted" in t)
    measured = next(t for t in panels if "measured" in t)
    for title in (predicted, measured):
        assert _rows(svg, title) == {"rank 0", "rank 1"}
        _assert_every_action(panels[title], one_f_one_b(2, 3))
    assert any(b["data-kind"] == "wait" and b["data-rank"] == "1" for b in panels[measured])  # rank 1 waits for rank 0

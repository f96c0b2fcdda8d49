"""Timeline pictures: one row per rank and every action of the schedule, predicted and measured."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from lightning_pipe.observe import TimelinePicture, simulated_bars, timeline_svg
from lightning_pipe.schedules import build, gpipe, one_f_one_b, simulate
from lightning_pipe.schedules.actions import Schedule
from lightning_pipe.schedules.timeline_svg import Bar, nice_ticks
from tests.models import LifecycleNet, TinyNet, loader
from tests.pipeline import fit_pipeline

SVG = "{http://www.w3.org/2000/svg}"


def _panels(svg: str) -> dict[str, list[dict[str, str]]]:
    root = ET.fromstring(svg)
    return {
        g.get("data-title", ""): [r.attrib for r in g.iter(f"{SVG}rect") if "data-kind" in r.attrib]
        for g in root.iter(f"{SVG}g")
    }


def _rows(svg: str, panel: dict[str, str]) -> set[str]:
    root = ET.fromstring(svg)
    return {
        t.text or ""
        for g in root.iter(f"{SVG}g")
        if g.get("data-title") == panel
        for t in g.iter(f"{SVG}text")
        if t.get("class") == "rank"
    }


def _assert_every_action(bars: list[dict[str, str]], schedule: Schedule) -> None:
    assert {int(b["data-rank"]) for b in bars} == set(range(schedule.num_ranks))
    for rank in range(schedule.num_ranks):
        drawn = sorted(
            (b["data-kind"], int(b["data-stage"]), int(b["data-microbatch"]))
            for b in bars
            if b["data-rank"] == str(rank) and b["data-kind"] in "FBW"
        )
        expected = sorted((a.kind.value, a.stage, a.microbatch) for a in schedule.compute(rank))
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


def test_ticks_are_round_numbers() -> None:
    """1, 2 or 5 times a power of ten apart, from 0 to at most the span, at most ``most`` of them."""
    assert nice_ticks(2.03) == [0.0, 0.5, 1.0, 1.5, 2.0]  # fifths of the span would read 0, 0.406, 0.812
    assert nice_ticks(1.0) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(0.3) == [0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3]
    assert nice_ticks(12.18) == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0]
    assert nice_ticks(99.9, most=6) == [0.0, 20.0, 40.0, 60.0, 80.0]
    assert nice_ticks(7.0) == [float(t) for t in range(8)]
    assert nice_ticks(0.0) == [0.0] and nice_ticks(float("inf")) == [0.0]
    with pytest.raises(ValueError, match="at least 2"):
        nice_ticks(1.0, most=1)
    svg = timeline_svg([("one step", [Bar(0, "F", 0, 0, 0.0, 0.0124)])], unit="s")  # 12.4 ms: labelled in ms
    (panel,) = [g for g in ET.fromstring(svg).iter(f"{SVG}g") if g.get("class") == "panel"]
    labels = [t.text for t in panel.iter(f"{SVG}text") if t.get("class") == "axis"]
    assert labels == ["0", "2", "4", "6", "8", "10", "12", "ms"]


@pytest.mark.parametrize("schedule", ["zero_bubble", "zbv", "dualpipev"])
def test_split_backward_schedules_get_their_predicted_timeline(tmp_path: Path, schedule: str) -> None:
    """The schedules that split the backward into B and W (and ZB-V, two stages per process) are
    predicted from each stage's measured F, B and W times; the measured panel is the last training
    step even where validation ran after it (its forwards are recorded too)."""
    path = tmp_path / "run.svg"
    fit_pipeline(
        LifecycleNet(), 2, data=loader(48, 12), val_data=loader(24, 12), schedule=schedule, chunks=4, max_steps=-1,
        max_epochs=1, callbacks=[TimelinePicture(path)],
    )  # fmt: skip
    svg = path.read_text()
    panels = _panels(svg)
    predicted = next(t for t in panels if "predicted" in t)
    measured = next(t for t in panels if "measured" in t)
    assert "forward, backward (B) and weight-gradient (W) times" in predicted
    ran = build(schedule, 2, 4, 2 if schedule in ("zbv", "dualpipev") else 1)
    for title in (predicted, measured):
        assert _rows(svg, title) == {"rank 0", "rank 1"}
        _assert_every_action(panels[title], ran)  # the training step's F, B and W, in both panels

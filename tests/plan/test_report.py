"""What ``lightning-pipe plan`` prints and writes: the link, the table once, the chosen layout and the
overrides that run it (accepted by the command line), and predicted timelines that fit their picture."""

from __future__ import annotations

import functools
import itertools
import shlex
import xml.etree.ElementTree as ET
from dataclasses import replace

from lightning_pipe.partition.solvers.costs import LayerCost, Profile
from lightning_pipe.plan.planner import Candidate, Link, needed_sizes, plan_layouts
from lightning_pipe.plan.report import overrides, plan_text, predicted_timelines
from lightning_pipe.schedules.timeline_svg import _LEFT, _TITLE_CHAR
from tests.plan.test_planner import FREE

SVG = "{http://www.w3.org/2000/svg}"
LINK = Link(latency=85.8e-6, bandwidth=3.377e9)
# every schedule the planner proposes, 2 to 3 stages per process, every balance mode: 4 processes, a batch of 8
SCHEDULES = ("1f1b", "gpipe", "zero_bubble", "interleaved_1f1b", "interleaved_zero_bubble", "zbv")


def _profile(size: int) -> Profile:
    """Twelve layers whose time, parameters and activations differ, so that every balance mode splits
    them its own way."""
    layers = tuple(
        LayerCost(
            forward=1e-3 * size * (1 + i % 4),
            backward=2e-3 * size * (1 + i % 4),
            parameter_bytes=1000 * (12 - i),
            gradient_bytes=1000 * (12 - i),
            optimizer_bytes=0,
            activation_bytes=10**5 * size * (1 + i % 3),
            input_bytes=size,
            output_bytes=size,
            input_backward=1e-3 * size * (1 + i % 4),
            weight_backward=1e-3 * size * (1 + i % 4),
        )
        for i in range(12)
    )
    return Profile(layers, size, "cpu", 3)


@functools.lru_cache(maxsize=1)
def _ranked() -> list[Candidate]:
    profiles = {size: _profile(size) for size in needed_sizes(4, 8)}
    return plan_layouts(
        profiles, 4, 8, LINK, schedules=SCHEDULES, virtual=(2, 3), checkpoints=("never", "always"), rendezvous=False
    )


def _compose(extra: list[str]) -> object:
    from hydra import compose, initialize_config_dir

    from lightning_pipe.cli import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=["recipe=vgg19_cifar100", "trainer.devices=4", *extra])


def test_the_printed_overrides_run_the_candidate() -> None:
    """For one candidate of each schedule, balance mode and layout: the overrides, as a shell splits
    them, compose with the command line's configuration into the strategy that runs it."""
    from lightning_pipe.cli import build_strategy

    chosen: list[Candidate] = []
    seen: set[tuple[str, object]] = set()
    for c in _ranked():  # a few candidates that between them show every value of each key
        features = {("schedule", c.schedule), ("balance", c.balance_mode), ("layout", (c.depth, c.replicas)),
                    ("virtual", c.virtual_stages), ("recompute", c.recompute)}  # fmt: skip
        if not features <= seen:
            chosen.append(c)
            seen |= features
    assert {v for k, v in seen if k == "schedule"} == set(SCHEDULES)
    assert {v for k, v in seen if k == "balance"} == {"uniform", "parameters", "time", "memory"}
    assert {v for k, v in seen if k == "layout"} == {(4, 1), (2, 2), (1, 4)} and {
        v for k, v in seen if k == "virtual"
    } == {1, 2, 3}
    for c in chosen:
        line = " ".join(shlex.quote(o) for o in overrides(c, 4, 1))  # as printed: configured 4 stages x 1 replica
        cfg = _compose(shlex.split(line))
        strategy, devices = build_strategy(cfg.strategy, cfg.trainer.devices)
        got = (strategy.schedule_name, strategy.chunks, strategy.recompute, strategy.virtual_stages)
        assert got == (c.schedule, c.chunks, c.recompute, c.virtual_stages), line
        if c.balance_mode in ("uniform", "parameters"):
            assert strategy.balance == c.balance_mode, line
        else:  # a measured split is given as its layer counts: a new run would measure again
            assert list(strategy.balance) == list(c.balance), line
        if (c.depth, c.replicas) == (4, 1):
            assert strategy.stages is None and cfg.recipe.data.batch_size == 64, line  # as configured
        else:
            assert strategy.stages == c.depth and cfg.recipe.data.batch_size == c.replica_batch == 8 // c.replicas, line
        assert devices == 4


def test_plan_text_has_the_link_the_table_once_and_the_choice() -> None:
    ranked = _ranked()
    text = plan_text(ranked, 4, 1)
    lines = text.splitlines()
    assert lines[0] == "measured link between ranks 0 and 1: latency 85.8 us, bandwidth 3377 MB/s"
    assert lines[1].startswith("rank speeds: none")  # the ranked layouts here were planned without speeds
    assert lines[2] == f"{len(ranked)} layouts ranked by predicted step time; the best 5 distinct ones:"
    assert [line.split()[:3] for line in lines].count(["#", "schedule", "chunks"]) == 1 and len(lines) == 4 + 5 + 3
    best = ranked[0]
    assert lines[9].startswith("best: #1, ") and f"{1e3 * best.step_seconds:.2f} ms per step predicted" in lines[9]
    assert lines[10] == "run it with: " + " ".join(shlex.quote(o) for o in overrides(best, 4, 1))
    assert lines[11].startswith("activations per stage (predicted peak MiB of saved tensors): stage 0 ")
    assert "link between ranks 0 and 1: none measured (one process)" in plan_text([replace(best, link=FREE)], 4, 1)
    speeds = plan_text([replace(best, rank_speeds=(1.0, 0.5, 1.0, 1.0))], 4, 1).splitlines()[1]
    assert speeds.startswith("rank speeds relative to rank 0: rank 0 1.00, rank 1 0.50, rank 2 1.00, rank 3 1.00")
    busy = plan_text([replace(best, link=Link(latency=2e-3, bandwidth=float("inf")))], 4, 1).splitlines()[0]
    assert busy == (
        "measured link between ranks 0 and 1: latency 2000.0 us, bandwidth not resolved (an activation-sized message "
        "took no longer than a 4-byte one)"
    )


def test_predicted_timeline_titles_fit_the_picture_and_ticks_are_round() -> None:
    """The best candidates' titles (long schedule names, balances of many stages) wrap inside the
    picture's width; the time axis is in milliseconds at round steps."""
    ranked = sorted(_ranked(), key=lambda c: -len(c.balance))[:3]  # the longest titles
    svg = predicted_timelines(ranked, 4)
    root = ET.fromstring(svg)
    width = float(root.get("width", "0"))
    panels = [g for g in root.iter(f"{SVG}g") if g.get("class") == "panel"]
    assert len(panels) == 3
    for panel in panels:
        (title,) = [t for t in panel.iter(f"{SVG}text") if t.get("class") == "title"]
        lines = [span.text or "" for span in title.iter(f"{SVG}tspan")]
        assert " ".join(lines) == panel.get("data-title") and len(lines) >= 2  # wrapped, nothing lost
        assert all(_LEFT + len(line) * _TITLE_CHAR <= width for line in lines), lines
        labels = [t.text for t in panel.iter(f"{SVG}text") if t.get("class") == "axis"]
        assert labels[-1] == "ms"
        ticks = [float(v) for v in labels[:-1]]
        step = ticks[1] - ticks[0]
        assert ticks[0] == 0 and all(abs(b - a - step) < 1e-9 for a, b in itertools.pairwise(ticks))
        assert any(abs(step - m * 10**e) < 1e-9 for m in (1, 2, 5) for e in range(-3, 4)), ticks


def test_rows_that_differ_only_in_a_balance_that_changes_nothing_are_shown_once() -> None:
    """Chimera on 2 processes: every process holds both stages, so its balances predict the same step."""
    from lightning_pipe.plan.report import distinct

    best = replace(_ranked()[0], schedule="chimera", balance_mode="uniform", balance=(2, 2))
    twins = [
        best,
        replace(best, balance_mode="parameters", balance=(1, 3)),
        replace(best, balance=(3, 1), chunks=best.chunks * 2),
    ]
    assert distinct(twins) == [twins[0], twins[2]]
    text = plan_text(twins, 2, 1)
    rows = [line for line in text.splitlines() if line.split()[1:2] == ["chimera"]]
    assert len(rows) == 2 and "the best 2 distinct ones:" in text

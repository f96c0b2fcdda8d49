"""Timelines of a pipeline step as SVG pictures: one row per rank, one bar per action.

Pure: bars in, SVG text out. Bars come from a schedule's simulation (:func:`simulated_bars`, the
predicted timeline, in units of the forward time or in seconds) or from the spans the executor's
:class:`~lightning_pipe.runtime.timings.Timeline` recorded on each rank (:func:`measured_bars`).
Forwards, backwards (and weight-gradient backwards ``W``, for schedules that split them) have
their own colours; time a rank spends waiting for communication is drawn as a hatched red bar, so
the bubble is visible where it is.

Every bar is an SVG ``rect`` carrying ``data-rank``, ``data-kind``, ``data-stage`` and
``data-microbatch``, with a tooltip; so a picture can also be checked by a program.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from html import escape
from typing import Any

from lightning_pipe.schedules.simulate import Simulation

COLOURS = {"F": "#4c78a8", "B": "#59a14f", "W": "#f28e2b", "post": "#bab0ac", "wait": "url(#waiting)"}
KIND_NAMES = {
    "F": "forward",
    "B": "backward",
    "W": "weight gradient",
    "post": "posting communication",
    "wait": "waiting for communication",
}


@dataclass(frozen=True)
class Bar:
    """One action of one rank: ``kind`` is ``F``, ``B``, ``W``, ``post`` or ``wait``."""

    rank: int
    kind: str
    stage: int
    microbatch: int
    start: float
    end: float


def simulated_bars(simulation: Simulation, scale: float = 1.0) -> list[Bar]:
    """The simulation's compute actions, and the idle time before each as a ``wait`` bar (what a
    rank spends waiting for its peers). ``scale`` converts the simulation's units (for example to
    seconds, when its costs were forward seconds)."""
    schedule = simulation.schedule
    bars: list[Bar] = []
    for rank in range(schedule.num_ranks):
        clock = 0.0
        for action in schedule.compute(rank):
            start = simulation.start_times[(rank, action)]
            cost = simulation.cost(action)
            if start > clock + 1e-12:
                bars.append(Bar(rank, "wait", action.stage, action.microbatch, clock * scale, start * scale))
            bars.append(
                Bar(rank, action.kind.value, action.stage, action.microbatch, start * scale, (start + cost) * scale)
            )
            clock = start + cost
    return bars


def measured_bars(spans_by_rank: Mapping[int, Iterable[Any]], offsets: Mapping[int, float] | None = None) -> list[Bar]:
    """Bars from each rank's recorded spans of one step (objects with ``name``, ``stage``,
    ``microbatch``, ``start``, ``end``), shifted by that rank's ``offsets`` (seconds between the
    rank's step start and the earliest rank's), so the rows share one clock."""
    offsets = offsets or {}
    bars: list[Bar] = []
    for rank, spans in spans_by_rank.items():
        shift = offsets.get(rank, 0.0)
        for span in spans:
            name = span.name
            if name not in COLOURS:
                continue  # the whole step's span
            bars.append(Bar(rank, name, span.stage, span.microbatch, span.start + shift, span.end + shift))
    return bars


_ROW, _GAP, _LEFT, _RIGHT, _TITLE, _AXIS = 28, 6, 64, 16, 26, 26
_TITLE_LINE = 16  # each further line of a wrapped title
# a bold 13 px sans-serif character is at most this wide on average (DejaVu Sans Bold's digits are
# 9.05 px, its letters less): titles wrap to stay inside the picture whatever font draws them
_TITLE_CHAR = 0.7 * 13


def nice_ticks(span: float, most: int = 8) -> list[float]:
    """Tick values from 0 up to ``span``, ``most`` at most, a round step apart: 1, 2 or 5 times a
    power of ten (0, 0.2, 0.4, ... rather than fifths of the span, which read 0, 0.406, 0.813)."""
    if most < 2:
        raise ValueError(f"nice_ticks(most={most}): give at least 2 ticks")
    if not math.isfinite(span) or span <= 0:
        return [0.0]
    least = span / (most - 1)  # the smallest step that keeps the ticks within ``most``
    exponent = math.floor(math.log10(least))
    step = next(m * 10.0**exponent for m in (1, 2, 5, 10) if m * 10.0**exponent >= least * (1 - 1e-9))
    digits = max(0, 1 - exponent)  # enough to hold a step of 5 x 10^exponent exactly
    return [round(i * step, digits) for i in range(math.floor(span / step * (1 + 1e-9)) + 1)]


def _display_unit(span: float, unit: str) -> tuple[float, str]:
    """Seconds are shown in the unit that suits the span (a 12 ms step in ms, not 0.012 s)."""
    if unit != "s":
        return 1.0, unit
    if span >= 1.0 or span <= 0:
        return 1.0, "s"
    return (1e3, "ms") if span >= 1e-3 else (1e6, "\u00b5s")


def title_lines(title: str, width: float) -> list[str]:
    """``title`` wrapped at spaces into lines that fit a picture ``width`` pixels wide."""
    chars = max(10, int((width - _LEFT - _RIGHT) / _TITLE_CHAR))
    return textwrap.wrap(title, chars) or [""]


def _panel(title: str, bars: Sequence[Bar], unit: str, top: float, width: float, span: float, ranks: int) -> list[str]:
    plot = width - _LEFT - _RIGHT
    x = lambda t: _LEFT + plot * (t / span if span > 0 else 0.0)  # noqa: E731
    scale, shown = _display_unit(span, unit)
    lines = title_lines(title, width)
    out = [f'<g class="panel" data-title="{escape(title)}">', f'<text x="{_LEFT}" y="{top + 17}" class="title">']
    out += [
        f'<tspan x="{_LEFT}" dy="{0 if i == 0 else _TITLE_LINE}">{escape(line)}</tspan>' for i, line in enumerate(lines)
    ]
    out.append("</text>")
    y0 = top + _TITLE + _TITLE_LINE * (len(lines) - 1)
    for rank in range(ranks):
        y = y0 + rank * (_ROW + _GAP)
        out.append(f'<text x="{_LEFT - 8}" y="{y + _ROW / 2 + 4}" class="rank" text-anchor="end">rank {rank}</text>')
        out.append(f'<rect x="{_LEFT}" y="{y}" width="{plot:.2f}" height="{_ROW}" class="row"/>')
    for bar in sorted(bars, key=lambda b: (b.kind not in ("wait", "post"), b.start)):
        y = y0 + bar.rank * (_ROW + _GAP)
        left, right = x(bar.start), x(bar.end)
        label = bar.kind if bar.kind in ("F", "B", "W") else ""
        tip = f"rank {bar.rank}, stage {bar.stage}: {KIND_NAMES[bar.kind]}"
        if bar.microbatch >= 0:
            tip += f" of micro-batch {bar.microbatch}"
        tip += f", {bar.start * scale:.4g}-{bar.end * scale:.4g} {shown}"
        out.append(
            f'<rect x="{left:.2f}" y="{y + 1}" width="{max(right - left, 0.5):.2f}" height="{_ROW - 2}" '
            f'fill="{COLOURS[bar.kind]}" class="bar" data-rank="{bar.rank}" data-kind="{bar.kind}" '
            f'data-stage="{bar.stage}" data-microbatch="{bar.microbatch}"><title>{escape(tip)}</title></rect>'
        )
        if label and right - left >= 14:
            out.append(
                f'<text x="{(left + right) / 2:.2f}" y="{y + _ROW / 2 + 4}" class="label" '
                f'text-anchor="middle">{label}{bar.microbatch}</text>'
            )
    axis_y = y0 + ranks * (_ROW + _GAP)
    for tick in nice_ticks(span * scale):
        at = x(tick / scale)
        out.append(f'<line x1="{at:.2f}" y1="{axis_y - _GAP}" x2="{at:.2f}" y2="{axis_y}" class="tick"/>')
        out.append(f'<text x="{at:.2f}" y="{axis_y + 12}" class="axis" text-anchor="middle">{tick:g}</text>')
    out.append(f'<text x="{_LEFT + plot:.2f}" y="{axis_y + 24}" class="axis" text-anchor="end">{escape(shown)}</text>')
    out.append("</g>")
    return out


def timeline_svg(panels: Sequence[tuple[str, Sequence[Bar]]], unit: str = "s", width: float = 960.0) -> str:
    """An SVG picture of one or more timelines (for example the predicted one above the measured
    one), each with its own title and one row per rank, on a shared time axis in ``unit``."""
    if not panels:
        raise ValueError("timeline_svg needs at least one panel of bars")
    span = max((b.end for _, bars in panels for b in bars), default=0.0)
    heights, body = [], []
    top = 4.0
    for title, bars in panels:
        ranks = 1 + max((b.rank for b in bars), default=0)
        body += _panel(title, bars, unit, top, width, span, ranks)
        height = _TITLE + _TITLE_LINE * (len(title_lines(title, width)) - 1) + ranks * (_ROW + _GAP) + _AXIS + 8
        heights.append(height)
        top += height
    legend_y = top + 4
    legend = []
    present = {b.kind for _, bars in panels for b in bars} | {"F", "B", "wait"}
    for i, kind in enumerate(k for k in ("F", "B", "W", "post", "wait") if k in present):
        lx = _LEFT + i * 170
        legend.append(f'<rect x="{lx}" y="{legend_y}" width="14" height="14" fill="{COLOURS[kind]}" class="key"/>')
        legend.append(f'<text x="{lx + 20}" y="{legend_y + 11}" class="axis">{KIND_NAMES[kind]}</text>')
    total = legend_y + 24
    style = (
        "text{font-family:sans-serif;font-size:11px;fill:#222}.title{font-size:13px;font-weight:bold}"
        ".row{fill:#f4f4f4}.bar{stroke:#fff;stroke-width:0.5}.label{fill:#fff;font-size:10px}"
        ".tick{stroke:#888}.key{stroke:#888;stroke-width:0.5}"
    )
    defs = (
        '<defs><pattern id="waiting" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
        '<rect width="6" height="6" fill="#fbe3e4"/><line x1="0" y1="0" x2="0" y2="6" stroke="#e15759" '
        'stroke-width="2"/>'
        "</pattern></defs>"
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{total:.0f}" '
        f'viewBox="0 0 {width:.0f} {total:.0f}"><style>{style}</style>{defs}' + "".join(body + legend) + "</svg>\n"
    )

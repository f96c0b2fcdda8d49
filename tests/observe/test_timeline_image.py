"""The raster timeline: bars where the SVG draws them, in the SVG's colours, one band per panel."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe.observe import Bar, simulated_bars, timeline_image
from lightning_pipe.observe.timeline_image import FILLS
from lightning_pipe.schedules import one_f_one_b, simulate

_ROW, _GAP, _MARGIN, _TOP, _AXIS = 28, 6, 8, 8, 10  # the layout the module draws


def _pixel(image: torch.Tensor, y: int, x: int) -> tuple[int, ...]:
    return tuple(int(v) for v in image[y, x])


def test_bars_land_in_their_rank_row_and_time() -> None:
    bars = [
        Bar(0, "F", 0, 0, 0.0, 1.0),
        Bar(1, "wait", 1, 0, 0.0, 1.0),
        Bar(1, "F", 1, 0, 1.0, 2.0),
        Bar(0, "B", 0, 0, 2.0, 4.0),
    ]
    image = timeline_image([("one", bars)], width=416)  # 400 px of plot: 100 px per time unit
    assert image.dtype == torch.uint8 and image.shape == (_TOP + 2 * (_ROW + _GAP) + _AXIS + 1, 416, 3)
    row0, row1 = _TOP + _ROW // 2, _TOP + _ROW + _GAP + _ROW // 2
    assert _pixel(image, row0, _MARGIN + 50) == FILLS["F"]  # rank 0, time 0.5
    assert _pixel(image, row0, _MARGIN + 300) == FILLS["B"]  # rank 0, time 3
    assert _pixel(image, row1, _MARGIN + 150) == FILLS["F"]  # rank 1, time 1.5
    assert _pixel(image, row1, _MARGIN + 300) == (244, 244, 244)  # rank 1 is done by then: the empty row
    hatch = {_pixel(image, row1, _MARGIN + x) for x in range(10, 20)}
    assert hatch == {(225, 87, 89), (251, 227, 228)}  # waiting: red stripes on pink


def test_panels_stack_on_one_time_axis() -> None:
    simulation = simulate(one_f_one_b(2, 3))
    predicted = simulated_bars(simulation)
    measured = [Bar(b.rank, b.kind, b.stage, b.microbatch, b.start / 2, b.end / 2) for b in predicted]  # twice as fast
    image = timeline_image([("predicted", predicted), ("measured", measured)], width=960)
    panel = _TOP + 2 * (_ROW + _GAP) + _AXIS
    assert image.shape == (2 * panel + 1, 960, 3)
    assert _pixel(image, panel, 500) == (64, 64, 64)  # the line between the panels
    right = _MARGIN + int((960 - 2 * _MARGIN) * 0.75)  # three quarters of the time axis
    y = lambda panel_index, rank: panel_index * panel + _TOP + rank * (_ROW + _GAP) + _ROW // 2  # noqa: E731
    assert _pixel(image, y(0, 0), right) != (244, 244, 244)  # predicted: still running at 3/4 of its time
    assert _pixel(image, y(1, 0), right) == (244, 244, 244)  # measured: finished at half of it


def test_no_panels_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one panel"):
        timeline_image([])

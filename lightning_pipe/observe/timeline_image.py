"""Timelines of a pipeline step as a raster image, for loggers that take images (TensorBoard).

Pure: bars in, an RGB ``uint8`` tensor of shape (height, width, 3) out, drawn with tensor slicing
(no plotting library). The same layout and colours as :func:`~lightning_pipe.schedules.timeline_svg`'s
picture, without its text: panels from top to bottom (the predicted timeline above the measured
one), one row per rank, forwards blue, backwards green, weight gradients orange, posting
communication grey, waiting for communication hatched red; a dark line between panels and five
ticks under each, at fifths of the longest panel's time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_pipe.schedules.timeline_svg import Bar

_ROW, _GAP, _MARGIN, _TOP, _AXIS = 28, 6, 8, 8, 10
_BACKGROUND, _ROW_FILL, _INK = (255, 255, 255), (244, 244, 244), (64, 64, 64)
_WAIT_FILL, _WAIT_LINE = (251, 227, 228), (225, 87, 89)
FILLS = {"F": (76, 120, 168), "B": (89, 161, 79), "W": (242, 142, 43), "post": (186, 176, 172)}


def _panel_height(bars: Sequence[Bar]) -> int:
    ranks = 1 + max((b.rank for b in bars), default=0)
    return _TOP + ranks * (_ROW + _GAP) + _AXIS


def timeline_image(panels: Sequence[tuple[str, Sequence[Bar]]], width: int = 960) -> torch.Tensor:
    """One picture of ``panels`` (title, bars) stacked on a shared time axis, as (H, W, 3) ``uint8``."""
    if not panels:
        raise ValueError("timeline_image needs at least one panel of bars")
    if width < 4 * _MARGIN:
        raise ValueError(f"timeline_image(width={width}): give at least {4 * _MARGIN} pixels")
    span = max((b.end for _, bars in panels for b in bars), default=0.0)
    height = sum(_panel_height(bars) for _, bars in panels) + 1
    image = torch.tensor(_BACKGROUND, dtype=torch.uint8).expand(height, width, 3).clone()
    plot = width - 2 * _MARGIN

    def x(t: float) -> int:
        return _MARGIN + round(plot * (t / span if span > 0 else 0.0))

    top = 0
    for _, bars in panels:
        image[top, :] = torch.tensor(_INK, dtype=torch.uint8)
        y0 = top + _TOP
        ranks = 1 + max((b.rank for b in bars), default=0)
        for rank in range(ranks):
            y = y0 + rank * (_ROW + _GAP)
            image[y : y + _ROW, _MARGIN : _MARGIN + plot] = torch.tensor(_ROW_FILL, dtype=torch.uint8)
        for bar in sorted(bars, key=lambda b: (b.kind not in ("wait", "post"), b.start)):
            y = y0 + bar.rank * (_ROW + _GAP) + 1
            left, right = x(bar.start), max(x(bar.end), x(bar.start) + 1)
            if right - left >= 3:
                right -= 1  # a white seam between neighbouring bars of one colour
            region = image[y : y + _ROW - 2, left:right]
            if bar.kind == "wait":
                rows = torch.arange(y, y + region.shape[0]).unsqueeze(1)
                cols = torch.arange(left, left + region.shape[1]).unsqueeze(0)
                stripe = ((rows + cols) % 6 < 2).unsqueeze(-1)
                region[:] = torch.where(
                    stripe, torch.tensor(_WAIT_LINE, dtype=torch.uint8), torch.tensor(_WAIT_FILL, dtype=torch.uint8)
                )
            else:
                region[:] = torch.tensor(FILLS[bar.kind], dtype=torch.uint8)
        axis = y0 + ranks * (_ROW + _GAP)
        for i in range(6):
            tick = min(x(span * i / 5), width - 1)
            image[axis - _GAP : axis + 2, tick] = torch.tensor(_INK, dtype=torch.uint8)
        top += _panel_height(bars)
    image[height - 1, :] = torch.tensor(_INK, dtype=torch.uint8)
    return image

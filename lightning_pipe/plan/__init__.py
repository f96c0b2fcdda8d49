"""Seeing and choosing a pipeline's layout: timeline pictures of a schedule and of a run."""

from lightning_pipe.plan.picture import TimelinePicture
from lightning_pipe.plan.timeline_svg import Bar, measured_bars, simulated_bars, timeline_svg

__all__ = ["Bar", "TimelinePicture", "measured_bars", "simulated_bars", "timeline_svg"]

"""Seeing and choosing a pipeline's layout: timeline pictures of a schedule and of a run,
per-stage metrics of a run for Lightning's loggers, and where each rank's step goes."""

from lightning_pipe.plan.picture import TimelinePicture
from lightning_pipe.plan.stage_metrics import StageMetrics
from lightning_pipe.plan.step_profile import StepProfile
from lightning_pipe.plan.timeline_image import timeline_image
from lightning_pipe.plan.timeline_svg import Bar, measured_bars, simulated_bars, timeline_svg

__all__ = ["Bar", "StageMetrics", "StepProfile", "TimelinePicture", "measured_bars", "simulated_bars", "timeline_image", "timeline_svg"]

"""Observing a run: timeline pictures of a schedule and of a run, per-stage metrics of a run for
Lightning's loggers, where each rank's step goes, and the run's summary lines."""

from lightning_pipe.observe.picture import TimelinePicture
from lightning_pipe.observe.stage_metrics import StageMetrics
from lightning_pipe.observe.step_profile import StepProfile
from lightning_pipe.observe.timeline_image import timeline_image
from lightning_pipe.schedules.timeline_svg import Bar, measured_bars, simulated_bars, timeline_svg

__all__ = [
    "Bar",
    "StageMetrics",
    "StepProfile",
    "TimelinePicture",
    "measured_bars",
    "simulated_bars",
    "timeline_image",
    "timeline_svg",
]

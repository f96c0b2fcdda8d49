"""``TimelinePicture``: a Lightning callback that draws what the pipeline did in a training step.

Every rank records its spans (``strategy.enable_timeline()``); at the end of training the ranks
send one step's spans to global rank 0, which writes an SVG with the predicted timeline of the
schedule (simulated with the measured median forward and backward times) above the measured one.
The rows of the measured timeline share one clock through the step start times each rank read
from ``perf_counter`` (one host's processes share it; ranks on other hosts are drawn from their
own step starts). The same picture goes to the Trainer's loggers as an image (without its text;
see :mod:`lightning_pipe.plan.timeline_image` and :mod:`lightning_pipe.plan.image_logging`).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_pipe.plan.image_logging import log_image
from lightning_pipe.plan.timeline_image import timeline_image
from lightning_pipe.plan.timeline_svg import measured_bars, simulated_bars, timeline_svg
from lightning_pipe.runtime.timeline import Span, Timeline
from lightning_pipe.schedules import SCHEDULES, VIRTUAL_STAGES, simulate


class TimelinePicture(pl.Callback):
    """Write ``path`` (SVG) at the end of training: the predicted and the measured timeline of
    training step ``step`` (default: the last one, in the steady state) on every rank.

    With ``log=True`` (default) the picture also goes to the Trainer's loggers under ``tag``, as
    an image: TensorBoard's ``add_image``, or a logger's ``log_image``; other loggers are skipped
    with a warning. ``path=None`` only logs it.

    ``self.svg`` holds the picture on global rank 0 afterwards, ``self.image`` the logged image,
    ``self.spans`` each rank's spans.
    """

    def __init__(
        self, path: Union[str, Path, None], step: int = -1, log: bool = True, tag: str = "pipeline/timeline"
    ) -> None:
        if path is None and not log:
            raise ValueError("TimelinePicture(path=None, log=False) would draw nothing: give a path, or log=True.")
        self.path = Path(path) if path is not None else None
        self.step = step
        self.log = log
        self.tag = tag
        self.svg: Optional[str] = None
        self.image: Optional[torch.Tensor] = None
        self.spans: dict[int, list[Span]] = {}
        self._timeline: Optional[Timeline] = None

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._timeline = trainer.strategy.enable_timeline()

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        strategy = trainer.strategy
        timeline = self._timeline
        mine: Optional[tuple[float, list[Span]]] = None
        if timeline is not None and timeline.steps:
            index = self.step if self.step < 0 else min(self.step, len(timeline.steps) - 1)
            mine = (timeline.origins[index], timeline.steps[index])
        gathered: list[Any] = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
        if trainer.global_rank != 0:
            return
        recorded = {rank: entry for rank, entry in enumerate(gathered) if entry is not None}
        if not recorded:
            return
        first = min(origin for origin, _ in recorded.values())
        self.spans = {rank: spans for rank, (_, spans) in recorded.items()}
        offsets = {rank: origin - first for rank, (origin, _) in recorded.items()}
        measured = measured_bars(self.spans, offsets)
        panels = []
        forwards = [s.seconds for spans in self.spans.values() for s in spans if s.name == "F"]
        backwards = [s.seconds for spans in self.spans.values() for s in spans if s.name == "B"]
        name = getattr(strategy, "schedule_name", "")
        num_microbatches = len({s.microbatch for s in self.spans.get(0, []) if s.name == "F"})
        # predicted only for one stage per process and a whole backward (F and B spans per rank)
        if name in SCHEDULES and name not in VIRTUAL_STAGES and name != "zero_bubble" and forwards and backwards and num_microbatches:
            schedule = SCHEDULES[name](len(self.spans), num_microbatches)
            simulation = simulate(schedule, statistics.median(forwards), statistics.median(backwards))
            panels.append((f"{name}: predicted from the median forward and backward times", simulated_bars(simulation)))
        step_seconds = max(b.end for b in measured)
        which = "the last training step" if self.step == -1 else f"training step {self.step}"
        panels.append((f"{name}: measured, {which} ({step_seconds * 1e3:.1f} ms)", measured))
        self.svg = timeline_svg(panels, unit="s")
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(self.svg)
        if self.log and trainer.loggers:
            self.image = timeline_image(panels)
            step = int(getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step))
            log_image(trainer.loggers, self.tag, self.image, step)


__all__ = ["TimelinePicture"]

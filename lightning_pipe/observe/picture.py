"""``TimelinePicture``: a Lightning callback that draws what the pipeline did in a training step.

Every rank records its spans (``strategy.enable_timeline()``); at the end of training the ranks
send one step's spans to global rank 0, which writes an SVG with the predicted timeline of the
schedule (every synchronous one, simulated with each stage's measured median forward, backward and,
for the schedules that split the backward, weight-gradient times) above the measured one.
The rows of the measured timeline share one clock through the step start times each rank read
from ``perf_counter`` (one host's processes share it; ranks on other hosts are drawn from their
own step starts). The same picture goes to the Trainer's loggers as an image (without its text;
see :mod:`lightning_pipe.observe.timeline_image` and :mod:`lightning_pipe.observe.image_logging`).
"""

from __future__ import annotations

import statistics
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_pipe.observe.image_logging import log_image
from lightning_pipe.observe.timeline_image import timeline_image
from lightning_pipe.runtime.timings import Span, Timeline
from lightning_pipe.schedules import SCHEDULES, build, is_async, simulate, traits
from lightning_pipe.schedules.text import is_schedule_text
from lightning_pipe.schedules.timeline_svg import measured_bars, simulated_bars, timeline_svg
from lightning_pipe.trainer import internals


def stage_costs(spans_by_rank: dict[int, list[Span]]) -> dict[int, tuple[float, float, float]]:
    """Each stage's median forward, backward (B) and weight-gradient (W) seconds over its micro-batches
    (and replicas) in the spans: the costs the predicted timeline plays the schedule with. W is 0 for
    a schedule that runs the backward whole; a stage that recorded no forward or backward is left out."""
    seconds: dict[tuple[int, str], list[float]] = {}
    for spans in spans_by_rank.values():
        for span in spans:
            if span.name in ("F", "B", "W"):
                seconds.setdefault((span.stage, span.name), []).append(span.seconds)
    stages = {stage for stage, name in seconds if name == "F"} & {stage for stage, name in seconds if name == "B"}
    return {
        stage: tuple(statistics.median(seconds.get((stage, kind), [0.0])) for kind in ("F", "B", "W"))  # type: ignore[misc]
        for stage in sorted(stages)
    }


def _training_steps(timeline: Timeline) -> list[int]:
    """The indices of the recorded steps that trained (those with a backward): validation's forwards
    run through the same executor and are recorded too."""
    return [i for i, spans in enumerate(timeline.steps) if any(s.name in ("B", "W") for s in spans)]


class TimelinePicture(pl.Callback):
    """Write ``path`` (SVG) at the end of training: the predicted and the measured timeline of
    training step ``step`` (default: the last one, in the steady state) on every rank.

    With ``to_loggers=True`` (default) the picture also goes to the Trainer's loggers under ``tag``,
    as an image: TensorBoard's ``add_image``, or a logger's ``log_image``; other loggers are skipped
    with a warning. ``path=None`` only logs it. (The option is not called ``log``: Lightning sets
    every callback's ``log`` attribute to the module's ``log`` method at fit start; ``log=`` is still
    accepted, with a ``DeprecationWarning``.)

    ``self.svg`` holds the picture on global rank 0 afterwards, ``self.image`` the logged image,
    ``self.spans`` each rank's spans.
    """

    def __init__(
        self,
        path: str | Path | None,
        step: int = -1,
        to_loggers: bool = True,
        tag: str = "pipeline/timeline",
        *,
        log: bool | None = None,
    ) -> None:
        if log is not None:
            warnings.warn(
                f"TimelinePicture(log={log!r}) is deprecated: write TimelinePicture(..., to_loggers={log!r}) "
                "(Lightning "
                "replaces every callback's `log` attribute with the module's `log` method when fitting starts).",
                DeprecationWarning,
                stacklevel=2,
            )
            to_loggers = log
        if path is None and not to_loggers:
            raise ValueError(
                "TimelinePicture(path=None, to_loggers=False) would draw nothing: give a path, or to_loggers=True."
            )
        self.path = Path(path) if path is not None else None
        self.step = step
        self.to_loggers = bool(to_loggers)
        self.tag = tag
        self.svg: str | None = None
        self.image: torch.Tensor | None = None
        self.spans: dict[int, list[Span]] = {}
        self._timeline: Timeline | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._timeline = trainer.strategy.enable_timeline()  # type: ignore[attr-defined]  # the pipeline strategy's

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        timeline = self._timeline
        mine: tuple[float, list[Span]] | None = None
        training = _training_steps(timeline) if timeline is not None else []
        if training:
            index = training[self.step if self.step < 0 else min(self.step, len(training) - 1)]
            mine = (timeline.origins[index], timeline.steps[index])  # type: ignore[union-attr]
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
        name = getattr(strategy, "schedule_name", "")
        panels = []
        predicted = self._predicted(strategy, name)
        if predicted is not None:
            panels.append(predicted)
        step_seconds = max(b.end for b in measured)
        which = "the last training step" if self.step == -1 else f"training step {self.step}"
        label = traits(name).label if is_schedule_text(name) else name  # a schedule text: its file's name
        panels.append((f"{label}: measured, {which} ({step_seconds * 1e3:.1f} ms)", measured))
        self.svg = timeline_svg(panels, unit="s")
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(self.svg)
        if self.to_loggers and trainer.loggers:
            self.image = timeline_image(panels)
            step = internals.batches_that_stepped(trainer)
            log_image(trainer.loggers, self.tag, self.image, step)

    def _predicted(self, strategy: Any, name: str) -> tuple[str, list] | None:
        """The schedule the run used, simulated with each stage's measured median F, B and W times (a
        schedule that splits the backward plays B and W apart, the others their sum); None for the
        asynchronous schedules, whose step runs across batches."""
        if (name not in SCHEDULES and not is_schedule_text(name)) or is_async(name):
            return None
        costs = stage_costs(self.spans)
        microbatches = len(
            {s.microbatch for spans in self.spans.values() for s in spans if s.name == "F" and s.stage == 0}
        )
        ranks = int(getattr(strategy, "num_stages", len(self.spans)))
        virtual = int(getattr(strategy, "virtual_stages", 1)) if traits(name).virtual_stages > 1 else 1
        if not microbatches or sorted(costs) != list(range(ranks * virtual)):
            return None
        rendezvous = (
            dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"
        )  # as the strategy ran it
        try:
            schedule = build(name, ranks, microbatches, virtual, rendezvous=rendezvous)
        except ValueError:  # a schedule text for other micro-batches than this step ran
            return None
        simulation = simulate(schedule, stage_costs=[costs[s] for s in range(ranks * virtual)], rendezvous=rendezvous)
        times = "forward, backward (B) and weight-gradient (W)" if schedule.split_backward else "forward and backward"
        label = traits(name).label if is_schedule_text(name) else name
        return f"{label}: predicted from each stage's median {times} times", simulated_bars(simulation)

"""Drives an asynchronous schedule across optimizer steps: no flush between batches.

Step ``t`` runs batch ``t``'s forwards on a fresh weight version and the backwards that are due,
some of them for earlier batches, which still use their own stashed versions. A batch's gradient
on a stage is complete once the stage's last backward of it ran; it is applied at the optimizer
step ``update_delay`` steps after the batch. A drain runs the backwards still owed (before
validation, a checkpoint, the end of training, at an epoch's end, or before a change in the number
of micro-batches); it does not apply anything early. A backward that reads its forward's stashed
version gives the same gradient whenever it runs, so the update rule is the same with or without
drains. Under PipeMare and XPipe a backward reads the weights of its own moment: a drain after a
step's update leaves their rule unchanged where each backward would have run in the next step
anyway (``chunks >= stages - 1``), see :meth:`AsyncPipeline.inexact_drain`.

Under PipeMare (:mod:`lightning_pipe.runtime.asynchronous.pipemare`) the versions are never stashed: they only
gather each batch's gradient apart, while every forward and backward reads the stage's one copy
of the weights (the backward through PipeMare's saved-tensor hooks). Under XPipe
(:mod:`lightning_pipe.runtime.asynchronous.xpipe`) a batch's version aliases the prediction its forwards run on.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

from torch import Tensor

from lightning_pipe.runtime.asynchronous.delay_correction import DelayCorrection
from lightning_pipe.runtime.asynchronous.pipemare import PipeMare
from lightning_pipe.runtime.executor import Callbacks, Executor
from lightning_pipe.runtime.stage import StageRunner
from lightning_pipe.schedules import Schedule, ScheduleTraits, drain_actions, step_actions, update_delay
from lightning_pipe.schedules.families.asynchronous import isolated_step, lag, min_chunks


class AsyncPipeline:
    """One rank's share of an asynchronous pipeline (stage ``runner.stage``)."""

    def __init__(
        self,
        schedule: ScheduleTraits,
        executor: Executor,
        runner: StageRunner,
        num_stages: int,
        pipemare: PipeMare | None = None,
        correction: DelayCorrection | None = None,
    ) -> None:
        if runner.versions is None:
            raise ValueError("an asynchronous pipeline needs a StageRunner with weight versions")
        self.schedule = schedule
        self.name = schedule.name  # how messages name it, and the rule its delays follow
        self.executor = executor
        self.runner = runner
        self.versions = runner.versions
        self.num_stages = num_stages
        self.step = 0  # index of the next batch
        self._start = 0  # first batch since the pipeline was last empty
        self._in_flight: int | None = None  # micro-batches per batch while work is in flight
        self.pending: dict[int, dict[str, Tensor | None]] = {}  # batch -> gradient not yet applied
        self._schedules: dict[int, Schedule] = {}
        #: PipeMare's learning-rate rescheduling and discrepancy correction, where they are on; XPipe's
        #: prediction (an :class:`~lightning_pipe.runtime.asynchronous.xpipe.XPipe`)
        self.pipemare = pipemare
        #: the delay correction of the applied gradients (``delay_correction``), where one is on
        self.correction = correction
        self.stashes = schedule.stashes_weights  # PipeDream's and 2BW's versions keep their weights
        if pipemare is not None and (schedule.predicts_weights or schedule.predicts_ahead):
            runner.saving = pipemare.saving

    def _steady(self, m: int) -> Schedule:
        if m not in self._schedules:
            make = isolated_step if self.isolated(m) else self.schedule.make
            self._schedules[m] = make(self.num_stages, m)
        return self._schedules[m]

    def isolated(self, m: int) -> bool:
        """Whether a batch of ``m`` micro-batches is too short to overlap its neighbours (2BW with
        ``m < p - 1``): it runs from an empty pipeline and must be drained in its own step. The
        update rule is unchanged; only that step's bubble is not hidden."""
        return m < min_chunks(self.name, self.num_stages)

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    def train_step(self, m: int, keys: Mapping[int, Hashable], calls: Callbacks) -> int:
        """Run batch ``self.step`` split into ``m`` micro-batches (``keys`` by global id; ``calls``:
        the user's step and what else the executor calls out to); returns its index."""
        if self._in_flight is not None and (self._in_flight != m or self.isolated(m)):
            self.drain(calls)
        steady = self._steady(m)
        t = self.step
        if self._in_flight is None:
            self._start = t
        self.versions.create(t, self.pipemare.forward_weights() if self.pipemare is not None else None)
        actions = step_actions(steady, self.executor.rank, t, self._start)
        self.executor.run_actions(actions, self.num_stages, m, keys, calls, finish=False)
        self._in_flight = m
        self.step += 1
        self._collect()
        return t

    def inexact_drain(self) -> str | None:
        """Why draining now, between steps (after the step's update), would change the weights the rule
        gives, or None where it does not. A drain runs every backward owed at once. Backwards that run on
        their forward's stashed version (PipeDream, 2BW, WPipe) are the same whenever they run; under
        PipeMare and XPipe a backward reads the weights of its own moment, so it is the same only where
        it would have run in the next step anyway: where no backward trails its forward by two updates
        or more, ``m >= p - 1`` (stage 0's lag)."""
        m = self._in_flight
        longest = lag(self.num_stages, 0)
        if m is None or self.stashes or m >= longest:
            return None
        return (
            f"schedule={self.name!r} with {m} micro-batch(es) per batch on {self.num_stages} stages: draining the "
            "pipeline between steps (for a validation or a checkpoint in the middle of an epoch) runs at once "
            "backwards that would have run two or more updates after their forward, on other weights than the "
            f"rule gives them, so this run trains slightly differently from one without the drain. chunks >= "
            f"{longest} makes every drain exact; else validate and save at epoch ends (val_check_interval=1.0, "
            "ModelCheckpoint(every_n_epochs=...)), where the pipeline drains anyway."
        )

    def drain(self, calls: Callbacks) -> None:
        """Finish every backward in flight (``calls``: what the executor calls out to); the pipeline
        is empty afterwards."""
        if self._in_flight is None:
            return
        m = self._in_flight
        actions = drain_actions(self._steady(m), self.executor.rank, self.step - 1, self._start)
        self.executor.run_actions(actions, self.num_stages, m, {}, calls, finish=True)
        self._in_flight = None
        self._collect()
        stale = [v for v in self.versions.held() if v < self.step]
        if stale:
            raise RuntimeError(f"weight versions {stale} outlived their batches' backwards")

    def _collect(self) -> None:
        self.pending.update(self.runner.completed)
        self.runner.completed.clear()

    def due(self, step: int, m: int) -> dict[str, Tensor]:
        """The gradient to apply at the optimizer step that ends step ``step``: the sum of the
        completed batch gradients whose delay has passed (one batch in the steady state)."""
        delay = update_delay(self.name, self.num_stages, m, self.runner.stage)
        ready = sorted(b for b in self.pending if b <= step - delay)
        total: dict[str, Tensor] = {}
        for b in ready:
            for name, grad in self.pending.pop(b).items():
                if grad is None:
                    continue
                total[name] = grad if name not in total else total[name] + grad
        if self.correction is not None and total:
            return self.correction.correct(total, delay)
        return total

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue exactly: the step counter and unapplied gradients.
        Call after :meth:`drain`."""
        if self.in_flight:
            raise RuntimeError("drain the pipeline before saving its state")
        state: dict[str, Any] = {"step": self.step, "pending": {b: dict(g) for b, g in self.pending.items()}}
        if self.pipemare is not None:
            state["pipemare"] = self.pipemare.state_dict()
        if self.correction is not None:
            state["delay_correction"] = self.correction.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step = int(state["step"])
        self.pending = {int(b): dict(g) for b, g in state["pending"].items()}
        if self.pipemare is not None:
            saved = state.get("pipemare")
            if saved is None:
                raise ValueError(
                    "the checkpoint has no PipeMare state (update count, velocity): it was saved under another "
                    "schedule or without learning-rate rescheduling; resume it with the schedule and options it was "
                    "saved with"
                )
            self.pipemare.load_state_dict(saved)
        if self.correction is not None:
            if state.get("delay_correction") is None:
                raise ValueError(
                    "the checkpoint has no delay-correction state: it was saved without delay_correction; resume it "
                    "with the options it was saved with"
                )
            self.correction.load_state_dict(state["delay_correction"])
        self._in_flight = None
        self.versions.clear()
        self.runner.reset()

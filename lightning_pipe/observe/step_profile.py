"""``StepProfile``: where each rank's training step goes, the pipeline's own time included.

The executor's timeline (:class:`~lightning_pipe.runtime.timings.Timeline`) says what happens
inside one run of the schedule. A step is more than that: Lightning's loop fetches the batch (and
the first stage's sampler sends its indices), the step splits it and posts the stages' agreement
on what they loaded, the executor runs, the last stage's results are shared, the gradients are
handed to the parameters, the optimizer steps. This callback reads the host clock at Lightning's
hooks around those parts and joins it with the timeline, so that one run yields, per rank and
per step (seconds):

- ``compute``: forward, backward and weight-gradient work (the timeline's ``F``, ``B``, ``W``);
- ``wait``: blocked on a peer (the timeline's ``wait``: receives, the end of sends);
- ``post``: handing sends and receives to the backend (the timeline's ``post``);
- ``executor_other``: the rest of the executor's runs: its own Python between actions;
- ``before_executor``: from the batch's start to the executor's (splitting the batch, its
  shapes, posting the agreement, the stop flag);
- ``after_executor``: from the executor's end to the backward hook (the step's summary shared
  and replayed into ``self.log``, Lightning's closure, ``zero_grad``);
- ``hand_over``: Lightning's backward, where the pipeline hands its gradients to the parameters
  (summed over replicas where there are several);
- ``optimizer``: from then to the batch's end (clipping, ``optimizer.step`` and its hooks);
- ``between``: from the previous batch's end to this one's start (Lightning's loop, LR
  schedulers, loggers, the DataLoader's next batch including the sampler's sends, and a
  validation run in between, if any).

They add up to ``total``, the time from one batch's end to the next. The first step has no
``between`` and no ``total``. Beside them (not parts of ``total``), the CPU time the process used
over the same interval: ``main_thread_cpu`` by the thread that runs the training loop, and
``other_threads_cpu`` by all its other threads (on CPU with gloo mostly gloo's own threads, which
read and write the messages: time they take from the cores the stages compute on). On a GPU
the hooks synchronize the device (so that the host clock sees the work done) and the executor's
parts are its CUDA events; measuring then slows the step a little. Asynchronous schedules that drain
run the executor twice in a step: both runs count.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_pipe.observe.stage_metrics import COMPUTE

PARTS = (
    "compute", "wait", "post", "executor_other", "before_executor", "after_executor", "hand_over", "optimizer",
    "between",
)  # fmt: skip
#: CPU time over each step's interval, beside the parts (they do not add up to ``total``)
CPU = ("main_thread_cpu", "other_threads_cpu")


class StepProfile(pl.Callback):
    """Per rank, one row per training step with the parts above (``rows``).

    Args:
        folder: where each rank writes ``step_profile_rank{r}.json`` (its rows) when training
            ends; None: nowhere (read ``rows`` in the process).
    """

    def __init__(self, folder: str | None = None) -> None:
        self.folder = folder
        self.rows: list[dict[str, float]] = []
        self._cuda = False
        self._marks: dict[str, float] = {}
        self._last_end: float | None = None
        self._last_cpu: tuple[float, float] | None = None  # (process, this thread) CPU seconds at the last batch end
        self._timeline: Any = None
        self._runs: list[tuple[float, list[Any]]] = []  # the executor's runs since the batch began: (start, spans)

    def _now(self) -> float:
        if self._cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pipeline = trainer.strategy.pipeline  # type: ignore[attr-defined]
        if self._timeline is None:
            # each run reaches the listener as it ends; the timeline keeps only the last (bounded memory)
            self._timeline = pipeline.enable_timeline(keep=1)
            self._timeline.listeners.append(self._ran)
        self._cuda = pipeline.placement.device.type == "cuda"
        self._last_end = None
        self._last_cpu = None

    def _ran(self, spans: list[Any]) -> None:
        self._runs.append((self._timeline.origins[-1], spans))

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._marks = {"start": self._now()}
        self._runs = []  # a validation in between ran the executor too, before this batch began

    def on_before_backward(self, trainer: pl.Trainer, *args: Any) -> None:
        self._marks["backward"] = self._now()

    def on_after_backward(self, trainer: pl.Trainer, *args: Any) -> None:
        self._marks["handed"] = self._now()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        end = self._now()
        cpu, last_cpu = (time.process_time(), time.thread_time()), self._last_cpu
        self._last_cpu = cpu
        marks, runs, self._runs = self._marks, self._runs, []
        if "backward" not in marks or not runs:
            self._last_end = end
            return  # a step without the pipeline's backward (skipped by the user): nothing to split
        sums = dict.fromkeys(("compute", "wait", "post", "step"), 0.0)
        first_start, handed = runs[0][0], marks.get("handed", marks["backward"])
        # an asynchronous rule may run the executor again in the hand-over or the optimizer step: each run's
        # time counts in the executor's parts, not in the window it ran in
        later = {"hand_over": 0.0, "optimizer": 0.0}
        for start, spans in runs:
            for span in spans:
                part = "compute" if span.name in COMPUTE else span.name
                if part in sums:
                    sums[part] += span.seconds
                if span.name == "step" and start >= marks["backward"]:
                    later["hand_over" if start < handed else "optimizer"] += span.seconds
        row = {
            "compute": sums["compute"],
            "wait": sums["wait"],
            "post": sums["post"],
            "executor_other": sums["step"] - sums["compute"] - sums["wait"] - sums["post"],
            "before_executor": first_start - marks["start"],
            "after_executor": marks["backward"] - first_start - (sums["step"] - sum(later.values())),
            "hand_over": handed - marks["backward"] - later["hand_over"],
            "optimizer": end - handed - later["optimizer"],
        }
        if self._last_end is not None:
            row["between"] = marks["start"] - self._last_end
            row["total"] = end - self._last_end
        if last_cpu is not None:
            row["main_thread_cpu"] = cpu[1] - last_cpu[1]
            row["other_threads_cpu"] = (cpu[0] - last_cpu[0]) - row["main_thread_cpu"]
        self.rows.append(row)
        self._last_end = end

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.folder is not None:
            os.makedirs(self.folder, exist_ok=True)
            with open(os.path.join(self.folder, f"step_profile_rank{trainer.global_rank}.json"), "w") as f:
                json.dump(self.rows, f)


def means(rows: Sequence[dict[str, float]], skip: int = 0) -> dict[str, float]:
    """Each part's mean over the steps after the first ``skip`` that have a ``total`` (means, so
    that the parts add up to the mean step), and the CPU times' where every such step has them."""
    chosen = [row for row in rows[skip:] if "total" in row]
    if not chosen:
        return {}
    keys = (*PARTS, "total", *(c for c in CPU if all(c in row for row in chosen)))
    return {part: statistics.fmean(row[part] for row in chosen) for part in keys}


def markdown(per_rank: Sequence[dict[str, float]], ranks: Sequence[int] | None = None) -> str:
    """A table of the parts (milliseconds and share of the step) with one column per rank
    (``ranks``: the columns' ranks, by default 0, 1, ...)."""
    names = ranks if ranks is not None else range(len(per_rank))
    header = "| part | " + " | ".join(f"rank {r}" for r in names) + " |"
    lines = [header, "|---|" + "---|" * len(per_rank)]
    for part in (*PARTS, "total"):
        cells = []
        for m in per_rank:
            share = m[part] / m["total"] if m.get("total") else 0.0
            cells.append(f"{1e3 * m[part]:.1f} ms ({share:.0%})" if part != "total" else f"{1e3 * m[part]:.1f} ms")
        lines.append(f"| {part} | " + " | ".join(cells) + " |")
    for part in CPU:  # CPU time over the step, beside the parts
        if all(part in m for m in per_rank):
            lines.append(f"| {part} | " + " | ".join(f"{1e3 * m[part]:.1f} ms" for m in per_rank) + " |")
    return "\n".join(lines)

"""``StageMetrics``: a Lightning callback that logs what each pipeline stage did while training.

Every ``every_n_steps`` training batches (default: the Trainer's ``log_every_n_steps``) the
loggers on global rank 0 receive, for each stage ``s`` (the ``s``-th process of the pipeline; with
virtual stages it holds several model chunks):

- ``pipeline/stage{s}/bubble``: the share of the stage's pipeline time (the executor's run of
  each training step's schedule) not spent in forward, backward or weight-gradient work: waiting
  for and posting communication, bookkeeping. The optimizer step and Lightning's work between
  steps are not part of it. With data-parallel replicas, over all replicas of the stage
  (their summed idle time over their summed pipeline time).
- ``pipeline/stage{s}/samples_per_sec``: training samples per second of wall time, from the end
  of one training batch to the end of the next (data loading, the pipeline, the optimizer step;
  validation left out), summed over the replicas: the global batch's throughput as that stage saw it.
- ``pipeline/stage{s}/peak_memory_mib`` on CUDA: ``torch.cuda.max_memory_allocated`` (the
  allocator's peak since the process started or the peak statistics were last reset);
  ``pipeline/stage{s}/peak_rss_mib`` elsewhere: the process's peak resident set size
  (``resource.getrusage``), which includes the Python interpreter and the loaded libraries.
  The largest over the replicas.

The numbers of the ranks travel to rank 0 in one small asynchronous gather over a gloo group,
posted every ``every_n_steps`` batches and completed at the next batch's end, so no step waits
for it; the values of a window are logged one batch after it closes, under the window's last step.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.distributed import ProcessGroup

from lightning_pipe.runtime.microbatch import batch_size
from lightning_pipe.trainer import internals

COMPUTE = ("F", "B", "W")
_MIB = 1024.0 * 1024.0


def busy_and_total(spans: Iterable[Any]) -> tuple[float, float]:
    """Seconds of one recorded step spent computing (its ``F``, ``B`` and ``W`` spans) and the
    step's seconds (its ``step`` span, the executor's whole run). Spans are objects with ``name``,
    ``start`` and ``end``, as :class:`~lightning_pipe.runtime.timings.Span`."""
    busy = total = 0.0
    for span in spans:
        if span.name in COMPUTE:
            busy += span.end - span.start
        elif span.name == "step":
            total += span.end - span.start
    return busy, total


def bubble(busy: float, total: float) -> float:
    """The idle share ``1 - busy / total`` of a window (0.0 where nothing ran)."""
    if total <= 0.0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - busy / total))


@dataclass
class Window:
    """One rank's sums over the training batches since its numbers were last sent."""

    busy: float = 0.0
    total: float = 0.0
    samples: float = 0.0
    seconds: float = 0.0
    batches: int = 0
    step: int = 0  # the logger's step of the last batch (what Lightning logs that batch's values under)

    def row(self, stage: int, peak_bytes: float) -> list[float]:
        """What the rank sends: stage, busy, total, samples, seconds, peak bytes."""
        return [float(stage), self.busy, self.total, self.samples, self.seconds, float(peak_bytes)]


def stage_metrics(rows: Sequence[Sequence[float]], memory_name: str, prefix: str = "pipeline") -> dict[str, float]:
    """The logged values from every rank's row (see :meth:`Window.row`): per stage, the bubble
    over its replicas' summed times, their summed samples per second and their largest peak
    memory (``memory_name``, in MiB; a NaN peak is left out)."""
    by_stage: dict[int, list[Sequence[float]]] = {}
    for row in rows:
        by_stage.setdefault(int(row[0]), []).append(row)
    metrics: dict[str, float] = {}
    for stage in sorted(by_stage):
        replicas = by_stage[stage]
        key = f"{prefix}/stage{stage}"
        metrics[f"{key}/bubble"] = bubble(sum(r[1] for r in replicas), sum(r[2] for r in replicas))
        metrics[f"{key}/samples_per_sec"] = sum(r[3] / r[4] for r in replicas if r[4] > 0)
        peaks = [r[5] for r in replicas if r[5] == r[5]]
        if peaks:
            metrics[f"{key}/{memory_name}"] = max(peaks) / _MIB
    return metrics


def peak_memory(device: torch.device) -> tuple[str, float]:
    """The metric's name and this process's peak memory in bytes (NaN where it cannot be read)."""
    if device.type == "cuda":
        return "peak_memory_mib", float(torch.cuda.max_memory_allocated(device))
    try:
        import resource
    except ImportError:  # Windows
        return "peak_rss_mib", float("nan")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return "peak_rss_mib", float(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


class StageMetrics(pl.Callback):
    """Log each stage's bubble, samples per second and peak memory to the Trainer's loggers
    (see the module's docstring for what each measures).

    ``every_n_steps``: training batches per logged window (default: ``Trainer(log_every_n_steps)``).
    The last, shorter window is logged at the end of training. ``self.metrics`` holds the last
    logged values on global rank 0.
    """

    def __init__(self, every_n_steps: int | None = None, prefix: str = "pipeline") -> None:
        if every_n_steps is not None and (
            not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1
        ):
            raise ValueError(
                f"StageMetrics(every_n_steps={every_n_steps!r}): give an integer >= 1, or None for "
                "Trainer(log_every_n_steps)."
            )
        self.every_n_steps = every_n_steps
        self.prefix = prefix
        self.metrics: dict[str, float] = {}
        self._window = Window()
        self._in_batch = False
        self._last: float | None = None
        self._batches = 0
        self._group: ProcessGroup | None = None
        self._pending: tuple[Any, list[torch.Tensor], int, str] | None = None
        self._timeline: Any = None

    # ------------------------------------------------------------------ recording
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        if not hasattr(strategy, "enable_timeline"):
            raise MisconfigurationException(
                "StageMetrics measures the stages of a pipeline, but the Trainer's strategy is "
                f"{type(strategy).__name__}. "
                "Use Trainer(strategy='pipeline') or PipelineStrategy(...), or drop the callback."
            )
        self._timeline = strategy.enable_timeline(keep=0)  # read step by step below; keeps no history of its own
        self._timeline.listeners.append(self._on_step)
        if self.every_n_steps is None:
            self.every_n_steps = max(1, int(trainer.log_every_n_steps))  # type: ignore[attr-defined]  # set by Lightning's logger connector
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo")  # every rank runs on_fit_start: a collective call

    def _on_step(self, spans: list[Any]) -> None:
        if self._in_batch:  # training steps only (not validation, nor a drain before it)
            busy, total = busy_and_total(spans)
            self._window.busy += busy
            self._window.total += total

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = None  # the epoch's first batch is timed from its start

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._in_batch = True
        if self._last is None:
            self._last = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._last is not None:
            self._last = time.perf_counter()  # validation is not training time

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._in_batch = False
        now = time.perf_counter()
        window = self._window
        window.seconds += now - (self._last if self._last is not None else now)
        window.samples += batch_size(batch)
        window.batches += 1
        window.step = internals.batches_that_stepped(trainer)
        self._last = now
        self._batches += 1
        self._complete(trainer)
        assert self.every_n_steps is not None
        if self._batches % self.every_n_steps == 0:
            self._post(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._complete(trainer)
        if self._window.batches:
            self._post(trainer)
            self._complete(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._timeline is not None and self._on_step in self._timeline.listeners:
            self._timeline.listeners.remove(self._on_step)
        self._timeline = None
        self._pending = None
        self._group = None  # a later fit may run in a new process group
        self._window, self._last, self._in_batch = Window(), None, False

    # ------------------------------------------------------------------ sending and logging
    def _post(self, trainer: pl.Trainer) -> None:
        """Send this rank's window to global rank 0 without waiting, and start a new window."""
        strategy = trainer.strategy
        memory_name, peak = peak_memory(strategy.root_device)
        row = torch.tensor(self._window.row(getattr(strategy, "stage", 0), peak), dtype=torch.float64)
        step = self._window.step
        self._window = Window()
        if self._group is None:
            self._pending = (None, [row], step, memory_name)
            return
        rows = [torch.empty_like(row) for _ in range(dist.get_world_size())] if trainer.global_rank == 0 else None
        work = dist.gather(row, rows, dst=0, group=self._group, async_op=True)
        self._pending = (work, rows or [], step, memory_name)

    def _complete(self, trainer: pl.Trainer) -> None:
        """Finish the gather posted last (long arrived, as a whole batch ran since) and log its values."""
        if self._pending is None:
            return
        work, rows, step, memory_name = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        if trainer.global_rank != 0:
            return
        self.metrics = stage_metrics([r.tolist() for r in rows], memory_name, self.prefix)
        for logger in trainer.loggers:
            logger.log_metrics(self.metrics, step=step)

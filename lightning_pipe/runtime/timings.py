"""Per-action timings of a rank's pipeline step: where the time of a step goes.

Off by default: without a timeline the executor reads no clock. On a GPU each span is a pair of
CUDA events on the current stream, so it measures when the GPU ran the work rather than when
Python queued it (a receive's ``wait`` then only orders streams and takes no GPU time: idle GPU
time shows as the gaps between compute spans). On the CPU spans are ``perf_counter`` readings.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Span:
    """One action of one step: ``name`` is ``F``, ``B``, ``post`` (handing sends and receives to the
    backend) or ``wait`` (blocked on communication); times in seconds from the step's start."""

    name: str
    stage: int
    microbatch: int
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


class Timeline:
    """Records the spans of every step the executor runs while it is attached.

    ``keep`` bounds the history: None keeps every step in ``steps``; ``n`` keeps the last ``n``
    (0: none), so a consumer that reads each step as it ends (a ``listeners`` entry, called with
    the step's spans) does not make a long run's memory grow."""

    def __init__(self, device: torch.device, keep: int | None = None) -> None:
        self.cuda = device.type == "cuda"
        self.keep = keep
        self.listeners: list[Callable[[list[Span]], None]] = []
        self.steps: list[list[Span]] = []
        self.origins: list[
            float
        ] = []  # per step: ``perf_counter`` at its start, a clock shared by the host's processes
        self._origin: Any = None
        self._wall = 0.0
        self._marks: list[tuple[str, int, int, Any, Any]] = []

    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _seconds(self, mark: Any) -> float:
        if self.cuda:
            return self._origin.elapsed_time(mark) / 1000.0
        return mark - self._origin

    def begin_step(self) -> None:
        self._wall = time.perf_counter()
        self._origin = self._mark()
        self._marks = []

    @contextmanager
    def span(self, name: str, stage: int, microbatch: int) -> Iterator[None]:
        start = self._mark()
        try:
            yield
        finally:
            self._marks.append((name, stage, microbatch, start, self._mark()))

    def end_step(self) -> None:
        """Close the step (on a GPU this waits for its work to finish, to read the events)."""
        if self._origin is None:
            return
        end = self._mark()
        if self.cuda:
            end.synchronize()
        spans = [Span(n, s, i, self._seconds(a), self._seconds(b)) for n, s, i, a, b in self._marks]
        spans.append(Span("step", -1, -1, 0.0, self._seconds(end)))
        self.steps.append(spans)
        self.origins.append(self._wall)
        self._origin = None
        if self.keep is not None and len(self.steps) > self.keep:
            del self.steps[: len(self.steps) - self.keep]
            del self.origins[: len(self.origins) - self.keep]
        for listener in self.listeners:
            listener(spans)

    def totals(self, steps: slice | None = None) -> dict[str, float]:
        """Mean seconds per step spent in each kind of span (``step`` is the executor's whole run),
        plus ``other``: the step's time outside forward and backward (posting and waiting for
        communication, bookkeeping; on a GPU, the time the GPU had no stage work)."""
        chosen = self.steps[steps] if steps is not None else self.steps
        if not chosen:
            return {}
        sums: dict[str, float] = defaultdict(float)
        for spans in chosen:
            for span in spans:
                sums[span.name] += span.seconds
        means = {name: total / len(chosen) for name, total in sums.items()}
        means["other"] = means["step"] - means.get("F", 0.0) - means.get("B", 0.0) - means.get("W", 0.0)
        return means

"""The start of a corrected run watched: a delay correction whose loss climbs above its first value early on is
diverging where the schedule without it may not, and the user is told once, with what to change."""

from __future__ import annotations

import math
from collections import deque

#: The share of the run's steps watched; how far above the first loss the mean of the last :data:`RECENT`
#: losses (the first among them until there are more) must be to count as rising: a quarter of the first (one
#: batch's loss varies by a fifth around the first one's before training has moved it, on the tests' small
#: batches). A loss that is not finite counts at once.
WATCHED, MARGIN, RECENT = 0.1, 0.25, 3

ADVICE = {
    "nesterov": "lower lr (the correction steps as NAdam does, by about lr per weight; the method's reference "
    "trains at 3e-4), or leave delay_correction unset",
    "error_feedback": "lower lr or delay_correction_coefficient (beta; 0.5 by default), or leave delay_correction "
    "unset",
}


class RisingLoss:
    """Watch each step's loss over the first :data:`WATCHED` of ``total_steps`` (not finite: the run's length is
    unknown, nothing is watched); :meth:`observe` says it once."""

    def __init__(self, correction: str, total_steps: float) -> None:
        self.correction = correction
        self.last_watched = WATCHED * total_steps if math.isfinite(total_steps) else -1.0
        self.first: float | None = None
        self.recent: deque[float] = deque(maxlen=RECENT)
        self.told = False

    def observe(self, step: int, loss: float) -> str | None:
        """What to tell at global step ``step`` whose loss is ``loss`` (nan: no batch's loss yet), or None."""
        if self.told or step > self.last_watched:
            return None
        if self.first is None:
            if math.isfinite(loss):
                self.first = loss
                self.recent.append(loss)
            return None
        self.recent.append(loss)
        if math.isfinite(loss) and sum(self.recent) / len(self.recent) <= self.first + MARGIN * abs(self.first):
            return None
        self.told = True
        return (
            f"lightning-pipe: PipelineStrategy(delay_correction={self.correction!r}): the training loss rose from "
            f"{self.first:.4g} (its first value) to {loss:.4g} at step {step}, within the first "
            f"{WATCHED:.0%} of the steps: the corrected run is diverging. {ADVICE[self.correction].capitalize()} "
            "(docs/schedules.md#delay-corrections)."
        )

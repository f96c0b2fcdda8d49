"""Schedules as data: per-rank action lists, their validation, simulation and rendering.

Nothing here touches ``torch.distributed``; the executor in :mod:`lightning_pipe.runtime` runs
the very lists these functions return.
"""

from __future__ import annotations

from typing import Callable

from lightning_pipe.schedules.actions import Action, ActionKind, Schedule
from lightning_pipe.schedules.asynchronous import (
    ASYNC_SCHEDULES,
    drain_actions,
    pipedream,
    pipedream_2bw,
    step_actions,
    steady_state_bubble,
    unroll,
    update_delay,
    versions_held,
)
from lightning_pipe.schedules.render import render
from lightning_pipe.schedules.simulate import DeadlockError, Simulation, closed_form_bubble, peak_in_flight, simulate
from lightning_pipe.schedules.interleaved import interleaved_1f1b
from lightning_pipe.schedules.sync import forward_only, gpipe, one_f_one_b
from lightning_pipe.schedules.zero_bubble import zbv, zero_bubble
from lightning_pipe.schedules.validate import InvalidScheduleError, validate

ScheduleFn = Callable[[int, int], Schedule]

#: Training schedules by the name users pass as ``PipelineStrategy(schedule=...)``.
SCHEDULES: dict[str, ScheduleFn] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "zero_bubble": zero_bubble,
    "pipedream": pipedream,
    "pipedream_2bw": pipedream_2bw,
}


def is_async(name: str) -> bool:
    """Asynchronous schedules keep work in flight across optimizer steps."""
    return name in ASYNC_SCHEDULES


def get_schedule(name: str) -> ScheduleFn:
    """The schedule function called ``name``; the error lists the valid names."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"Unknown pipeline schedule {name!r}. Valid schedules: {', '.join(sorted(SCHEDULES))}.") from None


__all__ = [
    "ASYNC_SCHEDULES",
    "Action",
    "ActionKind",
    "DeadlockError",
    "InvalidScheduleError",
    "SCHEDULES",
    "Schedule",
    "Simulation",
    "closed_form_bubble",
    "drain_actions",
    "is_async",
    "pipedream",
    "pipedream_2bw",
    "steady_state_bubble",
    "step_actions",
    "unroll",
    "update_delay",
    "versions_held",
    "forward_only",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "peak_in_flight",
    "render",
    "simulate",
    "validate",
    "zbv",
    "zero_bubble",
]

"""``recompute=`` and ``offload=`` per pipeline stage: keep, recompute or move saved activations to host memory.

``recompute`` takes one of torchgpipe's modes for every stage, a list with one mode per pipeline stage
(processes x ``virtual_stages``), or ``"auto"``: ``"always"`` on every stage that holds more
micro-batches in flight at its peak than the last stage (from the schedule), ``"never"`` elsewhere.

The value names, per pipeline stage, how many micro-batches' saved tensors the stage keeps in
device memory; the forwards beyond them go to host memory (:mod:`lightning_pipe.runtime.activations.offload`).
``False``/``None``: none offloaded; ``True``: every micro-batch offloaded (keep 0); an integer
``k >= 0``: keep ``k`` (and one more comes back ahead of its backward, so ``k + 1`` at most on the
device); a list: one of those per pipeline stage (processes x ``virtual_stages``); ``"auto"``: from
the schedule, every stage that holds more micro-batches in flight at its peak than the last stage
keeps one fewer than the last stage holds, so that it holds as many as the last stage, the others
offload nothing (under 1F1B: stage ``s`` of ``p`` holds ``p - s``, so every stage but the last
keeps none and holds one, the one brought back).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from lightning_pipe.runtime.activations.recomputation import RECOMPUTE_MODES, RecomputeMode
from lightning_pipe.schedules import ScheduleTraits, peak_in_flight, positions_for, schedule_for

#: one stage's choice: off (None/False), all (True) or the micro-batches kept resident (int >= 0)
StageOffload = bool | int | None
OffloadSpec = StageOffload | str | Sequence[StageOffload]

_HOW = (
    "Give False (keep every activation), True (offload every micro-batch's saved tensors to host memory), an "
    "integer k >= 0 (keep k micro-batches on the device, offload the rest), a list of those with one per pipeline "
    "stage, or 'auto'."
)


RecomputeSpec = str | Sequence[str]

_RECOMPUTE_HOW = (
    f"Valid: {', '.join(RECOMPUTE_MODES)} (for every stage), a list of those with one per pipeline stage "
    "(processes x virtual_stages), or 'auto'."
)


def check_recompute(value: Any) -> None:
    """Refuse a recompute value that no layout can take (the list's length is checked at setup)."""
    if value == "auto" or value in RECOMPUTE_MODES:
        return
    if isinstance(value, (list, tuple)) and value and all(v in RECOMPUTE_MODES for v in value):
        return
    raise ValueError(f"PipelineStrategy(recompute={value!r}): unknown mode. {_RECOMPUTE_HOW}")


def uniform_recompute(value: RecomputeSpec) -> str | None:
    """The one mode every stage runs, or None where stages differ (a list) or the schedule decides (``"auto"``)."""
    if isinstance(value, str):
        return None if value == "auto" else value
    modes = set(value)
    return next(iter(modes)) if len(modes) == 1 else None


def recomputes_nothing(value: RecomputeSpec) -> bool:
    """Whether no stage ever recomputes (``"auto"`` may)."""
    return uniform_recompute(value) == "never"


def _peaks(
    schedule: ScheduleTraits, num_ranks: int, num_microbatches: int, virtual_stages: int
) -> tuple[list[int], int]:
    """Per pipeline stage the micro-batches in flight at its peak, and the last stage's."""
    peaks = peak_in_flight(schedule_for(schedule, num_ranks, num_microbatches, virtual_stages))
    num_stages = len(positions_for(schedule, num_ranks, virtual_stages))
    return [peaks.get(s, 0) for s in range(num_stages)], peaks.get(num_stages - 1, 1)


def _per_stage(name: str, value: Sequence[Any], schedule: ScheduleTraits, num_ranks: int, virtual_stages: int) -> None:
    num_stages = len(positions_for(schedule, num_ranks, virtual_stages))
    if len(value) != num_stages:
        raise ValueError(
            f"PipelineStrategy({name}={list(value)!r}) gives {len(value)} values but the pipeline has "
            f"{num_stages} stages ({num_ranks} processes, schedule {schedule.name!r}). Give one per stage, "
            "or a single value for all of them, or 'auto'."
        )


def recompute_per_stage(
    value: RecomputeSpec, schedule: ScheduleTraits, num_ranks: int, num_microbatches: int, virtual_stages: int
) -> tuple[RecomputeMode, ...]:
    """Per pipeline stage, its recompute mode."""
    check_recompute(value)
    num_stages = len(positions_for(schedule, num_ranks, virtual_stages))
    if value == "auto":
        peaks, last = _peaks(schedule, num_ranks, num_microbatches, virtual_stages)
        return tuple("always" if peak > last else "never" for peak in peaks)
    if isinstance(value, str):
        return (cast(RecomputeMode, value),) * num_stages
    _per_stage("recompute", value, schedule, num_ranks, virtual_stages)
    return tuple(cast(RecomputeMode, v) for v in value)


def _stage_value(value: Any) -> bool:
    return value is None or isinstance(value, bool) or (isinstance(value, int) and value >= 0)


def check_offload(value: Any) -> None:
    """Refuse a value that no layout can take, saying how to fix it (the list's length is checked at setup)."""
    if value == "auto" or _stage_value(value):
        return
    if isinstance(value, (list, tuple)) and value and all(_stage_value(v) for v in value):
        return
    raise ValueError(f"PipelineStrategy(offload={value!r}): {_HOW}")


def _keep(value: Any) -> int | None:
    if value is None or value is False:
        return None
    return 0 if value is True else int(value)


def offload_per_stage(
    value: OffloadSpec, schedule: ScheduleTraits, num_ranks: int, num_microbatches: int, virtual_stages: int
) -> tuple[int | None, ...]:
    """Per pipeline stage, the micro-batches it keeps resident (None: it offloads nothing)."""
    check_offload(value)
    num_stages = len(positions_for(schedule, num_ranks, virtual_stages))
    if value == "auto":
        peaks, last = _peaks(schedule, num_ranks, num_microbatches, virtual_stages)
        # ``last - 1`` from their forwards, plus the one brought back ahead of its backward: ``last`` at once
        return tuple(max(last - 1, 0) if peak > last else None for peak in peaks)
    assert not isinstance(value, str)
    if isinstance(value, Sequence):
        _per_stage("offload", value, schedule, num_ranks, virtual_stages)
        return tuple(_keep(v) for v in value)
    return (_keep(value),) * num_stages

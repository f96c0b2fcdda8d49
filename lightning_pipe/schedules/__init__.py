"""Schedules as data: per-rank action lists, their validation, simulation and rendering.

Nothing here touches ``torch.distributed``; the executor in :mod:`lightning_pipe.runtime` runs
the very lists these functions return.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_pipe.schedules.actions import Action, ActionKind, Schedule
from lightning_pipe.schedules.families.asynchronous import (
    drain_actions,
    pipedream,
    pipedream_2bw,
    pipemare,
    steady_state_bubble,
    step_actions,
    unroll,
    update_delay,
    versions_held,
    xpipe,
)
from lightning_pipe.schedules.families.chimera import chimera
from lightning_pipe.schedules.families.dualpipe import dualpipev
from lightning_pipe.schedules.families.interleaved import interleaved_1f1b, interleaved_zero_bubble
from lightning_pipe.schedules.families.sync import forward_only, forward_only_like, gpipe, one_f_one_b
from lightning_pipe.schedules.families.zero_bubble import zbv, zero_bubble
from lightning_pipe.schedules.from_traits import positions_for, schedule_for
from lightning_pipe.schedules.render import render
from lightning_pipe.schedules.rendezvous import RendezvousError, for_rendezvous
from lightning_pipe.schedules.simulate import (
    DeadlockError,
    Simulation,
    closed_form_bubble,
    peak_in_flight,
    peak_in_flight_per_rank,
    simulate,
)
from lightning_pipe.schedules.text import ScheduleTextError, format_schedule, load_schedule, parse_schedule
from lightning_pipe.schedules.traits import (
    ASYNC_SCHEDULES,
    DEFAULT_SCHEDULE,
    TRAITS,
    ScheduleName,
    ScheduleTraits,
    traits,
)
from lightning_pipe.schedules.validate import InvalidScheduleError, validate

ScheduleFn = Callable[[int, int], Schedule]

#: Training schedules by the name users pass as ``PipelineStrategy(schedule=...)``.
SCHEDULES: dict[str, ScheduleFn] = {name: t.make for name, t in TRAITS.items()}


#: Schedules with several stages per rank: the ones ``virtual_stages`` applies to, and its default.
VIRTUAL_STAGES: dict[str, int] = {name: t.virtual_stages for name, t in TRAITS.items() if t.virtual_stages > 1}


#: Schedules whose default placement of communication deadlocks where point-to-point calls
#: rendezvous (NCCL); ``build(..., rendezvous=True)`` regroups theirs with :func:`for_rendezvous`.
REGROUPED_FOR_RENDEZVOUS: frozenset[str] = frozenset(name for name, t in TRAITS.items() if t.regroup_for_rendezvous)


def build(
    name: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1, rendezvous: bool = False
) -> Schedule:
    """Schedule ``name`` for ``num_ranks`` ranks with ``virtual_stages`` stages each. With
    ``rendezvous`` (NCCL) the schedules in :data:`REGROUPED_FOR_RENDEZVOUS` come with their
    communication regrouped so that they finish there (same compute order); raises
    :class:`RendezvousError` where that is impossible (too few micro-batches). A run's own schedule
    is built from its resolved traits instead (:func:`~.from_traits.schedule_for`)."""
    return schedule_for(traits(name), num_ranks, num_microbatches, virtual_stages, rendezvous)


def stage_positions(name: str, num_ranks: int, virtual_stages: int) -> list[int]:
    """For each stage of schedule ``name``, the pipeline position (rank) that holds it (see
    :func:`~.from_traits.positions_for`)."""
    return positions_for(traits(name), num_ranks, virtual_stages)


def check_virtual_stages(name: str, virtual_stages: int) -> None:
    """Reject a stage count per rank that schedule ``name`` cannot run, saying which it can."""
    if not isinstance(virtual_stages, int) or isinstance(virtual_stages, bool) or virtual_stages < 1:
        raise ValueError(f"virtual_stages={virtual_stages!r}: give an integer >= 1 (stages per process).")
    t = traits(name)
    if t.text is not None and virtual_stages != t.virtual_stages:
        raise ValueError(
            f"virtual_stages={virtual_stages}: the schedule text {t.text.name!r} computes {t.virtual_stages} stage(s) "
            "on each line (rank). Leave virtual_stages unset, or give that number."
        )
    if t.interleaved and virtual_stages < 2:
        raise ValueError(
            f"schedule={name!r} with virtual_stages={virtual_stages}: interleaving needs at least 2 stages "
            f"per process. Use virtual_stages >= 2, or schedule={t.single!r}."
        )
    if not t.interleaved and t.virtual_stages > 1 and virtual_stages != t.virtual_stages:
        raise ValueError(
            f"schedule={name!r} holds exactly {t.virtual_stages} stages per process (a V); got "
            f"virtual_stages={virtual_stages}."
        )
    if t.virtual_stages == 1 and virtual_stages != 1:
        raise ValueError(
            f"schedule={name!r} runs one stage per process; got virtual_stages={virtual_stages}. Several stages per "
            "process need schedule='interleaved_1f1b' or 'interleaved_zero_bubble' (virtual_stages >= 2), or 'zbv' "
            "or 'dualpipev' (2)."
        )


def is_async(name: str) -> bool:
    """Asynchronous schedules keep work in flight across optimizer steps."""
    return traits(name).asynchronous


def get_schedule(name: str) -> ScheduleFn:
    """The schedule function called ``name``; the error lists the valid names."""
    return traits(name).make


__all__ = [
    "ASYNC_SCHEDULES",
    "DEFAULT_SCHEDULE",
    "REGROUPED_FOR_RENDEZVOUS",
    "SCHEDULES",
    "TRAITS",
    "VIRTUAL_STAGES",
    "Action",
    "ActionKind",
    "DeadlockError",
    "InvalidScheduleError",
    "RendezvousError",
    "Schedule",
    "ScheduleName",
    "ScheduleTextError",
    "ScheduleTraits",
    "Simulation",
    "build",
    "check_virtual_stages",
    "chimera",
    "closed_form_bubble",
    "drain_actions",
    "dualpipev",
    "for_rendezvous",
    "format_schedule",
    "forward_only",
    "forward_only_like",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "interleaved_zero_bubble",
    "is_async",
    "load_schedule",
    "one_f_one_b",
    "parse_schedule",
    "peak_in_flight",
    "peak_in_flight_per_rank",
    "pipedream",
    "pipedream_2bw",
    "pipemare",
    "positions_for",
    "render",
    "schedule_for",
    "simulate",
    "stage_positions",
    "steady_state_bubble",
    "step_actions",
    "traits",
    "unroll",
    "update_delay",
    "validate",
    "versions_held",
    "xpipe",
    "zbv",
    "zero_bubble",
]

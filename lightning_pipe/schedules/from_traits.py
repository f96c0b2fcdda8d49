"""A schedule's action lists and stage positions from its traits, which a run resolves once.

Everything here reads a :class:`~.traits.ScheduleTraits` (a schedule text's parsed once with it)
and never a schedule's name, so code holding a run's resolved traits builds its schedules without
looking the schedule up again, and an edited schedule file cannot change a run under way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_pipe.schedules.actions import Schedule
from lightning_pipe.schedules.families.chimera import chimera_stage_to_rank
from lightning_pipe.schedules.families.zero_bubble import zbv_stage_to_rank
from lightning_pipe.schedules.rendezvous import for_rendezvous
from lightning_pipe.schedules.simulate import DeadlockError, simulate
from lightning_pipe.schedules.text import text_for_run

if TYPE_CHECKING:
    from lightning_pipe.schedules.traits import ScheduleTraits


def schedule_for(
    traits: ScheduleTraits, num_ranks: int, num_microbatches: int, virtual_stages: int = 1, rendezvous: bool = False
) -> Schedule:
    """The schedule of ``traits`` for ``num_ranks`` ranks with ``virtual_stages`` stages each. With
    ``rendezvous`` (NCCL) a schedule whose communication would deadlock there comes regrouped with
    :func:`~.rendezvous.for_rendezvous` (same compute order); raises
    :class:`~.rendezvous.RendezvousError` where that is impossible (too few micro-batches)."""
    if traits.interleaved:
        schedule = traits.make(num_ranks, num_microbatches, virtual_stages)
    else:
        schedule = traits.make(num_ranks, num_microbatches)
    if rendezvous and (traits.regroup_for_rendezvous or (traits.text is not None and not _finishes(schedule))):
        return for_rendezvous(schedule)
    return schedule


def positions_for(traits: ScheduleTraits, num_ranks: int, virtual_stages: int) -> list[int]:
    """For each stage of the schedule of ``traits`` (``num_ranks x virtual_stages``; a mirrored
    schedule's ``2 x num_ranks``, two copies of ``num_ranks``), the pipeline position (rank) that holds it."""
    if traits.text is not None:
        return list(text_for_run(traits.text, num_ranks, traits.text.num_microbatches).stage_to_rank)
    if traits.placement == "v":
        return zbv_stage_to_rank(num_ranks)
    if traits.placement == "mirror":
        return chimera_stage_to_rank(num_ranks)
    return [s % num_ranks for s in range(num_ranks * virtual_stages)]


def _finishes(schedule: Schedule) -> bool:
    """Whether ``schedule`` finishes where point-to-point calls rendezvous, as written."""
    try:
        simulate(schedule, rendezvous=True)
    except DeadlockError:
        return False
    return True

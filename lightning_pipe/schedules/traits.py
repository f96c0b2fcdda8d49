"""Each schedule's traits, in one table that every other module asks.

A schedule is more than its action lists: whether it keeps work in flight across optimizer steps,
how many stages a process holds and where, whether it runs each stage twice, what it refuses. Code
outside ``schedules/`` reads these traits instead of comparing schedule names, so a new schedule is
one row here (and its action lists in its family's module).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lightning_pipe.schedules.actions import Schedule
from lightning_pipe.schedules.asynchronous import ASYNC_SCHEDULES, pipedream, pipedream_2bw, pipemare, wpipe, xpipe
from lightning_pipe.schedules.chimera import chimera, chimera_stage_to_rank
from lightning_pipe.schedules.dualpipe import dualpipev, dualpipev_min_chunks
from lightning_pipe.schedules.interleaved import interleaved_1f1b, interleaved_zero_bubble
from lightning_pipe.schedules.sync import gpipe, one_f_one_b
from lightning_pipe.schedules.zero_bubble import zbv, zbv_stage_to_rank, zero_bubble

#: The schedule ``PipelineStrategy`` runs unless told otherwise.
DEFAULT_SCHEDULE = "1f1b"

#: Where a process's stages lie: every ``p``-th stage (``"loop"``), a V (``"v"``: stages ``r`` and
#: ``2p - 1 - r``), or Chimera's mirrored copies (``"mirror"``: stage ``p + k`` on process ``p - 1 - k``).
PLACEMENTS = ("loop", "v", "mirror")


@dataclass(frozen=True)
class ScheduleTraits:
    """What one schedule is, beyond its action lists."""

    #: the name users pass as ``PipelineStrategy(schedule=...)``
    name: str
    #: ``(ranks, micro-batches) -> Schedule``; for interleaved schedules ``(ranks, micro-batches, virtual_stages)``
    make: Callable[..., Schedule]
    #: keeps work in flight across optimizer steps (no flush), gradients applied late
    asynchronous: bool = False
    #: the backward is split into input-gradient (B) and weight-gradient (W) actions
    split_backward: bool = False
    #: stages per process by default; ``interleaved`` schedules take any value >= 2
    virtual_stages: int = 1
    #: takes ``virtual_stages`` >= 2 as an argument of ``make``
    interleaved: bool = False
    #: for an interleaved schedule, the one-stage-per-process schedule it interleaves
    single: str | None = None
    #: where a process's stages lie (one of :data:`PLACEMENTS`)
    placement: str = "loop"
    #: each split stage runs twice, in two pipelines of opposite directions (Chimera): the schedule
    #: has ``2 x ranks`` stages, the copy of split stage ``k`` on the process mirrored to ``k``'s
    mirrored: bool = False
    #: PipeDream's weight stashing: a batch's backwards run on the version its forwards used
    stashes_weights: bool = False
    #: PipeMare: no stash; backwards on weights predicted for their forward (its techniques default on)
    predicts_weights: bool = False
    #: XPipe: forwards and backwards on the weights predicted for the update that applies their gradient
    predicts_ahead: bool = False
    #: applies gradients with a different delay per stage, so copies of a tied weight would drift
    refuses_ties: bool = False
    #: its default placement of communication deadlocks where point-to-point calls rendezvous (NCCL)
    regroup_for_rendezvous: bool = False
    #: runs on a block container (``module=`` naming an ``nn.ModuleList`` the model loops over)
    block_containers: bool = True
    #: combines with data-parallel replicas of the pipeline
    replicas: bool = True
    #: needs an even number of pipeline stages (Chimera pairs process ``i`` with ``p - 1 - i``)
    even_stages: bool = False
    #: ranked by the planner (``plan="auto"``, ``lightning-pipe plan``)
    planned: bool = True
    #: the fewest pipeline stages the planner ranks it for (Chimera: 4; on 2 processes each holds the whole
    #: model, and the pair's sum of every gradient and the whole model's optimizer step cost more than the
    #: bubble it removes: measured slower than 1F1B on 2 processes, though its prediction ranked it first)
    planned_from: int = 1
    #: ``ranks -> the fewest micro-batches it runs`` (DualPipeV: one per stage), None: any
    min_chunks: Callable[[int], int] | None = None
    #: pairs one micro-batch's forward with another's backward (DualPipe's F&B) for the executor
    #: to run at once (:attr:`~lightning_pipe.schedules.actions.Schedule.overlapped`)
    overlaps: bool = False


TRAITS: dict[str, ScheduleTraits] = {
    t.name: t
    for t in (
        ScheduleTraits("gpipe", gpipe),
        ScheduleTraits("1f1b", one_f_one_b),
        ScheduleTraits(
            "interleaved_1f1b",
            interleaved_1f1b,
            virtual_stages=2,
            interleaved=True,
            single="1f1b",
            regroup_for_rendezvous=True,
        ),
        ScheduleTraits("zero_bubble", zero_bubble, split_backward=True),
        ScheduleTraits(
            "interleaved_zero_bubble",
            interleaved_zero_bubble,
            split_backward=True,
            virtual_stages=2,
            interleaved=True,
            single="zero_bubble",
            regroup_for_rendezvous=True,
        ),
        ScheduleTraits("zbv", zbv, split_backward=True, virtual_stages=2, placement="v", regroup_for_rendezvous=True),
        ScheduleTraits(
            "dualpipev",
            dualpipev,
            split_backward=True,
            virtual_stages=2,
            placement="v",
            regroup_for_rendezvous=True,
            min_chunks=dualpipev_min_chunks,
            overlaps=True,
        ),
        ScheduleTraits(
            "chimera",
            chimera,
            placement="mirror",
            mirrored=True,
            regroup_for_rendezvous=True,
            block_containers=False,
            replicas=False,
            even_stages=True,
            planned_from=4,
        ),
        ScheduleTraits(
            "pipedream", pipedream, asynchronous=True, stashes_weights=True, refuses_ties=True, planned=False
        ),
        ScheduleTraits("pipedream_2bw", pipedream_2bw, asynchronous=True, stashes_weights=True, planned=False),
        ScheduleTraits(
            "pipemare", pipemare, asynchronous=True, predicts_weights=True, refuses_ties=True, planned=False
        ),
        ScheduleTraits("xpipe", xpipe, asynchronous=True, predicts_ahead=True, refuses_ties=True, planned=False),
        # WPipe: 2BW's stash on the first half of the stages (2 weight copies), none on the second (1 copy;
        # ``asynchronous.versions_held``); the halves' delays differ (1 and 0), so ties are refused
        ScheduleTraits("wpipe", wpipe, asynchronous=True, stashes_weights=True, refuses_ties=True, planned=False),
    )
}

assert {n for n, t in TRAITS.items() if t.asynchronous} == set(ASYNC_SCHEDULES), (
    "the async family and the table disagree"
)


def traits(name: str) -> ScheduleTraits:
    """The traits of schedule ``name``; the error lists the valid names."""
    try:
        return TRAITS[name]
    except KeyError:
        raise ValueError(f"Unknown pipeline schedule {name!r}. Valid schedules: {', '.join(sorted(TRAITS))}.") from None


def stage_positions(name: str, num_ranks: int, virtual_stages: int) -> list[int]:
    """For each stage of schedule ``name`` (``num_ranks x virtual_stages``; a mirrored schedule's
    ``2 x num_ranks``, two copies of ``num_ranks``), the pipeline position (rank) that holds it."""
    placement = traits(name).placement
    if placement == "v":
        return zbv_stage_to_rank(num_ranks)
    if placement == "mirror":
        return chimera_stage_to_rank(num_ranks)
    return [s % num_ranks for s in range(num_ranks * virtual_stages)]


def stage_counts(name: str, candidates: list[int]) -> list[int]:
    """The stages per process schedule ``name`` can run, of ``candidates`` (for an interleaved one)."""
    t = traits(name)
    return list(candidates) if t.interleaved else [t.virtual_stages]


__all__ = ["DEFAULT_SCHEDULE", "PLACEMENTS", "TRAITS", "ScheduleTraits", "stage_counts", "stage_positions", "traits"]

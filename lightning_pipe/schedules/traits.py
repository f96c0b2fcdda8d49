"""Each schedule's traits, in one table that every other module asks.

A schedule is more than its action lists: whether it keeps work in flight across optimizer steps,
how many stages a process holds and where, whether it runs each stage twice, what it refuses. Code
outside ``schedules/`` reads these traits instead of comparing schedule names, so a new schedule is
one row here (and its action lists in its family's module).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from lightning_pipe.schedules.actions import Schedule
from lightning_pipe.schedules.families.asynchronous import pipedream, pipedream_2bw, pipemare, wpipe, xpipe
from lightning_pipe.schedules.families.chimera import chimera
from lightning_pipe.schedules.families.dualpipe import dualpipev, dualpipev_min_chunks
from lightning_pipe.schedules.families.interleaved import interleaved_1f1b, interleaved_zero_bubble
from lightning_pipe.schedules.families.sync import gpipe, one_f_one_b
from lightning_pipe.schedules.families.zero_bubble import zbv, zero_bubble
from lightning_pipe.schedules.text import ScheduleTextError, is_schedule_text, load_schedule, text_for_run

#: The built-in schedules' names, for the type checker and editors; :data:`TRAITS` holds one entry per name
#: (tests/schedules/test_traits.py checks that both list the same names, in the same order).
ScheduleName = Literal[
    "gpipe",
    "1f1b",
    "interleaved_1f1b",
    "zero_bubble",
    "interleaved_zero_bubble",
    "zbv",
    "dualpipev",
    "chimera",
    "pipedream",
    "pipedream_2bw",
    "pipemare",
    "xpipe",
    "wpipe",
]

#: The schedule ``PipelineStrategy`` runs unless told otherwise.
DEFAULT_SCHEDULE: ScheduleName = "1f1b"

#: Where a process's stages lie: every ``p``-th stage (``"loop"``), a V (``"v"``: stages ``r`` and
#: ``2p - 1 - r``), Chimera's mirrored copies (``"mirror"``: stage ``p + k`` on process ``p - 1 - k``),
#: or where a schedule text computes them (``"text"``).
PLACEMENTS = ("loop", "v", "mirror", "text")


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
    #: its micro-batches go through a process's stages in rounds, so it takes only counts that
    #: :func:`~lightning_pipe.schedules.families.interleaved.valid_microbatches` keeps (a short last batch
    #: runs in fewer)
    rounds: bool = False
    #: where a process's stages lie (one of :data:`PLACEMENTS`)
    placement: str = "loop"
    #: each split stage runs twice, in two pipelines of opposite directions (Chimera): the schedule
    #: has ``2 x ranks`` stages, the copy of split stage ``k`` on the process mirrored to ``k``'s
    mirrored: bool = False
    #: PipeDream's weight stashing: a batch's backwards run on the version its forwards used
    stashes_weights: bool = False
    #: PipeDream-2BW: every stage applies its gradient one update late (the delay error feedback corrects)
    one_step_delay: bool = False
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
    #: carries the values that blocks record (router logits, hidden states) and the values a block returns for
    #: the next (T5's position biases) with their micro-batch: every built-in schedule (the chain ones and Chimera
    #: as plain training, the stashing rules as their one-process reference, PipeMare and XPipe as the same model
    #: run as a Sequential does); not a schedule given as text, which no test has run with them
    records_cross: bool = False
    #: pairs one micro-batch's forward with another's backward (DualPipe's F&B) for the executor
    #: to run at once (:attr:`~lightning_pipe.schedules.actions.Schedule.overlapped`)
    overlaps: bool = False
    #: a schedule handed in as text (:mod:`.text`): its one schedule, for its ranks and micro-batches only
    text: Schedule | None = None

    @property
    def label(self) -> str:
        """How messages name the schedule: its name, or a text's file name."""
        return f"text {self.text.name!r}" if self.text is not None else self.name


TRAITS: dict[str, ScheduleTraits] = {
    t.name: t
    for t in (
        ScheduleTraits("gpipe", gpipe, records_cross=True),
        ScheduleTraits("1f1b", one_f_one_b, records_cross=True),
        ScheduleTraits(
            "interleaved_1f1b",
            interleaved_1f1b,
            virtual_stages=2,
            interleaved=True,
            single="1f1b",
            rounds=True,
            regroup_for_rendezvous=True,
            records_cross=True,
        ),
        ScheduleTraits("zero_bubble", zero_bubble, split_backward=True, records_cross=True),
        ScheduleTraits(
            "interleaved_zero_bubble",
            interleaved_zero_bubble,
            split_backward=True,
            virtual_stages=2,
            interleaved=True,
            single="zero_bubble",
            rounds=True,
            regroup_for_rendezvous=True,
            records_cross=True,
        ),
        ScheduleTraits(
            "zbv",
            zbv,
            split_backward=True,
            virtual_stages=2,
            placement="v",
            regroup_for_rendezvous=True,
            records_cross=True,
        ),
        ScheduleTraits(
            "dualpipev",
            dualpipev,
            split_backward=True,
            virtual_stages=2,
            placement="v",
            regroup_for_rendezvous=True,
            min_chunks=dualpipev_min_chunks,
            overlaps=True,
            records_cross=True,
        ),
        ScheduleTraits(
            "chimera",
            chimera,
            placement="mirror",
            mirrored=True,
            regroup_for_rendezvous=True,
            replicas=False,
            even_stages=True,
            planned_from=4,
            records_cross=True,
        ),
        ScheduleTraits(
            "pipedream",
            pipedream,
            asynchronous=True,
            stashes_weights=True,
            refuses_ties=True,
            planned=False,
            records_cross=True,
        ),
        ScheduleTraits(
            "pipedream_2bw",
            pipedream_2bw,
            asynchronous=True,
            stashes_weights=True,
            one_step_delay=True,
            planned=False,
            records_cross=True,
        ),
        ScheduleTraits(
            "pipemare",
            pipemare,
            asynchronous=True,
            predicts_weights=True,
            refuses_ties=True,
            planned=False,
            records_cross=True,
        ),
        ScheduleTraits(
            "xpipe",
            xpipe,
            asynchronous=True,
            predicts_ahead=True,
            refuses_ties=True,
            planned=False,
            records_cross=True,
        ),
        # WPipe: 2BW's stash on the first half of the stages (2 weight copies), none on the second (1 copy;
        # ``asynchronous.versions_held``); the halves' delays differ (1 and 0), so ties are refused
        ScheduleTraits(
            "wpipe",
            wpipe,
            asynchronous=True,
            stashes_weights=True,
            refuses_ties=True,
            planned=False,
            records_cross=True,
        ),
    )
}

#: The schedules that keep work in flight across optimizer steps (the ``asynchronous`` column).
ASYNC_SCHEDULES = tuple(name for name, t in TRAITS.items() if t.asynchronous)


def traits(name: str) -> ScheduleTraits:
    """The traits of schedule ``name`` (a built-in's, or a schedule text's or its path's: see
    :func:`text_traits`); the error lists the valid names."""
    if name in TRAITS:
        return TRAITS[name]
    if is_schedule_text(name):
        return text_traits(name)
    raise ValueError(
        f"Unknown pipeline schedule {name!r}. Valid schedules: {', '.join(sorted(TRAITS))}; your own goes in "
        f"schedule_text=: the path of a .csv or .txt file, or the text itself (one line of actions per rank)."
    )


def text_traits(spec: str) -> ScheduleTraits:
    """A schedule text's traits: synchronous; its stages where it computes them, as many on each
    rank; its backward split where it has I or W; its own micro-batch count (a short last batch runs its
    first micro-batches: :func:`~.text.first_microbatches`). Refuses, before any
    process runs it, a text that training cannot run."""
    return _text_traits(spec, load_schedule(spec))


@functools.lru_cache(maxsize=16)
def _text_traits(spec: str, schedule: Schedule) -> ScheduleTraits:
    where = f"schedule text {schedule.name!r}"
    if schedule.forward_only:
        raise ScheduleTextError(f"{where} has no backward (B or I): a training schedule runs each forward's backward")
    if schedule.chains > 1:
        raise ScheduleTextError(
            f"{where} sends its micro-batches through {schedule.chains} chains of stages, Chimera's mirrored "
            "pipelines, whose copies of each stage the built-in keeps in step: use schedule='chimera'"
        )
    held = [len(schedule.stages_of(r)) for r in range(schedule.num_ranks)]
    if len(set(held)) > 1:
        raise ScheduleTextError(
            f"{where}: its lines (ranks) compute {held} stages; the layers are split into ranks x stages per rank, "
            "so give every line the same number of stages"
        )
    return ScheduleTraits(
        name=spec,
        make=functools.partial(text_for_run, schedule),
        split_backward=schedule.split_backward,
        virtual_stages=held[0],
        placement="text",
        planned=False,
        overlaps=bool(schedule.overlapped),
        text=schedule,
    )


def stage_counts(name: str, candidates: list[int]) -> list[int]:
    """The stages per process schedule ``name`` can run, of ``candidates`` (for an interleaved one)."""
    t = traits(name)
    return list(candidates) if t.interleaved else [t.virtual_stages]

"""Schedules as text: one line per rank, so that a user's own schedule runs like a built-in one.

Each line lists one rank's actions in order, separated by commas and/or spaces. An action is
``{stage}{kind}{micro-batch}``, torch.distributed.pipelining's CSV cells (``1F0``: stage 1's
forward of micro-batch 0), or the way an :class:`~.actions.Action` prints (``F0@s1``). Kinds, as
torch means them, mixed in one text as torch mixes them: ``F`` (forward), ``B`` (the whole
backward), ``I`` (the input gradient) and ``W`` (the weight gradient), and the communication
``SEND_F``, ``RECV_F``, ``SEND_B``, ``RECV_B``. Empty cells, blank lines and ``#`` comments are
skipped, and so are torch's ``UNSHARD``, ``RESHARD`` and ``REDUCE_GRAD`` (the strategy gathers,
frees and reduces a stage's parameters itself). A compute written ``+`` first (``+0B2``) runs
overlapped with the compute before it, as does torch's ``(0F3;3B1)OVERLAP_F_B`` (DualPipe's F&B
pairs).

What the text does not say is derived from it: the stages and micro-batches are the numbers it
uses, a stage lives on the line that computes it, a backward-free text is forward-only, an ``I``
or a ``W`` splits the backward (each ``B`` of such a text runs as its input gradient and, at once,
its weight gradient), micro-batches that each pass through a different block of stages make
chains (Chimera). A text without communication gets each rank's sends and receives placed as the
built-in schedules place theirs (:func:`~.comm.with_communication`); a text with communication
runs it as written, with the hand-overs between two stages of one line (which torch does not
write) placed at their computes. :func:`format_schedule` writes every built-in schedule so that
:func:`parse_schedule` reads back the same lists. Pure: no ``torch.distributed``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from lightning_pipe.schedules.actions import Action, ActionKind, Schedule
from lightning_pipe.schedules.comm import needs, produces, with_communication
from lightning_pipe.schedules.rendezvous import RendezvousError, for_rendezvous
from lightning_pipe.schedules.simulate import DeadlockError, simulate
from lightning_pipe.schedules.validate import InvalidScheduleError, validate

#: File endings that make a ``schedule=`` value a path to a text schedule.
TEXT_SUFFIXES = (".csv", ".txt")

_KINDS = {kind.value: kind for kind in ActionKind} | {"I": ActionKind.BACKWARD}
_KIND = "SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W"
_TORCH_CELL = re.compile(rf"(\d+)({_KIND})(-?\d+)")
_OWN_CELL = re.compile(rf"({_KIND})(-?\d+)@s(\d+)")
_OVERLAP_CELL = re.compile(r"\(([^()]*)\)OVERLAP_F_B")
#: torch's actions on a stage's parameters (FSDP's gather and free, data parallelism's reduction): skipped
_PARAMETER_CELL = re.compile(r"\d+(UNSHARD|RESHARD|REDUCE_GRAD)")
_RANK = re.compile(r"\brank (\d+)")


@dataclass(frozen=True)
class _Cell:
    """One compute or communication of a line as written: ``whole`` where it is a ``B`` (the whole
    backward, which a split text runs as its B and W), ``join`` where it overlaps the one before."""

    action: Action
    join: bool = False
    whole: bool = False


class ScheduleTextError(InvalidScheduleError):
    """A schedule text that cannot be read or run; the message names the line and the problem."""


def is_schedule_text(spec: str) -> bool:
    """Whether a ``schedule=`` value is a schedule's text or a path to one, not a schedule's name."""
    if not isinstance(spec, str):
        return False
    return "\n" in spec or "," in spec or spec.endswith(TEXT_SUFFIXES) or "/" in spec


def format_schedule(schedule: Schedule, compute_only: bool = False) -> str:
    """``schedule`` as text, one line per rank (torch.distributed.pipelining's CSV cells). A split
    backward's input gradient is written ``I``, as torch writes it (``B`` is the whole backward).
    ``compute_only`` leaves the communication out, for the reader to place as the built-in schedules do."""
    lines = []
    for rank, actions in enumerate(schedule.actions):
        joined = {a for unit in (schedule.overlapped[rank] if schedule.overlapped else ()) for a in unit[1:]}
        cells = []
        for action in actions:
            if compute_only and not action.kind.is_compute:
                continue
            kind = "I" if action.kind is ActionKind.BACKWARD and schedule.split_backward else action.kind.value
            cells.append(("+" if action in joined else "") + f"{action.stage}{kind}{action.microbatch}")
        lines.append(",".join(cells))
    return "\n".join(lines) + "\n"


def parse_schedule(text: str, name: str = "text") -> Schedule:
    """The :class:`Schedule` that ``text`` writes (see the module's docstring), not yet validated
    (:func:`load_schedule` validates). Raises :class:`ScheduleTextError` naming the line."""
    cells: list[list[_Cell]] = []
    lines: list[int] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        cells.append([c for cell in re.split(r"[,\s]+", line) if cell for c in _cells(cell, number)])
        lines.append(number)
    if not any(cells):
        raise ScheduleTextError("the schedule text has no actions: write one line of actions per rank, such as 0F0,0B0")
    # torch's meaning: B the whole backward, I the input gradient, W the weight gradient, mixed per action
    split_backward = any(c.action.kind is ActionKind.WEIGHT or (c.action.kind is ActionKind.BACKWARD and not c.whole)
                         for row in cells for c in row)  # fmt: skip
    if split_backward:  # each whole backward as its input gradient, then at once its weight gradient
        cells = [[d for c in row for d in _whole_split(c)] for row in cells]
    rows = [[c.action for c in row] for row in cells]
    joins = [[c.join for c in row] for row in cells]
    compute = [[a for a in row if a.kind.is_compute] for row in rows]
    stage_to_rank = _placement(compute, lines)
    num_stages = len(stage_to_rank)
    num_microbatches = max(1, max(a.microbatch for row in rows for a in row) + 1)  # below 0: refused on loading
    chains, chain_of = _chains(compute, num_stages, num_microbatches)
    units = _units(rows, joins, lines)
    forward_only = not any(a.kind is ActionKind.BACKWARD for row in compute for a in row)
    if not all(a.kind.is_compute for row in rows for a in row):
        rows = _with_hand_overs(rows, stage_to_rank, num_stages // chains)
    if all(a.kind.is_compute for row in rows for a in row):
        return with_communication(
            name, compute, num_stages, num_microbatches, stage_to_rank, forward_only, split_backward,
            chains, chain_of, units if any(units) else (),
        )  # fmt: skip
    return Schedule(
        name=name,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        stage_to_rank=tuple(stage_to_rank),
        actions=tuple(tuple(row) for row in rows),
        forward_only=forward_only,
        split_backward=split_backward,
        chains=chains,
        chain_of=tuple(chain_of),
        overlapped=tuple(tuple(tuple(u) for u in r) for r in units) if any(units) else (),
    )


def read_schedule_text(spec: str) -> tuple[str, str]:
    """``(text, name)`` of a ``schedule=`` value: the file's content where it is a path (the name
    is the file's), else the value itself (named ``"text"``)."""
    if "\n" in spec or "," in spec:
        return spec, "text"
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ScheduleTextError(
            f"schedule={spec!r}: no such file. Give a schedule's name, the path of a schedule text "
            f"({', '.join(TEXT_SUFFIXES)} files, one line of actions per rank), or the text itself."
        )
    return path.read_text(), path.name


def load_schedule(spec: str) -> Schedule:
    """The schedule that ``spec`` (a text or the path of one) writes, validated under gloo's
    communication model (NCCL's is checked when the run knows its backend). Errors name the line.
    A file is read at each call (an edited file counts), a text checked once."""
    return _checked(*read_schedule_text(spec))


@functools.lru_cache(maxsize=16)
def _checked(text: str, name: str) -> Schedule:
    try:
        schedule = parse_schedule(text, name)
    except ScheduleTextError as err:
        raise ScheduleTextError(f"schedule text {name!r}, {err}") from None
    lines = [n for n, raw in enumerate(text.splitlines(), start=1) if raw.split("#", 1)[0].strip()]
    for rank, actions in enumerate(schedule.actions):
        early = next((a for a in actions if a.microbatch < 0), None)
        if early is not None:
            raise ScheduleTextError(
                f"schedule text {name!r}, line {lines[rank]}: {early} is work of the batch before (micro-batch "
                f"{early.microbatch}), which keeps work in flight across optimizer steps. A text schedule is "
                "synchronous (each batch flushed); the asynchronous ones are built in: schedule='pipedream', "
                "'pipedream_2bw', 'pipemare', 'xpipe' or 'wpipe'."
            )
    try:
        validate(schedule, rendezvous=False)
    except InvalidScheduleError as err:
        message = _RANK.sub(lambda m: f"line {lines[int(m.group(1))]} (rank {m.group(1)})", str(err))
        raise ScheduleTextError(f"schedule text {name!r}: {message}") from None
    return schedule


def first_microbatches(schedule: Schedule, num_microbatches: int) -> Schedule:
    """``schedule`` for its first ``num_microbatches`` micro-batches only (a short last batch, which
    splits into fewer than the text numbers): every action of the others left out, each rank's order
    otherwise as written; an overlapped unit that loses a member runs what is left one compute after
    the other. Each remaining action waits for what it waited for before, or less, so under gloo's
    model a text that finishes still does (:func:`~.validate.validate` checks it again)."""
    if num_microbatches >= schedule.num_microbatches:
        return schedule
    kept = [tuple(a for a in actions if a.microbatch < num_microbatches) for actions in schedule.actions]
    units = tuple(
        tuple(unit for unit in mine if all(a.microbatch < num_microbatches for a in unit))
        for mine in schedule.overlapped
    )
    return replace(
        schedule,
        num_microbatches=num_microbatches,
        actions=tuple(kept),
        chain_of=schedule.chain_of[:num_microbatches],
        overlapped=units if any(units) else (),
    )


def text_for_run(schedule: Schedule, num_ranks: int, num_microbatches: int) -> Schedule:
    """The text's schedule for a run of ``num_ranks`` and a batch of ``num_microbatches``: as written, or,
    for a short last batch that splits into fewer, with the missing micro-batches' actions left out."""
    if num_ranks != schedule.num_ranks or not 1 <= num_microbatches <= schedule.num_microbatches:
        raise ScheduleTextError(
            f"schedule text {schedule.name!r} is written for {schedule.num_ranks} pipeline stages (lines) and "
            f"{schedule.num_microbatches} micro-batches; asked for {num_ranks} and {num_microbatches}. Give "
            f"stages={schedule.num_ranks} and chunks={schedule.num_microbatches} (a short last batch runs the "
            "text's first micro-batches), or write the text for this run."
        )
    return first_microbatches(schedule, num_microbatches)


def forward_like_text(schedule: Schedule, num_microbatches: int, rendezvous: bool = False) -> Schedule:
    """Evaluation on a schedule text's stages, for any micro-batch count: the first order that
    finishes, with its communication regrouped where point-to-point calls rendezvous (NCCL) and it
    needs it, of: each rank runs, of the forwards whose input is there, the one that can start
    first (the deeper stage first, or the earlier micro-batch first); each rank runs all
    micro-batches through one of its stages after the other. Raises :class:`RendezvousError` where
    none finishes."""
    stages = [schedule.stages_of(r) for r in range(schedule.num_ranks)]
    orders = [
        _earliest_first(schedule, num_microbatches, deeper=True),
        _earliest_first(schedule, num_microbatches, deeper=False),
        [[Action(ActionKind.FORWARD, s, i) for s in mine for i in range(num_microbatches)] for mine in stages],
    ]
    errors = []
    for order in orders:
        forward = with_communication(
            "forward", order, schedule.num_stages, num_microbatches, schedule.stage_to_rank, forward_only=True
        )
        try:
            simulate(forward, rendezvous=rendezvous)
            return forward
        except DeadlockError:
            pass
        try:
            return for_rendezvous(forward)
        except RendezvousError as err:
            errors.append(str(err))
    raise RendezvousError(errors[0])


def _earliest_first(schedule: Schedule, num_microbatches: int, deeper: bool) -> list[list[Action]]:
    """Each rank's forwards in the order a list scheduler starts them, each costing one unit."""
    order: list[list[Action]] = [[] for _ in range(schedule.num_ranks)]
    free = [0] * schedule.num_ranks  # when each rank is next idle
    done: dict[tuple[int, int], int] = {}  # (stage, micro-batch) -> when its output is there
    while len(done) < schedule.num_stages * num_microbatches:
        _, _, stage, microbatch = min(
            (max(free[schedule.rank_of(s)], done.get((s - 1, i), 0)), -s if deeper else i, s, i)
            for s in range(schedule.num_stages)
            for i in range(num_microbatches)
            if (s, i) not in done and (s == 0 or (s - 1, i) in done)
        )
        rank = schedule.rank_of(stage)
        start = max(free[rank], done.get((stage - 1, microbatch), 0))
        order[rank].append(Action(ActionKind.FORWARD, stage, microbatch))
        done[(stage, microbatch)] = free[rank] = start + 1
    return order


def _cells(cell: str, line: int) -> list[_Cell]:
    """What one cell writes: an action, none (torch's actions on a stage's parameters), or the
    computes of torch's overlapped pair, the later ones joined to the first."""
    if _PARAMETER_CELL.fullmatch(cell):
        return []
    if match := _OVERLAP_CELL.fullmatch(cell):
        parts = [part.strip() for part in match.group(1).split(";") if part.strip()]
        if not parts:
            raise ScheduleTextError(f"line {line}: {cell!r} overlaps no compute: write (0F3;3B1)OVERLAP_F_B")
        pair = [_cell(part, line) for part in parts]
        if not all(c.action.kind.is_compute for c in pair):
            raise ScheduleTextError(f"line {line}: {cell!r}: an overlapped pair holds computes (F, B, I, W) only")
        return [replace(c, join=k > 0) for k, c in enumerate(pair)]
    return [_cell(cell, line)]


def _cell(cell: str, line: int) -> _Cell:
    join = cell.startswith("+")
    body = cell[1:] if join else cell
    if match := _TORCH_CELL.fullmatch(body):
        stage, kind, microbatch = match.groups()
    elif match := _OWN_CELL.fullmatch(body):
        kind, microbatch, stage = match.groups()
    else:
        raise ScheduleTextError(
            f"line {line}: {cell!r} is not an action. Write {{stage}}{{kind}}{{micro-batch}} such as 1F0 (stage 1's "
            "forward of micro-batch 0) or F0@s1; kinds: F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B (torch's "
            "UNSHARD, RESHARD and REDUCE_GRAD are skipped, its (0F3;3B1)OVERLAP_F_B read as an overlapped pair)."
        )
    action = Action(_KINDS[kind], int(stage), int(microbatch))
    if join and not action.kind.is_compute:
        raise ScheduleTextError(f"line {line}: {cell!r}: only a compute (F, B, I, W) joins an overlapped unit ('+')")
    return _Cell(action, join, whole=kind == "B")


def _whole_split(cell: _Cell) -> list[_Cell]:
    """A whole backward (``B``) in a text whose backward is split: its input gradient, then its weight
    gradient at once (in the same overlapped unit where it is in one): what ``B`` computes, in two."""
    if not cell.whole:
        return [cell]
    a = cell.action
    return [_Cell(a, cell.join), _Cell(Action(ActionKind.WEIGHT, a.stage, a.microbatch), cell.join)]


def _with_hand_overs(rows: Sequence[Sequence[Action]], stage_to_rank: Sequence[int], length: int) -> list[list[Action]]:
    """Each line with the hand-overs between two of its own stages that it does not write (torch's
    texts leave them out): the send right after the compute that produces it, the receive right
    before the compute that needs it."""
    out: list[list[Action]] = []
    for row in rows:
        written = set(row)
        actions: list[Action] = []
        for action in row:
            if not action.kind.is_compute:
                actions.append(action)
                continue
            missing = [a for a in (*needs(action, length), *produces(action, length)) if a not in written]
            local = [a for a in missing if stage_to_rank[a.peer_stage()] == stage_to_rank[a.stage]]
            actions += [a for a in local if a.kind.is_recv] + [action] + [a for a in local if a.kind.is_send]
        out.append(actions)
    return out


def _placement(compute: Sequence[Sequence[Action]], lines: Sequence[int]) -> list[int]:
    """Each stage's rank: the line that computes it, once; the stages 0..S-1 all there."""
    owner: dict[int, int] = {}
    for rank, row in enumerate(compute):
        for action in row:
            other = owner.setdefault(action.stage, rank)
            if other != rank:
                raise ScheduleTextError(
                    f"line {lines[rank]}: stage {action.stage} is computed on line {lines[other]} too; a stage lives "
                    "on one rank (one line)"
                )
    for rank, row in enumerate(compute):
        if not row:
            raise ScheduleTextError(f"line {lines[rank]}: no compute (F, B, I, W): every rank holds a stage")
    missing = sorted(set(range(max(owner) + 1)) - set(owner))
    if missing:
        raise ScheduleTextError(
            f"stage(s) {missing} computed on no line: number the stages 0..{max(owner)} without a gap"
        )
    return [owner[s] for s in range(len(owner))]


def _chains(compute: Sequence[Sequence[Action]], num_stages: int, num_microbatches: int) -> tuple[int, list[int]]:
    """Chains (Chimera's pipelines) where each micro-batch's forwards cover one block of the stages
    and not all of them; else one chain (what is missing, :func:`validate` names)."""
    stages: list[set[int]] = [set() for _ in range(num_microbatches)]
    for row in compute:
        for action in row:
            if action.kind is ActionKind.FORWARD:
                stages[action.microbatch].add(action.stage)
    length = len(stages[0])
    if not length or length == num_stages or num_stages % length:
        return 1, []
    chain_of = [min(s) // length if s else 0 for s in stages]
    if any(s != set(range(c * length, (c + 1) * length)) for s, c in zip(stages, chain_of)):
        return 1, []
    return num_stages // length, chain_of


def _units(
    rows: Sequence[Sequence[Action]], joins: Sequence[Sequence[bool]], lines: Sequence[int]
) -> list[list[list[Action]]]:
    """Each rank's overlapped units: a compute with its ``+`` computes that follow."""
    units: list[list[list[Action]]] = []
    for row, joined, line in zip(rows, joins, lines):
        mine: list[list[Action]] = []
        last: Action | None = None
        for action, join in zip(row, joined):
            if not action.kind.is_compute:
                continue
            if join:
                if last is None:
                    raise ScheduleTextError(
                        f"line {line}: +{action} joins no compute before it ('+' runs a compute with the one before)"
                    )
                if not mine or mine[-1][-1] != last:
                    mine.append([last])
                mine[-1].append(action)
            last = action
        units.append(mine)
    return units

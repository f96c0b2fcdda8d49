"""Run a schedule on paper: timing, bubble, memory, and deadlock detection.

The model is the strictest the executor can meet. Each rank posts its consecutive communication
actions as one group; groups of a rank complete in posting order (one stream per rank, as with
NCCL's rendezvous point-to-point); a send and its receive complete only while both of their
groups are at the head of their rank's queue; a receive is posted only after its peer posted the
matching send of an activation (the receiver may have to read a shape header first; gradient
shapes are known locally), and (in gloo's model below) while it waits for that, the sends of its
group go out as a group of their own; a compute action waits for
the receive it consumes. A send between two stages of one rank is a hand-over in memory: it
completes when posted and takes no place in the queue; its receive completes when posted after it.
A schedule that finishes under this model cannot hang under gloo or NCCL.

Costs are per action: F, B and W (the weight gradient of a split backward). Where a schedule does
not split its backward, B is the whole backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_pipe.schedules.actions import Action, ActionKind, Schedule, comm_groups
from lightning_pipe.schedules.comm import needs


class DeadlockError(RuntimeError):
    """The schedule cannot finish: every rank waits on another."""


@dataclass
class _Group:
    rank: int
    ops: list[Action]
    post_time: float
    active_time: float | None = None
    done: dict[Action, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Simulation:
    """What one batch costs under a schedule, in units of the forward time."""

    schedule: Schedule
    makespan: float
    busy: tuple[float, ...]  # compute time per rank
    start_times: dict[tuple[int, Action], float]
    forward_cost: float
    backward_cost: float
    weight_cost: float = 0.0
    #: per stage (forward, backward) or (forward, B, W), when given
    stage_costs: tuple[tuple[float, ...], ...] | None = None

    def cost(self, action: Action) -> float:
        """What ``action`` took in this simulation."""
        if self.stage_costs is not None:
            return _stage_cost(self.stage_costs[action.stage], action, self.schedule.split_backward)
        return _cost(action, self.forward_cost, self.backward_cost, self.weight_cost)

    @property
    def bubble_fraction(self) -> float:
        """Share of rank-time spent idle: ``1 - sum(busy) / (ranks * makespan)``."""
        total = self.schedule.num_ranks * self.makespan
        return 0.0 if total == 0 else 1.0 - sum(self.busy) / total


def _cost(action: Action, forward: float, backward: float, weight: float) -> float:
    if action.kind is ActionKind.FORWARD:
        return forward
    return backward if action.kind is ActionKind.BACKWARD else weight


def _stage_cost(costs: tuple[float, ...], action: Action, split: bool) -> float:
    """``action``'s cost from its stage's (forward, backward) or (forward, B, W): a split
    backward given as one figure is B and W at half of it each."""
    if action.kind is ActionKind.FORWARD:
        return costs[0]
    if len(costs) == 3:
        if action.kind is ActionKind.WEIGHT:
            return costs[2]
        return costs[1] if split else costs[1] + costs[2]
    return costs[1] / 2 if split else costs[1]


def split_costs(schedule: Schedule, backward_cost: float, weight_cost: float | None) -> tuple[float, float]:
    """(B, W) costs: as given, or, where the schedule splits its backward and no W cost is given,
    half of ``backward_cost`` each (so a whole backward costs the same under every schedule)."""
    if weight_cost is not None:
        return backward_cost, weight_cost
    if schedule.split_backward:
        return backward_cost / 2, backward_cost / 2
    return backward_cost, 0.0


def simulate(
    schedule: Schedule,
    forward_cost: float = 1.0,
    backward_cost: float = 2.0,
    weight_cost: float | None = None,
    rendezvous: bool = True,
    stage_costs: Sequence[tuple[float, ...]] | None = None,
    overlap: float | None = None,
) -> Simulation:
    """Play ``schedule`` with fixed per-action costs, or per-stage ``(forward, backward)`` costs
    (unequal stages, as a planner predicts them; a split backward's B and W take half the backward
    each) or ``(forward, B, W)`` costs (as measured; an unsplit backward costs B + W); raises
    :class:`DeadlockError` if it hangs. ``weight_cost`` is W's cost; without it a split
    backward's B and W take half of ``backward_cost`` each. With ``rendezvous`` false the model is
    gloo's instead of NCCL's: every posted send and receive proceeds on its own (matched per peer
    and tag), whatever else the rank posted before; only shape headers and the compute that
    consumes a receive wait. ``overlap``: the schedule's overlapped units (DualPipe's F&B) run as
    one block taking this share of their computes' summed cost, as on two streams: the block starts
    once every receive of the unit arrived and its sends leave when it ends (1.0: no gain, the time
    DeepSeek's table calls F&B being F + B + W). None: the unit's computes run one after another,
    as listed."""
    backward_cost, weight_cost = split_costs(schedule, backward_cost, weight_cost)
    per_stage = tuple(tuple(float(c) for c in costs) for costs in stage_costs) if stage_costs is not None else None
    ranks = range(schedule.num_ranks)
    lists = schedule.actions
    pointer = [0 for _ in ranks]
    clock = [0.0 for _ in ranks]
    busy = [0.0 for _ in ranks]
    queues: list[list[_Group]] = [[] for _ in ranks]
    posted_sends: dict[tuple[int, Action], float] = {}
    where: dict[tuple[int, Action], _Group] = {}
    completed: dict[tuple[int, Action], float] = {}
    starts: dict[tuple[int, Action], float] = {}
    early: list[set[Action]] = [set() for _ in ranks]  # sends of the group at the pointer, posted ahead

    def parts(group: list[Action]) -> tuple[list[Action], list[Action]]:
        local = [op for op in group if schedule.is_local(op)]
        return ([op for op in group if op not in local] if local else group), local

    group_at = [{start: parts(group) for start, group in comm_groups(actions)} for actions in lists]
    unit_of: list[dict[Action, tuple[Action, ...]]] = [
        {a: unit for unit in units for a in unit} if overlap is not None else {}
        for units in (schedule.overlapped or [()] * schedule.num_ranks)
    ]

    def cost(action: Action) -> float:
        if per_stage is not None:
            return _stage_cost(per_stage[action.stage], action, schedule.split_backward)
        return _cost(action, forward_cost, backward_cost, weight_cost)

    def advance(rank: int) -> bool:
        moved = False
        while pointer[rank] < len(lists[rank]):
            index = pointer[rank]
            action = lists[rank][index]
            if action.kind.is_compute:
                unit = unit_of[rank].get(action)
                if unit is not None and action is not unit[0]:  # ran within its unit's block
                    starts[(rank, action)] = starts[(rank, unit[0])]
                    pointer[rank] += 1
                    moved = True
                    continue
                members = unit if unit is not None else (action,)
                waits = [completed.get((rank, need)) for a in members for need in _needs_of(schedule, a)]
                done = [w for w in waits if w is not None]
                if len(done) < len(waits):
                    return moved
                start = max([clock[rank], *done])
                starts[(rank, action)] = start
                took = cost(action) if unit is None else overlap * sum(cost(a) for a in unit)  # type: ignore[operator]
                clock[rank] = start + took
                busy[rank] += took
                pointer[rank] += 1
                moved = True
                continue
            remote, local = group_at[rank][index]
            post = clock[rank]
            if local:
                sent = {op for op in local if op.kind.is_send}  # posted first, as the executor does
                for op in local:
                    if op.kind.is_recv and op.matching() not in sent and (rank, op.matching()) not in completed:
                        return moved  # sent later on this same rank: never (validate names it)
                for op in local:
                    completed[(rank, op)] = post
            ops = [op for op in remote if op not in early[rank]] if early[rank] else remote
            if not ops:
                pointer[rank] += len(local) + len(early[rank])
                early[rank] = set()
                moved = True
                continue
            for op in ops:  # shape headers of sends go out before the rank waits for any header
                if op.kind.is_send:
                    posted_sends.setdefault((rank, op), post)
            headers: list[float] = []
            for op in ops:
                if op.kind is ActionKind.RECV_ACTIVATION:  # gradient shapes are known locally
                    peer = (schedule.rank_of(op.peer_stage()), op.matching())
                    if peer not in posted_sends:
                        sends = [] if rendezvous else [o for o in ops if o.kind.is_send]
                        if sends:  # gloo: the sends go out as a group of their own while the rank waits
                            group = _Group(rank, sends, post)
                            queues[rank].append(group)
                            for o in sends:
                                where[(rank, o)] = group
                            early[rank].update(sends)
                            moved = True
                        return moved
                    headers.append(posted_sends[peer])
            post = max([post, *headers])
            clock[rank] = post
            group = _Group(rank, list(ops), post)
            queues[rank].append(group)
            for op in ops:
                where[(rank, op)] = group
            pointer[rank] += len(ops) + len(local) + len(early[rank])
            early[rank] = set()
            moved = True
        return moved

    def resolve_unordered() -> bool:
        moved = False
        for rank in ranks:
            for group in list(queues[rank]):
                for op in group.ops:
                    if op in group.done:
                        continue
                    peer_key = (schedule.rank_of(op.peer_stage()), op.matching())
                    peer_group = where.get(peer_key)
                    if peer_group is None:
                        continue
                    t = max(group.post_time, peer_group.post_time)
                    group.done[op] = t
                    peer_group.done[peer_key[1]] = t
                    completed[(rank, op)] = t  # each receive is waited for on its own
                    completed[peer_key] = t
                    moved = True
        for rank in ranks:
            for group in list(queues[rank]):
                if len(group.done) == len(group.ops):
                    for op in group.ops:
                        completed[(rank, op)] = group.done[op]
                    queues[rank].remove(group)
                    moved = True
        return moved

    def resolve() -> bool:
        if not rendezvous:
            return resolve_unordered()
        moved = False
        changed = True
        while changed:
            changed = False
            for rank in ranks:
                if not queues[rank]:
                    continue
                head = queues[rank][0]
                if head.active_time is None:
                    head.active_time = head.post_time
                for op in head.ops:
                    if op in head.done:
                        continue
                    peer_key = (schedule.rank_of(op.peer_stage()), op.matching())
                    peer_group = where.get(peer_key)
                    if peer_group is None or not queues[peer_key[0]] or queues[peer_key[0]][0] is not peer_group:
                        continue
                    if peer_group.active_time is None:
                        peer_group.active_time = peer_group.post_time
                    t = max(head.active_time, peer_group.active_time)
                    head.done[op] = t
                    peer_group.done[peer_key[1]] = t
                    changed = True
                if len(head.done) == len(head.ops):
                    finish = max(head.done.values(), default=head.active_time)
                    for op in head.ops:
                        completed[(rank, op)] = head.done[op]
                    queues[rank].pop(0)
                    if queues[rank]:
                        nxt = queues[rank][0]
                        nxt.active_time = max(nxt.post_time, finish)
                    changed = True
            moved = moved or changed
        return moved

    while True:
        progress = False
        for rank in ranks:
            progress = advance(rank) or progress
        progress = resolve() or progress
        finished = all(pointer[r] == len(lists[r]) and not queues[r] for r in ranks)
        if finished:
            break
        if not progress:
            stuck = [
                f"rank {r} at {lists[r][pointer[r]] if pointer[r] < len(lists[r]) else 'end'}"
                + (f" with {len(queues[r])} unfinished communication group(s)" if queues[r] else "")
                for r in ranks
            ]
            raise DeadlockError(f"schedule {schedule.name!r} deadlocks: " + "; ".join(stuck))
    makespan = max(clock) if clock else 0.0
    sends_done = [max((t for (r, _), t in completed.items() if r == rank), default=0.0) for rank in ranks]
    makespan = max([makespan, *sends_done])
    return Simulation(schedule, makespan, tuple(busy), starts, forward_cost, backward_cost, weight_cost, per_stage)


def _needs_of(schedule: Schedule, action: Action) -> list[Action]:
    return needs(action, schedule.chain_length)


def peak_in_flight(schedule: Schedule) -> dict[int, int]:
    """Per stage, the most micro-batches whose forward ran and whose backward has not: the number
    of micro-batches' activations the stage holds at once (until its W, where the backward is split)."""
    peaks: dict[int, int] = {}
    for rank in range(schedule.num_ranks):
        live: dict[int, int] = {}
        for action in schedule.compute(rank):
            count = live.get(action.stage, 0)
            if action.kind is ActionKind.FORWARD:
                count += 0 if schedule.forward_only else 1
            elif action.kind is (ActionKind.WEIGHT if schedule.split_backward else ActionKind.BACKWARD):
                count -= 1
            live[action.stage] = count
            peaks[action.stage] = max(peaks.get(action.stage, 0), count)
    return peaks


def peak_in_flight_per_rank(schedule: Schedule) -> dict[int, int]:
    """Per rank, the most micro-batch stages whose forward ran and whose backward has not, over all
    the rank's stages at once (an overlapped unit's forward counted before its backward frees the
    other micro-batch, as the executor runs it): the activations a process holds at its peak,
    in micro-batches of one stage. Summing :func:`peak_in_flight` over a rank's stages adds peaks
    that need not coincide (ZB-V: ``2p + 1`` summed, ``2p`` held)."""
    release = ActionKind.WEIGHT if schedule.split_backward else ActionKind.BACKWARD
    peaks: dict[int, int] = {}
    for rank in range(schedule.num_ranks):
        count = peak = 0
        for action in schedule.compute(rank):
            if action.kind is ActionKind.FORWARD and not schedule.forward_only:
                count += 1
            elif action.kind is release:
                count -= 1
            peak = max(peak, count)
        peaks[rank] = peak
    return peaks


def closed_form_bubble(num_stages: int, num_microbatches: int) -> float:
    """GPipe's and 1F1B's bubble with equal stages: ``(p - 1) / (m + p - 1)``."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)

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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

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


class _Step(Enum):
    """What one step of a rank's list did."""

    ADVANCED = "advanced"  # the action ran or was posted: the rank's pointer moved on
    WAITING = "waiting"  # the action waits on another rank: nothing changed
    SENT_AHEAD = "sent ahead"  # (gloo) the group's sends went out while the rank waits for a header


@dataclass
class _Play:
    """The state of one simulation: where each rank stands in its list, its clock and the
    communication it posted. Each phase of the play is one method: a rank runs a compute
    (:meth:`compute`), hands over within the rank (:meth:`hand_over`), posts a communication group
    (:meth:`post`, or :meth:`send_ahead` while it waits for a shape header); then sends and receives
    are matched (:meth:`match_at_heads` under NCCL's rendezvous, :meth:`match_anywhere` under gloo's)
    and finished groups retire."""

    schedule: Schedule
    cost: Callable[[Action], float]
    rendezvous: bool
    overlap: float | None

    def __post_init__(self) -> None:
        ranks = range(self.schedule.num_ranks)
        self.ranks = ranks
        self.lists = self.schedule.actions
        self.pointer = [0 for _ in ranks]
        self.clock = [0.0 for _ in ranks]
        self.busy = [0.0 for _ in ranks]
        self.queues: list[list[_Group]] = [[] for _ in ranks]
        self.posted_sends: dict[tuple[int, Action], float] = {}
        self.where: dict[tuple[int, Action], _Group] = {}
        self.completed: dict[tuple[int, Action], float] = {}
        self.starts: dict[tuple[int, Action], float] = {}
        self.early: list[set[Action]] = [set() for _ in ranks]  # sends of the group at the pointer, posted ahead
        self.group_at = [{start: self._parts(group) for start, group in comm_groups(actions)} for actions in self.lists]
        self.unit_of: list[dict[Action, tuple[Action, ...]]] = [
            {a: unit for unit in units for a in unit} if self.overlap is not None else {}
            for units in (self.schedule.overlapped or [()] * self.schedule.num_ranks)
        ]

    def _parts(self, group: list[Action]) -> tuple[list[Action], list[Action]]:
        """A communication group's actions with another rank, and its hand-overs within the rank."""
        local = [op for op in group if self.schedule.is_local(op)]
        return ([op for op in group if op not in local] if local else group), local

    def _peer(self, op: Action) -> tuple[int, Action]:
        """The matching action of ``op``, keyed by the rank that posts it."""
        return self.schedule.rank_of(op.peer_stage()), op.matching()

    def advance(self, rank: int) -> bool:
        """Run ``rank``'s list as far as it can go now; whether anything changed."""
        moved = False
        while self.pointer[rank] < len(self.lists[rank]):
            index = self.pointer[rank]
            action = self.lists[rank][index]
            step = self.compute(rank, action) if action.kind.is_compute else self.post(rank, index)
            if step is _Step.WAITING:
                return moved
            if step is _Step.SENT_AHEAD:
                return True
            moved = True
        return moved

    def compute(self, rank: int, action: Action) -> _Step:
        """Run ``action`` once the receives it (or its overlapped unit) consumes completed."""
        unit = self.unit_of[rank].get(action)
        if unit is not None and action is not unit[0]:  # ran within its unit's block
            self.starts[(rank, action)] = self.starts[(rank, unit[0])]
            self.pointer[rank] += 1
            return _Step.ADVANCED
        members = unit if unit is not None else (action,)
        waits = [self.completed.get((rank, need)) for a in members for need in _needs_of(self.schedule, a)]
        done = [w for w in waits if w is not None]
        if len(done) < len(waits):
            return _Step.WAITING
        start = max([self.clock[rank], *done])
        self.starts[(rank, action)] = start
        took = self.cost(action) if unit is None else self.overlap * sum(self.cost(a) for a in unit)  # type: ignore[operator]
        self.clock[rank] = start + took
        self.busy[rank] += took
        self.pointer[rank] += 1
        return _Step.ADVANCED

    def hand_over(self, rank: int, local: list[Action], post: float) -> bool:
        """Complete the group's sends and receives between two stages of ``rank`` (sends first, as
        the executor posts them); False where a receive's send comes later on this rank (never:
        validate names it)."""
        sent = {op for op in local if op.kind.is_send}
        for op in local:
            if op.kind.is_recv and op.matching() not in sent and (rank, op.matching()) not in self.completed:
                return False
        for op in local:
            self.completed[(rank, op)] = post
        return True

    def post(self, rank: int, index: int) -> _Step:
        """Post the communication group at ``index`` of ``rank``'s list: its hand-overs complete at
        once; its other actions queue as one group, once the shape header of every activation it
        receives was sent."""
        remote, local = self.group_at[rank][index]
        post = self.clock[rank]
        if local and not self.hand_over(rank, local, post):
            return _Step.WAITING
        early = self.early[rank]
        ops = [op for op in remote if op not in early] if early else remote
        if not ops:
            self.pointer[rank] += len(local) + len(early)
            self.early[rank] = set()
            return _Step.ADVANCED
        for op in ops:  # shape headers of sends go out before the rank waits for any header
            if op.kind.is_send:
                self.posted_sends.setdefault((rank, op), post)
        receives = [self._peer(op) for op in ops if op.kind is ActionKind.RECV_ACTIVATION]  # gradient shapes are known
        if any(peer not in self.posted_sends for peer in receives):
            return self.send_ahead(rank, ops, post)
        post = max([post, *(self.posted_sends[peer] for peer in receives)])
        self.clock[rank] = post
        self._queue(rank, list(ops), post)
        self.pointer[rank] += len(ops) + len(local) + len(early)
        self.early[rank] = set()
        return _Step.ADVANCED

    def send_ahead(self, rank: int, ops: list[Action], post: float) -> _Step:
        """While ``rank`` waits for a shape header: under gloo, the group's sends go out as a group
        of their own; under NCCL's rendezvous the rank just waits."""
        sends = [] if self.rendezvous else [o for o in ops if o.kind.is_send]
        if not sends:
            return _Step.WAITING
        self._queue(rank, sends, post)
        self.early[rank].update(sends)
        return _Step.SENT_AHEAD

    def _queue(self, rank: int, ops: list[Action], post: float) -> None:
        group = _Group(rank, ops, post)
        self.queues[rank].append(group)
        for op in ops:
            self.where[(rank, op)] = group

    def resolve(self) -> bool:
        """Complete the sends and receives whose peers are posted; whether any completed."""
        if not self.rendezvous:
            return self.match_anywhere()
        return self.match_at_heads()

    def match_anywhere(self) -> bool:
        """gloo: each posted send and receive completes once its peer is posted, whatever else
        its rank posted before; a group retires when all of its actions completed."""
        moved = False
        for rank in self.ranks:
            for group in list(self.queues[rank]):
                for op in group.ops:
                    if op in group.done:
                        continue
                    peer_key = self._peer(op)
                    peer_group = self.where.get(peer_key)
                    if peer_group is None:
                        continue
                    t = max(group.post_time, peer_group.post_time)
                    group.done[op] = t
                    peer_group.done[peer_key[1]] = t
                    self.completed[(rank, op)] = t  # each receive is waited for on its own
                    self.completed[peer_key] = t
                    moved = True
        return self._retire_complete() or moved

    def _retire_complete(self) -> bool:
        moved = False
        for rank in self.ranks:
            for group in list(self.queues[rank]):
                if len(group.done) == len(group.ops):
                    for op in group.ops:
                        self.completed[(rank, op)] = group.done[op]
                    self.queues[rank].remove(group)
                    moved = True
        return moved

    def match_at_heads(self) -> bool:
        """NCCL's rendezvous: a send and its receive complete only while both of their groups are
        at the head of their rank's queue; repeated until nothing changes."""
        moved = False
        changed = True
        while changed:
            changed = False
            for rank in self.ranks:
                if self.queues[rank]:
                    changed = self._progress_head(rank) or changed
            moved = moved or changed
        return moved

    def _progress_head(self, rank: int) -> bool:
        """Match what the head group of ``rank``'s queue can, and retire it once all of it completed."""
        head = self.queues[rank][0]
        if head.active_time is None:
            head.active_time = head.post_time
        changed = False
        for op in head.ops:
            if op in head.done:
                continue
            peer_key = self._peer(op)
            peer_group = self.where.get(peer_key)
            if peer_group is None or not self.queues[peer_key[0]] or self.queues[peer_key[0]][0] is not peer_group:
                continue
            if peer_group.active_time is None:
                peer_group.active_time = peer_group.post_time
            t = max(head.active_time, peer_group.active_time)
            head.done[op] = t
            peer_group.done[peer_key[1]] = t
            changed = True
        if len(head.done) == len(head.ops):
            self._retire_head(rank, head)
            changed = True
        return changed

    def _retire_head(self, rank: int, head: _Group) -> None:
        """Complete ``head``'s actions and activate the next group of the rank's queue."""
        assert head.active_time is not None  # set when it became the head
        finish = max(head.done.values(), default=head.active_time)
        for op in head.ops:
            self.completed[(rank, op)] = head.done[op]
        self.queues[rank].pop(0)
        if self.queues[rank]:
            nxt = self.queues[rank][0]
            nxt.active_time = max(nxt.post_time, finish)

    def finished(self) -> bool:
        return all(self.pointer[r] == len(self.lists[r]) and not self.queues[r] for r in self.ranks)

    def deadlock(self) -> DeadlockError:
        """Where each rank is stuck."""
        stuck = [
            f"rank {r} at {self.lists[r][self.pointer[r]] if self.pointer[r] < len(self.lists[r]) else 'end'}"
            + (f" with {len(self.queues[r])} unfinished communication group(s)" if self.queues[r] else "")
            for r in self.ranks
        ]
        return DeadlockError(f"schedule {self.schedule.name!r} deadlocks: " + "; ".join(stuck))

    def makespan(self) -> float:
        """When the last compute or communication of any rank ends."""
        makespan = max(self.clock) if self.clock else 0.0
        sends_done = [max((t for (r, _), t in self.completed.items() if r == rank), default=0.0) for rank in self.ranks]
        return max([makespan, *sends_done])


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

    def cost(action: Action) -> float:
        if per_stage is not None:
            return _stage_cost(per_stage[action.stage], action, schedule.split_backward)
        return _cost(action, forward_cost, backward_cost, weight_cost)

    play = _Play(schedule, cost, rendezvous, overlap)
    while True:
        progress = False
        for rank in play.ranks:
            progress = play.advance(rank) or progress
        progress = play.resolve() or progress
        if play.finished():
            break
        if not progress:
            raise play.deadlock()
    return Simulation(
        schedule, play.makespan(), tuple(play.busy), play.starts, forward_cost, backward_cost, weight_cost, per_stage
    )


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

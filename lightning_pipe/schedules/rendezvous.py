"""Regroup a schedule's sends and receives so that it runs where point-to-point calls rendezvous.

Under NCCL a rank's communication groups run one after another on one stream, a group completes
only when every send and receive in it met its peer, and a rank reads an activation's shape header
before it posts the receive. A schedule with several stages per rank can then deadlock with the
placement of :mod:`.comm` (each receive right before the compute that needs it): rank 0 waits,
behind a send that rank 1 has not received yet, for a gradient that rank 1 sends only after it
got a receive that waits on rank 0. Megatron-LM avoids this by posting, at each step, what a rank
just computed together with what it will receive next, so both ends of a transfer are posted in
the same step.

:func:`for_rendezvous` does the same for any schedule, from its compute order alone: it plays the
schedule on paper under the rendezvous model of :mod:`.simulate`, ranks advancing in time order
(forward 1, backward 2, weight gradient 1), and decides each group when the rank posts it: the
sends of the compute just done, the receive the next compute needs, and the receive of every
transfer a peer has already posted to this rank (the receiver picks it up at its next step, as in
Megatron's steps). The compute order does not change; only where communication is posted does.
It builds two such placements (with and without moving a send whose receiver is busy to the next
step), checks each with :func:`.simulate` (``rendezvous=True``) and returns the faster, each group's
receives in the order their senders send them (:func:`in_sending_order`: NCCL pairs by posting order).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from lightning_pipe.schedules.actions import Action, ActionKind, Schedule, comm_groups
from lightning_pipe.schedules.comm import needs, produces
from lightning_pipe.schedules.simulate import DeadlockError, simulate

#: The costs of :func:`.simulate`'s defaults: forward 1, backward 2, or B 1 and W 1 where it is split.
_COSTS = {ActionKind.FORWARD: 1.0, ActionKind.BACKWARD: 2.0, ActionKind.WEIGHT: 1.0}
_SPLIT_COSTS = {ActionKind.FORWARD: 1.0, ActionKind.BACKWARD: 1.0, ActionKind.WEIGHT: 1.0}


@dataclass
class _Group:
    ops: list[Action]
    post_time: float
    done: dict[Action, float] = field(default_factory=dict)


@dataclass
class _Rank:
    order: list[Action]
    inbound: list[Action]  # remote receives, in the order their computes come
    pointer: int = 0  # next compute
    at_gap: bool = True  # the group before compute ``pointer`` is not posted yet
    clock: float = 0.0
    queue: list[_Group] = field(default_factory=list)
    gaps: list[list[Action]] = field(default_factory=list)
    deferred: list[Action] = field(default_factory=list)  # sends moved to the next step


class RendezvousError(ValueError):
    """No regrouping of the schedule's communication runs under the rendezvous model."""


def for_rendezvous(schedule: Schedule) -> Schedule:
    """``schedule`` with the same compute order per rank and its sends and receives regrouped so
    that it finishes under the rendezvous model (NCCL). Raises :class:`RendezvousError` if the
    regrouping does not."""
    best: tuple[float, Schedule] | None = None
    errors: list[str] = []
    for defer in (True, False):
        try:
            regrouped = in_sending_order(replace(schedule, actions=tuple(_regroup(schedule, defer))))
            makespan = simulate(regrouped, rendezvous=True).makespan
        except RendezvousError as err:
            errors.append(str(err))
            continue
        except DeadlockError as err:  # not expected: the regrouping plays the same model
            errors.append(
                f"schedule {schedule.name!r} regrouped for rendezvous point-to-point (NCCL) still deadlocks: {err}"
            )
            continue
        if best is None or makespan < best[0]:
            best = (makespan, regrouped)
    if best is None:
        raise RendezvousError(errors[-1])
    return best[1]


def _regroup(schedule: Schedule, defer: bool) -> list[tuple[Action, ...]]:
    """Play the schedule under the rendezvous model, deciding each group as it is posted. With
    ``defer``, a step whose next compute's input is already on its way posts only the sends whose
    receive is already posted, and the others one step later, so that the compute does not wait
    for a peer still busy with its own."""
    play = _Regrouping(schedule, defer)
    while not play.finished():
        if not play.step():
            raise play.stuck()
    return play.lists()


@dataclass
class _Regrouping:
    """The state of one regrouping: each rank's place in its compute order, its clock and queue of
    posted groups, and what was posted and received so far. Its phases: a rank at a gap between two
    computes posts that gap's group (:meth:`post_gap`), or runs its next compute
    (:meth:`run_compute`); after either, groups at the heads of their queues meet (:meth:`resolve`)."""

    schedule: Schedule
    defer: bool

    def __post_init__(self) -> None:
        schedule, n = self.schedule, self.schedule.chain_length
        self.n = n
        self.costs = _SPLIT_COSTS if schedule.split_backward else _COSTS
        self.ranks = [
            _Rank(
                order=(order := schedule.compute(r)),
                inbound=[x for a in order for x in needs(a, n) if not schedule.is_local(x)],
                gaps=[[] for _ in range(len(order) + 1)],
            )
            for r in range(schedule.num_ranks)
        ]
        self.posted: dict[Action, float] = {}  # remote sends posted so far, and when
        self.headers_out: dict[Action, float] = {}  # remote activation sends whose shape header went out
        self.received: set[Action] = set()  # remote receives posted so far
        self.where: dict[Action, tuple[int, _Group]] = {}
        self.completed: dict[Action, float] = {}  # remote receives whose group completed, and when

    @staticmethod
    def _done(state: _Rank) -> bool:
        return state.pointer == len(state.order) and not state.at_gap

    def finished(self) -> bool:
        return all(self._done(s) for s in self.ranks)

    def step(self) -> bool:
        """Move the earliest rank (by its clock) that can move one step, then let groups meet;
        False where none can."""
        for rank in sorted(range(len(self.ranks)), key=lambda r: (self.ranks[r].clock, r)):
            state = self.ranks[rank]
            if self._done(state):
                continue
            if (state.at_gap and self.post_gap(rank)) or (
                not state.at_gap and state.pointer < len(state.order) and self.run_compute(rank)
            ):
                self.resolve()
                return True
        return False

    def _split_sends(self, state: _Rank, wanted: list[Action]) -> tuple[list[Action], list[Action], list[Action]]:
        """The gap's sends to post now, those moved to the next step (``defer``), and its hand-overs."""
        k, n = state.pointer, self.n
        sends = produces(state.order[k - 1], n) if k > 0 else []
        local = [a for a in sends + wanted if self.schedule.is_local(a)]
        fresh = [a for a in sends if not self.schedule.is_local(a)]
        sends = state.deferred + fresh
        remote = [a for a in wanted if not self.schedule.is_local(a) and a not in self.received]
        later: list[Action] = []
        if self.defer and remote and all(a.matching() in self.posted for a in remote):
            later = [a for a in fresh if a.matching() not in self.received]
            sends = [a for a in sends if a not in later]
        return sends, later, local

    def post_gap(self, rank: int) -> bool:
        """Post the group before ``rank``'s next compute: the sends of the compute just done, the
        receives the next one needs and those a peer already sent; False where the rank waits for
        the shape header of what the next compute needs."""
        state = self.ranks[rank]
        k = state.pointer
        wanted = needs(state.order[k], self.n) if k < len(state.order) else []
        sends, later, local = self._split_sends(state, wanted)
        wanted = [a for a in wanted if not self.schedule.is_local(a) and a not in self.received]
        for a in sends:  # their headers go out before the rank waits for any (as the executor does)
            self.headers_out.setdefault(a, state.clock)
        headers = [self.headers_out.get(a.matching()) for a in wanted if a.kind is ActionKind.RECV_ACTIVATION]
        if any(t is None for t in headers):
            return False
        extra = [a for a in state.inbound if a not in self.received and a not in wanted and a.matching() in self.posted]
        ops = sends + wanted + extra
        state.gaps[k] = sends + local + wanted + extra
        if ops:
            post = max([state.clock, *(t for t in headers if t is not None)])
            state.clock = post
            self._queue(rank, ops, post)
        state.deferred = later
        state.at_gap = False
        return True

    def _queue(self, rank: int, ops: list[Action], post: float) -> None:
        group = _Group(ops, post)
        self.ranks[rank].queue.append(group)
        for a in ops:
            self.where[a] = (rank, group)
            if a.kind.is_send:
                self.posted[a] = post
            else:
                self.received.add(a)

    def run_compute(self, rank: int) -> bool:
        """Run ``rank``'s next compute once its remote inputs arrived."""
        state = self.ranks[rank]
        action = state.order[state.pointer]
        waits = [self.completed.get(a) for a in needs(action, self.n) if not self.schedule.is_local(a)]
        if any(t is None for t in waits):
            return False
        start = max([state.clock, *(t for t in waits if t is not None)])
        state.clock = start + self.costs[action.kind]
        state.pointer += 1
        state.at_gap = True
        return True

    def resolve(self) -> None:
        """Let the groups at the heads of the ranks' queues meet until none can."""
        changed = True
        while changed:
            changed = False
            for state in self.ranks:
                if state.queue:
                    changed = self._progress_head(state) or changed

    def _progress_head(self, state: _Rank) -> bool:
        """Match what the head group of ``state``'s queue can with its peers' heads, and retire it
        once all of it completed (its receives completing then)."""
        head = state.queue[0]
        changed = False
        for op in head.ops:
            if op in head.done:
                continue
            peer = self.where.get(op.matching())
            if peer is None or self.ranks[peer[0]].queue[:1] != [peer[1]]:
                continue
            t = max(head.post_time, peer[1].post_time)
            head.done[op] = t
            peer[1].done[op.matching()] = t
            changed = True
        if len(head.done) == len(head.ops):
            finish = max(head.done.values())
            for op in head.ops:
                if op.kind.is_recv:
                    self.completed[op] = finish
            state.queue.pop(0)
            if state.queue:
                state.queue[0].post_time = max(state.queue[0].post_time, finish)
            changed = True
        return changed

    def stuck(self) -> RendezvousError:
        """Where each rank waits."""
        stuck = [
            f"rank {r} at {s.order[s.pointer] if s.pointer < len(s.order) else 'end'}" for r, s in enumerate(self.ranks)
        ]
        return RendezvousError(
            f"schedule {self.schedule.name!r} cannot be regrouped to run where point-to-point calls rendezvous "
            f"(NCCL): {'; '.join(stuck)}"
        )

    def lists(self) -> list[tuple[Action, ...]]:
        """Each rank's compute order with its decided groups between the computes (sends first)."""
        lists: list[tuple[Action, ...]] = []
        for state in self.ranks:
            actions: list[Action] = []
            for k, gap in enumerate(state.gaps):
                actions += sorted(gap, key=lambda a: not a.kind.is_send)  # sends first, as the executor posts them
                if k < len(state.order):
                    actions.append(state.order[k])
            lists.append(tuple(actions))
        return lists


def in_sending_order(schedule: Schedule) -> Schedule:
    """``schedule`` with the receives of each communication group reordered, within the group, as
    their senders send them. Where point-to-point calls rendezvous (NCCL) a rank's messages to
    another meet its receives in posting order, whatever micro-batch each names; a group is posted
    as one batch, so ordering its receives changes nothing else. What still disagrees across groups
    :func:`~.validate.validate` names."""
    position: dict[Action, int] = {}  # each remote send: its place among its rank's sends to that peer
    count: dict[tuple[int, int], int] = {}
    for rank, actions in enumerate(schedule.actions):
        for action in actions:
            if action.kind.is_send and not schedule.is_local(action):
                pair = (rank, schedule.rank_of(action.peer_stage()))
                position[action] = count.get(pair, 0)
                count[pair] = position[action] + 1
    lists = []
    for actions in schedule.actions:
        out = list(actions)
        for start, group in comm_groups(actions):
            slots = [k for k, a in enumerate(group) if a.kind.is_recv and not schedule.is_local(a)]
            receives = sorted(
                (group[k] for k in slots),
                key=lambda a: (schedule.rank_of(a.peer_stage()), position.get(a.matching(), len(position))),
            )
            for k, action in zip(slots, receives):
                out[start + k] = action
        lists.append(tuple(out))
    return replace(schedule, actions=tuple(lists))

"""Checks that a schedule is runnable before any process runs it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from lightning_pipe.schedules.actions import Action, ActionKind, Schedule
from lightning_pipe.schedules.comm import needs
from lightning_pipe.schedules.simulate import DeadlockError, simulate


class InvalidScheduleError(ValueError):
    """A schedule breaks a rule every executor relies on."""


def validate(schedule: Schedule, rendezvous: bool = True) -> None:
    """Raise :class:`InvalidScheduleError` unless, on every rank: each action belongs to a stage the
    rank holds; every stage runs each micro-batch's forward exactly once (and its backward exactly
    once, after the forward; with several chains, the stages of the micro-batch's chain only; in a
    ``split_backward`` schedule also its weight gradient W exactly once,
    after the backward B); each receive comes before the compute that consumes it and each send
    after the compute that produces it; every send has exactly one matching receive (between two
    stages of one rank, the send comes
    first in the rank's list); and the whole
    schedule finishes under the strict communication model of :mod:`.simulate` (NCCL's rendezvous;
    with ``rendezvous`` false, gloo's, where sends and receives proceed independently). With
    ``rendezvous``, also: between every two ranks the receives come in the order of the sends
    (NCCL pairs a rank's messages to another in posting order; gloo pairs them by micro-batch)."""
    _check_layout(schedule)
    seen: Counter[Action] = Counter()
    sends: set[Action] = set()
    recvs: set[Action] = set()
    for rank, actions in enumerate(schedule.actions):
        _check_rank(schedule, rank, actions, seen, sends, recvs)
    _check_coverage(seen, _expected(schedule))
    _check_overlapped(schedule)
    unmatched = [a for a in sends if a.matching() not in recvs] + [a for a in recvs if a.matching() not in sends]
    if unmatched:
        raise InvalidScheduleError(f"unmatched communication: {sorted(str(a) for a in unmatched)}")
    if rendezvous:
        _check_posting_order(schedule)
    try:
        simulate(schedule, rendezvous=rendezvous)
    except DeadlockError as err:
        raise InvalidScheduleError(str(err)) from err


def _check_posting_order(schedule: Schedule) -> None:
    """Between each two ranks, each direction's messages received in the order they are sent: where
    point-to-point calls rendezvous (NCCL) they pair in posting order, so a receive posted for one
    micro-batch would get another's tensors."""
    sent: dict[tuple[int, int], list[Action]] = {}
    received: dict[tuple[int, int], list[Action]] = {}
    for rank, actions in enumerate(schedule.actions):
        for action in actions:
            if action.kind.is_compute or schedule.is_local(action):
                continue
            peer = schedule.rank_of(action.peer_stage())
            if action.kind.is_send:
                sent.setdefault((rank, peer), []).append(action)
            else:
                received.setdefault((peer, rank), []).append(action.matching())
    for (source, target), order in sorted(sent.items()):
        theirs = received.get((source, target), [])
        if order != theirs:
            at = next(k for k, (a, b) in enumerate(zip(order, theirs)) if a != b)
            raise InvalidScheduleError(
                f"rank {source} sends {order[at]} where rank {target} receives {theirs[at].matching()} (message "
                f"{at} from rank {source} to rank {target}): where point-to-point calls rendezvous (NCCL) a rank's "
                "messages to another meet its receives in the order both post them, so the two ranks must take "
                "those micro-batches in the same order"
            )


def _check_layout(schedule: Schedule) -> None:
    """Every stage on a rank of the schedule, the stages in equal chains, each micro-batch on a chain."""
    p, m = schedule.num_stages, schedule.num_microbatches
    if len(schedule.stage_to_rank) != p:
        raise InvalidScheduleError(f"stage_to_rank has {len(schedule.stage_to_rank)} entries for {p} stages")
    if any(not 0 <= r < schedule.num_ranks for r in schedule.stage_to_rank):
        raise InvalidScheduleError(
            f"stage_to_rank {schedule.stage_to_rank} names a rank outside 0..{schedule.num_ranks - 1}"
        )
    if (
        p % schedule.chains
        or (schedule.chain_of and len(schedule.chain_of) != m)
        or any(not 0 <= c < schedule.chains for c in schedule.chain_of)
    ):
        raise InvalidScheduleError(f"{p} stages in {schedule.chains} chains, micro-batch chains {schedule.chain_of}")


def _expected(schedule: Schedule) -> Counter[Action]:
    """Each compute action the schedule must run once: every micro-batch's F (B, W) on its chain's stages."""
    expected: Counter[Action] = Counter()
    for i in range(schedule.num_microbatches):
        for s in schedule.chain_stages(i):
            expected[Action(ActionKind.FORWARD, s, i)] += 1
            if not schedule.forward_only:
                expected[Action(ActionKind.BACKWARD, s, i)] += 1
                if schedule.split_backward:
                    expected[Action(ActionKind.WEIGHT, s, i)] += 1
    return expected


def _check_rank(
    schedule: Schedule,
    rank: int,
    actions: Sequence[Action],
    seen: Counter[Action],
    sends: set[Action],
    recvs: set[Action],
) -> None:
    """Walk ``rank``'s list in order: each action on a stage of the rank, each compute after what it
    consumes, each send after what it sends; counts the computes into ``seen`` and the communication
    into ``sends`` and ``recvs``."""
    done: set[Action] = set()
    posted: set[Action] = set()
    for index, action in enumerate(actions):
        where = f"rank {rank}, position {index} ({action})"
        if not 0 <= action.stage < schedule.num_stages or not 0 <= action.microbatch < schedule.num_microbatches:
            raise InvalidScheduleError(f"{where}: stage or micro-batch out of range")
        if schedule.rank_of(action.stage) != rank:
            raise InvalidScheduleError(f"{where}: stage {action.stage} lives on rank {schedule.rank_of(action.stage)}")
        if action.kind.is_compute:
            seen[action] += 1
            _check_compute(schedule, action, where, done, posted)
            done.add(action)
            continue
        if action.kind.is_send:
            _check_send(action, where, done, sends)
        else:
            _check_receive(schedule, action, where, sends, recvs)
        posted.add(action)


def _check_compute(schedule: Schedule, action: Action, where: str, done: set[Action], posted: set[Action]) -> None:
    """A backward after its forward, a W after its B, and each after the receives it consumes."""
    if action.kind is ActionKind.BACKWARD and Action(ActionKind.FORWARD, action.stage, action.microbatch) not in done:
        raise InvalidScheduleError(f"{where}: backward before its forward")
    if action.kind is ActionKind.WEIGHT and Action(ActionKind.BACKWARD, action.stage, action.microbatch) not in done:
        raise InvalidScheduleError(f"{where}: weight gradient before its input gradient (B)")
    for need in needs(action, schedule.chain_length):
        if need not in posted:
            raise InvalidScheduleError(f"{where}: runs before receiving {need}")


def _check_send(action: Action, where: str, done: set[Action], sends: set[Action]) -> None:
    """A send after the compute that produces it, once."""
    producer = _producer(action)
    if producer not in done:
        raise InvalidScheduleError(f"{where}: sends before {producer} produced it")
    if action in sends:
        raise InvalidScheduleError(f"{where}: sent twice")
    sends.add(action)


def _check_receive(schedule: Schedule, action: Action, where: str, sends: set[Action], recvs: set[Action]) -> None:
    """A receive once, and from a stage of the same rank only after that stage sent."""
    if action in recvs:
        raise InvalidScheduleError(f"{where}: received twice")
    if schedule.is_local(action) and action.matching() not in sends:
        raise InvalidScheduleError(
            f"{where}: receives from stage {action.peer_stage()} on the same rank before it sent"
        )
    recvs.add(action)


def _check_coverage(seen: Counter[Action], expected: Counter[Action]) -> None:
    """The computes run are exactly the expected ones."""
    if seen != expected:
        missing = sorted((expected - seen).elements(), key=str)
        extra = sorted((seen - expected).elements(), key=str)
        raise InvalidScheduleError(
            f"compute actions do not cover each micro-batch once: missing {[str(a) for a in missing]}, "
            f"extra {[str(a) for a in extra]}"
        )


def _check_overlapped(schedule: Schedule) -> None:
    """Each overlapped unit (DualPipe's F&B) is consecutive computes of its rank: a forward, then
    the backward (B, and at most its W) of another stage or micro-batch, which it does not feed."""
    if schedule.overlapped and len(schedule.overlapped) != schedule.num_ranks:
        raise InvalidScheduleError(f"overlapped units for {len(schedule.overlapped)} ranks, not {schedule.num_ranks}")
    for rank, units in enumerate(schedule.overlapped):
        compute = schedule.compute(rank)
        position = {a: k for k, a in enumerate(compute)}
        for unit in units:
            names = " ".join(str(a) for a in unit)
            kinds = [a.kind for a in unit]
            if kinds not in (
                [ActionKind.FORWARD, ActionKind.BACKWARD],
                [ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT],
            ):
                raise InvalidScheduleError(
                    f"rank {rank}, overlapped unit {names}: give a forward, a B and at most its W"
                )
            forward, backward = unit[0], unit[1]
            if unit[-1].kind is ActionKind.WEIGHT and (unit[-1].stage, unit[-1].microbatch) != (
                backward.stage,
                backward.microbatch,
            ):
                raise InvalidScheduleError(f"rank {rank}, overlapped unit {names}: the W is not the B's")
            if forward.microbatch == backward.microbatch:
                raise InvalidScheduleError(
                    f"rank {rank}, overlapped unit {names}: one micro-batch's forward and backward cannot overlap"
                )
            if any(a not in position for a in unit) or [position[a] for a in unit] != list(
                range(position[forward], position[forward] + len(unit))
            ):
                raise InvalidScheduleError(
                    f"rank {rank}, overlapped unit {names}: not consecutive computes of the rank"
                )


def _producer(send: Action) -> Action:
    kind = ActionKind.FORWARD if send.kind is ActionKind.SEND_ACTIVATION else ActionKind.BACKWARD
    return Action(kind, send.stage, send.microbatch)

"""Schedules regrouped for NCCL's rendezvous point-to-point: they finish under the strict model,
still finish under gloo's, keep every rank's compute order, and the regrouping refuses (rather
than returns a schedule that hangs) where a process would wait for its own output."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from lightning_pipe.schedules import (
    REGROUPED_FOR_RENDEZVOUS,
    Action,
    DeadlockError,
    InvalidScheduleError,
    RendezvousError,
    Schedule,
    build,
    for_rendezvous,
    forward_only_like,
    load_schedule,
    simulate,
    traits,
    validate,
)
from lightning_pipe.schedules.rendezvous import in_sending_order
from lightning_pipe.schedules.runnable import runnable_schedule


def _regroups(name: str, p: int, m: int) -> bool:
    """The counts checked to regroup over the grid below (others may or may not, and
    :func:`for_rendezvous` says which): interleaved 1F1B from ``p`` micro-batches, interleaved
    zero bubble at multiples of ``p``, ZB-V from ``2p - 2`` (DualPipeV runs from ``2p``), Chimera from ``2p - 4``."""
    if name == "chimera":
        return m >= max(1, 2 * p - 4)
    if name == "interleaved_1f1b":
        return m >= p
    if name == "interleaved_zero_bubble":
        return m % p == 0
    return m >= max(1, 2 * p - 2)


def _cases(name: str, ranks: range, per_rank: int) -> list[tuple[int, int, int]]:
    virtual = (2, 3, 4) if name in ("interleaved_1f1b", "interleaved_zero_bubble") else (2,)
    return [(p, m, v) for p in ranks for m in range(1, per_rank * p + 1) for v in virtual]


def _check(name: str, p: int, m: int, v: int) -> None:
    try:
        original = build(name, p, m, v)
    except ValueError:
        if name == "chimera":
            assert p % 2, (p, m)  # Chimera pairs the ranks
            return
        if name == "dualpipev":
            assert m < 2 * p, (p, m)  # DualPipeV needs a micro-batch per stage
            return
        assert name != "zbv" and m % max(1, m // p), (name, p, m)  # no equal rounds
        return
    # Chimera evaluates through one of its pipelines (schedules.families.chimera.chimera_forward), not in its
    # training order
    for schedule in (original,) if name == "chimera" else (original, forward_only_like(original)):
        try:
            regrouped = for_rendezvous(schedule)
        except RendezvousError:
            assert not _regroups(name, p, m), (name, p, m, v, schedule.forward_only)
            continue
        _check_regrouped(schedule, regrouped)


def _check_regrouped(schedule: Schedule, regrouped: Schedule) -> None:
    where = (schedule.name, schedule.num_ranks, schedule.num_microbatches, schedule.virtual_stages)
    for rank in range(schedule.num_ranks):
        assert regrouped.compute(rank) == schedule.compute(rank), where
        assert Counter(regrouped.actions[rank]) == Counter(schedule.actions[rank]), where  # same transfers
    validate(regrouped, rendezvous=True)
    validate(regrouped, rendezvous=False)


SAMPLE = {
    name: random.Random(20261123).sample(_cases(name, range(1, 9), 3), 12) + [(2, 8, 2), (8, 8, 2), (4, 16, 4)]
    for name in sorted(REGROUPED_FOR_RENDEZVOUS)
}


@pytest.mark.parametrize("name", sorted(REGROUPED_FOR_RENDEZVOUS))
def test_default_placement_deadlocks_under_rendezvous(name: str) -> None:
    """Why the regrouping exists: the placement gloo runs hangs where calls rendezvous."""
    schedule = build(name, 4 if name == "chimera" else 2, 8, 2)  # Chimera on 2 ranks runs as it is
    simulate(schedule, rendezvous=False)
    with pytest.raises(DeadlockError):
        simulate(schedule, rendezvous=True)


@pytest.mark.parametrize("name", sorted(REGROUPED_FOR_RENDEZVOUS))
def test_sampled_grid(name: str) -> None:
    for p, m, v in SAMPLE[name]:
        _check(name, p, m, v)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REGROUPED_FOR_RENDEZVOUS))
def test_whole_grid(name: str) -> None:
    """p in 1..8, m in 1..4p, v in 2..4 (the interleaved schedules) or 2 (ZB-V)."""
    for p, m, v in _cases(name, range(1, 9), 4):
        _check(name, p, m, v)


def test_build_regroups_only_under_rendezvous() -> None:
    plain = build("interleaved_1f1b", 4, 8, 2)
    assert build("interleaved_1f1b", 4, 8, 2, rendezvous=False) == plain
    nccl = build("interleaved_1f1b", 4, 8, 2, rendezvous=True)
    assert nccl != plain
    _check_regrouped(plain, nccl)
    for name in ("1f1b", "gpipe", "zero_bubble"):  # already finish under rendezvous: left as they are
        assert build(name, 4, 8, rendezvous=True) == build(name, 4, 8)


@pytest.mark.parametrize("name", ["1f1b", "gpipe", "zero_bubble"])
def test_regrouping_is_generic(name: str) -> None:
    """The pass works from any valid compute order, not only the ones it was written for."""
    for p, m in [(1, 1), (2, 1), (3, 7), (4, 4), (8, 16)]:
        schedule = build(name, p, m)
        _check_regrouped(schedule, for_rendezvous(schedule))


def test_too_few_microbatches_is_refused_with_the_reason() -> None:
    """Interleaved 1F1B with one micro-batch on two processes: rank 0's first stage output must go
    out before rank 0 can receive its third stage's input, in the same step; under NCCL the
    executor reads that input's shape header before it posts the step's send."""
    with pytest.raises(RendezvousError, match="rendezvous"):
        build("interleaved_1f1b", 2, 1, 2, rendezvous=True)


def _pairs_in_order(schedule: Schedule) -> bool:
    """Whether between every two ranks the receives come in the order of the sends (NCCL's pairing)."""
    sent: dict[tuple[int, int], list[Action]] = {}
    got: dict[tuple[int, int], list[Action]] = {}
    for rank, actions in enumerate(schedule.actions):
        for a in actions:
            if a.kind.is_compute or schedule.is_local(a):
                continue
            peer = schedule.rank_of(a.peer_stage())
            if a.kind.is_send:
                sent.setdefault((rank, peer), []).append(a)
            else:
                got.setdefault((peer, rank), []).append(a.matching())
    return sent == got


def test_each_groups_receives_are_posted_in_their_senders_order() -> None:
    """Rank 1 posts one group receiving micro-batch 1, then 0, where rank 0 sends 0, then 1: under NCCL
    (pairing by posting order) 0's tensors would fill 1's buffers. The schedule that runs posts them as
    sent; regrouped schedules come so (interleaved zero bubble, 2 processes, 3 micro-batches: one group
    of rank 0 receives B0 from stage 3 and F2 from stage 1, which rank 1 sends F2 first)."""
    text = "0F0,0F1,0SEND_F0,0SEND_F1,0RECV_B0,0RECV_B1,0B0,0B1\n1RECV_F1,1RECV_F0,1F0,1F1,1B0,1SEND_B0,1B1,1SEND_B1\n"
    written = load_schedule(text)
    assert not _pairs_in_order(written)
    with pytest.raises(InvalidScheduleError, match="the two ranks must take those micro-batches in the same order"):
        validate(written, rendezvous=True)
    ordered = in_sending_order(written)
    assert _pairs_in_order(ordered)
    assert str(ordered.actions[1][0]) == "RECV_F0@s1" and ordered.actions[0] == written.actions[0]
    assert [sorted(map(str, a)) for a in ordered.actions] == [sorted(map(str, a)) for a in written.actions]
    validate(runnable_schedule(traits(text), 2, 2, 1, rendezvous=True), rendezvous=True)
    assert _pairs_in_order(build("interleaved_zero_bubble", 2, 3, 2, rendezvous=True))


@pytest.mark.parametrize("name", sorted(REGROUPED_FOR_RENDEZVOUS | {"1f1b", "gpipe", "zero_bubble"}))
def test_every_schedule_that_runs_under_nccl_pairs_its_messages_in_order(name: str) -> None:
    for p, m, v in _cases(name, range(2, 5), 2):
        try:
            schedule = runnable_schedule(traits(name), p, m, v, rendezvous=True)
        except ValueError:  # a count or depth the schedule refuses
            continue
        assert _pairs_in_order(schedule), (name, p, m, v)


def test_messages_received_across_groups_in_another_order_are_refused_under_nccl() -> None:
    """Rank 1 receives micro-batch 1, then 0, each in a group of its own, where rank 0 sends 0, then 1:
    gloo pairs them by micro-batch; NCCL, by posting order, would swap them: refused, naming both."""
    text = "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B1,0RECV_B0,0B1,0B0\n1RECV_F1,1F1,1RECV_F0,1F0,1B1,1SEND_B1,1B0,1SEND_B0\n"
    schedule = load_schedule(text)  # runs under gloo
    with pytest.raises(InvalidScheduleError, match=r"rank 0 sends SEND_F0@s0 where rank 1 receives RECV_F1@s1"):
        validate(schedule, rendezvous=True)

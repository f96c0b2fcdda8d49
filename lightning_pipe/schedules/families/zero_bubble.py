"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

Each backward is split into B, the gradient of the stage's input (which the previous stage waits
for), and W, the gradient of its weights (which nobody waits for). Moving W's later fills the
bubble with useful work.

- ``zero_bubble`` is ZB-H1: 1F1B's warm-up and steady state, with stage ``s``'s W's running ``s``
  backwards late, so that every stage holds at most ``p`` micro-batches (1F1B's peak) and the
  bubble shrinks from 1F1B's ``(p - 1)(T_F + T_B + T_W)`` to ``(p - 1)(T_F + T_B - T_W)`` (the
  paper's section 3.1): a third of it when the three costs are equal.
- ``zbv`` is ZB-V: two stages per rank in a V (rank ``r`` holds stages ``r`` and ``2p - 1 - r``,
  so rank 0 holds the first and the last), with the paper's warm-up / steady / cool-down order as
  ``torch.distributed.pipelining.ScheduleZBVZeroBubble`` builds it. Every rank holds at most
  ``2p + 1`` micro-batches of its half-size stages (``p + 1/2`` full stages; 1F1B: ``p`` on rank 0).
"""

from __future__ import annotations

from lightning_pipe.schedules.actions import Action, B, F, Schedule, W
from lightning_pipe.schedules.comm import with_communication
from lightning_pipe.schedules.families.interleaved import check_counts, rank_order


def zero_bubble(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 on ``num_stages`` stages, one per rank."""
    check_counts(num_stages, num_microbatches, 1)
    p, m = num_stages, num_microbatches
    compute = [rank_order(p, m, 1, r, 1, zero_bubble=True) for r in range(p)]
    return with_communication("zero_bubble", compute, p, m, range(p), split_backward=True)


def zbv_stage_to_rank(num_ranks: int) -> list[int]:
    """Stage ``s`` of ``2p`` lives on rank ``s`` (first half) or ``2p - 1 - s`` (second half)."""
    p = num_ranks
    return [s if s < p else 2 * p - 1 - s for s in range(2 * p)]


def _zbv_order(p: int, m: int, rank: int) -> list[Action]:
    n = max(2 * p - 1, m)  # built for enough micro-batches to fill the V, then cut to m
    down, up = rank, 2 * p - 1 - rank
    order: list[Action] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (p - rank) - 1):
        order.append(F(down, f0))
        f0 += 1
    for _ in range(rank):
        order += [F(up, f1), F(down, f0)]
        f1 += 1
        f0 += 1
    for _ in range(p - rank):
        order += [F(up, f1), B(up, b1), W(up, b1)]
        f1 += 1
        b1 += 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            order.append(F(down, f0))
            f0 += 1
        order += [B(down, b0), W(down, b0), F(up, f1), B(up, b1), W(up, b1)]
        b0 += 1
        f1 += 1
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(rank):
        order += [B(down, b0), B(up, b1)]
        b0 += 1
        b1 += 1
    for _ in range(p - rank):
        order += [B(down, b0), W(down, w0)]
        b0 += 1
        w0 += 1
    order += [W(up, i) for i in range(w1, b1)]
    order += [W(down, i) for i in range(w0, b0)]
    return [a for a in order if a.microbatch < m]


def zbv(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-V on ``2 x num_ranks`` stages, two per rank in a V."""
    check_counts(num_ranks, num_microbatches, 2)
    p, m = num_ranks, num_microbatches
    compute = [_zbv_order(p, m, r) for r in range(p)]
    return with_communication("zbv", compute, 2 * p, m, zbv_stage_to_rank(p), split_backward=True)

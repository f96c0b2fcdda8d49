"""Schedules with several stages per rank, and the shared 1F1B generator behind them.

Megatron-LM's interleaved 1F1B (Narayanan et al., 2021) splits the layers into ``p x v`` stages;
rank ``r`` holds stages ``r, r + p, ..., r + (v - 1) p``, so a micro-batch visits every rank ``v``
times and the pipeline fills ``v`` times faster: the bubble, relative to the ideal time, is
``(p - 1) / (v m)`` instead of 1F1B's ``(p - 1) / m``. Micro-batches go through a rank's stages in
rounds of ``g`` (``p`` when ``m`` is a multiple of ``p``): ``g`` forwards on the first local stage,
the same ``g`` on the second, and so on; backwards visit the local stages in reverse. The order
per rank is the one ``torch.distributed.pipelining`` builds (``_get_1f1b_rank_ops``), so the two
engines run the same schedule.
"""

from __future__ import annotations

from lightning_pipe.schedules.actions import Action, B, F, Schedule, W
from lightning_pipe.schedules.comm import with_communication


def check_counts(num_ranks: int, num_microbatches: int, virtual_stages: int) -> None:
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")


def round_size(num_ranks: int, num_microbatches: int) -> int:
    """Micro-batches per round: ``m`` split into ``max(1, m // p)`` equal rounds. Raises a clear
    error for the counts that cannot be split so (for example ``p = 2, m = 5``)."""
    rounds = max(1, num_microbatches // num_ranks)
    if num_microbatches % rounds:
        valid = [m for m in range(num_ranks, num_microbatches + 2 * num_ranks) if m % max(1, m // num_ranks) == 0][:6]
        raise ValueError(
            f"{num_microbatches} micro-batches cannot be split into rounds of equal size for {num_ranks} "
            f"processes with several stages each (rounds of at least {num_ranks}). Use chunks in "
            f"1..{2 * num_ranks - 1} or a multiple of the round size, e.g. {valid}."
        )
    return num_microbatches // rounds


def rank_order(
    num_ranks: int,
    num_microbatches: int,
    virtual_stages: int,
    rank: int,
    warmup_per_hop: int,
    zero_bubble: bool,
) -> list[Action]:
    """One rank's compute order: warm-up forwards, one forward / one backward, cool-down backwards.
    With ``zero_bubble`` each backward is B (input gradient) and the rank's W actions follow their
    B's ``rank`` backwards late, filling the cool-down (ZB-H1 for one stage per rank)."""
    p, m, v = num_ranks, num_microbatches, virtual_stages
    group = round_size(p, m) if v > 1 else m
    total = m * v
    warmup = min((v - 1) * group + warmup_per_hop * (p - 1 - rank), total)

    def forward_stage(step: int) -> int:
        return ((step // group) % v) * p + rank

    def backward_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // group) % v) * p + rank

    next_mb: dict[tuple[str, int], int] = {}

    def take(kind: str, stage: int) -> int:
        i = next_mb.get((kind, stage), 0)
        next_mb[(kind, stage)] = i + 1
        return i

    order: list[Action] = []
    backward_steps: list[int] = []
    weights_done = 0

    def backward(step: int) -> None:
        stage = backward_stage(step)
        order.append(B(stage, take("B", stage)))
        backward_steps.append(step)
        if zero_bubble and step - warmup >= rank:
            weight(backward_stage(backward_steps[weights_done]))

    def weight(stage: int) -> None:
        nonlocal weights_done
        order.append(W(stage, take("W", stage)))
        weights_done += 1

    for step in range(total):
        stage = forward_stage(step)
        order.append(F(stage, take("F", stage)))
        if step >= warmup:
            backward(step)
    for step in range(total, total + warmup):  # cool-down: the backwards the warm-up left over
        backward(step)
    while zero_bubble and weights_done < len(backward_steps):
        weight(backward_stage(backward_steps[weights_done]))
    return order


def interleaved_1f1b(num_ranks: int, num_microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B over ``num_ranks x virtual_stages`` stages (stage ``s`` on rank
    ``s % num_ranks``). ``num_microbatches`` must split into equal rounds of at least
    ``num_ranks`` (any multiple of ``num_ranks``, or fewer than ``2 x num_ranks``)."""
    check_counts(num_ranks, num_microbatches, virtual_stages)
    p, v, m = num_ranks, virtual_stages, num_microbatches
    compute = [rank_order(p, m, v, r, 2, zero_bubble=False) for r in range(p)]
    return with_communication("interleaved_1f1b", compute, p * v, m, [s % p for s in range(p * v)])


def interleaved_zero_bubble(num_ranks: int, num_microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Interleaved 1F1B with the backward split into B and W (zero bubble with several stages per
    rank, torch.distributed.pipelining's ``ScheduleInterleavedZeroBubble``): one warm-up forward per
    hop instead of interleaving's two, and each rank's W's running ``rank`` backwards late. With equal
    F, B and W per stage every rank idles ``(p - 1)(T_F + T_B - T_W)`` of one of its ``p x v`` stages
    once ``m >= p`` (ZB-H1's idle, ``v`` times smaller), holding as many micro-batches as interleaved 1F1B.
    The counts are interleaved 1F1B's."""
    check_counts(num_ranks, num_microbatches, virtual_stages)
    p, v, m = num_ranks, virtual_stages, num_microbatches
    compute = [rank_order(p, m, v, r, 1, zero_bubble=True) for r in range(p)]
    return with_communication(
        "interleaved_zero_bubble", compute, p * v, m, [s % p for s in range(p * v)], split_backward=True
    )


def valid_microbatches(num_ranks: int, num_microbatches: int) -> int:
    """The largest count ``<= num_microbatches`` that the interleaved schedules take (a short last
    batch runs in fewer micro-batches rather than failing mid-training)."""
    m = num_microbatches
    while m > 1 and m % max(1, m // num_ranks):
        m -= 1
    return m

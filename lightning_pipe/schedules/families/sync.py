"""Synchronous schedules: every micro-batch's forward and backward inside one batch, then a flush.

GPipe runs all forwards, then all backwards (last micro-batch first, so ``except_last``
checkpointing never recomputes the micro-batch whose activations are still fresh). 1F1B starts
``p - s - 1`` forwards on stage ``s``, then alternates one forward with one backward, which bounds
the micro-batches a stage holds to ``p - s`` instead of ``m``. Both have the same bubble,
``(p - 1) / (m + p - 1)``.
"""

from __future__ import annotations

from lightning_pipe.schedules.actions import Action, ActionKind, B, F, Schedule
from lightning_pipe.schedules.comm import with_communication


def _check(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards in reverse micro-batch order."""
    _check(num_stages, num_microbatches)
    m = num_microbatches
    compute = [[F(s, i) for i in range(m)] + [B(s, i) for i in reversed(range(m))] for s in range(num_stages)]
    return with_communication("gpipe", compute, num_stages, m, range(num_stages))


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """Warm-up forwards, then one forward / one backward, then the remaining backwards."""
    _check(num_stages, num_microbatches)
    m = num_microbatches
    compute: list[list[Action]] = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, m)
        order = [F(s, i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [F(s, warmup + i), B(s, i)]
        order += [B(s, i) for i in range(m - warmup, m)]
        compute.append(order)
    return with_communication("1f1b", compute, num_stages, m, range(num_stages))


def forward_only(num_stages: int, num_microbatches: int) -> Schedule:
    """Evaluation: forwards in order, nothing kept for a backward."""
    _check(num_stages, num_microbatches)
    compute = [[F(s, i) for i in range(num_microbatches)] for s in range(num_stages)]
    return with_communication("forward", compute, num_stages, num_microbatches, range(num_stages), forward_only=True)


def forward_only_like(schedule: Schedule) -> Schedule:
    """Evaluation on ``schedule``'s layout (several stages per rank too): each rank's forwards in
    the training order, with their communication, and no backward work."""
    compute = [[a for a in schedule.compute(r) if a.kind is ActionKind.FORWARD] for r in range(schedule.num_ranks)]
    return with_communication(
        "forward",
        compute,
        schedule.num_stages,
        schedule.num_microbatches,
        schedule.stage_to_rank,
        forward_only=True,
        chains=schedule.chains,
        chain_of=schedule.chain_of,
    )

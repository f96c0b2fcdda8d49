"""Chimera (Li and Hoefler, SC'21): two pipelines in opposite directions over the same ranks.

The layers are split into ``D`` stages as for 1F1B, and each stage is kept twice. The *down*
pipeline runs stage ``k`` on rank ``k``; the *up* pipeline runs stage ``k`` on rank ``D - 1 - k``.
Each takes half of the micro-batches, and each fills the other's bubbles: rank 0 starts the down
pipeline while rank ``D - 1`` starts the up one.

As a :class:`~lightning_pipe.schedules.actions.Schedule` this is ``2 D`` stages in two chains:
stage ``k`` (``k < D``) is the down pipeline's stage ``k`` on rank ``k``, and stage ``D + k`` is the
up pipeline's copy of stage ``k``, on rank ``D - 1 - k`` (the placement of ZB-V's V). Micro-batch
``i`` goes through chain ``chain_of[i]``: the micro-batches come in units of ``D`` (the paper's
basic unit), whose first half goes down and second half up.

Each rank's order is the paper's: backwards first (a backward frees activations and unblocks the
previous stage), then the forward of the earliest unit, the stage furthest along its pipeline
first (it brings that micro-batch's backward closest). Playing these rules with unit costs gives
the paper's basic unit for ``N = D`` and, for ``N = k D``, its direct concatenation, the forwards
of a unit filling the bubbles at the end of the one before. With equal forward and backward costs
every rank idles ``D - 2`` of ``2 N + D - 2`` time units, the paper's bubble
``(D - 2) / (2 N + D - 2)`` (1F1B: ``(D - 1) / (N + D - 1)``), and holds at most ``D`` micro-batches'
activations over its two stages.
"""

from __future__ import annotations

from lightning_pipe.schedules.actions import Action, B, F, Schedule
from lightning_pipe.schedules.comm import with_communication
from lightning_pipe.schedules.families.zero_bubble import zbv_stage_to_rank

DOWN, UP = 0, 1


def check_chimera(num_ranks: int, num_microbatches: int) -> None:
    """Reject a rank count Chimera cannot pair, saying what works."""
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if num_ranks < 2 or num_ranks % 2:
        raise ValueError(
            f"schedule='chimera' needs an even number of pipeline stages >= 2 (rank i holds stage i of one pipeline "
            f"and stage D-1-i of the other), got {num_ranks}. Use stages=2, 4, 6, ..., or schedule='1f1b'."
        )


def chimera_chains(num_ranks: int, num_microbatches: int) -> tuple[int, ...]:
    """Which pipeline each micro-batch goes through: units of ``num_ranks``, first half down,
    second half up (a short last unit: its first half, rounded up, down)."""
    chains = []
    for i in range(num_microbatches):
        unit, position = divmod(i, num_ranks)
        size = min(num_ranks, num_microbatches - unit * num_ranks)
        chains.append(DOWN if position < (size + 1) // 2 else UP)
    return tuple(chains)


def chimera_stage_to_rank(num_ranks: int) -> list[int]:
    """Stage ``k`` of the down pipeline on rank ``k``; the up copy ``D + k`` on rank ``D - 1 - k``."""
    return zbv_stage_to_rank(num_ranks)


def _orders(d: int, n: int, chains: tuple[int, ...]) -> list[list[Action]]:
    """Each rank's compute order, by playing the rules of the module docstring with unit costs."""
    finish: dict[tuple[str, int, int], int] = {}  # (kind, micro-batch, depth) -> end time
    orders: list[list[Action]] = [[] for _ in range(d)]
    total, t = 2 * n * d, 0
    while len(finish) < total:
        for rank in range(d):
            if orders[rank] and finish[_key(orders[rank][-1], d)] > t:
                continue  # busy
            ready: list[tuple[tuple[int, ...], Action]] = []
            for i in range(n):
                depth = rank if chains[i] == DOWN else d - 1 - rank
                stage = depth + (d if chains[i] == UP else 0)
                if ("F", i, depth) not in finish:
                    if depth == 0 or finish.get(("F", i, depth - 1), t + 1) <= t:
                        ready.append(((1, i // d, -depth, i), F(stage, i)))
                elif (
                    ("B", i, depth) not in finish
                    and finish[("F", i, depth)] <= t
                    and (depth == d - 1 or finish.get(("B", i, depth + 1), t + 1) <= t)
                ):
                    ready.append(((0, i // d, -depth, i), B(stage, i)))
            if ready:
                action = min(ready)[1]
                finish[_key(action, d)] = t + 1
                orders[rank].append(action)
        t += 1
    return orders


def _key(action: Action, d: int) -> tuple[str, int, int]:
    return (action.kind.value, action.microbatch, action.stage % d)


def chimera(num_ranks: int, num_microbatches: int) -> Schedule:
    """Chimera on ``num_ranks`` (even) ranks: ``2 x num_ranks`` stages in two chains (see the module
    docstring). Any micro-batch count runs; the paper's bubble holds for multiples of ``num_ranks``."""
    check_chimera(num_ranks, num_microbatches)
    d, n = num_ranks, num_microbatches
    chains = chimera_chains(d, n)
    return with_communication(
        "chimera", _orders(d, n, chains), 2 * d, n, chimera_stage_to_rank(d), chains=2, chain_of=chains
    )


def chimera_forward(num_ranks: int, num_microbatches: int) -> Schedule:
    """Evaluation on Chimera's layout: every micro-batch forward through the up pipeline, whose last
    stage is on rank 0 (where predictions are gathered) and which holds the same weights."""
    check_chimera(num_ranks, num_microbatches)
    d, n = num_ranks, num_microbatches
    compute = [[F(2 * d - 1 - r, i) for i in range(n)] for r in range(d)]
    return with_communication(
        "forward", compute, 2 * d, n, chimera_stage_to_rank(d), forward_only=True, chains=2, chain_of=(UP,) * n
    )


def paper_bubble(num_ranks: int, num_microbatches: int) -> float:
    """The paper's bubble ratio for Chimera with equal forward and backward costs (its Table 2):
    ``(D - 2) / (2 N + D - 2)``."""
    d, n = num_ranks, num_microbatches
    return (d - 2) / (2 * n + d - 2)

"""Which rank holds which pipeline position, on unequal devices (HetPipe's grouping).

The replicas of a stage step together, so the slowest (or smallest) of them bounds the stage: a
fast rank beside a slow one in the same stage waits for it every step. Placing ranks therefore
first *groups* them ``replicas`` at a time by speed (the fastest together, the slowest together;
this maximises the sum of the groups' slowest speeds, which is what a speed-weighted split can use),
then *orders* the groups along the pipeline: by their lowest rank (the default layout's order,
which keeps a node's ranks together), unless a ``score`` (the predicted slowest stage of the split
that each order would get) finds an order better by more than :data:`BETTER_BY`.

Pure: numbers in, a rank order out (:class:`~lightning_pipe.runtime.topology.Layout`'s ``order``).
Values within :data:`~lightning_pipe.partition.solvers.speeds.EQUAL_WITHIN` of each other count as equal,
so equal devices (and a probe's noise between them) keep the default layout.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_pipe.partition.solvers.costs import Profile
from lightning_pipe.partition.solvers.speeds import EQUAL_WITHIN, all_equal, stage_values
from lightning_pipe.schedules import stage_positions

#: an order other than the default one must predict a slowest stage shorter by this share: moving
#: ranks off their node's neighbours has costs that the prediction does not see, and a profile
#: measured on a busy host has noise of this order between layers of equal cost
BETTER_BY = 0.05

#: pipelines up to this depth try every order of their groups (24 orders); deeper ones try three
EVERY_ORDER_UP_TO = 4


def check_rank_order(order: Any, world_size: int | None = None) -> list[int] | None:
    """``rank_order`` as Python integers: any sequence or 1-D array of integers (numpy's and torch's
    too), naming each global rank once (of ``world_size`` processes, where known); otherwise refused,
    saying what is wrong with it."""
    if order is None:
        return None
    size = f"{world_size} processes" if world_size is not None else "the processes"
    fix = (
        f"give each global rank of {size} once, the ranks of stage 0's replicas first (such as [0, 2, 1, 3] for "
        "ranks 0 and 2 on stage 0 of 2 stages x 2 replicas), or None to place ranks by their speed."
    )
    shown = f"PipelineStrategy(rank_order={order!r})"
    if isinstance(order, (str, bytes, Mapping)) or not isinstance(order, Iterable):
        raise ValueError(f"{shown}: not a list of global ranks; {fix}")
    ranks: list[int] = []
    for rank in order:
        if isinstance(rank, bool) or "bool" in str(getattr(rank, "dtype", "")):
            raise ValueError(f"{shown}: {rank!r} is a truth value, not a global rank; {fix}")
        try:
            ranks.append(operator.index(rank))  # an integer of any kind; a float, even 1.0, is refused
        except TypeError:
            raise ValueError(
                f"{shown}: {rank!r} ({type(rank).__name__}) is not a global rank (an integer); {fix}"
            ) from None
    if world_size is not None and len(ranks) != world_size:
        raise ValueError(f"{shown}: names {len(ranks)} ranks for {world_size} processes; {fix}")
    wrong = {
        "names {} more than once": {r for r in ranks if ranks.count(r) > 1},
        f"names {{}} outside 0..{len(ranks) - 1}": {r for r in ranks if not 0 <= r < len(ranks)},
        "leaves out {}": set(range(len(ranks))) - set(ranks),
    }
    found = [what.format(_ranks(found)) for what, found in wrong.items() if found]
    if found:
        raise ValueError(f"{shown}: {' and '.join(found)}; {fix}")
    return ranks


def _ranks(ranks: set[int]) -> str:
    """``rank 3`` or ``ranks 1, 2``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, sorted(ranks)))


def classes(values: Sequence[float], within: float = EQUAL_WITHIN) -> list[float]:
    """``values`` with those within ``within`` of a larger one set to it (from the largest down),
    so that noise between equal devices does not reorder them."""
    out = list(map(float, values))
    head: float | None = None
    for rank in sorted(range(len(out)), key=lambda r: -out[r]):
        if head is None or out[rank] * (1.0 + within) < head:
            head = out[rank]
        out[rank] = head
    return out


def groups_by_value(values: Sequence[float], replicas: int) -> list[list[int]]:
    """Ranks in groups of ``replicas``, the largest values together (equal classes keep rank order);
    each group's ranks ascending."""
    if len(values) % replicas:
        raise ValueError(f"{len(values)} ranks do not form groups of {replicas}")
    levels = classes(values)
    ranked = sorted(range(len(values)), key=lambda r: (-levels[r], r))
    return [sorted(ranked[i : i + replicas]) for i in range(0, len(ranked), replicas)]


def group_orders(groups: list[list[int]], values: Sequence[float]) -> list[list[list[int]]]:
    """The orders of ``groups`` along the pipeline to try, the default (by lowest rank) first."""
    default = sorted(groups, key=min)
    if len(groups) <= EVERY_ORDER_UP_TO:
        return [list(p) for p in itertools.permutations(default)]
    fastest_first = sorted(default, key=lambda g: -min(values[r] for r in g))
    return [default, fastest_first, fastest_first[::-1]]


def place_ranks(
    values: Sequence[float] | None,
    stages: int,
    replicas: int,
    score: Callable[[list[float]], float] | None = None,
) -> tuple[int, ...]:
    """The rank order (slot ``stage x replicas + replica`` -> global rank) for per-rank ``values``
    (speeds, or free bytes), or ``()`` for the default layout (no values, or all equal).

    ``score``: given each position's value (the least of its ranks'), the predicted cost of the
    split it gets (lower is better); without one, groups keep the default order."""
    if values is None or len(values) != stages * replicas or all_equal(values):
        return ()
    groups = groups_by_value(values, replicas)
    orders = group_orders(groups, values)
    best = orders[0]
    if score is not None and len(orders) > 1:

        def cost(order: list[list[int]]) -> float:
            return score([min(values[r] for r in g) for g in order])

        base = cost(best)
        challenger = min(orders[1:], key=cost)
        if cost(challenger) < (1.0 - BETTER_BY) * base:
            best = challenger
    order = tuple(r for g in best for r in g)
    return () if order == tuple(range(len(order))) else order


def position_load(
    profile: Profile, balance: str, counts: Sequence[int], positions: Sequence[int], in_flight: Sequence[int],
    checkpoint: str,
) -> list[float]:  # fmt: skip
    """Per pipeline position, the seconds (``"time"``) or bytes (``"memory"``) of the stages it holds
    (every copy of a stage: Chimera keeps each twice)."""
    per_stage = (
        profile.stage_seconds(counts, checkpoint)
        if balance == "time"
        else [float(b) for b in profile.stage_bytes(counts, in_flight, checkpoint)]
    )
    out = [0.0] * (max(positions) + 1)
    for stage, position in enumerate(positions):
        out[position] += per_stage[stage % len(counts)]
    return out


@dataclass(frozen=True)
class BalanceTarget:
    """What a measured split is for: the balance, the schedule and the layout that run it.

    Attributes:
        balance: ``"time"`` or ``"memory"``.
        schedule: the schedule's name (it decides the micro-batches each stage keeps in flight).
        recompute: the recompute mode (``"never"``, ``"except_last"``, ``"always"``).
        num_stages: processes per pipeline.
        num_microbatches: micro-batches per step.
        virtual: stages per process (the split is into ``num_stages x virtual`` stages).
        replicas: replicas per pipeline position.
        order: which rank holds which slot (None: placed by the measured speeds or free memory).
    """

    balance: str
    schedule: str
    recompute: str
    num_stages: int
    num_microbatches: int
    virtual: int = 1
    replicas: int = 1
    order: Sequence[int] | None = None


def measured_order(
    profile: Profile,
    values: Sequence[float] | None,
    target: BalanceTarget,
    in_flight: Sequence[int],
    owners: Sequence[bool] | None = None,
) -> tuple[int, ...]:
    """Which rank holds which position for a measured split of ``target`` (:func:`place_ranks`): ranks
    grouped by their ``values``, speeds (``"time"``) or free bytes (``"memory"``), the groups ordered
    by the slowest (or fullest) position each order's split would have; ``()``: the default layout.
    ``in_flight``: per split stage, the micro-batches it holds at once."""
    balance, checkpoint, stages, virtual = target.balance, target.recompute, target.num_stages, target.virtual
    positions = stage_positions(target.schedule, stages, virtual)
    num_split = stages * virtual

    def score(per_position: list[float]) -> float:
        per_stage = stage_values(per_position, positions, num_split)
        speeds, capacities = (per_stage, None) if balance == "time" else (None, per_stage)
        counts = profile.balance(balance, num_split, in_flight, checkpoint, owners, speeds, capacities)
        load = position_load(profile, balance, counts, positions, in_flight, checkpoint)
        return max(x / v for x, v in zip(load, per_position))

    return place_ranks(values, stages, target.replicas, score)


def describe_order(order: Sequence[int], stages: int, replicas: int) -> str:
    """``stage 0 on ranks 0, 2; stage 1 on ranks 1, 3``: where each position sits."""
    ranks = list(order) or list(range(stages * replicas))
    parts = []
    for stage in range(stages):
        held = ranks[stage * replicas : (stage + 1) * replicas]
        parts.append(f"stage {stage} on rank{'s' if len(held) > 1 else ''} {', '.join(map(str, held))}")
    return "; ".join(parts)

"""``balance="time"``/``"memory"`` in the pipeline's setup, before the split.

Every rank profiles the layers at once on its device with the first micro-batch of the run's
first batch (drawn from the DataLoader in setup, since the split must exist before the
optimizers); global rank 0's profile reaches every rank, which solve alike. The caller keeps the
profile for the run (a later setup, such as test after fit, passes it back and reuses it).

Unequal devices: before the split every rank also times a fixed probe on its own device
(``balance="time"``, unless ``rank_speeds`` gives the speeds) and reads its free memory
(``balance="memory"``); the numbers are gathered to every rank (:func:`agreed_resources`) and the
split gives each stage work in proportion to the speed (or room) of the rank holding it (see
:mod:`lightning_pipe.partition.solvers.speeds`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_pipe.partition.measure.profile import Timing, agreed_profile, profile_module
from lightning_pipe.partition.solvers.costs import Profile, in_flight_microbatches
from lightning_pipe.partition.solvers.rank_order import BalanceTarget, describe_order, measured_order
from lightning_pipe.partition.solvers.speeds import (
    EQUAL_WITHIN,
    all_equal,
    check_speeds_for_world,
    free_bytes,
    position_values,
    probe_timings,
    relative,
    speeds_from_timings,
    stage_values,
)
from lightning_pipe.schedules import stage_positions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MeasureInputs:
    """What measuring the layers before the split needs from the run.

    Attributes:
        batch: the run's first batch, on the device the module's tensors are on (drawn when called).
        device: the device to measure on (this rank's).
        is_source: whether this rank's measurement is the one every rank uses (global rank 0).
        broadcast: gives every rank the source rank's object.
        context: the precision's training-step context (autocast under mixed precision).
        optimizers: makes the module's optimizers as the Trainer would (for their state's size and
            update time); none by default.
        gather: gives every rank the list of every global rank's object (an all-gather over the
            world; None: a world of one process).
    """

    batch: Callable[[], Any]
    device: torch.device
    is_source: bool
    broadcast: Callable[[Any], Any]
    context: Callable[[], AbstractContextManager[Any]] = nullcontext
    optimizers: Callable[[], Sequence[Any]] = tuple
    gather: Callable[[Any], list[Any]] | None = None


@dataclass(frozen=True)
class RankResources:
    """Every global rank's speed and free memory, the same on every rank.

    Attributes:
        speeds: relative speed per global rank, rank 0 (whose profile is used) 1.0; None: not asked for.
        free: free bytes per global rank (None entries: unknown); None: not asked for.
        measured: whether the speeds come from the probe (False: given as ``rank_speeds``).
    """

    speeds: list[float] | None = None
    free: list[int | None] | None = None
    measured: bool = False

    def describe(self) -> str:
        """One line for the log and ``plan.txt``: each rank's speed (and free memory)."""
        parts = []
        for rank in range(len(self.speeds or self.free or [])):
            part = f"rank {rank}"
            if self.speeds is not None:
                part += f" {self.speeds[rank]:.2f}"
            free = self.free[rank] if self.free is not None else None
            if free is not None:
                part += f" ({free / 2**30:.1f} GiB free)"
            parts.append(part)
        source = "measured by a probe on each rank" if self.measured else "given as rank_speeds"
        equal = ""
        if self.speeds is not None and all_equal(self.speeds):
            equal = f" (equal within {EQUAL_WITHIN:.0%}: split as for equal devices)"
        return f"rank speeds relative to rank 0, {source}{equal}: " + ", ".join(parts)

    @property
    def known_free(self) -> list[float] | None:
        """Every rank's free bytes, or None where any is unknown (or none was asked for)."""
        free = [float(f) for f in self.free or [] if f is not None]
        return free if self.free is not None and len(free) == len(self.free) else None

    def placed_by(self, balance: str) -> list[float] | None:
        """The per-rank values that place the ranks for ``balance``: speeds for ``"time"`` (and any
        balance where speeds were given), free bytes for ``"memory"``."""
        return self.known_free if balance == "memory" else self.speeds


def agreed_resources(
    gather: Callable[[Any], list[Any]] | None,
    device: torch.device,
    given: Sequence[float] | None,
    world_size: int,
    speeds: bool = True,
    memory: bool = False,
    probe: Callable[[torch.device], Sequence[float]] = probe_timings,
) -> RankResources:
    """Every rank's speed (``speeds``: ``given`` per global rank, else timed with ``probe``'s repeats on
    each rank at once, ranks within the repeats' spread counting as equal) and free memory (``memory``),
    gathered to every rank with ``gather``; every rank calls it. A world of one process measures nothing."""
    if world_size < 2 or gather is None:
        return RankResources()
    if given is not None:
        given = check_speeds_for_world(given, world_size)
    timed = speeds and given is None
    if timed:
        gather(None)  # every rank starts its probe together, so each sees what the others' work costs it
    mine = (probe(device) if timed else None, free_bytes(device) if memory else None)
    everyone = gather(mine)
    found: list[float] | None = None
    if given is not None and speeds:
        found = relative(given)
    elif timed:
        found = relative(speeds_from_timings([e[0] for e in everyone]))
    return RankResources(found, [e[1] for e in everyone] if memory else None, timed)


def split_resources(
    resources: RankResources, schedule: str, stages: int, replicas: int, virtual: int, order: Sequence[int] = ()
) -> tuple[list[float] | None, list[float] | None]:
    """Per stage of the split (``stages x virtual``, as the schedule places them), the speed and the
    free bytes of the rank holding it (the least over its replicas; ranks placed by ``order``, see
    :class:`~lightning_pipe.runtime.topology.Layout`); None where not known."""
    positions = stage_positions(schedule, stages, virtual)
    num_split = stages * virtual

    def per_stage(values: Sequence[float] | None) -> list[float] | None:
        if values is None:
            return None
        return stage_values(position_values(values, stages, replicas, order), positions, num_split)

    return per_stage(resources.speeds), per_stage(resources.known_free)


def measured_balance(
    target: BalanceTarget,
    module: Any,
    layers: nn.Sequential | nn.ModuleList,
    inputs: MeasureInputs,
    profile: Profile | None = None,
    owners: Sequence[bool] | None = None,
    resources: RankResources | None = None,
) -> tuple[list[int], Profile, tuple[int, ...]]:
    """Layer counts per stage for the measured balance of ``target``, the profile they come from
    (``profile`` when given for these layers, else measured) and the rank order they are for
    (``target.order`` when given, else :func:`~lightning_pipe.partition.solvers.rank_order.measured_order`'s);
    with several stages per process the split is into processes x virtual stages, each stage
    holding the micro-batches its schedule keeps in flight there. ``owners``: which layers hold a
    parameter (every stage gets one where they allow it). ``resources``: every rank's speed and free
    memory (:func:`agreed_resources`), which weight the stages."""
    t = target
    in_flight = in_flight_microbatches(t.schedule, t.num_stages, t.num_microbatches, t.virtual)

    def measure() -> Profile:
        return profile_module(
            module,
            layers,
            inputs.batch,
            t.num_microbatches,
            inputs.device,
            Timing(context=inputs.context),
            memory=t.balance == "memory",
            optimizers=inputs.optimizers,
        )

    if profile is None or len(profile.layers) != len(layers):
        profile = agreed_profile(inputs.is_source, inputs.broadcast, measure)
    resources = resources or RankResources()
    order = t.order
    if order is None:
        values = resources.placed_by(t.balance)
        order = measured_order(profile, values, t, in_flight, owners)
    speeds, capacities = split_resources(resources, t.schedule, t.num_stages, t.replicas, t.virtual, order)
    counts = profile.balance(t.balance, len(in_flight), in_flight, t.recompute, owners, speeds, capacities)
    if inputs.is_source:
        log.info("lightning-pipe: balance=%s, %s", t.balance, profile.report(counts, in_flight, t.recompute))
        if resources.speeds is not None or resources.free is not None:
            log.info("lightning-pipe: %s", resources.describe())
        if order:
            placed = describe_order(order, t.num_stages, t.replicas)
            log.info("lightning-pipe: ranks placed by %s: %s", t.balance, placed)
    return counts, profile, tuple(order)

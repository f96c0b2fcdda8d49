"""``balance="time"``/``"memory"`` in the pipeline's setup, before the split.

Every rank profiles the layers at once on its device with the first micro-batch of the run's
first batch (drawn from the DataLoader in setup, since the split must exist before the
optimizers); global rank 0's profile reaches every rank, which solve alike. The caller keeps the
profile for the run (a later setup, such as test after fit, passes it back and reuses it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_pipe.partition.costs import Profile, in_flight_microbatches
from lightning_pipe.partition.profile import agreed_profile, profile_module

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
    """

    batch: Callable[[], Any]
    device: torch.device
    is_source: bool
    broadcast: Callable[[Any], Any]
    context: Callable[[], AbstractContextManager[Any]] = nullcontext
    optimizers: Callable[[], Sequence[Any]] = tuple


def measured_balance(
    schedule: str,
    balance: str,
    checkpoint: str,
    num_stages: int,
    num_microbatches: int,
    virtual: int,
    module: Any,
    layers: nn.Sequential | nn.ModuleList,
    inputs: MeasureInputs,
    profile: Profile | None = None,
    owners: Sequence[bool] | None = None,
) -> tuple[list[int], Profile]:
    """Layer counts per stage for the measured ``balance`` (``"time"`` or ``"memory"``) and the
    profile they come from (``profile`` when given for these layers, else measured); with
    ``virtual`` stages per process the split is into processes x ``virtual`` stages, each stage
    holding the micro-batches its schedule keeps in flight there. ``owners``: which layers hold a
    parameter (every stage gets one where they allow it)."""
    in_flight = in_flight_microbatches(schedule, num_stages, num_microbatches, virtual)

    def measure() -> Profile:
        return profile_module(
            module,
            layers,
            inputs.batch,
            num_microbatches,
            inputs.device,
            inputs.context,
            memory=balance == "memory",
            optimizers=inputs.optimizers,
        )

    if profile is None or len(profile.layers) != len(layers):
        profile = agreed_profile(inputs.is_source, inputs.broadcast, measure)
    counts = profile.balance(balance, len(in_flight), in_flight, checkpoint, owners)
    if inputs.is_source:
        log.info("lightning-pipe: balance=%s, %s", balance, profile.report(counts, in_flight, checkpoint))
    return counts, profile


__all__ = ["MeasureInputs", "measured_balance"]

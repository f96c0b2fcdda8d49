"""``balance="time"``/``"memory"`` for a ``PipelineStrategy`` in its setup, before the split.

Every rank profiles the layers at once on its device with the first micro-batch of the run's
first batch (drawn from the DataLoader in setup, since the split must exist before the
optimizers); global rank 0's profile reaches every rank, which solve alike. The profile is kept
on the strategy for the run (a later setup, such as test after fit, reuses it).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from lightning_pipe.partition.costs import Profile, in_flight_microbatches
from lightning_pipe.partition.profile import agreed_profile, first_batch, profile_module

log = logging.getLogger(__name__)


def measured_balance(strategy: Any, module: Any, layers: nn.Sequential, virtual: int) -> list[int]:
    """Layer counts per stage for the strategy's measured ``balance``; with ``virtual`` stages
    per process the split is into processes x ``virtual`` stages, each stage holding the
    micro-batches its schedule keeps in flight there."""
    trainer = module.trainer
    home = next((t.device for t in module.state_dict().values()), torch.device("cpu"))
    in_flight = in_flight_microbatches(strategy.schedule_name, strategy.num_stages, strategy.num_microbatches, virtual)

    def measure() -> Profile:
        return profile_module(
            module,
            layers,
            lambda: strategy.batch_to_device(first_batch(trainer), home),
            strategy.num_microbatches,
            strategy.root_device,
            strategy.precision_plugin.train_step_context,
            memory=strategy.balance == "memory",
        )

    if strategy.profile is None or len(strategy.profile.layers) != len(layers):
        strategy.profile = agreed_profile(strategy.global_rank == 0, strategy.broadcast, measure)
    profile: Profile = strategy.profile
    balance = profile.balance(str(strategy.balance), len(in_flight), in_flight, strategy.checkpoint_mode)
    if strategy.global_rank == 0:
        log.info("lightning-pipe: balance=%s, %s", strategy.balance, profile.report(balance, in_flight, strategy.checkpoint_mode))
    return balance


__all__ = ["measured_balance"]

"""The learning-rate schedule of the text recipes: linear warm-up, then a linear or cosine decay."""

from __future__ import annotations

import math

import torch

DECAYS = ("linear", "cosine")


def warmup_then_decay(
    optimizer: torch.optim.Optimizer, warmup_steps: int, max_steps: int, decay: str = "linear", floor: float = 0.0
) -> torch.optim.lr_scheduler.LambdaLR:
    """A per-step schedule: the learning rate rises linearly over ``warmup_steps`` to the
    optimizer's, then falls to ``floor`` times it at ``max_steps`` (linearly, or along half a
    cosine) and stays there."""
    if decay not in DECAYS:
        raise ValueError(f"decay={decay!r}: valid decays are {', '.join(DECAYS)}.")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        left = max(0.0, (max_steps - step) / max(1, max_steps - warmup_steps))  # 1 -> 0 after the warm-up
        shape = left if decay == "linear" else 0.5 * (1.0 - math.cos(math.pi * left))
        return floor + (1.0 - floor) * shape

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

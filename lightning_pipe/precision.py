"""Mixed precision across stages.

With ``precision="16-mixed"`` a gradient scaler skips an optimizer step when a gradient holds an
inf or NaN. Each stage's scaler sees only its own gradients, so the stages would skip different
steps and their loss scales would drift apart. :func:`sync_gradient_scaler` makes every stage's
scaler act on the verdict over all stages.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.optim import Optimizer


def sync_gradient_scaler(scaler: "torch.amp.GradScaler", group: Optional[Any] = None) -> None:
    """After ``scaler.unscale_(optimizer)`` finds infs on this stage, agree over all stages (max of
    the flags) before ``scaler.step`` and ``scaler.update`` read them. Idempotent."""
    if getattr(scaler, "_lightning_pipe_synced", False):
        return
    unscale = scaler.unscale_

    def unscale_across_stages(optimizer: Optimizer) -> None:
        unscale(optimizer)
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return
        state = scaler._per_optimizer_states[id(optimizer)]
        found = state["found_inf_per_device"]
        device = next(iter(found.values())).device if found else scaler._scale.device  # type: ignore[union-attr]
        local = torch.zeros((), dtype=torch.float32, device=device)
        for flag in found.values():
            local += flag.to(local.device)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        if local.item() > 0 and not any(flag.item() > 0 for flag in found.values()):
            target = next(iter(found)) if found else device
            found[target] = torch.ones((), dtype=torch.float32, device=device)

    scaler.unscale_ = unscale_across_stages  # type: ignore[method-assign]
    scaler._lightning_pipe_synced = True  # type: ignore[attr-defined]

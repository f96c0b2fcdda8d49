"""Mixed precision across stages.

With ``precision="16-mixed"`` a gradient scaler skips an optimizer step when a gradient holds an
inf or NaN. Each stage's scaler sees only its own gradients, so the stages would skip different
steps and their loss scales would drift apart. :func:`sync_gradient_scaler` makes every stage's
scaler act on the verdict over all stages.

Clipping by norm (``Trainer(gradient_clip_val=...)``) must take the norm over every stage's
gradients: :func:`clip_by_global_norm` gives the precision plugin that clipping.
:func:`across_stages` does both to the Trainer's plugin.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from lightning_pipe.trainer import internals

_SYNCED: weakref.WeakSet[torch.amp.GradScaler] = weakref.WeakSet()  # the scalers already patched


def sync_gradient_scaler(scaler: torch.amp.GradScaler, group: ProcessGroup | None = None) -> None:
    """After ``scaler.unscale_(optimizer)`` finds infs on this stage, agree over all stages (max of
    the flags) before ``scaler.step`` and ``scaler.update`` read them. Idempotent."""
    if scaler in _SYNCED:
        return
    unscale = scaler.unscale_

    def unscale_across_stages(optimizer: Optimizer) -> None:
        unscale(optimizer)
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return
        found = internals.scaler_found_infs(scaler, optimizer)
        device = next(iter(found.values())).device if found else internals.scaler_device(scaler)
        local = torch.zeros((), dtype=torch.float32, device=device)
        for flag in found.values():
            local += flag.to(local.device)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        if not found:  # an optimizer with nothing to step (a frozen stage) still takes the verdict
            found[device] = local.clamp(max=1.0)
        elif local.item() > 0 and not any(flag.item() > 0 for flag in found.values()):
            found[next(iter(found))] = torch.ones((), dtype=torch.float32, device=device)

    internals.replace_unscale(scaler, unscale_across_stages)
    _SYNCED.add(scaler)


class _GlobalNormClipping:
    """Lightning's clip-by-norm hook (``Precision.clip_grad_by_norm``, the method Lightning's own
    ``FSDPPrecision`` overrides) with the norm taken over every stage's gradients; its clip-by-value
    hook on the stage's gradients there are."""

    _lightning_pipe_clip: Callable[[list[Any], int | float], Any]

    def clip_with(self, clip: Callable[[list[Any], int | float], Any]) -> None:
        """Clip by norm with ``clip(parameters, max_norm)`` from now."""
        self._lightning_pipe_clip = clip

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self._lightning_pipe_clip(list(self.main_params(optimizer)), clip_val)  # type: ignore[attr-defined]

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Per element, so each stage clips its own gradients; a stage with none at this update (an
        asynchronous schedule's first updates, before any batch's gradient is due) has nothing to clip,
        where ``torch.nn.utils.clip_grad_value_`` would raise."""
        grads = [p for p in self.main_params(optimizer) if p.grad is not None]  # type: ignore[attr-defined]
        if grads:
            torch.nn.utils.clip_grad_value_(grads, clip_value=clip_val)


def clip_by_global_norm(plugin: Any, clip: Callable[[list[Any], int | float], Any]) -> None:
    """Make ``gradient_clip_val`` (norm) clip ``plugin``'s parameters with ``clip(parameters,
    max_norm)``. The Trainer chose the plugin's class from ``precision=``, so the override comes as
    a subclass of that class (isinstance checks still hold). Idempotent."""
    internals.extend_class(plugin, _GlobalNormClipping)
    plugin.clip_with(clip)


def across_stages(plugin: Any, clip: Callable[[list[Any], int | float], Any]) -> None:
    """The Trainer's precision ``plugin`` over a pipeline: Lightning's clip-by-norm hook clips with
    ``clip`` (the norm over every stage), and its gradient scaler, if any, acts on every stage's verdict."""
    clip_by_global_norm(plugin, clip)
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None:
        sync_gradient_scaler(scaler)

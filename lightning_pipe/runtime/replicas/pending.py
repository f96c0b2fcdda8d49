"""An asynchronous schedule's unapplied gradients across data-parallel replicas, for checkpoints.

Each replica of a stage holds the gradients of its own part of the batches still in flight; they
are averaged over the replicas only when the optimizer step that applies them comes. A checkpoint
therefore keeps every replica's own (gathered to the replica that writes the stage's file), so a
resume under the same number of replicas gives each replica back exactly what it held, and their
mean, which is what a resume under another number of replicas continues from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

Pending = dict[int, dict[str, Tensor | None]]  # batch -> layer name -> gradient (None: no gradient)


def gather_pending(
    pending: Mapping[int, Mapping[str, Tensor | None]], group: ProcessGroup, count: int
) -> list[Pending]:
    """Every replica's ``pending`` (this one's included), in replica order, on every replica of the
    ``group``. The replicas run the same schedule on the same stage, so they hold the same batches
    and names; a difference is a bug, reported rather than silently mixed."""
    keys = [(b, n) for b in sorted(pending) for n in sorted(pending[b]) if pending[b][n] is not None]
    layout = [(int(b), n, tuple(pending[b][n].shape)) for b, n in keys]  # type: ignore[union-attr]
    layouts: list[Any] = [None] * count
    dist.all_gather_object(layouts, layout, group=group)
    if any(other != layout for other in layouts):
        raise RuntimeError(
            "the replicas of a stage hold different unapplied gradients (batches, names or shapes) at a checkpoint; "
            "they run the same schedule and should not: report this with the schedule and layout"
        )
    gathered: list[Pending] = [{b: dict.fromkeys(pending[b]) for b in pending} for _ in range(count)]
    for b, n in keys:
        grad = pending[b][n]
        assert grad is not None
        parts = [torch.empty_like(grad) for _ in range(count)]
        dist.all_gather(parts, grad.contiguous(), group=group)
        for replica, part in enumerate(parts):
            gathered[replica][b][n] = part
    return gathered


def mean_pending(replicas: Sequence[Mapping[int, Mapping[str, Tensor | None]]]) -> Pending:
    """The replicas' mean gradient per batch and name (what their update would apply)."""
    first = replicas[0]
    out: Pending = {}
    for b, grads in first.items():
        out[b] = {}
        for n in grads:
            parts = [r[b][n] for r in replicas]
            out[b][n] = None if any(p is None for p in parts) else torch.stack(parts).mean(0)  # type: ignore[arg-type]
    return out


def pending_for(state: Mapping[str, Any], replica: int, count: int) -> Mapping[int, Mapping[str, Any]]:
    """The pending gradients a replica resumes with: its own where the checkpoint was saved with
    ``count`` replicas, else the saved replicas' mean (``state["pending"]``)."""
    saved = state.get("replica_pending")
    if saved is not None and len(saved) == count:
        return saved[replica]
    return state["pending"]

"""A plain Lightning checkpoint of the unsplit module from a pipeline checkpoint, without processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_pipe.checkpoint.files import read
from lightning_pipe.checkpoint.merged import merged_optimizer_states, merged_state_dict
from lightning_pipe.checkpoint.optimizer_state import optimizer_state_by_position

_PATH = str | Path


def consolidate(path: _PATH, output: _PATH | None = None, weights_only: bool | None = None) -> dict[str, Any]:
    """The full ``state_dict``, and optimizer states by position in the unsplit module's order as
    ``torch.optim`` saves them, every tensor compared with its checksum. Written to ``output`` when
    given; ``LightningModule.load_from_checkpoint`` and ``Trainer.fit(ckpt_path=...)`` without the
    pipeline accept it. The training data's position is left out: it is the pipeline's own order
    (Lightning refuses a loader state for a plain DataLoader)."""
    meta, shards = read(path, weights_only)
    checkpoint = {k: v for k, v in meta.items() if k != "lightning_pipe"}
    fit_loop = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    if isinstance(fit_loop, dict):
        fit_loop.pop("combined_loader", None)
    order = meta.get("lightning_pipe", {}).get("order") or ()
    checkpoint["state_dict"] = {k: v.clone() for k, v in merged_state_dict(shards, order).items()}
    named = merged_optimizer_states(shards)
    if named is not None:
        checkpoint["optimizer_states"] = [
            optimizer_state_by_position(opt, [g["params"] for g in opt["param_groups"]]) for opt in named
        ]
    if output is not None:
        torch.save(checkpoint, output)
    return checkpoint

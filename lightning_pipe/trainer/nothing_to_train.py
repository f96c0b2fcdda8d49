"""A stage with nothing to train still runs its part of every step.

Fine-tuning with a frozen backbone leaves the first stages without a trainable parameter, and the
usual ``AdamW(p for p in self.parameters() if p.requires_grad)`` (or an optimizer over the head
alone) hands such a stage's optimizer an empty list, which torch refuses ("optimizer got an empty
parameter list"). Plain training sees the whole model and never gets there. So while the user's
``configure_optimizers`` runs, an optimizer over nothing is built over one empty parameter group: it
steps nothing, and the stage runs its forwards, the backwards that pass gradients on, the global
norm and the scaler's verdict with the others. Only when no rank's optimizer got a parameter (the
whole model has nothing to train) is torch's refusal raised, on every rank, as plain training
raises it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lightning_pipe.torch_internals import optimizers_over_nothing


def setup_optimizers(setup: Callable[[], None], device: torch.device) -> None:
    """Run ``setup`` (Lightning's ``setup_optimizers``, which calls the user's
    ``configure_optimizers``) letting this stage's optimizer hold no parameter; refuse on every rank
    when no rank's optimizers hold one but one of them was handed an empty list."""
    built: list[Optimizer] = []
    emptied: list[Optimizer] = []
    with optimizers_over_nothing(built, emptied):
        setup()
    held = sum(len(group["params"]) for optimizer in built for group in optimizer.param_groups)
    counts = torch.tensor([held, len(emptied)], dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts)
    if counts[1] > 0 and counts[0] == 0:
        raise ValueError(
            "optimizer got an empty parameter list: configure_optimizers() gave the optimizer no parameter on "
            "any pipeline stage, so the model has nothing to train. Pass the parameters to train (those with "
            "requires_grad=True) to the optimizer."
        )

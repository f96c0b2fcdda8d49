"""How a value logged with ``self.log(..., reduce_fx=...)`` combines over micro-batches and replicas.

Lightning reduces a logged value over an epoch's batches by its ``reduce_fx``: a weighted mean,
the largest, the smallest or the sum. A batch split into micro-batches (and a global batch split
over replicas) has its parts' values combined the same way, so that each batch's value is the one
plain Lightning would have logged for the whole batch. Pure: no Lightning, no torch.distributed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

_REDUCE_FUNCTIONS = {"mean": (torch.mean,), "max": (torch.max, max), "min": (torch.min, min), "sum": (torch.sum, sum)}


def reduction(reduce_fx: Any) -> str:
    """``"mean"``, ``"max"``, ``"min"`` or ``"sum"``: Lightning's reduction for a ``self.log``
    ``reduce_fx`` (a name, ``"avg"``, or ``torch.max`` and the like). Anything else counts as a
    mean here; Lightning refuses it when the batch's value is logged."""
    if isinstance(reduce_fx, str):
        name = reduce_fx.lower()
        return "mean" if name == "avg" else name if name in _REDUCE_FUNCTIONS else "mean"
    return next((name for name, fns in _REDUCE_FUNCTIONS.items() if any(reduce_fx is fn for fn in fns)), "mean")


def combine(how: str, a: float | Tensor, b: float | Tensor) -> float | Tensor:
    """Two values combined by ``how`` (``"sum"``, ``"max"``, ``"min"``); a tensor stays on its device,
    and a NaN is kept, as Lightning's ``torch.max`` keeps it."""
    if how == "sum":
        return a + b
    tensor = next((v for v in (a, b) if isinstance(v, Tensor)), None)
    if tensor is None:  # two numbers; a NaN wins, as in torch.maximum
        return a if a != a or (a >= b if how == "max" else a <= b) else b
    ta, tb = (torch.as_tensor(v, dtype=tensor.dtype, device=tensor.device) for v in (a, b))
    return torch.maximum(ta, tb) if how == "max" else torch.minimum(ta, tb)

"""Each micro-batch's share of a batch's loss: what makes the pipeline's gradient the whole batch's.

The user's step runs once per micro-batch and returns that micro-batch's loss, a mean over the
items it holds. Weighting micro-batch ``i``'s loss by ``n_i / N`` (``n_i`` its items, ``N`` the
batch's) gives the gradient of the whole batch's mean, whatever the split. By default the items
are samples (``n_i`` the micro-batch's size). A language model's loss averages over the tokens
whose label is not ``ignore_index`` (padding, unmasked positions), and micro-batches hold
different numbers of them: with ``loss_weight=token_count(...)`` the items are those tokens, and
the pipeline trains on the batch's token mean, as plain training on the whole batch does.

Every stage loads the batch itself, so the counts come from the batch before the schedule starts,
on the ranks that compute a loss. Pure: no Lightning, no torch.distributed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_pipe.runtime.microbatch import batch_size

#: ``loss_weight(micro_batch) -> number of items its loss averages over`` (an int, float or a 0-d tensor)
LossWeight = Callable[[Any], int | float | Tensor]


@dataclass(frozen=True)
class TokenCount:
    """The number of labels other than ``ignore_index`` in a micro-batch (see :func:`token_count`).
    A frozen value rather than a closure: the strategy is pickled for ``start_method="spawn"``."""

    labels: str | int | None = "labels"
    ignore_index: int = -100
    shift: bool = True

    def __call__(self, batch: Any) -> Tensor:
        labels = self._labels(batch)
        if self.shift:  # a causal LM predicts token t + 1 at position t: the first label has no prediction
            labels = labels[..., 1:]
        return (labels != self.ignore_index).sum()

    def _labels(self, batch: Any) -> Tensor:
        where = self.labels
        if where is None:
            found: Any = batch
        elif isinstance(batch, Mapping) and isinstance(where, str) and where in batch:  # noqa: SIM114 - apart, each branch's index type checks
            found = batch[where]
        elif isinstance(batch, Sequence) and isinstance(where, int) and -len(batch) <= where < len(batch):
            found = batch[where]
        else:
            found = getattr(batch, where, None) if isinstance(where, str) else None
        if not isinstance(found, Tensor):
            kind = (
                f"a mapping with keys {sorted(map(str, batch))}" if isinstance(batch, Mapping) else type(batch).__name__
            )
            raise ValueError(
                f"token_count(labels={where!r}): found no label tensor there in the batch ({kind}). Give the key of "
                "the labels in a dict batch, their index in a tuple batch, or labels=None where the batch is the "
                "label tensor itself (a causal LM trained with labels=input_ids)."
            )
        return found


def token_count(labels: str | int | None = "labels", ignore_index: int = -100, shift: bool = True) -> TokenCount:
    """A ``loss_weight`` for language models whose loss is the mean over the valid tokens (Hugging
    Face's causal and masked LM losses, ``F.cross_entropy(..., ignore_index=-100)``).

    Args:
        labels: where a batch keeps its labels: a key (dict batches, HF style: ``"labels"``), an index
            (tuple batches) or None (the batch is the label tensor: a causal LM trained with
            ``labels=input_ids``).
        ignore_index: the label value the loss leaves out.
        shift: True for a causal LM whose loss shifts the labels itself (HF's ``*ForCausalLM``: the
            first position of each row is never a target); False where every position can be one
            (masked LM, token classification, or labels shifted by the data already).
    """
    if labels is not None and (isinstance(labels, bool) or not isinstance(labels, (str, int))):
        raise TypeError(
            f"token_count(labels={labels!r}): give a key (str), an index (int) or None (the batch is the labels)."
        )
    return TokenCount(labels, ignore_index, shift)


def microbatch_weights(micro: list[Any], loss_weight: LossWeight | None) -> list[float]:
    """Each micro-batch's share ``n_i / N`` of the batch's items: samples (``loss_weight`` None), or
    what ``loss_weight`` counts. A batch without items gives shares of 0 (its mean is NaN, as in
    plain training)."""
    return microbatch_shares(micro, loss_weight)[0]


def microbatch_shares(micro: list[Any], loss_weight: LossWeight | None) -> tuple[list[float], float]:
    """Each micro-batch's share of the batch's items (see :func:`microbatch_weights`) and ``N``, the
    batch's items: what its means average over, and so their weight against other replicas' batches."""
    if loss_weight is None:
        sizes = [batch_size(mb) for mb in micro]
        total = float(sum(sizes))
        return ([n / total for n in sizes] if total else [1.0]), total  # an empty batch: one empty micro-batch
    counts = [loss_weight(mb) for mb in micro]
    tensors = [c for c in counts if isinstance(c, Tensor)]
    if tensors:  # one read back to the host for the step, not one per micro-batch
        device = tensors[0].device
        stacked = torch.stack([torch.as_tensor(c, dtype=torch.float64, device=device).reshape(()) for c in counts])
        values = stacked.tolist()
    else:
        values = [float(c) for c in counts]
    for i, (value, count) in enumerate(zip(values, counts)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(
                f"loss_weight gave {count!r} for micro-batch {i} of {len(micro)}: it must count the items the "
                "micro-batch's loss averages over, a finite number >= 0 (see lightning_pipe.token_count)."
            )
    total = sum(values)
    return [v / total if total else 0.0 for v in values], total


def check_loss_weight(loss_weight: Any) -> None:
    """Refuse a ``loss_weight`` that is neither None, ``"samples"`` nor a callable."""
    if loss_weight is not None and loss_weight != "samples" and not callable(loss_weight):
        raise ValueError(
            f"PipelineStrategy(loss_weight={loss_weight!r}): give a callable micro_batch -> number of items its loss "
            "averages over (lightning_pipe.token_count(...) for language models), or None / 'samples' (the "
            "micro-batch's size)."
        )

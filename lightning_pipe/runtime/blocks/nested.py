"""Nested hidden states across a stage boundary: ``nn.TransformerEncoder``'s fast path.

In evaluation with a padding mask (no gradient, the layers in eval mode), torch's
``nn.TransformerEncoder`` turns its padded input into a nested tensor before its loop (one row per
sample, padding left out) and its layers run fused kernels on it; after the loop it pads the result
again, with zeros. Under ``module=`` its layers every stage computes the same nested input, so the
hidden state that crosses a boundary is nested too. Between stages it travels padded, to the
shape the encoder padded its input from (which depends on the batch's shapes alone, as the transport
requires: the samples' lengths are values), and the receiving stage nests it again to the lengths of
its own nested input, so its layers run on what they run on in plain evaluation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_pipe.torch_internals import nested_from_mask


def lengths(nested: Tensor) -> list[int]:
    """The number of rows of each sample of a nested tensor (batch first)."""
    return [int(row.shape[0]) for row in nested.unbind()]


def padded_for_crossing(nested: Tensor, shapes: Sequence[tuple[int, ...]]) -> Tensor:
    """``nested`` padded with zeros to the last of ``shapes`` (the padded inputs nested tensors were
    built from in this micro-batch's forward) that holds it: same batch, same width, rows for its
    longest sample."""
    sizes = lengths(nested)
    width = tuple(nested.unbind()[0].shape[1:]) if sizes else ()
    for shape in reversed(shapes):
        if shape[0] == len(sizes) and tuple(shape[2:]) == width and shape[1] >= max(sizes, default=0):
            return nested.to_padded_tensor(0.0, shape)
    raise TypeError(
        "A block's hidden state that crosses a pipeline stage boundary is a nested tensor that was not built from a "
        "padding mask in this forward (as nn.TransformerEncoder's fast path builds it); only those cross, padded to "
        "the shape they were built from. Give the blocks padded tensors (and their mask) instead."
    )


def nested_like(received: Tensor, local: Tensor) -> Tensor:
    """The padded hidden state ``received`` from the previous stage, nested as this stage's own nested
    input ``local`` is (the lengths of its samples)."""
    rows = torch.arange(received.shape[1], device=received.device)
    valid = rows.unsqueeze(0) < torch.tensor(lengths(local), device=received.device).unsqueeze(1)
    return nested_from_mask(received, valid)

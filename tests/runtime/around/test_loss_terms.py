"""Which parameters a loss reads other than through the stage's output."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe.runtime.around.loss_terms import ParameterTermRefused, read_directly, refuse_parameter_terms


def test_a_term_on_parameters_is_found_and_the_path_through_the_output_is_not() -> None:
    layer, head = nn.Linear(3, 3), nn.Linear(3, 1)
    named = list(layer.named_parameters())
    out = layer(torch.randn(2, 3))
    assert read_directly(head(out).sum(), [out], named) == []  # through the output; the head is not the layer's
    penalized = head(out).sum() + layer.weight.pow(2).sum()
    assert read_directly(penalized, [out], named) == ["weight"]
    with pytest.raises(ParameterTermRefused, match=r"other than through the pipelined call \(weight\)"):
        refuse_parameter_terms(penalized, [out], named)
    assert read_directly(head(out).sum(), [], named) == ["weight", "bias"]  # without the stop: found inside

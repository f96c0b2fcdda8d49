"""Layers compiled with ``torch.compile`` train under the split-backward schedules (B and W apart) as plain
training does. ``aot_eager`` traces the forward and the backward through AOTAutograd as the default backend
does, without needing a C++ compiler."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.models import TinyNet, fit_plain
from tests.pipeline import assert_same_weights, fit_pipeline, twins


class CompiledNet(TinyNet):
    """TinyNet with every Linear compiled: the model a user writes with ``torch.compile(layer)``."""

    def __init__(self) -> None:
        super().__init__()
        compiled = [torch.compile(m, backend="aot_eager") if isinstance(m, nn.Linear) else m for m in self.layers]
        self.layers = nn.Sequential(*compiled)


@pytest.mark.parametrize("schedule", ["zero_bubble", pytest.param("dualpipev", marks=pytest.mark.slow)])
def test_compiled_layers_train_as_plain_under_the_split_backward_schedules(schedule: str) -> None:
    torch.manual_seed(0)
    reference, piped = twins(CompiledNet())
    assert type(piped.layers[0]).__name__ == "OptimizedModule"  # the compiled wrapper, as the user built it
    fit_plain(reference)
    fit_pipeline(piped, 2, schedule=schedule, chunks=4)
    assert_same_weights(reference, piped)

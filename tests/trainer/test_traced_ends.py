"""The trace of a model's ends leaves the run as it was, and runs only where something lies beside the split layers."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn

from lightning_pipe.config import PipelineConfig
from lightning_pipe.trainer.traced_ends import _untouched, traces_ends


class Own(nn.Module):
    def __init__(self, beside: bool) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.head = nn.Linear(4, 2) if beside else None


def test_a_model_with_nothing_beside_its_split_layers_is_not_traced() -> None:
    """No batch is drawn for nothing to place: a dataset that counts its reads, a sampler on a random state."""
    config = PipelineConfig()
    alone, beside = Own(beside=False), Own(beside=True)
    assert not traces_ends(alone, alone.layers, config, 2)
    assert traces_ends(beside, beside.layers, config, 2)


def test_the_trace_leaves_every_random_state_and_the_buffers_as_they_were() -> None:
    """torch's, Python's (a custom sampler's ``random.shuffle``) and numpy's draws, and batch-norm statistics."""
    module = nn.BatchNorm1d(3)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(())))
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    with _untouched(module, torch.device("cpu")):
        random.random(), np.random.rand(), torch.rand(())
        module(torch.randn(8, 3))  # moves the running statistics
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == expected
    assert torch.equal(module.running_mean, torch.zeros(3)) and torch.equal(module.running_var, torch.ones(3))

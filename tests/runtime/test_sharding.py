"""Which modules ``data_parallel="shard"`` wraps beside a stage's layers, and what it refuses."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_pipe.runtime.replicas.sharding import outside_modules, refuse_shared_units


def test_the_modules_holding_trainable_parameters_outside_the_stage_are_sharded_with_it() -> None:
    model = nn.Module()
    model.embed, model.norm, model.frozen = nn.Embedding(5, 4), nn.LayerNorm(4), nn.Linear(4, 4)
    model.frozen.requires_grad_(False)
    model.stage = nn.Sequential(nn.Linear(4, 4))
    model.head = nn.Linear(4, 5)
    assert outside_modules(model, model.stage) == [model.embed, model.norm, model.head]


def test_a_parameter_held_directly_beside_the_stage_is_refused() -> None:
    model = nn.Module()
    model.stage = nn.Sequential(nn.Linear(4, 4))
    model.scale = nn.Parameter(nn.Linear(1, 1).weight.detach())
    with pytest.raises(ValueError, match="holds one directly and also holds the split layers"):
        outside_modules(model, model.stage)


def test_a_weight_two_units_of_one_process_hold_is_refused() -> None:
    embed, head = nn.Embedding(5, 4), nn.Linear(4, 5, bias=False)
    head.weight = embed.weight
    with pytest.raises(ValueError, match=r"shape \[5, 4\] is held by both Embedding and Linear"):
        refuse_shared_units([embed, nn.Tanh(), head])
    refuse_shared_units([embed, nn.Linear(4, 5)])

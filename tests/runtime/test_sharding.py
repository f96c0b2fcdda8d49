"""Which modules ``data_parallel="shard"`` wraps beside a stage's layers, and what it refuses."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_pipe.runtime.replicas.sharding import outside_modules, refuse_shared_units, shard_units


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


def test_a_weight_two_units_of_one_process_hold_is_refused_naming_their_paths() -> None:
    embed, head = nn.Embedding(5, 4), nn.Linear(4, 5, bias=False)
    head.weight = embed.weight
    with pytest.raises(ValueError, match=r"shape \[5, 4\] is held by both model.embed and lm_head"):
        refuse_shared_units([("model.embed", embed), ("1", nn.Tanh()), ("lm_head", head)])
    refuse_shared_units([("embed", embed), ("head", nn.Linear(4, 5))])


class _Embeddings(nn.Module):
    """As ViT's: a parameter held directly beside a child that holds its own."""

    def __init__(self) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(nn.Linear(4, 1).weight.detach())
        self.patches = nn.Sequential(nn.Conv2d(3, 4, 2))


def test_a_module_and_its_child_are_two_units_the_child_first_not_a_tie() -> None:
    model = nn.Module()
    model.embeddings = _Embeddings()
    model.stage = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model.head = nn.Linear(4, 5)
    units = shard_units(model, model.stage)
    assert [name for name, _ in units] == ["stage.0", "stage.1", "embeddings.patches.0", "embeddings", "head"]
    refuse_shared_units(units)  # the embeddings' unit holds the [CLS] token only


def test_a_parametrized_weight_is_one_parameter_sharded_with_its_module() -> None:
    model = nn.Module()
    model.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 4, 3), dim=2)  # as Wav2Vec2's positional conv
    model.stage = nn.Sequential(nn.Linear(4, 4))
    units = shard_units(model, model.stage)
    assert [(name, module) for name, module in units] == [("stage.0", model.stage[0]), ("conv", model.conv)]
    refuse_shared_units(units)

"""Which modules ``data_parallel="shard"`` wraps beside a stage's layers, and what it refuses."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_pipe.runtime.replicas.sharding import outside_modules, shard_groups, shard_units


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


def test_a_weight_a_layer_shares_with_another_unit_of_its_process_is_refused_naming_their_paths() -> None:
    embed, head = nn.Embedding(5, 4), nn.Linear(4, 5, bias=False)
    head.weight = embed.weight
    with pytest.raises(ValueError, match=r"shape \[5, 4\] is held by both model.embed and lm_head"):
        shard_groups([("model.embed", embed), ("1", nn.Tanh()), ("lm_head", head)], layers=1)
    with pytest.raises(ValueError, match=r"held by both layers.0 and layers.1"):
        shard_groups([("layers.0", embed), ("layers.1", head)], layers=2)
    untied = [("embed", embed), ("head", nn.Linear(4, 5))]
    assert shard_groups(untied, layers=1) == [[u] for u in untied]


def test_modules_outside_the_layers_sharing_a_weight_are_one_unit() -> None:
    """BART's embedding: held by the model's ``shared``, the encoder's and decoder's ``embed_tokens`` and
    the head; outside the split layers they are sharded together, once."""
    shared, encoder, head, norm = nn.Embedding(5, 4), nn.Embedding(5, 4), nn.Linear(4, 5, bias=False), nn.LayerNorm(4)
    encoder.weight = head.weight = shared.weight
    layer = nn.Linear(4, 4)
    units = [("layers.0", layer), ("shared", shared), ("norm", norm), ("encoder.embed_tokens", encoder),
             ("lm_head", head)]  # fmt: skip
    groups = shard_groups(units, layers=1)
    assert [[name for name, _ in group] for group in groups] == [
        ["layers.0"],
        ["shared", "encoder.embed_tokens", "lm_head"],
        ["norm"],
    ]


class _Embeddings(nn.Module):
    """As ViT's: a parameter held directly beside a child that holds its own."""

    def __init__(self) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(nn.Linear(4, 1).weight.detach())
        self.patches = nn.Sequential(nn.Conv2d(3, 4, 2))


def test_a_module_and_its_child_are_one_unit_not_a_tie() -> None:
    """The outer module's forward may read the child's weight without calling it (``nn.MultiheadAttention``
    its ``out_proj``'s): the child is gathered with it (before: its own unit, its weight still sharded in
    the outer forward, "got mixed torch.Tensor and DTensor")."""
    model = nn.Module()
    model.embeddings = _Embeddings()
    model.pool = nn.MultiheadAttention(4, 2, batch_first=True)  # in_proj_weight beside out_proj, a Linear
    model.stage = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model.head = nn.Linear(4, 5)
    units = shard_units(model, model.stage)
    assert [name for name, _ in units] == ["stage.0", "stage.1", "embeddings", "pool", "head"]
    assert len(shard_groups(units, layers=2)) == 5  # no tie: each unit holds its own


def test_a_parametrized_weight_is_one_parameter_sharded_with_its_module() -> None:
    model = nn.Module()
    model.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 4, 3), dim=2)  # as Wav2Vec2's positional conv
    model.stage = nn.Sequential(nn.Linear(4, 4))
    units = shard_units(model, model.stage)
    assert [(name, module) for name, module in units] == [("stage.0", model.stage[0]), ("conv", model.conv)]
    assert len(shard_groups(units, layers=1)) == 2

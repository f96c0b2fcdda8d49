"""The layout's refusals speak of what was split: an nn.Sequential or a block container, and say what to change."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_pipe.assembly.refusals import LayoutRefused, check_async, check_shard


def test_the_asynchronous_schedules_take_parameters_outside_the_split_and_refuse_ties_that_drift() -> None:
    """Parameters outside the split layers are versioned with the stage that uses them; a weight tied
    across stages is still refused where the stages' delays differ."""
    model = nn.Module()
    model.wte = nn.Embedding(4, 2)
    check_async("pipedream", model, [model.wte.weight], False, 2, 4, None, blocks="model.transformer.h")
    check_async("pipedream", model, [model.wte.weight], False, 2, 4, None)
    with pytest.raises(LayoutRefused, match="copies of a weight tied across stages would drift"):
        check_async("pipedream", model, [model.wte.weight], True, 2, 4, None, blocks="model.transformer.h")


def test_shard_takes_parameters_outside_the_split_and_ties_and_refuses_weight_versions() -> None:
    """Parameters outside the split layers and weights tied across stages are sharded with their stage."""
    weight = nn.Parameter(nn.Linear(2, 2).weight.detach())
    check_shard("1f1b", [weight], True, blocks="model.model.layers")
    check_shard("zero_bubble", [weight], False)
    with pytest.raises(LayoutRefused, match="schedule='pipedream' keeps weight versions"):
        check_shard("pipedream", [weight], False, blocks="model.model.layers")

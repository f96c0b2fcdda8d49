"""The refusals of compatibility.py speak of what was split: an nn.Sequential or a block container."""

from __future__ import annotations

import pytest
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_pipe.trainer.compatibility import check_async, check_shard


def test_the_asynchronous_schedules_take_parameters_outside_the_split_and_refuse_ties_that_drift() -> None:
    """Parameters outside the split layers are versioned with the stage that uses them; a weight tied
    across stages is still refused where the stages' delays differ."""
    model = nn.Module()
    model.wte = nn.Embedding(4, 2)
    check_async("pipedream", model, [model.wte.weight], False, 2, 4, None, blocks="model.transformer.h")
    check_async("pipedream", model, [model.wte.weight], False, 2, 4, None)
    with pytest.raises(MisconfigurationException, match="copies of a weight tied across stages would drift"):
        check_async("pipedream", model, [model.wte.weight], True, 2, 4, None, blocks="model.transformer.h")


def test_the_shard_refusal_names_the_block_container() -> None:
    weight = nn.Parameter(nn.Linear(2, 2).weight.detach())
    with pytest.raises(MisconfigurationException) as refused:
        check_shard("1f1b", [weight], True, blocks="model.model.layers")
    message = str(refused.value)
    assert "trainable parameters outside the blocks of the block container 'model.model.layers'" in message
    assert "weights are tied across stages" in message and "split nn.Sequential" not in message
    with pytest.raises(MisconfigurationException, match="outside the split nn.Sequential"):
        check_shard("1f1b", [weight], False)

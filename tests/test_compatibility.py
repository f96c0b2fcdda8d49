"""The refusals of compatibility.py speak of what was split: an nn.Sequential or a block container."""

from __future__ import annotations

import pytest
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_pipe.trainer.compatibility import check_async, check_shard


def test_the_async_refusal_names_the_block_container_and_its_ends() -> None:
    model = nn.Module()
    model.wte = nn.Embedding(4, 2)
    with pytest.raises(MisconfigurationException) as refused:
        check_async("pipedream", model, [model.wte.weight], False, 2, 4, None, blocks="model.transformer.h")
    message = str(refused.value)
    assert "weight versions of the blocks of the block container 'model.transformer.h' only" in message
    assert "outside those blocks (wte.weight)" in message and "embeddings, head and final norm" in message
    assert "nn.Sequential" in message and "Move those layers into the Sequential" not in message
    with pytest.raises(
        MisconfigurationException, match="of the split nn.Sequential only.*Move those layers into the Sequential"
    ):
        check_async("pipedream", model, [model.wte.weight], False, 2, 4, None)


def test_the_shard_refusal_names_the_block_container() -> None:
    weight = nn.Parameter(nn.Linear(2, 2).weight.detach())
    with pytest.raises(MisconfigurationException) as refused:
        check_shard("1f1b", [weight], True, blocks="model.model.layers")
    message = str(refused.value)
    assert "trainable parameters outside the blocks of the block container 'model.model.layers'" in message
    assert "weights are tied across stages" in message and "split nn.Sequential" not in message
    with pytest.raises(MisconfigurationException, match="outside the split nn.Sequential"):
        check_shard("1f1b", [weight], False)
